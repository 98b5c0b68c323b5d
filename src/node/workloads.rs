//! The node's side of workloads: starting (exactly once per request id, within capacity),
//! cancelling (process group, escalation), completion (exactly once, through the outbox),
//! the max-runtime limit, and re-adopting workloads after a restart.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::logs::{Cursor, Stream};
use super::uploads::Upload;
use super::{Node, Op};
use crate::logtext::shown;
use crate::outbox::Item;
use crate::protocol::commands::{CancelParams, CancelTarget, RequestId, Seconds};
use crate::store;
use crate::workload::lifecycle::{self, Action, Event, Phase};
use crate::workload::shim::Exit;
use crate::workload::{self, procinfo, Cancel, Meta};

/// Default grace between the cancel signal and SIGKILL of the whole group (D10).
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);
/// How often adopted workloads (not the node's children) are checked.
const ADOPTED_CHECK: Duration = Duration::from_millis(250);

/// A workload the node tracks.
pub struct Active {
    pub meta: Meta,
    /// The shim is the node's child: the reaper reports its exit.
    pub child: bool,
    /// Where it is: the one source of truth, changed only through [`Node::advance`].
    pub phase: Phase,
    pub runtime_deadline: Option<Instant>,
    pub next_check: Instant,
    /// stdout, stderr.
    pub streams: [Stream; 2],
    /// The progress of its result uploads, while the phase is `Uploading`.
    pub upload: Option<Upload>,
}

impl Active {
    pub(super) fn new(meta: Meta, child: bool, now: Instant) -> Active {
        let elapsed = (workload::unix_now() - meta.created_unix).max(0.0);
        // A limit read back from disk is bounded again here: no value can overflow the clock.
        let runtime_deadline = meta
            .max_runtime_s
            .and_then(Seconds::from_f64)
            .and_then(|m| Duration::try_from_secs_f64((m.get() - elapsed).max(0.0)).ok())
            .and_then(|left| now.checked_add(left));
        // A cancel recorded before a restart is still under way, with its original deadline.
        let phase = match &meta.cancel {
            Some(c) => Phase::Cancelling {
                escalate_at: crate::util::secs_f64(
                    (c.requested_unix + c.grace_s - workload::unix_now()).max(0.0),
                )
                .checked_add(Duration::ZERO)
                .and_then(|left| now.checked_add(left)),
            },
            None => Phase::Running,
        };
        Active {
            meta,
            child,
            phase,
            runtime_deadline,
            next_check: now,
            streams: [Stream::default(), Stream::default()],
            upload: None,
        }
    }

    /// Nothing of it runs any more: it waits for its logs, uploads or report and is never
    /// signalled again (D26).
    pub fn finished(&self) -> bool {
        self.phase.finished()
    }

    pub fn state(&self) -> &'static str {
        self.phase.label()
    }
}

/// The workload's process group, when it can be proven at this moment to be the one its
/// supervisor created: same boot, and live members in the supervisor's session (D26). None:
/// nothing of it is left to signal, and a signal to that number could reach a stranger.
fn provable_group(meta: &Meta) -> Option<i32> {
    let st = meta.started.as_ref()?;
    (st.boot_id == procinfo::boot_id() && procinfo::group_members(st.pid, st.shim_pid) > 0)
        .then_some(st.pid)
}

/// Signals the group if it is provably the workload's; `Ok(false)` when nothing is left.
fn signal_if_ours(meta: &Meta, sig: i32) -> std::io::Result<bool> {
    match provable_group(meta) {
        Some(g) => procinfo::signal_group(g, sig).map(|()| true),
        None => Ok(false),
    }
}

impl Node {
    /// A non-terminal workload status (R7): sent once, its failure only logged.
    pub(super) fn workload_status(&mut self, wl: &str, body: Value) {
        if wl.is_empty() || wl == "None" {
            return;
        }
        let topic = self.topics.workload_status(wl);
        self.request(
            Op::WorkloadStatus,
            &topic,
            body,
            self.s.tuning.request_timeout,
        );
    }

    // ---- cancel -----------------------------------------------------------------------------

