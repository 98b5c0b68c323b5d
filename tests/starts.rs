//! Starts off the loop (issue 15, item 2): the spawner thread starts workloads and reports back;
//! the loop answers `status` meanwhile. The slow disk is simulated with
//! `CYBERWAVE_TEST_SLOW_FSYNC_MS` (every fsync of the node's state sleeps first; honoured by every build;
//! each test proves it is on from the node's start-up WARN, in debug and release builds alike).

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::node::NodeSetup;
use crate::support::scenario::Start;
use crate::support::timeouts::READY;
use crate::support::{wait_for, Broker, ControlPlane};

fn rig(slow_ms: u64, manifest: &str) -> (Broker, ControlPlane, NodeSetup) {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_MAX_CONCURRENT_WORKLOADS", "32");
    setup.set("CYBERWAVE_TEST_SLOW_FSYNC_MS", &slow_ms.to_string());
    setup.set("RUST_LOG", "debug");
    setup.write("cyberwave.yml", manifest);
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    (broker, cp, setup)
}

fn runs(setup: &NodeSetup, rid: &str) -> usize {
    std::fs::read_to_string(setup.cwd.join(format!("t/{rid}.runs")))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// Guarantees 1 and 6: 20 starts sent at once (each delivered twice) on a slow disk each run
/// exactly once, and `status` is answered while starts are provably still in flight (its reply
/// comes before the last start's, and lists workloads still `starting`).
#[test]
fn g1_twenty_concurrent_starts_on_a_slow_disk_start_once_and_status_is_answered_meanwhile() {
    let (_broker, cp, setup) = rig(
        100,
        "cyberwave:\n  inference: echo $$ >> t/$CYBERWAVE_REQUEST_ID.runs; until [ -e t/stop ]; do sleep 0.1; done\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let rids: Vec<String> = (0..20).map(|i| format!("c{i}")).collect();
    for rid in &rids {
        Start::new("inference", rid).send(&cp, &node);
    }
    for rid in &rids {
        Start::new("inference", rid).send(&cp, &node); // a QoS 1 redelivery while the first is in flight
    }
    let status = cp
        .status(&node.uuid(), "st-during", Duration::from_secs(10))
        .unwrap_or_else(|| panic!("status not answered; log:\n{}", node.log()));
    let status_at = cp.reply_time("st-during").unwrap();
    let listed = status["output"]["active_workloads"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let starting = listed.iter().filter(|w| w["state"] == "starting").count();
    assert!(starting > 0, "status lists the starts in flight: {status}");
    for w in &listed {
        assert!(
            rids.iter().any(|r| w["request_id"] == json!(r)),
            "only the workloads started here: {w}"
        );
    }
    assert_eq!(status["output"]["is_busy"], false, "20 of 32: {status}");

    // Every start is answered: both deliveries, with the same pid; each workload ran once.
    for rid in &rids {
        let replies = wait_for(Duration::from_secs(60), || {
            Some(cp.replies_for(rid)).filter(|r| r.len() >= 2)
        })
        .unwrap_or_else(|| panic!("{rid} not answered twice; log:\n{}", node.log()));
        assert_eq!(replies.len(), 2, "{rid}: {replies:?}");
        let pids: Vec<&Value> = replies.iter().map(|r| &r["output"]["pid"]).collect();
        assert!(
            replies.iter().all(|r| r["status"] == "ok"),
            "{rid}: {replies:?}"
        );
        assert_eq!(pids[0], pids[1], "{rid}: the same answer twice");
        assert!(pids[0].as_i64().unwrap_or(0) > 0, "{rid}: {replies:?}");
    }
    let last_start = rids.iter().filter_map(|r| cp.reply_time(r)).max().unwrap();
    assert!(
        status_at < last_start,
        "status was answered while starts were still in flight"
    );
    for rid in &rids {
        let n = wait_for(Duration::from_secs(10), || {
            Some(runs(&setup, rid)).filter(|n| *n > 0)
        });
        assert_eq!(n, Some(1), "{rid} ran exactly once");
    }
    // All 20 are tracked as running now, none starting.
    let after = cp
        .status(&node.uuid(), "st-after", Duration::from_secs(10))
        .unwrap();
    let listed = after["output"]["active_workloads"].as_array().unwrap();
    assert_eq!(listed.len(), 20, "{after}");
    assert!(listed.iter().all(|w| w["state"] == "running"), "{after}");
    for rid in &rids {
        assert_eq!(runs(&setup, rid), 1, "{rid} still ran exactly once");
    }
    std::fs::write(setup.cwd.join("t/stop"), "").unwrap();
    for rid in &rids {
        assert!(
            cp.wait_status(&format!("wl-{rid}"), "completed", Duration::from_secs(30))
                .is_some(),
            "{rid} completed"
        );
    }
}

/// A supervisor can end before the loop learned of its start (here the workload exits at once
/// while the spawner still syncs its record on a slow disk): the reaper thread is told of it
/// only once the loop tracks it, so the end is not lost, and the completion goes out once with
/// the real exit code.
#[test]
fn g3_a_supervisor_that_ends_before_its_start_is_reported_is_still_reported_once() {
    let (_broker, cp, setup) = rig(300, "cyberwave:\n  inference: exit 3\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::new("inference", "quick").send(&cp, &node);
    let reply = cp
        .wait_reply("quick", Duration::from_secs(15))
        .unwrap_or_else(|| panic!("no reply; log:\n{}", node.log()));
    assert_eq!(reply["status"], "ok", "{reply}");
    let all = cp
        .wait_status("wl-quick", "completed", Duration::from_secs(20))
        .unwrap_or_else(|| panic!("no completion; log:\n{}", node.log()));
    let done: Vec<&Value> = all.iter().filter(|b| b["status"] == "completed").collect();
    assert_eq!(done.len(), 1, "{all:?}");
    assert_eq!(done[0]["exit_code"], 3, "{all:?}");
    std::thread::sleep(Duration::from_millis(500));
    let again: Vec<Value> = cp
        .statuses("wl-quick")
        .into_iter()
        .filter(|b| b["status"] == "completed")
        .collect();
    assert_eq!(again.len(), 1, "still exactly one completion");
}

/// Guarantees 1 and 2: the node is SIGKILLed while a start is in flight (the workload runs, its
/// record is not yet synced, the start not yet answered). The restarted node re-adopts the
/// workload; the redelivered start is answered from it and does not run it a second time; its
/// completion goes out once.
#[test]
fn g1_a_node_killed_during_a_start_neither_loses_nor_repeats_the_workload() {
    let (_broker, cp, mut setup) = rig(
        600,
        "cyberwave:\n  inference: echo $$ >> t/$CYBERWAVE_REQUEST_ID.runs; sleep 1\n",
    );
    let mut node = setup.spawn();
    node.wait_ready(READY);
    Start::new("inference", "k1").send(&cp, &node);
    wait_for(Duration::from_secs(10), || {
        Some(()).filter(|_| runs(&setup, "k1") == 1)
    })
    .unwrap_or_else(|| panic!("the workload did not run; log:\n{}", node.log()));
    assert!(
        cp.replies_for("k1").is_empty(),
        "killed before the start was answered"
    );
    node.kill9();
    setup.unset("CYBERWAVE_TEST_SLOW_FSYNC_MS");
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::new("inference", "k1").send(&cp, &node); // the backend asks again: no answer came
    let reply = cp
        .wait_reply("k1", Duration::from_secs(10))
        .unwrap_or_else(|| panic!("no reply; log:\n{}", node.log()));
    assert_eq!(reply["status"], "ok", "{reply}");
    assert!(reply["output"]["pid"].as_i64().unwrap_or(0) > 0, "{reply}");
    let all = cp
        .wait_status("wl-k1", "completed", Duration::from_secs(20))
        .unwrap_or_else(|| panic!("no completion; log:\n{}", node.log()));
    let done: Vec<&Value> = all.iter().filter(|b| b["status"] == "completed").collect();
    assert_eq!(done.len(), 1, "{all:?}");
    assert_eq!(done[0]["success"], true, "{all:?}");
    assert_eq!(runs(&setup, "k1"), 1, "the workload ran exactly once");
}

/// A shutdown while a start is in flight: the node waits for it, answers it and names the
/// workload it leaves running (guarantee 2), then exits cleanly.
#[test]
fn g2_a_start_in_flight_at_shutdown_is_answered_before_the_node_exits() {
    let (_broker, cp, setup) = rig(
        700,
        "cyberwave:\n  inference: echo $$ >> t/$CYBERWAVE_REQUEST_ID.runs; sleep 5\n",
    );
    let mut node = setup.spawn();
    node.wait_ready(READY);
    Start::new("inference", "late").send(&cp, &node);
    wait_for(Duration::from_secs(10), || {
        Some(()).filter(|_| runs(&setup, "late") == 1)
    })
    .unwrap_or_else(|| panic!("the workload did not run; log:\n{}", node.log()));
    assert!(cp.replies_for("late").is_empty(), "still in flight");
    node.sigterm();
    let code = node.wait_exit(Duration::from_secs(30));
    assert_eq!(code, Some(Some(0)), "log:\n{}", node.log());
    let replies = cp.replies_for("late");
    assert_eq!(replies.len(), 1, "answered once: {replies:?}");
    assert_eq!(replies[0]["status"], "ok", "{replies:?}");
    let pid = replies[0]["output"]["pid"].as_i64().unwrap_or(0);
    assert!(pid > 0, "{replies:?}");
    assert!(
        node.log()
            .contains(&format!("left running: inference late pid {pid}")),
        "log:\n{}",
        node.log()
    );
}

/// A cancel that comes while its workload is starting is answered at once and carried out as
/// soon as the workload runs: the workload gets the signal and is reported cancelled, once.
#[test]
fn g9_a_cancel_while_starting_is_answered_at_once_and_carried_out_when_the_workload_runs() {
    let (_broker, cp, setup) = rig(
        500,
        "cyberwave:\n  inference: echo $$ >> t/$CYBERWAVE_REQUEST_ID.runs; trap 'echo term >> t/$CYBERWAVE_REQUEST_ID.runs; exit 143' TERM; sleep 30 & wait\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::new("inference", "early").send(&cp, &node);
    cp.command(
        &node.uuid(),
        json!({"command": "cancel", "request_id": "cx", "params": {"workload_request_id": "early"}}),
    );
    let answer = cp
        .wait_reply("cx", Duration::from_secs(5))
        .unwrap_or_else(|| panic!("cancel not answered; log:\n{}", node.log()));
    assert_eq!(answer["status"], "ok", "{answer}");
    assert_eq!(answer["output"]["state"], "starting", "{answer}");
    assert!(
        cp.replies_for("early").is_empty(),
        "answered while the start was still in flight"
    );
    let all = cp
        .wait_status("wl-early", "cancelled", Duration::from_secs(30))
        .unwrap_or_else(|| panic!("not cancelled; log:\n{}", node.log()));
    assert_eq!(
        all.iter().filter(|b| b["status"] == "cancelled").count(),
        1,
        "{all:?}"
    );
    let start = cp.replies_for("early");
    assert_eq!(start.len(), 1, "{start:?}");
    assert_eq!(start[0]["status"], "ok", "{start:?}");
    let lines = std::fs::read_to_string(setup.cwd.join("t/early.runs")).unwrap();
    assert_eq!(
        lines.lines().count(),
        2,
        "ran once and got SIGTERM: {lines}"
    );
    assert!(lines.ends_with("term\n"), "{lines}");
}

/// A workload runs before its start is reported: an `emit` it sends meanwhile waits for the
/// report and is then accepted (its token is the workload's own), not refused as unknown.
#[test]
fn g10_an_emit_from_a_workload_whose_start_is_not_reported_yet_is_accepted() {
    let (_broker, cp, setup) = rig(
        500,
        "cyberwave:\n  inference: |\n    \"$CYBERWAVE_NODE_BIN\" emit started --workflow wf-s > t/emit.out 2>&1; echo \"rc=$?\" >> t/emit.out\n    sleep 1\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::new("inference", "em").send(&cp, &node);
    let reply = cp
        .wait_reply("em", Duration::from_secs(15))
        .unwrap_or_else(|| panic!("no reply; log:\n{}", node.log()));
    assert_eq!(reply["status"], "ok", "{reply}");
    let out = wait_for(Duration::from_secs(15), || {
        std::fs::read_to_string(setup.cwd.join("t/emit.out"))
            .ok()
            .filter(|s| s.contains("rc="))
    })
    .unwrap_or_else(|| panic!("emit did not finish; log:\n{}", node.log()));
    assert!(
        out.contains("rc=0"),
        "emit accepted: {out}\nlog:\n{}",
        node.log()
    );
    let events = wait_for(Duration::from_secs(15), || {
        Some(cp.requests("ingress")).filter(|r| r.iter().any(|r| r.id == "wf-s/execution/started"))
    });
    assert!(events.is_some(), "the event was sent");
}

/// Guarantee 10: starts in flight hold their GPUs. Four starts at once on a slow disk on a node
/// with four GPUs (one each) get four different GPUs, although none was reported yet when the
/// next was accepted.
#[test]
fn g10_starts_in_flight_hold_their_gpus() {
    let (_broker, cp, mut setup) = rig(
        300,
        "cyberwave:\n  max_concurrent_workloads: 4\n  inference: |\n    echo \"$CUDA_VISIBLE_DEVICES\" > t/$CYBERWAVE_REQUEST_ID.gpu\n    sleep 2\n",
    );
    // The fake nvidia-smi of tests/fixtures, answering with four A100s.
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let smi = crate::support::TempDir::new("smi");
    std::fs::create_dir_all(smi.join("bin")).unwrap();
    std::os::unix::fs::symlink(fixtures.join("nvidia-smi"), smi.join("bin/nvidia-smi")).unwrap();
    std::fs::copy(fixtures.join("gpu/four-a100.csv"), smi.join("query.csv")).unwrap();
    let path = format!(
        "{}:{}",
        smi.join("bin").display(),
        std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into())
    );
    setup.set("PATH", &path);
    setup.set("FAKE_NVIDIA_SMI_DIR", &smi.path().display().to_string());
    let node = setup.spawn();
    node.wait_ready(READY);
    let rids = ["g0", "g1", "g2", "g3"];
    for rid in rids {
        Start::new("inference", rid).send(&cp, &node);
    }
    let mut seen = std::collections::BTreeSet::new();
    for rid in rids {
        let reply = cp
            .wait_reply(rid, Duration::from_secs(20))
            .unwrap_or_else(|| panic!("no reply to {rid}; log:\n{}", node.log()));
        assert_eq!(reply["status"], "ok", "{reply}");
        let gpu = wait_for(Duration::from_secs(10), || {
            std::fs::read_to_string(setup.cwd.join(format!("t/{rid}.gpu")))
                .ok()
                .filter(|g| !g.trim().is_empty())
        })
        .unwrap_or_else(|| panic!("{rid} saw no GPU; log:\n{}", node.log()));
        assert!(
            seen.insert(gpu.trim().to_string()),
            "{rid} got a GPU another start holds: {gpu} (all: {seen:?})"
        );
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
}
