//! The loop's side of the GPU part ([`super::gpus`]): the workloads' holds it sees (tracked
//! workloads and starts in flight) and its [`Outbound`] on the monitor thread.

use std::time::Duration;

use serde_json::{json, Value};

use super::gpus::{put, Gpus, Hold, Outbound};
use super::starts::Starts;
use super::table::Table;
use crate::gpu::{self, Monitor};

/// The GPU part's [`Outbound`] on the monitor thread (none when it could not start).
pub struct Wire<'a>(pub Option<&'a Monitor>);

impl Outbound for Wire<'_> {
    fn set_holding(&self, holding: bool) {
        if let Some(m) = self.0 {
            m.set_holding(holding);
        }
    }
    fn sample_every(&self) -> Duration {
        self.0.map_or(gpu::SAMPLE_EVERY, |m| m.timing.sample)
    }
    fn pgid_of(&self, pid: i32) -> Option<i32> {
        gpu::pgid_of(pid)
    }
}

/// The holds of the node's tracked workloads and starts in flight.
pub(super) fn holds_of<'a>(active: &'a Table, starts: &'a Starts) -> Vec<Hold<'a>> {
    let running = active.iter().map(|(id, a)| Hold {
        id,
        holder: match &a.meta.request_id {
            Value::Null => json!(id),
            r => r.clone(),
        },
        pid: Some(a.meta.pid()),
        gpus: a.meta.gpus.as_deref().unwrap_or_default(),
    });
    let starting = starts.iter().map(|(id, st)| Hold {
        id,
        holder: st.request_id.clone(),
        pid: None,
        gpus: st.gpus.as_deref().unwrap_or_default(),
    });
    running.chain(starting).collect()
}

/// A GPU snapshot from the monitor thread, seen against the workloads' holds.
pub(super) fn on_snapshot(
    gpu: &mut Gpus,
    active: &Table,
    starts: &Starts,
    monitor: Option<&Monitor>,
    s: gpu::Snapshot,
) {
    gpu.on_snapshot(s, &holds_of(active, starts), &Wire(monitor));
}

/// GPU sampling runs every few seconds only while a tracked workload holds GPUs.
pub(super) fn update_sampling(
    gpu: &Gpus,
    active: &Table,
    starts: &Starts,
    monitor: Option<&Monitor>,
) {
    gpu.update_sampling(&holds_of(active, starts), &Wire(monitor));
}

/// A workload's status entry, with its GPUs when it has an assignment.
pub(super) fn with_gpus(mut w: Value, meta: &crate::workload::Meta) -> Value {
    if let Some(g) = &meta.gpus {
        put(&mut w, "gpus", json!(g));
    }
    w
}
