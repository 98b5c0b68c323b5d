//! The MQTT v5 session over Paho's asynchronous C client. Nothing here blocks the caller:
//! publishes and subscribes are queued in Paho; a connect attempt is waited on by a short-lived
//! feeder thread that reports the outcome (and, on failure, a diagnosis) as an [`MqttEvent`].
//! Paho's own callbacks only forward messages and connection losses into the same channel.

use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

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
}

#[derive(Debug, Clone)]
pub struct MqttOptions {
    pub host: String,
    pub port: u16,
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

pub struct Mqtt {
    client: paho::AsyncClient,
    connect_opts: paho::ConnectOptions,
    opts: MqttOptions,
    tx: Sender<MqttEvent>,
}

impl Mqtt {
    pub fn new(opts: MqttOptions, tx: Sender<MqttEvent>) -> Result<Mqtt, String> {
        let scheme = if opts.tls { "ssl" } else { "tcp" };
        let uri = format!("{scheme}://{}:{}", opts.host, opts.port);
        let client = paho::CreateOptionsBuilder::new()
            .server_uri(&uri)
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
            .map_err(|e| format!("cannot create the MQTT client for {uri}: {e}"))?;

        let mut props = paho::Properties::new();
        let expiry = u32::try_from(opts.session_expiry.as_secs()).unwrap_or(u32::MAX);
        props
            .push_u32(paho::PropertyCode::SessionExpiryInterval, expiry)
            .map_err(|e| format!("session expiry property: {e}"))?;
        let mut b = paho::ConnectOptionsBuilder::new_v5();
        b.keep_alive_interval(opts.keep_alive)
            .clean_start(false) // D15: resume the broker session (queued QoS 1 commands)
            .properties(props)
            .connect_timeout(Duration::from_secs(10));
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
        let connect_opts = b.finalize();

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
        Ok(Mqtt {
            client,
            connect_opts,
            opts,
            tx,
        })
    }

    pub fn endpoint(&self) -> String {
        format!(
            "{}:{}{}",
            self.opts.host,
            self.opts.port,
            if self.opts.tls { " (TLS)" } else { "" }
        )
    }

    /// Starts one connect attempt; its outcome arrives as `MqttEvent::Connect`.
    pub fn start_connect(&self) {
        let token = self.client.connect(self.connect_opts.clone());
        let tx = self.tx.clone();
        let opts = self.opts.clone();
        let spawned = std::thread::Builder::new()
            .name("mqtt-connect".into())
            .spawn(move || {
                let outcome = match token.wait() {
                    Ok(rsp) => Ok(rsp
                        .connect_response()
                        .map(|c| c.session_present)
                        .unwrap_or(false)),
                    Err(e) => Err(diagnose(&opts, &e)),
                };
                let _ = tx.send(MqttEvent::Connect(outcome));
            });
        if let Err(e) = spawned {
            let _ = self.tx.send(MqttEvent::Connect(Err(format!(
                "cannot start a thread: {e}"
            ))));
        }
    }

    /// Whether the client holds a live connection now (the truth `status` reports, D34).
    pub fn is_connected(&self) -> bool {
        self.client.is_connected()
    }

    /// Queues a publish; never waits. A topic no broker would accept is never sent (D34).
    pub fn publish(&self, topic: &str, payload: Vec<u8>, qos: i32, props: paho::Properties) {
        if !crate::protocol::topics::publishable(topic) {
            log::error!(
                "not publishing to an invalid topic {}",
                crate::logtext::shown(&redact_topic(topic))
            );
            return;
        }
        let msg = paho::MessageBuilder::new()
            .topic(topic)
            .payload(payload)
            .qos(qos)
            .properties(props)
            .finalize();
        if let Err(e) = self.client.try_publish(msg) {
            log::warn!("could not queue a message for {}: {e}", redact_topic(topic));
        }
    }

    /// A v5 request: response topic, correlation data and the `X-API-Token` user property.
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
        self.publish(topic, payload, 1, props);
    }

    /// A QoS 1 publish whose broker acknowledgement (PUBACK) the caller wants to know of.
    pub fn publish_tracked(&self, topic: &str, payload: Vec<u8>) -> Option<paho::DeliveryToken> {
        if !crate::protocol::topics::publishable(topic) {
            log::error!(
                "not publishing to an invalid topic {}",
                crate::logtext::shown(topic)
            );
            return None;
        }
        let msg = paho::MessageBuilder::new()
            .topic(topic)
            .payload(payload)
            .qos(1)
            .finalize();
        match self.client.try_publish(msg) {
            Ok(t) => Some(t),
            Err(e) => {
                log::warn!(
                    "could not queue a message for {}: {e}",
                    crate::logtext::shown(&redact_topic(topic))
                );
                None
            }
        }
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
fn diagnose(opts: &MqttOptions, err: &paho::Error) -> String {
    let target = format!("{}:{}", opts.host, opts.port);
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
        Err(e) => return format!("DNS lookup of {} failed: {e}", opts.host),
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
            opts.host
        )
    } else {
        format!("MQTT connect to {target} failed: {err} (the port is open; is it an MQTT listener without TLS?)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
