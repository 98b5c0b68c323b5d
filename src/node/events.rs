//! Execution ingress on the node: the durable ingress queue (`<state dir>/ingress/`,
//! [`EventQueue`]: bounded in bytes, payloads on disk, sent in order per execution and removed
//! on the broker's acknowledgement, D67); events from workloads through the control socket
//! (`emit`), checked against the workload's event token and workflow and its share of the
//! queue; and the node's own workloads reported as workflow node events (decision D18).

use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::io::{Acked, Io};
use crate::ingress;
use crate::ingress_queue::EventQueue;
use crate::mqtt::NotSent;
use crate::outbox::Item;
use crate::workload::{self, Meta, WorkflowCtx};

/// The quarantine is pruned at most this often after an event is set aside (and hourly).
const PRUNE_EVERY: Duration = Duration::from_secs(10);

/// The ingress part: the durable queue of workflow events and the node's own reports into it.
pub struct Ingress {
    /// Workflow execution events waiting for the broker's acknowledgement.
    pub queue: EventQueue,
    /// `workflow_reporting` of the manifest is not off: the node reports its own workloads.
    reporting: bool,
    /// `topic_prefix`.
    prefix: String,
    /// When the quarantine was last pruned after an event was set aside.
    pruned: Option<Instant>,
}

/// What the ingress part needs of the world.
pub trait Publisher {
    fn connected(&self) -> bool;
    fn now(&self) -> Instant;
    /// The MQTT client id, the session of every event (the backend dedups on it).
    fn client_id(&self) -> &str;
    /// Publishes an event at QoS 1; its acknowledgement comes back as an [`Acked`].
    fn publish_tracked(&mut self, seq: u64, topic: &str, payload: Vec<u8>) -> Result<(), NotSent>;
    /// A full-disk error is due to be logged (once a minute, D28): `Some(held)`.
    fn disk_error_due(&mut self) -> Option<u64>;
    /// Events were set aside: the quarantine is held to its bounds (off the loop).
    fn prune_quarantine(&mut self);
}

impl Ingress {
    pub fn new(queue: EventQueue, reporting: bool, prefix: String) -> Ingress {
        Ingress {
            queue,
            reporting,
            prefix,
            pruned: None,
        }
    }

