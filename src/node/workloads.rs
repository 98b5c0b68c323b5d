//! The node's side of workloads: starting (exactly once per request id, within capacity),
//! cancelling (process group, escalation), completion (exactly once, through the outbox),
//! the max-runtime limit, and re-adopting workloads after a restart.

use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::logs::{Cursor, Stream, DRAIN_LIMIT};
use super::uploads::Upload;
use super::{Node, Op};
use crate::outbox::Item;
use crate::protocol::messages::request_id_text;
use crate::store;
use crate::workload::shim::Exit;
use crate::workload::{self, procinfo, Cancel, Meta, StartRequest, KINDS};

/// Default grace between the cancel signal and SIGKILL of the whole group (D10).
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);
/// How often adopted workloads (not the node's children) are checked.
const ADOPTED_CHECK: Duration = Duration::from_millis(250);

/// A workload the node tracks.
pub struct Active {
    pub meta: Meta,
    /// The shim is the node's child: the reaper reports its exit.
    pub child: bool,
    pub escalate_at: Option<Instant>,
    pub runtime_deadline: Option<Instant>,
    /// The shim reported the end, but a cancel's process group is still being cleared.
    pub exited: Option<Option<Exit>>,
    pub next_check: Instant,
    /// stdout, stderr.
    pub streams: [Stream; 2],
    /// The workload ended; its logs are being drained before the completion goes out.
    pub ending: Option<Ending>,
    /// Result files are being uploaded (the workload still counts as busy).
    pub upload: Option<Upload>,
}

pub struct Ending {
    pub exit: Option<Exit>,
    pub lost: Option<&'static str>,
    pub drain_deadline: Instant,
}

impl Active {
    fn new(meta: Meta, child: bool, now: Instant) -> Active {
        let elapsed = (workload::unix_now() - meta.created_unix).max(0.0);
        let runtime_deadline = meta
            .max_runtime_s
            .map(|m| now + Duration::from_secs_f64((m - elapsed).max(0.0)));
        Active {
            meta,
            child,
            escalate_at: None,
            runtime_deadline,
            exited: None,
            next_check: now,
            streams: [Stream::default(), Stream::default()],
            ending: None,
            upload: None,
        }
    }

    pub fn state(&self) -> &'static str {
        if self.upload.is_some() {
            "finalizing"
        } else if self.ending.is_some() {
            "finishing"
        } else if self.meta.cancel.is_some() {
            "cancelling"
        } else {
            "running"
        }
    }
}

fn signal_number(name: &str) -> Option<i32> {
    match name {
        "SIGTERM" => Some(libc::SIGTERM),
        "SIGINT" => Some(libc::SIGINT),
        "SIGKILL" => Some(libc::SIGKILL),
        _ => None,
    }
}

impl Node {
    // ---- start ------------------------------------------------------------------------------

    pub(super) fn start_workload(
        &mut self,
        kind: &str,
        request_id: &Value,
        params: Map<String, Value>,
    ) {
        self.start_workload_inner(kind, request_id, params, true);
    }

    /// A start after the self-heal pass it waited for: no second wait.
    pub(super) fn start_workload_now(
        &mut self,
        kind: &str,
        request_id: &Value,
        params: Map<String, Value>,
    ) {
        self.start_workload_inner(kind, request_id, params, false);
    }

