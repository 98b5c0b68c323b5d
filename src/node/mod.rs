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
mod gpus_out;
mod ingress;
mod interrupted;
mod io;
pub mod operate;
mod parts;
mod selfheal;
mod session;
mod session_out;
mod shutdown;
mod starts;
pub mod startup;
pub mod streams;
mod streams_out;
mod table;
mod table_out;
mod timers;
mod uploads;
mod workloads;

use std::time::{Duration, Instant};

use crossbeam_channel::{select, Receiver};

// Exit codes are chosen in `error.rs` alone (the binary's edge, `app.rs`, is not imported here).
const EXIT_OK: i32 = crate::error::Exit::Ok.code();
const EXIT_RUNTIME: i32 = crate::error::Exit::Runtime.code();
const EXIT_CREDENTIALS: i32 = crate::error::Exit::Credentials.code();
use crate::config::Settings;
use crate::protocol::commands::{CancelParams, Command, Received, RequestId};
use crate::protocol::replies::Reply;
use crate::signals::Signal;
use crate::workers::Done;
use crate::workload::shim::Exit;
use crate::workload::Meta;
use commands::Accepted;
use gpus_out::with_gpus;
use parts::{Durable, Life, Op};
use serde_json::Value;
use session::Happening;
use session::Session;
use session_out::AfterRefusal;
use timers::Timers;

/// The loop's longest sleep while a workload is tracked: a safety net under the workload timers,
/// each of which has its own deadline in [`Node::next_wake`].
pub const BUSY_TICK: Duration = Duration::from_secs(1);
/// The loop's longest sleep when nothing is tracked (a heartbeat is due sooner anyway).
pub const IDLE_TICK: Duration = Duration::from_secs(60);
/// Retrying outbox writes that a full disk refused (D28).
const DISK_RETRY: Duration = Duration::from_secs(1);
/// Written into the state dir when another client takes the session over twice within a
/// minute; `doctor` fails while it is recent.
pub use crate::store::CLIENT_ID_CONFLICT;

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

pub struct Node {
    s: Settings,
    /// The I/O handles: MQTT client, feeders' channels, threads.
    io: io::Io,
    /// The broker session: connection, registration, heartbeat, requests awaiting replies.
    session: Session<Op>,
    /// Uptime, draining, the shutdown under way, the exit code once decided, the counters.
    life: Life,
    /// Active workloads by safe id.
    active: table::Table,
    /// The ledger of handled request ids and the outbox of messages awaiting acknowledgement.
    durable: Durable,
    /// Starts in flight, and those the node before this one took and did not answer (D53).
    starts: starts::Starts,
    /// Every workload's log streams (their cursors, pace and install-log shipping).
    streams: streams::Streams,
    heal: selfheal::Heal,
    /// Workflow execution events and the node's own reports of them.
    ingress: ingress::Ingress,
    /// GPU inventory, health, accounting (D35–D38) and the telemetry's count and VRAM tier.
    gpu: gpus::Gpus,
    /// When the loop's own periodic work is next due, and when errors may next be logged.
    timers: Timers,
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
                recv(self.io.chunks) -> c => if let Ok(c) = c { self.logs().on_tail(c) },
                recv(self.io.worker_done) -> d => if let Ok(d) = d { self.on_worker_done(d) },
                recv(self.io.acked) -> a => if let Ok(a) = a { self.with_ingress(|i, out| i.on_ack(a, out)) },
                recv(self.io.control) -> r => if let Ok(r) = r { self.on_control(r) },
                recv(self.io.gpu_rx) -> s => if let Ok(s) = s { gpus_out::on_snapshot(&mut self.gpu, &self.active, &self.starts, self.io.gpu_monitor.as_ref(), s) },
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

