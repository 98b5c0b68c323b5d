//! The MQTT v5 session over Paho's asynchronous C client. Nothing here blocks the caller:
//! publishes and subscribes are queued in Paho; a connect attempt is waited on by a short-lived
//! feeder thread that reports the outcome (and, on failure, a diagnosis) as an [`MqttEvent`].
//! Paho's own callbacks only forward messages and connection losses into the same channel.

use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use paho_mqtt as paho;

#[derive(Debug)]
pub enum MqttEvent {
    /// A connect attempt ended: `Ok(session_present)` or `Err(why)`.
    Connect(Result<bool, String>),
    /// The connection dropped.
    Lost(String),
    /// The broker handed this client's session to another client with the same client id
    /// (MQTT v5 reason 0x8E): two nodes share one identity (D33).
    TakenOver,
    /// The broker answered a confirmed subscribe (SUBACK: the reason code of each topic, in
    /// order; ≥ 0x80 is a refusal), or it failed.
    Subscribed(Result<Vec<i32>, String>),
    Message {
        topic: String,
        payload: Vec<u8>,
        correlation: Option<Vec<u8>>,
    },
    /// The request with this correlation was not delivered and will not be by sending it
    /// again as it is: `permanent` when it can never fit the broker's limit (it was not sent
    /// at all), else the broker refused it in its PUBACK (an ACL deny, a size limit: MQTT v5
    /// reason ≥ 0x80) without dropping the connection.
    Refused {
        correlation: Vec<u8>,
        why: String,
        permanent: bool,
    },
}

/// Why a publish was not queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotSent {
    /// It can never be sent as it is (too big for the broker, an invalid topic).
    Never(String),
    /// The client could not queue it now (its buffer is full); later may work.
    NotNow(String),
}

/// The size in bytes of an MQTT v5 PUBLISH packet with a topic of `topic` bytes, properties
/// of `props` bytes and a payload of `payload` bytes (what a broker compares with its Maximum
/// Packet Size).
pub fn publish_packet_size(topic: usize, props: usize, payload: usize, qos: i32) -> u64 {
    let n = |x: usize| u64::try_from(x).unwrap_or(u64::MAX);
    let packet_id = if qos > 0 { 2 } else { 0 };
    let remaining = n(topic)
        .saturating_add(2)
        .saturating_add(packet_id)
        .saturating_add(varint_len(n(props)))
        .saturating_add(n(props))
        .saturating_add(n(payload));
    remaining
        .saturating_add(varint_len(remaining))
        .saturating_add(1)
}

/// Bytes of an MQTT variable byte integer holding `n`.
fn varint_len(n: u64) -> u64 {
    match n {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    }
}

/// Bytes of the properties of a request: response topic, correlation data, and the
/// `X-API-Token` user property when there is a token.
pub fn request_props_size(inbox: usize, correlation: usize, token: usize) -> usize {
    let user = if token == 0 {
        0
    } else {
        1usize
            .saturating_add(2)
            .saturating_add("X-API-Token".len())
            .saturating_add(2)
            .saturating_add(token)
    };
    3usize
        .saturating_add(inbox)
        .saturating_add(3)
        .saturating_add(correlation)
        .saturating_add(user)
}

/// Why the MQTT client cannot be set up, or a message can never be sent. Each prints as the
/// line the node shows for it.
#[derive(Debug)]
pub enum MqttError {
    /// `mqtt_host` is not a list of broker addresses (printed after the setting's name).
    Endpoints(EndpointsError),
    /// No broker address at all.
    NoEndpoint,
    /// A packet of `size` bytes and the broker's Maximum Packet Size `limit`.
    TooLarge { size: u64, limit: u32 },
    /// The configured CA file does not exist.
    NoCaFile(PathBuf),
    /// TLS is on and no system CA bundle exists.
    NoCaBundle,
    /// TLS is on and the options name no CA file.
    TlsWithoutCa,
    /// Paho cannot load the CA file.
    CaFile(PathBuf, paho::Error),
    /// Paho cannot create a client for this address.
    Client(String, paho::Error),
    /// Paho refuses the session expiry property.
    SessionExpiry(paho::Error),
}

impl std::fmt::Display for MqttError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MqttError::Endpoints(e) => write!(f, "mqtt_host {e}"),
            MqttError::NoEndpoint => write!(f, "no MQTT broker address is configured"),
            MqttError::TooLarge { size, limit } => write!(
                f,
                "the message is {size} bytes and the broker takes at most {limit} (its Maximum Packet Size); sending it would only make the broker drop the connection"
            ),
            MqttError::NoCaFile(p) => write!(f, "the MQTT CA file {} does not exist", p.display()),
            MqttError::NoCaBundle => write!(
                f,
                "TLS is on but no CA bundle was found (tried {}); install ca-certificates or set CYBERWAVE_MQTT_TLS_CA_CERTS",
                SYSTEM_CA_BUNDLES.join(", ")
            ),
            MqttError::TlsWithoutCa => write!(f, "TLS needs a CA file"),
            MqttError::CaFile(p, e) => write!(f, "CA file {}: {e}", p.display()),
            MqttError::Client(uri, e) => write!(f, "cannot create the MQTT client for {uri}: {e}"),
            MqttError::SessionExpiry(e) => write!(f, "session expiry property: {e}"),
        }
    }
}

impl std::error::Error for MqttError {}

impl From<EndpointsError> for MqttError {
    fn from(e: EndpointsError) -> Self {
        MqttError::Endpoints(e)
    }
}

/// Whether a packet of `size` bytes fits the broker's Maximum Packet Size `limit` (0: the
/// broker named none). `Err` says why not.
pub fn fits(size: u64, limit: u32) -> Result<(), MqttError> {
    if limit == 0 || size <= u64::from(limit) {
        Ok(())
    } else {
        Err(MqttError::TooLarge { size, limit })
    }
}

/// MQTT v5 reason "Packet too large": the message will never fit this broker.
const PACKET_TOO_LARGE: i32 = 0x95;

/// The broker's answer to a publish, as a refusal: `Some((why, permanent))` when it refused it
/// with an MQTT v5 reason code (PUBACK ≥ 0x80; `permanent` when the message is too large to
/// ever fit), `None` for a delivery or a failure of the connection (which the node notices
/// and handles as a loss).
pub fn refusal_of(result: &Result<(), paho::Error>) -> Option<(String, bool)> {
    match result {
        Err(paho::Error::ReasonCode(rc, _)) if (*rc as i32) >= 0x80 => {
            let code = *rc as i32;
            Some((
                format!("the broker refused it: {rc} (MQTT reason {code:#04x})"),
                code == PACKET_TOO_LARGE,
            ))
        }
        _ => None,
    }
}

/// One broker address of `mqtt_host`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    /// `host:port`, with an IPv6 address in brackets.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Why `mqtt_host` is not a list of broker addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointsError {
    /// More than [`MAX_ENDPOINTS`] entries.
    TooMany(usize),
    /// Entry `pos` (from 1) of `count`, as written, and what is wrong with it.
    Entry {
        pos: usize,
        count: usize,
        item: String,
        why: BadEndpoint,
    },
}

impl std::fmt::Display for EndpointsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EndpointsError::TooMany(count) => write!(
                f,
                "lists {count} broker addresses; at most {MAX_ENDPOINTS} are allowed"
            ),
            EndpointsError::Entry {
                count: 1,
                item,
                why,
                ..
            } => write!(f, "{}: {why}", quoted(item)),
            EndpointsError::Entry {
                pos,
                count,
                item,
                why,
            } => write!(f, "entry {pos} ({}) of {count}: {why}", quoted(item)),
        }
    }
}

/// What is wrong with one entry of `mqtt_host`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadEndpoint {
    Empty,
    UnclosedBracket,
    NotIpv6,
    NoPortAfterBracket,
    Ipv6WithoutBrackets,
    NoHost,
    NotAscii,
    HostTooLong,
    NotHostName,
    /// The port as written.
    Port(String),
}

