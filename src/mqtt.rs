//! The MQTT v5 session over Paho's asynchronous C client. Nothing here blocks the caller:
//! publishes and subscribes are queued in Paho; a connect attempt is waited on by a short-lived
//! feeder thread that reports the outcome (and, on failure, a diagnosis) as an [`MqttEvent`].
//! Paho's own callbacks only forward messages and connection losses into the same channel.

use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
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
    /// The broker answered a confirmed subscribe (SUBACK), or it failed.
    Subscribed(Result<(), String>),
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

/// Whether a packet of `size` bytes fits the broker's Maximum Packet Size `limit` (0: the
/// broker named none). `Err` says why not.
pub fn fits(size: u64, limit: u32) -> Result<(), String> {
    if limit == 0 || size <= u64::from(limit) {
        Ok(())
    } else {
        Err(format!(
            "the message is {size} bytes and the broker takes at most {limit} (its Maximum Packet Size); sending it would only make the broker drop the connection"
        ))
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

/// Paho gives up a connect attempt after this long.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The node gives up waiting for an attempt's outcome after this long (Paho's own timeout
/// should always come first).
const CONNECT_WATCHDOG: Duration = Duration::from_secs(25);

/// The most broker addresses `mqtt_host` may list.
pub const MAX_ENDPOINTS: usize = 32;
/// The longest DNS name.
const MAX_HOST_LEN: usize = 253;

/// `mqtt_host` as a list of broker addresses: `host[:port]` separated by commas (clustered
/// brokers are reached through several addresses); an entry without a port gets
/// `default_port`; an IPv6 address goes in brackets (`[::1]:1883`). Duplicates are dropped.
pub fn parse_endpoints(list: &str, default_port: u16) -> Result<Vec<Endpoint>, String> {
    let count = list.split(',').count();
    if count > MAX_ENDPOINTS {
        return Err(format!(
            "lists {count} broker addresses; at most {MAX_ENDPOINTS} are allowed"
        ));
    }
    let mut out: Vec<Endpoint> = Vec::new();
    for (n, item) in list.split(',').enumerate() {
        let pos = n.saturating_add(1);
        let item = item.trim();
        let e = parse_endpoint(item, default_port).map_err(|why| {
            if count == 1 {
                format!("{}: {why}", quoted(item))
            } else {
                format!("entry {pos} ({}) of {count}: {why}", quoted(item))
            }
        })?;
        if !out.contains(&e) {
            out.push(e);
        }
    }
    Ok(out)
}

fn parse_endpoint(item: &str, default_port: u16) -> Result<Endpoint, String> {
    if item.is_empty() {
        return Err("empty (expected host[:port], addresses separated by commas)".into());
    }
    let (host, port) = if let Some(rest) = item.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or("an IPv6 address opened with [ is not closed with ]")?;
        if host.is_empty()
            || !host
                .chars()
                .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.')
            || !host.contains(':')
        {
            return Err("not an IPv6 address inside [ ]".into());
        }
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or("expected :port after the ] of an IPv6 address")?,
            ),
        };
        (host, port)
    } else {
        let (h, p) = match item.split_once(':') {
            Some((_, p)) if p.contains(':') => {
                return Err("an IPv6 address goes in brackets, as in [::1]:1883".into())
            }
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
            .ok_or_else(|| format!("port {} is not a whole number from 1 to 65535", quoted(p)))?,
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

fn check_host_name(h: &str) -> Result<(), String> {
    if h.is_empty() {
        return Err("no host name before the :port".into());
    }
    if !h.is_ascii() {
        return Err(
            "not an ASCII host name (write an internationalised name in its xn-- form)".into(),
        );
    }
    if h.len() > MAX_HOST_LEN {
        return Err(format!("host name longer than {MAX_HOST_LEN} characters"));
    }
    let ok = h
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
        && !h.starts_with(['-', '.']);
    if !ok {
        return Err(
            "not a host name (letters, digits, '-', '.' and '_' only; no scheme such as tcp://)"
                .into(),
        );
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
) -> Result<PathBuf, String> {
    if let Some(p) = configured {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(format!("the MQTT CA file {} does not exist", p.display()))
        };
    }
    if let Some(p) = ssl_cert_file.filter(|p| Path::new(p).is_file()) {
        return Ok(PathBuf::from(p));
    }
    SYSTEM_CA_BUNDLES
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "TLS is on but no CA bundle was found (tried {}); install ca-certificates or set CYBERWAVE_MQTT_TLS_CA_CERTS",
                SYSTEM_CA_BUNDLES.join(", ")
            )
        })
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