    fn start_workload_inner(
        &mut self,
        kind: &str,
        request_id: &Value,
        params: Map<String, Value>,
        may_wait: bool,
    ) {
        let rid = request_id_text(request_id);
        let rid = if rid.is_empty() {
            format!(
                "auto-{}-{}",
                workload::unix_now() as u64,
                crate::util::hex(&crate::util::random_bytes::<4>())
            )
        } else {
            rid
        };
        let safe_id = store::safe_id(&rid);
        // Exactly once: a request id seen before gets its original answer and nothing else.
        if let Some(e) = self.ledger.get(&rid).cloned() {
            log::info!("request {rid} was handled before; repeating its answer");
            return if e.ok {
                self.reply_ok(request_id, e.body)
            } else {
                self.reply_error(request_id, e.body.as_str().unwrap_or(""))
            };
        }
        if let Some(a) = self.active.get(&safe_id) {
            let out = start_output(&a.meta);
            return self.reply_ok(request_id, out);
        }
        let workload_uuid = params
            .get("workload_uuid")
            .and_then(Value::as_str)
            .map(String::from);
        let ctx = super::ingress::context_of(kind, &params);
        let Some(template) = self.s.command_template(kind).map(String::from) else {
            let mut cap = kind.to_string();
            cap[..1].make_ascii_uppercase();
            let why = format!("{cap} command not configured in cyberwave.yml");
            return self.reject_start(request_id, workload_uuid.as_deref(), &why, None, ctx);
        };
        if let Some((why, reason)) = self.start_guard() {
            return self.reject_start(
                request_id,
                workload_uuid.as_deref(),
                &why,
                Some(reason),
                ctx,
            );
        }
        let capacity = self.s.max_concurrent_workloads.value as usize;
        if self.active.len() >= capacity
            && may_wait
            && self.defer_start_for_heal(kind, request_id, &params)
        {
            return;
        }
        if self.active.len() >= capacity {
            let what = if kind == "inference" {
                "controller"
            } else {
                "workload"
            };
            let uploading = self.uploading();
            let detail = if uploading > 0 {
                format!(" ({uploading} uploading results)")
            } else {
                String::new()
            };
            let why = format!(
                "Controller host is busy with {} active workload(s){detail}. Stop the existing {what} before starting a new one.",
                self.active.len()
            );
            return self.reject_start(
                request_id,
                workload_uuid.as_deref(),
                &why,
                Some("host_busy"),
                ctx,
            );
        }
        let manifest_limit = self.s.manifest.as_ref().and_then(|m| m.max_runtime_seconds);
        let param_limit = params
            .get("max_runtime_seconds")
            .and_then(Value::as_f64)
            .filter(|v| v.is_finite() && *v > 0.0);
        let max_runtime_s = match (manifest_limit, param_limit) {
            (Some(m), Some(p)) => Some(m.min(p)),
            (m, p) => m.or(p),
        };
        let req = StartRequest {
            kind,
            request_id,
            safe_id: &safe_id,
            params,
            template: &template,
            node_token: &self.token,
            max_runtime_s,
            workflow: ctx.clone(),
            socket: self.layout.state.join("control.sock"),
        };
        let t0 = Instant::now();
        match workload::start(&self.s, &self.layout, &self.exe, req) {
            Ok(meta) => {
                self.reaper.spawned();
                log::info!(
                    "{kind} {rid} started: pid {} in {:.1} ms; logs {} and {}",
                    meta.pid(),
                    t0.elapsed().as_secs_f64() * 1e3,
                    meta.stdout_log.display(),
                    meta.stderr_log.display()
                );
                let out = start_output(&meta);
                self.ledger.record(&rid, true, out.clone());
                self.reply_ok(request_id, out);
                if let Some(wl) = &meta.workload_uuid {
                    let body = json!({"status": "running", "message": format!("{kind} started in background"), "pid": meta.pid()});
                    self.workload_status(wl, body);
                }
                self.report_started(&meta);
                self.metrics.starts += 1;
                if self.s.drain_after_one {
                    self.one_started = true;
                    self.set_draining(true, "--drain-after-one");
                }
                let now = self.clock.now();
                self.active.insert(safe_id, Active::new(meta, true, now));
            }
            Err(e) => {
                let why = format!("Failed to start {kind}: {e}");
                log::error!("{why}");
                self.reject_start(request_id, workload_uuid.as_deref(), &why, None, ctx);
            }
        }
    }