impl std::fmt::Display for BadEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadEndpoint::Empty => {
                write!(
                    f,
                    "empty (expected host[:port], addresses separated by commas)"
                )
            }
            BadEndpoint::UnclosedBracket => {
                write!(f, "an IPv6 address opened with [ is not closed with ]")
            }
            BadEndpoint::NotIpv6 => write!(f, "not an IPv6 address inside [ ]"),
            BadEndpoint::NoPortAfterBracket => {
                write!(f, "expected :port after the ] of an IPv6 address")
            }
            BadEndpoint::Ipv6WithoutBrackets => {
                write!(f, "an IPv6 address goes in brackets, as in [::1]:1883")
            }
            BadEndpoint::NoHost => write!(f, "no host name before the :port"),
            BadEndpoint::NotAscii => write!(
                f,
                "not an ASCII host name (write an internationalised name in its xn-- form)"
            ),
            BadEndpoint::HostTooLong => {
                write!(f, "host name longer than {MAX_HOST_LEN} characters")
            }
            BadEndpoint::NotHostName => write!(
                f,
                "not a host name (letters, digits, '-', '.' and '_' only; no scheme such as tcp://)"
            ),
            BadEndpoint::Port(p) => {
                write!(
                    f,
                    "port {} is not a whole number from 1 to 65535",
                    quoted(p)
                )
            }
        }
    }
}

/// The most broker addresses `mqtt_host` may list.
pub const MAX_ENDPOINTS: usize = 32;
/// The longest DNS name.
const MAX_HOST_LEN: usize = 253;

/// `mqtt_host` as a list of broker addresses: `host[:port]` separated by commas (clustered
/// brokers are reached through several addresses); an entry without a port gets
/// `default_port`; an IPv6 address goes in brackets (`[::1]:1883`). Duplicates are dropped.
pub fn parse_endpoints(list: &str, default_port: u16) -> Result<Vec<Endpoint>, EndpointsError> {
    let count = list.split(',').count();
    if count > MAX_ENDPOINTS {
        return Err(EndpointsError::TooMany(count));
    }
    let mut out: Vec<Endpoint> = Vec::new();
    for (n, item) in list.split(',').enumerate() {
        let pos = n.saturating_add(1);
        let item = item.trim();
        let e = parse_endpoint(item, default_port).map_err(|why| EndpointsError::Entry {
            pos,
            count,
            item: item.to_string(),
            why,
        })?;
        if !out.contains(&e) {
            out.push(e);
        }
    }
    Ok(out)
}

fn parse_endpoint(item: &str, default_port: u16) -> Result<Endpoint, BadEndpoint> {
    if item.is_empty() {
        return Err(BadEndpoint::Empty);
    }
    let (host, port) = if let Some(rest) = item.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or(BadEndpoint::UnclosedBracket)?;
        if host.is_empty()
            || !host
                .chars()
                .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.')
            || !host.contains(':')
        {
            return Err(BadEndpoint::NotIpv6);
        }
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':').ok_or(BadEndpoint::NoPortAfterBracket)?),
        };
        (host, port)
    } else {
        let (h, p) = match item.split_once(':') {
            Some((_, p)) if p.contains(':') => return Err(BadEndpoint::Ipv6WithoutBrackets),
            Some((h, p)) => (h, Some(p)),
            None => (item, None),
        };
        check_host_name(h)?;
        (h, p)
    };
    let port = match port {
        None => default_port,
        Some(p) => Some(p)
            .filter(|p| !p.is_empty() && p.len() <= 5 && p.chars().all(|c| c.is_ascii_digit()))
            .and_then(|p| p.parse::<u16>().ok())
            .filter(|p| *p >= 1)
            .ok_or_else(|| BadEndpoint::Port(p.to_string()))?,
    };
    Ok(Endpoint {
        host: host.to_string(),
        port,
    })
}

/// An entry as an error shows it: quoted, control characters escaped, at most 64 characters.
fn quoted(s: &str) -> String {
    const MAX: usize = 64;
    let head: String = s.chars().take(MAX).collect();
    let more = if s.chars().nth(MAX).is_some() {
        "…"
    } else {
        ""
    };
    format!("\"{}{more}\"", crate::logtext::shown(&head))
}

fn check_host_name(h: &str) -> Result<(), BadEndpoint> {
    if h.is_empty() {
        return Err(BadEndpoint::NoHost);
    }
    if !h.is_ascii() {
        return Err(BadEndpoint::NotAscii);
    }
    if h.len() > MAX_HOST_LEN {
        return Err(BadEndpoint::HostTooLong);
    }
    let ok = h
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
        && !h.starts_with(['-', '.']);
    if !ok {
        return Err(BadEndpoint::NotHostName);
    }
    Ok(())
}

#[derive(Debug, Clone)]
pub struct MqttOptions {
    /// Broker addresses, tried in this order (see [`shuffled`]).
    pub endpoints: Vec<Endpoint>,
    pub tls: bool,
    /// Trust store for TLS; decided by [`trust_store`].
    pub ca_file: Option<PathBuf>,
    pub client_id: String,
    pub username: String,
    pub password: Option<String>,
    pub keep_alive: Duration,
    pub session_expiry: Duration,
    /// How long an attempt waits for the CONNACK (`CYBERWAVE_NODE_CONNECT_TIMEOUT_SECONDS`).
    pub connect_timeout: Duration,
}

/// Standard CA bundles, in the order they are tried (Debian/Ubuntu, RHEL/Fedora, Alpine/macOS,
/// openSUSE). A statically linked OpenSSL knows none of them, so one is always named explicitly.
pub const SYSTEM_CA_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
    "/etc/ssl/ca-bundle.pem",
];

/// The CA file to trust: the configured one, else `SSL_CERT_FILE`, else the first system bundle
/// that exists.
pub fn trust_store(
    configured: Option<&Path>,
    ssl_cert_file: Option<&str>,
) -> Result<PathBuf, MqttError> {
    if let Some(p) = configured {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(MqttError::NoCaFile(p.to_path_buf()))
        };
    }
    if let Some(p) = ssl_cert_file.filter(|p| Path::new(p).is_file()) {
        return Ok(PathBuf::from(p));
    }
    SYSTEM_CA_BUNDLES
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or(MqttError::NoCaBundle)
}

/// `v` in a random order (Fisher–Yates), drawing from `random`: a fleet spreads over the
/// addresses of a cluster instead of all starting on the first.
pub fn shuffled<T>(mut v: Vec<T>, mut random: impl FnMut() -> u64) -> Vec<T> {
    let mut i = v.len();
    while i > 1 {
        let j = usize::try_from(random().checked_rem(i as u64).unwrap_or(0)).unwrap_or(0);
        i = i.saturating_sub(1);
        v.swap(i, j);
    }
    v
}

/// A message kept while the client is disconnected, handed to the next client (see
/// [`Mqtt::start_connect`]).
struct Held {
    msg: paho::Message,
    /// A request's correlation: its PUBACK is watched for.
    correlation: Option<Vec<u8>>,
    /// How often it went to a new client because the last one did not deliver it.
    resends: u32,
}

/// How often a reply or status the connection lost is sent again on the next connection.
const MAX_RESENDS: u32 = 3;

/// The most messages kept while disconnected (the oldest go first).
const MAX_HELD: usize = 10_000;

/// The smallest limit the node learns from drops (log chunks never go below it).
pub const MIN_LEARNED_LIMIT: u32 = 16 * 1024;
/// A drop this soon after a large publish counts as the broker refusing it.
const DROP_WINDOW: Duration = Duration::from_secs(2);

/// A packet limit learned from a broker that enforces one without announcing it in CONNACK
/// (rumqttd, AWS IoT Core-class brokers): it drops the connection right after a publish over
/// it. Two such drops halve the largest message the node sends, down to
/// [`MIN_LEARNED_LIMIT`].
#[derive(Debug, Default)]
pub struct LimitGuess {
    /// The largest publish of the current connection over [`MIN_LEARNED_LIMIT`], and when it
    /// was queued.
    largest: Option<(u64, Instant)>,
    strikes: u32,
    /// The learned limit in bytes (0: none).
    limit: u32,
}

