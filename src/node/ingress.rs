//! Execution ingress on the node: the durable ingress queue (`<state dir>/ingress/`), sent at
//! QoS 1 strictly in order one event at a time and removed on the broker's acknowledgement (so
//! node and finished events never overtake their `started`); events from workloads through the
//! control socket (`emit`), checked against the workload's event token and workflow; and the
//! node's own workloads reported as workflow node events (decision D18).

use std::time::Duration;

use crossbeam_channel::{unbounded, Receiver, Sender};
use serde_json::{json, Map, Value};

use super::Node;
use crate::ingress;
use crate::outbox::Item;
use crate::workload::{self, Meta, WorkflowCtx};

/// The PUBACK of an ingress event: `Ok`, or `Err(Some((why, permanent)))` when the broker
/// refused it, `Err(None)` when no acknowledgement came.
pub type Acked = (u64, Result<(), Option<(String, bool)>>);
/// An ingress event's sequence number and its delivery token, for the ack thread.
pub type Tracked = (u64, paho_mqtt::DeliveryToken);

/// Waits for delivery tokens, in order, off the event loop.
pub fn start_ack_thread() -> std::io::Result<(Sender<Tracked>, Receiver<Acked>)> {
    let (tx, rx) = unbounded::<Tracked>();
    let (atx, arx) = unbounded();
    std::thread::Builder::new()
        .name("acks".into())
        .spawn(move || {
            for (seq, token) in rx {
                let result = token.wait_for(Duration::from_secs(30)).map(|_| ());
                let acked = match crate::mqtt::refusal_of(&result) {
                    Some(refused) => Err(Some(refused)),
                    None => result.map_err(|_| None),
                };
                if atx.send((seq, acked)).is_err() {
                    return;
                }
            }
        })?;
    Ok((tx, arx))
}

/// The workflow context a start's params carry, if complete (D18).
pub fn context_of(kind: &str, params: &Map<String, Value>) -> Option<WorkflowCtx> {
    let s = |k: &str| {
        params
            .get(k)
            .and_then(Value::as_str)
            .filter(|v| !v.is_empty())
            .map(String::from)
    };
    let workflow = s("workflow_uuid")?;
    let execution = s("workflow_execution_uuid").or_else(|| s("execution_uuid"))?;
    let node = s("workflow_node_uuid").or_else(|| s("node_uuid"))?;
    Some(WorkflowCtx {
        workflow,
        execution,
        node,
        source_type: s("workflow_source_type").unwrap_or_else(|| {
            if kind == "simulate" {
                "sim".into()
            } else {
                "edge".into()
            }
        }),
        activation_index: params.get("activation_index").and_then(Value::as_u64),
        caller_uuid: s("caller_uuid"),
    })
}

impl Node {
    fn reporting(&self) -> bool {
        self.s.manifest.as_ref().and_then(|m| m.workflow_reporting) != Some(false)
    }

    /// Queues an event durably; returns once it is on disk.
    fn queue_event(&mut self, ev: ingress::Event, label: String) -> Result<(), String> {
        let item = Item {
            topic: ev.topic,
            body: ev.body,
            label,
            key: None,
        };
        if let Err((_, e)) = self.ingress.push(item) {
            // Kept in memory and sent all the same (D28); written once the disk allows.
            if let Some(held) = self.disk_errors.ready(self.clock.now()) {
                log::error!(
                    "cannot write a workflow event to disk ({e}); it is kept in memory and sent anyway{}",
                    super::workloads::held_note(held)
                );
            }
        }
        self.send_ingress();
        Ok(())
    }

    /// Publishes the oldest queued event when nothing is in flight.
    pub(super) fn send_ingress(&mut self) {
        if !self.session.connected() {
            return;
        }
        let Some((seq, item)) = self.ingress.head_due(self.clock.now()) else {
            return;
        };
        let topic = format!("{}{}", self.s.topic_prefix.value, item.topic);
        if !crate::protocol::topics::publishable(&topic) {
            // Queued by an older version or planted: no broker would take it (D34).
            if let Some((item, aside)) = self.ingress.quarantine(seq) {
                log::error!(
                    "the {} has an invalid topic; set aside in {} and not sent",
                    crate::logtext::shown(&item.label),
                    aside.display()
                );
            }
            return;
        }
        let payload =
            serde_json::to_vec(&ingress::with_session(&item.body, self.topics.client_id()))
                .unwrap_or_default();
        match self.mqtt.publish_tracked(&topic, payload) {
            Ok(token) => {
                self.ingress.sent(seq, Vec::new());
                let _ = self.acks_tx.send((seq, token));
            }
            Err(crate::mqtt::NotSent::Never(why)) => {
                self.ingress_refused(seq, &why, true);
                self.send_ingress();
            }
            Err(crate::mqtt::NotSent::NotNow(_)) => self.ingress.retry_later(seq, self.clock.now()),
        }
    }

    /// The broker refused an event, or it can never be sent (D34): set aside with one ERROR
    /// line at once (`permanent`) or after [`crate::outbox::MAX_REFUSALS`] refusals, so that
    /// the events queued behind it are not held up for ever.
    fn ingress_refused(&mut self, seq: u64, why: &str, permanent: bool) {
        let now = self.clock.now();
        super::refused_in(
            &mut self.ingress,
            seq,
            why,
            permanent,
            now,
            "workflow event",
        );
    }

