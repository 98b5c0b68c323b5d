//! The loop's own clocks ([`Timers`]); the periodic work they drive is [`super::Node::tick`].

use std::time::{Duration, Instant};

/// How often events that `emit` queued itself are looked for while workloads run (they are
/// the ones that emit) or the queue is not empty; an idle node looks once a minute.
pub(super) const RESCAN_BUSY: Duration = Duration::from_secs(2);
pub(super) const RESCAN_IDLE: Duration = Duration::from_secs(60);

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
