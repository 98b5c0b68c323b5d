//! Commands from the backend (`status`, `start`, `cancel`, `received`) and their replies, and
//! requests on the local control socket (`emit`, `drain`, `resume`, `status`): a command read
//! and checked ([`accept`]), then answered (the status answers: methods of [`Work`])
//! or handed to the start path ([`Start`]) or to [`cancel`].

use serde_json::{json, Value};

use super::cancel;
use super::start_path::Start;
use super::workloads::Work;
use crate::config::Settings;
use crate::protocol::commands::{
    self as protocol, Command, Incoming, Received, RequestId, StartParams, TopicId,
};
use crate::util;

/// A command as the dispatch gets it.
pub(super) enum Accepted {
    /// An echo, or unreadable without a request id: nothing to answer.
    Nothing,
    /// Refused: the error reply, and R7 `failed` when the backend named the workload.
    Refused {
        rid: Value,
        reason: String,
        failed: Option<(TopicId, Value)>,
    },
    Run(RequestId, Command),
}

/// Reads and checks a command (at most `max` bytes, D64): a start is refused by its own guard,
/// as a retryable "host busy" (D21); anything else is refused while the node shuts down.
pub(super) fn accept(payload: &[u8], max: usize, shutting_down: bool) -> Accepted {
    let (request_id, command) = match protocol::parse_command_within(payload, max) {
        Incoming::Echo => return Accepted::Nothing,
        Incoming::Invalid {
            request_id: Some(rid),
            reason,
            workload_uuid,
        } => {
            log::warn!(
                "refused a command (request {}): {}",
                crate::logtext::shown(&protocol::request_id_text(&rid)),
                crate::logtext::shown(&reason)
            );
            let failed = workload_uuid.map(|wl| {
                let body = json!({"status": "failed", "error": reason, "failure_detail": reason});
                (wl, body)
            });
            return Accepted::Refused {
                rid,
                reason,
                failed,
            };
        }
        Incoming::Invalid {
            request_id: None,
            reason,
            ..
        } => {
            log::warn!(
                "ignored a command without a readable request id: {}",
                crate::logtext::shown(&reason)
            );
            return Accepted::Nothing;
        }
        Incoming::Command {
            request_id,
            command,
        } => (request_id, command),
    };
    log::info!(
        "command {} (request {})",
        command.name(),
        crate::logtext::shown(&request_id.text())
    );
    let start = matches!(
        command,
        Command::Start(..) | Command::Received(Received::Start(..))
    );
    if shutting_down && !start {
        return Accepted::Refused {
            rid: request_id.value().clone(),
            reason: "node is shutting down and not accepting new commands".into(),
            failed: None,
        };
    }
    Accepted::Run(request_id, command)
}

/// A start for another environment than the one this node is reserved for: the refusal.
pub(super) fn wrong_environment(s: &Settings, params: &StartParams) -> Option<String> {
    let (Some(mine), Some(theirs)) = (&s.environment_uuid, &params.environment_uuid) else {
        return None;
    };
    (mine.value != theirs.as_str()).then(|| format!("this node is reserved for environment {}; refusing a workload for environment {theirs}", mine.value))
}

