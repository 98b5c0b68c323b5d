//! Execution ingress on the node: the durable ingress queue (`<state dir>/ingress/`), sent at
//! QoS 1 strictly in order one event at a time and removed on the broker's acknowledgement (so
//! node and finished events never overtake their `started`); events from workloads through the
//! control socket (`emit`), checked against the workload's event token and workflow; and the
//! node's own workloads reported as workflow node events (decision D18).

use std::time::Instant;

use serde_json::{json, Map, Value};

use super::io::{Acked, Io};
use crate::ingress;
use crate::mqtt::NotSent;
use crate::outbox::{Item, Outbox};
use crate::workload::{self, Meta, WorkflowCtx};

/// The ingress part: the durable queue of workflow events and the node's own reports into it.
pub struct Ingress {
    /// Workflow execution events waiting for the broker's acknowledgement.
    pub queue: Outbox,
    /// `workflow_reporting` of the manifest is not off: the node reports its own workloads.
    reporting: bool,
    /// `topic_prefix`.
    prefix: String,
    /// How many events may wait in `queue` before a workload's `emit` is refused
    /// ([`ingress::MAX_QUEUED_EVENTS`]).
    max_queued: usize,
}

/// What the ingress part needs of the world.
pub trait Outbound {
    fn connected(&self) -> bool;
    fn now(&self) -> Instant;
    /// The MQTT client id, the session of every event (the backend dedups on it).
    fn client_id(&self) -> &str;
    /// Publishes an event at QoS 1; its acknowledgement comes back as an [`Acked`].
    fn publish_tracked(&mut self, seq: u64, topic: &str, payload: Vec<u8>) -> Result<(), NotSent>;
    /// A full-disk error is due to be logged (once a minute, D28): `Some(held)`.
    fn disk_error_due(&mut self) -> Option<u64>;
}

impl Ingress {
    pub fn new(queue: Outbox, reporting: bool, prefix: String) -> Ingress {
        Ingress {
            queue,
            reporting,
            prefix,
            max_queued: ingress::MAX_QUEUED_EVENTS,
        }
    }

    /// Queues an event durably (in memory when the disk refuses, D28), then sends what is due.
    fn queue_event(&mut self, ev: ingress::Event, label: String, out: &mut dyn Outbound) {
        let item = Item {
            topic: ev.topic,
            body: ev.body,
            label,
            key: None,
        };
        if let Err((_, e)) = self.queue.push(item) {
            // Kept in memory and sent all the same (D28); written once the disk allows.
            if let Some(held) = out.disk_error_due() {
                log::error!(
                    "cannot write a workflow event to disk ({e}); it is kept in memory and sent anyway{}",
                    crate::logtext::held_note(held)
                );
            }
        }
        self.send(out);
    }

    /// Publishes the oldest queued event when nothing is in flight.
    pub fn send(&mut self, out: &mut dyn Outbound) {
        if !out.connected() {
            return;
        }
        let Some((seq, item)) = self.queue.head_due(out.now()) else {
            return;
        };
        let topic = format!("{}{}", self.prefix, item.topic);
        if !crate::protocol::topics::publishable(&topic) {
            // Queued by an older version or planted: no broker would take it (D34).
            if let Some((item, aside)) = self.queue.quarantine(seq) {
                log::error!(
                    "the {} has an invalid topic; set aside in {} and not sent",
                    crate::logtext::shown(&item.label),
                    aside.display()
                );
            }
            return;
        }
        let payload = serde_json::to_vec(&ingress::with_session(&item.body, out.client_id()))
            .unwrap_or_default();
        match out.publish_tracked(seq, &topic, payload) {
            Ok(()) => self.queue.sent(seq, Vec::new()),
            Err(NotSent::Never(why)) => {
                self.refused(seq, &why, true, out.now());
                self.send(out);
            }
            Err(NotSent::NotNow(_)) => self.queue.retry_later(seq, out.now()),
        }
    }

    /// The broker refused an event, or it can never be sent (D34): set aside with one ERROR
    /// line at once (`permanent`) or after [`crate::outbox::MAX_REFUSALS`] refusals, so that
    /// the events queued behind it are not held up for ever.
    fn refused(&mut self, seq: u64, why: &str, permanent: bool, now: Instant) {
        super::parts::refused_in(&mut self.queue, seq, why, permanent, now, "workflow event");
    }