impl LimitGuess {
    /// A publish of `size` bytes was queued at `now`.
    pub fn published(&mut self, size: u64, now: Instant) {
        if size > u64::from(MIN_LEARNED_LIMIT) && self.largest.is_none_or(|(n, _)| size >= n) {
            self.largest = Some((size, now));
        }
    }

    /// A new connection: what was published on the last one no longer counts.
    pub fn connecting(&mut self) {
        self.largest = None;
    }

    /// The connection dropped at `now`. `Some((size, limit))` when this is the second drop
    /// right after a publish over the limit in force: from now on messages are at most
    /// `limit` bytes.
    pub fn dropped(&mut self, now: Instant) -> Option<(u64, u32)> {
        let (size, at) = self.largest.take()?;
        if now.saturating_duration_since(at) > DROP_WINDOW {
            return None;
        }
        self.strikes = self.strikes.saturating_add(1);
        if self.strikes < 2 {
            return None;
        }
        self.strikes = 0;
        let half = u32::try_from(size / 2)
            .unwrap_or(u32::MAX)
            .max(MIN_LEARNED_LIMIT);
        if self.limit != 0 && half >= self.limit {
            return None;
        }
        self.limit = half;
        Some((size, half))
    }

    /// The learned limit (0: none).
    pub fn limit(&self) -> u32 {
        self.limit
    }
}

/// The smaller of two packet limits, 0 meaning none.
fn tighter(a: u32, b: u32) -> u32 {
    match (a, b) {
        (0, x) | (x, 0) => x,
        (a, b) => a.min(b),
    }
}

pub struct Mqtt {
    /// The Paho client of the current (or next) connection attempt. A client that has been
    /// connected is never connected again: [`Mqtt::start_connect`] makes a fresh one.
    client: std::cell::RefCell<paho::AsyncClient>,
    /// Set once the current client has been connected.
    used: Arc<AtomicBool>,
    /// One set of connect options per endpoint (each names only its own address).
    connect_opts: Vec<paho::ConnectOptions>,
    /// Messages published while disconnected, for the next client.
    held: std::cell::RefCell<std::collections::VecDeque<Held>>,
    opts: MqttOptions,
    /// The endpoint of the current (or next) attempt, an index into `opts.endpoints`.
    current: std::cell::Cell<usize>,
    tx: Sender<MqttEvent>,
    /// The broker's Maximum Packet Size from the last CONNACK (0: none named).
    max_packet: Arc<AtomicU32>,
    /// The broker's Maximum QoS from the last CONNACK (2 when it names none).
    max_qos: Arc<AtomicU32>,
    /// A limit the broker enforces without naming it.
    guess: std::cell::RefCell<LimitGuess>,
    /// Requests whose PUBACK the ack thread waits for (a refusal comes back as
    /// `MqttEvent::Refused`).
    acks: Option<Sender<(Vec<u8>, paho::DeliveryToken)>>,
    /// QoS 1 publishes that are not requests (command replies, standalone statuses), watched
    /// until their PUBACK: what a lost connection left undelivered comes back on `undelivered`
    /// and goes to the next client (what Paho would resend on a resumed session).
    inflight: Option<Sender<(Held, paho::DeliveryToken)>>,
    undelivered: crossbeam_channel::Receiver<Held>,
    /// Publishes handed to the watcher and not yet settled.
    unsettled: Arc<AtomicU32>,
    /// Requests are watched like replies and sent again on the next connection (a standalone
    /// node: nothing else sends its workload statuses again).
    resend_requests: std::cell::Cell<bool>,
    /// When the current client's connection was lost.
    lost_at: LostAt,
    /// Publishes refused here for their size, logged at most once a minute.
    too_big: std::cell::RefCell<crate::logtext::Throttle>,
}

/// When the current connection was lost (set by the client's callbacks).
type LostAt = Arc<std::sync::Mutex<Option<Instant>>>;

fn mark_lost(lost_at: &LostAt) {
    if let Ok(mut l) = lost_at.lock() {
        *l = Some(Instant::now());
    }
}

/// A Paho client for `opts`, its callbacks forwarding into `tx`.
fn create_client(
    opts: &MqttOptions,
    tx: &Sender<MqttEvent>,
    lost_at: &LostAt,
) -> Result<paho::AsyncClient, MqttError> {
    let first = opts
        .endpoints
        .first()
        .map(|e| uri(opts, e))
        .ok_or(MqttError::NoEndpoint)?;
    let client = paho::CreateOptionsBuilder::new()
        .server_uri(&first)
        .client_id(&opts.client_id)
        .mqtt_version(paho::MQTT_VERSION_5)
        // The node keeps its own durable outbox; Paho's file persistence would write into
        // the current directory.
        .persistence(None)
        // Publishes while disconnected are held by `Mqtt` itself, never queued in a client
        // that was connected; these only let a fresh client take them before its CONNACK.
        .send_while_disconnected(true)
        .allow_disconnected_send_at_anytime(true)
        .max_buffered_messages(i32::try_from(MAX_HELD).unwrap_or(i32::MAX))
        .delete_oldest_messages(true)
        .create_client()
        .map_err(|e| MqttError::Client(first.clone(), e))?;
    let t = tx.clone();
    client.set_message_callback(move |_, msg| {
        if let Some(msg) = msg {
            let correlation = msg
                .properties()
                .get_binary(paho::PropertyCode::CorrelationData)
                .map(|b| b.to_vec());
            let _ = t.send(MqttEvent::Message {
                topic: msg.topic().to_string(),
                payload: msg.payload().to_vec(),
                correlation,
            });
        }
    });
    let t = tx.clone();
    let l = lost_at.clone();
    client.set_connection_lost_callback(move |_| {
        mark_lost(&l);
        let _ = t.send(MqttEvent::Lost("connection lost".into()));
    });
    let t = tx.clone();
    let l = lost_at.clone();
    client.set_disconnected_callback(move |_, _, reason| {
        mark_lost(&l);
        let _ = t.send(if reason == paho::ReasonCode::SessionTakenOver {
            MqttEvent::TakenOver
        } else {
            let code = reason as i32;
            MqttEvent::Lost(format!(
                "the broker disconnected the node: {code:#04x} {}",
                reason_name(code)
            ))
        });
    });
    Ok(client)
}

fn uri(opts: &MqttOptions, e: &Endpoint) -> String {
    let scheme = if opts.tls { "ssl" } else { "tcp" };
    format!("{scheme}://{}", e.authority())
}

impl Mqtt {
    pub fn new(opts: MqttOptions, tx: Sender<MqttEvent>) -> Result<Mqtt, MqttError> {
        let lost_at: LostAt = Arc::new(std::sync::Mutex::new(None));
        let client = create_client(&opts, &tx, &lost_at)?;
        let mut connect_opts = Vec::with_capacity(opts.endpoints.len());
        for e in &opts.endpoints {
            connect_opts.push(connect_options(&opts, &uri(&opts, e))?);
        }
        let (undelivered_tx, undelivered) = crossbeam_channel::unbounded();
        let unsettled = Arc::new(AtomicU32::new(0));
        let inflight = match start_inflight_thread(undelivered_tx, unsettled.clone(), tx.clone()) {
            Ok(t) => Some(t),
            Err(e) => {
                log::warn!("cannot start the MQTT delivery thread ({e}); a reply in flight when the connection drops is not sent again");
                None
            }
        };
        let acks = match start_ack_thread(tx.clone()) {
            Ok(a) => Some(a),
            Err(e) => {
                log::warn!("cannot start the MQTT acknowledgement thread ({e}); a request the broker refuses is noticed only by its timeout");
                None
            }
        };
        Ok(Mqtt {
            client: std::cell::RefCell::new(client),
            used: Arc::new(AtomicBool::new(false)),
            connect_opts,
            held: std::cell::RefCell::new(std::collections::VecDeque::new()),
            opts,
            current: std::cell::Cell::new(0),
            tx,
            max_packet: Arc::new(AtomicU32::new(0)),
            max_qos: Arc::new(AtomicU32::new(2)),
            guess: std::cell::RefCell::new(LimitGuess::default()),
            acks,
            inflight,
            undelivered,
            unsettled,
            resend_requests: std::cell::Cell::new(false),
            lost_at,
            too_big: std::cell::RefCell::new(crate::logtext::Throttle::default()),
        })
    }

