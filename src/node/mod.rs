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
use crate::signals::Signal;
use gpus_out::with_gpus;
use io::Wire;
use parts::{Drain, Durable, Life, Op};
use session::Session;
use session_out::refused_in;
use timers::{Due, Throttles, Timers};

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

    fn uuid(&self) -> &str {
        self.session.uuid()
    }

    fn slug(&self) -> &str {
        self.session.slug()
    }
}
