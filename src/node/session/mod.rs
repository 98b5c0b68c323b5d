//! The broker session: the connection and its reconnects, the registration
//! (R1, R2), the heartbeat (R3) and every request waiting for its reply. It owns that state and
//! reaches the outside only through [`Link`]; it takes the time as an argument and tells the
//! loop what happened as [`Happening`]s, so each of its decisions is unit-tested here with a
//! recording fake and a fake clock in milliseconds.
//!
//! It knows nothing of workloads, streams or the outbox: the loop's own requests (workload
//! statuses, log chunks, outbox messages, uploads) are tagged with the loop's type `T` and come
//! back to the loop as [`Happening::Outcome`].

pub mod heartbeat;

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};

use crate::config::credentials::Identity;
use crate::config::{Settings, Tuning};
use crate::logtext::shown;
use crate::mqtt::MqttEvent;
use crate::protocol::replies::Reply;
use crate::protocol::topics::Topics;
use crate::util;
pub use heartbeat::{Heartbeat, HeartbeatVerdict, MAX_AUTH_FAILURES};

/// Commands kept while the node is not yet registered (a resumed session delivers them first).
const MAX_EARLY_COMMANDS: usize = 1000;
/// The least wait between connects while another client holds this node's client id (D33).
const DUPLICATE_ID_BACKOFF: Duration = Duration::from_secs(30);
/// How soon after a connect the session checks the connection is still there (a loss that
/// raced the connect's outcome is otherwise noticed only at the next wake-up).
const VERIFY_CONNECTION: Duration = Duration::from_millis(500);
/// A connection closed this soon after it was accepted counts towards a duplicate client id.
const SHORT_CONNECTION: Duration = Duration::from_secs(5);
/// The first wait after a failed registration (doubling, with full jitter).
const REGISTER_RETRY_BASE: Duration = Duration::from_millis(500);

/// A request's JSON body as sent.
fn encode(body: &Value) -> Vec<u8> {
    serde_json::to_vec(body).unwrap_or_default()
}

/// Everything the session does to the world.
pub trait Link {
    /// Starts a connect attempt to the current broker address (never asking for a clean
    /// session). Its outcome comes back as an `MqttEvent`.
    fn connect(&mut self);
    /// Whether the client holds a live connection right now.
    fn is_connected(&self) -> bool;
    /// The broker address in use (for log lines).
    fn endpoint(&self) -> String;
    fn endpoint_count(&self) -> usize;
    /// The next connect goes to the next broker address.
    fn next_endpoint(&mut self);
    fn subscribe(&mut self, topics: &[String]);
    /// A subscribe whose SUBACK comes back as `MqttEvent::Subscribed`.
    fn subscribe_confirmed(&mut self, topics: &[String]);
    fn unsubscribe(&mut self, topic: &str);
    /// Publishes a request whose reply comes to the inbox with this correlation.
    fn request(&mut self, topic: &str, payload: Vec<u8>, correlation: &[u8]);
    /// Stores the identity the backend assigned.
    fn save_identity(&mut self, identity: &Identity) -> Result<(), String>;
    /// Records, for `doctor`, that another client uses this node's client id (D33).
    fn mark_client_id_conflict(&mut self);
    /// Tells systemd (`READY=1`, `WATCHDOG=1`).
    fn notify(&mut self, state: &str);
}

/// What the session needs of the settings, copied once.
#[derive(Debug, Clone)]
pub struct Config {
    pub topics: Topics,
    /// The API token (R1's topic carries it).
    pub token: String,
    pub profile_slug: String,
    pub environment_uuid: Option<String>,
    pub slug_hint: Option<String>,
    pub instance_uuid: Option<String>,
    pub workspace_slug: Option<String>,
    pub standalone: bool,
    pub heartbeat_interval: Duration,
    pub tuning: Tuning,
    /// For the duplicate-client-id message only.
    pub state_dir: String,
}

