//! The loop's side of the GPU part ([`super::gpus`]) where the caller holds the table and the
//! starts apart: the workloads' holds it sees (tracked workloads and starts in flight), a
//! snapshot and the sampling seen against them, a status entry's GPUs.

use serde_json::{json, Value};

use super::gpus::{put, Gpus, Hold};
use super::io::GpuWire;
use super::starts::Starts;
use super::table::Table;
use crate::gpu::{self, Monitor};

/// The holds of the node's tracked workloads and starts in flight.
pub(super) fn holds_of<'a>(active: &'a Table, starts: &'a Starts) -> Vec<Hold<'a>> {
    active.holds().chain(starts.holds()).collect()
}

/// A GPU snapshot from the monitor thread, seen against the workloads' holds.
pub(super) fn on_snapshot(
    gpu: &mut Gpus,
    active: &Table,
    starts: &Starts,
    monitor: Option<&Monitor>,
    s: gpu::Snapshot,
) {
    gpu.on_snapshot(s, &holds_of(active, starts), &GpuWire(monitor));
}

/// GPU sampling runs every few seconds only while a tracked workload holds GPUs.
pub(super) fn update_sampling(
    gpu: &Gpus,
    active: &Table,
    starts: &Starts,
    monitor: Option<&Monitor>,
) {
    gpu.update_sampling(&holds_of(active, starts), &GpuWire(monitor));
}

/// A workload's status entry, with its GPUs when it has an assignment.
pub(super) fn with_gpus(mut w: Value, meta: &crate::workload::Meta) -> Value {
    if let Some(g) = &meta.gpus {
        put(&mut w, "gpus", json!(g));
    }
    w
}