    pub(super) fn on_ingress_ack(&mut self, (seq, acked): Acked) {
        if !self.ingress.in_flight(seq) {
            return; // from before a reconnect: that event is sent again
        }
        if let Err(Some((why, permanent))) = &acked {
            self.ingress_refused(seq, why, *permanent);
        } else if acked.is_ok() {
            if let Some(item) = self.ingress.acknowledged(seq) {
                log::debug!(
                    "ingress event delivered: {}",
                    crate::logtext::shown(&item.label)
                );
            }
        } else {
            self.ingress.retry_later(seq, self.clock.now());
        }
        self.send_ingress();
    }

    /// `emit` from a workload, through the control socket.
    pub(super) fn on_emit(&mut self, body: &Value) -> Value {
        let token = body.get("token").and_then(Value::as_str).unwrap_or("");
        let Some(fields) = body.get("fields").and_then(Value::as_object) else {
            return json!({"ok": false, "error": "emit needs fields"});
        };
        let owner = self
            .active
            .values()
            .find(|a| !token.is_empty() && crate::util::same_secret(&a.meta.event_token, token))
            .map(|a| a.meta.clone());
        let Some(owner) = owner else {
            return json!({"ok": false, "refused": true, "error": "invalid event token (only a running workload's own CYBERWAVE_NODE_EVENT_TOKEN is accepted)"});
        };
        let ev = match ingress::build(fields) {
            Ok(ev) => ev,
            Err(e) => return json!({"ok": false, "error": e.to_string()}),
        };
        if let Some(ctx) = &owner.workflow {
            if ctx.workflow != ev.workflow {
                return json!({"ok": false, "refused": true, "error": format!("this workload may only report workflow {}", ctx.workflow)});
            }
        }
        let execution = ev.execution.clone();
        let label = format!(
            "{} event of workflow {} from {}",
            fields.get("kind").and_then(Value::as_str).unwrap_or("?"),
            ev.workflow,
            owner.request_id_text()
        );
        match self.queue_event(ev, label) {
            Ok(()) => json!({"ok": true, "execution_uuid": execution}),
            Err(e) => json!({"ok": false, "error": e}),
        }
    }

    /// The node's own workload as a workflow node event: `running` at spawn.
    pub(super) fn report_started(&mut self, meta: &Meta) {
        let Some(ctx) = meta.workflow.clone().filter(|_| self.reporting()) else {
            return;
        };
        let mut f = base_fields(&ctx, "running");
        f.insert("started_at".into(), json!(workload::unix_now()));
        self.queue_own(f, &ctx);
    }

    /// … and `success` / `error` at the end.
    pub(super) fn report_finished(
        &mut self,
        meta: &Meta,
        success: bool,
        exit_code: Option<i32>,
        error: Option<String>,
    ) {
        let Some(ctx) = meta.workflow.clone().filter(|_| self.reporting()) else {
            return;
        };
        let now = workload::unix_now();
        let mut f = base_fields(&ctx, if success { "success" } else { "error" });
        f.insert("finished_at".into(), json!(now));
        f.insert(
            "execution_time_ms".into(),
            json!(((now - meta.created_unix) * 1000.0).max(0.0) as i64),
        );
        if let Some(e) = error.filter(|_| !success) {
            f.insert("error_message".into(), json!(e));
        }
        let mut out = Map::new();
        if let Some(c) = exit_code {
            out.insert("exit_code".into(), json!(c));
        }
        if let Some(wl) = &meta.workload_uuid {
            out.insert("workload_uuid".into(), json!(wl));
        }
        f.insert("output".into(), json!([Value::Object(out)]));
        self.queue_own(f, &ctx);
    }

    /// A start that was refused, for a workload with workflow context.
    pub(super) fn report_rejected(&mut self, ctx: Option<WorkflowCtx>, why: &str) {
        let Some(ctx) = ctx.filter(|_| self.reporting()) else {
            return;
        };
        let mut f = base_fields(&ctx, "error");
        f.insert("finished_at".into(), json!(workload::unix_now()));
        f.insert("error_message".into(), json!(why));
        self.queue_own(f, &ctx);
    }

    fn queue_own(&mut self, f: Map<String, Value>, ctx: &WorkflowCtx) {
        match ingress::build(&f) {
            Ok(ev) => {
                let label = format!(
                    "node {} of workflow {} ({})",
                    ctx.node,
                    ctx.workflow,
                    f.get("status").and_then(Value::as_str).unwrap_or("")
                );
                if let Err(e) = self.queue_event(ev, label) {
                    log::error!("{e}");
                }
            }
            Err(e) => log::warn!("workflow context not reported: {e}"),
        }
    }
}

fn base_fields(ctx: &WorkflowCtx, status: &str) -> Map<String, Value> {
    let mut f = Map::new();
    f.insert("kind".into(), json!("node"));
    f.insert("workflow".into(), json!(ctx.workflow));
    f.insert("execution".into(), json!(ctx.execution));
    f.insert("node".into(), json!(ctx.node));
    f.insert("status".into(), json!(status));
    f.insert("source_type".into(), json!(ctx.source_type));
    if let Some(i) = ctx.activation_index {
        f.insert("activation_index".into(), json!(i));
    }
    if let Some(c) = &ctx.caller_uuid {
        f.insert("caller_uuid".into(), json!(c));
    }
    f
}
