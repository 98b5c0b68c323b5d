//! What the node queues to send (completions in its outbox, workflow events in its ingress
//! queue) and a broker refuses (D34): an entry too large for the broker, denied by its ACL, with
//! a topic it drops the connection for, or one no broker takes, is set aside after a few tries
//! with one ERROR line, what queues behind it is delivered, the connection stays (and a refusal
//! is no duplicate client id, D33), and the node answers throughout (guarantee 11).

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::node::NodeSetup;
use crate::support::scenario::completion;
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{wait_for, Broker, ControlPlane, NodeProcess, Rig, Scenario, Start};

const ACCUSED: &str = "another client uses this node's MQTT client id";

/// Writes `entry` as queue entry `seq` of `queue` (`outbox` or `ingress`) in the node's state
/// dir before it starts.
fn plant(setup: &NodeSetup, queue: &str, seq: u64, entry: Value) {
    setup.plant(&format!("{queue}/{seq:020}.json"), entry.to_string());
}

/// An outbox entry whose topic has 251 levels: valid for the node, over mosquitto's limit of
/// 200, so the broker closes the connection for it.
fn plant_deep_topic(rig: &Rig) {
    let topic = vec!["a"; 251].join("/");
    plant(
        &rig.setup,
        "outbox",
        1,
        json!({"topic": topic, "body": {"x": 1}, "label": "deep topic"}),
    );
}

