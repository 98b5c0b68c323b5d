//! Stale-workload self-healing: the node asks the backend (REST E7, on the HTTP worker, time-
//! boxed) about each tracked running workload at start-up, before every heartbeat and before
//! rejecting a start as busy. Terminal status, 404, or another owner → the process group is
//! terminated (SIGTERM, then SIGKILL after a grace) and the workload is forgotten without a
//! completion. An inconclusive answer always keeps the workload. A process that will not die
//! stays tracked, so the node keeps reporting itself busy. A pass never delays a heartbeat;
//! an unfinished pass carries on, and the next one starts after it.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::Node;
use crate::backend::WorkloadCheck;
use crate::protocol::commands::{Kind, StartParams};
use crate::workers::Job;

/// How long one lookup may take.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// SIGTERM → SIGKILL for a stale workload.
pub const STALE_GRACE: Duration = Duration::from_secs(5);

#[derive(Default)]
pub struct Heal {
    /// Workloads whose lookup is under way.
    pub checking: BTreeSet<String>,
    /// Starts waiting for a pass (kind, request id, params, give up at).
    pub deferred: Vec<(Kind, Value, StartParams, Instant)>,
}

/// How long a busy start waits for a self-heal pass.
pub fn defer_wait() -> Duration {
    super::admit::defer_limit(CHECK_TIMEOUT, STALE_GRACE)
}

impl Node {
    /// Starts a pass unless one is still under way. Returns whether lookups are pending.
    pub(super) fn start_heal_pass(&mut self) -> bool {
        if self.s.standalone || !self.heal.checking.is_empty() {
            return !self.heal.checking.is_empty();
        }
        let uuid = self.uuid().to_string();
        let candidates: Vec<(String, String)> = self
            .active
            .iter()
            .filter(|(_, a)| {
                a.phase == crate::workload::lifecycle::Phase::Running && a.meta.cancel.is_none()
            })
            .filter_map(|(k, a)| {
                a.meta
                    .workload_uuid
                    .clone()
                    .filter(|w| !w.is_empty())
                    .map(|w| (k.clone(), w))
            })
            .collect();
        for (key, wl) in candidates {
            self.heal.checking.insert(key.clone());
            self.io.workers.submit(Job::CheckWorkload {
                key,
                wl,
                my_uuid: uuid.clone(),
                timeout: CHECK_TIMEOUT,
            });
        }
        !self.heal.checking.is_empty()
    }

    pub(super) fn on_workload_check(&mut self, key: &str, check: WorkloadCheck) {
        self.heal.checking.remove(key);
        let Some(a) = self.active.get(key) else {
            return;
        };
        let what = format!("{} {}", a.meta.kind, a.meta.request_id_text());
        match check {
            WorkloadCheck::Active => {}
            WorkloadCheck::Inconclusive(why) => log::debug!(
                "self-heal: {} kept ({})",
                crate::logtext::shown(&what),
                crate::logtext::shown(&why)
            ),
            WorkloadCheck::Stale(why) => {
                if a.phase != crate::workload::lifecycle::Phase::Running || a.meta.cancel.is_some()
                {
                    return; // finished meanwhile: its own completion owns it
                }
                log::warn!(
                    "self-heal: {} is stale ({}); terminating it without a completion",
                    crate::logtext::shown(&what),
                    crate::logtext::shown(&why)
                );
                if let Err(e) = self.terminate_stale(key) {
                    log::error!(
                        "self-heal: cannot terminate {}: {e}; it stays tracked",
                        crate::logtext::shown(&what)
                    );
                }
            }
        }
        self.retry_deferred_starts();
    }

    fn terminate_stale(&mut self, key: &str) -> Result<(), String> {
        self.cancel_stale(key, STALE_GRACE)
    }

    /// Busy: wait (until `until`, see [`defer_wait`]) for a pass before rejecting. Returns true when the start was deferred.
    pub(super) fn defer_start_for_heal(
        &mut self,
        kind: Kind,
        request_id: &Value,
        params: &StartParams,
        until: Instant,
    ) -> bool {
        if !self.start_heal_pass() {
            return false;
        }
        log::info!(
            "node busy: checking with the backend for stale workloads before answering {}",
            crate::logtext::shown(&crate::protocol::messages::request_id_text(request_id))
        );
        self.heal
            .deferred
            .push((kind, request_id.clone(), params.clone(), until));
        true
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
            if super::admit::go_ahead(now, until, room, undecided) {
                self.start_workload_now(kind, &rid, params);
            } else {
                self.heal.deferred.push((kind, rid, params, until));
            }
        }
    }
}
