//! The node: start-up (install script → token check → MQTT), then one event loop on the main
//! thread that owns every piece of state and selects over the feeders' channels. Nothing in the
//! loop waits on the network: requests are published and their replies (or deadlines) come
//! back as events. The loop sleeps until the next real deadline ([`Node::next_wake`]): an idle
//! node wakes for its heartbeat and little else; while workloads run it wakes at least every
//! [`BUSY_TICK`].

mod admit;
mod cancel;
mod commands;
mod container;
mod gpus;
mod ingress;
mod interrupted;
mod io;
pub mod operate;
mod selfheal;
mod session;
mod shutdown;
mod starts;
pub mod startup;
pub mod streams;
mod streams_out;
mod table;
mod table_out;
mod uploads;
mod workloads;

use std::time::{Duration, Instant};

use crossbeam_channel::{select, Receiver};
use serde_json::{json, Value};

// Exit codes are chosen in `error.rs` alone (the binary's edge, `app.rs`, is not imported here).
const EXIT_OK: i32 = crate::error::Exit::Ok.code();
const EXIT_RUNTIME: i32 = crate::error::Exit::Runtime.code();
const EXIT_CREDENTIALS: i32 = crate::error::Exit::Credentials.code();
use crate::config::Settings;
use crate::ledger::Ledger;
use crate::mqtt::MqttEvent;
use crate::outbox::Outbox;
use crate::protocol::replies::Reply;
use crate::signals::Signal;
use crate::util;
use crate::workload::tail::Key;
use io::Wire;
use session::{Happening, Session};
use shutdown::Shutdown;

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
/// Written into the state dir when another client takes the session over twice within a
/// minute; `doctor` fails while it is recent.
pub use crate::store::CLIENT_ID_CONFLICT;

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

