//! Commands from the backend (`status`, `start`, `cancel`, `received`) and their replies, and
//! requests on the local control socket (`emit`, `drain`, `resume`, `status`).

use serde_json::{json, Value};

use super::{gpus, Node};
use crate::protocol::commands::{Command, Kind, Received, StartParams};
use crate::protocol::messages::{self, Incoming};
use crate::util;

impl Node {
    // ---- commands -------------------------------------------------------------------------------

    pub(super) fn on_command(&mut self, payload: &[u8]) {
        let (request_id, command) = match messages::parse_command(payload) {
            Incoming::Echo => return,
            Incoming::Invalid {
                request_id: Some(rid),
                reason,
                workload_uuid,
            } => {
                log::warn!(
                    "refused a command (request {}): {}",
                    crate::logtext::shown(&messages::request_id_text(&rid)),
                    crate::logtext::shown(&reason)
                );
                if let Some(wl) = workload_uuid {
                    let body =
                        json!({"status": "failed", "error": reason, "failure_detail": reason});
                    self.workload_status(wl.as_str(), body);
                }
                return self.reply_error(&rid, &reason);
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
                return;
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
        let rid = request_id.value();
        // A start is refused by its own guard, as a retryable "host busy" (D21).
        let start = matches!(
            command,
            Command::Start(..) | Command::Received(Received::Start(..))
        );
        if self.life.shutdown.is_some() && !start {
            return self.reply_error(rid, "node is shutting down and not accepting new commands");
        }
        match command {
            Command::Status => {
                let out = self.status_output();
                self.reply_ok(rid, out);
            }
            Command::Start(kind, params) => self.on_start(kind, rid, params),
            Command::Cancel(params) => self.cancel(&request_id, params),
            Command::Received(Received::Start(kind, params)) => self.on_start(kind, rid, params),
            Command::Received(Received::Ack(uuid)) => {
                let shown = uuid.as_ref().map_or("None", |u| u.as_str());
                self.reply_ok(
                    rid,
                    json!({"message": format!("Workload {shown} received and acknowledged")}),
                );
            }
        }
    }

    pub(super) fn on_start(&mut self, kind: Kind, request_id: &Value, params: StartParams) {
        if let (Some(mine), Some(theirs)) = (&self.s.environment_uuid, &params.environment_uuid) {
            if mine.value != theirs.as_str() {
                return self.reply_error(
                    request_id,
                    &format!("this node is reserved for environment {}; refusing a workload for environment {theirs}", mine.value),
                );
            }
        }
        self.start_workload(kind, request_id, params);
    }

    pub(super) fn status_output(&self) -> Value {
        let mut out = json!({
            "slug": self.slug(),
            "instance_uuid": self.uuid(),
            "profile_slug": self.s.profile_slug.value,
            "has_inference": self.s.inference.is_some(),
            "has_simulate": self.s.simulate.is_some(),
            "has_training": self.s.training.is_some(),
                        "is_busy": self.active.len() >= self.s.max_concurrent_workloads.value as usize,
            "active_workloads": self.active_workloads_json(),
                        "max_concurrent_workloads": self.s.max_concurrent_workloads.value,
            "accepting": self.life.shutdown.is_none() && !self.life.drain.on,
            "draining": self.life.drain.on,
            "environment_uuid": self.s.environment_uuid.as_ref().map(|e| e.value.clone()),
            "node_version": crate::cli::VERSION,
        });
        if let Some(g) = self.gpu.status(&self.gpu_holds()) {
            gpus::put(&mut out, "gpus", g);
        }
        self.add_starting(&mut out, "active_workloads");
        out
    }

    pub(super) fn reply_ok(&self, request_id: &Value, output: Value) {
        self.publish_reply(true, request_id, output);
    }

    pub(super) fn reply_error(&self, request_id: &Value, error: &str) {
        self.publish_reply(false, request_id, json!(error));
    }

    pub(super) fn publish_reply(&self, ok: bool, request_id: &Value, body: Value) {
        let payload = messages::reply(ok, request_id, self.slug(), self.uuid(), body);
        let topic = self.io.topics.reply(self.uuid());
        // D12: QoS 1 so a reply survives a short outage (Paho buffers it).
        self.io
            .mqtt
            .publish(&topic, payload, 1, paho_mqtt::Properties::new());
    }

    // ---- the control socket ---------------------------------------------------------------------

    pub(super) fn on_control(&mut self, req: crate::control::Request) {
        let Some(req) = self.hold_for_start(req) else {
            return;
        };
        let op = req.body.get("op").and_then(Value::as_str).unwrap_or("");
        let reply = match op {
            "emit" => self.on_emit(&req.body),
            "drain" | "resume" => {
                self.set_draining(op == "drain", "asked on the control socket");
                json!({"ok": true, "draining": self.life.drain.on, "active_workloads": self.in_use()})
            }
            "status" => json!({"ok": true, "status": self.local_status()}),
            other => json!({"ok": false, "error": format!("unknown op {other:?}")}),
        };
        let _ = req.reply.send(reply);
    }

    /// What `cyberwave-cloud-node status` shows about a running node.
    pub(super) fn local_status(&self) -> Value {
        let mut out = json!({
            "running": true,
            "pid": std::process::id(),
            "instance_uuid": self.uuid(),
            "slug": self.slug(),
            "environment_uuid": self.s.environment_uuid.as_ref().map(|e| e.value.clone()),
            "broker": self.io.mqtt.endpoint(),
            "connected": self.session.connected(),
            "registered": self.session.registered(),
            "last_heartbeat_ok": self.session.last_heartbeat_ok().map(util::rfc3339),
                        "accepting": self.life.shutdown.is_none() && !self.life.drain.on,
            "draining": self.life.drain.on,
            "max_concurrent_workloads": self.s.max_concurrent_workloads.value,
            "workloads": self.active.values().map(|a| crate::node::with_gpus(json!({
                "pid": a.meta.pid(),
                "type": a.meta.kind,
                "request_id": a.meta.request_id,
                "workload_uuid": a.meta.workload_uuid,
                "state": a.state(),
                "running_for_seconds": (crate::workload::unix_now() - a.meta.created_unix).max(0.0) as u64,
                "stdout_log": a.meta.stdout_log,
                "stderr_log": a.meta.stderr_log,
            }), &a.meta)).collect::<Vec<_>>(),
            "outbox": self.durable.outbox.len(),
            "ingress_queue": self.ingress.queue.len(),
        });
        if let Some(g) = self.gpu.status(&self.gpu_holds()) {
            gpus::put(&mut out, "gpus", g);
        }
        self.add_starting(&mut out, "workloads");
        out
    }
}
