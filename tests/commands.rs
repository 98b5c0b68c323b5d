//! Commands as the node reads them: the envelope and params are typed at the edge (D8, D20,
//! D64), so a command that does not validate gets an error reply naming the field (and a
//! `failed` status for a start that names its workload), nothing is spawned, queued or
//! persisted for it, and the node keeps serving, also after a restart (guarantees 5 and 8).

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::scenario::completion;
use crate::support::scenario::error_of;
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{wait_for, ControlPlane, NodeProcess, Rig, Scenario, Start};

/// A manifest whose workloads leave a mark in `ran/` when they run at all.
const MARKING: &str =
    "cyberwave:\n  inference: mkdir -p ran && touch \"ran/$(date +%s%N)\"\n  training: mkdir -p ran && touch \"ran/$(date +%s%N)\"\n";

/// Sends a command that must be refused; returns the error its reply names.
fn refused(cp: &ControlPlane, node: &NodeProcess, body: Value) -> String {
    let r = cp.ask(node, body);
    assert_eq!(r["status"], "error", "{r}");
    error_of(&r).to_string()
}

/// How many workloads of [`MARKING`] ran.
fn ran(rig: &Rig) -> usize {
    std::fs::read_dir(rig.work("ran")).map_or(0, |d| d.count())
}

fn nothing_ran(rig: &Rig) {
    assert_eq!(ran(rig), 0, "a refused command spawned a workload");
}

fn still_serving(cp: &ControlPlane, node: &NodeProcess, rid: &str) {
    let s = cp
        .status(&node.uuid(), rid, REPLY)
        .expect("no status reply");
    assert_eq!(s["status"], "ok", "{s}");
}

/// The node has not exited.
fn assert_running(node: &mut NodeProcess, what: &str) {
    assert!(
        node.wait_exit(Duration::ZERO).is_none(),
        "the node died ({what}); log:\n{}",
        node.log()
    );
}

#[test]
fn g5_bad_commands_get_clear_errors_and_the_node_keeps_serving() {
    let (rig, node) = Scenario::default().node();
    let uuid = node.uuid();
    rig.cp.command_raw(&uuid, b"{not json".to_vec());
    rig.cp.command(&uuid, json!({"request_id": "no-command"}));
    rig.cp
        .command(&uuid, json!({"command": "reboot", "request_id": "unknown"}));
    rig.cp.command(
        &uuid,
        json!({"command": "training", "request_id": "bad-params", "params": [1, 2]}),
    );
    rig.cp
        .command(&uuid, json!({"status": "ok", "request_id": "echo"}));
    for (rid, needle) in [
        ("no-command", "no 'command' field"),
        ("unknown", "Unknown command: reboot"),
        ("bad-params", "params must be a JSON object"),
    ] {
        let r = rig
            .cp
            .wait_reply(rid, REPLY)
            .unwrap_or_else(|| panic!("no reply to {rid}"));
        assert_eq!(r["status"], "error", "{r}");
        assert!(error_of(&r).contains(needle), "{r}");
    }
    assert!(rig.cp.status(&uuid, "still-alive", REPLY).is_some());
    assert!(rig.cp.replies_for("echo").is_empty(), "echoes are ignored");
    node.assert_logged("not valid JSON");
}

#[test]
fn g5_params_that_are_not_an_object_spawn_nothing() {
    let (rig, node) = Scenario::new(MARKING).node();
    for (i, bad) in [json!(null), json!("x"), json!(7), json!([1, 2])]
        .into_iter()
        .enumerate()
    {
        let rid = format!("p{i}");
        let e = refused(
            &rig.cp,
            &node,
            json!({"command": "training", "request_id": rid, "params": bad}),
        );
        assert!(e.contains("params must be a JSON object"), "{e}");
    }
    let e = refused(
        &rig.cp,
        &node,
        json!({"command": "inference", "request_id": "absent"}),
    );
    assert!(e.contains("params"), "{e}");
    // workload_received: a null command_params is refused, and the named workload fails (D8).
    let e = refused(
        &rig.cp,
        &node,
        json!({"command": "workload_received", "request_id": "wr", "params": {"workload_uuid": "wl-wr", "command_type": "training", "command_params": null}}),
    );
    assert!(e.contains("params.command_params"), "{e}");
    assert!(rig.cp.wait_status("wl-wr", "failed", REPLY).is_some());
    still_serving(&rig.cp, &node, "alive");
    nothing_ran(&rig);
}

