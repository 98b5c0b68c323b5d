//! The node's side of workloads ([`Work`], the parts their events touch): building and queueing
//! completions (exactly once, through the outbox), and re-adopting workloads after a restart. Where a workload is, its timers and its uploads
//! belong to the workload table (`table.rs`), which this file drives through
//! [`Work::with_table`].

use std::collections::BTreeMap;

use serde_json::{json, Value};

use std::time::{Duration, Instant};

use super::effect::{Effect, Fx};
use super::events::{self, Ingress};
use super::gpus::{self, Gpus};
use super::io::{Io, Replies};
use super::parts::{Life, Metrics, Op, Throttles};
use super::session::Session;
use super::starts::{self, Starts, Taken};
use super::streams::Streams;
use super::table::{self, Table, SALVAGED};
use crate::config::Settings;
use crate::logtext::shown;
use crate::outbox::Item;
use crate::outbox::Outbox;
use crate::protocol::commands::TopicId;
use crate::protocol::replies::Reply;
use crate::store;
use crate::workers::Done;
use crate::workload::shim::Exit;
use crate::workload::{self, procinfo, Layout, Meta};

/// How a workload found at recovery ended: its exit record, and what was lost when it is a
/// failure the node reports itself.
pub(super) type Ending = (Option<Exit>, Option<&'static str>);

/// [`Work::recover`]'s workloads: the notes of starts whose workload started move from
/// `notes` to `started`, with the `ok` output of their start.
/// Each one is handed to `adopt`, with its end when it is known to have ended.
pub(super) fn recover_workloads(
    layout: &Layout,
    params_cap: u64,
    notes: &mut BTreeMap<String, Taken>,
    started: &mut Vec<(String, Taken, Value)>,
    adopt: &mut dyn FnMut(String, Meta, Option<Ending>),
) {
    let _ = store::ensure_dir_or_quarantine(&layout.workloads());
    let Ok(entries) = std::fs::read_dir(layout.workloads()) else {
        return;
    };
    let boot = procinfo::boot_id();
    for entry in entries.flatten() {
        let dir = entry.path();
        if !dir.is_dir() {
            continue;
        }
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".retired-") {
            let _ = std::fs::remove_dir_all(&dir); // reported already; deletion was cut short
            continue;
        }
        if name.ends_with(".corrupt") {
            continue;
        }
        // Every file is validated; an invalid one is quarantined, and a workload whose
        // record is bad is still tracked by what can be proven about it.
        let (meta, salvaged) = match workload::recover_meta(layout, &dir, &name, params_cap) {
            workload::Recovered::Intact(m) => (m, false),
            workload::Recovered::Salvaged(m) => (m, true),
        };
        let shown = store::clip(&name, 80);
        let Some(st) = meta.started.clone() else {
            if salvaged {
                // Nothing proves which process it was: report it (once) and retire it.
                report_unprovable(name, meta, adopt);
            } else {
                log::warn!("workload {shown} never started (the node stopped while starting it); forgetting it");
                let _ = std::fs::remove_dir_all(&dir);
            }
            continue;
        };
        if salvaged {
            log::error!(
                "workload {shown} has no valid record ({}); tracking it by its pid {} and reporting its end as a failure{}",
                store::clip(meta.salvaged.as_deref().unwrap_or(""), 300),
                st.pid,
                if meta.workload_uuid.is_none() {
                    " (its workload uuid is unknown: the backend cannot be told)"
                } else {
                    ""
                }
            );
        }
        let exit: Option<Exit> = workload::load_exit(&dir);
        // Outside text in a log line: escaped and cut (D31).
        let rid = store::clip(&meta.request_id_text(), 120);
        if let Some(taken) = notes.remove(&name) {
            started.push((name.clone(), taken, start_output(&meta)));
        }
        // Its log streams resume from its cursor (node/logs.rs reads it).
        if salvaged && (exit.is_some() || !alive(&st)) {
            adopt(name, meta, Some((exit, Some(SALVAGED))));
        } else if exit.is_some() {
            log::info!("workload {rid} ended while the node was down; reporting it");
            adopt(name, meta, Some((exit, None)));
        } else if !st.boot_id.is_empty() && st.boot_id != boot {
            log::warn!("workload {rid} was lost: the host rebooted");
            adopt(
                name,
                meta,
                Some((None, Some("workload lost: host rebooted"))),
            );
        } else if alive(&st) {
            log::info!("re-adopted running workload {rid} (pid {})", st.pid);
            adopt(name, meta, None);
        } else {
            log::warn!("workload {rid} was lost while the node was down");
            adopt(
                name,
                meta,
                Some((
                    None,
                    Some("workload lost: node restarted and no exit status was recorded"),
                )),
            );
        }
    }
}