#[derive(Debug, Clone, PartialEq)]
enum Op {
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

pub struct Node {
    s: Settings,
    /// The I/O handles: MQTT client, feeders' channels, threads.
    io: io::Io,
    /// The broker session: connection, registration, heartbeat, requests awaiting replies.
    session: Session<Op>,
    /// Uptime, draining, the shutdown under way, the exit code once decided.
    life: Life,
    /// Active workloads by safe id.
    active: table::Table,
    ledger: Ledger,
    outbox: Outbox,
    /// Starts in flight, and those the node before this one took and did not answer (D53).
    starts: starts::Starts,
    /// Every workload's log streams (their cursors, pace and install-log shipping).
    streams: streams::Streams,
    heal: selfheal::Heal,
    /// Workflow execution events and the node's own reports of them.
    ingress: ingress::Ingress,
    metrics: operate::Metrics,
    /// GPU inventory, health, accounting (D35–D38) and the telemetry's count and VRAM tier.
    gpu: gpus::Gpus,
    /// When the loop's own periodic work is next due.
    due: Due,
    throttle: Throttles,
}

/// The node's life: since when it runs, the shutdown under way, the exit code once decided.
struct Life {
    started: Instant,
    shutdown: Option<Shutdown>,
    exit: Option<i32>,
    /// Draining (no new workloads) and `--drain-after-one`.
    drain: Drain,
}

/// Draining: new workloads are refused while it is on.
#[derive(Default)]
struct Drain {
    on: bool,
    /// `--drain-after-one`: a workload was started.
    one_started: bool,
    idle_since: Option<Instant>,
}

/// When the loop's periodic work is next due.
struct Due {
    /// A standalone node's watchdog ping (no heartbeats feed it).
    watchdog: Instant,
    /// Looking for events `emit` queued by itself.
    rescan: Instant,
    metrics: Instant,
    prune: Instant,
}

/// Errors logged at most once a minute.
#[derive(Default)]
struct Throttles {
    /// Full-disk errors (D28).
    disk: crate::logtext::Throttle,
    /// Requests the broker refused in its PUBACK (D34).
    refusals: crate::logtext::Throttle,
}

impl Node {
    fn run(mut self, signals: Receiver<Signal>) -> i32 {
        self.tick();
        loop {
            let now = self.io.clock.now();
            let wait = self.next_wake(now).saturating_duration_since(now);
            select! {
                recv(self.io.events) -> ev => match ev {
                    Ok(ev) => self.on_mqtt(ev),
                    Err(_) => { log::error!("the MQTT client stopped"); self.life.exit = Some(EXIT_RUNTIME); }
                },
                recv(signals) -> sig => if let Ok(sig) = sig { self.on_signal(sig) },
                recv(self.io.reaped) -> r => if let Ok(r) = r { self.on_reaped(r.pid) },
                recv(self.io.spawned) -> o => match o {
                    Ok(o) => self.on_spawn_outcome(o),
                    Err(_) => self.on_spawner_gone(),
                },
                recv(self.io.chunks) -> c => if let Ok(c) = c { self.on_tail(c) },
                recv(self.io.worker_done) -> d => if let Ok(d) = d { self.on_worker_done(d) },
                recv(self.io.acked) -> a => if let Ok(a) = a { self.with_ingress(|i, out| i.on_ack(a, out)) },
                recv(self.io.control) -> r => if let Ok(r) = r { self.on_control(r) },
                recv(self.io.gpu_rx) -> s => if let Ok(s) = s { self.on_gpu_snapshot(s) },
                default(wait) => {}
            }
            self.tick();
            if let Some(code) = self.life.exit {
                self.finish_starts();
                self.io.mqtt.disconnect(Duration::from_millis(500));
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
        let open = self.life.shutdown.is_none();
        if let Some(d) = self.session.next_due() {
            due(d);
        }
        if let Some(s) = &self.life.shutdown {
            due(s.deadline);
        }
        // Only while a stream has unsent bytes: growth of a file arrives as an event.
        if let Some(d) = self.next_stream_due() {
            due(d);
        }
        if let Some(d) = self.active.next_due() {
            due(d);
        }
        for (.., until) in &self.heal.deferred {
            due(*until);
        }
        if self.session.connected() {
            if let Some(o) = self.outbox.next_try() {
                due(o);
            }
            if let Some(o) = self.ingress.queue.head_next_try() {
                due(o);
            }
        }
        if self.outbox.has_pending_writes() {
            due(now.checked_add(DISK_RETRY).unwrap_or(now));
        }
        due(self.due.rescan);
        if self.s.metrics_file.is_some() {
            due(self.due.metrics);
        }
        if self.s.log_retention_days.value > 0 {
            due(self.due.prune);
        }
        if self.s.standalone && self.session.connected() {
            due(self.due.watchdog);
        }
        if let Some(since) = self.life.drain.idle_since {
            if self.s.drain_after_one && open && self.active.is_empty() {
                due(since
                    .checked_add(operate::DRAIN_AFTER_ONE_WAIT)
                    .unwrap_or(since));
            }
        }
        t
    }

    /// Workloads that hold a slot: tracked ones and starts in flight.
    fn in_use(&self) -> usize {
        self.active.len().saturating_add(self.starts.len())
    }

    /// What the GPU part sees of the workloads: tracked ones and starts in flight.
    fn gpu_holds(&self) -> Vec<gpus::Hold<'_>> {
        gpus::holds_of(&self.active, &self.starts)
    }

    fn on_gpu_snapshot(&mut self, s: crate::gpu::Snapshot) {
        let holds = gpus::holds_of(&self.active, &self.starts);
        let wire = gpus::Wire(self.io.gpu_monitor.as_ref());
        self.gpu.on_snapshot(s, &holds, &wire);
    }

    /// GPU sampling runs every few seconds only while a tracked workload holds GPUs.
    fn gpu_update_sampling(&self) {
        let wire = gpus::Wire(self.io.gpu_monitor.as_ref());
        self.gpu.update_sampling(&self.gpu_holds(), &wire);
    }

    fn uuid(&self) -> &str {
        self.session.uuid()
    }

    fn slug(&self) -> &str {
        self.session.slug()
    }

    // ---- the broker session -------------------------------------------------------------------

    /// Whether messages of the loop are in flight: a loss may then be the broker refusing one
    /// of them (D34), not another client taking the session (D33).
    fn publishing(&self) -> bool {
        self.outbox.in_flight_count() > 0
            || self.ingress.queue.in_flight_count() > 0
            || self.session.loop_requests_pending()
    }

    fn on_mqtt(&mut self, ev: MqttEvent) {
        let now = self.io.clock.now();
        let publishing = self.publishing();
        let happened = self
            .session
            .on_mqtt(ev, publishing, now, &mut self.io.wire(&self.s));
        self.carry_out(happened);
    }

    /// Acts on what the session reports.
    fn carry_out(&mut self, happened: Vec<Happening<Op>>) {
        for h in happened {
            match h {
                Happening::Connected { reconnect } => {
                    if reconnect {
                        self.metrics.reconnects = self.metrics.reconnects.saturating_add(1);
                    }
                    self.flush_outbox();
                    self.with_ingress(|i, out| i.send(out));
                }
                Happening::Lost => self.connection_lost(),
                Happening::Registered => {
                    self.ship_install_logs();
                    self.answer_interrupted_starts();
                }
                Happening::RegisteredAfterFailedStart(err) => self.report_failed_start(err),
                Happening::Command(payload) => self.on_command(&payload),
                Happening::Outcome {
                    tag,
                    reply,
                    correlation,
                } => self.on_outcome(tag, reply, &correlation),
                Happening::Refused {
                    tag,
                    why,
                    permanent,
                } => self.on_refused(tag, &why, permanent),
                Happening::HeartbeatDue => self.send_heartbeat(),
                Happening::HeartbeatFailed => {
                    self.metrics.heartbeat_failures =
                        self.metrics.heartbeat_failures.saturating_add(1);
                }
                Happening::TokenRejected => self.begin_shutdown(EXIT_CREDENTIALS, "token rejected"),
            }
        }
    }

    /// The connection is gone (the session schedules the reconnect): what was in flight goes
    /// again, except what the broker refused too often (D34).
    fn connection_lost(&mut self) {
        // Outbox messages in flight are sent again after the reconnect.
        self.session.forget(|op| matches!(op, Op::Outbox(_)));
        let refused = self.outbox.reset_in_flight();
        let refused_events = self.ingress.queue.reset_in_flight();
        for (item, aside) in refused.into_iter().chain(refused_events) {
            log::error!(
                "the broker dropped the connection each of the last {} times the {} was sent; it is set aside in {} and not sent again",
                crate::outbox::MAX_REFUSALS,
                crate::logtext::shown(&item.label),
                aside.display()
            );
        }
        // The refused message sat in the MQTT client too: the next connect uses a fresh client
        // (never a clean session, see `Mqtt::start_connect`), which resends nothing of the
        // loop's requests but a standalone node's (`Mqtt::resend_requests`).
        self.reset_streams();
    }

    /// A request the broker refused, or that can never be sent as it is: an outbox message is
    /// set aside (at once when it can never fit, else after the broker refused it
    /// [`crate::outbox::MAX_REFUSALS`] times) with one ERROR line; the others fail now (D34).
    fn on_refused(&mut self, op: Op, why: &str, permanent: bool) {
        match op {
            Op::Outbox(seq) => {
                let now = self.io.clock.now();
                refused_in(&mut self.outbox, seq, why, permanent, now, "outbox message");
            }
            // A chunk that can never fit would hold its stream (and the workload's completion,
            // until the drain limit) for good: it is skipped, the rest of the log still goes.
            Op::Log(key) if permanent => {
                self.io.mqtt.log_too_big(
                    &format!(
                        "a log chunk of {} (skipped)",
                        crate::logtext::shown(&key.safe_id)
                    ),
                    why,
                );
                self.on_log_ack(&key, true);
            }
            other => {
                if permanent {
                    // At most once a minute: a log stream offers its chunk again and again.
                    self.io
                        .mqtt
                        .log_too_big(&format!("the {other:?} request"), why);
                } else if let Some(held) = self.throttle.refusals.ready(self.io.clock.now()) {
                    // A refused log chunk is offered again at its stream's pace: once a minute.
                    log::warn!(
                        "{other:?} not delivered: {}{}",
                        crate::logtext::shown(why),
                        workloads::held_note(held)
                    );
                }
                // Failed now rather than at its timeout (a log chunk is read and sent again).
                self.on_outcome(other, None, &[]);
            }
        }
    }

    /// Sends one of the loop's requests through the session; returns its correlation.
    fn request(&mut self, op: Op, topic: &str, body: Value, timeout: Duration) -> Vec<u8> {
        let now = self.io.clock.now();
        self.session
            .request(op, topic, &body, timeout, now, &mut self.io.wire(&self.s))
    }

    /// A request's reply (`Some`) or its timeout (`None`).
    fn on_outcome(&mut self, op: Op, body: Option<Reply>, corr: &[u8]) {
        match op {
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
                // A standalone node has no backend to acknowledge it: no reply is expected.
                None if self.s.standalone => {
                    log::debug!("workload status update published (standalone: no reply expected)")
                }
                None => log::warn!("workload status update not acknowledged in time"),
            },
            Op::Terminate | Op::Fail => {
                if body.is_none() {
                    log::warn!("the backend did not acknowledge the {op:?} notice in time");
                }
                if let Some(s) = &mut self.life.shutdown {
                    if s.waiting_for.as_deref() == Some(corr) {
                        s.waiting_for = None;
                        s.deadline = self.io.clock.now();
                    }
                }
            }
        }
    }