#[test]
fn g8_workload_uuids_with_topic_wildcards_are_refused_and_the_node_stays_connected() {
    let (rig, node) = Scenario::new(MARKING).node();
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
            &rig.cp,
            &node,
            json!({"command": "inference", "request_id": rid, "params": {"workload_uuid": bad}}),
        );
        assert!(e.contains("params.workload_uuid"), "{e}");
    }
    // Workflow ids reach ingress topics: the same rule.
    let e = refused(
        &rig.cp,
        &node,
        json!({"command": "inference", "request_id": "wf", "params": {"workflow_uuid": "w/#", "workflow_execution_uuid": "e", "workflow_node_uuid": "n"}}),
    );
    assert!(e.contains("params.workflow_uuid"), "{e}");
    still_serving(&rig.cp, &node, "alive");
    nothing_ran(&rig);
    assert!(!node.log().contains("connection lost"), "{}", node.log());
    let outbox = rig.state("outbox");
    let queued = std::fs::read_dir(&outbox).map(|d| d.count()).unwrap_or(0);
    assert_eq!(queued, 0, "nothing is queued for a refused command");
}

/// R7–R10, D20: `"workload_uuid": "None"` is what a Python sender writes for none, and `""`
/// says none too. A start that carries either names no workload: from its `running` status to
/// its end, nothing the node publishes goes to a `…/None/…` or `…//…` workload topic, and the
/// workload's environment names no workload.
#[test]
fn g5_a_start_whose_workload_uuid_is_the_text_none_names_no_workload() {
    let (rig, node) =
        Scenario::new("cyberwave:\n  training: echo \"wl=[${CYBERWAVE_WORKLOAD_UUID-unset}]\"\n")
            .node();
    for (rid, none) in [("nn", "None"), ("ne", "")] {
        Start::training(rid)
            .params(json!({"workload_uuid": none}))
            .ok(&rig.cp, &node);
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
    still_serving(&rig.cp, &node, "after-none");
    let topics: Vec<String> = rig
        .cp
        .all_requests()
        .into_iter()
        .map(|r| r.topic)
        .filter(|t| t.contains("cloud-workload/None/") || t.contains("cloud-workload//"))
        .collect();
    assert!(topics.is_empty(), "published to {topics:?}");
}

/// A NUL in `workload_uuid` would reach a topic, and paho's message builder panics on it
/// (`CString::new(topic).unwrap()`), killing the node; the completion in the outbox would then
/// carry the same topic. D20 refuses the id at the edge.
#[test]
fn a_nul_in_a_workload_uuid_is_refused_and_the_node_lives_and_restarts() {
    let (rig, mut node) = Scenario::new("cyberwave:\n  inference: 'true'\n").node();
    let uuid = node.uuid();
    rig.cp.command(
        &uuid,
        json!({"command": "inference", "request_id": "nul", "params": {"workload_uuid": "w\u{0}x"}}),
    );
    let reply = rig.cp.wait_reply("nul", REPLY);
    assert!(
        rig.cp.status(&uuid, "after-nul", REPLY).is_some(),
        "no status reply"
    );
    assert_running(&mut node, "after a NUL in workload_uuid");
    assert_eq!(
        reply.expect("a reply to the start")["status"],
        "error",
        "refused at the edge"
    );
    node.sigterm();
    assert!(node.wait_exit(REPLY).is_some(), "the node did not stop");
    let mut again = rig.node();
    assert!(rig.cp.status(&uuid, "after-restart", REPLY).is_some());
    assert_running(&mut again, "after a restart");
}

#[test]
fn g8_a_request_id_over_16_kib_is_refused_and_one_at_the_limit_runs() {
    let (rig, node) = Scenario::new(MARKING).node();
    let long = "r".repeat(16 * 1024 + 1);
    let e = refused(
        &rig.cp,
        &node,
        json!({"command": "inference", "request_id": long, "params": {}}),
    );
    assert!(e.contains("request_id"), "{e}");
    assert!(e.contains("16384"), "the reply names the limit: {e}");
    nothing_ran(&rig);
    // The node's log shows a cut id, never 16 KiB of it.
    assert!(
        node.log().lines().all(|l| l.len() < 4096),
        "a log line carries the whole id"
    );
    let at_limit = "s".repeat(16 * 1024);
    rig.cp.command(
        &node.uuid(),
        json!({"command": "inference", "request_id": at_limit, "params": {}}),
    );
    let r = rig.cp.wait_reply(&at_limit, REPLY).expect("reply");
    assert_eq!(r["status"], "ok", "{r}; log:\n{}", node.log());
    assert!(
        wait_for(REPLY, || (ran(&rig) == 1).then_some(())).is_some(),
        "the workload with a 16 KiB request id ran"
    );
}

#[test]
fn g8_a_runtime_limit_of_1e19_seconds_is_refused_and_cannot_crash_loop_the_node() {
    let (rig, mut node) = Scenario::new(MARKING).node();
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
            &rig.cp,
            &node,
            json!({"command": "inference", "request_id": rid, "params": {"workload_uuid": format!("w{i}"), "max_runtime_seconds": bad}}),
        );
        assert!(e.contains("params.max_runtime_seconds"), "{e}");
        assert!(e.contains("30 days"), "the reply names the range: {e}");
        // The backend named the workload: it hears that it failed, and why.
        let wl = format!("w{i}");
        assert!(
            rig.cp.wait_status(&wl, "failed", REPLY).is_some(),
            "{:?}",
            rig.cp.statuses(&wl)
        );
    }
    still_serving(&rig.cp, &node, "alive-1");
    nothing_ran(&rig);
    // Nothing was persisted for it: a restart comes up and serves.
    node.kill9();
    let node = rig.node();
    still_serving(&rig.cp, &node, "alive-2");
    assert!(!node.log().contains("panicked"), "{}", node.log());
}