    /// An error reply and, when the backend named the workload, R7 `failed` (protocol §4.3.3).
    fn reject_start(
        &mut self,
        request_id: &Value,
        workload_uuid: Option<&str>,
        why: &str,
        reason: Option<&str>,
        ctx: Option<workload::WorkflowCtx>,
    ) {
        self.report_rejected(ctx, why);
        self.count_rejection(reason.unwrap_or(if why.contains("not configured") {
            "not_configured"
        } else {
            "failed_to_start"
        }));
        log::warn!("refused start {}: {why}", request_id_text(request_id));
        self.reply_error(request_id, why);
        if let Some(wl) = workload_uuid {
            let mut body = json!({"status": "failed", "error": why, "failure_detail": why});
            if let Some(r) = reason {
                body["rejection_reason"] = json!(r);
                body["rejecting_instance_uuid"] = json!(self.uuid());
            }
            self.workload_status(wl, body);
        }
    }

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

    pub(super) fn cancel_command(&mut self, request_id: &Value, params: &Value) {
        let rid = request_id_text(request_id);
        if !rid.is_empty() {
            if let Some(e) = self.ledger.get(&rid).cloned() {
                log::info!("cancel {rid} was handled before; repeating its answer");
                return if e.ok {
                    self.reply_ok(request_id, e.body)
                } else {
                    self.reply_error(request_id, e.body.as_str().unwrap_or(""))
                };
            }
        }
        let sig_name = match params.get("signal") {
            None | Some(Value::Null) => "SIGTERM".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
        };
        let Some(sig) = signal_number(&sig_name) else {
            return self.reply_error(
                request_id,
                &format!("Invalid signal: {sig_name}. Must be SIGTERM, SIGKILL, or SIGINT"),
            );
        };
        let grace = match params.get("grace_seconds") {
            None | Some(Value::Null) => DEFAULT_GRACE,
            Some(v) => match v
                .as_f64()
                .filter(|g| g.is_finite() && *g >= 0.0 && *g <= 86_400.0)
            {
                Some(g) => Duration::from_secs_f64(g),
                None => {
                    return self.reply_error(
                        request_id,
                        "grace_seconds must be a number of seconds from 0 to 86400",
                    )
                }
            },
        };
        let pid = match params.get("pid") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_i64() {
                Some(0) => None,
                Some(p) => Some(p),
                None => return self.reply_error(request_id, "pid must be a whole number"),
            },
        };
        let wanted_rid = params
            .get("workload_request_id")
            .filter(|v| !v.is_null())
            .map(request_id_text);
        let found = self
            .active
            .iter()
            .find(|(_, a)| match (pid, &wanted_rid) {
                (Some(p), _) => i64::from(a.meta.pid()) == p && a.meta.pid() > 0,
                (None, Some(r)) => &a.meta.request_id_text() == r,
                (None, None) => false,
            })
            .map(|(k, _)| k.clone());
        let Some(safe_id) = found else {
            let mut msg = "No active workload found".to_string();
            if let Some(p) = pid {
                msg.push_str(&format!(" with PID {p}"));
            }
            if let Some(r) = &wanted_rid {
                msg.push_str(&format!(" with request_id {r}"));
            }
            if pid.is_none() && wanted_rid.is_none() {
                msg = "cancel needs params.pid or params.workload_request_id".to_string();
            }
            return self.reply_error(request_id, &msg);
        };
        match self.cancel_workload(&safe_id, sig, &sig_name, grace, false) {
            Ok(message) => {
                let a = &self.active[&safe_id];
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
    fn cancel_workload(
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
        let message = match procinfo::signal_group(pid, sig) {
            Ok(()) => format!("Workload cancelled with {sig_name}"),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                format!("Process {pid} was already terminated")
            }
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                return Err(format!("Permission denied to send signal to process {pid}"))
            }
            Err(e) => return Err(format!("Failed to cancel workload: {e}")),
        };
        log::info!(
            "cancelling {} {} (pid {pid}) with {sig_name}; SIGKILL to its group after {:.1}s",
            a.meta.kind,
            a.meta.request_id_text(),
            grace.as_secs_f64()
        );
        if a.meta.cancel.is_none() {
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
        }
        a.escalate_at = Some(now + grace);
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
                log::warn!("workload {safe_id}: cannot record the stale mark: {e}");
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
        log::debug!("workload {safe_id} ended: {exit:?}");
        let Some(a) = self.active.get_mut(safe_id) else {
            return;
        };
        let pid = a.meta.pid();
        if a.meta.cancel.is_some() && procinfo::group_alive(pid) {
            // The shell ended but something of a cancelled workload lingers: clear the group first.
            a.exited = Some(exit);
            return;
        }
        let lost = exit
            .is_none()
            .then_some("workload lost: its supervisor ended without recording an exit status");
        self.begin_ending(safe_id, exit, lost);
    }