    /// The loop's periodic work: run after every event and every wake-up.
    pub(super) fn tick(&mut self) {
        let now = self.io.clock.now();
        let publishing =
            session_out::publishing(&self.session, &self.durable.outbox, &self.ingress.queue);
        let happened = self
            .session
            .tick(publishing, now, &mut self.io.wire(&self.s));
        self.carry_out(happened);
        self.tick_workloads();
        self.retry_deferred_starts();
        if now >= self.timers.due.rescan {
            // Events `emit` queued by itself while the node was unreachable.
            self.ingress.queue.rescan();
            let every = if self.active.is_empty() && self.ingress.queue.is_empty() {
                timers::RESCAN_IDLE
            } else {
                timers::RESCAN_BUSY
            };
            self.timers.due.rescan = now.checked_add(every).unwrap_or(now);
        }
        self.with_ingress(|i, out| i.send(out));
        if operate::drain_after_one_done(
            &self.s,
            &mut self.life,
            &self.active,
            &self.durable.outbox,
            now,
        ) {
            self.begin_shutdown(EXIT_OK, "--drain-after-one: the workload completed");
        }
        operate::write_metrics(
            &self.s,
            &mut self.timers.due.metrics,
            now,
            &self.life,
            self.durable
                .outbox
                .len()
                .saturating_add(self.ingress.queue.len()),
            &self.active,
            &self.starts,
            &self.gpu,
        );
        operate::prune_old_files(
            &self.s,
            &mut self.timers.due.prune,
            &self.active,
            &self.io.layout,
            now,
        );
        if self.s.standalone && self.session.connected() && now >= self.timers.due.watchdog {
            // No heartbeats without a backend: a live broker connection feeds the watchdog.
            crate::systemd::notify("WATCHDOG=1");
            self.timers.due.watchdog = crate::util::later(now, Duration::from_secs(10));
        }
        self.flush_outbox();
        self.logs().pump();
        shutdown::finish_stopping_workloads(
            &mut self.life,
            &self.active,
            &self.durable.outbox,
            &mut self.session,
            &self.io,
            &self.s,
        );
        if let Some(s) = &self.life.shutdown {
            if now >= s.deadline {
                self.life.exit = Some(s.exit_code);
            }
        }
    }

    // ---- signals and shutdown -------------------------------------------------------------

    /// Registered after start-up failed: tell the backend (R6), then exit.
    pub(super) fn report_failed_start(&mut self, err: String) {
        let uuid = self.uuid().to_string();
        log::error!("reporting the start-up failure to the backend, then exiting");
        if self.s.standalone {
            return self.begin_shutdown(EXIT_RUNTIME, "start-up failed");
        }
        let topic = self.io.topics.fail(&uuid);
        let corr = self.request(
            Op::Fail,
            &topic,
            serde_json::json!({"instance_uuid": uuid, "error": err}),
            self.s.tuning.heartbeat_timeout,
        );
        self.begin_shutdown(EXIT_RUNTIME, "start-up failed");
        if let Some(s) = &mut self.life.shutdown {
            s.waiting_for = Some(corr);
        }
    }

    pub(super) fn on_signal(&mut self, sig: Signal) {
        match sig {
            Signal::Term | Signal::Int => {
                if self.life.shutdown.is_some() {
                    log::warn!("second {sig:?}: exiting now");
                    self.life.exit = Some(EXIT_OK);
                    return;
                }
                self.begin_shutdown(EXIT_OK, &format!("{sig:?} received"));
            }
            Signal::Hup => {
                log::info!("SIGHUP ignored (restart the service to reload the configuration)")
            }
            Signal::Usr1 => self.life.drain.set(true, "SIGUSR1", self.in_use()),
            Signal::Usr2 => self.life.drain.set(false, "SIGUSR2", self.in_use()),
        }
    }

