//! The node: start-up (install script → token check → MQTT), then one event loop on the main
//! thread that owns every piece of state and selects over the feeders' channels. Nothing in the
//! loop waits on the network: requests are published and their replies (or deadlines) come
//! back as events. The loop sleeps until the next real deadline ([`Node::next_wake`]): an idle
//! node wakes for its heartbeat and little else; while workloads run it wakes at least every
//! [`BUSY_TICK`].

mod gpus;
mod ingress;
pub mod logs;
pub mod operate;
mod selfheal;
mod session;
mod starts;
pub mod startup;
mod uploads;
mod workloads;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{select, Receiver};
use serde_json::{json, Value};

use crate::app::{EXIT_CREDENTIALS, EXIT_OK, EXIT_RUNTIME};
use crate::config::credentials::Identity;
use crate::config::Settings;
use crate::ledger::Ledger;
use crate::mqtt::{Mqtt, MqttEvent};
use crate::outbox::Outbox;
use crate::protocol::commands::{Command, Kind, Received, StartParams};
use crate::protocol::messages::{self, Incoming};
use crate::protocol::replies::Reply;
use crate::protocol::topics::Topics;
use crate::signals::Signal;
use crate::util;
use crate::workers::{Done, Workers};
use crate::workload::reaper::Reaped;
use crate::workload::tail::{Chunk, Key, Tailer};
use crate::workload::Layout;
use workloads::Active;

/// The loop's longest sleep while a workload is tracked: a safety net under the workload timers,
/// each of which has its own deadline in [`Node::next_wake`].
pub const BUSY_TICK: Duration = Duration::from_secs(1);
/// The loop's longest sleep when nothing is tracked (a heartbeat is due sooner anyway).
pub const IDLE_TICK: Duration = Duration::from_secs(60);
/// How often events that `emit` queued itself are looked for while workloads run (they are
/// the ones that emit) or the queue is not empty; an idle node looks once a minute.
const RESCAN_BUSY: Duration = Duration::from_secs(2);
const RESCAN_IDLE: Duration = Duration::from_secs(60);
/// Retrying outbox writes that a full disk refused (D28).
const DISK_RETRY: Duration = Duration::from_secs(1);
const MAX_EARLY_COMMANDS: usize = 1000;
/// The least wait between connects while another client holds this node's client id (D33).
const DUPLICATE_ID_BACKOFF: Duration = Duration::from_secs(30);
/// How soon after a connect the node checks the connection is still there (a loss that raced
/// the connect's outcome is otherwise noticed only at the next wake-up).
const VERIFY_CONNECTION: Duration = Duration::from_millis(500);
/// A connection closed this soon after it was accepted counts towards a duplicate client id.
const SHORT_CONNECTION: Duration = Duration::from_secs(5);
/// Written into the state dir when another client takes the session over twice within a
/// minute; `doctor` fails while it is recent.
pub const CLIENT_ID_CONFLICT: &str = "client_id_conflict";

/// Time, injected so timers can be driven in tests without sleeping.
pub trait Clock {
    fn now(&self) -> Instant;
}