    pub(super) fn cancel_command(&mut self, request_id: &RequestId, params: CancelParams) {
        let rid = request_id.text();
        let request_id = request_id.value();
        if !rid.is_empty() {
            if let Some(e) = self.ledger.get(&rid).cloned() {
                log::info!(
                    "cancel {} was handled before; repeating its answer",
                    shown(&rid)
                );
                return if e.ok {
                    self.reply_ok(request_id, e.body)
                } else {
                    self.reply_error(request_id, e.body.as_str().unwrap_or(""))
                };
            }
        }
        let sig = params.signal.number();
        let sig_name = params.signal.name();
        let grace = params.grace.map_or(DEFAULT_GRACE, Seconds::duration);
        let found = self
            .active
            .iter()
            .find(|(_, a)| match &params.target {
                CancelTarget::Pid(p) => a.meta.pid() == p.get() && a.meta.pid() > 0,
                CancelTarget::Request(r) => &a.meta.request_id_text() == r,
            })
            .map(|(k, _)| k.clone());
        let Some(safe_id) = found else {
            // D29: a workload this node started, reported and forgot already finished.
            if let CancelTarget::Request(r) = &params.target {
                if self.ledger.get(r).is_some_and(|e| e.ok) {
                    return self.reply_ok(
                        request_id,
                        json!({"message": "Workload already finished; its completion reports how it ended", "workload_request_id": r}),
                    );
                }
            }
            let msg = match &params.target {
                CancelTarget::Pid(p) => format!("No active workload found with PID {}", p.get()),
                CancelTarget::Request(r) => {
                    format!("No active workload found with request_id {r}")
                }
            };
            return self.reply_error(request_id, &msg);
        };
        match self.cancel_workload(&safe_id, sig, sig_name, grace, false) {
            Ok(message) => {
                let Some(a) = self.active.get(&safe_id) else {
                    return self.reply_ok(request_id, json!({"message": message}));
                };
                let out = json!({
                    "message": message,
                    "pid": a.meta.pid(),
                    "workload_type": a.meta.kind,
                    "workload_request_id": a.meta.request_id,
                    "signal": sig_name,
                });
                if !rid.is_empty() {
                    self.ledger.record(&rid, true, out.clone());
                }
                self.reply_ok(request_id, out);
            }
            Err(e) => self.reply_error(request_id, &e),
        }
    }