/// A workload whose record did not validate and that no pid identity ties to a process:
/// its end is reported once (a failure, when its workload uuid is known; an ERROR line
/// otherwise) and its directory retired.
fn report_unprovable(
    name: String,
    meta: Meta,
    adopt: &mut dyn FnMut(String, Meta, Option<Ending>),
) {
    let shown = store::clip(&name, 80);
    let why = store::clip(meta.salvaged.as_deref().unwrap_or(""), 300);
    match &meta.workload_uuid {
        Some(wl) => log::error!(
            "workload {shown} has no valid record ({why}) and no proof of its process; reporting workload {} as failed",
            store::clip(wl, 80)
        ),
        None => log::error!(
            "workload {shown} has no valid record ({why}), no proof of its process and no known workload uuid; it cannot be reported to the backend and is forgotten"
        ),
    }
    adopt(name, meta, Some((None, Some(SALVAGED))));
}

/// The status a cancelled workload ends with (training: `failed`, else `cancelled`), and
/// its outbox label.
pub(super) fn cancelled_body(
    meta: &Meta,
    c: &crate::workload::record::Cancel,
    exit: Option<&Exit>,
    rid: &str,
    metrics: &mut Metrics,
    ingress: &mut Ingress,
    out: &mut dyn events::Publisher,
) -> (Value, String) {
    let pid = meta.pid();
    let status = if meta.kind == crate::protocol::commands::Kind::Training {
        "failed"
    } else {
        "cancelled"
    };
    let how = cancel_message(c, exit);
    log::info!(
        "{} {} (pid {pid}): {}",
        meta.kind,
        crate::logtext::shown(rid),
        crate::logtext::shown(&how)
    );
    metrics.count_completion("cancelled");
    ingress.report_finished(meta, false, exit.map(Exit::code), Some(how.clone()), out);
    let mut body = json!({"status": status, "message": how, "signal": c.signal, "pid": pid});
    if let Some(r) = &c.reason {
        crate::util::set(&mut body, "reason", json!(r));
    }
    (body, format!("{status} status of {} {rid}", meta.kind))
}

/// The completion of a workload that ended by itself, timed out or was lost, and its
/// outbox label.
pub(super) fn finished_body(
    meta: &Meta,
    exit: Option<&Exit>,
    lost: Option<&str>,
    rid: &str,
    metrics: &mut Metrics,
    ingress: &mut Ingress,
    out: &mut dyn events::Publisher,
) -> (Value, String) {
    let pid = meta.pid();
    let code = exit.map(Exit::code);
    let timed_out = meta.cancel.as_ref().is_some_and(|c| c.timed_out);
    let success = code == Some(0) && lost.is_none() && !timed_out;
    let mut body = json!({"status": "completed", "success": success});
    if let Some(c) = code {
        crate::util::set(&mut body, "exit_code", json!(c));
    }
    if !success {
        let fallback = match (exit.and_then(|e| e.signal), code) {
            (Some(s), _) => format!(
                "{} was killed by {} (signal {s}).",
                meta.kind,
                procinfo::signal_name(s)
            ),
            (None, Some(c)) => format!("{} exited with code {c}.", meta.kind),
            (None, None) => {
                format!("{} failed before reporting an exit code.", meta.kind)
            }
        };
        let (mut error, stderr) = workload::failure_summary(meta, &fallback);
        if let Some(l) = lost {
            error = l.to_string();
        }
        if timed_out {
            error = format!("timed out after {}s", meta.max_runtime_s.unwrap_or(0.0));
        }
        crate::util::set(&mut body, "error", json!(error));
        if let Some(s) = stderr {
            crate::util::set(&mut body, "stderr", json!(s));
        }
    }
    ingress.report_finished(
        meta,
        success,
        code,
        body.get("error").and_then(Value::as_str).map(String::from),
        out,
    );
    metrics.count_completion(if success {
        "success"
    } else if lost.is_some() {
        "lost"
    } else {
        "failure"
    });
    log::info!(
        "{} {} (pid {pid}) finished: {}{}",
        meta.kind,
        crate::logtext::shown(rid),
        if success { "success" } else { "failure" },
        code.map(|c| format!(", exit code {c}")).unwrap_or_default()
    );
    (body, format!("completion of {} {rid}", meta.kind))
}