pub struct Mqtt {
    client: paho::AsyncClient,
    /// One set of connect options per endpoint (each names only its own address).
    connect_opts: Vec<paho::ConnectOptions>,
    /// The same with Clean Start: the next attempt drops the session on both sides (D34).
    clean_opts: Vec<paho::ConnectOptions>,
    clean_next: std::cell::Cell<bool>,
    opts: MqttOptions,
    /// The endpoint of the current (or next) attempt, an index into `opts.endpoints`.
    current: std::cell::Cell<usize>,
    tx: Sender<MqttEvent>,
    /// The broker's Maximum Packet Size from the last CONNACK (0: none named).
    max_packet: Arc<AtomicU32>,
    /// Requests whose PUBACK the ack thread waits for (a refusal comes back as
    /// `MqttEvent::Refused`).
    acks: Option<Sender<(Vec<u8>, paho::DeliveryToken)>>,
    /// Publishes refused here for their size, logged at most once a minute.
    too_big: std::cell::RefCell<crate::logtext::Throttle>,
}

impl Mqtt {
    pub fn new(opts: MqttOptions, tx: Sender<MqttEvent>) -> Result<Mqtt, String> {
        let scheme = if opts.tls { "ssl" } else { "tcp" };
        let uri = |e: &Endpoint| format!("{scheme}://{}", e.authority());
        let first = opts
            .endpoints
            .first()
            .map(uri)
            .ok_or("no MQTT broker address is configured")?;
        let client = paho::CreateOptionsBuilder::new()
            .server_uri(&first)
            .client_id(&opts.client_id)
            .mqtt_version(paho::MQTT_VERSION_5)
            // The node keeps its own durable outbox; Paho's file persistence would write into
            // the current directory.
            .persistence(None)
            // Replies and requests published during a short outage go out on reconnect.
            .send_while_disconnected(true)
            .allow_disconnected_send_at_anytime(true)
            .max_buffered_messages(10_000)
            .delete_oldest_messages(true)
            .create_client()
            .map_err(|e| format!("cannot create the MQTT client for {first}: {e}"))?;

        let mut connect_opts = Vec::with_capacity(opts.endpoints.len());
        let mut clean_opts = Vec::with_capacity(opts.endpoints.len());
        for e in &opts.endpoints {
            connect_opts.push(connect_options(&opts, &uri(e), false)?);
            clean_opts.push(connect_options(&opts, &uri(e), true)?);
        }

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
        client.set_connection_lost_callback(move |_| {
            let _ = t.send(MqttEvent::Lost("connection lost".into()));
        });
        let t = tx.clone();
        client.set_disconnected_callback(move |_, _, reason| {
            let _ = t.send(if reason == paho::ReasonCode::SessionTakenOver {
                MqttEvent::TakenOver
            } else {
                MqttEvent::Lost(format!("the broker disconnected the node: {reason}"))
            });
        });
        let acks = match start_ack_thread(tx.clone()) {
            Ok(a) => Some(a),
            Err(e) => {
                log::warn!("cannot start the MQTT acknowledgement thread ({e}); a request the broker refuses is noticed only by its timeout");
                None
            }
        };
        Ok(Mqtt {
            client,
            connect_opts,
            clean_opts,
            clean_next: std::cell::Cell::new(false),
            opts,
            current: std::cell::Cell::new(0),
            tx,
            max_packet: Arc::new(AtomicU32::new(0)),
            acks,
            too_big: std::cell::RefCell::new(crate::logtext::Throttle::default()),
        })
    }

