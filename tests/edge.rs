//! The typed edge (issue 11, decisions D8 and D20; guarantee 8): a command whose params do not
//! validate gets an error reply naming the field, nothing is spawned, queued or persisted for
//! it, and the node keeps serving — also after a restart.

use serde_json::{json, Value};

use crate::support::node::NodeSetup;
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{rig, wait_for, NodeProcess};

/// A manifest whose workloads leave a mark in `ran/` when they run at all.
const MARKING: &str =
    "cyberwave:\n  inference: mkdir -p ran && touch \"ran/$(date +%s%N)\"\n  training: mkdir -p ran && touch \"ran/$(date +%s%N)\"\n";

fn refused(
    cp: &crate::support::ControlPlane,
    node: &NodeProcess,
    rid: &str,
    body: Value,
) -> String {
    cp.command(&node.uuid(), body);
    let r = cp
        .wait_reply(rid, REPLY)
        .unwrap_or_else(|| panic!("no reply to {rid}; log:\n{}", node.log()));
    assert_eq!(r["status"], "error", "{rid}: {r}");
    r["error"].as_str().unwrap_or_default().to_string()
}

fn nothing_ran(setup: &NodeSetup) {
    let ran = setup.cwd.join("ran");
    let n = std::fs::read_dir(&ran).map(|d| d.count()).unwrap_or(0);
    assert_eq!(n, 0, "a refused command spawned a workload");
}

fn still_serving(cp: &crate::support::ControlPlane, node: &NodeProcess, rid: &str) {
    let s = cp
        .status(&node.uuid(), rid, REPLY)
        .unwrap_or_else(|| panic!("no status reply; log:\n{}", node.log()));
    assert_eq!(s["status"], "ok", "{s}");
}

#[test]
fn g8_a_runtime_limit_of_1e19_seconds_is_refused_and_cannot_crash_loop_the_node() {
    let (_broker, cp, setup) = rig(MARKING);
    let mut node = setup.spawn();
    node.wait_ready(READY);
    for (i, bad) in [
        json!(1e19),
        json!(-1),
        json!(0),
        json!(f64::MAX),
        json!("60"),
    ]
    .into_iter()
    .enumerate()
    {
        let rid = format!("rt{i}");
        let e = refused(
            &cp,
            &node,
            &rid,
            json!({"command": "inference", "request_id": rid, "params": {"workload_uuid": format!("w{i}"), "max_runtime_seconds": bad}}),
        );
        assert!(e.contains("params.max_runtime_seconds"), "{e}");
        assert!(e.contains("30 days"), "the reply names the range: {e}");
        // The backend named the workload: it hears that it failed, and why.
        let st = cp.statuses(&format!("w{i}"));
        assert!(
            crate::support::wait_for(REPLY, || cp
                .statuses(&format!("w{i}"))
                .iter()
                .any(|b| b["status"] == "failed")
                .then_some(()))
            .is_some(),
            "{st:?}"
        );
    }
    still_serving(&cp, &node, "alive-1");
    nothing_ran(&setup);
    // Nothing was persisted for it: a restart comes up and serves.
    node.kill9();
    let node = setup.spawn();
    node.wait_ready(READY);
    still_serving(&cp, &node, "alive-2");
    assert!(!node.log().contains("panicked"), "{}", node.log());
}

#[test]
fn g8_workload_uuids_with_topic_wildcards_are_refused_and_the_node_stays_connected() {
    let (_broker, cp, setup) = rig(MARKING);
    let node = setup.spawn();
    node.wait_ready(READY);
    for (i, bad) in [
        "a/#",
        "+",
        "#",
        "a/b",
        "with space",
        "tab\there",
        "\u{1b}[2J",
        "é",
    ]
    .into_iter()
    .enumerate()
    {
        let rid = format!("topic{i}");
        let e = refused(
            &cp,
            &node,
            &rid,
            json!({"command": "inference", "request_id": rid, "params": {"workload_uuid": bad}}),
        );
        assert!(e.contains("params.workload_uuid"), "{e}");
    }
    // Workflow ids reach ingress topics: the same rule.
    let e = refused(
        &cp,
        &node,
        "wf",
        json!({"command": "inference", "request_id": "wf", "params": {"workflow_uuid": "w/#", "workflow_execution_uuid": "e", "workflow_node_uuid": "n"}}),
    );
    assert!(e.contains("params.workflow_uuid"), "{e}");
    still_serving(&cp, &node, "alive");
    nothing_ran(&setup);
    assert!(!node.log().contains("connection lost"), "{}", node.log());
    let outbox = setup.config_dir().join("outbox");
    let queued = std::fs::read_dir(&outbox).map(|d| d.count()).unwrap_or(0);
    assert_eq!(queued, 0, "nothing is queued for a refused command");
}

#[test]
fn g5_params_that_are_not_an_object_spawn_nothing() {
    let (_broker, cp, setup) = rig(MARKING);
    let node = setup.spawn();
    node.wait_ready(READY);
    for (i, bad) in [json!(null), json!("x"), json!(7), json!([1, 2])]
        .into_iter()
        .enumerate()
    {
        let rid = format!("p{i}");
        let e = refused(
            &cp,
            &node,
            &rid,
            json!({"command": "training", "request_id": rid, "params": bad}),
        );
        assert!(e.contains("params must be a JSON object"), "{e}");
    }
    let e = refused(
        &cp,
        &node,
        "absent",
        json!({"command": "inference", "request_id": "absent"}),
    );
    assert!(e.contains("params"), "{e}");
    // workload_received: a null command_params is refused, and the named workload fails (D8).
    let e = refused(
        &cp,
        &node,
        "wr",
        json!({"command": "workload_received", "request_id": "wr", "params": {"workload_uuid": "wl-wr", "command_type": "training", "command_params": null}}),
    );
    assert!(e.contains("params.command_params"), "{e}");
    assert!(cp.wait_status("wl-wr", "failed", REPLY).is_some());
    still_serving(&cp, &node, "alive");
    nothing_ran(&setup);
}