    /// Signals the workload's process group and arms the escalation to SIGKILL.
    pub(super) fn cancel_workload(
        &mut self,
        safe_id: &str,
        sig: i32,
        sig_name: &str,
        grace: Duration,
        timed_out: bool,
    ) -> Result<String, String> {
        let now = self.clock.now();
        let Some(a) = self.active.get_mut(safe_id) else {
            return Err("No active workload found".into());
        };
        let pid = a.meta.pid();
        if a.finished() {
            // D29: its real outcome is what the backend gets; nothing is signalled (D26).
            return Ok("Workload already finished; its completion reports how it ended".into());
        }
        if let Some(c) = &a.meta.cancel {
            // Cancelling already: the escalation keeps its original deadline; only a SIGKILL
            // asked for now goes out now.
            let first = c.signal.clone();
            if sig == libc::SIGKILL {
                signal_if_ours(&a.meta, sig)
                    .map_err(|e| format!("Failed to cancel workload: {e}"))?;
                return Ok(format!(
                    "Workload was already being cancelled with {first}; SIGKILL sent to its group"
                ));
            }
            return Ok(format!(
                "Workload is already being cancelled with {first}; anything left of it gets SIGKILL at the original deadline"
            ));
        }
        let message = match signal_if_ours(&a.meta, sig) {
            Ok(true) => format!("Workload cancelled with {sig_name}"),
            // Its group is gone: the exit is about to be noticed, and reported as it was.
            Ok(false) => return Ok(format!("Process {pid} was already terminated")),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                return Ok(format!("Process {pid} was already terminated"))
            }
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                return Err(format!("Permission denied to send signal to process {pid}"))
            }
            Err(e) => return Err(format!("Failed to cancel workload: {e}")),
        };
        log::info!(
            "cancelling {} {} (pid {pid}) with {sig_name}; SIGKILL to its group after {:.1}s",
            a.meta.kind,
            shown(&a.meta.request_id_text()),
            grace.as_secs_f64()
        );
        a.meta.cancel = Some(Cancel {
            signal: sig_name.to_string(),
            requested_unix: workload::unix_now(),
            grace_s: grace.as_secs_f64(),
            timed_out,
            stale: false,
        });
        if let Err(e) = workload::save_meta(&self.layout, &a.meta) {
            log::warn!("workload {safe_id}: cannot record the cancel: {e}");
        }
        let _ = now;
        self.advance(safe_id, Event::Cancelled { grace });
        Ok(message)
    }

    /// Self-heal: terminate a stale workload; it will be forgotten without a report.
    pub(super) fn cancel_stale(&mut self, safe_id: &str, grace: Duration) -> Result<(), String> {
        self.cancel_workload(safe_id, libc::SIGTERM, "SIGTERM", grace, false)?;
        if let Some(a) = self.active.get_mut(safe_id) {
            if let Some(c) = a.meta.cancel.as_mut() {
                c.stale = true;
            }
            if let Err(e) = workload::save_meta(&self.layout, &a.meta) {
                log::warn!(
                    "workload {}: cannot record the stale mark: {e}",
                    crate::logtext::shown(safe_id)
                );
            }
        }
        Ok(())
    }

    // ---- exits and completion ---------------------------------------------------------------

    pub(super) fn on_reaped(&mut self, pid: i32) {
        log::debug!("supervisor pid {pid} exited");
        let found = self
            .active
            .iter()
            .find(|(_, a)| a.child && a.meta.started.as_ref().is_some_and(|s| s.shim_pid == pid))
            .map(|(k, _)| k.clone());
        if let Some(safe_id) = found {
            let exit: Option<Exit> = workload::read_json(&self.layout.exit(&safe_id));
            self.on_exit(&safe_id, exit);
        }
    }

    /// The workload's supervisor ended (`exit` is its record, if it wrote one).
    fn on_exit(&mut self, safe_id: &str, exit: Option<Exit>) {
        log::debug!(
            "workload {} ended: {exit:?}",
            crate::logtext::shown(safe_id)
        );
        let Some(a) = self.active.get_mut(safe_id) else {
            return;
        };
        let group_alive = provable_group(&a.meta).is_some();
        if group_alive && exit.is_none() {
            // D27: the supervisor was killed; the workload stays tracked, counted and
            // cancellable until its group is empty.
            log::error!(
                "the supervisor of {} {} (pid {}) ended without an exit record while the workload still runs; tracking its process group until it is empty",
                a.meta.kind,
                shown(&a.meta.request_id_text()),
                a.meta.pid()
            );
        }
        if a.meta.salvaged.is_some() && !group_alive {
            // A record rebuilt at recovery: whatever the exit, its outcome cannot be trusted.
            return self.advance(
                safe_id,
                Event::Lost {
                    exit,
                    reason: SALVAGED,
                },
            );
        }
        self.advance(safe_id, Event::SupervisorEnded { exit, group_alive });
    }

    /// A workload known to have ended (found at recovery): ship what is left of its logs, then
    /// report it — as lost when `lost` says why, or when its record was rebuilt.
    fn begin_ending(&mut self, safe_id: &str, exit: Option<Exit>, lost: Option<&'static str>) {
        let salvaged = self
            .active
            .get(safe_id)
            .is_some_and(|a| a.meta.salvaged.is_some());
        let event = match (lost, salvaged) {
            (_, true) => Event::Lost {
                exit,
                reason: SALVAGED,
            },
            (Some(reason), false) => Event::Lost { exit, reason },
            (None, false) => Event::SupervisorEnded {
                exit,
                group_alive: false,
            },
        };
        self.advance(safe_id, event);
    }

    /// Feeds `event` to the workload's lifecycle ([`lifecycle::step`]) and carries out what it
    /// says. The only place a workload's phase changes.
    pub(super) fn advance(&mut self, id: &str, event: Event) {
        let now = self.clock.now();
        let Some(a) = self.active.get_mut(id) else {
            return;
        };
        let (next, actions) = lifecycle::step(&a.phase, event, now);
        a.phase = next;
        for action in actions {
            match action {
                Action::KillGroup => {
                    if let Some(a) = self.active.get(id) {
                        if provable_group(&a.meta).is_some() {
                            log::warn!(
                                "workload pid {} outlived its grace period; SIGKILL to its process group",
                                a.meta.pid()
                            );
                            let _ = signal_if_ours(&a.meta, libc::SIGKILL);
                        }
                    }
                }
                Action::ShipLogs => self.pump_streams(false),
                Action::StartUploads => {
                    let exit = match self.active.get(id).map(|a| &a.phase) {
                        Some(Phase::Uploading { exit }) => exit.clone(),
                        _ => None,
                    };
                    if !self.begin_uploads(id, exit) {
                        self.advance(id, Event::UploadsDone);
                    }
                }
                Action::Report { exit, lost } => self.complete(id, exit, lost),
            }
        }
    }

    /// Reports the end of a workload exactly once (through the outbox) and forgets it.
    pub(super) fn complete(&mut self, safe_id: &str, exit: Option<Exit>, lost: Option<&str>) {
        let Some(a) = self.active.remove(safe_id) else {
            return;
        };
        let meta = a.meta;
        let pid = meta.pid();
        let rid = meta.request_id_text();
        if meta.cancel.as_ref().is_some_and(|c| c.stale) {
            log::info!(
                "stale {} {} (pid {pid}) is gone; forgotten without a completion",
                meta.kind,
                crate::logtext::shown(&rid)
            );
            self.count_completion("stale");
            self.retire(safe_id);
            self.retry_deferred_starts();
            return;
        }
        let (body, label) = match &meta.cancel {
            Some(c) if !c.timed_out => {
                let status = if meta.kind == "training" {
                    "failed"
                } else {
                    "cancelled"
                };
                log::info!(
                    "{} {} (pid {pid}) cancelled by {}",
                    meta.kind,
                    crate::logtext::shown(&rid),
                    crate::logtext::shown(&c.signal)
                );
                self.count_completion("cancelled");
                self.report_finished(
                    &meta,
                    false,
                    exit.as_ref().map(Exit::code),
                    Some(format!("Workload cancelled by {}", c.signal)),
                );
                (
                    json!({"status": status, "message": format!("Workload cancelled by {}", c.signal), "signal": c.signal, "pid": pid}),
                    format!("{status} status of {} {rid}", meta.kind),
                )
            }
            cancel => {
                let code = exit.as_ref().map(Exit::code);
                let timed_out = cancel.as_ref().is_some_and(|c| c.timed_out);
                let success = code == Some(0) && lost.is_none() && !timed_out;
                let mut body = json!({"status": "completed", "success": success});
                if let Some(c) = code {
                    crate::util::set(&mut body, "exit_code", json!(c));
                }
                if !success {
                    let fallback = match (exit.as_ref().and_then(|e| e.signal), code) {
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
                    let (mut error, stderr) = workload::failure_summary(&meta, &fallback);
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
                self.report_finished(
                    &meta,
                    success,
                    code,
                    body.get("error").and_then(Value::as_str).map(String::from),
                );
                self.count_completion(if success {
                    "success"
                } else if lost.is_some() {
                    "lost"
                } else {
                    "failure"
                });
                log::info!(
                    "{} {} (pid {pid}) finished: {}{}",
                    meta.kind,
                    crate::logtext::shown(&rid),
                    if success { "success" } else { "failure" },
                    code.map(|c| format!(", exit code {c}")).unwrap_or_default()
                );
                (body, format!("completion of {} {rid}", meta.kind))
            }
        };
        let mut body = body;
        if let Some(g) = self.gpu_usage_of(safe_id, &meta) {
            super::gpus::put(&mut body, "gpu", g); // D38
        }
        self.gpu_update_sampling();
        if let Some(wl) = meta
            .workload_uuid
            .as_deref()
            .filter(|w| !w.is_empty() && *w != "None")
        {
            let topic = self.topics.workload_status(wl);
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
                };
                match self.outbox.push(item) {
                    Ok(_) => self.flush_outbox(),
                    Err((seq, e)) => {
                        // D28: kept in memory and sent all the same; the workload's record
                        // stays until the backend acknowledged it, so a restart still knows.
                        if let Some(held) = self.disk_errors.ready(self.clock.now()) {
                            log::error!("cannot write the completion of {} to disk ({e}); it is kept in memory and sent anyway, and the workload's record stays until it is acknowledged{}", shown(&rid), held_note(held));
                        }
                        self.retire_on_ack.insert(seq, safe_id.to_string());
                        self.flush_outbox();
                        self.retry_deferred_starts();
                        return;
                    }
                }
            }
        }
        self.retire(safe_id);
        self.retry_deferred_starts();
    }

    /// Removes a reported workload's directory: first an atomic rename (so a crash never leaves
    /// a half-deleted record that a restart would misread), then the deletion.
    fn retire(&self, safe_id: &str) {
        let dir = self.layout.dir(safe_id);
        let trash = self.layout.workloads().join(format!(".retired-{safe_id}"));
        let target = match std::fs::rename(&dir, &trash) {
            Ok(()) => trash,
            Err(e) => {
                log::warn!(
                    "cannot retire {}: {e}",
                    crate::logtext::shown(&dir.display().to_string())
                );
                return;
            }
        };
        if let Err(e) = std::fs::remove_dir_all(&target) {
            log::warn!(
                "cannot remove {}: {e}",
                crate::logtext::shown(&target.display().to_string())
            );
        }
    }

    // ---- the outbox -------------------------------------------------------------------------

    pub(super) fn flush_outbox(&mut self) {
        if self.outbox.has_pending_writes() {
            let left = self.outbox.persist_pending();
            if left > 0 {
                if let Some(held) = self.disk_errors.ready(self.clock.now()) {
                    log::error!("{left} outbox message(s) still cannot be written to disk; they are kept in memory{}", held_note(held));
                }
            }
        }
        if self.conn != super::Conn::Connected {
            return;
        }
        let now = self.clock.now();
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

    pub(super) fn on_outbox_reply(
        &mut self,
        seq: u64,
        body: Option<crate::protocol::replies::Reply>,
    ) {
        match body {
            Some(b) if b.success => {
                if let Some(item) = self.outbox.acknowledged(seq) {
                    log::info!(
                        "backend acknowledged the {}",
                        crate::logtext::shown(&item.label)
                    );
                }
                if let Some(safe_id) = self.retire_on_ack.remove(&seq) {
                    self.retire(&safe_id);
                }
            }
            Some(b) if b.code.is_some_and(|c| c < 500) => {
                if let Some(item) = self.outbox.acknowledged(seq) {
                    log::error!(
                        "backend refused the {} ({}); not retried",
                        crate::logtext::shown(&item.label),
                        crate::logtext::shown(&b.message)
                    );
                }
            }
            _ => {
                log::warn!("no acknowledgement for outbox message {seq}; retrying later");
                self.outbox.retry_later(seq, self.clock.now());
            }
        }
    }

    // ---- timers -----------------------------------------------------------------------------

    pub(super) fn tick_workloads(&mut self) {
        let now = self.clock.now();
        let ids: Vec<String> = self.active.keys().cloned().collect();
        for id in ids {
            let Some(a) = self.active.get(&id) else {
                continue;
            };
            // Max runtime.
            if a.runtime_deadline.is_some_and(|d| now >= d)
                && a.meta.cancel.is_none()
                && !a.finished()
            {
                log::warn!(
                    "{} {} exceeded its max runtime; cancelling",
                    a.meta.kind,
                    shown(&a.meta.request_id_text())
                );
                if let Some(a) = self.active.get_mut(&id) {
                    a.runtime_deadline = None;
                }
                let _ = self.cancel_workload(&id, libc::SIGTERM, "SIGTERM", DEFAULT_GRACE, true);
                continue;
            }
            // Deadlines of its phase (escalation, drain limit).
            if a.phase.deadline().is_some_and(|t| now >= t) {
                self.advance(&id, Event::Tick);
            }
            let Some(a) = self.active.get(&id) else {
                continue;
            };
            match &a.phase {
                Phase::Draining { .. } => {
                    if self.drained(&id, now) {
                        self.advance(&id, Event::LogsDrained);
                    }
                    continue;
                }
                Phase::Uploading { .. } => {
                    self.step_upload(&id);
                    continue;
                }
                Phase::Lingering { .. } => {
                    if now >= a.next_check {
                        if let Some(a) = self.active.get_mut(&id) {
                            a.next_check = crate::util::later(now, ADOPTED_CHECK);
                        }
                        if self
                            .active
                            .get(&id)
                            .is_some_and(|a| provable_group(&a.meta).is_none())
                        {
                            self.advance(&id, Event::GroupEmpty);
                        }
                    }
                    continue;
                }
                Phase::Done => continue,
                Phase::Running | Phase::Cancelling { .. } => {}
            }
            // Adopted workloads: their exit record tells the end.
            if !a.child && now >= a.next_check {
                if let Some(a) = self.active.get_mut(&id) {
                    a.next_check = crate::util::later(now, ADOPTED_CHECK);
                }
                self.check_adopted(&id);
            }
        }
    }

    fn check_adopted(&mut self, safe_id: &str) {
        let Some(a) = self.active.get(safe_id) else {
            return;
        };
        if let Some(exit) = workload::read_json::<Exit>(&self.layout.exit(safe_id)) {
            return self.on_exit(safe_id, Some(exit));
        }
        let Some(st) = a.meta.started.clone() else {
            return;
        };
        let shim_alive =
            st.shim_pid > 0 && procinfo::same_process_alive(st.shim_pid, st.shim_start_ticks);
        if !shim_alive {
            // One more look: the shim may have written the record as it ended.
            let exit: Option<Exit> = workload::read_json(&self.layout.exit(safe_id));
            self.on_exit(safe_id, exit);
        }
    }

    // ---- recovery ---------------------------------------------------------------------------

    /// Re-adopts every workload in the state dir (run once, before the loop).
    pub(super) fn recover(&mut self) {
        let _ = store::ensure_dir_or_quarantine(&self.layout.workloads());
        let Ok(entries) = std::fs::read_dir(self.layout.workloads()) else {
            return;
        };
        let boot = procinfo::boot_id();
        let now = self.clock.now();
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
            let (meta, salvaged) = match workload::recover_meta(&self.layout, &dir, &name) {
                workload::Recovered::Intact(m) => (m, false),
                workload::Recovered::Salvaged(m) => (m, true),
            };
            let shown = store::clip(&name, 80);
            let Some(st) = meta.started.clone() else {
                if salvaged {
                    // Nothing proves which process it was: report it (once) and retire it.
                    self.report_unprovable(&name, meta, now);
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
            let exit: Option<Exit> =
                workload::load_json(&dir.join("exit.json"), "workload exit record");
            // Outside text in a log line: escaped and cut (D31).
            let rid = store::clip(&meta.request_id_text(), 120);
            let mut active = Active::new(meta, false, now);
            let cursor: Cursor =
                workload::load_json(&dir.join("cursor.json"), "log cursor").unwrap_or_default();
            for (s, (at, base)) in active.streams.iter_mut().zip([
                (cursor.stdout, cursor.stdout_base),
                (cursor.stderr, cursor.stderr_base),
            ]) {
                s.acked = at;
                s.mirrored = at;
                s.base = base;
            }
            self.active.insert(name.clone(), active);
            if salvaged && (exit.is_some() || !alive(&st)) {
                self.begin_ending(&name, exit, Some(SALVAGED));
            } else if exit.is_some() {
                log::info!("workload {rid} ended while the node was down; reporting it");
                self.begin_ending(&name, exit, None);
            } else if !st.boot_id.is_empty() && st.boot_id != boot {
                log::warn!("workload {rid} was lost: the host rebooted");
                self.begin_ending(&name, None, Some("workload lost: host rebooted"));
            } else if alive(&st) {
                log::info!("re-adopted running workload {rid} (pid {})", st.pid);
            } else {
                log::warn!("workload {rid} was lost while the node was down");
                self.begin_ending(
                    &name,
                    None,
                    Some("workload lost: node restarted and no exit status was recorded"),
                );
            }
        }
    }

    /// A workload whose record did not validate and that no pid identity ties to a process:
    /// its end is reported once (a failure, when its workload uuid is known; an ERROR line
    /// otherwise) and its directory retired.
    fn report_unprovable(&mut self, name: &str, meta: Meta, now: Instant) {
        let shown = store::clip(name, 80);
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
        self.active
            .insert(name.to_string(), Active::new(meta, false, now));
        self.begin_ending(name, None, Some(SALVAGED));
    }

    pub(super) fn active_workloads_json(&self) -> Value {
        let now = workload::unix_now();
        Value::Array(
            self.active
                .values()
                .map(|a| {
                    super::with_gpus(
                        json!({
                            "pid": a.meta.pid(),
                            "type": a.meta.kind,
                            "request_id": a.meta.request_id,
                            "workload_uuid": a.meta.workload_uuid,
                            "running_for_seconds": (now - a.meta.created_unix).max(0.0) as u64,
                            "state": a.state(),
                        }),
                        &a.meta,
                    )
                })
                .collect(),
        )
    }

    pub(super) fn log_running_workloads(&self) {
        for a in self.active.values() {
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
}

/// " (N more like it held back)" for a throttled log line.
pub(super) fn held_note(held: u64) -> String {
    if held == 0 {
        String::new()
    } else {
        format!(" ({held} more like it in the last minute not logged)")
    }
}

/// The error of a completion for a workload whose record did not validate at recovery.
const SALVAGED: &str =
    "workload record was corrupt (moved to the quarantine folder); its outcome cannot be trusted";

/// The workload's shim or the workload itself is still the process it was (D9).
fn alive(st: &workload::shim::Started) -> bool {
    procinfo::same_process_alive(st.shim_pid, st.shim_start_ticks)
        || procinfo::same_process_alive(st.pid, st.start_ticks)
}

pub(super) fn start_output(meta: &Meta) -> Value {
    json!({"message": format!("{} started", meta.kind), "pid": meta.pid(), "workload_request_id": meta.request_id})
}
