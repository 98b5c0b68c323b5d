//! `cyberwave-cloud-node emit started|node|finished …`: a workload reports workflow execution
//! events through the node (decision D19). The event is validated here (exit 2, nothing queued,
//! on bad input), sent to the node's control socket with the workload's event token, and the
//! command returns once the event is durably queued. When the node is down the event is
//! written into the ingress queue directly, to be sent when the node returns.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Map, Value};

use crate::control::{self, CallError};
use crate::error::EmitError;
use crate::outbox::{self, Item};

pub const FLAGS: &[&str] = &[
    "--workflow",
    "--execution",
    "--node",
    "--status",
    "--trigger-json",
    "--input-json",
    "--output-json",
    "--error-message",
    "--execution-time-ms",
    "--metadata-json",
    "--started-at",
    "--finished-at",
    "--activation-index",
    "--caller-uuid",
    "--source-type",
];

/// The flags as the event's fields; `Err` is a usage error.
pub fn fields(
    kind: &str,
    flags: &BTreeMap<String, String>,
) -> Result<Map<String, Value>, EmitError> {
    let mut f = Map::new();
    f.insert("kind".into(), json!(kind));
    for (flag, value) in flags {
        let key = flag.trim_start_matches("--");
        let (name, v) = match key {
            "trigger-json" | "input-json" | "output-json" | "metadata-json" => {
                let parsed: Value = serde_json::from_str(value)
                    .map_err(|e| EmitError::Invalid(format!("{flag}: not valid JSON ({e})")))?;
                (key.trim_end_matches("-json").to_string(), parsed)
            }
            "execution-time-ms" | "activation-index" => {
                let n: u64 = value.trim().parse().map_err(|_| {
                    EmitError::Invalid(format!(
                        "{flag}: expected a whole number ≥ 0, got {value:?}"
                    ))
                })?;
                (key.replace('-', "_"), json!(n))
            }
            _ => (key.replace('-', "_"), json!(value)),
        };
        f.insert(name, v);
    }
    Ok(f)
}

pub fn run(kind: &str, flags: &BTreeMap<String, String>) -> Result<(), EmitError> {
    let (fields, event) = fields(kind, flags).and_then(|f| {
        crate::ingress::build(&f)
            .map(|ev| (f, ev))
            .map_err(|e| EmitError::Invalid(e.to_string()))
    })?;
    let Some(token) = std::env::var("CYBERWAVE_NODE_EVENT_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
    else {
        return Err(EmitError::Invalid("CYBERWAVE_NODE_EVENT_TOKEN is not set: emit runs inside a workload started by the node".into()));
    };
    let socket = std::env::var_os("CYBERWAVE_NODE_SOCKET")
        .map(PathBuf::from)
        .unwrap_or_else(|| state_dir().join("control.sock"));
    let print_ok = |execution: &str| {
        if kind == "started" {
            crate::outln!("{execution}");
        }
        Ok(())
    };
    match control::call(
        &socket,
        &json!({"op": "emit", "token": token, "fields": fields}),
        Duration::from_secs(30),
    ) {
        Ok(reply) if reply.get("ok") == Some(&json!(true)) => print_ok(
            reply
                .get("execution_uuid")
                .and_then(|v| v.as_str())
                .unwrap_or(&event.execution),
        ),
        Ok(reply) => {
            let why = reply
                .get("error")
                .and_then(|v| v.as_str())
                .unwrap_or("the node refused the event")
                .to_string();
            Err(if reply.get("refused") == Some(&json!(true)) {
                EmitError::Refused(why)
            } else if reply.get("busy") == Some(&json!(true))
                || reply.get("not_queued") == Some(&json!(true))
            {
                EmitError::Failed(why)
            } else {
                EmitError::Invalid(why)
            })
        }
        Err(CallError::NotRunning) => {
            // The node is down: check the token against the workload records and queue directly.
            let state = socket.parent().map(PathBuf::from).unwrap_or_else(state_dir);
            let owner = authorised(&state, &token, &event.workflow)?;
            let item = Item {
                topic: event.topic.clone(),
                body: event.body.clone(),
                label: format!(
                    "{kind} event of workflow {} (queued while the node was down)",
                    event.workflow
                ),
                key: None,
                owner: Some(owner),
            };
            // The node cannot share the queue out while it is down: all such events together
            // get one workload's share (D67).
            let size = crate::ingress_queue::EventQueue::size_of(&item);
            if let Err(full) = crate::ingress_queue::room_while_down(&state.join("ingress"), size) {
                return Err(EmitError::Failed(format!(
                    "{full}: this event ({size} bytes) is not queued; send it again once the queue drains"
                )));
            }
            match outbox::write_item(&state.join("ingress"), &item) {
                Ok(_) => print_ok(&event.execution),
                Err(e) => Err(EmitError::Failed(format!(
                    "cannot queue the event in {}: {e}",
                    state.join("ingress").display()
                ))),
            }
        }
        Err(CallError::Failed(e)) => {
            Err(EmitError::Failed(format!("the node did not answer: {e}")))
        }
    }
}

fn state_dir() -> PathBuf {
    // The node's own rule (D42), so `emit` finds the node wherever `start` put its state dir.
    crate::config::config_dir(&crate::config::env::EnvLayers::from_process())
        .map(|d| d.value)
        .unwrap_or_else(|_| PathBuf::from(".cyberwave"))
}

/// The workload whose own event token `token` is, when it may report `workflow` (its safe id);
/// `Err` is a refusal.
fn authorised(state: &std::path::Path, token: &str, workflow: &str) -> Result<String, EmitError> {
    let rd = std::fs::read_dir(state.join("workloads"))
        .map_err(|e| EmitError::Refused(format!("cannot check the event token: {e}")))?;
    for e in rd.flatten() {
        let Some(meta) = crate::workload::load_meta(&e.path()) else {
            continue;
        };
        if !meta.event_token.is_empty() && crate::util::same_secret(&meta.event_token, token) {
            return match &meta.workflow {
                Some(ctx) if ctx.workflow != workflow => Err(EmitError::Refused(format!(
                    "this workload may only report workflow {}",
                    ctx.workflow
                ))),
                _ => Ok(meta.safe_id),
            };
        }
    }
    Err(EmitError::Refused("invalid event token (only a running workload's own CYBERWAVE_NODE_EVENT_TOKEN is accepted)".into()))
}