#[test]
fn g8_a_non_string_environment_uuid_cannot_slip_past_a_reservation() {
    let (_broker, cp, mut setup) = rig(MARKING);
    setup.arg("--environment").arg("env-A");
    let node = setup.spawn();
    node.wait_ready(READY);
    for (i, bad) in [json!(42), json!(["env-B"]), json!({}), json!("env-B")]
        .into_iter()
        .enumerate()
    {
        let rid = format!("env{i}");
        let e = refused(
            &cp,
            &node,
            &rid,
            json!({"command": "inference", "request_id": rid, "params": {"environment_uuid": bad}}),
        );
        assert!(e.contains("environment"), "{e}");
    }
    nothing_ran(&setup);
    // The reserved environment itself is served.
    cp.command(
        &node.uuid(),
        json!({"command": "inference", "request_id": "env-ok", "params": {"environment_uuid": "env-A"}}),
    );
    let r = cp.wait_reply("env-ok", REPLY).expect("reply");
    assert_eq!(r["status"], "ok", "{r}");
}

#[test]
fn g8_a_request_id_over_16_kib_is_refused_and_one_at_the_limit_runs() {
    let (_broker, cp, setup) = rig(MARKING);
    let node = setup.spawn();
    node.wait_ready(READY);
    let long = "r".repeat(16 * 1024 + 1);
    let e = refused(
        &cp,
        &node,
        &long,
        json!({"command": "inference", "request_id": long, "params": {}}),
    );
    assert!(e.contains("request_id"), "{e}");
    assert!(e.contains("16384"), "the reply names the limit: {e}");
    nothing_ran(&setup);
    // The node's log shows a cut id, never 16 KiB of it.
    assert!(
        node.log().lines().all(|l| l.len() < 4096),
        "a log line carries the whole id"
    );
    let at_limit = "s".repeat(16 * 1024);
    cp.command(
        &node.uuid(),
        json!({"command": "inference", "request_id": at_limit, "params": {}}),
    );
    let r = cp.wait_reply(&at_limit, REPLY).expect("reply");
    assert_eq!(r["status"], "ok", "{r}; log:\n{}", node.log());
    let ran = setup.cwd.join("ran");
    assert!(
        crate::support::wait_for(REPLY, || (std::fs::read_dir(&ran)
            .map(|d| d.count())
            .unwrap_or(0)
            == 1)
            .then_some(()))
        .is_some(),
        "the workload with a 16 KiB request id ran"
    );
}

#[test]
fn g11_a_queued_completion_with_a_wildcard_topic_is_set_aside_and_the_node_stays_connected() {
    let (_broker, cp, setup) = rig(MARKING);
    // What an older version queued for workload `a/#`: the broker would drop the connection
    // at every attempt, and the node would be deaf while saying "connected".
    let outbox = setup.config_dir().join("outbox");
    std::fs::create_dir_all(&outbox).unwrap();
    let planted = json!({"topic": "cyberwave/cloud-workload/a/#/update-status", "body": {"status": "completed"}, "label": "completion of a/#"});
    std::fs::write(
        outbox.join("00000000000000000001.json"),
        planted.to_string(),
    )
    .unwrap();
    let node = setup.spawn();
    node.wait_ready(READY);
    assert!(
        node.wait_log("invalid topic", REPLY),
        "the bad entry is named: {}",
        node.log()
    );
    let aside = setup.config_dir().join("quarantine");
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
        still_serving(&cp, &node, &format!("alive-{i}"));
    }
    let local = setup.run(&["status", "--json"]);
    let text = &local.stdout;
    assert!(
        text.contains("\"connected\": true") || text.contains("\"connected\":true"),
        "{text}"
    );
    assert!(!node.log().contains("connection lost"), "{}", node.log());
}

/// R7–R10, D20: `"workload_uuid": "None"` is what a Python sender writes for none, and `""`
/// says none too. A start that carries either names no workload: from its `running` status to
/// its end, nothing the node publishes goes to a `…/None/…` or `…//…` workload topic, and the
/// workload's environment names no workload.
#[test]
fn g5_a_start_whose_workload_uuid_is_the_text_none_names_no_workload() {
    let (_broker, cp, setup) =
        rig("cyberwave:\n  training: echo \"wl=[${CYBERWAVE_WORKLOAD_UUID-unset}]\"\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    for (rid, none) in [("nn", "None"), ("ne", "")] {
        let w =
            crate::support::scenario::Start::training(rid).params(json!({"workload_uuid": none}));
        assert_eq!(w.reply(&cp, &node)["status"], "ok");
        // The console tag is the request id then, as for a start without a workload uuid.
        assert!(
            node.wait_stdout(&format!("[workload {rid} stdout] wl=[unset]"), DONE),
            "{}",
            node.stdout()
        );
        let done = format!("training {rid} (pid");
        assert!(
            wait_for(DONE, || node
                .log()
                .lines()
                .any(|l| l.contains(&done) && l.contains("finished: success"))
                .then_some(()))
            .is_some(),
            "{}",
            node.log()
        );
    }
    still_serving(&cp, &node, "after-none");
    let topics: Vec<String> = cp
        .all_requests()
        .into_iter()
        .map(|r| r.topic)
        .filter(|t| t.contains("cloud-workload/None/") || t.contains("cloud-workload//"))
        .collect();
    assert!(topics.is_empty(), "published to {topics:?}");
}