    pub fn on_ack(&mut self, (seq, acked): Acked, out: &mut dyn Outbound) {
        if !self.queue.in_flight(seq) {
            return; // from before a reconnect: that event is sent again
        }
        if let Err(Some((why, permanent))) = &acked {
            self.refused(seq, why, *permanent, out.now());
        } else if acked.is_ok() {
            if let Some(item) = self.queue.acknowledged(seq) {
                log::debug!(
                    "ingress event delivered: {}",
                    crate::logtext::shown(&item.label)
                );
            }
        } else {
            self.queue.retry_later(seq, out.now());
        }
        self.send(out);
    }

    /// `emit` from a workload, through the control socket: `owner` is the running workload
    /// whose event token the request carries, if any.
    pub fn emit(&mut self, body: &Value, owner: Option<&Meta>, out: &mut dyn Outbound) -> Value {
        let Some(fields) = body.get("fields").and_then(Value::as_object) else {
            return json!({"ok": false, "error": "emit needs fields"});
        };
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
        // A workload emitting in a loop (or while the broker is away) must not fill the memory
        // and the disk: past the limit nothing more is queued until events are sent.
        if self.queue.len() >= self.max_queued {
            return json!({"ok": false, "busy": true, "error": format!("{} workflow events wait to be sent already (the broker is slow or away): this one is not queued; try again later", self.queue.len())});
        }
        let execution = ev.execution.clone();
        let label = format!(
            "{} event of workflow {} from {}",
            fields.get("kind").and_then(Value::as_str).unwrap_or("?"),
            ev.workflow,
            owner.request_id_text()
        );
        self.queue_event(ev, label, out);
        json!({"ok": true, "execution_uuid": execution})
    }

    /// The node's own workload as a workflow node event: `running` at spawn.
    pub fn report_started(&mut self, meta: &Meta, out: &mut dyn Outbound) {
        let Some(ctx) = meta.workflow.clone().filter(|_| self.reporting) else {
            return;
        };
        let mut f = base_fields(&ctx, "running");
        f.insert("started_at".into(), json!(workload::unix_now()));
        self.queue_own(f, &ctx, out);
    }

    /// … and `success` / `error` at the end.
    pub fn report_finished(
        &mut self,
        meta: &Meta,
        success: bool,
        exit_code: Option<i32>,
        error: Option<String>,
        out: &mut dyn Outbound,
    ) {
        let Some(ctx) = meta.workflow.clone().filter(|_| self.reporting) else {
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
        let mut o = Map::new();
        if let Some(c) = exit_code {
            o.insert("exit_code".into(), json!(c));
        }
        if let Some(wl) = &meta.workload_uuid {
            o.insert("workload_uuid".into(), json!(wl));
        }
        f.insert("output".into(), json!([Value::Object(o)]));
        self.queue_own(f, &ctx, out);
    }

    /// A start that was refused, for a workload with workflow context.
    pub fn report_rejected(&mut self, ctx: Option<WorkflowCtx>, why: &str, out: &mut dyn Outbound) {
        let Some(ctx) = ctx.filter(|_| self.reporting) else {
            return;
        };
        let mut f = base_fields(&ctx, "error");
        f.insert("finished_at".into(), json!(workload::unix_now()));
        f.insert("error_message".into(), json!(why));
        self.queue_own(f, &ctx, out);
    }

    fn queue_own(&mut self, f: Map<String, Value>, ctx: &WorkflowCtx, out: &mut dyn Outbound) {
        match ingress::build(&f) {
            Ok(ev) => {
                let label = format!(
                    "node {} of workflow {} ({})",
                    ctx.node,
                    ctx.workflow,
                    f.get("status").and_then(Value::as_str).unwrap_or("")
                );
                self.queue_event(ev, label, out);
            }
            Err(e) => log::warn!("workflow context not reported: {e}"),
        }
    }
}

/// The ingress part's [`Outbound`] on the node's MQTT client and the ack thread.
pub(super) struct Wire<'a> {
    pub connected: bool,
    pub now: Instant,
    pub io: &'a Io,
    pub disk_errors: &'a mut crate::logtext::Throttle,
}