/// The GPU holds of the node's tracked workloads and starts in flight.
pub(super) fn holds_of<'a>(active: &'a Table, starts: &'a Starts) -> Vec<gpus::Hold<'a>> {
    active.holds().chain(starts.holds()).collect()
}

/// At shutdown: the workloads left running, one line each.
pub(super) fn log_running(active: &super::table::Table) {
    for a in active.values() {
        log::info!(
            "left running: {} {} pid {} (logs {} and {})",
            a.meta.kind,
            crate::logtext::shown(&a.meta.request_id_text()),
            a.meta.pid(),
            crate::logtext::shown(&a.meta.stdout_log.display().to_string()),
            crate::logtext::shown(&a.meta.stderr_log.display().to_string())
        );
    }
}

/// The workload's shim or the workload itself is still the process it was (D9).
fn alive(st: &workload::shim::Started) -> bool {
    procinfo::same_process_alive(st.shim_pid, st.shim_start_ticks)
        || procinfo::same_process_alive(st.pid, st.start_ticks)
}

pub(super) fn start_output(meta: &Meta) -> Value {
    json!({"message": format!("{} started", meta.kind), "pid": meta.pid(), "workload_request_id": meta.request_id})
}

/// How a cancelled workload ended: the signal asked for, and the SIGKILL of the escalation when
/// the workload outlived its grace ("cancelled by SIGTERM" alone would hide that it was killed).
fn cancel_message(c: &workload::Cancel, exit: Option<&Exit>) -> String {
    let asked = &c.signal;
    let how = match exit.and_then(|e| e.signal) {
        Some(9) if asked != "SIGKILL" => format!(
            "Workload cancelled by {asked}; it was still running after the {}s grace and was killed with SIGKILL",
            c.grace_s
        ),
        _ => format!("Workload cancelled by {asked}"),
    };
    match &c.reason {
        Some(r) => format!("{how} ({r})"),
        None => how,
    }
}

/// The notes of the starts that the node before this one took and did not answer (D53):
/// those whose workload started (with the `ok` output of their start), and the others.
pub(super) type RecoveredStarts = (Vec<(String, Taken, Value)>, BTreeMap<String, Taken>);

/// What a workload's events touch, borrowed apart from the node for one call (the loop builds
/// it): the table (and, to carry out its effects, the session, io handles and settings), the
/// streams (logs to ship), the outbox (completions), the ingress part (workflow reports), the
/// GPUs (accounting) and the starts that hold some, the node's life (its counters) and the
/// throttles of repeated errors.
pub(super) struct Work<'a> {
    pub(super) s: &'a Settings,
    pub(super) io: &'a Io,
    pub(super) session: &'a mut Session<Op>,
    pub(super) life: &'a mut Life,
    pub(super) active: &'a mut Table,
    pub(super) outbox: &'a mut Outbox,
    pub(super) starts: &'a mut Starts,
    pub(super) streams: &'a mut Streams,
    pub(super) ingress: &'a mut Ingress,
    pub(super) gpu: &'a mut Gpus,
    /// The services workloads left (D59): a completion takes on those its supervisor kept.
    pub(super) services: &'a mut super::service_watch::Services,
    pub(super) throttle: &'a mut Throttles,
}

