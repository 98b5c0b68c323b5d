//! Stale-workload self-healing: the node asks the backend (REST E7, on the HTTP worker, time-
//! boxed) about each tracked running workload at start-up, before every heartbeat and before
//! rejecting a start as busy. Terminal status, 404, or another owner → the process group is
//! terminated (SIGTERM, then SIGKILL after a grace) and the workload is forgotten without a
//! completion. An inconclusive answer always keeps the workload. A process that will not die
//! stays tracked, so the node keeps reporting itself busy. A pass never delays a heartbeat;
//! an unfinished pass carries on, and the next one starts after it.

use std::collections::BTreeSet;
use std::time::Instant;

use serde_json::Value;

use super::admit::CHECK_TIMEOUT;
use super::table::Table;
use crate::backend::WorkloadCheck;
use crate::protocol::commands::{Kind, StartParams};
use crate::workers::{Job, Workers};

#[derive(Default)]
pub struct Heal {
    /// Workloads whose lookup is under way.
    pub checking: BTreeSet<String>,
    /// Starts waiting for a pass (kind, request id, params, give up at).
    pub deferred: Vec<(Kind, Value, StartParams, Instant)>,
}

/// What a lookup's answer comes to ([`Heal::on_check`]).
pub(super) enum HealCheck {
    /// Nothing more to do: the workload is gone, or finished meanwhile (its own completion
    /// owns it).
    Moot,
    /// Kept (active, or the answer was inconclusive).
    Kept,
    /// Stale: to be terminated without a completion (the text names it for the log).
    Stale(String),
}

impl Heal {
    /// Starts a pass unless one is still under way. Returns whether lookups are pending.
    pub(super) fn start_pass(
        &mut self,
        standalone: bool,
        active: &Table,
        workers: &Workers,
        uuid: &str,
    ) -> bool {
        if standalone || !self.checking.is_empty() {
            return !self.checking.is_empty();
        }
        let candidates: Vec<(String, String)> = active
            .iter()
            .filter(|(_, a)| {
                a.phase == crate::workload::lifecycle::Phase::Running && a.meta.cancel.is_none()
            })
            .filter_map(|(k, a)| {
                a.meta
                    .workload_uuid
                    .as_deref()
                    .map(|w| (k.clone(), w.to_string()))
            })
            .collect();
        for (key, wl) in candidates {
            self.checking.insert(key.clone());
            workers.submit(Job::CheckWorkload {
                key,
                wl,
                my_uuid: uuid.to_string(),
                timeout: CHECK_TIMEOUT,
            });
        }
        !self.checking.is_empty()
    }

    /// A lookup's answer for the workload `key`.
    pub(super) fn on_check(
        &mut self,
        key: &str,
        check: WorkloadCheck,
        active: &Table,
    ) -> HealCheck {
        self.checking.remove(key);
        let Some(a) = active.get(key) else {
            return HealCheck::Moot;
        };
        let what = format!("{} {}", a.meta.kind, a.meta.request_id_text());
        match check {
            WorkloadCheck::Active => HealCheck::Kept,
            WorkloadCheck::Inconclusive(why) => {
                log::debug!(
                    "self-heal: {} kept ({})",
                    crate::logtext::shown(&what),
                    crate::logtext::shown(&why)
                );
                HealCheck::Kept
            }
            WorkloadCheck::Stale(why) => {
                if a.phase != crate::workload::lifecycle::Phase::Running || a.meta.cancel.is_some()
                {
                    return HealCheck::Moot; // finished meanwhile: its own completion owns it
                }
                log::warn!(
                    "self-heal: {} is stale ({}); terminating it without a completion",
                    crate::logtext::shown(&what),
                    crate::logtext::shown(&why)
                );
                HealCheck::Stale(what)
            }
        }
    }

    /// Busy, and a pass is under way ([`Heal::start_pass`]): the start waits (until `until`,
    /// see [`super::admit::defer_wait`]) for it before it is rejected.
    pub(super) fn defer(
        &mut self,
        kind: Kind,
        request_id: &Value,
        params: &StartParams,
        until: Instant,
    ) {
        log::info!(
            "node busy: checking with the backend for stale workloads before answering {}",
            crate::logtext::shown(&crate::protocol::commands::request_id_text(request_id))
        );
        self.deferred
            .push((kind, request_id.clone(), params.clone(), until));
    }
}
