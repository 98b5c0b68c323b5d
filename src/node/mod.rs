//! The node: start-up (install script → token check → MQTT), then one event loop on the main
//! thread that owns every piece of state and selects over the feeders' channels. Nothing in the
//! loop waits on the network: requests are published and their replies (or deadlines) come
//! back as events. The loop sleeps until the next real deadline ([`timers::next_wake`]). Each
//! event goes to its handler with the parts it touches, borrowed apart from the node: a
//! workload's ([`Work`]) or the start path's ([`Start`]). A broker event goes through the
//! session, and what the session reports is dispatched here too ([`carry_out`]): a command to
//! `dispatch.rs`, the rest to `happenings.rs`, `shutdown.rs` and the parts. The workload table
//! and the log streams return what they want done as [`effect::Effect`]s, carried out by
//! [`io::send`] (and `Work::carry_out` for the two that need the node's other parts).

mod admit;
mod cancel;
mod container;
mod dispatch;
mod effect;
mod events;
mod gpus;
mod happenings;
mod install;
mod io;
mod logs;
pub mod operate;
mod parts;
mod selfheal;
mod service_watch;
mod session;
mod shutdown;
mod start_path;
mod starts;
pub mod startup;
pub mod streams;
mod table;
mod timers;
mod uploads;
mod workloads;

use std::time::Duration;

use crossbeam_channel::{select, Receiver};

use crate::config::Settings;
use crate::mqtt::MqttEvent;
use crate::signals::Signal;
use crate::workers::Done;
use parts::{Durable, Exit, Life, Op, Timers};
use session::{Happening, Session};
use start_path::Start;
use workloads::Work;

/// Written into the state dir when another client takes the session over twice within a
/// minute; `doctor` fails while it is recent.
pub use crate::store::CLIENT_ID_CONFLICT;
pub use timers::{BUSY_TICK, IDLE_TICK};

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
    ingress: events::Ingress,
    /// GPU inventory, health, accounting (D35–D38) and the telemetry's count and VRAM tier.
    gpu: gpus::Gpus,
    /// What workloads and the install script left running in a session of their own (D59).
    services: service_watch::Services,
    /// When the loop's own periodic work is next due, and when errors may next be logged.
    timers: Timers,
}

impl Node {
    /// A feeder thread ended while the loop runs (none does by design; a panic in one aborts
    /// release and packaged builds, `panic = "abort"`, and ends just that thread in debug builds): its
    /// closed channel would be ready at every `select!` and spin the loop.
    /// Crash-only: the node exits, to be started again; its workloads keep running.
    fn lost(&mut self, what: &str) {
        log::error!("the {what} thread stopped; the node exits (its workloads keep running) so that it is started again");
        self.life.exit = Some(Exit::Runtime);
    }