impl Work<'_> {
    pub(super) fn now(&self) -> Instant {
        self.io.clock.now()
    }

    /// Workloads that hold a slot: tracked ones and starts in flight.
    pub(super) fn in_use(&self) -> usize {
        self.active.len().saturating_add(self.starts.len())
    }

    /// The user a new workload runs as (D46.3): none without `workload_user`; its one user;
    /// or with a pool, the first one no tracked workload and no start in flight holds (D65).
    pub(super) fn free_user(&self) -> Result<Option<crate::workload::user::WorkloadUser>, String> {
        let users = &self.io.users;
        if users.len() <= 1 {
            return Ok(users.first().cloned());
        }
        let held: std::collections::BTreeSet<u32> = self
            .active
            .values()
            .filter_map(|a| a.meta.uid)
            .chain(self.starts.iter().filter_map(|(_, s)| s.uid))
            .collect();
        users
            .iter()
            .find(|u| !held.contains(&u.uid))
            .cloned()
            .map(Some)
            .ok_or_else(|| {
                format!(
                    "every user of the workload_user pool ({}) is held by a running workload",
                    users.len()
                )
            })
    }

    /// Replies to the backend's commands.
    pub(super) fn replies(&self) -> Replies<'_> {
        Replies {
            io: self.io,
            session: self.session,
        }
    }

    /// Sends one of the loop's requests through the session; returns its correlation.
    pub(super) fn request(
        &mut self,
        op: Op,
        topic: &str,
        body: Value,
        timeout: Duration,
    ) -> Vec<u8> {
        let now = self.now();
        self.session
            .request(op, topic, &body, timeout, now, &mut self.io.link(self.s))
    }

    /// A non-terminal workload status (R7): sent once, its failure only logged.
    pub(super) fn workload_status(&mut self, wl: &TopicId, body: Value) {
        let topic = self.io.topics.workload_status(wl);
        let timeout = self.s.tuning.request_timeout;
        self.request(Op::WorkloadStatus, &topic, body, timeout);
    }

    /// Carries out what the table asked for, in its order; shipping logs (once) and reporting
    /// ends come after the rest, so the requests and records of the same call are out first.
    pub(super) fn carry_out(&mut self, fx: Fx) {
        let mut last = Vec::new();
        for e in fx.list {
            if let Some(e) = super::io::send(e, self.session, self.io, self.s) {
                last.push(e);
            }
        }
        let mut shipped = false;
        for e in last {
            match e {
                Effect::ShipLogs if !shipped => {
                    shipped = true;
                    self.pump_logs();
                }
                Effect::Report {
                    id,
                    meta,
                    exit,
                    lost,
                    left,
                } => {
                    let held = self.complete(&id, *meta, exit, lost, &left);
                    if let Some(e) = self.active.completion_queued(&id, held) {
                        let _ = super::io::send(e, self.session, self.io, self.s);
                    }
                    if held.is_some() {
                        self.flush_outbox();
                    }
                }
                _ => {}
            }
        }
    }

    /// Sends a workload's end: through the outbox (once per workload), or published once by a
    /// standalone node. `Some(seq)`: queued, but the outbox could not write it to disk (D28).
    pub(super) fn send_completion(
        &mut self,
        safe_id: &str,
        meta: &Meta,
        body: Value,
        label: String,
        rid: &str,
    ) -> Option<u64> {
        if let Some(wl) = &meta.workload_uuid {
            let topic = self.io.topics.workload_status(wl);
            let key = format!("end:{safe_id}");
            if self.s.standalone {
                // No backend to acknowledge: published once for the site's own dispatcher.
                self.request(
                    Op::WorkloadStatus,
                    &topic,
                    body,
                    self.s.tuning.request_timeout,
                );
            } else if !self.outbox.has_key(&key) {
                let item = Item {
                    topic,
                    body,
                    label,
                    key: Some(key),
                    owner: None,
                };
                match self.outbox.push(item) {
                    Ok(_) => self.flush_outbox(),
                    Err((seq, e)) => {
                        if let Some(held) = self.throttle.disk.ready(self.io.clock.now()) {
                            log::error!("cannot write the completion of {} to disk ({e}); it is kept in memory and sent anyway, and the workload's record stays until it is acknowledged{}", shown(rid), crate::logtext::held_note(held));
                        }
                        return Some(seq);
                    }
                }
            }
        }
        None
    }

    /// Writes what the disk refused before, then sends what is due (while connected).
    pub(super) fn flush_outbox(&mut self) {
        if self.outbox.has_pending_writes() {
            let left = self.outbox.persist_pending();
            if left > 0 {
                if let Some(held) = self.throttle.disk.ready(self.io.clock.now()) {
                    log::error!("{left} outbox message(s) still cannot be written to disk; they are kept in memory{}", crate::logtext::held_note(held));
                }
            }
        }
        if !self.session.connected() {
            return;
        }
        let now = self.io.clock.now();
        for (seq, item) in self.outbox.due(now) {
            if !crate::protocol::topics::publishable(&item.topic) {
                // Queued by an older version or planted: no broker would take it (D34).
                if let Some((item, aside)) = self.outbox.quarantine(seq) {
                    log::error!(
                        "the {} has an invalid topic; set aside in {} and not sent",
                        crate::logtext::shown(&item.label),
                        aside.display()
                    );
                }
                continue;
            }
            let corr = self.request(
                Op::Outbox(seq),
                &item.topic,
                item.body.clone(),
                self.s.tuning.request_timeout,
            );
            self.outbox.sent(seq, corr);
        }
    }

    /// The reply to outbox message `seq` (or its timeout); true when the backend acknowledged
    /// it (the table then lets the workload's record go).
    fn outbox_reply(&mut self, seq: u64, body: Option<crate::protocol::replies::Reply>) -> bool {
        match body {
            Some(b) if b.success => {
                if let Some(item) = self.outbox.acknowledged(seq) {
                    log::info!(
                        "backend acknowledged the {}",
                        crate::logtext::shown(&item.label)
                    );
                }
                true
            }
            Some(b) if b.code.is_some_and(|c| c < 500) => {
                if let Some(item) = self.outbox.acknowledged(seq) {
                    log::error!(
                        "backend refused the {} ({}); not retried",
                        crate::logtext::shown(&item.label),
                        crate::logtext::shown(&b.message)
                    );
                }
                false
            }
            _ => {
                log::warn!("no acknowledgement for outbox message {seq}; retrying later");
                self.outbox.retry_later(seq, self.io.clock.now());
                false
            }
        }
    }

    /// Runs `f` on the workload table with the host's [`table::World`], then carries out
    /// what it asked for ([`Work::carry_out`]).
    pub(super) fn with_table<R>(
        &mut self,
        f: impl FnOnce(&mut Table, &mut dyn table::World, &mut Fx, Instant) -> R,
    ) -> R {
        let now = self.now();
        let mut fx = Fx::new(self.session.connected());
        let mut world = table::Procs {
            layout: &self.io.layout,
        };
        let r = f(self.active, &mut world, &mut fx, now);
        self.carry_out(fx);
        r
    }

    pub(super) fn on_reaped(&mut self, id: &str) {
        self.with_table(|t, w, fx, now| t.on_reaped(id, now, w, fx));
    }

    /// Tracks a workload: in the table, its supervisor watched by the reaper thread (`child`:
    /// this node started it), so its end is reported only once the table knows it.
    pub(super) fn track(&mut self, id: &str, meta: Meta, child: bool) {
        let supervisor = meta
            .started
            .as_ref()
            .map(|s| (s.shim_pid, s.shim_start_ticks));
        let now = self.now();
        self.active
            .insert(id.to_string(), table::Active::new(meta, now));
        if let Some((pid, ticks)) = supervisor {
            self.io.reaper.watch(id, pid, ticks, child);
        }
    }

    /// Reports the end of a workload exactly once (through the outbox); the table no longer
    /// tracks it, and its record goes once the completion is safe (the caller tells the table,
    /// [`Table::completion_queued`]: `Some(seq)`, queued but not on disk, D28). Deferred starts
    /// that it made room for go ahead at the loop's next tick, in the same turn.
    pub(super) fn complete(
        &mut self,
        safe_id: &str,
        meta: Meta,
        exit: Option<Exit>,
        lost: Option<&str>,
        left: &super::effect::LeftOnDisk,
    ) -> Option<u64> {
        let pid = meta.pid();
        let rid = meta.request_id_text();
        self.services_left(safe_id, &meta);
        if meta.cancel.as_ref().is_some_and(|c| c.stale) {
            log::info!(
                "stale {} {} (pid {pid}) is gone; forgotten without a completion",
                meta.kind,
                shown(&rid)
            );
            self.life.metrics.count_completion("stale");
            return None;
        }
        let mut publisher = events::MqttPublisher {
            connected: self.session.connected(),
            now: self.io.clock.now(),
            io: self.io,
            disk_errors: &mut self.throttle.disk,
        };
        let (metrics, events) = (&mut self.life.metrics, &mut *self.ingress);
        let (mut body, label) = match &meta.cancel {
            Some(c) if !c.timed_out => cancelled_body(
                &meta,
                c,
                exit.as_ref(),
                &rid,
                metrics,
                events,
                &mut publisher,
            ),
            _ => finished_body(
                &meta,
                exit.as_ref(),
                lost,
                &rid,
                metrics,
                events,
                &mut publisher,
            ),
        };
        if let Some(g) = self.gpu.usage_of(safe_id, &meta) {
            gpus::put(&mut body, "gpu", g); // D38
        }
        if !left.unattributed.is_empty() {
            // D61: result files it could have written, left on disk (a new optional field).
            crate::util::set(&mut body, "unattributed_results", json!(left.unattributed));
        }
        if !left.not_uploaded.is_empty() {
            // D68: its result files left on disk, not uploaded (a new optional field).
            crate::util::set(&mut body, "results_not_uploaded", json!(left.not_uploaded));
        }
        self.update_sampling();
        // D28: `Some(seq)`, kept in memory and sent all the same; the workload's record stays
        // until the backend acknowledged it, so a restart still knows.
        self.send_completion(safe_id, &meta, body, label, &rid)
    }

    /// D59: what the workload's supervisor kept running (services, taken on) and cleared
    /// (logged), from its record.
    fn services_left(&mut self, safe_id: &str, meta: &Meta) {
        let origin = super::service_watch::Origin {
            started_by: meta.kind.to_string(),
            request_id: Some(store::clip(&meta.request_id_text(), 200)),
            workload_uuid: meta.workload_uuid.as_ref().map(|w| w.as_str().to_string()),
        };
        let uid = meta.uid.unwrap_or_else(crate::util::euid);
        let now = self.now();
        let dir = self.io.layout.dir(safe_id);
        self.services.adopt_left(&dir, &origin, uid, now);
    }

    /// The table's timers, with the streams' verdict on which ending workloads are drained.
    pub(super) fn tick(&mut self) {
        let now = self.now();
        // The streams' verdict, read before the table is borrowed.
        let drained = self.drained_logs(now);
        self.with_table(|t, w, fx, now| t.tick(now, &drained, w, fx));
    }

    /// A worker's result other than a self-heal lookup.
    pub(super) fn on_worker_done(&mut self, done: Done) {
        self.with_table(|t, w, fx, now| t.on_worker_done(done, now, w, fx));
    }

    pub(super) fn on_outbox_reply(&mut self, seq: u64, body: Option<Reply>) {
        if self.outbox_reply(seq, body) {
            if let Some(e) = self.active.acknowledged(seq) {
                self.carry_out(Fx {
                    connected: self.session.connected(),
                    list: vec![e],
                });
            }
        }
    }

    /// The GPU holds of the tracked workloads and the starts in flight.
    pub(super) fn holds(&self) -> Vec<gpus::Hold<'_>> {
        holds_of(self.active, self.starts)
    }

    /// GPU sampling runs every few seconds only while a tracked workload holds GPUs.
    pub(super) fn update_sampling(&self) {
        self.gpu
            .update_sampling(&self.holds(), &self.io.gpu_monitor.as_ref());
    }

    /// Runs `f` on the ingress part with its [`events::MqttPublisher`] (the io handles and the
    /// full-disk throttle).
    pub(super) fn with_ingress<R>(
        &mut self,
        f: impl FnOnce(&mut Ingress, &mut dyn events::Publisher) -> R,
    ) -> R {
        let mut publisher = events::MqttPublisher {
            connected: self.session.connected(),
            now: self.io.clock.now(),
            io: self.io,
            disk_errors: &mut self.throttle.disk,
        };
        f(self.ingress, &mut publisher)
    }

    /// `emit` from a workload, through the control socket: its owner found by its token.
    pub(super) fn on_emit(&mut self, body: &Value) -> Value {
        let owner = events::owner_of(self.active, body);
        self.with_ingress(|i, out| i.emit(body, owner.as_ref(), out))
    }

    /// Re-adopts every workload in the state dir (run once, before the loop); returns the
    /// notes of the starts the node before this one took and did not answer (D53), those
    /// whose workload started apart, to be settled on the ledger.
    pub(super) fn recover(&mut self) -> RecoveredStarts {
        let layout = self.io.layout.clone();
        let mut notes: BTreeMap<String, Taken> = starts::load_notes(&layout).into_iter().collect();
        let mut started = Vec::new();
        let now = self.now();
        let params_cap = u64::try_from(self.s.tuning.max_command_bytes).unwrap_or(u64::MAX);
        recover_workloads(
            &layout,
            params_cap,
            &mut notes,
            &mut started,
            &mut |name, meta, ending| match ending {
                Some((exit, lost)) => {
                    self.active
                        .insert(name.clone(), table::Active::new(meta, now));
                    self.with_table(|t, w, fx, now| t.end(&name, exit, lost, now, w, fx));
                }
                None => self.track(&name, meta, false),
            },
        );
        for (safe_id, taken, _) in &started {
            self.carry_out_noted_cancel(safe_id, taken);
        }
        (started, notes)
    }

    /// A cancel answered while the start was in flight, before the node's restart: carried out
    /// now that its workload is re-adopted (one that ended meanwhile is reported as it ended).
    fn carry_out_noted_cancel(&mut self, safe_id: &str, taken: &Taken) {
        let Some(c) = taken.cancel.as_ref().and_then(starts::NotedCancel::pending) else {
            return;
        };
        if self.active.get(safe_id).is_none_or(table::Active::finished) {
            return;
        }
        log::info!(
            "carrying out the cancel of {} recorded while it was starting, before the node's restart",
            shown(&crate::protocol::commands::request_id_text(&taken.request_id))
        );
        let r = self.with_table(|t, w, fx, now| {
            t.cancel(safe_id, c.signal, c.name, c.grace, false, now, w, fx)
        });
        if let Err(e) = r {
            log::warn!(
                "the cancel recorded for {} failed: {}",
                shown(safe_id),
                shown(&e)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(signal: Option<i32>) -> Exit {
        Exit {
            exit_code: None,
            signal,
            started_at: String::new(),
            ended_at: String::new(),
        }
    }

    #[test]
    fn a_cancel_that_ended_in_the_escalation_says_so() {
        let c = |signal: &str| workload::Cancel {
            signal: signal.into(),
            requested_unix: 0.0,
            grace_s: 2.5,
            timed_out: false,
            stale: false,
            reason: None,
        };
        assert_eq!(
            cancel_message(&c("SIGTERM"), Some(&exit(Some(15)))),
            "Workload cancelled by SIGTERM"
        );
        let mut stopping = c("SIGTERM");
        stopping.reason = Some(crate::node::container::REASON.into());
        assert_eq!(
            cancel_message(&stopping, Some(&exit(Some(9)))),
            "Workload cancelled by SIGTERM; it was still running after the 2.5s grace and was killed with SIGKILL (the node's container is stopping)"
        );
        assert_eq!(
            cancel_message(&c("SIGTERM"), Some(&exit(Some(9)))),
            "Workload cancelled by SIGTERM; it was still running after the 2.5s grace and was killed with SIGKILL"
        );
        assert_eq!(
            cancel_message(&c("SIGKILL"), Some(&exit(Some(9)))),
            "Workload cancelled by SIGKILL"
        );
        assert_eq!(
            cancel_message(&c("SIGINT"), None),
            "Workload cancelled by SIGINT"
        );
    }
}