    /// A heartbeat is due (R3): its body is what the loop knows.
    fn send_heartbeat(&mut self) {
        // Self-heal runs beside the heartbeat, never in front of it.
        self.start_heal_pass();
        let mut body = json!({
            "node_version": crate::cli::VERSION,
            "active_workloads": self.in_use(),
            "max_concurrent_workloads": self.s.max_concurrent_workloads.value,
            "accepting": self.life.shutdown.is_none() && !self.life.drain.on,
            "draining": self.life.drain.on,
            "uptime_s": self.life.started.elapsed().as_secs(),
        });
        self.gpu.heartbeat(&self.gpu_holds(), &mut body);
        if let Some(h) = self.hardware() {
            util::set(&mut body, "hardware", h);
        }
        let now = self.io.clock.now();
        self.session
            .send_heartbeat(&body, now, &mut self.io.wire(&self.s));
    }
    // ---- timers ---------------------------------------------------------------------------------

    fn tick(&mut self) {
        let now = self.io.clock.now();
        let publishing = self.publishing();
        let happened = self
            .session
            .tick(publishing, now, &mut self.io.wire(&self.s));
        self.carry_out(happened);
        self.tick_workloads();
        self.retry_deferred_starts();
        if now >= self.due.rescan {
            // Events `emit` queued by itself while the node was unreachable.
            self.ingress.queue.rescan();
            let every = if self.active.is_empty() && self.ingress.queue.is_empty() {
                RESCAN_IDLE
            } else {
                RESCAN_BUSY
            };
            self.due.rescan = now.checked_add(every).unwrap_or(now);
        }
        self.with_ingress(|i, out| i.send(out));
        self.check_drain_after_one(now);
        self.write_metrics(now);
        self.prune_old_files(now);
        if self.s.standalone && self.session.connected() && now >= self.due.watchdog {
            // No heartbeats without a backend: a live broker connection feeds the watchdog.
            crate::systemd::notify("WATCHDOG=1");
            self.due.watchdog = util::later(now, Duration::from_secs(10));
        }
        self.flush_outbox();
        self.pump_streams(true);
        self.finish_stopping_workloads();
        if let Some(s) = &self.life.shutdown {
            if now >= s.deadline {
                self.life.exit = Some(s.exit_code);
            }
        }
    }
}

/// Counts a broker's refusal of queue entry `seq` (D34): one ERROR line when it is set aside
/// (at once when it can never fit, else after [`crate::outbox::MAX_REFUSALS`]), else a WARN.
fn refused_in(q: &mut Outbox, seq: u64, why: &str, permanent: bool, now: Instant, what: &str) {
    match q.refused(seq, permanent, now) {
        Some((item, aside)) => log::error!(
            "the {} cannot be delivered ({}); it is set aside in {} and not sent again",
            crate::logtext::shown(&item.label),
            crate::logtext::shown(why),
            aside.display()
        ),
        None => log::warn!(
            "{what} {seq} not delivered ({}); retrying later",
            crate::logtext::shown(why)
        ),
    }
}

/// A workload's status entry, with its GPUs when it has an assignment.
fn with_gpus(mut w: Value, meta: &crate::workload::Meta) -> Value {
    if let Some(g) = &meta.gpus {
        gpus::put(&mut w, "gpus", json!(g));
    }
    w
}