    fn client(&self) -> paho::AsyncClient {
        self.client.borrow().clone()
    }

    /// The largest packet the node sends: the broker's Maximum Packet Size (MQTT v5 CONNACK),
    /// or less when the broker showed a smaller limit by dropping the connection.
    pub fn max_packet_size(&self) -> Option<u32> {
        Some(self.limit()).filter(|n| *n > 0)
    }

    fn limit(&self) -> u32 {
        let learned = self.guess.try_borrow().map(|g| g.limit()).unwrap_or(0);
        tighter(self.max_packet.load(Ordering::Relaxed), learned)
    }

    /// The last connection is gone (checked before the next connect, so a connection closed
    /// right after its CONNACK counts too): a drop right after a large publish, twice, halves
    /// the largest message the node sends from now on (said once, with the size).
    fn connection_dropped(&self) {
        let at = self
            .lost_at
            .lock()
            .ok()
            .and_then(|mut l| l.take())
            .unwrap_or_else(Instant::now);
        let learned = self
            .guess
            .try_borrow_mut()
            .ok()
            .and_then(|mut g| g.dropped(at));
        if let Some((size, limit)) = learned {
            log::warn!(
                "the broker dropped the connection right after a publish of {size} bytes, twice: it enforces a packet size limit it did not announce; the node now sends messages of at most {limit} bytes"
            );
        }
    }
    /// Says, at most once a minute, that a message (`what`: "to TOPIC", "a log chunk of …")
    /// was not sent because it cannot be (too big, an invalid topic).
    pub fn log_too_big(&self, what: &str, why: &str) {
        let held = self
            .too_big
            .try_borrow_mut()
            .ok()
            .and_then(|mut t| t.ready(Instant::now()));
        if let Some(held) = held {
            let more = if held > 0 {
                format!(" ({held} more since the last such line)")
            } else {
                String::new()
            };
            log::error!("not publishing {what}: {why}{more}");
        }
    }

    fn current_endpoint(&self) -> Option<&Endpoint> {
        self.opts.endpoints.get(self.current.get())
    }

    /// The broker of the current (or next) attempt.
    pub fn endpoint(&self) -> String {
        format!(
            "{}{}",
            self.current_endpoint()
                .map(Endpoint::authority)
                .unwrap_or_default(),
            if self.opts.tls { " (TLS)" } else { "" }
        )
    }

    /// How many broker addresses the node knows.
    pub fn endpoint_count(&self) -> usize {
        self.opts.endpoints.len()
    }

    /// The attempt on the current endpoint failed or its connection was lost: the next attempt
    /// goes to the next address (round the list, in the order chosen at start).
    pub fn next_endpoint(&self) {
        let n = self.opts.endpoints.len().max(1);
        self.current.set(
            self.current
                .get()
                .saturating_add(1)
                .checked_rem(n)
                .unwrap_or(0),
        );
    }

    /// Starts one connect attempt; its outcome arrives as `MqttEvent::Connect`.
    ///
    /// Never with a clean session, and never on a client that has been connected: Paho C frees
    /// its in-flight QoS 1 messages on a CONNACK when the connect asked for a clean session or
    /// the broker kept none (`MQTTAsync_cleanSession`), the path of its open double-free reports
    /// (eclipse/paho.mqtt.c #1532, #1621, #1622, #1459). A fresh client has nothing in flight at
    /// its first CONNACK (Paho sends no queued publish before it); the old one is destroyed
    /// while disconnected (`MQTTAsync_destroy` cleans no session for a v5 client with a session
    /// expiry). What the old one had in flight the node sends again itself; what was
    /// published while disconnected was held here and goes to the new client.
    pub fn start_connect(&self) {
        if self.used.load(Ordering::SeqCst) {
            self.connection_dropped();
            match create_client(&self.opts, &self.tx, &self.lost_at) {
                Ok(fresh) => {
                    let old = self.client.replace(fresh);
                    self.used.store(false, Ordering::SeqCst);
                    // Destroying it fails what it still had in flight (Paho calls each
                    // one's failure callback); the watcher hands those back at once.
                    drop(old);
                    self.take_undelivered();
                }
                Err(e) => {
                    let _ = self.tx.send(MqttEvent::Connect(Err(e.to_string())));
                    return;
                }
            }
        }
        if let Ok(mut g) = self.guess.try_borrow_mut() {
            g.connecting();
        }
        let Some(copts) = self.connect_opts.get(self.current.get()) else {
            let _ = self
                .tx
                .send(MqttEvent::Connect(Err("no MQTT broker address".into())));
            return;
        };
        let client = self.client();
        self.release_held(&client);
        let copts = copts.clone();
        let tx = self.tx.clone();
        let opts = self.opts.clone();
        let endpoint = self.current_endpoint().cloned();
        let max_packet = self.max_packet.clone();
        let max_qos = self.max_qos.clone();
        let used = self.used.clone();
        let timeout = self.opts.connect_timeout;
        let watchdog = timeout.saturating_add(Duration::from_secs(15));
        let spawned = std::thread::Builder::new()
            .name("mqtt-connect".into())
            .spawn(move || {
                // Started here, not on the loop: Paho resolves the broker's name holding the
                // lock every call into it takes, so a slow DNS would stall the caller.
                let started = Instant::now();
                let token = client.connect(copts);
                // Paho ends the attempt itself after the connect timeout; this bound only
                // makes sure the node never waits on an attempt whose outcome never comes.
                let outcome = match token.wait_for(watchdog) {
                    Ok(rsp) => {
                        used.store(true, Ordering::SeqCst);
                        // Known before the loop hears of the connection, so before it sends.
                        let props = rsp.properties();
                        let limit = props
                            .get_int(paho::PropertyCode::MaximumPacketSize)
                            .and_then(|n| u32::try_from(n).ok())
                            .unwrap_or(0);
                        max_packet.store(limit, Ordering::Relaxed);
                        let qos = props
                            .get_int(paho::PropertyCode::MaximumQos)
                            .and_then(|n| u32::try_from(n).ok())
                            .unwrap_or(2);
                        max_qos.store(qos, Ordering::Relaxed);
                        Ok(rsp
                            .connect_response()
                            .map(|c| c.session_present)
                            .unwrap_or(false))
                    }
                    Err(e) => {
                        // Never connected: it holds nothing in flight, and what waits in it
                        // goes out on its next attempt.
                        let elapsed = started.elapsed();
                        Err(match &endpoint {
                            Some(ep) => diagnose(&opts, ep, &e, elapsed),
                            None => e.to_string(),
                        })
                    }
                };
                let _ = tx.send(MqttEvent::Connect(outcome));
            });
        if let Err(e) = spawned {
            let _ = self.tx.send(MqttEvent::Connect(Err(format!(
                "cannot start a thread: {e}"
            ))));
        }
    }

    /// Hands the messages published while disconnected to `client` (sent after its CONNACK).
    fn release_held(&self, client: &paho::AsyncClient) {
        let held: Vec<Held> = match self.held.try_borrow_mut() {
            Ok(mut h) => h.drain(..).collect(),
            Err(_) => return,
        };
        for h in held {
            let size = publish_packet_size(
                h.msg.topic().len(),
                if h.correlation.is_some() { 1024 } else { 0 },
                h.msg.payload().len(),
                h.msg.qos() as i32,
            );
            if fits(size, self.limit()).is_err() {
                // Too big for what the broker showed it takes (a request is failed by its
                // timeout and handled there).
                continue;
            }
            if let Ok(mut g) = self.guess.try_borrow_mut() {
                g.published(size, Instant::now());
            }
            match client.try_publish(h.msg) {
                Ok(token) => self.track(token, h.correlation, h.resends),
                Err(e) => log::warn!("could not queue a held message: {e}"),
            }
        }
    }