#[test]
fn g8_a_huge_max_runtime_neither_kills_the_node_nor_makes_it_crash_loop() {
    // A manifest limit past 30 days is a configuration error (exit 2, naming the key), never
    // a panic; the command's own huge limit is refused at the edge.
    let rig =
        Scenario::new("cyberwave:\n  training: sleep 30\n  max_runtime_seconds: 1e300\n").rig();
    let Rig { cp, setup, .. } = &rig;
    let out = setup.run(&["start"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("max_runtime_seconds"), "{out:?}");
    assert!(!out.stderr.contains("panicked"), "{out:?}");
    setup.write("cyberwave.yml", "cyberwave:\n  training: sleep 30\n");
    let mut node = rig.node();
    let uuid = node.uuid();
    cp.command(
        &uuid,
        json!({"command": "training", "request_id": "huge", "params": {"workload_uuid": "wl-huge", "max_runtime_seconds": 1e19}}),
    );
    // Accepted or refused (a range check may refuse it): either way an answer, and a live node.
    assert!(
        cp.wait_reply("huge", REPLY).is_some(),
        "no reply; log:\n{}",
        node.log()
    );
    assert!(
        cp.status(&uuid, "st-1", REPLY).is_some(),
        "the node stopped answering; log:\n{}",
        node.log()
    );
    // Recovery rebuilds the deadline from the record on disk: the restarted node must live too.
    node.kill9();
    let mut node = rig.node();
    assert!(
        cp.status(&uuid, "st-2", REPLY).is_some(),
        "the restarted node stopped answering; log:\n{}",
        node.log()
    );
    assert_eq!(
        node.wait_exit(Duration::from_millis(200)),
        None,
        "{}",
        node.log()
    );
    assert!(!node.log().contains("panicked"), "{}", node.log());
    cp.command(
        &uuid,
        json!({"command": "cancel", "request_id": "c-huge", "params": {"workload_request_id": "huge", "grace_seconds": 1}}),
    );
    let _ = cp.wait_reply("c-huge", REPLY);
    node.sigterm();
    assert!(wait_for(READY, || node.wait_exit(Duration::ZERO)).is_some());
}

/// D64: a command refused before its params are read (nested deeper than serde_json goes, cut
/// short, over `CYBERWAVE_NODE_MAX_COMMAND_BYTES`) still gets its error reply, and a `failed`
/// status when it is a start that names its workload: the backend never waits for its own
/// timeout. What cannot be read soundly gets nothing.
#[test]
fn g5_d64_a_command_refused_before_its_params_are_read_gets_its_reply_and_a_failed_status() {
    let (rig, node) = Scenario::new("cyberwave:\n  inference: 'true'\n")
        .env("CYBERWAVE_NODE_MAX_COMMAND_BYTES", "1048576")
        .node();
    let uuid = node.uuid();
    let deep = format!(
        r#"{{"command":"inference","request_id":"deep","params":{{"workload_uuid":"wl-deep","x":{}{}}}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    rig.cp.command_raw(&uuid, deep.into_bytes());
    rig.cp.command_raw(
        &uuid,
        br#"{"request_id":"cut","command":"training","params":{"workload_uuid":"wl-cut","x":[1,"#
            .to_vec(),
    );
    let big = format!(
        r#"{{"request_id":"big","command":"simulate","params":{{"workload_uuid":"wl-big","image_bytes_base64":"{}"}}}}"#,
        "A".repeat(2 << 20)
    );
    rig.cp.command_raw(&uuid, big.into_bytes());
    // A cancel names a workload to act on, not one that failed: a reply, no status.
    let cancel = format!(
        r#"{{"command":"cancel","request_id":"deep-cancel","params":{{"workload_uuid":"wl-other","x":{}{}}}}}"#,
        "{\"a\":".repeat(200),
        "}".repeat(200)
    );
    rig.cp.command_raw(&uuid, cancel.into_bytes());
    // Read twice: which one is meant? No reply.
    rig.cp.command_raw(
        &uuid,
        br#"{"request_id":"twice","request_id":"twice","command":"inference","params":{"workload_uuid":"wl-twice","#
            .to_vec(),
    );
    for (rid, wl, needle) in [
        ("deep", Some("wl-deep"), "recursion limit"),
        ("cut", Some("wl-cut"), "not valid JSON"),
        ("big", Some("wl-big"), "the limit is 1048576"),
        ("deep-cancel", None, "recursion limit"),
    ] {
        let r = rig
            .cp
            .wait_reply(rid, REPLY)
            .unwrap_or_else(|| panic!("no reply to {rid}; log:\n{}", node.log()));
        assert_eq!(r["status"], "error", "{r}");
        assert!(error_of(&r).contains(needle), "{r}");
        if let Some(wl) = wl {
            let st = rig
                .cp
                .wait_status(wl, "failed", REPLY)
                .unwrap_or_else(|| panic!("no failed status for {wl}; log:\n{}", node.log()));
            let last = st.last().cloned().unwrap_or_default();
            assert!(error_of(&last).contains(needle), "{last}");
        }
    }
    assert!(
        rig.cp.statuses("wl-other").is_empty(),
        "a cancel fails nothing"
    );
    assert!(rig.cp.status(&uuid, "still-alive", REPLY).is_some());
    assert!(rig.cp.replies_for("twice").is_empty());
    assert!(rig.cp.statuses("wl-twice").is_empty());
}

/// Long enough for tens of MiB through the broker and a debug build's JSON parser.
const DONE_BIG: Duration = Duration::from_secs(60);

/// D64: a preview sends its image inline; a command of up to 32 MiB (the default limit) goes
/// through the broker and the node's client and runs; one over it is refused with its reply
/// and a `failed` status.
#[test]
fn g5_d64_a_start_of_31_mib_runs_and_one_of_33_mib_gets_its_reply_and_a_failed_status() {
    let (rig, node) = Scenario::new("cyberwave:\n  inference: 'true'\n").node();
    let uuid = node.uuid();
    let start = |rid: &str, wl: &str, mib: usize| {
        format!(
            r#"{{"request_id":"{rid}","command":"inference","params":{{"workload_uuid":"{wl}","image_bytes_base64":"{}"}}}}"#,
            "QUFB".repeat(mib << 18)
        )
        .into_bytes()
    };
    rig.cp.command_raw(&uuid, start("inline", "wl-inline", 31));
    let r = rig
        .cp
        .wait_reply("inline", DONE_BIG)
        .expect("a reply to the 31 MiB start");
    assert_eq!(r["status"], "ok", "{r}");
    assert!(rig
        .cp
        .wait_status("wl-inline", "completed", DONE_BIG)
        .is_some());
    rig.cp.command_raw(&uuid, start("over", "wl-over", 33));
    let r = rig
        .cp
        .wait_reply("over", DONE_BIG)
        .expect("a reply to the 33 MiB start");
    assert_eq!(r["status"], "error", "{r}");
    assert!(error_of(&r).contains("limit"), "{r}");
    assert!(rig.cp.wait_status("wl-over", "failed", REPLY).is_some());
    assert!(rig.cp.status(&uuid, "still-alive", REPLY).is_some());
}

#[test]
fn workload_received_dispatches_a_start() {
    let rig = Scenario::new("cyberwave:\n  simulate: cp {body} wr.json\n").rig();
    let node = rig.node();
    rig.cp.command(
        &node.uuid(),
        json!({"command": "workload_received", "request_id": "wr", "params": {"workload_uuid": "wl-wr", "command_type": "simulate", "command_params": {"scene": 1}}}),
    );
    assert_eq!(
        rig.cp.wait_reply("wr", REPLY).expect("reply")["status"],
        "ok"
    );
    completion(&rig.cp, "wl-wr");
    let got: Value =
        serde_json::from_str(&std::fs::read_to_string(rig.work("wr.json")).unwrap_or_default())
            .unwrap_or_default();
    assert_eq!(got, json!({"scene": 1, "workload_uuid": "wl-wr"}));
    rig.cp.command(&node.uuid(), json!({"command": "workload_received", "request_id": "wr2", "params": {"workload_uuid": "wl-x", "command_type": "other"}}));
    let r = rig.cp.wait_reply("wr2", REPLY).expect("reply");
    assert_eq!(
        r["output"]["message"],
        "Workload wl-x received and acknowledged"
    );
}