    fn run(mut self, signals: Receiver<Signal>) -> i32 {
        self.tick();
        loop {
            let now = self.io.clock.now();
            let (st, due) = self.parts();
            let wait = timers::next_wake(&st, due, now).saturating_duration_since(now);
            select! {
                recv(self.io.events) -> ev => match ev {
                    Ok(ev) => self.on_mqtt(ev),
                    Err(_) => self.lost("MQTT client"),
                },
                recv(signals) -> sig => match sig { Ok(sig) => shutdown::on_signal(&mut self.work(), sig), Err(_) => self.lost("signal") },
                recv(self.io.reaped) -> r => match r { Ok(r) => self.work().on_reaped(&r.id), Err(_) => self.lost("reaper") },
                recv(self.starts.outcomes) -> o => match o {
                    Ok(o) => self.start().on_spawn_outcome(o),
                    Err(_) => self.start().on_spawner_gone(),
                },
                recv(self.io.chunks) -> c => match c { Ok(c) => self.work().on_tail(c), Err(_) => self.lost("log tailer") },
                recv(self.io.worker_done) -> d => match d { Ok(d) => self.on_worker_done(d), Err(_) => self.lost("HTTP and upload") },
                recv(self.io.acked) -> a => match a { Ok(a) => self.work().with_ingress(|i, out| i.on_ack(a, out)), Err(_) => self.lost("acknowledgement") },
                recv(self.io.control) -> r => match r { Ok(r) => dispatch::on_control(&mut self.work(), r), Err(_) => self.lost("control socket") },
                recv(self.io.gpu_rx) -> s => match s { Ok(s) => self.on_gpu_snapshot(s), Err(_) => self.lost("GPU monitor") },
                default(wait) => {}
            }
            self.tick();
            if let Some(exit) = self.life.exit {
                let code = exit.code();
                self.start().finish_starts();
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

    /// The loop's periodic work: the session's (reconnects, heartbeats, deadlines) and what it
    /// reports, then the rest ([`timers::tick`]).
    fn tick(&mut self) {
        let (mut st, due) = self.parts();
        let w = &mut st.work;
        // One moment for the whole turn's periodic work, the session's included.
        let now = w.now();
        let publishing = happenings::publishing(w.session, w.outbox, &w.ingress.queue);
        let happened = w.session.tick(publishing, now, &mut w.io.link(w.s));
        carry_out(&mut st, happened);
        timers::tick(&mut st, due, now);
    }

    /// A broker event, through the session.
    fn on_mqtt(&mut self, ev: MqttEvent) {
        let mut st = self.start();
        let w = &mut st.work;
        let publishing = happenings::publishing(w.session, w.outbox, &w.ingress.queue);
        let happened = w
            .session
            .on_mqtt(ev, publishing, w.now(), &mut w.io.link(w.s));
        carry_out(&mut st, happened);
    }

    fn on_worker_done(&mut self, done: Done) {
        match done {
            Done::CheckWorkload { key, check } => self.start().on_workload_check(&key, check),
            done => self.work().on_worker_done(done),
        }
    }

    /// A GPU snapshot: which GPUs the services use (D59), then the workloads' accounting.
    fn on_gpu_snapshot(&mut self, s: crate::gpu::Snapshot) {
        if let crate::gpu::Snapshot::Gpus { app_gpus, .. } = &s {
            self.services.on_apps(app_gpus);
            self.gpu.avoid = self.services.gpus();
        }
        let holds = workloads::holds_of(&self.active, &self.starts);
        self.gpu
            .on_snapshot(s, &holds, &self.io.gpu_monitor.as_ref());
    }

    /// Re-adopts every workload in the state dir (run once, before the loop), and settles the
    /// answers of the starts the node before this one took and did not answer (D53).
    fn recover(&mut self) {
        let (started, notes) = self.work().recover();
        let interrupted = &mut self.starts.interrupted;
        starts::settle_interrupted(&mut self.durable.ledger, interrupted, started, notes);
    }

    /// The node split into the parts a handler borrows: the start path's ([`Start`], which
    /// holds a workload's, [`Work`]) and the loop's own clocks.
    fn parts(&mut self) -> (Start<'_>, &mut parts::Due) {
        let Node {
            s,
            io,
            session,
            life,
            active,
            durable,
            starts,
            streams,
            heal,
            ingress,
            gpu,
            services,
            timers,
        } = self;
        let work = Work {
            s,
            io,
            session,
            life,
            active,
            outbox: &mut durable.outbox,
            starts,
            streams,
            ingress,
            gpu,
            services,
            throttle: &mut timers.throttle,
        };
        let ledger = &mut durable.ledger;
        (Start { work, ledger, heal }, &mut timers.due)
    }

    fn start(&mut self) -> Start<'_> {
        self.parts().0
    }

    fn work(&mut self) -> Work<'_> {
        self.parts().0.work
    }
}

/// What the session reports, each to the part it concerns.
fn carry_out(st: &mut Start<'_>, happened: Vec<Happening<Op>>) {
    for h in happened {
        let w = &mut st.work;
        match h {
            Happening::Command(payload) => dispatch::on_command(st, &payload),
            Happening::Connected { reconnect } => happenings::on_connected(w, reconnect),
            Happening::Lost => happenings::on_lost(w),
            Happening::Registered => {
                w.ship_install_logs();
                st.answer_interrupted();
            }
            Happening::RegisteredAfterFailedStart(err) => shutdown::report_failed_start(w, err),
            Happening::Outcome {
                tag,
                reply,
                correlation,
            } => happenings::on_outcome(w, tag, reply, &correlation),
            Happening::Refused {
                tag,
                why,
                permanent,
            } => happenings::on_refused(w, tag, &why, permanent),
            Happening::HeartbeatDue => happenings::on_heartbeat_due(w, st.heal),
            Happening::HeartbeatFailed => {
                let m = &mut w.life.metrics;
                m.heartbeat_failures = m.heartbeat_failures.saturating_add(1);
            }
            Happening::TokenRejected => shutdown::begin(w, Exit::Credentials, "token rejected"),
        }
    }
}
