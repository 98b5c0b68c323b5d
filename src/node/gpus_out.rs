//! The loop's side of the GPU part ([`super::gpus`]): the workloads' holds it sees (tracked
//! workloads and starts in flight) and its [`Outbound`] on the monitor thread.

use std::time::Duration;

use serde_json::{json, Value};

use super::gpus::{put, Hold, Outbound};
use super::starts::Starts;
use super::table::Table;
use super::Node;
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

impl Node {
    /// What the GPU part sees of the workloads: tracked ones and starts in flight.
    pub(super) fn gpu_holds(&self) -> Vec<Hold<'_>> {
        holds_of(&self.active, &self.starts)
    }

    pub(super) fn on_gpu_snapshot(&mut self, s: crate::gpu::Snapshot) {
        let holds = holds_of(&self.active, &self.starts);
        let wire = Wire(self.io.gpu_monitor.as_ref());
        self.gpu.on_snapshot(s, &holds, &wire);
    }

    /// GPU sampling runs every few seconds only while a tracked workload holds GPUs.
    pub(super) fn gpu_update_sampling(&self) {
        let wire = Wire(self.io.gpu_monitor.as_ref());
        self.gpu.update_sampling(&self.gpu_holds(), &wire);
    }
}

/// A workload's status entry, with its GPUs when it has an assignment.
pub(super) fn with_gpus(mut w: Value, meta: &crate::workload::Meta) -> Value {
    if let Some(g) = &meta.gpus {
        put(&mut w, "gpus", json!(g));
    }
    w
}
