//! The loop's own clocks ([`Timers`]) and the periodic work they drive ([`Node::tick`]).

use std::time::{Duration, Instant};

use super::Node;
use crate::util;

/// How often events that `emit` queued itself are looked for while workloads run (they are
/// the ones that emit) or the queue is not empty; an idle node looks once a minute.
const RESCAN_BUSY: Duration = Duration::from_secs(2);
const RESCAN_IDLE: Duration = Duration::from_secs(60);

/// The loop's own clocks: when its periodic work is next due, and how often an error that
/// repeats may be logged.
pub(super) struct Timers {
    pub(super) due: Due,
    pub(super) throttle: Throttles,
}

/// When the loop's periodic work is next due.
pub(super) struct Due {
    /// A standalone node's watchdog ping (no heartbeats feed it).
    pub(super) watchdog: Instant,
    /// Looking for events `emit` queued by itself.
    pub(super) rescan: Instant,
    pub(super) metrics: Instant,
    pub(super) prune: Instant,
}

/// Errors logged at most once a minute.
#[derive(Default)]
pub(super) struct Throttles {
    /// Full-disk errors (D28).
    pub(super) disk: crate::logtext::Throttle,
    /// Requests the broker refused in its PUBACK (D34).
    pub(super) refusals: crate::logtext::Throttle,
}

impl Node {
    /// The loop's periodic work: run after every event and every wake-up.
    pub(super) fn tick(&mut self) {
        let now = self.io.clock.now();
        let publishing = self.publishing();
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
                RESCAN_IDLE
            } else {
                RESCAN_BUSY
            };
            self.timers.due.rescan = now.checked_add(every).unwrap_or(now);
        }
        self.with_ingress(|i, out| i.send(out));
        self.check_drain_after_one(now);
        self.write_metrics(now);
        self.prune_old_files(now);
        if self.s.standalone && self.session.connected() && now >= self.timers.due.watchdog {
            // No heartbeats without a backend: a live broker connection feeds the watchdog.
            crate::systemd::notify("WATCHDOG=1");
            self.timers.due.watchdog = util::later(now, Duration::from_secs(10));
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