/// The status answers, from what a workload's events touch.
impl Work<'_> {
    /// The `status` command's output.
    pub(super) fn status_answer(&self) -> Value {
        let mut out = json!({
            "slug": self.session.slug(),
            "instance_uuid": self.session.uuid(),
            "profile_slug": self.s.profile_slug.value,
            "has_inference": self.s.inference.is_some(),
            "has_simulate": self.s.simulate.is_some(),
            "has_training": self.s.training.is_some(),
                        "is_busy": self.active.len() >= self.s.max_concurrent_workloads.value as usize,
            "active_workloads": self.active_json(),
                        "max_concurrent_workloads": self.s.max_concurrent_workloads.value,
            "accepting": self.life.shutdown.is_none() && !self.life.drain.on,
            "draining": self.life.drain.on,
            "environment_uuid": self.s.environment_uuid.as_ref().map(|e| e.value.clone()),
            "node_version": crate::cli::VERSION,
            "services": self.services.status(),
        });
        self.gpu.add_status(
            &super::workloads::holds_of(self.active, self.starts),
            &mut out,
        );
        self.add_starting(&mut out, "active_workloads");
        out
    }

    fn active_json(&self) -> Value {
        let now = crate::workload::unix_now();
        Value::Array(
            self.active
                .values()
                .map(|a| {
                    super::gpus::with_gpus(
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

    /// The starts in flight in a `status` reply: each in `active_workloads` with state
    /// `starting`, and counted in `is_busy`.
    fn add_starting(&self, out: &mut Value, key: &str) {
        let now = crate::workload::unix_now();
        if let Some(list) = out.get_mut(key).and_then(Value::as_array_mut) {
            for st in self.starts.iter().map(|(_, s)| s) {
                let mut w = json!({
                    "pid": 0,
                    "type": st.kind.as_str(),
                    "request_id": st.request_id,
                    "workload_uuid": st.workload_uuid,
                    "running_for_seconds": (now - st.created_unix).max(0.0) as u64,
                    "state": "starting",
                });
                if let Some(g) = &st.gpus {
                    super::gpus::put(&mut w, "gpus", json!(g));
                }
                list.push(w);
            }
        }
        if let Some(busy) = out.get_mut("is_busy") {
            let used = self.active.len().saturating_add(self.starts.len());
            *busy = json!(used >= self.s.max_concurrent_workloads.value as usize);
        }
    }

    /// What `cyberwave-cloud-node status` shows about a running node.
    pub(super) fn local_status(&self) -> Value {
        let mut out = json!({
            "running": true,
            "pid": std::process::id(),
            "instance_uuid": self.session.uuid(),
            "slug": self.session.slug(),
            "environment_uuid": self.s.environment_uuid.as_ref().map(|e| e.value.clone()),
            "broker": self.io.mqtt.endpoint(),
            "connected": self.session.connected(),
            "registered": self.session.registered(),
            "last_heartbeat_ok": self.session.last_heartbeat_ok().map(util::rfc3339),
                        "accepting": self.life.shutdown.is_none() && !self.life.drain.on,
            "draining": self.life.drain.on,
            "max_concurrent_workloads": self.s.max_concurrent_workloads.value,
            "workloads": self.active.values().map(|a| super::gpus::with_gpus(json!({
                "pid": a.meta.pid(),
                "type": a.meta.kind,
                "request_id": a.meta.request_id,
                "workload_uuid": a.meta.workload_uuid,
                "state": a.state(),
                "running_for_seconds": (crate::workload::unix_now() - a.meta.created_unix).max(0.0) as u64,
                "stdout_log": a.meta.stdout_log,
                "stderr_log": a.meta.stderr_log,
            }), &a.meta)).collect::<Vec<_>>(),
            "services": self.services.status(),
            "outbox": self.outbox.len(),
            "ingress_queue": self.ingress.queue.len(),
            "ingress_queue_bytes": self.ingress.queue.bytes(),
        });
        self.gpu.add_status(
            &super::workloads::holds_of(self.active, self.starts),
            &mut out,
        );
        self.add_users(&mut out);
        self.add_starting(&mut out, "workloads");
        out
    }

    /// D65: who the workloads run as, and a warning when several share one uid.
    fn add_users(&self, out: &mut Value) {
        let users = &self.io.users;
        if users.is_empty() {
            return;
        }
        let names: Vec<&str> = users.iter().map(|u| u.name.as_str()).collect();
        util::set(out, "workload_users", json!(names));
        let slots = self.s.max_concurrent_workloads.value;
        if let [u] = users.as_slice() {
            if slots > 1 {
                let note = crate::workload::user::shared_uid_note(&u.name, u.uid, slots);
                util::set(out, "workload_user_shared", json!(note));
            }
        }
    }
}

/// A command from the backend: read and checked, then answered or carried out.
pub(super) fn on_command(st: &mut Start<'_>, payload: &[u8]) {
    let max = st.work.s.tuning.max_command_bytes;
    let (request_id, command) = match accept(payload, max, st.work.life.shutdown.is_some()) {
        Accepted::Nothing => return,
        Accepted::Refused {
            rid,
            reason,
            failed,
        } => {
            if let Some((wl, body)) = failed {
                st.work.workload_status(&wl, body);
            }
            return st.work.replies().error(&rid, &reason);
        }
        Accepted::Run(request_id, command) => (request_id, command),
    };
    let rid = request_id.value();
    match command {
        Command::Status => {
            let status = st.work.status_answer();
            st.work.replies().ok(rid, status);
        }
        Command::Start(kind, params) | Command::Received(Received::Start(kind, params)) => {
            match wrong_environment(st.work.s, &params) {
                Some(why) => st.work.replies().error(rid, &why),
                None => st.start_workload(kind, rid, params),
            }
        }
        Command::Cancel(params) => cancel::cancel(st.ledger, &mut st.work, &request_id, params),
        Command::Received(Received::Ack(uuid)) => {
            let shown = uuid.as_ref().map_or("None", |u| u.as_str());
            st.work.replies().ok(
                rid,
                json!({"message": format!("Workload {shown} received and acknowledged")}),
            );
        }
    }
}

/// A request on the local control socket (`emit`, `drain`, `resume`, `status`).
pub(super) fn on_control(w: &mut Work<'_>, req: crate::control::Request) {
    let Some(req) = w.starts.hold_for_start(req) else {
        return;
    };
    let op = req.body.get("op").and_then(Value::as_str).unwrap_or("");
    let reply = match op {
        "emit" => w.on_emit(&req.body),
        "drain" | "resume" => {
            let in_use = w.in_use();
            w.life
                .drain
                .set(op == "drain", "asked on the control socket", in_use);
            json!({"ok": true, "draining": w.life.drain.on, "active_workloads": in_use})
        }
        "status" => json!({"ok": true, "status": w.local_status()}),
        other => json!({"ok": false, "error": format!("unknown op {other:?}")}),
    };
    let _ = req.reply.send(reply);
}