    /// The workload ended: ship what is left of its logs, then report it.
    fn begin_ending(&mut self, safe_id: &str, exit: Option<Exit>, lost: Option<&'static str>) {
        let now = self.clock.now();
        let Some(a) = self.active.get_mut(safe_id) else {
            return;
        };
        if a.ending.is_some() {
            return;
        }
        a.exited = None;
        // A record rebuilt at recovery: whatever the exit, its outcome cannot be trusted.
        let lost = if a.meta.salvaged.is_some() {
            Some(SALVAGED)
        } else {
            lost
        };
        a.ending = Some(Ending {
            exit,
            lost,
            drain_deadline: now + DRAIN_LIMIT,
        });
        self.pump_streams(false);
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
                "stale {} {rid} (pid {pid}) is gone; forgotten without a completion",
                meta.kind
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
                log::info!("{} {rid} (pid {pid}) cancelled by {}", meta.kind, c.signal);
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
                    body["exit_code"] = json!(c);
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
                    body["error"] = json!(error);
                    if let Some(s) = stderr {
                        body["stderr"] = json!(s);
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
                    "{} {rid} (pid {pid}) finished: {}{}",
                    meta.kind,
                    if success { "success" } else { "failure" },
                    code.map(|c| format!(", exit code {c}")).unwrap_or_default()
                );
                (body, format!("completion of {} {rid}", meta.kind))
            }
        };
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
                    Err(e) => log::error!("cannot queue the completion of {rid}: {e}"),
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
                log::warn!("cannot retire {}: {e}", dir.display());
                return;
            }
        };
        if let Err(e) = std::fs::remove_dir_all(&target) {
            log::warn!("cannot remove {}: {e}", target.display());
        }
    }

    // ---- the outbox -------------------------------------------------------------------------

    pub(super) fn flush_outbox(&mut self) {
        if self.conn != super::Conn::Connected {
            return;
        }
        let now = self.clock.now();
        for (seq, item) in self.outbox.due(now) {
            let corr = self.request(
                Op::Outbox(seq),
                &item.topic,
                item.body.clone(),
                self.s.tuning.request_timeout,
            );
            self.outbox.sent(seq, corr);
        }
    }

    pub(super) fn on_outbox_reply(&mut self, seq: u64, body: Option<Value>) {
        match body {
            Some(b) if super::success(&b) => {
                if let Some(item) = self.outbox.acknowledged(seq) {
                    log::info!("backend acknowledged the {}", item.label);
                }
            }
            Some(b) if super::code(&b).is_some_and(|c| c < 500) => {
                if let Some(item) = self.outbox.acknowledged(seq) {
                    log::error!(
                        "backend refused the {} ({}); not retried",
                        item.label,
                        super::message(&b)
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
            let pid = a.meta.pid();
            // Max runtime.
            if a.runtime_deadline.is_some_and(|d| now >= d) && a.meta.cancel.is_none() {
                log::warn!(
                    "{} {} exceeded its max runtime; cancelling",
                    a.meta.kind,
                    a.meta.request_id_text()
                );
                let _ = self.cancel_workload(&id, libc::SIGTERM, "SIGTERM", DEFAULT_GRACE, true);
                continue;
            }
            // Escalation: anything left in the group after the grace period gets SIGKILL.
            if a.escalate_at.is_some_and(|t| now >= t) {
                if procinfo::group_alive(pid) {
                    log::warn!("workload pid {pid} outlived its grace period; SIGKILL to its process group");
                    let _ = procinfo::signal_group(pid, libc::SIGKILL);
                }
                if let Some(a) = self.active.get_mut(&id) {
                    a.escalate_at = None;
                }
            }
            let Some(a) = self.active.get(&id) else {
                continue;
            };
            if a.ending.is_some() {
                if self.drained(&id, now) {
                    if let Some(e) = self.active.get_mut(&id).and_then(|a| a.ending.take()) {
                        if e.lost.is_some() || !self.begin_uploads(&id, e.exit.clone()) {
                            self.complete(&id, e.exit, e.lost);
                        }
                    }
                }
                continue;
            }
            if a.upload.is_some() {
                self.step_upload(&id);
                continue;
            }
            if let Some(exit) = a.exited.clone() {
                if !procinfo::group_alive(pid) {
                    let lost = exit.is_none().then_some(
                        "workload lost: its supervisor ended without recording an exit status",
                    );
                    self.begin_ending(&id, exit, lost);
                }
                continue;
            }
            // Adopted workloads: their exit record tells the end.
            if !a.child && now >= a.next_check {
                if let Some(a) = self.active.get_mut(&id) {
                    a.next_check = now + ADOPTED_CHECK;
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
        if !shim_alive && !procinfo::group_alive(st.pid) {
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
                    json!({
                        "pid": a.meta.pid(),
                        "type": a.meta.kind,
                        "request_id": a.meta.request_id,
                        "workload_uuid": a.meta.workload_uuid,
                        "running_for_seconds": (now - a.meta.created_unix).max(0.0) as u64,
                        "state": a.state(),
                    })
                })
                .collect(),
        )
    }

    pub(super) fn log_running_workloads(&self) {
        for a in self.active.values() {
            log::info!(
                "left running: {} {} pid {} (logs {} and {})",
                a.meta.kind,
                a.meta.request_id_text(),
                a.meta.pid(),
                a.meta.stdout_log.display(),
                a.meta.stderr_log.display()
            );
        }
    }

    /// `workload_received`: a start wrapped with its workload uuid (protocol §4.5).
    pub(super) fn workload_received(&mut self, request_id: &Value, params: &Value) {
        let uuid = params
            .get("workload_uuid")
            .and_then(Value::as_str)
            .map(String::from);
        let kind = params
            .get("command_type")
            .and_then(Value::as_str)
            .unwrap_or("");
        if KINDS.contains(&kind) {
            let mut inner = match params.get("command_params") {
                Some(Value::Object(m)) => m.clone(),
                None | Some(Value::Null) => Map::new(),
                Some(_) => {
                    let why = "command_params must be a JSON object";
                    return self.reject_start(request_id, uuid.as_deref(), why, None, None);
                }
            };
            if let Some(u) = &uuid {
                inner.insert("workload_uuid".into(), json!(u));
            }
            let kind = kind.to_string();
            return self.on_start(&kind, request_id, &Value::Object(inner));
        }
        let shown = uuid.unwrap_or_else(|| "None".into());
        self.reply_ok(
            request_id,
            json!({"message": format!("Workload {shown} received and acknowledged")}),
        );
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

fn start_output(meta: &Meta) -> Value {
    json!({"message": format!("{} started", meta.kind), "pid": meta.pid(), "workload_request_id": meta.request_id})
}