    pub(super) fn begin_shutdown(&mut self, exit_code: i32, why: &str) {
        if self.life.shutdown.is_some() {
            return;
        }
        crate::systemd::notify("STOPPING=1");
        let now = self.io.clock.now();
        if container::is_init(&self.s.env) {
            // D58: its workloads die with the container; stop them and report them first.
            let grace = container::stop_grace(&self.s.env);
            let kill = container::kill_after(grace);
            let n = self.with_table(|t, out, now| t.cancel_all(container::REASON, kill, now, out));
            log::info!(
                "shutting down ({why}); as its container's main process the node stops its {n} running workload(s) (SIGTERM, SIGKILL after {:.1}s) and reports them before it exits, within {:.1}s",
                kill.as_secs_f64(),
                grace.as_secs_f64()
            );
            self.session.close();
            self.life.shutdown = Some(parts::Shutdown {
                deadline: crate::util::later(now, container::deadline_after(grace)),
                exit_code,
                waiting_for: None,
                stopping_workloads: true,
            });
            return;
        }
        log::info!("shutting down ({why}); running workloads are left running");
        workloads::log_running(&self.active);
        self.session.close();
        let (session, io, s) = (&mut self.session, &self.io, &self.s);
        self.life.shutdown = Some(shutdown::goodbye(session, io, s, now, exit_code, None));
    }

    // ---- the broker session's dispatch ----------------------------------------------------