impl Config {
    pub fn from_settings(s: &Settings, topics: Topics, token: String) -> Config {
        Config {
            topics,
            token,
            profile_slug: s.profile_slug.value.clone(),
            environment_uuid: s.environment_uuid.as_ref().map(|e| e.value.clone()),
            slug_hint: s.slug_hint.as_ref().map(|e| e.value.clone()),
            instance_uuid: s.instance_uuid.as_ref().map(|e| e.value.clone()),
            workspace_slug: s.workspace_slug.as_ref().map(|e| e.value.clone()),
            standalone: s.standalone,
            heartbeat_interval: s.heartbeat_interval.value,
            tuning: s.tuning.clone(),
            state_dir: s.config_dir.value.display().to_string(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Conn {
    Disconnected { next_attempt: Instant, attempt: u32 },
    Connecting { attempt: u32 },
    Connected,
}

#[derive(Debug, Clone, PartialEq)]
enum Registration {
    /// Send R1 (create) or R2 (register a known uuid) once connected and `next_try` is due.
    Needed {
        next_try: Instant,
        attempt: u32,
        create: bool,
    },
    AwaitingCreate {
        attempt: u32,
    },
    AwaitingRegister {
        attempt: u32,
        uuid: String,
        slug: Option<String>,
    },
    Done,
}

/// Whose request a reply answers.
#[derive(Debug, Clone, PartialEq)]
enum Tag<T> {
    Create,
    Register,
    Heartbeat,
    Loop(T),
}

struct Pending<T> {
    tag: Tag<T>,
    deadline: Instant,
}

/// What the loop acts on.
#[derive(Debug, PartialEq)]
pub enum Happening<T> {
    /// A connection is up and the inbox subscribed: send what waits.
    Connected { reconnect: bool },
    /// The connection is gone; a reconnect is scheduled. What was in flight goes again.
    Lost,
    /// Registered (R2 acknowledged, or standalone): the command subscriptions are asked for.
    Registered,
    /// Registered, but the node failed to start: report `error` (R6 fail) and shut down.
    RegisteredAfterFailedStart(String),
    /// A command on one of the node's command topics (also those kept from before the
    /// registration, in order).
    Command(Vec<u8>),
    /// The reply to one of the loop's requests, or `None` when its time ran out.
    Outcome {
        tag: T,
        reply: Option<Reply>,
        correlation: Vec<u8>,
    },
    /// One of the loop's requests was not delivered: it cannot be sent as it is (`permanent`)
    /// or the broker refused it (see `MqttEvent::Refused`). No outcome follows.
    Refused {
        tag: T,
        why: String,
        permanent: bool,
    },
    /// A heartbeat is due: the loop builds its body and calls [`Session::send_heartbeat`].
    HeartbeatDue,
    /// A heartbeat was refused or not answered.
    HeartbeatFailed,
    /// The token was refused on [`MAX_AUTH_FAILURES`] heartbeats in a row: exit 3.
    TokenRejected,
}

pub struct Session<T> {
    cfg: Config,
    conn: Conn,
    reg: Registration,
    identity: Option<Identity>,
    command_topics: Vec<String>,
    early_commands: Vec<Vec<u8>>,
    pending: HashMap<Vec<u8>, Pending<T>>,
    hb: Heartbeat,
    /// Set when the node shuts down: no reconnect, registration or heartbeat any more.
    closing: bool,
    /// A start-up failure to report once registered, instead of taking commands.
    startup_failure: Option<String>,
    connected_once: bool,
    ready_announced: bool,
    taken_over_at: Option<Instant>,
    connected_at: Option<Instant>,
    short_connections: Vec<Instant>,
    /// The current connection was made at the first attempt after a loss.
    connected_first_try: bool,
    verify_connection_at: Option<Instant>,
    /// Failed attempts in a row per broker address (the back-off of each address is its own:
    /// a dead address that refuses at once does not lengthen the wait before a live one).
    failures: HashMap<String, u32>,
}

impl<T: Clone + std::fmt::Debug> Session<T> {
    /// A session about to make its first connect attempt.
    pub fn new(
        cfg: Config,
        identity: Option<Identity>,
        startup_failure: Option<String>,
        now: Instant,
    ) -> Session<T> {
        let create = cfg.instance_uuid.is_none();
        Session {
            cfg,
            conn: Conn::Disconnected {
                next_attempt: now,
                attempt: 0,
            },
            reg: Registration::Needed {
                next_try: now,
                attempt: 0,
                create,
            },
            identity,
            command_topics: Vec::new(),
            early_commands: Vec::new(),
            pending: HashMap::new(),
            hb: Heartbeat::default(),
            closing: false,
            startup_failure,
            connected_once: false,
            ready_announced: false,
            taken_over_at: None,
            connected_at: None,
            short_connections: Vec::new(),
            connected_first_try: false,
            verify_connection_at: None,
            failures: HashMap::new(),
        }
    }

    // ---- what the loop reads ------------------------------------------------------------------

    pub fn connected(&self) -> bool {
        self.conn == Conn::Connected
    }

    pub fn registered(&self) -> bool {
        self.reg == Registration::Done
    }

    pub fn uuid(&self) -> &str {
        self.identity.as_ref().map_or("", |i| i.uuid.as_str())
    }

    pub fn slug(&self) -> &str {
        self.identity.as_ref().map_or("", |i| i.slug.as_str())
    }

    pub fn last_heartbeat_ok(&self) -> Option<SystemTime> {
        self.hb.last_ok
    }

    /// Whether any of the loop's requests (a log chunk, a workload status, an outbox message)
    /// awaits its reply: a loss may then be the broker refusing it (D34).
    pub fn loop_requests_pending(&self) -> bool {
        self.pending.values().any(|p| matches!(p.tag, Tag::Loop(_)))
    }

    pub fn startup_failed(&self) -> bool {
        self.startup_failure.is_some()
    }

    /// The earliest moment the session has something to do.
    pub fn next_due(&self) -> Option<Instant> {
        let mut due: Option<Instant> = None;
        let mut at = |d: Instant| due = Some(due.map_or(d, |t| t.min(d)));
        let open = !self.closing;
        if let Conn::Disconnected { next_attempt, .. } = self.conn {
            if open {
                at(next_attempt);
            }
        }
        if let Registration::Needed { next_try, .. } = self.reg {
            if self.connected() && open {
                at(next_try);
            }
        }
        if let Some(d) = self.hb.next_due {
            if self.registered() && open {
                at(d);
            }
        }
        for p in self.pending.values() {
            at(p.deadline);
        }
        if let Some(v) = self.verify_connection_at {
            at(v);
        }
        due
    }

    // ---- what the loop tells it -----------------------------------------------------------------

    /// The node shuts down: nothing more is started (pending requests still get their outcome).
    pub fn close(&mut self) {
        self.closing = true;
        self.hb.next_due = None;
    }

    /// Forgets the loop's requests that `drop` picks (their replies are then ignored).
    pub fn forget(&mut self, mut drop: impl FnMut(&T) -> bool) {
        self.pending.retain(|_, p| match &p.tag {
            Tag::Loop(t) => !drop(t),
            _ => true,
        });
    }

    /// Sends one of the loop's requests; its reply (or its timeout) comes back as
    /// [`Happening::Outcome`]. Returns the correlation.
    pub fn request(
        &mut self,
        tag: T,
        topic: &str,
        body: &Value,
        timeout: Duration,
        now: Instant,
        out: &mut dyn Link,
    ) -> Vec<u8> {
        self.send(Tag::Loop(tag), topic, encode(body), timeout, now, out)
    }

    /// Like [`Session::request`] with the body already encoded (a log chunk's JSON is written
    /// straight into its payload, its text escaped once).
    pub fn request_payload(
        &mut self,
        tag: T,
        topic: &str,
        payload: Vec<u8>,
        timeout: Duration,
        now: Instant,
        out: &mut dyn Link,
    ) -> Vec<u8> {
        self.send(Tag::Loop(tag), topic, payload, timeout, now, out)
    }

    fn send(
        &mut self,
        tag: Tag<T>,
        topic: &str,
        payload: Vec<u8>,
        timeout: Duration,
        now: Instant,
        out: &mut dyn Link,
    ) -> Vec<u8> {
        let corr = util::random_bytes::<16>().to_vec();
        out.request(topic, payload, &corr);
        self.pending.insert(
            corr.clone(),
            Pending {
                tag,
                deadline: util::later(now, timeout),
            },
        );
        corr
    }

    /// Sends the heartbeat the loop built after [`Happening::HeartbeatDue`]; counts a failure
    /// when there is no connection to send it on.
    pub fn send_heartbeat(&mut self, body: &Value, now: Instant, out: &mut dyn Link) {
        if !self.connected() {
            self.hb.failures = self.hb.failures.saturating_add(1);
            log::debug!("heartbeat skipped: not connected");
            return;
        }
        let topic = self.cfg.topics.heartbeat(self.uuid());
        let timeout = self.cfg.tuning.heartbeat_timeout;
        self.send(Tag::Heartbeat, &topic, encode(body), timeout, now, out);
    }

    /// What the MQTT client reported. `publishing`: messages of the loop were in flight (a
    /// loss may then be the broker refusing one of them, D34, not another client, D33).
    pub fn on_mqtt(
        &mut self,
        ev: MqttEvent,
        publishing: bool,
        now: Instant,
        out: &mut dyn Link,
    ) -> Vec<Happening<T>> {
        let mut happened = Vec::new();
        match ev {
            MqttEvent::Connect(Ok(resumed)) => {
                self.on_connected(resumed, publishing, now, out, &mut happened)
            }
            MqttEvent::Connect(Err(why)) => {
                let attempt = match self.conn {
                    Conn::Connecting { attempt } => attempt,
                    _ => 0,
                };
                self.schedule_reconnect(attempt, true, &why, now, out);
            }
            MqttEvent::Lost(why) => {
                if self.connected() {
                    self.connection_lost(&why, publishing, now, out, &mut happened);
                } else if matches!(self.conn, Conn::Connecting { .. }) {
                    // Maybe this attempt's connection, lost before its outcome arrived: check
                    // soon after the outcome (a stale loss of the last connection is harmless).
                    self.verify_connection_at = Some(util::later(now, Duration::from_millis(100)));
                }
            }
            MqttEvent::TakenOver => self.taken_over(publishing, now, out, &mut happened),
            MqttEvent::Subscribed(result) => self.on_subscribed(result, now, out),
            MqttEvent::Refused {
                correlation,
                why,
                permanent,
            } => match self.pending.remove(&correlation) {
                Some(Pending {
                    tag: Tag::Loop(tag),
                    ..
                }) => happened.push(Happening::Refused {
                    tag,
                    why,
                    permanent,
                }),
                // The session's own requests: a failure now rather than at their timeout.
                Some(p) => {
                    log::warn!("the {:?} request was not delivered: {why}", p.tag);
                    self.outcome(p.tag, None, correlation, now, out, &mut happened);
                }
                None => log::debug!("a refusal of a request no longer waited for: {why}"),
            },
            MqttEvent::Message {
                topic,
                payload,
                correlation,
            } => {
                if topic == self.cfg.topics.inbox() {
                    self.on_reply(correlation, &payload, now, out, &mut happened);
                } else if self.command_topics.contains(&topic) {
                    happened.push(Happening::Command(payload));
                } else if !self.registered() && self.cfg.topics.is_command_topic(&topic) {
                    // A resumed session delivers queued commands before registration is done:
                    // keep them (bounded) and hand them over once the node is registered.
                    if self.early_commands.len() < MAX_EARLY_COMMANDS {
                        self.early_commands.push(payload);
                    } else {
                        log::warn!(
                            "dropped a command that arrived before registration: too many queued"
                        );
                    }
                } else {
                    log::debug!("message on unexpected topic {} ignored", shown(&topic));
                }
            }
        }
        happened
    }

    /// Everything that is due at `now`: a check of the connection, a connect attempt, expired
    /// requests, a registration step, a heartbeat.
    pub fn tick(
        &mut self,
        publishing: bool,
        now: Instant,
        out: &mut dyn Link,
    ) -> Vec<Happening<T>> {
        let mut happened = Vec::new();
        if self.verify_connection_at.is_some_and(|v| now >= v) {
            self.verify_connection_at = None;
        }
        if self.connected() && !out.is_connected() {
            // A loss the client did not report as an event still is one (D34).
            self.connection_lost(
                "the connection is gone",
                publishing,
                now,
                out,
                &mut happened,
            );
        }
        if let Conn::Disconnected { next_attempt, .. } = self.conn {
            if now >= next_attempt && !self.closing {
                self.start_connect(out);
            }
        }
        let expired: Vec<Vec<u8>> = self
            .pending
            .iter()
            .filter(|(_, p)| now >= p.deadline)
            .map(|(k, _)| k.clone())
            .collect();
        for corr in expired {
            if let Some(p) = self.pending.remove(&corr) {
                self.outcome(p.tag, None, corr, now, out, &mut happened);
            }
        }
        if self.connected() && !self.closing {
            if let Registration::Needed {
                next_try,
                attempt,
                create,
            } = self.reg
            {
                if self.cfg.standalone {
                    // No backend: the node's own identity stands in for a registration.
                    if let Some(identity) = self.identity.clone() {
                        self.become_registered(identity, out, &mut happened);
                    }
                } else if now >= next_try {
                    let create = create || self.known_uuid().is_none();
                    self.send_registration_step(attempt, create, now, out);
                }
            }
        }
        if let Some(due) = self.hb.next_due {
            if now >= due && self.registered() && !self.closing {
                let r = u64::from_le_bytes(util::random_bytes::<8>());
                self.hb.next_due = heartbeat::beat_due(now, self.cfg.heartbeat_interval, r);
                happened.push(Happening::HeartbeatDue);
            }
        }
        happened
    }

    // ---- connection -------------------------------------------------------------------------

    fn start_connect(&mut self, out: &mut dyn Link) {
        let attempt = match self.conn {
            Conn::Disconnected { attempt, .. } => attempt,
            _ => 0,
        };
        log::debug!(
            "connecting to {} (attempt {})",
            out.endpoint(),
            attempt.saturating_add(1)
        );
        self.conn = Conn::Connecting { attempt };
        out.connect();
    }

    fn on_connected(
        &mut self,
        resumed: bool,
        publishing: bool,
        now: Instant,
        out: &mut dyn Link,
        happened: &mut Vec<Happening<T>>,
    ) {
        log::info!(
            "connected to MQTT broker {} ({})",
            out.endpoint(),
            if resumed {
                "session resumed"
            } else {
                "new session"
            }
        );
        self.connected_first_try = matches!(self.conn, Conn::Connecting { attempt: 1 });
        self.connected_at = Some(now);
        if !out.is_connected() {
            // The connection dropped between the CONNACK and now (its loss event came while
            // the attempt was still open): never claim it (D34). It counts as a failed attempt.
            self.schedule_reconnect(
                0,
                true,
                "the connection closed right after it opened",
                now,
                out,
            );
            // A message of the loop resent at once may be what the broker drops the
            // connection for (D34), not another client (D33).
            if !publishing {
                self.note_short_connection(now, out);
            }
            return;
        }
        self.conn = Conn::Connected;
        // A loss can race the connect's own outcome (its event then comes while the attempt is
        // open, and is dropped): look again shortly, even on an idle node.
        self.verify_connection_at = Some(util::later(now, VERIFY_CONNECTION));
        let reconnect = self.connected_once;
        self.connected_once = true;
        // Renew every subscription on every connect: harmless when the broker kept the
        // session, essential when it did not.
        if self.registered() && !self.ready_announced && self.command_topics.len() >= 2 {
            // Not confirmed yet (the last SUBACK was lost with its connection, or refused):
            // ready only once this connection's SUBACK grants them.
            out.subscribe(&[self.cfg.topics.inbox()]);
            out.subscribe_confirmed(&self.command_topics);
        } else {
            let mut topics = vec![self.cfg.topics.inbox()];
            topics.extend(self.command_topics.iter().cloned());
            out.subscribe(&topics);
        }
        happened.push(Happening::Connected { reconnect });
    }

    /// The connection is gone: reconnect with backoff.
    fn connection_lost(
        &mut self,
        why: &str,
        publishing: bool,
        now: Instant,
        out: &mut dyn Link,
        happened: &mut Vec<Happening<T>>,
    ) {
        // A connection that dies within seconds of its CONNACK is a failed attempt for the
        // back-off: a broker that accepts and drops at once cannot cause a reconnect storm.
        let short = self
            .connected_at
            .is_some_and(|t| now.saturating_duration_since(t) <= SHORT_CONNECTION);
        self.schedule_reconnect(0, short, why, now, out);
        if !publishing {
            self.note_short_connection(now, out);
        }
        happened.push(Happening::Lost);
    }

    /// D33: the broker gave this node's session to another client with the same client id
    /// (MQTT v5 reason 0x8E). Twice within a minute means another node runs with a copy of
    /// this state dir.
    fn taken_over(
        &mut self,
        publishing: bool,
        now: Instant,
        out: &mut dyn Link,
        happened: &mut Vec<Happening<T>>,
    ) {
        let recent = self
            .taken_over_at
            .is_some_and(|t| now.saturating_duration_since(t) <= Duration::from_secs(60));
        self.taken_over_at = Some(now);
        let why = "the broker gave this node's session to another client (MQTT reason 0x8E)";
        if self.connected() {
            self.connection_lost(why, publishing, now, out, happened);
        } else {
            log::warn!("{why}");
        }
        if recent {
            self.duplicate_client_id(
                "the broker took the session over twice within a minute",
                now,
                out,
            );
        }
    }

    /// Not every broker or client library reports reason 0x8E: a connection that the broker
    /// closes within seconds of accepting it, three times within a minute, is the same sign.
    fn note_short_connection(&mut self, now: Instant, out: &mut dyn Link) {
        // A broker that restarts refuses the first reconnect; a takeover does not: only a
        // connection made at the first attempt after a loss counts.
        let short = self.connected_first_try
            && self
                .connected_at
                .is_some_and(|t| now.saturating_duration_since(t) <= SHORT_CONNECTION);
        if !short {
            return;
        }
        // Every connection starts with a fresh client (it resends nothing of the last one), so
        // a short one is not the node's own refused message.
        self.short_connections
            .retain(|t| now.saturating_duration_since(*t) <= Duration::from_secs(60));
        self.short_connections.push(now);
        if self.short_connections.len() >= 3 {
            self.short_connections.clear();
            self.duplicate_client_id(
                "the broker closed the connection right after accepting it 3 times within a minute",
                now,
                out,
            );
        }
    }

    /// Says that another client uses this node's client id, records it for `doctor`, and waits
    /// at least 30 s between attempts so the two do not take the session from each other
    /// several times a second (D33).
    fn duplicate_client_id(&mut self, sign: &str, now: Instant, out: &mut dyn Link) {
        // Recorded before it is said, so whoever reads the line finds the record (`doctor`).
        out.mark_client_id_conflict();
        log::error!(
            "another client uses this node's MQTT client id {} ({sign}); most likely a copy of this state dir {} runs on another host, and each takes the session from the other. Give the copy its own identity: stop it, delete node_id and instance_identity.json in its state dir, start it again. Reconnecting in 30 s",
            self.cfg.topics.client_id(),
            self.cfg.state_dir
        );
        if let Conn::Disconnected {
            next_attempt,
            attempt,
        } = self.conn
        {
            self.conn = Conn::Disconnected {
                next_attempt: next_attempt.max(util::later(now, DUPLICATE_ID_BACKOFF)),
                attempt,
            };
        }
    }

    /// The attempt (or connection) on the current address ended; `failed`: it counts as a
    /// failure of that address for its back-off (else the address's count starts over).
    fn schedule_reconnect(
        &mut self,
        attempt: u32,
        failed: bool,
        why: &str,
        now: Instant,
        out: &mut dyn Link,
    ) {
        let n = self.failures.entry(out.endpoint()).or_insert(0);
        *n = if failed { n.saturating_add(1) } else { 0 };
        // Several broker addresses (a cluster): the next attempt goes to the next one, after
        // that address's own back-off.
        out.next_endpoint();
        let next_failures = self.failures.get(&out.endpoint()).copied().unwrap_or(0);
        let t = &self.cfg.tuning;
        let delay = util::backoff_full_jitter(
            next_failures.saturating_sub(1),
            t.reconnect_base,
            t.reconnect_max,
        );
        let next = if out.endpoint_count() > 1 {
            format!(" on {}", out.endpoint())
        } else {
            String::new()
        };
        log::warn!(
            "MQTT {}: {why}; retrying{next} in {:.1}s",
            if attempt == 0 {
                "connection problem"
            } else {
                "connect failed again"
            },
            delay.as_secs_f64()
        );
        self.conn = Conn::Disconnected {
            next_attempt: util::later(now, delay),
            attempt: attempt.saturating_add(1),
        };
    }

    // ---- replies ------------------------------------------------------------------------------

    fn on_reply(
        &mut self,
        correlation: Option<Vec<u8>>,
        payload: &[u8],
        now: Instant,
        out: &mut dyn Link,
        happened: &mut Vec<Happening<T>>,
    ) {
        let Some(corr) = correlation else {
            log::debug!("reply without correlation data dropped");
            return;
        };
        let Some(p) = self.pending.remove(&corr) else {
            log::debug!("reply with no matching request dropped (late or foreign)");
            return;
        };
        self.outcome(p.tag, Some(Reply::parse(payload)), corr, now, out, happened);
    }

    /// A request's reply (`Some`) or its timeout (`None`).
    fn outcome(
        &mut self,
        tag: Tag<T>,
        reply: Option<Reply>,
        correlation: Vec<u8>,
        now: Instant,
        out: &mut dyn Link,
        happened: &mut Vec<Happening<T>>,
    ) {
        match tag {
            Tag::Create => self.on_create_reply(reply, now, out),
            Tag::Register => self.on_register_reply(reply, now, out, happened),
            Tag::Heartbeat => self.on_heartbeat_reply(reply, now, out, happened),
            Tag::Loop(tag) => happened.push(Happening::Outcome {
                tag,
                reply,
                correlation,
            }),
        }
    }

    // ---- registration (R1, R2) ----------------------------------------------------------------

    fn registration_body(&self) -> Value {
        let mut body = json!({"profile_slug": self.cfg.profile_slug});
        if let Some(e) = &self.cfg.environment_uuid {
            util::set(&mut body, "environment_uuid", json!(e));
        }
        body
    }

    fn send_registration_step(
        &mut self,
        attempt: u32,
        create: bool,
        now: Instant,
        out: &mut dyn Link,
    ) {
        if create {
            let mut body = self.registration_body();
            util::set(&mut body, "provider", json!("self-hosted"));
            util::set(&mut body, "visibility", json!("private"));
            if let Some(slug) = &self.cfg.slug_hint {
                util::set(&mut body, "slug", json!(slug));
            }
            log::info!("registering: asking the backend for a new instance (R1)");
            let topic = self.cfg.topics.request_instance(&self.cfg.token);
            let timeout = self.cfg.tuning.request_timeout;
            self.send(Tag::Create, &topic, encode(&body), timeout, now, out);
            self.reg = Registration::AwaitingCreate { attempt };
        } else {
            let uuid = self.known_uuid().unwrap_or_default();
            self.send_register(attempt, uuid, None, now, out);
        }
    }

    fn send_register(
        &mut self,
        attempt: u32,
        uuid: String,
        slug: Option<String>,
        now: Instant,
        out: &mut dyn Link,
    ) {
        log::info!("registering instance {} (R2)", shown(&uuid));
        let topic = self.cfg.topics.register(&uuid);
        let body = self.registration_body();
        let timeout = self.cfg.tuning.request_timeout;
        self.send(Tag::Register, &topic, encode(&body), timeout, now, out);
        self.reg = Registration::AwaitingRegister {
            attempt,
            uuid,
            slug,
        };
    }

    fn known_uuid(&self) -> Option<String> {
        self.identity
            .as_ref()
            .map(|i| i.uuid.clone())
            .or_else(|| self.cfg.instance_uuid.clone())
            .filter(|u| !u.is_empty())
    }

    fn registration_failed(&mut self, why: &str, create: bool, now: Instant) {
        let attempt = match &self.reg {
            Registration::AwaitingCreate { attempt }
            | Registration::AwaitingRegister { attempt, .. }
            | Registration::Needed { attempt, .. } => *attempt,
            Registration::Done => 0,
        };
        let delay = util::backoff_full_jitter(
            attempt,
            REGISTER_RETRY_BASE,
            self.cfg.tuning.register_retry_max,
        );
        log::warn!(
            "registration failed: {}; retrying in {:.1}s",
            shown(why),
            delay.as_secs_f64()
        );
        self.reg = Registration::Needed {
            next_try: util::later(now, delay),
            attempt: attempt.saturating_add(1),
            create,
        };
    }

    fn on_create_reply(&mut self, reply: Option<Reply>, now: Instant, out: &mut dyn Link) {
        let Registration::AwaitingCreate { attempt } = self.reg else {
            return;
        };
        let Some(reply) = reply else {
            return self.registration_failed("no reply to the instance request", true, now);
        };
        let uuid = reply.uuid.map(|u| u.as_str().to_string());
        let slug = reply.slug.map(|u| u.as_str().to_string());
        match (reply.success, uuid) {
            (true, Some(uuid)) => self.send_register(attempt, uuid, slug, now, out),
            (true, None) => self.registration_failed(
                "the backend created an instance but sent no uuid",
                true,
                now,
            ),
            (false, _) => {
                let why = format!("instance creation refused: {}", shown(&reply.message));
                self.registration_failed(&why, true, now)
            }
        }
    }

    fn on_register_reply(
        &mut self,
        reply: Option<Reply>,
        now: Instant,
        out: &mut dyn Link,
        happened: &mut Vec<Happening<T>>,
    ) {
        let Registration::AwaitingRegister { uuid, slug, .. } = self.reg.clone() else {
            return;
        };
        let Some(reply) = reply else {
            return self.registration_failed("no reply to the registration", false, now);
        };
        if !reply.success {
            if reply.code == Some(404) {
                // D6: the instance no longer exists; create a new one.
                log::warn!(
                    "instance {} is unknown to the backend; creating a new instance",
                    shown(&uuid)
                );
                self.identity = None;
                self.reg = Registration::Needed {
                    next_try: now,
                    attempt: 0,
                    create: true,
                };
                return;
            }
            let why = format!("registration refused: {}", shown(&reply.message));
            return self.registration_failed(&why, false, now);
        }
        let uuid = reply.uuid.map_or(uuid, |u| u.as_str().to_string());
        let slug = reply
            .slug
            .map(|s| s.as_str().to_string())
            .or(slug)
            .or_else(|| self.cfg.slug_hint.clone())
            .unwrap_or_else(|| format!("cn-{}", uuid.chars().take(8).collect::<String>()));
        let identity = Identity {
            uuid,
            slug,
            workspace_slug: self.cfg.workspace_slug.clone(),
            registered_at: Some(util::rfc3339(SystemTime::now())),
            standalone: false,
        };
        self.become_registered(identity, out, happened);
    }

    fn become_registered(
        &mut self,
        identity: Identity,
        out: &mut dyn Link,
        happened: &mut Vec<Happening<T>>,
    ) {
        if let Err(e) = out.save_identity(&identity) {
            log::error!("cannot save the instance identity: {e}");
        }
        self.reg = Registration::Done;
        self.identity = Some(identity);
        if let Some(err) = self.startup_failure.clone() {
            happened.push(Happening::RegisteredAfterFailedStart(err));
            return;
        }
        let new_topics = vec![
            self.cfg.topics.command(self.uuid()),
            self.cfg.topics.command(self.slug()),
        ];
        for old in self
            .command_topics
            .iter()
            .filter(|t| !new_topics.contains(t))
        {
            out.unsubscribe(old);
        }
        self.command_topics = new_topics;
        self.ready_announced = false;
        // Ready only once the broker confirmed the subscriptions: a command published before
        // the SUBACK would have no subscription to land on.
        out.subscribe_confirmed(&self.command_topics);
        happened.push(Happening::Registered);
        for payload in std::mem::take(&mut self.early_commands) {
            happened.push(Happening::Command(payload));
        }
    }

    /// The broker answered the command subscriptions (SUBACK): ready once it granted them.
    /// A refusal (reason ≥ 0x80) is an ERROR naming the topic and the reason, never followed by
    /// "node ready" (D50); the next connect asks again.
    fn on_subscribed(
        &mut self,
        result: Result<Vec<i32>, String>,
        now: Instant,
        out: &mut dyn Link,
    ) {
        if self.ready_announced || !self.registered() || self.command_topics.len() < 2 {
            return;
        }
        match result {
            Err(e) if !out.is_connected() => {
                log::debug!("the command subscriptions were not confirmed ({e}): the connection is gone; asked again on the next connect");
                return;
            }
            Err(e) => log::warn!("the broker did not confirm the command subscriptions ({e}); they are renewed on the next connect"),
            Ok(codes) => {
                let mut refused = false;
                for (topic, code) in self.command_topics.iter().zip(&codes) {
                    if *code >= 0x80 {
                        refused = true;
                        log::error!(
                            "the broker refused the subscription to {}: SUBACK reason {code:#04x} {}; the node cannot take commands (check the broker's ACL for this client); asked again on the next connect",
                            shown(topic),
                            crate::mqtt::reason_name(*code)
                        );
                    } else if *code == 0 {
                        log::warn!(
                            "the broker granted only QoS 0 for {}: a command published while the node is disconnected is lost",
                            shown(topic)
                        );
                    }
                }
                if refused {
                    return;
                }
            }
        }
        self.ready_announced = true;
        out.notify("READY=1");
        // Heartbeats start with readiness: the backend never sees a node beat that cannot yet
        // take commands (and systemd hears READY=1 before any WATCHDOG=1).
        if !self.cfg.standalone {
            self.hb.next_due = Some(now);
        }
        log::info!(
            "node ready: instance {} (slug {}){}; commands on {} and {}",
            shown(self.uuid()),
            shown(self.slug()),
            self.cfg
                .environment_uuid
                .as_ref()
                .map(|e| format!(", reserved for environment {e}"))
                .unwrap_or_default(),
            self.command_topics.first().map_or("", String::as_str),
            self.command_topics.get(1).map_or("", String::as_str)
        );
    }

    // ---- heartbeat (R3) -------------------------------------------------------------------------

    fn on_heartbeat_reply(
        &mut self,
        reply: Option<Reply>,
        now: Instant,
        out: &mut dyn Link,
        happened: &mut Vec<Happening<T>>,
    ) {
        if self.closing || !self.registered() {
            return;
        }
        let verdict = self.hb.on_reply(
            reply.as_ref(),
            now,
            self.cfg.heartbeat_interval,
            self.cfg.tuning.auth_retry_base,
        );
        match verdict {
            HeartbeatVerdict::Ok { recovered } => {
                if recovered {
                    log::info!("heartbeats acknowledged again");
                }
                // The watchdog is fed only while the backend acknowledges heartbeats.
                out.notify("WATCHDOG=1");
            }
            HeartbeatVerdict::GiveUp { n } => {
                log::error!("the backend rejected the API token on {n} heartbeats in a row: it is invalid or revoked; shutting down");
                happened.push(Happening::TokenRejected);
            }
            HeartbeatVerdict::AuthRetry { n, delay } => {
                log::warn!(
                    "heartbeat rejected: authentication failed ({n}/{MAX_AUTH_FAILURES}); retrying in {:.1}s",
                    delay.as_secs_f64()
                );
            }
            HeartbeatVerdict::Gone => {
                // D5: the instance is gone; register a new one and move the subscriptions.
                log::warn!(
                    "the backend says instance {} is gone ({}); registering a new instance",
                    shown(self.uuid()),
                    shown(reply.as_ref().map_or("", |b| b.message.as_str()))
                );
                self.pending.retain(|_, p| !matches!(p.tag, Tag::Heartbeat));
                if let Some(i) = &mut self.identity {
                    i.uuid.clear();
                }
                self.cfg.instance_uuid = None;
                self.reg = Registration::Needed {
                    next_try: now,
                    attempt: 0,
                    create: true,
                };
            }
            HeartbeatVerdict::Failed { n, alarm } => {
                happened.push(Happening::HeartbeatFailed);
                let why = match &reply {
                    Some(b) => format!("refused: {}", b.message),
                    None => "no reply in time".to_string(),
                };
                if alarm {
                    log::error!(
                        "heartbeat failed {n} times in a row ({}); the backend may reap this instance",
                        shown(&why)
                    );
                } else {
                    log::warn!("heartbeat failed ({})", shown(&why));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