    /// What the destroyed client left undelivered, held for the next one (each message at
    /// most [`MAX_RESENDS`] times: one the broker drops the connection for is not resent for
    /// ever). Waits at most 200 ms for the watcher to settle them.
    fn take_undelivered(&self) {
        let end = crate::util::later(Instant::now(), Duration::from_millis(200));
        while self.unsettled.load(Ordering::SeqCst) > 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(2));
        }
        for mut h in self.undelivered.try_iter() {
            h.resends = h.resends.saturating_add(1);
            if h.resends > MAX_RESENDS {
                log::warn!(
                    "a message for {} was not delivered after {MAX_RESENDS} connections; dropped",
                    crate::logtext::shown(&redact_topic(h.msg.topic()))
                );
                continue;
            }
            if let Ok(mut held) = self.held.try_borrow_mut() {
                held.push_back(h);
            }
        }
    }

    /// Requests are sent again on the next connection when the one they went out on is lost
    /// before their PUBACK (for a standalone node, whose statuses nothing else resends).
    pub fn resend_requests(&self) {
        self.resend_requests.set(true);
    }

    /// Hands a publish's token to whoever waits for its PUBACK: a request's to the ack
    /// thread (refusals come back as `MqttEvent::Refused`), unless requests are resent; the
    /// rest (and resent requests) to the watcher.
    fn track(&self, token: paho::DeliveryToken, correlation: Option<Vec<u8>>, resends: u32) {
        match correlation {
            Some(c) if !self.resend_requests.get() => {
                if let Some(acks) = &self.acks {
                    let _ = acks.send((c, token));
                }
            }
            c => self.watch(token, resends, c),
        }
    }

    /// Watches a QoS 1 publish until its PUBACK (see `inflight`).
    fn watch(&self, token: paho::DeliveryToken, resends: u32, correlation: Option<Vec<u8>>) {
        let Some(tx) = &self.inflight else {
            return;
        };
        if token.message().qos() == paho::QoS::AtMostOnce {
            return;
        }
        let held = Held {
            msg: token.message().clone(),
            correlation,
            resends,
        };
        self.unsettled.fetch_add(1, Ordering::SeqCst);
        if tx.send((held, token)).is_err() {
            self.unsettled.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Keeps `msg` for the next client.
    fn hold(&self, msg: paho::Message, correlation: Option<Vec<u8>>) {
        if let Ok(mut h) = self.held.try_borrow_mut() {
            if h.len() >= MAX_HELD {
                h.pop_front();
            }
            h.push_back(Held {
                msg,
                correlation,
                resends: 0,
            });
        }
    }

    /// Whether the client holds a live connection now (the truth `status` reports, D34).
    pub fn is_connected(&self) -> bool {
        self.client.borrow().is_connected()
    }

    /// Queues a publish; never waits. A topic no broker would accept, or a message over the
    /// broker's Maximum Packet Size, is never sent (D34): the broker would drop the connection.
    pub fn publish(&self, topic: &str, payload: Vec<u8>, qos: i32, props: paho::Properties) {
        // Replies, without properties; a reserve for any others.
        let props_len = if props.is_empty() { 0 } else { 1024 };
        match self.queue(topic, payload, qos, props, props_len, Some(None)) {
            Ok(Some(token)) => self.watch(token, 0, None),
            Ok(None) => {}
            Err(NotSent::Never(why)) => self.log_too_big(
                &format!("to {}", crate::logtext::shown(&redact_topic(topic))),
                &why,
            ),
            Err(NotSent::NotNow(why)) => log::warn!("{why}"),
        }
    }

    fn check(
        &self,
        topic: &str,
        props_len: usize,
        payload: usize,
        qos: i32,
    ) -> Result<u64, NotSent> {
        if !crate::protocol::topics::publishable(topic) {
            return Err(NotSent::Never("the topic is invalid".into()));
        }
        let size = publish_packet_size(topic.len(), props_len, payload, qos);
        fits(size, self.limit()).map_err(|e| NotSent::Never(e.to_string()))?;
        Ok(size)
    }

    /// Queues `payload` for `topic` in the client, or, while disconnected and `hold` is
    /// `Some(correlation)`, keeps it for the next client (`Ok(None)`). QoS is capped at the
    /// broker's Maximum QoS.
    fn queue(
        &self,
        topic: &str,
        payload: Vec<u8>,
        qos: i32,
        props: paho::Properties,
        props_len: usize,
        hold: Option<Option<&[u8]>>,
    ) -> Result<Option<paho::DeliveryToken>, NotSent> {
        let max_qos = i32::try_from(self.max_qos.load(Ordering::Relaxed)).unwrap_or(2);
        let qos = qos.min(max_qos).max(0);
        let size = self.check(topic, props_len, payload.len(), qos)?;
        let msg = paho::MessageBuilder::new()
            .topic(topic)
            .payload(payload)
            .qos(qos)
            .properties(props)
            .finalize();
        let client = self.client();
        if self.used.load(Ordering::SeqCst) && !client.is_connected() {
            // Never into a client that was connected: it is replaced before the next connect.
            return match hold {
                Some(correlation) => {
                    self.hold(msg, correlation.map(<[u8]>::to_vec));
                    Ok(None)
                }
                None => Err(NotSent::NotNow(format!(
                    "not connected: a message for {} waits",
                    crate::logtext::shown(&redact_topic(topic))
                ))),
            };
        }
        if let Ok(mut g) = self.guess.try_borrow_mut() {
            g.published(size, Instant::now());
        }
        client.try_publish(msg).map(Some).map_err(|e| {
            NotSent::NotNow(format!(
                "could not queue a message for {}: {e}",
                crate::logtext::shown(&redact_topic(topic))
            ))
        })
    }

    /// A v5 request: response topic, correlation data and the `X-API-Token` user property.
    /// A request that cannot be sent, or that the broker refuses, comes back as
    /// `MqttEvent::Refused` with its correlation.
    pub fn publish_request(
        &self,
        topic: &str,
        payload: Vec<u8>,
        inbox: &str,
        correlation: &[u8],
        token: &str,
    ) {
        let mut props = paho::Properties::new();
        let ok = props
            .push_string(paho::PropertyCode::ResponseTopic, inbox)
            .is_ok()
            && props
                .push_binary(paho::PropertyCode::CorrelationData, correlation.to_vec())
                .is_ok()
            && (token.is_empty()
                || props
                    .push_string_pair(paho::PropertyCode::UserProperty, "X-API-Token", token)
                    .is_ok());
        if !ok {
            log::warn!(
                "could not build request properties for {}",
                redact_topic(topic)
            );
        }
        let props_len = request_props_size(inbox.len(), correlation.len(), token.len());
        match self.queue(topic, payload, 1, props, props_len, Some(Some(correlation))) {
            Ok(Some(t)) => self.track(t, Some(correlation.to_vec()), 0),
            Ok(None) => {}
            Err(NotSent::Never(why)) => {
                let _ = self.tx.send(MqttEvent::Refused {
                    correlation: correlation.to_vec(),
                    why,
                    permanent: true,
                });
            }
            // Its timeout retries it.
            Err(NotSent::NotNow(why)) => log::warn!("{why}"),
        }
    }

    /// A QoS 1 publish whose broker acknowledgement (PUBACK) the caller wants to know of;
    /// `NotNow` while disconnected.
    pub fn publish_tracked(
        &self,
        topic: &str,
        payload: Vec<u8>,
    ) -> Result<paho::DeliveryToken, NotSent> {
        let r = self.queue(topic, payload, 1, paho::Properties::new(), 0, None);
        match r {
            Ok(Some(t)) => Ok(t),
            Ok(None) => Err(NotSent::NotNow("not connected".into())),
            Err(NotSent::NotNow(why)) => {
                log::warn!("{why}");
                Err(NotSent::NotNow(why))
            }
            Err(e) => Err(e),
        }
    }

    pub fn subscribe(&self, topics: &[String]) {
        if topics.is_empty() {
            return;
        }
        let qos = vec![1; topics.len()];
        // Queued; a failure shows up as a lost connection, which re-subscribes.
        drop(self.client().subscribe_many(topics, &qos));
    }

    /// Subscribes and reports the broker's SUBACK as `MqttEvent::Subscribed`: the reason code
    /// of each topic, in order (a feeder thread waits for it; the caller never does).
    pub fn subscribe_confirmed(&self, topics: &[String]) {
        let qos = vec![1; topics.len()];
        let token = self.client().subscribe_many(topics, &qos);
        let tx = self.tx.clone();
        let n = topics.len();
        let spawned = std::thread::Builder::new()
            .name("mqtt-suback".into())
            .spawn(move || {
                let result = match token.wait_for(Duration::from_secs(10)) {
                    Ok(rsp) => Ok(rsp
                        .subscribe_many_response()
                        .filter(|codes| codes.len() == n)
                        .unwrap_or_else(|| vec![1; n])),
                    // Paho reports a SUBACK of one refused topic as a failure.
                    Err(paho::Error::ReasonCode(rc, _)) if n == 1 => Ok(vec![rc as i32]),
                    Err(e) => Err(e.to_string()),
                };
                let _ = tx.send(MqttEvent::Subscribed(result));
            });
        if let Err(e) = spawned {
            let _ = self.tx.send(MqttEvent::Subscribed(Err(format!(
                "cannot start a thread: {e}"
            ))));
        }
    }

    pub fn unsubscribe(&self, topic: &str) {
        drop(self.client().unsubscribe(topic));
    }

    /// Sends DISCONNECT and waits at most `timeout` (shutdown only).
    pub fn disconnect(&self, timeout: Duration) {
        let client = self.client();
        if client.is_connected() {
            let _ = client.disconnect(None).wait_for(timeout);
        }
    }
}

/// Waits, in order and off the event loop, for the outcome of each watched publish and sends
/// back (on `undelivered`) those the client failed without a PUBACK refusal: a connection lost
/// or a client destroyed with them in flight.
fn start_inflight_thread(
    undelivered: Sender<Held>,
    unsettled: Arc<AtomicU32>,
    events: Sender<MqttEvent>,
) -> std::io::Result<Sender<(Held, paho::DeliveryToken)>> {
    let (tx, rx) = crossbeam_channel::unbounded::<(Held, paho::DeliveryToken)>();
    std::thread::Builder::new()
        .name("mqtt-inflight".into())
        .spawn(move || {
            for (held, token) in rx {
                let result = token.wait_for(Duration::from_secs(60)).map(|_| ());
                match refusal_of(&result) {
                    Some((why, permanent)) => {
                        // A request the broker refused: the session hears of it.
                        if let Some(correlation) = held.correlation {
                            let _ = events.send(MqttEvent::Refused {
                                correlation,
                                why,
                                permanent,
                            });
                        }
                    }
                    // Lost with its connection (or its client): for the next client.
                    None if result.is_err() && undelivered.send(held).is_err() => return,
                    None => {}
                }
                let _ = unsettled.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    Some(n.saturating_sub(1))
                });
            }
        })?;
    Ok(tx)
}

