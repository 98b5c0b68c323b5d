//! The node's smaller values: its life (uptime, draining, shutdown, exit, counters), its
//! durable queues, and what a request awaiting its reply was for.

use std::time::Instant;

use super::shutdown::Shutdown;
use crate::ledger::Ledger;
use crate::outbox::Outbox;
use crate::workload::tail::Key;

/// The node's life: since when it runs, the shutdown under way, the exit code once decided,
/// and what it counted along the way (the metrics file's counters).
pub(super) struct Life {
    pub(super) started: Instant,
    pub(super) shutdown: Option<Shutdown>,
    pub(super) exit: Option<i32>,
    /// Draining (no new workloads) and `--drain-after-one`.
    pub(super) drain: Drain,
    pub(super) metrics: super::operate::Metrics,
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
