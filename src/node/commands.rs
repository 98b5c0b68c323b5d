//! Commands from the backend (`status`, `start`, `cancel`, `received`) and their replies, and
//! requests on the local control socket (`emit`, `drain`, `resume`, `status`). The dispatch is
//! in `mod.rs` (`Node::on_command`, `Node::on_control`); here are what it is built of: a
//! command read and checked ([`accept`]), the replies ([`Replies`], on the MQTT client and the
//! session's naming) and the status answers ([`View`], the parts they read).

use serde_json::{json, Value};

use super::gpus::{self, Gpus};
use super::io::Io;
use super::parts::Life;
use super::parts::Op;
use super::session::Session;
use super::starts::Starts;
use super::table::Table;
use crate::config::Settings;
use crate::outbox::Outbox;
use crate::protocol::commands::{Command, Received, RequestId, StartParams};
use crate::protocol::messages::{self, Incoming};
use crate::util;

/// A command as the dispatch gets it.
pub(super) enum Accepted {
    /// An echo, or unreadable without a request id: nothing to answer.
    Nothing,
    /// Refused: the error reply, and R7 `failed` when the backend named the workload.
    Refused {
        rid: Value,
        reason: String,
        failed: Option<(String, Value)>,
    },
    Run(RequestId, Command),
}

/// Reads and checks a command: a start is refused by its own guard, as a retryable "host busy"
/// (D21); anything else is refused while the node shuts down.
pub(super) fn accept(payload: &[u8], shutting_down: bool) -> Accepted {
    let (request_id, command) = match messages::parse_command(payload) {
        Incoming::Echo => return Accepted::Nothing,
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
            let failed = workload_uuid.map(|wl| {
                let body = json!({"status": "failed", "error": reason, "failure_detail": reason});
                (wl.as_str().to_string(), body)
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

/// Replies to the backend's commands, on the node's MQTT client and under its session's names.
pub(super) struct Replies<'a> {
    pub(super) io: &'a Io,
    pub(super) session: &'a Session<Op>,
}

impl Replies<'_> {
    pub(super) fn ok(&self, request_id: &Value, output: Value) {
        self.publish(true, request_id, output);
    }

    pub(super) fn error(&self, request_id: &Value, error: &str) {
        self.publish(false, request_id, json!(error));
    }

    /// The answer a request had before, again (the ledger's `ok` output or `error` text).
    pub(super) fn replay(&self, request_id: &Value, ok: bool, body: Value) {
        if ok {
            self.ok(request_id, body)
        } else {
            self.error(request_id, body.as_str().unwrap_or(""))
        }
    }

    fn publish(&self, ok: bool, request_id: &Value, body: Value) {
        let (slug, uuid) = (self.session.slug(), self.session.uuid());
        let payload = messages::reply(ok, request_id, slug, uuid, body);
        let topic = self.io.topics.reply(uuid);
        // D12: QoS 1 so a reply survives a short outage (Paho buffers it).
        self.io
            .mqtt
            .publish(&topic, payload, 1, paho_mqtt::Properties::new());
    }
}

/// What the status answers read of the node, borrowed for one answer.
pub(super) struct View<'a> {
    pub(super) s: &'a Settings,
    pub(super) session: &'a Session<Op>,
    pub(super) io: &'a Io,
    pub(super) life: &'a Life,
    pub(super) active: &'a Table,
    pub(super) starts: &'a Starts,
    pub(super) gpu: &'a Gpus,
    pub(super) outbox: &'a Outbox,
    /// The ingress queue.
    pub(super) events: &'a Outbox,
}

impl View<'_> {
    /// The `status` command's output.
    pub(super) fn status(&self) -> Value {
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
        });
        if let Some(g) = self
            .gpu
            .status(&super::gpus_out::holds_of(self.active, self.starts))
        {
            gpus::put(&mut out, "gpus", g);
        }
        self.add_starting(&mut out, "active_workloads");
        out
    }

    fn active_json(&self) -> Value {
        let now = crate::workload::unix_now();
        Value::Array(
            self.active
                .values()
                .map(|a| {
                    super::gpus_out::with_gpus(
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
    pub(super) fn local(&self) -> Value {
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
            "outbox": self.outbox.len(),
            "ingress_queue": self.events.len(),
        });
        if let Some(g) = self
            .gpu
            .status(&super::gpus_out::holds_of(self.active, self.starts))
        {
            gpus::put(&mut out, "gpus", g);
        }
        self.add_starting(&mut out, "workloads");
        out
    }
}