/// Files in the node's quarantine folder.
fn set_aside(rig: &Rig) -> usize {
    std::fs::read_dir(rig.state("quarantine"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// The node answers `status` over MQTT (request id `rid`).
fn answers(cp: &ControlPlane, node: &NodeProcess, rid: &str) {
    assert!(
        cp.status(&node.uuid(), rid, REPLY).is_some(),
        "no status reply to {rid}; log:\n{}",
        node.log()
    );
}

/// What every refusal test checks at its end: one connection all along (the node never sent
/// what the broker drops clients for, and nothing it refused cost the connection), no false
/// duplicate-client-id alarm, one ERROR line per entry set aside, and `status` answered.
fn assert_stayed_up(cp: &ControlPlane, node: &NodeProcess, labels: &[&str]) {
    let log = node.log();
    assert_eq!(
        log.matches("connected to MQTT broker").count(),
        1,
        "the connection did not survive the refusals:\n{log}"
    );
    assert!(!log.contains(ACCUSED), "{log}");
    for label in labels {
        let line = format!("the {label} cannot be delivered");
        assert_eq!(
            log.lines()
                .filter(|l| l.contains(&line) && l.contains("ERROR") && l.contains("set aside in"))
                .count(),
            1,
            "one ERROR line for the {label}:\n{log}"
        );
    }
    answers(cp, node, "after");
}

/// A completion and a workflow event over the broker's Maximum Packet Size (which the broker
/// named in its CONNACK) are never sent: mosquitto would drop the node's connection for them,
/// over and over. One over `message_size_limit` is refused in its PUBACK (0x95): too large
/// for ever, so set aside at once. What queues behind them is delivered, and the node answers
/// `status` throughout.
#[test]
fn g11_d34_messages_too_large_for_the_broker_are_set_aside_without_losing_the_connection() {
    let rig = Scenario::new("cyberwave:\n  training: sleep 1\n")
        .broker(Broker::start_with_conf(
            "max_packet_size 65536\nmessage_size_limit 10000\n",
        ))
        .rig();
    let status = |wl: &str| format!("cyberwave/cloud-workload/{wl}/update-status");
    let pad = |n: usize| "x".repeat(n);
    plant(
        &rig.setup,
        "outbox",
        1,
        json!({"topic": status("wl-huge"), "body": {"status": "completed", "pad": pad(100_000)}, "label": "huge completion"}),
    );
    plant(
        &rig.setup,
        "outbox",
        2,
        json!({"topic": status("wl-large"), "body": {"status": "completed", "pad": pad(20_000)}, "label": "large completion"}),
    );
    plant(
        &rig.setup,
        "outbox",
        3,
        json!({"topic": status("wl-ok"), "body": {"status": "completed"}, "label": "small completion"}),
    );
    plant(
        &rig.setup,
        "ingress",
        1,
        json!({"topic": "cyberwave/workflow/wf/execution/started", "body": {"pad": pad(100_000)}, "label": "huge event"}),
    );
    plant(
        &rig.setup,
        "ingress",
        2,
        json!({"topic": "cyberwave/workflow/wf/execution/ex/finished", "body": {"ok": true}, "label": "small event"}),
    );
    let node = rig.node();
    answers(&rig.cp, &node, "during");
    assert!(
        node.wait_log("backend acknowledged the small completion", DONE),
        "the completion queued behind the refused ones was not delivered:\n{}",
        node.log()
    );
    assert!(
        wait_for(DONE, || (!rig.cp.requests("ingress").is_empty())
            .then_some(()))
        .is_some(),
        "the event queued behind the refused one was not delivered:\n{}",
        node.log()
    );
    let events = rig.cp.requests("ingress");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].id, "wf/execution/ex/finished");
    assert!(
        wait_for(DONE, || (set_aside(&rig) == 3).then_some(())).is_some(),
        "{} set aside:\n{}",
        set_aside(&rig),
        node.log()
    );
    assert!(rig.cp.statuses("wl-huge").is_empty() && rig.cp.statuses("wl-large").is_empty());
    assert_stayed_up(
        &rig.cp,
        &node,
        &["huge completion", "large completion", "huge event"],
    );
}

/// An ACL that denies the node one workload's status topic and one workflow's events (MQTT v5:
/// PUBACK 0x87, the connection stays). Neither is retried for ever (the denied event, sent
/// strictly in order, would hold up every event after it): each is set aside after 5 refusals
/// with one ERROR line, the events behind it are delivered, and the node answers `status`
/// throughout.
#[test]
fn g11_d34_an_acl_deny_sets_the_entry_aside_and_what_follows_is_delivered() {
    let rig = Scenario::new("cyberwave:\n  training: echo done\n")
        .broker(Broker::start_with_acl(
            "pattern deny cyberwave/cloud-workload/wl-denied/#\npattern deny cyberwave/workflow/wf-denied/#\npattern readwrite #\n",
        ))
        .rig();
    plant(
        &rig.setup,
        "ingress",
        1,
        json!({"topic": "cyberwave/workflow/wf-denied/execution/started", "body": {"x": 1}, "label": "denied event"}),
    );
    plant(
        &rig.setup,
        "ingress",
        2,
        json!({"topic": "cyberwave/workflow/wf/execution/started", "body": {"x": 2}, "label": "allowed event"}),
    );
    let node = rig.node();
    Start::training("denied").ok(&rig.cp, &node);
    answers(&rig.cp, &node, "during");
    assert!(
        wait_for(DONE, || (set_aside(&rig) == 2).then_some(())).is_some(),
        "{} set aside:\n{}",
        set_aside(&rig),
        node.log()
    );
    let events = rig.cp.requests("ingress");
    assert!(
        events.iter().any(|e| e.id == "wf/execution/started"),
        "the event behind the denied one was held up: {events:?}\n{}",
        node.log()
    );
    // Another workload's completion goes through.
    Start::training("allowed").ok(&rig.cp, &node);
    completion(&rig.cp, "wl-allowed");
    let label = node
        .log()
        .lines()
        .find(|l| l.contains("cannot be delivered") && !l.contains("denied event"))
        .and_then(|l| l.split("the ").nth(1))
        .and_then(|l| l.split(" cannot be delivered").next())
        .map(String::from)
        .unwrap_or_default();
    assert!(label.contains("denied"), "{label:?}:\n{}", node.log());
    assert_stayed_up(&rig.cp, &node, &["denied event", &label]);
}

/// D34 meets D33: an outbox entry that the broker refuses by closing the connection (here a
/// topic of 251 levels: valid for the node, over mosquitto's limit of 200 levels) makes every
/// connection short. That is not "another client uses this node's MQTT client id" (a false
/// ERROR telling the operator to delete the node's identity, `doctor` FAILing, 30 s pauses
/// before the quarantine D34 promises): the entry is set aside, and the node comes up.
#[test]
fn g11_d34_an_outbox_entry_the_broker_refuses_is_not_reported_as_a_duplicate_client_id() {
    let rig = Scenario::new("cyberwave:\n  training: sleep 1\n").rig();
    plant_deep_topic(&rig);
    let node = rig.spawn();
    let outcome = wait_for(Duration::from_secs(90), || {
        let log = node.log();
        if log.contains(ACCUSED) {
            Some("accused")
        } else if log.contains("deep topic") && log.contains("ERROR") {
            Some("set aside")
        } else {
            None
        }
    });
    assert_eq!(
        outcome,
        Some("set aside"),
        "the refused entry was not set aside (D34) without a false duplicate-client-id ERROR:\n{}",
        node.log()
    );
    assert!(!rig.state("client_id_conflict").exists());
    // With the entry set aside the node comes up and serves.
    node.wait_ready(READY);
}

/// D34, never retried for ever: after the refused entry is set aside, the node comes up. The
/// QoS 1 PUBLISH must not stay in the MQTT session (paho resends unacknowledged messages when a
/// session is resumed): every reconnect would send it again and the broker drop the connection
/// again, ~10 times a second, and the node would never register.
#[test]
fn g11_d34_a_set_aside_outbox_entry_is_not_resent_by_the_resumed_session() {
    let rig = Scenario::new("cyberwave:\n  training: sleep 1\n").rig();
    plant_deep_topic(&rig);
    let node = rig.spawn();
    assert!(
        // Set aside as soon as it is read (too deep a topic), or after the broker refused it.
        node.wait_log("set aside in", Duration::from_secs(150)),
        "never set aside:\n{}",
        node.log()
    );
    let aside = node.log().len();
    // Ready after the entry was set aside, or already before it (a connection that outlived
    // the refusal): either way the node must be up. Both are looked at on every poll.
    let ready = wait_for(Duration::from_secs(30), || {
        node.log().contains("node ready").then_some(())
    })
    .is_some();
    assert!(
        ready,
        "the node did not come up after the entry was set aside ({} connections so far):\n{}",
        node.log().matches("connected to MQTT broker").count(),
        node.log()
            .get(aside..)
            .unwrap_or("")
            .chars()
            .take(6000)
            .collect::<String>()
    );
}

#[test]
fn g11_a_queued_completion_with_a_wildcard_topic_is_set_aside_and_the_node_stays_connected() {
    let rig = Scenario::new("cyberwave:\n  training: echo done\n").rig();
    // What an older version queued for workload `a/#`: the broker would drop the connection
    // at every attempt, and the node would be deaf while saying "connected".
    plant(
        &rig.setup,
        "outbox",
        1,
        json!({"topic": "cyberwave/cloud-workload/a/#/update-status", "body": {"status": "completed"}, "label": "completion of a/#"}),
    );
    let outbox = rig.state("outbox");
    let node = rig.node();
    assert!(
        node.wait_log("invalid topic", REPLY),
        "the bad entry is named: {}",
        node.log()
    );
    let aside = rig.state("quarantine");
    assert_eq!(
        std::fs::read_dir(&aside).map(|d| d.count()).unwrap_or(0),
        1,
        "the entry is kept for a person in {}",
        aside.display()
    );
    assert_eq!(
        std::fs::read_dir(&outbox).map(|d| d.count()).unwrap_or(0),
        0
    );
    for i in 0..3 {
        answers(&rig.cp, &node, &format!("alive-{i}"));
    }
    let local = rig.setup.run(&["status", "--json"]);
    let text = &local.stdout;
    assert!(
        text.contains("\"connected\": true") || text.contains("\"connected\":true"),
        "{text}"
    );
    assert!(!node.log().contains("connection lost"), "{}", node.log());
}