/// Waits, in order and off the event loop, for the PUBACK of each request, and reports the
/// ones the broker refused as `MqttEvent::Refused`.
fn start_ack_thread(
    events: Sender<MqttEvent>,
) -> std::io::Result<Sender<(Vec<u8>, paho::DeliveryToken)>> {
    let (tx, rx) = crossbeam_channel::unbounded::<(Vec<u8>, paho::DeliveryToken)>();
    std::thread::Builder::new()
        .name("mqtt-pubacks".into())
        .spawn(move || {
            for (correlation, token) in rx {
                // A token of a lost connection fails (or is resent after the reconnect and
                // answered then); a minute is far beyond any PUBACK.
                let result = token.wait_for(Duration::from_secs(60)).map(|_| ());
                if let Some((why, permanent)) = refusal_of(&result) {
                    let refused = MqttEvent::Refused {
                        correlation,
                        why,
                        permanent,
                    };
                    if events.send(refused).is_err() {
                        return;
                    }
                }
            }
        })?;
    Ok(tx)
}

/// CONNECT options naming only `uri` (Paho tries the addresses of a list itself, in order and
/// at once; the node wants its own order, backoff and jitter between them).
fn connect_options(opts: &MqttOptions, uri: &str) -> Result<paho::ConnectOptions, MqttError> {
    let mut props = paho::Properties::new();
    // At least 1 s: with a session expiry of 0 Paho cleans the session (frees what is in
    // flight) on every connection loss, the path of its double-free reports.
    let expiry = u32::try_from(opts.session_expiry.as_secs())
        .unwrap_or(u32::MAX)
        .max(1);
    props
        .push_u32(paho::PropertyCode::SessionExpiryInterval, expiry)
        .map_err(MqttError::SessionExpiry)?;
    let mut b = paho::ConnectOptionsBuilder::new_v5();
    b.server_uris(&[uri])
        .keep_alive_interval(opts.keep_alive)
        // D15: resume the broker session (queued QoS 1 commands); never a clean start (see
        // `Mqtt::start_connect`).
        .clean_start(false)
        .properties(props)
        .connect_timeout(opts.connect_timeout);
    if !opts.username.is_empty() {
        b.user_name(&opts.username);
    }
    if let Some(p) = opts.password.as_deref().filter(|p| !p.is_empty()) {
        b.password(p);
    }
    if opts.tls {
        let ca = opts.ca_file.clone().ok_or(MqttError::TlsWithoutCa)?;
        let ssl = paho::SslOptionsBuilder::new()
            .trust_store(&ca)
            .map_err(|e| MqttError::CaFile(ca.clone(), e))?
            .enable_server_cert_auth(true)
            .verify(true) // host-name verification: Paho skips it without this
            .finalize();
        b.ssl_options(ssl);
    } else {
        // Without SSL options Paho C prints "checking tcp://…" on stdout for every connect
        // (MQTTAsync_connect), the stream that mirrors workload output. They do nothing for a
        // tcp:// address.
        b.ssl_options(paho::SslOptions::default());
    }
    Ok(b.finalize())
}

/// Hides the token inside an R1 topic.
pub fn redact_topic(topic: &str) -> String {
    match topic.find("cloud-node-token/") {
        Some(i) => {
            let (head, rest) = topic
                .split_at_checked(i.saturating_add("cloud-node-token/".len()))
                .unwrap_or((topic, ""));
            let end = rest.find('/').unwrap_or(rest.len());
            let (token, tail) = rest.split_at_checked(end).unwrap_or((rest, ""));
            format!("{head}{}{tail}", crate::util::mask_secret(token))
        }
        None => topic.to_string(),
    }
}

/// The name the MQTT v5 specification gives a reason code.
pub fn reason_name(code: i32) -> &'static str {
    match code {
        0x00 => "Success",
        0x01 => "Granted QoS 1",
        0x02 => "Granted QoS 2",
        0x04 => "Disconnect with Will Message",
        0x10 => "No matching subscribers",
        0x80 => "Unspecified error",
        0x81 => "Malformed Packet",
        0x82 => "Protocol Error",
        0x83 => "Implementation specific error",
        0x84 => "Unsupported Protocol Version",
        0x85 => "Client Identifier not valid",
        0x86 => "Bad User Name or Password",
        0x87 => "Not authorized",
        0x88 => "Server unavailable",
        0x89 => "Server busy",
        0x8A => "Banned",
        0x8B => "Server shutting down",
        0x8C => "Bad authentication method",
        0x8D => "Keep Alive timeout",
        0x8E => "Session taken over",
        0x8F => "Topic Filter invalid",
        0x90 => "Topic Name invalid",
        0x91 => "Packet Identifier in use",
        0x93 => "Receive Maximum exceeded",
        0x94 => "Topic Alias invalid",
        0x95 => "Packet too large",
        0x96 => "Message rate too high",
        0x97 => "Quota exceeded",
        0x98 => "Administrative action",
        0x99 => "Payload format invalid",
        0x9A => "Retain not supported",
        0x9B => "QoS not supported",
        0x9C => "Use another server",
        0x9D => "Server moved",
        0x9E => "Shared Subscriptions not supported",
        0x9F => "Connection rate exceeded",
        0xA0 => "Maximum connect time",
        0xA1 => "Subscription Identifiers not supported",
        0xA2 => "Wildcard Subscriptions not supported",
        _ => "unknown reason",
    }
}