    /// The broker's Maximum Packet Size (MQTT v5 CONNACK), if it named one.
    pub fn max_packet_size(&self) -> Option<u32> {
        Some(self.max_packet.load(Ordering::Relaxed)).filter(|n| *n > 0)
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
    /// Returns whether this attempt starts a clean session.
    pub fn start_connect(&self) -> bool {
        let clean = self.clean_next.take();
        let all = if clean {
            &self.clean_opts
        } else {
            &self.connect_opts
        };
        let Some(copts) = all.get(self.current.get()) else {
            let _ = self
                .tx
                .send(MqttEvent::Connect(Err("no MQTT broker address".into())));
            return clean;
        };
        let client = self.client.clone();
        let copts = copts.clone();
        let tx = self.tx.clone();
        let opts = self.opts.clone();
        let endpoint = self.current_endpoint().cloned();
        let max_packet = self.max_packet.clone();
        let spawned = std::thread::Builder::new()
            .name("mqtt-connect".into())
            .spawn(move || {
                // Started here, not on the loop: Paho resolves the broker's name holding the
                // lock every call into it takes, so a slow DNS would stall the caller.
                let started = Instant::now();
                let token = client.connect(copts);
                // Paho ends the attempt itself after CONNECT_TIMEOUT; this bound only makes
                // sure the node never waits on an attempt whose outcome never comes.
                let outcome = match token.wait_for(CONNECT_WATCHDOG) {
                    Ok(rsp) => {
                        // Known before the loop hears of the connection, so before it sends.
                        let limit = rsp
                            .properties()
                            .get_int(paho::PropertyCode::MaximumPacketSize)
                            .and_then(|n| u32::try_from(n).ok())
                            .unwrap_or(0);
                        max_packet.store(limit, Ordering::Relaxed);
                        Ok(rsp
                            .connect_response()
                            .map(|c| c.session_present)
                            .unwrap_or(false))
                    }
                    Err(paho::Error::Timeout) if started.elapsed() >= CONNECT_WATCHDOG => {
                        Err(format!(
                            "the MQTT client gave no outcome of the connect attempt within {} s",
                            CONNECT_WATCHDOG.as_secs()
                        ))
                    }
                    Err(e) => Err(match &endpoint {
                        Some(ep) => diagnose(&opts, ep, &e),
                        None => e.to_string(),
                    }),
                };
                let _ = tx.send(MqttEvent::Connect(outcome));
            });
        if let Err(e) = spawned {
            let _ = self.tx.send(MqttEvent::Connect(Err(format!(
                "cannot start a thread: {e}"
            ))));
        }
        clean
    }

    /// The next connect starts a clean session: what the client and the broker kept of the
    /// old one (an unacknowledged publish the broker refuses, resent on every resume) is
    /// dropped. Subscriptions are renewed on every connect anyway (D34).
    pub fn clean_start_next(&self) {
        self.clean_next.set(true);
    }

    /// Whether the client holds a live connection now (the truth `status` reports, D34).
    pub fn is_connected(&self) -> bool {
        self.client.is_connected()
    }

    /// Queues a publish; never waits. A topic no broker would accept, or a message over the
    /// broker's Maximum Packet Size, is never sent (D34): the broker would drop the connection.
    pub fn publish(&self, topic: &str, payload: Vec<u8>, qos: i32, props: paho::Properties) {
        // Replies, without properties; a reserve for any others.
        let props_len = if props.is_empty() { 0 } else { 1024 };
        match self.queue(topic, payload, qos, props, props_len) {
            Ok(_) => {}
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
    ) -> Result<(), NotSent> {
        if !crate::protocol::topics::publishable(topic) {
            return Err(NotSent::Never("the topic is invalid".into()));
        }
        let size = publish_packet_size(topic.len(), props_len, payload, qos);
        fits(size, self.max_packet.load(Ordering::Relaxed)).map_err(NotSent::Never)
    }

    fn queue(
        &self,
        topic: &str,
        payload: Vec<u8>,
        qos: i32,
        props: paho::Properties,
        props_len: usize,
    ) -> Result<paho::DeliveryToken, NotSent> {
        self.check(topic, props_len, payload.len(), qos)?;
        let msg = paho::MessageBuilder::new()
            .topic(topic)
            .payload(payload)
            .qos(qos)
            .properties(props)
            .finalize();
        self.client.try_publish(msg).map_err(|e| {
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
        match self.queue(topic, payload, 1, props, props_len) {
            Ok(t) => {
                if let Some(acks) = &self.acks {
                    let _ = acks.send((correlation.to_vec(), t));
                }
            }
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

    /// A QoS 1 publish whose broker acknowledgement (PUBACK) the caller wants to know of.
    pub fn publish_tracked(
        &self,
        topic: &str,
        payload: Vec<u8>,
    ) -> Result<paho::DeliveryToken, NotSent> {
        let r = self.queue(topic, payload, 1, paho::Properties::new(), 0);
        if let Err(NotSent::NotNow(why)) = &r {
            log::warn!("{why}");
        }
        r
    }

    pub fn subscribe(&self, topics: &[String]) {
        if topics.is_empty() {
            return;
        }
        let qos = vec![1; topics.len()];
        // Queued; a failure shows up as a lost connection, which re-subscribes.
        drop(self.client.subscribe_many(topics, &qos));
    }

    /// Subscribes and reports the broker's SUBACK as `MqttEvent::Subscribed` (a feeder thread
    /// waits for it; the caller never does).
    pub fn subscribe_confirmed(&self, topics: &[String]) {
        let qos = vec![1; topics.len()];
        let token = self.client.subscribe_many(topics, &qos);
        let tx = self.tx.clone();
        let spawned = std::thread::Builder::new()
            .name("mqtt-suback".into())
            .spawn(move || {
                let result = token
                    .wait_for(Duration::from_secs(10))
                    .map(|_| ())
                    .map_err(|e| e.to_string());
                let _ = tx.send(MqttEvent::Subscribed(result));
            });
        if let Err(e) = spawned {
            let _ = self.tx.send(MqttEvent::Subscribed(Err(format!(
                "cannot start a thread: {e}"
            ))));
        }
    }

    pub fn unsubscribe(&self, topic: &str) {
        drop(self.client.unsubscribe(topic));
    }

    /// Sends DISCONNECT and waits at most `timeout` (shutdown only).
    pub fn disconnect(&self, timeout: Duration) {
        if self.client.is_connected() {
            let _ = self.client.disconnect(None).wait_for(timeout);
        }
    }
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
fn connect_options(
    opts: &MqttOptions,
    uri: &str,
    clean: bool,
) -> Result<paho::ConnectOptions, String> {
    let mut props = paho::Properties::new();
    let expiry = u32::try_from(opts.session_expiry.as_secs()).unwrap_or(u32::MAX);
    props
        .push_u32(paho::PropertyCode::SessionExpiryInterval, expiry)
        .map_err(|e| format!("session expiry property: {e}"))?;
    let mut b = paho::ConnectOptionsBuilder::new_v5();
    b.server_uris(&[uri])
        .keep_alive_interval(opts.keep_alive)
        .clean_start(clean) // D15: normally resume the broker session (queued QoS 1 commands)
        .properties(props)
        .connect_timeout(CONNECT_TIMEOUT);
    if !opts.username.is_empty() {
        b.user_name(&opts.username);
    }
    if let Some(p) = opts.password.as_deref().filter(|p| !p.is_empty()) {
        b.password(p);
    }
    if opts.tls {
        let ca = opts.ca_file.clone().ok_or("TLS needs a CA file")?;
        let ssl = paho::SslOptionsBuilder::new()
            .trust_store(&ca)
            .map_err(|e| format!("CA file {}: {e}", ca.display()))?
            .enable_server_cert_auth(true)
            .verify(true) // host-name verification: Paho skips it without this
            .finalize();
        b.ssl_options(ssl);
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

/// Why a connect attempt failed, in words an operator can act on. Paho reports most transport
/// failures as one generic error, so DNS and TCP are probed here (on the feeder thread).
fn diagnose(opts: &MqttOptions, ep: &Endpoint, err: &paho::Error) -> String {
    let target = ep.authority();
    match err {
        paho::Error::ReasonCode(rc, _) => {
            let code = *rc as i32;
            let hint = match code {
                0x86 | 0x87 | 0x8C => ": the broker rejected the credentials (check the API token / MQTT username and password)",
                0x85 => ": the broker rejected the client id",
                0x88 | 0x89 => ": the broker is unavailable or busy",
                _ => "",
            };
            return format!("broker refused the connection: {rc}{hint}");
        }
        paho::Error::Timeout => {
            return format!("no answer from {target} within the connect timeout")
        }
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
    if opts.tls {
        format!(
            "TLS handshake with {target} failed ({err}): the server certificate was not accepted — it is not signed by the trusted CA ({}), \
             or it was issued for another host name than {:?}, or the server does not speak TLS on this port",
            opts.ca_file.as_deref().map(|p| p.display().to_string()).unwrap_or_default(),
            ep.host
        )
    } else {
        format!("MQTT connect to {target} failed: {err} (the port is open; is it an MQTT listener without TLS?)")
    }
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
        let err = |s: &str| parse_endpoints(s, 1883).unwrap_err();
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
        let e = fits(65_537, 65_536).unwrap_err();
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
}