pub struct SystemClock;
impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// Runs the node until it shuts down; returns the exit code.
pub fn run(settings: Settings) -> i32 {
    match startup::prepare(settings) {
        Ok((node, signals)) => node.run(signals),
        Err(e) => {
            log::error!("{e}");
            crate::error::Failure::exit(&e).code()
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

#[derive(Debug, Clone, PartialEq)]
enum Op {
    Create,
    Register,
    Heartbeat,
    Terminate,
    Fail,
    /// A non-terminal workload status (R7), fire and forget.
    WorkloadStatus,
    /// An outbox message (terminal status, completion), removed once acknowledged.
    Outbox(u64),
    /// A log chunk of a workload stream.
    Log(Key),
    /// R9 for the workload with this safe id.
    SignedUrl(String),
    /// R10 for the workload with this safe id.
    UploadResults(String),
}

struct Pending {
    op: Op,
    deadline: Instant,
}

struct Shutdown {
    deadline: Instant,
    exit_code: i32,
    /// Correlation of the R5 (or R6) request whose reply ends the shutdown early.
    waiting_for: Option<Vec<u8>>,
}

pub struct Node {
    s: Settings,
    clock: Box<dyn Clock>,
    mqtt: Mqtt,
    events: Receiver<MqttEvent>,
    topics: Topics,
    token: String,
    conn: Conn,
    reg: Registration,
    identity: Option<Identity>,
    /// Command topics the node is subscribed to (renewed on every connect).
    command_topics: Vec<String>,
    /// Commands that arrived before registration finished.
    early_commands: Vec<Vec<u8>>,
    pending: HashMap<Vec<u8>, Pending>,
    hb: session::Heartbeat,
    shutdown: Option<Shutdown>,
    /// An install-script failure: reported with R6 once registered, then the node exits 1.
    startup_failure: Option<String>,
    started: Instant,
    exit: Option<i32>,
    layout: Layout,
    /// Active workloads by safe id.
    active: BTreeMap<String, Active>,
    ledger: Ledger,
    outbox: Outbox,
    reaped: Receiver<Reaped>,
    /// Starts in flight, and what the spawner thread reports about them.
    starts: starts::Starts,
    spawned: Receiver<crate::workload::spawner::Outcome>,
    tailer: Tailer,
    chunks: Receiver<Chunk>,
    next_stream_pass: Instant,
    workers: Workers,
    worker_done: Receiver<Done>,
    heal: selfheal::Heal,
    install_logs_shipped: bool,
    next_watchdog: Instant,
    /// Workflow execution events waiting for the broker's acknowledgement.
    ingress: Outbox,
    acks_tx: crossbeam_channel::Sender<ingress::Tracked>,
    acked: Receiver<ingress::Acked>,
    control: Receiver<crate::control::Request>,
    next_rescan: Instant,
    draining: bool,
    /// `--drain-after-one`: a workload was started.
    one_started: bool,
    idle_since: Option<Instant>,
    metrics: operate::Metrics,
    next_metrics: Instant,
    /// GPU count and VRAM tier (hardware telemetry).
    gpus: (usize, Option<&'static str>),
    /// GPU inventory, health and accounting (D35–D38).
    gpu: gpus::Gpus,
    gpu_rx: Receiver<crate::gpu::Snapshot>,
    connected_once: bool,
    /// "node ready" (and READY=1) was announced.
    ready_announced: bool,
    next_prune: Instant,
    /// Full-disk errors are logged once a minute (D28).
    disk_errors: crate::logtext::Throttle,
    /// Workloads whose completion could not be written to disk: their record is removed once
    /// the backend acknowledged it (outbox sequence → safe id).
    retire_on_ack: HashMap<u64, String>,
    /// The warning about files straight in `results_folder` with capacity > 1 was given (D24).
    loose_results_warned: bool,
    /// When the broker last gave the session to another client (D33).
    taken_over_at: Option<Instant>,
    /// When the current connection was accepted, and recent connections that lasted less
    /// than [`SHORT_CONNECTION`] (D33).
    connected_at: Option<Instant>,
    short_connections: Vec<Instant>,
    /// The current connection was made at the first attempt after a loss (D33).
    connected_first_try: bool,
    /// The connect under way, and the current connection, started a clean session.
    connecting_clean: bool,
    connected_clean: bool,
    /// When to check that the connection the node believes in is still there.
    verify_connection_at: Option<Instant>,
}

impl Node {
    fn run(mut self, signals: Receiver<Signal>) -> i32 {
        self.start_connect();
        loop {
            let now = self.clock.now();
            let wait = self.next_wake(now).saturating_duration_since(now);
            select! {
                recv(self.events) -> ev => match ev {
                    Ok(ev) => self.on_mqtt(ev),
                    Err(_) => { log::error!("the MQTT client stopped"); self.exit = Some(EXIT_RUNTIME); }
                },
                recv(signals) -> sig => if let Ok(sig) = sig { self.on_signal(sig) },
                recv(self.reaped) -> r => if let Ok(r) = r { self.on_reaped(r.pid) },
                recv(self.spawned) -> o => match o {
                    Ok(o) => self.on_spawn_outcome(o),
                    Err(_) => self.on_spawner_gone(),
                },
                recv(self.chunks) -> c => if let Ok(c) = c { self.on_chunk(c) },
                recv(self.worker_done) -> d => if let Ok(d) = d { self.on_worker_done(d) },
                recv(self.acked) -> a => if let Ok(a) = a { self.on_ingress_ack(a) },
                recv(self.control) -> r => if let Ok(r) = r { self.on_control(r) },
                recv(self.gpu_rx) -> s => if let Ok(s) = s { self.on_gpu_snapshot(s) },
                default(wait) => {}
            }
            self.tick();
            if let Some(code) = self.exit {
                self.finish_starts();
                self.mqtt.disconnect(Duration::from_millis(500));
                log::info!("cyberwave-cloud-node stopped (exit code {code})");
                // Dropping the Paho client joins Paho C's worker threads, which poll with 1 s
                // timeouts: an exiting process has no use for that second. Every state file
                // was already written and synced when it changed.
                std::mem::forget(self);
                return code;
            }
        }
    }

    /// The earliest moment something is due: every timer that [`Node::tick`] acts on has its
    /// deadline here, so the loop sleeps exactly until then.
    fn next_wake(&self, now: Instant) -> Instant {
        let cap = if self.active.is_empty() {
            IDLE_TICK
        } else {
            BUSY_TICK
        };
        let mut t = now.checked_add(cap).unwrap_or(now);
        let mut due = |d: Instant| t = t.min(d);
        let open = self.shutdown.is_none();
        if let Conn::Disconnected { next_attempt, .. } = self.conn {
            if open {
                due(next_attempt);
            }
        }
        if let Registration::Needed { next_try, .. } = self.reg {
            if self.conn == Conn::Connected && open {
                due(next_try);
            }
        }
        if let Some(d) = self.hb.next_due {
            if self.reg == Registration::Done && open {
                due(d);
            }
        }
        for p in self.pending.values() {
            due(p.deadline);
        }
        if let Some(s) = &self.shutdown {
            due(s.deadline);
        }
        if let Some(v) = self.verify_connection_at {
            due(v);
        }
        // Stream passes only while a workload is tracked: its files may grow.
        if !self.active.is_empty() {
            due(self.next_stream_pass);
        }
        for a in self.active.values() {
            for d in workload_deadlines(a) {
                due(d);
            }
        }
        for (.., until) in &self.heal.deferred {
            due(*until);
        }
        if self.conn == Conn::Connected {
            if let Some(o) = self.outbox.next_try() {
                due(o);
            }
            if let Some(o) = self.ingress.head_next_try() {
                due(o);
            }
        }
        if self.outbox.has_pending_writes() {
            due(now.checked_add(DISK_RETRY).unwrap_or(now));
        }
        due(self.next_rescan);
        if self.s.metrics_file.is_some() {
            due(self.next_metrics);
        }
        if self.s.log_retention_days.value > 0 {
            due(self.next_prune);
        }
        if self.s.standalone && self.conn == Conn::Connected {
            due(self.next_watchdog);
        }
        if let Some(since) = self.idle_since {
            if self.s.drain_after_one && open && self.active.is_empty() {
                due(since
                    .checked_add(operate::DRAIN_AFTER_ONE_WAIT)
                    .unwrap_or(since));
            }
        }
        t
    }

    fn uuid(&self) -> &str {
        self.identity
            .as_ref()
            .map(|i| i.uuid.as_str())
            .unwrap_or("")
    }

    fn slug(&self) -> &str {
        self.identity
            .as_ref()
            .map(|i| i.slug.as_str())
            .unwrap_or("")
    }

    // ---- connection -------------------------------------------------------------------------

    fn start_connect(&mut self) {
        let attempt = match self.conn {
            Conn::Disconnected { attempt, .. } => attempt,
            _ => 0,
        };
        log::debug!(
            "connecting to {} (attempt {})",
            self.mqtt.endpoint(),
            attempt.saturating_add(1)
        );
        self.conn = Conn::Connecting { attempt };
        self.connecting_clean = self.mqtt.start_connect();
    }

    fn on_mqtt(&mut self, ev: MqttEvent) {
        match ev {
            MqttEvent::Connect(Ok(session_present)) => {
                log::info!(
                    "connected to MQTT broker {} ({})",
                    self.mqtt.endpoint(),
                    if session_present {
                        "session resumed"
                    } else {
                        "new session"
                    }
                );
                if !self.mqtt.is_connected() {
                    // The connection dropped between the CONNACK and now (its loss event came
                    // while the attempt was still open): never claim it (D34). The resumed
                    // session may hold a publish the broker refuses (the client resends it at
                    // once): the count below starts the next session clean.
                    let now = self.clock.now();
                    self.connected_first_try = matches!(self.conn, Conn::Connecting { attempt: 1 });
                    self.connected_clean = self.connecting_clean;
                    self.connected_at = Some(now);
                    self.schedule_reconnect(0, "the connection closed right after it opened");
                    return self.note_short_connection(now);
                }
                self.connected_first_try = matches!(self.conn, Conn::Connecting { attempt: 1 });
                self.connected_clean = self.connecting_clean;
                self.conn = Conn::Connected;
                self.connected_at = Some(self.clock.now());
                // A loss can race the connect's own outcome (its event then comes while the
                // attempt is open, and is dropped): look again shortly, even on an idle node.
                self.verify_connection_at = Some(util::later(self.clock.now(), VERIFY_CONNECTION));
                if self.connected_once {
                    self.metrics.reconnects = self.metrics.reconnects.saturating_add(1);
                }
                self.connected_once = true;
                // Renew every subscription on every connect: harmless when the broker kept the
                // session, essential when it did not.
                let mut topics = vec![self.topics.inbox()];
                topics.extend(self.command_topics.iter().cloned());
                self.mqtt.subscribe(&topics);
                self.flush_outbox();
                self.send_ingress();
            }
            MqttEvent::Connect(Err(why)) => {
                let attempt = match self.conn {
                    Conn::Connecting { attempt } => attempt,
                    _ => 0,
                };
                self.schedule_reconnect(attempt, &why);
            }
            MqttEvent::Lost(why) => {
                if matches!(self.conn, Conn::Connected) {
                    self.connection_lost(&why);
                } else if matches!(self.conn, Conn::Connecting { .. }) {
                    // Maybe this attempt's connection, lost before its outcome arrived: check
                    // soon after the outcome (a stale loss of the last connection is harmless).
                    self.verify_connection_at =
                        Some(util::later(self.clock.now(), Duration::from_millis(100)));
                }
            }
            MqttEvent::TakenOver => self.session_taken_over(),
            MqttEvent::Subscribed(result) => self.on_subscribed(result),
            MqttEvent::Message {
                topic,
                payload,
                correlation,
            } => {
                if topic == self.topics.inbox() {
                    self.on_reply(correlation, &payload);
                } else if self.command_topics.contains(&topic) {
                    self.on_command(&payload);
                } else if self.reg != Registration::Done && self.topics.is_command_topic(&topic) {
                    // A resumed session delivers queued commands before registration is done:
                    // keep them (bounded) and handle them once the node is registered.
                    if self.early_commands.len() < MAX_EARLY_COMMANDS {
                        self.early_commands.push(payload);
                    } else {
                        log::warn!(
                            "dropped a command that arrived before registration: too many queued"
                        );
                    }
                } else {
                    log::debug!(
                        "message on unexpected topic {} ignored",
                        crate::logtext::shown(&topic)
                    );
                }
            }
        }
    }

    /// The connection is gone: reconnect with backoff; what was in flight goes again, except
    /// what the broker refused too often (D34).
    fn connection_lost(&mut self, why: &str) {
        // A loss while messages were in flight may be the broker refusing one of them (D34),
        // not another client taking the session (D33).
        let publishing = self.outbox.in_flight_count() > 0 || self.ingress.in_flight_count() > 0;
        self.schedule_reconnect(0, why);
        if !publishing {
            self.note_short_connection(self.clock.now());
        }
        // Outbox messages in flight are sent again after the reconnect.
        self.pending.retain(|_, p| !matches!(p.op, Op::Outbox(_)));
        let refused = self.outbox.reset_in_flight();
        let refused_events = self.ingress.reset_in_flight();
        let mut any_refused = false;
        for (item, aside) in refused.into_iter().chain(refused_events) {
            any_refused = true;
            log::error!(
                "the broker dropped the connection each of the last {} times the {} was sent; it is set aside in {} and not sent again",
                crate::outbox::MAX_REFUSALS,
                crate::logtext::shown(&item.label),
                aside.display()
            );
        }
        if any_refused {
            // The refused message also sits in the MQTT session (client and broker resend an
            // unacknowledged QoS 1 publish on resume): start the next one clean.
            self.mqtt.clean_start_next();
        }
        self.reset_streams();
    }

    /// D33: the broker gave this node's session to another client with the same client id
    /// (MQTT v5 reason 0x8E). Twice within a minute means another node runs with a copy of
    /// this state dir.
    fn session_taken_over(&mut self) {
        let now = self.clock.now();
        let recent = self
            .taken_over_at
            .is_some_and(|t| now.saturating_duration_since(t) <= Duration::from_secs(60));
        self.taken_over_at = Some(now);
        let why = "the broker gave this node's session to another client (MQTT reason 0x8E)";
        if matches!(self.conn, Conn::Connected) {
            self.connection_lost(why);
        } else {
            log::warn!("{why}");
        }
        if recent {
            self.duplicate_client_id("the broker took the session over twice within a minute");
        }
    }

    /// Not every broker or client library reports reason 0x8E: a connection that the broker
    /// closes within seconds of accepting it, three times within a minute, is the same sign.
    fn note_short_connection(&mut self, now: Instant) {
        // A broker that restarts refuses the first reconnect; a takeover does not: only a
        // connection made at the first attempt after a loss counts.
        let short = self.connected_first_try
            && self
                .connected_at
                .is_some_and(|t| now.saturating_duration_since(t) <= SHORT_CONNECTION);
        if !short {
            return;
        }
        // Something in the resumed session may be what the broker refuses (a QoS 1 publish the
        // client resends on every resume): the next session starts clean. Only connections
        // that were clean already count towards a duplicate client id, which a clean session
        // does not cure (D33, D34).
        self.mqtt.clean_start_next();
        if !self.connected_clean {
            return;
        }
        self.short_connections
            .retain(|t| now.saturating_duration_since(*t) <= Duration::from_secs(60));
        self.short_connections.push(now);
        if self.short_connections.len() >= 3 {
            self.short_connections.clear();
            self.duplicate_client_id(
                "the broker closed the connection right after accepting it 3 times within a minute",
            );
        }
    }

    /// Says that another client uses this node's client id, records it for `doctor`, and waits
    /// at least 30 s between attempts so the two do not take the session from each other
    /// several times a second (D33).
    fn duplicate_client_id(&mut self, sign: &str) {
        let now = self.clock.now();
        let client_id = self.topics.client_id().to_string();
        log::error!(
            "another client uses this node's MQTT client id {client_id} ({sign}); most likely a copy of this state dir {} runs on another host, and each takes the session from the other. Give the copy its own identity: stop it, delete node_id and instance_identity.json in its state dir, start it again. Reconnecting in 30 s",
            self.layout.state.display()
        );
        let marker = self.layout.state.join(CLIENT_ID_CONFLICT);
        let _ = crate::store::write_atomic(
            &marker,
            crate::util::rfc3339(SystemTime::now()).as_bytes(),
            0o600,
        );
        if let Conn::Disconnected {
            next_attempt,
            attempt,
        } = self.conn
        {
            self.conn = Conn::Disconnected {
                next_attempt: next_attempt.max(crate::util::later(now, DUPLICATE_ID_BACKOFF)),
                attempt,
            };
        }
    }

    fn schedule_reconnect(&mut self, attempt: u32, why: &str) {
        // Several broker addresses (a cluster): the next attempt goes to the next one.
        self.mqtt.next_endpoint();
        let t = &self.s.tuning;
        let delay = util::backoff_full_jitter(attempt, t.reconnect_base, t.reconnect_max);
        let next = if self.mqtt.endpoint_count() > 1 {
            format!(" on {}", self.mqtt.endpoint())
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
            next_attempt: util::later(self.clock.now(), delay),
            attempt: attempt.saturating_add(1),
        };
    }

    // ---- requests -----------------------------------------------------------------------------

    fn request(&mut self, op: Op, topic: &str, body: Value, timeout: Duration) -> Vec<u8> {
        let corr = util::random_bytes::<16>().to_vec();
        let payload = serde_json::to_vec(&body).unwrap_or_default();
        self.mqtt
            .publish_request(topic, payload, &self.topics.inbox(), &corr, &self.token);
        self.pending.insert(
            corr.clone(),
            Pending {
                op,
                deadline: util::later(self.clock.now(), timeout),
            },
        );
        corr
    }

    fn on_reply(&mut self, correlation: Option<Vec<u8>>, payload: &[u8]) {
        let Some(p) = correlation.as_ref().and_then(|c| self.pending.remove(c)) else {
            log::debug!("reply with no matching request dropped (late or foreign)");
            return;
        };
        let reply = Reply::parse(payload);
        let corr = correlation.unwrap_or_default();
        self.on_outcome(p.op, Some(reply), &corr);
    }

    /// A request's reply (`Some`) or its timeout (`None`).
    fn on_outcome(&mut self, op: Op, body: Option<Reply>, corr: &[u8]) {
        match op {
            Op::Create => self.on_create_reply(body),
            Op::Register => self.on_register_reply(body),
            Op::Heartbeat => self.on_heartbeat_reply(body),
            Op::Outbox(seq) => self.on_outbox_reply(seq, body),
            Op::Log(key) => self.on_log_ack(&key, body.as_ref().is_some_and(|b| b.success)),
            Op::SignedUrl(id) => self.on_signed_url_reply(&id, body.map(|b| b.body)),
            Op::UploadResults(id) => {
                self.on_upload_reply(&id, body.as_ref().is_some_and(|b| b.success))
            }
            Op::WorkloadStatus => match body {
                Some(b) if b.success => {}
                Some(b) => log::warn!(
                    "workload status update refused: {}",
                    crate::logtext::shown(&b.message)
                ),
                None => log::warn!("workload status update not acknowledged in time"),
            },
            Op::Terminate | Op::Fail => {
                if body.is_none() {
                    log::warn!("the backend did not acknowledge the {op:?} notice in time");
                }
                if let Some(s) = &mut self.shutdown {
                    if s.waiting_for.as_deref() == Some(corr) {
                        s.waiting_for = None;
                        s.deadline = self.clock.now();
                    }
                }
            }
        }
    }

    // ---- registration (R1, R2) ----------------------------------------------------------------

    fn send_registration_step(&mut self, attempt: u32, create: bool) {
        let mut body = json!({"profile_slug": self.s.profile_slug.value});
        if let Some(e) = &self.s.environment_uuid {
            util::set(&mut body, "environment_uuid", json!(e.value));
        }
        if create {
            util::set(&mut body, "provider", json!("self-hosted"));
            util::set(&mut body, "visibility", json!("private"));
            if let Some(slug) = &self.s.slug_hint {
                util::set(&mut body, "slug", json!(slug.value));
            }
            log::info!("registering: asking the backend for a new instance (R1)");
            let topic = self.topics.request_instance(&self.token);
            self.request(Op::Create, &topic, body, self.s.tuning.request_timeout);
            self.reg = Registration::AwaitingCreate { attempt };
        } else {
            let uuid = self.known_uuid().unwrap_or_default();
            self.send_register(attempt, uuid, None, body);
        }
    }

    fn send_register(&mut self, attempt: u32, uuid: String, slug: Option<String>, body: Value) {
        log::info!("registering instance {} (R2)", crate::logtext::shown(&uuid));
        let topic = self.topics.register(&uuid);
        self.request(Op::Register, &topic, body, self.s.tuning.request_timeout);
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
            .or_else(|| self.s.instance_uuid.as_ref().map(|u| u.value.clone()))
            .filter(|u| !u.is_empty())
    }

    fn registration_failed(&mut self, why: &str, create: bool) {
        let attempt = match &self.reg {
            Registration::AwaitingCreate { attempt }
            | Registration::AwaitingRegister { attempt, .. } => *attempt,
            Registration::Needed { attempt, .. } => *attempt,
            Registration::Done => 0,
        };
        let delay = util::backoff_full_jitter(
            attempt,
            Duration::from_millis(500),
            self.s.tuning.register_retry_max,
        );
        log::warn!(
            "registration failed: {}; retrying in {:.1}s",
            crate::logtext::shown(why),
            delay.as_secs_f64()
        );
        self.reg = Registration::Needed {
            next_try: util::later(self.clock.now(), delay),
            attempt: attempt.saturating_add(1),
            create,
        };
    }

    fn on_create_reply(&mut self, body: Option<Reply>) {
        let Registration::AwaitingCreate { attempt } = self.reg else {
            return;
        };
        let Some(body) = body else {
            return self.registration_failed("no reply to the instance request", true);
        };
        let uuid = body.uuid.map(|u| u.as_str().to_string());
        let slug = body.slug.map(|u| u.as_str().to_string());
        match (body.success, uuid) {
            (true, Some(uuid)) => {
                let mut req = json!({"profile_slug": self.s.profile_slug.value});
                if let Some(e) = &self.s.environment_uuid {
                    util::set(&mut req, "environment_uuid", json!(e.value));
                }
                self.send_register(attempt, uuid, slug, req);
            }
            (true, None) => {
                self.registration_failed("the backend created an instance but sent no uuid", true)
            }
            (false, _) => {
                let why = format!(
                    "instance creation refused: {}",
                    crate::logtext::shown(&body.message)
                );
                self.registration_failed(&why, true)
            }
        }
    }

    fn on_register_reply(&mut self, body: Option<Reply>) {
        let Registration::AwaitingRegister { uuid, slug, .. } = self.reg.clone() else {
            return;
        };
        let Some(body) = body else {
            return self.registration_failed("no reply to the registration", false);
        };
        if !body.success {
            if body.code == Some(404) {
                // D6: the instance no longer exists; create a new one.
                log::warn!(
                    "instance {} is unknown to the backend; creating a new instance",
                    crate::logtext::shown(&uuid)
                );
                self.identity = None;
                self.reg = Registration::Needed {
                    next_try: self.clock.now(),
                    attempt: 0,
                    create: true,
                };
                return;
            }
            let why = format!(
                "registration refused: {}",
                crate::logtext::shown(&body.message)
            );
            return self.registration_failed(&why, false);
        }
        let uuid = body.uuid.map_or(uuid, |u| u.as_str().to_string());
        let slug = body
            .slug
            .map(|s| s.as_str().to_string())
            .or(slug)
            .or_else(|| self.s.slug_hint.as_ref().map(|s| s.value.clone()))
            .unwrap_or_else(|| format!("cn-{}", uuid.chars().take(8).collect::<String>()));
        let identity = Identity {
            uuid,
            slug,
            workspace_slug: self.s.workspace_slug.as_ref().map(|w| w.value.clone()),
            registered_at: Some(util::rfc3339(SystemTime::now())),
            standalone: false,
        };
        self.become_registered(identity);
    }

    fn become_registered(&mut self, identity: Identity) {
        if let Err(e) = identity.save(&self.s.identity_path()) {
            log::error!(
                "cannot save the instance identity to {}: {e}",
                self.s.identity_path().display()
            );
        }
        self.reg = Registration::Done;
        self.identity = Some(identity);
        if let Some(err) = self.startup_failure.clone() {
            let uuid = self.uuid().to_string();
            log::error!("reporting the start-up failure to the backend, then exiting");
            if self.s.standalone {
                return self.begin_shutdown(EXIT_RUNTIME, "start-up failed");
            }
            let topic = self.topics.fail(&uuid);
            let corr = self.request(
                Op::Fail,
                &topic,
                json!({"instance_uuid": uuid, "error": err}),
                self.s.tuning.heartbeat_timeout,
            );
            self.begin_shutdown(EXIT_RUNTIME, "start-up failed");
            if let Some(s) = &mut self.shutdown {
                s.waiting_for = Some(corr);
            }
            return;
        }
        let new_topics = vec![
            self.topics.command(self.uuid()),
            self.topics.command(self.slug()),
        ];
        for old in self
            .command_topics
            .iter()
            .filter(|t| !new_topics.contains(t))
        {
            self.mqtt.unsubscribe(old);
        }
        self.command_topics = new_topics;
        self.ready_announced = false;
        // Ready only once the broker confirmed the subscriptions: a command published before
        // the SUBACK would have no subscription to land on.
        self.mqtt.subscribe_confirmed(&self.command_topics);
        self.ship_install_logs();
        for payload in std::mem::take(&mut self.early_commands) {
            self.on_command(&payload);
        }
    }

    /// The command subscriptions are confirmed (or failed: the next connect renews them).
    fn on_subscribed(&mut self, result: Result<(), String>) {
        if self.ready_announced || self.reg != Registration::Done || self.command_topics.len() < 2 {
            return;
        }
        if let Err(e) = result {
            log::warn!("the broker did not confirm the command subscriptions ({e}); they are renewed on the next connect");
        }
        self.ready_announced = true;
        crate::systemd::notify("READY=1");
        // Heartbeats start with readiness: the backend never sees a node beat that cannot yet
        // take commands (and systemd hears READY=1 before any WATCHDOG=1).
        if !self.s.standalone {
            self.hb.next_due = Some(self.clock.now());
        }
        log::info!(
            "node ready: instance {} (slug {}){}; commands on {} and {}",
            crate::logtext::shown(self.uuid()),
            crate::logtext::shown(self.slug()),
            self.s
                .environment_uuid
                .as_ref()
                .map(|e| format!(", reserved for environment {}", e.value))
                .unwrap_or_default(),
            self.command_topics.first().map_or("", String::as_str),
            self.command_topics.get(1).map_or("", String::as_str)
        );
    }

    // ---- heartbeat (R3) -------------------------------------------------------------------------

    fn send_heartbeat(&mut self) {
        // Self-heal runs beside the heartbeat, never in front of it.
        self.start_heal_pass();
        let interval = self.s.heartbeat_interval.value;
        let r = u64::from_le_bytes(util::random_bytes::<8>());
        self.hb.next_due = beat_due(self.clock.now(), interval, r);
        if self.conn != Conn::Connected {
            self.hb.failures = self.hb.failures.saturating_add(1);
            log::debug!("heartbeat skipped: not connected");
            return;
        }
        let body = json!({
            "node_version": crate::cli::VERSION,
            "active_workloads": self.active.len(),
            "max_concurrent_workloads": self.s.max_concurrent_workloads.value,
                        "accepting": self.shutdown.is_none() && !self.draining,
            "draining": self.draining,
            "uptime_s": self.started.elapsed().as_secs(),
        });
        let mut body = body;
        self.gpu_heartbeat(&mut body);
        if let Some(h) = self.hardware() {
            util::set(&mut body, "hardware", h);
        }
        let topic = self.topics.heartbeat(self.uuid());
        self.request(Op::Heartbeat, &topic, body, self.s.tuning.heartbeat_timeout);
    }

    fn on_heartbeat_reply(&mut self, body: Option<Reply>) {
        if self.shutdown.is_some() || self.reg != Registration::Done {
            return;
        }
        let interval = self.s.heartbeat_interval.value;
        let now = self.clock.now();
        let verdict = self
            .hb
            .on_reply(body.as_ref(), now, interval, self.s.tuning.auth_retry_base);
        match verdict {
            session::Verdict::Ok { recovered } => {
                if recovered {
                    log::info!("heartbeats acknowledged again");
                }
                // The watchdog is fed only while the backend acknowledges heartbeats.
                crate::systemd::notify("WATCHDOG=1");
            }
            session::Verdict::GiveUp { n } => {
                log::error!("the backend rejected the API token on {n} heartbeats in a row: it is invalid or revoked; shutting down");
                self.begin_shutdown(EXIT_CREDENTIALS, "token rejected");
            }
            session::Verdict::AuthRetry { n, delay } => {
                log::warn!(
                    "heartbeat rejected: authentication failed ({n}/{}); retrying in {:.1}s",
                    session::MAX_AUTH_FAILURES,
                    delay.as_secs_f64()
                );
            }
            session::Verdict::Gone => {
                // D5: the instance is gone; register a new one and move the subscriptions.
                log::warn!(
                    "the backend says instance {} is gone ({}); registering a new instance",
                    crate::logtext::shown(self.uuid()),
                    crate::logtext::shown(body.as_ref().map_or("", |b| b.message.as_str()))
                );
                self.pending.retain(|_, p| p.op != Op::Heartbeat);
                if let Some(i) = &mut self.identity {
                    i.uuid.clear();
                }
                self.s.instance_uuid = None;
                self.reg = Registration::Needed {
                    next_try: now,
                    attempt: 0,
                    create: true,
                };
            }
            session::Verdict::Failed { n, alarm } => {
                self.metrics.heartbeat_failures = self.metrics.heartbeat_failures.saturating_add(1);
                let why = match &body {
                    Some(b) => format!("refused: {}", b.message),
                    None => "no reply in time".to_string(),
                };
                if alarm {
                    log::error!("heartbeat failed {n} times in a row ({}); the backend may reap this instance", crate::logtext::shown(&why));
                } else {
                    log::warn!("heartbeat failed ({})", crate::logtext::shown(&why));
                }
            }
        }
    }

    // ---- commands -------------------------------------------------------------------------------

    fn on_command(&mut self, payload: &[u8]) {
        let (request_id, command) = match messages::parse_command(payload) {
            Incoming::Echo => return,
            Incoming::Invalid {
                request_id: Some(rid),
                reason,
                workload_uuid,
            } => {
                log::warn!(
                    "refused a command (request {}): {}",
                    crate::logtext::shown(&messages::request_id_text(&rid)),
                    crate::logtext::shown(&reason)
                );
                if let Some(wl) = workload_uuid {
                    let body =
                        json!({"status": "failed", "error": reason, "failure_detail": reason});
                    self.workload_status(wl.as_str(), body);
                }
                return self.reply_error(&rid, &reason);
            }
            Incoming::Invalid {
                request_id: None,
                reason,
                ..
            } => {
                log::warn!(
                    "ignored a command without a readable request id: {}",
                    crate::logtext::shown(&reason)
                );
                return;
            }
            Incoming::Command {
                request_id,
                command,
            } => (request_id, command),
        };
        log::info!(
            "command {} (request {})",
            command.name(),
            crate::logtext::shown(&request_id.text())
        );
        let rid = request_id.value();
        // A start is refused by its own guard, as a retryable "host busy" (D21).
        let start = matches!(
            command,
            Command::Start(..) | Command::Received(Received::Start(..))
        );
        if self.shutdown.is_some() && !start {
            return self.reply_error(rid, "node is shutting down and not accepting new commands");
        }
        match command {
            Command::Status => {
                let out = self.status_output();
                self.reply_ok(rid, out);
            }
            Command::Start(kind, params) => self.on_start(kind, rid, params),
            Command::Cancel(params) => self.cancel(&request_id, params),
            Command::Received(Received::Start(kind, params)) => self.on_start(kind, rid, params),
            Command::Received(Received::Ack(uuid)) => {
                let shown = uuid.as_ref().map_or("None", |u| u.as_str());
                self.reply_ok(
                    rid,
                    json!({"message": format!("Workload {shown} received and acknowledged")}),
                );
            }
        }
    }

    fn on_start(&mut self, kind: Kind, request_id: &Value, params: StartParams) {
        if let (Some(mine), Some(theirs)) = (&self.s.environment_uuid, &params.environment_uuid) {
            if mine.value != theirs.as_str() {
                return self.reply_error(
                    request_id,
                    &format!("this node is reserved for environment {}; refusing a workload for environment {theirs}", mine.value),
                );
            }
        }
        self.start_workload(kind, request_id, params);
    }

    fn status_output(&self) -> Value {
        let mut out = json!({
            "slug": self.slug(),
            "instance_uuid": self.uuid(),
            "profile_slug": self.s.profile_slug.value,
            "has_inference": self.s.inference.is_some(),
            "has_simulate": self.s.simulate.is_some(),
            "has_training": self.s.training.is_some(),
                        "is_busy": self.active.len() >= self.s.max_concurrent_workloads.value as usize,
            "active_workloads": self.active_workloads_json(),
                        "max_concurrent_workloads": self.s.max_concurrent_workloads.value,
            "accepting": self.shutdown.is_none() && !self.draining,
            "draining": self.draining,
            "environment_uuid": self.s.environment_uuid.as_ref().map(|e| e.value.clone()),
            "node_version": crate::cli::VERSION,
        });
        if let Some(g) = self.gpu_status() {
            gpus::put(&mut out, "gpus", g);
        }
        self.add_starting(&mut out, "active_workloads");
        out
    }

    fn reply_ok(&self, request_id: &Value, output: Value) {
        self.publish_reply(true, request_id, output);
    }

    fn reply_error(&self, request_id: &Value, error: &str) {
        self.publish_reply(false, request_id, json!(error));
    }

    fn publish_reply(&self, ok: bool, request_id: &Value, body: Value) {
        let payload = messages::reply(ok, request_id, self.slug(), self.uuid(), body);
        let topic = self.topics.reply(self.uuid());
        // D12: QoS 1 so a reply survives a short outage (Paho buffers it).
        self.mqtt
            .publish(&topic, payload, 1, paho_mqtt::Properties::new());
    }

    // ---- the control socket ---------------------------------------------------------------------

    fn on_control(&mut self, req: crate::control::Request) {
        let Some(req) = self.hold_for_start(req) else {
            return;
        };
        let op = req.body.get("op").and_then(Value::as_str).unwrap_or("");
        let reply = match op {
            "emit" => self.on_emit(&req.body),
            "drain" | "resume" => {
                self.set_draining(op == "drain", "asked on the control socket");
                json!({"ok": true, "draining": self.draining, "active_workloads": self.active.len()})
            }
            "status" => json!({"ok": true, "status": self.local_status()}),
            other => json!({"ok": false, "error": format!("unknown op {other:?}")}),
        };
        let _ = req.reply.send(reply);
    }

    /// What `cyberwave-cloud-node status` shows about a running node.
    fn local_status(&self) -> Value {
        let mut out = json!({
            "running": true,
            "pid": std::process::id(),
            "instance_uuid": self.uuid(),
            "slug": self.slug(),
            "environment_uuid": self.s.environment_uuid.as_ref().map(|e| e.value.clone()),
            "broker": self.mqtt.endpoint(),
            "connected": self.conn == Conn::Connected,
            "registered": self.reg == Registration::Done,
            "last_heartbeat_ok": self.hb.last_ok.map(util::rfc3339),
                        "accepting": self.shutdown.is_none() && !self.draining,
            "draining": self.draining,
            "max_concurrent_workloads": self.s.max_concurrent_workloads.value,
            "workloads": self.active.values().map(|a| crate::node::with_gpus(json!({
                "pid": a.meta.pid(),
                "type": a.meta.kind,
                "request_id": a.meta.request_id,
                "workload_uuid": a.meta.workload_uuid,
                "state": a.state(),
                "running_for_seconds": (crate::workload::unix_now() - a.meta.created_unix).max(0.0) as u64,
                "stdout_log": a.meta.stdout_log,
                "stderr_log": a.meta.stderr_log,
            }), &a.meta)).collect::<Vec<_>>(),
            "outbox": self.outbox.len(),
            "ingress_queue": self.ingress.len(),
        });
        if let Some(g) = self.gpu_status() {
            gpus::put(&mut out, "gpus", g);
        }
        self.add_starting(&mut out, "workloads");
        out
    }

    // ---- signals and shutdown -------------------------------------------------------------------

    fn on_signal(&mut self, sig: Signal) {
        match sig {
            Signal::Term | Signal::Int => {
                if self.shutdown.is_some() {
                    log::warn!("second {sig:?}: exiting now");
                    self.exit = Some(EXIT_OK);
                    return;
                }
                self.begin_shutdown(EXIT_OK, &format!("{sig:?} received"));
            }
            Signal::Hup => {
                log::info!("SIGHUP ignored (restart the service to reload the configuration)")
            }
            Signal::Usr1 => self.set_draining(true, "SIGUSR1"),
            Signal::Usr2 => self.set_draining(false, "SIGUSR2"),
        }
    }

    fn begin_shutdown(&mut self, exit_code: i32, why: &str) {
        if self.shutdown.is_some() {
            return;
        }
        crate::systemd::notify("STOPPING=1");
        log::info!("shutting down ({why}); running workloads are left running");
        self.log_running_workloads();
        let now = self.clock.now();
        self.hb.next_due = None;
        let mut waiting_for = None;
        if self.reg == Registration::Done
            && self.conn == Conn::Connected
            && !self.s.standalone
            && self.startup_failure.is_none()
        {
            let topic = self.topics.terminate(self.uuid());
            waiting_for = Some(self.request(
                Op::Terminate,
                &topic,
                json!({}),
                self.s.tuning.shutdown_flush,
            ));
        }
        let deadline = if waiting_for.is_some() {
            util::later(now, self.s.tuning.shutdown_flush)
        } else {
            now
        };
        self.shutdown = Some(Shutdown {
            deadline,
            exit_code,
            waiting_for,
        });
    }

    // ---- timers ---------------------------------------------------------------------------------

    fn tick(&mut self) {
        let now = self.clock.now();
        if self.verify_connection_at.is_some_and(|v| now >= v) {
            self.verify_connection_at = None;
        }
        if self.conn == Conn::Connected && !self.mqtt.is_connected() {
            // A loss the client did not report as an event still is one (D34).
            self.connection_lost("the connection is gone");
        }
        if let Conn::Disconnected { next_attempt, .. } = self.conn {
            if now >= next_attempt && self.shutdown.is_none() {
                self.start_connect();
            }
        }
        // Expired requests.
        let expired: Vec<Vec<u8>> = self
            .pending
            .iter()
            .filter(|(_, p)| now >= p.deadline)
            .map(|(k, _)| k.clone())
            .collect();
        for corr in expired {
            if let Some(p) = self.pending.remove(&corr) {
                self.on_outcome(p.op, None, &corr);
            }
        }
        if self.conn == Conn::Connected && self.shutdown.is_none() {
            if let Registration::Needed {
                next_try,
                attempt,
                create,
            } = self.reg
            {
                if self.s.standalone {
                    // No backend: the node's own identity stands in for a registration.
                    if let Some(identity) = self.identity.clone() {
                        self.become_registered(identity);
                    }
                } else if now >= next_try {
                    let create = create || self.known_uuid().is_none();
                    self.send_registration_step(attempt, create);
                }
            }
        }
        self.tick_workloads();
        self.retry_deferred_starts();
        if now >= self.next_rescan {
            // Events `emit` queued by itself while the node was unreachable.
            self.ingress.rescan();
            let every = if self.active.is_empty() && self.ingress.is_empty() {
                RESCAN_IDLE
            } else {
                RESCAN_BUSY
            };
            self.next_rescan = now.checked_add(every).unwrap_or(now);
        }
        self.send_ingress();
        self.check_drain_after_one(now);
        self.write_metrics(now);
        self.prune_old_files(now);
        if self.s.standalone && self.conn == Conn::Connected && now >= self.next_watchdog {
            // No heartbeats without a backend: a live broker connection feeds the watchdog.
            crate::systemd::notify("WATCHDOG=1");
            self.next_watchdog = util::later(now, Duration::from_secs(10));
        }
        self.flush_outbox();
        if now >= self.next_stream_pass && !self.active.is_empty() {
            self.pump_streams(true);
        }
        if let Some(due) = self.hb.next_due {
            if now >= due && self.reg == Registration::Done && self.shutdown.is_none() {
                self.send_heartbeat();
            }
        }
        if let Some(s) = &self.shutdown {
            if now >= s.deadline {
                self.exit = Some(s.exit_code);
            }
        }
    }
}

/// A workload's status entry, with its GPUs when it has an assignment.
fn with_gpus(mut w: Value, meta: &crate::workload::Meta) -> Value {
    if let Some(g) = &meta.gpus {
        gpus::put(&mut w, "gpus", json!(g));
    }
    w
}

/// When the next heartbeat is due (D39): `interval` ± up to 10 %, placed by `random` (uniform
/// over all u64), so a fleet started together does not beat in the same instant. Integer
/// arithmetic: the due time is always in [0.9 × interval, 1.1 × interval). `None` only if the
/// moment is beyond what the clock can hold.
pub fn beat_due(now: Instant, interval: Duration, random: u64) -> Option<Instant> {
    let nanos = interval.as_nanos();
    let spread = nanos / 10;
    // random / 2^64 of the whole band (2 × spread), from its low end.
    let offset = spread
        .checked_mul(2)?
        .checked_mul(u128::from(random))?
        .checked_shr(64)?;
    let after = nanos.checked_sub(spread)?.checked_add(offset)?;
    let secs = u64::try_from(after / 1_000_000_000).ok()?;
    let sub = u32::try_from(after % 1_000_000_000).ok()?;
    now.checked_add(Duration::new(secs, sub))
}

/// The moments a tracked workload's timers in `tick_workloads` fall due.
/// Each is counted only in the state in which `tick_workloads` acts on it, so a deadline that
/// has passed never keeps the loop spinning.
fn workload_deadlines(a: &Active) -> impl Iterator<Item = Instant> + '_ {
    use crate::workload::lifecycle::Phase;
    let lingering = matches!(a.phase, Phase::Lingering { .. });
    let adopted = !a.child && matches!(a.phase, Phase::Running | Phase::Cancelling { .. });
    [
        a.runtime_deadline
            .filter(|_| a.meta.cancel.is_none() && !a.finished()),
        a.phase.deadline(),
        a.upload
            .as_ref()
            .filter(|u| !u.busy && matches!(a.phase, Phase::Uploading { .. }))
            .and_then(|u| u.retry_at),
        (lingering || adopted).then_some(a.next_check),
    ]
    .into_iter()
    .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeats_spread_within_ten_percent_of_the_interval() {
        let now = Instant::now();
        let i = Duration::from_secs(30);
        let at = |r| beat_due(now, i, r).unwrap() - now;
        // The ends and the middle of the random range.
        assert_eq!(at(0), Duration::from_secs(27));
        assert_eq!(at(1u64 << 63), Duration::from_secs(30));
        let top = at(u64::MAX);
        assert!(
            top < Duration::from_secs(33) && top > Duration::from_millis(32_999),
            "{top:?}"
        );
        // Every random value lands inside the band, and the band is used (not one phase).
        let mut seen = std::collections::BTreeSet::new();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let d = at(x);
            assert!(
                d >= Duration::from_secs(27) && d < Duration::from_secs(33),
                "{d:?}"
            );
            seen.insert(d.as_millis() / 600);
        }
        assert_eq!(
            seen.len(),
            10,
            "10 bands of 600 ms between 27 s and 33 s: {seen:?}"
        );
    }

    #[test]
    fn heartbeat_spread_survives_extreme_intervals() {
        let now = Instant::now();
        assert_eq!(beat_due(now, Duration::ZERO, 12345), Some(now));
        let tiny = beat_due(now, Duration::from_nanos(1), u64::MAX).unwrap();
        assert!(tiny - now <= Duration::from_nanos(2));
        // Beyond the clock: no due time rather than a panic.
        assert_eq!(beat_due(now, Duration::MAX, u64::MAX), None);
    }
}