/// What a CONNACK reason means for the operator.
fn connack_hint(code: i32) -> &'static str {
    match code {
        0x84 => ": the broker does not speak MQTT v5, which the node needs",
        0x86 | 0x87 | 0x8C => {
            ": the broker rejected the credentials (check the API token / MQTT username and password)"
        }
        0x85 => ": the broker rejected the client id",
        0x88 | 0x89 | 0x9F => ": the broker is unavailable or busy; the node retries",
        0x8A => ": the broker banned this client",
        0x9C | 0x9D => ": the broker sends the node to another server",
        _ => "",
    }
}

/// Why a connect attempt failed, in words an operator can act on: what the broker said (its
/// CONNACK reason), or what happened on the way (DNS, TCP, TLS, no CONNACK in time). Paho
/// reports most transport failures as one generic error, so DNS and TCP are probed here (on
/// the feeder thread). `elapsed`: how long the attempt took.
fn diagnose(opts: &MqttOptions, ep: &Endpoint, err: &paho::Error, elapsed: Duration) -> String {
    let target = ep.authority();
    let timeout = opts.connect_timeout;
    let no_connack = || {
        format!(
            "no CONNACK from {target} within {} s (CYBERWAVE_NODE_CONNECT_TIMEOUT_SECONDS): the broker accepted the TCP connection but did not answer the MQTT CONNECT (a clustered broker may still be taking the session over)",
            timeout.as_secs_f64()
        )
    };
    match err {
        paho::Error::ReasonCode(rc, _) => {
            let code = *rc as i32;
            return format!(
                "the broker {target} refused the connection: CONNACK reason {code:#04x} {}{}",
                reason_name(code),
                connack_hint(code)
            );
        }
        paho::Error::Timeout => return no_connack(),
        _ => {}
    }
    let addrs: Vec<_> = match target.to_socket_addrs() {
        Ok(a) => a.collect(),
        Err(e) => return format!("DNS lookup of {} failed: {e}", ep.host),
    };
    let mut last = None;
    for a in &addrs {
        match TcpStream::connect_timeout(a, Duration::from_secs(3)) {
            Ok(_) => {
                last = None;
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    if let Some(e) = last {
        let what = if e.kind() == std::io::ErrorKind::ConnectionRefused {
            "connection refused (is the broker running, and is this the right port?)".to_string()
        } else {
            e.to_string()
        };
        return format!("cannot reach {target}: {what}");
    }
    // Paho's connect timeout ends the attempt with its generic failure.
    if elapsed.saturating_add(Duration::from_millis(500)) >= timeout {
        return no_connack();
    }
    if !opts.tls {
        if let Some(said) = addrs.first().and_then(probe_connack) {
            return format!("MQTT connect to {target} failed: {said}");
        }
    }
    if opts.tls {
        format!(
            "TLS handshake with {target} failed ({err}): the server certificate was not accepted — it is not signed by the trusted CA ({}), \
             or it was issued for another host name than {:?}, or the server does not speak TLS on this port",
            opts.ca_file.as_deref().map(|p| p.display().to_string()).unwrap_or_default(),
            ep.host
        )
    } else {
        format!(
            "MQTT connect to {target} failed: {err} (the TCP connection opened, then the MQTT handshake failed)"
        )
    }
}

/// What a broker answers a bare MQTT v5 CONNECT (a probe client id, no credentials, clean
/// start, no session kept), when Paho reported only a generic failure: a v3-only broker's
/// CONNACK (Paho cannot read it as v5), a v5 refusal, or nothing. `None` when it accepts.
fn probe_connack(addr: &std::net::SocketAddr) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = TcpStream::connect_timeout(addr, Duration::from_secs(3)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    let id = format!(
        "cw-probe-{:016x}",
        u64::from_le_bytes(crate::util::random_bytes::<8>())
    );
    let id_len = u8::try_from(id.len()).ok()?;
    // Protocol name, level 5, clean start, keep alive 10 s, no properties, the client id.
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 5, 0x02, 0, 10, 0, 0, id_len];
    body.extend_from_slice(id.as_bytes());
    let len = u8::try_from(body.len()).ok()?;
    let mut packet = vec![0x10, len];
    packet.extend_from_slice(&body);
    s.write_all(&packet).ok()?;
    let mut head = [0u8; 2];
    if s.read_exact(&mut head).is_err() {
        return Some(
            "the broker closed the connection without answering the MQTT v5 CONNECT (is it an MQTT listener, and does it speak MQTT v5?)".into(),
        );
    }
    let [kind, len] = head;
    let mut rest = vec![0u8; usize::from(len.min(127))];
    s.read_exact(&mut rest).ok()?;
    let _ = s.write_all(&[0xE0, 0]);
    if kind != 0x20 {
        return Some(format!(
            "the broker answered CONNECT with packet type {}, not a CONNACK",
            kind >> 4
        ));
    }
    let code = i32::from(rest.get(1).copied().unwrap_or(0));
    if len == 2 && (1..=5).contains(&code) {
        return Some(format!(
            "the broker refused MQTT v5: it answered as an MQTT 3.1.1 broker (CONNACK return code {code}{}); the node needs an MQTT v5 broker",
            if code == 1 { ", unacceptable protocol version" } else { "" }
        ));
    }
    (code >= 0x80).then(|| {
        format!(
            "the broker refused a v5 CONNECT: CONNACK reason {code:#04x} {}",
            reason_name(code)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(host: &str, port: u16) -> Endpoint {
        Endpoint {
            host: host.into(),
            port,
        }
    }

    #[test]
    fn endpoints_list_hosts_with_optional_ports() {
        assert_eq!(
            parse_endpoints("mqtt.cyberwave.com", 8883).unwrap(),
            vec![ep("mqtt.cyberwave.com", 8883)]
        );
        assert_eq!(
            parse_endpoints(
                " a.example:1883 , b.example,10.0.0.3:65535,[::1]:1884,[fe80::1] ",
                8883
            )
            .unwrap(),
            vec![
                ep("a.example", 1883),
                ep("b.example", 8883),
                ep("10.0.0.3", 65535),
                ep("::1", 1884),
                ep("fe80::1", 8883),
            ]
        );
        assert_eq!(ep("::1", 1884).authority(), "[::1]:1884");
        // Duplicates are dropped, order kept.
        assert_eq!(
            parse_endpoints("a:1,b:2,a:1", 9).unwrap(),
            vec![ep("a", 1), ep("b", 2)]
        );
        let max = vec!["h"; MAX_ENDPOINTS].join(",");
        assert_eq!(parse_endpoints(&max, 1).unwrap(), vec![ep("h", 1)]);
    }

    #[test]
    fn hostile_endpoint_lists_get_clear_errors() {
        let err = |s: &str| parse_endpoints(s, 1883).unwrap_err().to_string();
        assert!(err("").contains("empty"), "{}", err(""));
        assert!(err(" ").contains("empty"));
        assert!(err("a,,b").contains("entry 2"), "{}", err("a,,b"));
        assert!(err("a,").contains("entry 2"));
        assert!(err(",a").contains("entry 1"));
        for bad in [
            "a:0",
            "a:65536",
            "a:99999999999999999999",
            "a:-1",
            "a:+80",
            "a:",
            "a: 80",
            "a:8x",
        ] {
            assert!(err(bad).contains("1 to 65535"), "{bad}: {}", err(bad));
        }
        assert!(err("::1").contains("brackets"));
        assert!(err("[::1").contains("not closed"));
        assert!(err("[::1]x").contains(":port"));
        assert!(err("[evil.host]:1").contains("IPv6"));
        assert!(err("[]").contains("IPv6"));
        assert!(err(":1883").contains("no host"));
        assert!(
            err("tcp://broker").contains("1 to 65535") || err("tcp://broker").contains("brackets")
        );
        assert!(err("bröker.example").contains("ASCII"));
        assert!(err("名前.example:1883").contains("ASCII"));
        assert!(err("a b").contains("not a host name"));
        assert!(err("a\nb").contains("not a host name"));
        assert!(err("a\u{0}b").contains("not a host name"));
        assert!(err("-a").contains("not a host name"));
        assert!(err(&"x".repeat(254)).contains("longer than"));
        // A thousand entries: refused as a whole, without echoing them all.
        let many = vec!["h"; 1000].join(",");
        let e = err(&many);
        assert!(
            e.contains("1000") && e.contains("at most") && e.len() < 200,
            "{e}"
        );
        // Control characters and huge entries are shown escaped and bounded.
        let e = err(&format!("a:{}", "\u{1b}[31m".repeat(500)));
        assert!(!e.contains('\u{1b}') && e.len() < 700, "{e}");
    }

    #[test]
    fn shuffling_is_a_permutation_in_random_order() {
        let v: Vec<u32> = (0..8).collect();
        let mut x = 7u64;
        let mut orders = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let s = shuffled(v.clone(), || {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                x >> 17
            });
            let mut sorted = s.clone();
            sorted.sort();
            assert_eq!(sorted, v);
            orders.insert(s);
        }
        assert!(orders.len() > 100, "{}", orders.len());
        // Every address comes first sometimes (a fleet spreads over the cluster).
        let firsts: std::collections::BTreeSet<u32> = orders.iter().map(|o| o[0]).collect();
        assert_eq!(firsts.len(), 8);
        assert!(shuffled(Vec::<u8>::new(), || 0).is_empty());
    }

    #[test]
    fn packet_sizes_follow_the_mqtt_v5_encoding() {
        // 1 fixed header + 1 remaining length + (2 + 3 topic + 2 packet id + 1 property
        // length + 0 properties + 10 payload).
        assert_eq!(publish_packet_size(3, 0, 10, 1), 20);
        assert_eq!(publish_packet_size(3, 0, 10, 0), 18);
        // The remaining length takes a second byte from 128 on.
        assert_eq!(publish_packet_size(1, 0, 121, 1), 129);
        assert_eq!(publish_packet_size(1, 0, 122, 1), 131);
        // Properties past 127 bytes take a two-byte length.
        assert_eq!(
            publish_packet_size(1, 128, 0, 1) - publish_packet_size(1, 127, 0, 1),
            2
        );
        // Response topic, correlation data, user property "X-API-Token" = token.
        assert_eq!(request_props_size(10, 16, 0), 3 + 10 + 3 + 16);
        assert_eq!(
            request_props_size(10, 16, 5),
            3 + 10 + 3 + 16 + 1 + 2 + 11 + 2 + 5
        );
        assert_eq!(
            publish_packet_size(usize::MAX, usize::MAX, usize::MAX, 1),
            u64::MAX
        );
    }

    #[test]
    fn a_message_over_the_brokers_maximum_packet_size_never_fits() {
        assert!(fits(65_536, 65_536).is_ok());
        let e = fits(65_537, 65_536).unwrap_err().to_string();
        assert!(e.contains("65537") && e.contains("65536"), "{e}");
        // A broker that names no limit takes anything.
        assert!(fits(u64::MAX, 0).is_ok());
    }

    #[test]
    fn a_puback_reason_code_is_a_refusal_and_a_lost_connection_is_not() {
        let refused = |rc| refusal_of(&Err(paho::Error::ReasonCode(rc, paho::Properties::new())));
        let (why, permanent) = refused(paho::ReasonCode::NotAuthorized).unwrap();
        assert!(why.contains("0x87"), "{why}");
        assert!(
            !permanent,
            "an ACL may change: counted, not set aside at once"
        );
        assert!(refused(paho::ReasonCode::PacketTooLarge).unwrap().1);
        assert!(refused(paho::ReasonCode::ImplementationSpecificError).is_some());
        assert!(refused(paho::ReasonCode::Success).is_none());
        assert!(refusal_of(&Ok(())).is_none());
        assert!(refusal_of(&Err(paho::Error::Timeout)).is_none());
        assert!(refusal_of(&Err(paho::Error::Disconnected)).is_none());
    }

    #[test]
    fn redacts_tokens_in_topics() {
        assert_eq!(
            redact_topic("cyberwave/cloud-node-token/cw_secret_token_1234/request-instance"),
            "cyberwave/cloud-node-token/cw_…1234/request-instance"
        );
        assert_eq!(
            redact_topic("cyberwave/cloud-node/u/heartbeat"),
            "cyberwave/cloud-node/u/heartbeat"
        );
    }

    #[test]
    fn redacting_odd_topics_never_panics() {
        assert_eq!(redact_topic("cloud-node-token/"), "cloud-node-token/…");
        assert_eq!(
            redact_topic("x/cloud-node-token/éééééééééééééé"),
            "x/cloud-node-token/…éééé"
        );
        assert_eq!(
            redact_topic("cloud-node-token//cloud-node-token/"),
            "cloud-node-token/…/cloud-node-token/"
        );
    }

    #[test]
    fn trust_store_prefers_configured_and_reports_missing() {
        assert!(trust_store(Some(Path::new("/nonexistent/ca.pem")), None).is_err());
        let f = std::env::temp_dir().join(format!("cw-ca-{}.pem", std::process::id()));
        std::fs::write(&f, "x").unwrap();
        assert_eq!(trust_store(Some(&f), None).unwrap(), f);
        assert_eq!(trust_store(None, Some(f.to_str().unwrap())).unwrap(), f);
        std::fs::remove_file(&f).unwrap();
    }

    #[test]
    fn two_drops_right_after_a_large_publish_halve_the_largest_message() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut g = LimitGuess::default();
        // Small publishes never teach anything.
        g.published(10_000, t0);
        assert_eq!(g.dropped(ms(10)), None);
        assert_eq!(g.dropped(ms(20)), None);
        assert_eq!(g.limit(), 0);
        // One drop right after a 512 KiB chunk is not enough; the second halves it.
        g.connecting();
        g.published(524_288, ms(100));
        assert_eq!(g.dropped(ms(150)), None);
        g.connecting();
        g.published(524_288, ms(300));
        assert_eq!(g.dropped(ms(350)), Some((524_288, 262_144)));
        assert_eq!(g.limit(), 262_144);
        // A drop long after the publish is the network, not the size.
        g.connecting();
        g.published(200_000, ms(400));
        assert_eq!(g.dropped(ms(5_000)), None);
        assert_eq!(g.dropped(ms(5_001)), None, "each publish counts once");
        // Down to 16 KiB, never below.
        for _ in 0..20 {
            g.connecting();
            g.published(u64::from(g.limit()), ms(6_000));
            g.dropped(ms(6_001));
        }
        assert_eq!(g.limit(), MIN_LEARNED_LIMIT);
        g.connecting();
        g.published(20_000, ms(7_000));
        g.dropped(ms(7_001));
        g.published(20_000, ms(7_002));
        assert_eq!(g.dropped(ms(7_003)), None, "no lower than 16 KiB");
        assert_eq!(g.limit(), MIN_LEARNED_LIMIT);
        assert_eq!(tighter(0, 5), 5);
        assert_eq!(tighter(7, 0), 7);
        assert_eq!(tighter(7, 5), 5);
    }

    #[test]
    fn reason_codes_have_their_specification_names() {
        assert_eq!(reason_name(0x84), "Unsupported Protocol Version");
        assert_eq!(reason_name(0x86), "Bad User Name or Password");
        assert_eq!(reason_name(0x87), "Not authorized");
        assert_eq!(reason_name(0x80), "Unspecified error");
        assert_eq!(reason_name(0x8E), "Session taken over");
        assert_eq!(reason_name(0x95), "Packet too large");
        assert_eq!(reason_name(0x7F), "unknown reason");
        assert_eq!(reason_name(-1), "unknown reason");
    }
}
