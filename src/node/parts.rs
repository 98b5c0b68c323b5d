//! The node's smaller values: its life (uptime, draining, shutdown, exit, counters), its
//! durable queues, what a request awaiting its reply was for, the shutdown under way, the
//! counters, the clock, and the busy refusals. A leaf: of the node it imports only the container
//! mode (itself a leaf).

use std::collections::BTreeMap;
use std::time::Instant;

use crate::ledger::Ledger;
use crate::outbox::Outbox;
use crate::workload::tail::Key;

// The exit the node ends with is an [`Exit`]: its code is chosen in `error.rs` alone.
pub(super) use crate::error::Exit;

/// The node's life: since when it runs, the shutdown under way, the exit code once decided,
/// and what it counted along the way (the metrics file's counters).
pub(super) struct Life {
    pub(super) started: Instant,
    pub(super) shutdown: Option<Shutdown>,
    pub(super) exit: Option<Exit>,
    /// Draining (no new workloads) and `--drain-after-one`.
    pub(super) drain: Drain,
    pub(super) metrics: Metrics,
    /// Container mode (D58, D70): why the node is its container's main process, if it is.
    pub(super) container: Option<super::container::Mode>,
}

/// The node's durable queues: both live on disk and survive a restart.
pub(super) struct Durable {
    /// Every request id handled, so a redelivered start or cancel is answered the same
    /// (guarantee 1).
    pub(super) ledger: Ledger,
    /// Terminal statuses and completions, kept until the backend acknowledges them.
    pub(super) outbox: Outbox,
}

/// Draining: new workloads are refused while it is on.
#[derive(Default)]
pub(super) struct Drain {
    pub(super) on: bool,
    /// `--drain-after-one`: a workload was started.
    pub(super) one_started: bool,
    pub(super) idle_since: Option<Instant>,
}

/// What a request awaiting its reply (or its deadline) was for.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Op {
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

/// The shutdown under way: until when, with which exit code, and what it waits for.
pub(super) struct Shutdown {
    pub deadline: Instant,
    pub exit: Exit,
    /// Correlation of the R5 (or R6) request whose reply ends the shutdown early.
    pub waiting_for: Option<Vec<u8>>,
    /// D58: a container's init waits for its stopped workloads' completions to be acknowledged
    /// before it says goodbye (R5), at most until `deadline`.
    pub stopping_workloads: bool,
    /// D70: a second SIGTERM sent SIGKILL to what was left of them (no grace for late ones).
    pub killed: bool,
}

/// Counters for the metrics file.
#[derive(Default)]
pub struct Metrics {
    pub starts: u64,
    pub rejections: BTreeMap<String, u64>,
    pub completions: BTreeMap<String, u64>,
    pub reconnects: u64,
    pub heartbeat_failures: u64,
    pub log_bytes: u64,
}

impl Metrics {
    pub(super) fn count_rejection(&mut self, reason: &str) {
        let n = self.rejections.entry(reason.to_string()).or_default();
        *n = n.saturating_add(1);
    }

    pub(super) fn count_completion(&mut self, outcome: &str) {
        let n = self.completions.entry(outcome.to_string()).or_default();
        *n = n.saturating_add(1);
    }
}

impl Drain {
    /// Draining on or off, with one line when it changes.
    pub(super) fn set(&mut self, on: bool, why: &str, in_use: usize) {
        if self.on != on {
            log::info!(
                "{} ({why}); {in_use} workload(s) running",
                if on {
                    "draining: new workloads are refused"
                } else {
                    "resumed: accepting workloads"
                },
            );
        }
        self.on = on;
    }
}

/// The text every retryable refusal starts with: legacy backends classify on it (D13).
pub const BUSY_PREFIX: &str = "Controller host is busy with";

/// A "not now, not here" refusal (decision D21): it keeps the host-busy contract of D13
/// (`rejection_reason: "host_busy"`, the error starting [`BUSY_PREFIX`],
/// `rejecting_instance_uuid`) so the backend may send the workload elsewhere, and says which
/// in `busy_reason`. Refusals that can never succeed on this node are not `Busy`.
// `GpusBusy` names the wire's `gpus_busy`.
#[allow(clippy::enum_variant_names)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Busy {
    Capacity,
    Uploading,
    Draining,
    DiskLow,
    ShuttingDown,
    /// Not enough free healthy GPUs (D36): some are held by running workloads.
    GpusBusy,
    /// Not enough healthy GPUs at all (D37).
    GpusUnhealthy,
    /// More than one GPU asked for on a MIG host that has too few whole GPUs (D56).
    GpusUnsatisfiable,
    /// The start was interrupted by a node restart before its workload ran (D53).
    Restarted,
}

impl Busy {
    /// The wire value of `busy_reason`.
    pub fn reason(self) -> &'static str {
        match self {
            Busy::Capacity => "capacity",
            Busy::Uploading => "uploading",
            Busy::Draining => "draining",
            Busy::DiskLow => "disk_low",
            Busy::ShuttingDown => "shutting_down",
            Busy::GpusBusy => "gpus_busy",
            Busy::GpusUnhealthy => "gpus_unhealthy",
            Busy::GpusUnsatisfiable => "gpus_unsatisfiable",
            Busy::Restarted => "node_restarted",
        }
    }
}

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

/// Counts a broker's refusal of queue entry `seq` (D34): one ERROR line when it is set aside
/// (at once when it can never fit, else after [`crate::outbox::MAX_REFUSALS`]), else a WARN.
pub(super) fn refused_in(
    q: &mut Outbox,
    seq: u64,
    why: &str,
    permanent: bool,
    now: Instant,
    what: &str,
) {
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