    fn on_mqtt(&mut self, ev: crate::mqtt::MqttEvent) {
        let now = self.io.clock.now();
        let publishing =
            session_out::publishing(&self.session, &self.durable.outbox, &self.ingress.queue);
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
                        self.life.metrics.reconnects =
                            self.life.metrics.reconnects.saturating_add(1);
                    }
                    self.flush_outbox();
                    self.with_ingress(|i, out| i.send(out));
                }
                Happening::Lost => session_out::connection_lost(
                    &mut self.session,
                    &mut self.durable.outbox,
                    &mut self.ingress.queue,
                    &mut self.streams,
                    self.io.clock.now(),
                ),
                Happening::Registered => {
                    self.logs().ship_install();
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
                } => {
                    let now = self.io.clock.now();
                    let throttle = &mut self.timers.throttle.refusals;
                    let (outbox, mqtt) = (&mut self.durable.outbox, &self.io.mqtt);
                    match session_out::refused(tag, &why, permanent, outbox, mqtt, throttle, now) {
                        AfterRefusal::Nothing => {}
                        AfterRefusal::SkipLog(key) => self.logs().on_ack(&key, true),
                        AfterRefusal::Fail(op) => self.on_outcome(op, None, &[]),
                    }
                }
                Happening::HeartbeatDue => {
                    // Self-heal runs beside the heartbeat, never in front of it.
                    self.heal.start_pass(
                        self.s.standalone,
                        &self.active,
                        &self.io.workers,
                        self.session.uuid(),
                    );
                    let holds = gpus_out::holds_of(&self.active, &self.starts);
                    let body = session_out::heartbeat_body(
                        &self.s,
                        &self.life,
                        self.in_use(),
                        &self.gpu,
                        &holds,
                    );
                    let now = self.io.clock.now();
                    self.session
                        .send_heartbeat(&body, now, &mut self.io.wire(&self.s));
                }
                Happening::HeartbeatFailed => {
                    self.life.metrics.heartbeat_failures =
                        self.life.metrics.heartbeat_failures.saturating_add(1);
                }
                Happening::TokenRejected => self.begin_shutdown(EXIT_CREDENTIALS, "token rejected"),
            }
        }
    }

    /// A request's reply (`Some`) or its timeout (`None`).
    fn on_outcome(&mut self, op: Op, body: Option<Reply>, corr: &[u8]) {
        match op {
            Op::Outbox(seq) => self.on_outbox_reply(seq, body),
            Op::Log(key) => self
                .logs()
                .on_ack(&key, body.as_ref().is_some_and(|b| b.success)),
            Op::SignedUrl(id) => self.on_signed_url_reply(&id, body.map(|b| b.body)),
            Op::UploadResults(id) => {
                self.on_upload_reply(&id, body.as_ref().is_some_and(|b| b.success))
            }
            Op::WorkloadStatus => session_out::on_status_outcome(body, self.s.standalone),
            Op::Terminate | Op::Fail => {
                let now = self.io.clock.now();
                let shutdown = self.life.shutdown.as_mut();
                session_out::on_goodbye_outcome(&op, body.is_some(), shutdown, corr, now);
            }
        }
    }

    /// Once registered: every interrupted start gets its answer (D53), and its note goes.
    pub(super) fn answer_interrupted_starts(&mut self) {
        for (safe_id, taken, a) in std::mem::take(&mut self.starts.interrupted) {
            match a {
                interrupted::Answer::Started(out) => {
                    self.replies().ok(&taken.request_id, out);
                    let pid = self
                        .active
                        .get(&safe_id)
                        .filter(|a| !a.finished())
                        .map(|a| a.meta.pid());
                    if let (Some(pid), Some(wl)) = (pid, &taken.workload_uuid) {
                        let body = serde_json::json!({"status": "running", "message": format!("{} started in background", taken.kind), "pid": pid});
                        self.workload_status(wl, body);
                    }
                }
                interrupted::Answer::NeverStarted(why) => {
                    let why = admit::RejectReason::Recorded(why);
                    self.reject_start(
                        &taken.request_id,
                        taken.workload_uuid.as_deref(),
                        &why,
                        None,
                    );
                }
            }
            interrupted::forget(&self.io.layout, &safe_id);
        }
    }

    /// Sends one of the loop's requests through the session; returns its correlation.
    fn request(&mut self, op: Op, topic: &str, body: Value, timeout: Duration) -> Vec<u8> {
        let now = self.io.clock.now();
        self.session
            .request(op, topic, &body, timeout, now, &mut self.io.wire(&self.s))
    }

    /// Runs `f` on the workload table with the real [`table::Outbound`], then does what it
    /// left for the loop (logs to ship, completions to queue).
    fn with_table<R>(
        &mut self,
        f: impl FnOnce(&mut table::Table, &mut dyn table::Outbound, Instant) -> R,
    ) -> R {
        let now = self.io.clock.now();
        let mut out = table_out::NodeOut::new(&mut self.session, &self.io, &self.s, now);
        let r = f(&mut self.active, &mut out, now);
        let mut shipped = false;
        for l in out.into_later() {
            match l {
                table_out::Later::ShipLogs if !shipped => {
                    shipped = true;
                    self.logs().pump();
                }
                table_out::Later::ShipLogs => {}
                table_out::Later::Report {
                    id,
                    meta,
                    exit,
                    lost,
                } => self.complete(&id, *meta, exit, lost),
            }
        }
        r
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
        if let Some(d) = self.streams.next_due() {
            due(d);
        }
        if let Some(d) = self.active.next_due() {
            due(d);
        }
        for (.., until) in &self.heal.deferred {
            due(*until);
        }
        if self.session.connected() {
            if let Some(o) = self.durable.outbox.next_try() {
                due(o);
            }
            if let Some(o) = self.ingress.queue.head_next_try() {
                due(o);
            }
        }
        if self.durable.outbox.has_pending_writes() {
            due(now.checked_add(DISK_RETRY).unwrap_or(now));
        }
        due(self.timers.due.rescan);
        if self.s.metrics_file.is_some() {
            due(self.timers.due.metrics);
        }
        if self.s.log_retention_days.value > 0 {
            due(self.timers.due.prune);
        }
        if self.s.standalone && self.session.connected() {
            due(self.timers.due.watchdog);
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

    // ---- workloads: the table's events and completions -----------------------------------

    /// A non-terminal workload status (R7): sent once, its failure only logged.
    fn workload_status(&mut self, wl: &str, body: Value) {
        if wl.is_empty() {
            return;
        }
        let topic = self.io.topics.workload_status(wl);
        self.request(
            Op::WorkloadStatus,
            &topic,
            body,
            self.s.tuning.request_timeout,
        );
    }

    fn on_reaped(&mut self, pid: i32) {
        self.with_table(|t, out, now| t.on_reaped(pid, now, out));
    }

    /// A workload known to have ended (found at recovery).
    fn begin_ending(&mut self, safe_id: &str, exit: Option<Exit>, lost: Option<&'static str>) {
        self.with_table(|t, out, now| t.end(safe_id, exit, lost, now, out));
    }

    /// Reports the end of a workload exactly once (through the outbox); the table no longer
    /// tracks it, and its record goes once the completion is safe ([`table::Table::completion_queued`]).
    fn complete(&mut self, safe_id: &str, meta: Meta, exit: Option<Exit>, lost: Option<&str>) {
        let pid = meta.pid();
        let rid = meta.request_id_text();
        if meta.cancel.as_ref().is_some_and(|c| c.stale) {
            log::info!(
                "stale {} {} (pid {pid}) is gone; forgotten without a completion",
                meta.kind,
                crate::logtext::shown(&rid)
            );
            self.life.metrics.count_completion("stale");
            self.with_table(|t, out, _| t.completion_queued(safe_id, None, out));
            self.retry_deferred_starts();
            return;
        }
        let mut wire = ingress::Wire {
            connected: self.session.connected(),
            now: self.io.clock.now(),
            io: &self.io,
            disk_errors: &mut self.timers.throttle.disk,
        };
        let (metrics, events) = (&mut self.life.metrics, &mut self.ingress);
        let (body, label) = match &meta.cancel {
            Some(c) if !c.timed_out => {
                workloads::cancelled_body(&meta, c, exit.as_ref(), &rid, metrics, events, &mut wire)
            }
            _ => workloads::finished_body(
                &meta,
                exit.as_ref(),
                lost,
                &rid,
                metrics,
                events,
                &mut wire,
            ),
        };
        let mut body = body;
        if let Some(g) = self.gpu.usage_of(safe_id, &meta) {
            gpus::put(&mut body, "gpu", g); // D38
        }
        gpus_out::update_sampling(
            &self.gpu,
            &self.active,
            &self.starts,
            self.io.gpu_monitor.as_ref(),
        );
        match self
            .outgoing()
            .send_completion(safe_id, &meta, body, label, &rid)
        {
            // D28: kept in memory and sent all the same; the workload's record stays until the
            // backend acknowledged it, so a restart still knows.
            Some(seq) => {
                self.with_table(|t, out, _| t.completion_queued(safe_id, Some(seq), out));
                self.outgoing().flush();
            }
            None => self.with_table(|t, out, _| t.completion_queued(safe_id, None, out)),
        }
        self.retry_deferred_starts();
    }

    fn tick_workloads(&mut self) {
        let now = self.io.clock.now();
        // The streams' verdict, read before the table is borrowed.
        let drained: Vec<String> = self
            .active
            .draining()
            .into_iter()
            .filter(|id| streams_out::drained(&self.streams, &self.active, id, now))
            .collect();
        self.with_table(|t, out, now| t.tick(now, &drained, out));
    }

    fn on_signed_url_reply(&mut self, id: &str, body: Option<Value>) {
        self.with_table(|t, out, now| t.on_signed_url_reply(id, body, now, out));
    }

    fn on_upload_reply(&mut self, id: &str, ok: bool) {
        self.with_table(|t, out, now| t.on_upload_reply(id, ok, now, out));
    }

    fn on_worker_done(&mut self, done: Done) {
        match done {
            Done::CheckWorkload { key, check } => self.on_workload_check(&key, check),
            done => self.with_table(|t, out, now| t.on_worker_done(done, now, out)),
        }
    }

    /// The outbox and what sending from it touches.
    fn outgoing(&mut self) -> workloads::Outgoing<'_> {
        workloads::Outgoing {
            outbox: &mut self.durable.outbox,
            session: &mut self.session,
            io: &self.io,
            s: &self.s,
            disk: &mut self.timers.throttle.disk,
        }
    }

    fn flush_outbox(&mut self) {
        self.outgoing().flush();
    }

    fn on_outbox_reply(&mut self, seq: u64, body: Option<Reply>) {
        if self.outgoing().on_reply(seq, body) {
            self.with_table(|t, out, _| t.acknowledged(seq, out));
        }
    }

    /// Re-adopts every workload in the state dir (run once, before the loop), and settles the
    /// answers of the starts the node before this one took and did not answer (D53).
    fn recover(&mut self) {
        let mut notes: std::collections::BTreeMap<String, interrupted::Taken> =
            interrupted::load_all(&self.io.layout).into_iter().collect();
        let mut started = Vec::new();
        let layout = self.io.layout.clone();
        let now = self.io.clock.now();
        workloads::recover_workloads(
            &layout,
            &mut notes,
            &mut started,
            &mut |name, meta, ending| {
                self.active
                    .insert(name.clone(), table::Active::new(meta, false, now));
                if let Some((exit, lost)) = ending {
                    self.begin_ending(&name, exit, lost);
                }
            },
        );
        let interrupted = &mut self.starts.interrupted;
        interrupted::settle(&mut self.durable.ledger, interrupted, started, notes);
    }

    // ---- commands and the control socket's requests ----------------------------------------

    fn on_command(&mut self, payload: &[u8]) {
        let (request_id, command) = match commands::accept(payload, self.life.shutdown.is_some()) {
            Accepted::Nothing => return,
            Accepted::Refused {
                rid,
                reason,
                failed,
            } => {
                if let Some((wl, body)) = failed {
                    self.workload_status(&wl, body);
                }
                return self.replies().error(&rid, &reason);
            }
            Accepted::Run(request_id, command) => (request_id, command),
        };
        let rid = request_id.value();
        match command {
            Command::Status => self.replies().ok(rid, self.view().status()),
            Command::Start(kind, params) | Command::Received(Received::Start(kind, params)) => {
                match commands::wrong_environment(&self.s, &params) {
                    Some(why) => self.replies().error(rid, &why),
                    None => self.start_workload(kind, rid, params),
                }
            }
            Command::Cancel(params) => self.cancel(&request_id, params),
            Command::Received(Received::Ack(uuid)) => {
                let shown = uuid.as_ref().map_or("None", |u| u.as_str());
                self.replies().ok(
                    rid,
                    serde_json::json!({"message": format!("Workload {shown} received and acknowledged")}),
                );
            }
        }
    }

    /// `cancel`: decided on the ledger, the starts and the table ([`cancel::decide`]); a
    /// tracked workload is cancelled by the table.
    fn cancel(&mut self, request_id: &RequestId, params: CancelParams) {
        let ledger = &mut self.durable.ledger;
        let (ok, body) =
            match cancel::decide(ledger, &mut self.starts, &self.active, request_id, &params) {
                cancel::Step::Nothing => return,
                cancel::Step::Answer(ok, body) => (ok, body),
                cancel::Step::Table {
                    safe_id,
                    sig,
                    sig_name,
                    grace,
                } => {
                    let r = self.with_table(|t, out, now| {
                        t.cancel(&safe_id, sig, sig_name, grace, false, now, out)
                    });
                    let ledger = &mut self.durable.ledger;
                    cancel::answer(ledger, &self.active, request_id, &safe_id, sig_name, r)
                }
            };
        self.replies().replay(request_id.value(), ok, body);
    }

    fn on_control(&mut self, req: crate::control::Request) {
        let Some(req) = self.starts.hold_for_start(req) else {
            return;
        };
        let op = req.body.get("op").and_then(Value::as_str).unwrap_or("");
        let reply = match op {
            "emit" => self.on_emit(&req.body),
            "drain" | "resume" => {
                self.life
                    .drain
                    .set(op == "drain", "asked on the control socket", self.in_use());
                serde_json::json!({"ok": true, "draining": self.life.drain.on, "active_workloads": self.in_use()})
            }
            "status" => serde_json::json!({"ok": true, "status": self.view().local()}),
            other => serde_json::json!({"ok": false, "error": format!("unknown op {other:?}")}),
        };
        let _ = req.reply.send(reply);
    }

    /// A self-heal lookup's answer: a stale workload is terminated without a completion.
    fn on_workload_check(&mut self, key: &str, check: crate::backend::WorkloadCheck) {
        let what = match self.heal.on_check(key, check, &self.active) {
            selfheal::Checked::Moot => return,
            selfheal::Checked::Kept => None,
            selfheal::Checked::Stale(what) => Some(what),
        };
        if let Some(what) = what {
            let grace = selfheal::STALE_GRACE;
            if let Err(e) = self.with_table(|t, out, now| t.cancel_stale(key, grace, now, out)) {
                log::error!(
                    "self-heal: cannot terminate {}: {e}; it stays tracked",
                    crate::logtext::shown(&what)
                );
            }
        }
        self.retry_deferred_starts();
    }

    /// Deferred starts go ahead once there is room, or are refused once their time is up.
    pub(super) fn retry_deferred_starts(&mut self) {
        if self.heal.deferred.is_empty() {
            return;
        }
        let now = self.io.clock.now();
        let capacity = self.s.max_concurrent_workloads.value as usize;
        let pending = std::mem::take(&mut self.heal.deferred);
        for (kind, rid, params, until) in pending {
            let stale_left = self
                .active
                .values()
                .any(|a| a.meta.cancel.as_ref().is_some_and(|c| c.stale));
            let room = self.in_use() < capacity;
            let undecided = !self.heal.checking.is_empty() || stale_left;
            if admit::go_ahead(now, until, room, undecided) {
                self.start_workload_now(kind, &rid, params);
            } else {
                self.heal.deferred.push((kind, rid, params, until));
            }
        }
    }

    /// Replies to the backend's commands.
    fn replies(&self) -> commands::Replies<'_> {
        commands::Replies {
            io: &self.io,
            session: &self.session,
        }
    }

    /// What the status answers read of the node.
    fn view(&self) -> commands::View<'_> {
        commands::View {
            s: &self.s,
            session: &self.session,
            io: &self.io,
            life: &self.life,
            active: &self.active,
            starts: &self.starts,
            gpu: &self.gpu,
            outbox: &self.durable.outbox,
            events: &self.ingress.queue,
        }
    }

    /// Runs `f` on the ingress part with its [`ingress::Wire`] (the io handles and the
    /// full-disk throttle).
    fn with_ingress<R>(
        &mut self,
        f: impl FnOnce(&mut ingress::Ingress, &mut dyn ingress::Outbound) -> R,
    ) -> R {
        let mut wire = ingress::Wire {
            connected: self.session.connected(),
            now: self.io.clock.now(),
            io: &self.io,
            disk_errors: &mut self.timers.throttle.disk,
        };
        f(&mut self.ingress, &mut wire)
    }

    /// `emit` from a workload, through the control socket: its owner found by its token.
    fn on_emit(&mut self, body: &Value) -> Value {
        let owner = ingress::owner_of(&self.active, body);
        self.with_ingress(|i, out| i.emit(body, owner.as_ref(), out))
    }

    /// The streams part and what its calls touch, borrowed apart from the rest of the node.
    fn logs(&mut self) -> streams_out::Logs<'_> {
        streams_out::Logs {
            streams: &mut self.streams,
            session: &mut self.session,
            io: &self.io,
            s: &self.s,
            active: &self.active,
            disk: &mut self.timers.throttle.disk,
            log_bytes: &mut self.life.metrics.log_bytes,
        }
    }

    fn uuid(&self) -> &str {
        self.session.uuid()
    }
}