impl Outbound for Wire<'_> {
    fn connected(&self) -> bool {
        self.connected
    }
    fn now(&self) -> Instant {
        self.now
    }
    fn client_id(&self) -> &str {
        self.io.topics.client_id()
    }
    fn publish_tracked(&mut self, seq: u64, topic: &str, payload: Vec<u8>) -> Result<(), NotSent> {
        let token = self.io.mqtt.publish_tracked(topic, payload)?;
        let _ = self.io.acks_tx.send((seq, token));
        Ok(())
    }
    fn disk_error_due(&mut self) -> Option<u64> {
        self.disk_errors.ready(self.now)
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

/// The workload an `emit` on the control socket comes from, found by its token.
pub(super) fn owner_of(active: &super::table::Table, body: &Value) -> Option<Meta> {
    let token = body.get("token").and_then(Value::as_str).unwrap_or("");
    active
        .values()
        .find(|a| !token.is_empty() && crate::util::same_secret(&a.meta.event_token, token))
        .map(|a| a.meta.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recording fake: what was published, and whether it is connected.
    struct Fake {
        connected: bool,
        now: Instant,
        published: Vec<(u64, String)>,
    }
    impl Outbound for Fake {
        fn connected(&self) -> bool {
            self.connected
        }
        fn now(&self) -> Instant {
            self.now
        }
        fn client_id(&self) -> &str {
            "client-1"
        }
        fn publish_tracked(&mut self, seq: u64, topic: &str, _: Vec<u8>) -> Result<(), NotSent> {
            self.published.push((seq, topic.to_string()));
            Ok(())
        }
        fn disk_error_due(&mut self) -> Option<u64> {
            Some(0)
        }
    }

    fn ctx() -> WorkflowCtx {
        WorkflowCtx {
            workflow: "11111111-1111-4111-8111-111111111111".into(),
            execution: "22222222-2222-4222-8222-222222222222".into(),
            node: "33333333-3333-4333-8333-333333333333".into(),
            source_type: "edge".into(),
            activation_index: None,
            caller_uuid: None,
        }
    }

    /// A workload that emits in a loop while the broker is away fills the queue up to its limit
    /// and no further: each `emit` past it is refused as busy, with nothing queued.
    #[test]
    fn emits_past_the_queue_limit_are_refused_as_busy_and_queue_nothing() {
        let scratch = crate::scratch::Scratch::new("ingress-cap");
        let mut part = Ingress::new(
            Outbox::load(scratch.path().join("q")).unwrap(),
            true,
            String::new(),
        );
        part.max_queued = 3;
        let layout = crate::workload::Layout {
            state: scratch.path().to_path_buf(),
        };
        let owner: Meta =
            serde_json::from_value(crate::workload::testkit::good_meta(&layout)).unwrap();
        let mut out = Fake {
            connected: false,
            now: Instant::now(),
            published: Vec::new(),
        };
        let body = json!({"fields": {"kind": "started", "workflow": ctx().workflow}});
        for _ in 0..3 {
            assert_eq!(part.emit(&body, Some(&owner), &mut out)["ok"], true);
        }
        let refused = part.emit(&body, Some(&owner), &mut out);
        assert_eq!(refused["ok"], false, "{refused}");
        assert_eq!(refused["busy"], true, "{refused}");
        assert_eq!(part.queue.len(), 3);
    }

    #[test]
    fn a_refused_start_is_queued_sent_once_connected_one_at_a_time_and_removed_on_its_ack() {
        let dir = std::env::temp_dir().join(format!("cw-ingress-part-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let queue = Outbox::load(dir.clone()).unwrap();
        let mut part = Ingress::new(queue, true, "pre/".into());
        let mut out = Fake {
            connected: false,
            now: Instant::now(),
            published: Vec::new(),
        };
        part.report_rejected(Some(ctx()), "busy", &mut out);
        part.report_rejected(Some(ctx()), "busy again", &mut out);
        assert_eq!(part.queue.len(), 2, "queued durably");
        assert!(out.published.is_empty(), "not connected: nothing sent");
        out.connected = true;
        out.now += std::time::Duration::from_secs(1);
        part.send(&mut out);
        part.send(&mut out);
        assert_eq!(out.published.len(), 1, "strictly one in flight");
        let (seq, topic) = out.published[0].clone();
        assert!(topic.starts_with("pre/"), "{topic}");
        part.on_ack((seq, Ok(())), &mut out);
        assert_eq!(part.queue.len(), 1);
        assert_eq!(out.published.len(), 2, "the next goes on the ack");
        // Reporting off: the node's own workloads are not reported.
        let mut quiet = Ingress::new(Outbox::load(dir.join("q")).unwrap(), false, String::new());
        quiet.report_rejected(Some(ctx()), "busy", &mut out);
        assert_eq!(quiet.queue.len(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