    /// Queues the node's own event durably (in memory when the disk refuses, D28), then sends
    /// what is due.
    fn queue_own(&mut self, item: Item, out: &mut dyn Publisher) {
        if let Err(e) = self.queue.push(item, true) {
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

    /// Publishes what is due: the oldest event of each execution with none in flight.
    pub fn send(&mut self, out: &mut dyn Publisher) {
        if !out.connected() {
            return;
        }
        if self.queue.has_pending_writes() {
            self.queue.persist_pending();
        }
        let mut set_aside = false;
        for seq in self.queue.due(out.now()) {
            set_aside |= self.send_one(seq, out);
        }
        if set_aside {
            self.prune(out);
        }
    }

    /// Sends one event; true when it was set aside instead.
    fn send_one(&mut self, seq: u64, out: &mut dyn Publisher) -> bool {
        let item = match self.queue.item(seq) {
            Ok(item) => item,
            // Changed under the node: set aside, never sent as it is now.
            Err(e) => {
                if let Some((label, aside)) = self.queue.quarantine(seq) {
                    log::error!(
                        "the {} cannot be read back ({e}); set aside in {} and not sent",
                        crate::logtext::shown(&label),
                        aside.display()
                    );
                }
                return true;
            }
        };
        let topic = format!("{}{}", self.prefix, item.topic);
        if !crate::protocol::topics::publishable(&topic) {
            // Queued by an older version or planted: no broker would take it (D34).
            if let Some((label, aside)) = self.queue.quarantine(seq) {
                log::error!(
                    "the {} has an invalid topic; set aside in {} and not sent",
                    crate::logtext::shown(&label),
                    aside.display()
                );
            }
            return true;
        }
        let payload = serde_json::to_vec(&ingress::with_session(&item.body, out.client_id()))
            .unwrap_or_default();
        drop(item);
        match out.publish_tracked(seq, &topic, payload) {
            Ok(()) => {
                self.queue.sent(seq, out.now());
                false
            }
            Err(NotSent::Never(why)) => self.refused(seq, &why, true, out.now()),
            Err(NotSent::NotNow(_)) => {
                self.queue.retry_later(seq, out.now());
                false
            }
        }
    }

    /// The broker refused an event, or it can never be sent (D34): set aside with one ERROR
    /// line at once (`permanent`) or after [`crate::outbox::MAX_REFUSALS`] refusals; only the
    /// events of its own execution wait for it meanwhile. True when it was set aside.
    fn refused(&mut self, seq: u64, why: &str, permanent: bool, now: Instant) -> bool {
        match self.queue.refused(seq, permanent, now) {
            Some((label, aside)) => {
                log::error!(
                    "the {} cannot be delivered ({}); it is set aside in {} and not sent again",
                    crate::logtext::shown(&label),
                    crate::logtext::shown(why),
                    aside.display()
                );
                true
            }
            None => {
                log::warn!(
                    "workflow event {seq} not delivered ({}); retrying later",
                    crate::logtext::shown(why)
                );
                false
            }
        }
    }

    /// Holds the quarantine to its bounds, at most every [`PRUNE_EVERY`] (the hourly pass
    /// catches the rest).
    fn prune(&mut self, out: &mut dyn Publisher) {
        let now = out.now();
        if self
            .pruned
            .is_some_and(|t| now.saturating_duration_since(t) < PRUNE_EVERY)
        {
            return;
        }
        self.pruned = Some(now);
        out.prune_quarantine();
    }

    pub fn on_ack(&mut self, (seq, acked): Acked, out: &mut dyn Publisher) {
        if !self.queue.in_flight(seq) {
            return; // from before a reconnect: that event is sent again
        }
        if let Err(Some((why, permanent))) = &acked {
            if self.refused(seq, why, *permanent, out.now()) {
                self.prune(out);
            }
        } else if acked.is_ok() {
            if let Some(label) = self.queue.acknowledged(seq) {
                log::debug!("ingress event delivered: {}", crate::logtext::shown(&label));
            }
        } else {
            self.queue.retry_later(seq, out.now());
        }
        self.send(out);
    }

    /// The connection dropped: what was in flight goes again; what the broker refused too
    /// often is set aside (D34).
    pub fn connection_lost(&mut self, now: Instant) -> Vec<(String, std::path::PathBuf)> {
        self.queue.reset_in_flight(now)
    }

    /// `emit` from a workload, through the control socket: `owner` is the running workload
    /// whose event token the request carries, if any. An event that does not fit the queue's
    /// bounds (D67) is refused at once (`not_queued`, `full`) naming the bound it hit; nothing
    /// is queued.
    pub fn emit(&mut self, body: &Value, owner: Option<&Meta>, out: &mut dyn Publisher) -> Value {
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
        let execution = ev.execution.clone();
        let item = Item {
            label: format!(
                "{} event of workflow {} from {}",
                fields.get("kind").and_then(Value::as_str).unwrap_or("?"),
                ev.workflow,
                owner.request_id_text()
            ),
            topic: ev.topic,
            body: ev.body,
            key: None,
            owner: Some(owner.safe_id.clone()),
        };
        let size = EventQueue::size_of(&item);
        if let Err(full) = self.queue.room(&owner.safe_id, size) {
            // Not `busy` (which a caller retries at once for half a minute): the workload decides.
            return json!({"ok": false, "not_queued": true, "full": true, "error": format!("{full}: this event ({size} bytes) is not queued; send it again once the queue drains")});
        }
        if let Err(e) = self.queue.push(item, false) {
            return json!({"ok": false, "not_queued": true, "error": format!("the event cannot be written to the node's queue ({e}): it is not queued; send it again later")});
        }
        self.send(out);
        json!({"ok": true, "execution_uuid": execution})
    }

    /// The node's own workload as a workflow node event: `running` at spawn.
    pub fn report_started(&mut self, meta: &Meta, out: &mut dyn Publisher) {
        let Some(ctx) = meta.workflow.clone().filter(|_| self.reporting) else {
            return;
        };
        let mut f = base_fields(&ctx, "running");
        f.insert("started_at".into(), json!(workload::unix_now()));
        self.report(f, &ctx, out);
    }

    /// … and `success` / `error` at the end.
    pub fn report_finished(
        &mut self,
        meta: &Meta,
        success: bool,
        exit_code: Option<i32>,
        error: Option<String>,
        out: &mut dyn Publisher,
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
        self.report(f, &ctx, out);
    }

    /// A start that was refused, for a workload with workflow context.
    pub fn report_rejected(
        &mut self,
        ctx: Option<WorkflowCtx>,
        why: &str,
        out: &mut dyn Publisher,
    ) {
        let Some(ctx) = ctx.filter(|_| self.reporting) else {
            return;
        };
        let mut f = base_fields(&ctx, "error");
        f.insert("finished_at".into(), json!(workload::unix_now()));
        f.insert("error_message".into(), json!(why));
        self.report(f, &ctx, out);
    }

    fn report(&mut self, f: Map<String, Value>, ctx: &WorkflowCtx, out: &mut dyn Publisher) {
        match ingress::build(&f) {
            Ok(ev) => {
                let label = format!(
                    "node {} of workflow {} ({})",
                    ctx.node,
                    ctx.workflow,
                    f.get("status").and_then(Value::as_str).unwrap_or("")
                );
                let item = Item {
                    topic: ev.topic,
                    body: ev.body,
                    label,
                    key: None,
                    owner: None,
                };
                self.queue_own(item, out);
            }
            Err(e) => log::warn!("workflow context not reported: {e}"),
        }
    }
}

/// The ingress part's [`Publisher`] on the node's MQTT client and the ack thread.
pub(super) struct MqttPublisher<'a> {
    pub connected: bool,
    pub now: Instant,
    pub io: &'a Io,
    pub disk_errors: &'a mut crate::logtext::Throttle,
}

impl Publisher for MqttPublisher<'_> {
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
    fn prune_quarantine(&mut self) {
        crate::store::prune_quarantine_in_background(self.io.layout.state.clone());
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
    struct FakePublisher {
        connected: bool,
        now: Instant,
        published: Vec<(u64, String)>,
        prunes: usize,
    }
    impl Publisher for FakePublisher {
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
        fn prune_quarantine(&mut self) {
            self.prunes += 1;
        }
    }

    fn fake(connected: bool) -> FakePublisher {
        FakePublisher {
            connected,
            now: Instant::now(),
            published: Vec::new(),
            prunes: 0,
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

    fn owner(layout: &crate::workload::Layout, safe_id: &str) -> Meta {
        let mut m: Meta =
            serde_json::from_value(crate::workload::testkit::good_meta(layout)).unwrap();
        m.safe_id = safe_id.into();
        m
    }

    /// D67: a workload that emits while the broker is away fills its share of the queue (a
    /// quarter of the bytes) and no more: past it each `emit` is refused, saying which bound,
    /// with nothing queued; another workload still has its own share.
    #[test]
    fn d67_emits_past_a_workloads_share_are_refused_and_queue_nothing() {
        let scratch = crate::scratch::Scratch::new("ingress-share");
        let layout = crate::workload::Layout {
            state: scratch.path().to_path_buf(),
        };
        let queue = EventQueue::load(scratch.path().join("ingress"), 40_000).unwrap();
        let mut part = Ingress::new(queue, true, String::new());
        let mut out = fake(false);
        let body = |pad: usize| {
            json!({"fields": {"kind": "started", "workflow": ctx().workflow,
                "trigger": {"pad": "x".repeat(pad)}}})
        };
        let a = owner(&layout, "wl-a");
        let mut queued = 0;
        loop {
            let r = part.emit(&body(2000), Some(&a), &mut out);
            if r["ok"] != true {
                assert_eq!(r["not_queued"], true, "{r}");
                assert_eq!(r["full"], true, "{r}");
                assert!(
                    r.get("busy").is_none(),
                    "a caller would retry it for half a minute"
                );
                let why = r["error"].as_str().unwrap();
                assert!(
                    why.contains("its share of the node's queue is 10000"),
                    "{why}"
                );
                assert!(why.contains("not queued"), "{why}");
                break;
            }
            queued += 1;
            assert!(queued < 10, "never refused");
        }
        assert_eq!(part.queue.len(), queued);
        assert!(part.queue.bytes() <= 10_000);
        // Another workload has a share of its own.
        let b = owner(&layout, "wl-b");
        assert_eq!(part.emit(&body(2000), Some(&b), &mut out)["ok"], true);
        // The node's own reports are not held to the bounds.
        for _ in 0..20 {
            part.report_rejected(Some(ctx()), "busy", &mut out);
        }
        assert_eq!(part.queue.len(), queued + 21);
    }

    #[test]
    fn a_refused_start_is_queued_sent_once_connected_in_order_and_removed_on_its_ack() {
        let scratch = crate::scratch::Scratch::new("ingress-part");
        let queue = EventQueue::load(scratch.path().join("ingress"), 1 << 20).unwrap();
        let mut part = Ingress::new(queue, true, "pre/".into());
        let mut out = fake(false);
        part.report_rejected(Some(ctx()), "busy", &mut out);
        part.report_rejected(Some(ctx()), "busy again", &mut out);
        assert_eq!(part.queue.len(), 2, "queued durably");
        assert!(out.published.is_empty(), "not connected: nothing sent");
        out.connected = true;
        out.now += Duration::from_secs(1);
        part.send(&mut out);
        part.send(&mut out);
        assert_eq!(out.published.len(), 1, "one in flight per execution");
        let (seq, topic) = out.published[0].clone();
        assert!(topic.starts_with("pre/"), "{topic}");
        part.on_ack((seq, Ok(())), &mut out);
        assert_eq!(part.queue.len(), 1);
        assert_eq!(out.published.len(), 2, "the next goes on the ack");
        // Reporting off: the node's own workloads are not reported.
        let queue = EventQueue::load(scratch.path().join("q"), 1 << 20).unwrap();
        let mut quiet = Ingress::new(queue, false, String::new());
        quiet.report_rejected(Some(ctx()), "busy", &mut out);
        assert_eq!(quiet.queue.len(), 0);
    }

    /// D67: the broker refuses one workflow's events (an ACL deny in the PUBACK); another
    /// workflow's events are delivered meanwhile, and the refused ones are set aside after
    /// their refusals, with the quarantine pruned.
    #[test]
    fn d67_a_refused_workflow_never_holds_back_another() {
        let scratch = crate::scratch::Scratch::new("ingress-refused");
        let layout = crate::workload::Layout {
            state: scratch.path().to_path_buf(),
        };
        let queue = EventQueue::load(scratch.path().join("ingress"), 1 << 20).unwrap();
        let mut part = Ingress::new(queue, true, String::new());
        let mut out = fake(false);
        let denied = owner(&layout, "wl-denied");
        for i in 0..50 {
            let ev = json!({"fields": {"kind": "node", "workflow": "wf-denied",
                "execution": format!("ex-{i}"), "node": "n", "status": "running"}});
            assert_eq!(part.emit(&ev, Some(&denied), &mut out)["ok"], true);
        }
        let other = owner(&layout, "wl-other");
        let ev = json!({"fields": {"kind": "started", "workflow": "wf-ok", "execution": "ex"}});
        assert_eq!(part.emit(&ev, Some(&other), &mut out)["ok"], true);
        out.connected = true;
        part.send(&mut out);
        let first: Vec<String> = out.published.iter().map(|p| p.1.clone()).collect();
        assert!(first.len() <= crate::ingress_queue::MAX_IN_FLIGHT);
        // Every denied event in flight is refused; the allowed one goes as soon as there is room.
        let mut delivered = false;
        for _ in 0..2000 {
            let Some((seq, topic)) = out.published.first().cloned() else {
                out.now += Duration::from_secs(1);
                part.send(&mut out);
                continue;
            };
            out.published.remove(0);
            if topic.contains("wf-ok") {
                part.on_ack((seq, Ok(())), &mut out);
                delivered = true;
                break;
            }
            part.on_ack((seq, Err(Some(("not authorised".into(), false)))), &mut out);
        }
        assert!(delivered, "the allowed event was held back");
    }
}
