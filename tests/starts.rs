//! Starting workloads: a request id starts one workload once, however often it is delivered and
//! whatever its text (guarantee 1), within the node's capacity; starts run off the node's loop
//! (on the spawner thread), so `status` is answered while they are in flight, and a crash in the
//! middle of one neither loses nor repeats it. The slow disk that keeps starts in flight is
//! `CYBERWAVE_TEST_SLOW_FSYNC_MS` (`Scenario::slow_disk`).

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::scenario::{assert_host_busy, completion, error_of};
use crate::support::timeouts::REPLY;
use crate::support::{wait_for, Rig, Scenario, Start};

/// A node with 32 slots on a disk whose every sync takes `slow_ms`; its workloads note each run
/// in `t/<request id>.runs` ([`Rig::runs`]).
fn on_a_slow_disk(slow_ms: u64, manifest: &str) -> Scenario {
    Scenario::new(manifest)
        .slow_disk(slow_ms)
        .env("CYBERWAVE_MAX_CONCURRENT_WORKLOADS", "32")
        .env("RUST_LOG", "debug")
        .dir("t")
}

/// How many workloads ran (each leaves a file in `ran/`).
fn ran(rig: &Rig) -> usize {
    std::fs::read_dir(rig.work("ran")).map_or(0, |d| d.count())
}

/// The FNV-1a 32 hash `store::safe_id` appends to an id it changed.
fn fnv1a32(data: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in data {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

#[test]
fn g1_the_same_start_twice_spawns_once_and_capacity_is_enforced() {
    let rig = Scenario::new("cyberwave:\n  simulate: echo started >> starts.txt; sleep 3\n").rig();
    let node = rig.node();
    let first = Start::new("simulate", "dup").reply(&rig.cp, &node);
    rig.cp.command(
        &node.uuid(),
        json!({"command": "simulate", "request_id": "dup", "params": {"workload_uuid": "wl-dup"}}),
    );
    assert!(wait_for(REPLY, || (rig.cp.replies_for("dup").len() == 2)
        .then_some(()))
    .is_some());
    let replies = rig.cp.replies_for("dup");
    assert_eq!(
        replies[0], replies[1],
        "the redelivery gets the original answer"
    );
    assert_eq!(first["output"]["pid"], replies[1]["output"]["pid"]);
    // Two more at once: capacity 1 rejects both.
    for rid in ["busy-1", "busy-2"] {
        rig.cp.command(
            &node.uuid(),
            json!({"command": "simulate", "request_id": rid, "params": {"workload_uuid": rid}}),
        );
    }
    for rid in ["busy-1", "busy-2"] {
        let r = rig.cp.wait_reply(rid, REPLY).expect("reply");
        assert_eq!(r["status"], "error");
        let err = error_of(&r);
        assert!(
            err.starts_with("Controller host is busy with 1 active workload(s)"),
            "{err}"
        );
        let failed = rig.cp.wait_status(rid, "failed", REPLY).expect("R7 failed");
        assert_host_busy(&failed[0], "capacity");
        assert_eq!(failed[0]["rejecting_instance_uuid"], node.uuid());
    }
    std::thread::sleep(Duration::from_millis(500));
    let starts = std::fs::read_to_string(rig.work("starts.txt")).unwrap_or_default();
    assert_eq!(starts.lines().count(), 1, "spawned exactly once");
    let status = rig.cp.status(&node.uuid(), "st", REPLY).expect("status");
    assert_eq!(status["output"]["is_busy"], true);
    assert_eq!(
        status["output"]["active_workloads"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    // Once it is done, the same request id is still answered from the ledger, not run again.
    completion(&rig.cp, "wl-dup");
    rig.cp.command(
        &node.uuid(),
        json!({"command": "simulate", "request_id": "dup", "params": {}}),
    );
    assert!(wait_for(REPLY, || (rig.cp.replies_for("dup").len() == 3)
        .then_some(()))
    .is_some());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        std::fs::read_to_string(rig.work("starts.txt"))
            .unwrap_or_default()
            .lines()
            .count(),
        1
    );
}

/// D7: "two ids never share files". The id `x/y` maps to `x_y-<hash of x/y>`; the id that IS
/// that text is already safe and maps to itself. So the backend (or anyone who can send a
/// command) picks a request id that collides with a running workload's: the node answers the
/// second start with the FIRST workload's output (`ok`, its pid, `workload_request_id: x/y`)
/// and never runs the second workload — and, were the first gone, both would share
/// `workloads/<safe id>/` and `<results_folder>/<safe id>/`.
#[test]
fn g1_d7_a_request_id_equal_to_another_ids_safe_id_gets_its_own_workload() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  training: |\n    mkdir -p ran && touch \"ran/$$\"\n    while [ ! -f release ]; do sleep 0.05; done\ncloud_node:\n  max_concurrent_workloads: 2\n",
    )
    .node();
    let first = "x/y";
    let second = format!("x_y-{:08x}", fnv1a32(first.as_bytes()));
    Start::training(first).workload("wl-a").ok(&rig.cp, &node);
    let b = Start::training(&second)
        .workload("wl-b")
        .reply(&rig.cp, &node);
    rig.touch("release");
    assert_eq!(b["status"], "ok", "{b}");
    assert_eq!(
        b["output"]["workload_request_id"], second,
        "the second start was answered with another workload's output: {b}"
    );
    assert!(
        wait_for(REPLY, || (ran(&rig) == 2).then_some(())).is_some(),
        "the second workload never ran ({} ran); log:\n{}",
        ran(&rig),
        node.log()
    );
}

/// Guarantees 1 and 6: 20 starts sent at once (each delivered twice) on a slow disk each run
/// exactly once, and `status` is answered while starts are provably still in flight (its reply
/// comes before the last start's, and lists workloads still `starting`).
#[test]
fn g1_twenty_concurrent_starts_on_a_slow_disk_start_once_and_status_is_answered_meanwhile() {
    let (rig, node) = on_a_slow_disk(
        100,
        "cyberwave:\n  inference: echo $$ >> t/$CYBERWAVE_REQUEST_ID.runs; until [ -e t/stop ]; do sleep 0.1; done\n",
    )
    .node();
    let rids: Vec<String> = (0..20).map(|i| format!("c{i}")).collect();
    for rid in &rids {
        Start::new("inference", rid).send(&rig.cp, &node);
    }
    for rid in &rids {
        Start::new("inference", rid).send(&rig.cp, &node); // a QoS 1 redelivery while the first is in flight
    }
    let status = rig
        .cp
        .status(&node.uuid(), "st-during", Duration::from_secs(10))
        .expect("status not answered");
    let status_at = rig.cp.reply_time("st-during").unwrap();
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
            Some(rig.cp.replies_for(rid)).filter(|r| r.len() >= 2)
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
    let last_start = rids
        .iter()
        .filter_map(|r| rig.cp.reply_time(r))
        .max()
        .unwrap();
    assert!(
        status_at < last_start,
        "status was answered while starts were still in flight"
    );
    for rid in &rids {
        let n = wait_for(Duration::from_secs(10), || {
            Some(rig.runs(rid)).filter(|n| *n > 0)
        });
        assert_eq!(n, Some(1), "{rid} ran exactly once");
    }
    // All 20 are tracked as running now, none starting.
    let after = rig
        .cp
        .status(&node.uuid(), "st-after", Duration::from_secs(10))
        .unwrap();
    let listed = after["output"]["active_workloads"].as_array().unwrap();
    assert_eq!(listed.len(), 20, "{after}");
    assert!(listed.iter().all(|w| w["state"] == "running"), "{after}");
    for rid in &rids {
        assert_eq!(rig.runs(rid), 1, "{rid} still ran exactly once");
    }
    rig.touch("t/stop");
    for rid in &rids {
        assert!(
            rig.cp
                .wait_status(&format!("wl-{rid}"), "completed", Duration::from_secs(30))
                .is_some(),
            "{rid} completed"
        );
    }
}

/// Guarantees 1 and 2: the node is SIGKILLed while a start is in flight (the workload runs, its
/// record is not yet synced, the start not yet answered). The restarted node re-adopts the
/// workload; the redelivered start is answered from it and does not run it a second time; its
/// completion goes out once.
#[test]
fn g1_a_node_killed_during_a_start_neither_loses_nor_repeats_the_workload() {
    let mut rig = on_a_slow_disk(
        600,
        "cyberwave:\n  inference: echo $$ >> t/$CYBERWAVE_REQUEST_ID.runs; sleep 1\n",
    )
    .rig();
    let mut node = rig.node();
    Start::new("inference", "k1").send(&rig.cp, &node);
    wait_for(Duration::from_secs(10), || {
        Some(()).filter(|_| rig.runs("k1") == 1)
    })
    .expect("the workload did not run");
    assert!(
        rig.cp.replies_for("k1").is_empty(),
        "killed before the start was answered"
    );
    node.kill9();
    rig.setup.unset("CYBERWAVE_TEST_SLOW_FSYNC_MS");
    let node = rig.node();
    Start::new("inference", "k1").send(&rig.cp, &node); // the backend asks again: no answer came
    let reply = rig
        .cp
        .wait_reply("k1", Duration::from_secs(10))
        .expect("no reply");
    assert_eq!(reply["status"], "ok", "{reply}");
    assert!(reply["output"]["pid"].as_i64().unwrap_or(0) > 0, "{reply}");
    let all = rig
        .cp
        .wait_status("wl-k1", "completed", Duration::from_secs(20))
        .expect("no completion");
    let done: Vec<&Value> = all.iter().filter(|b| b["status"] == "completed").collect();
    assert_eq!(done.len(), 1, "{all:?}");
    assert_eq!(done[0]["success"], true, "{all:?}");
    assert_eq!(rig.runs("k1"), 1, "the workload ran exactly once");
}

/// A supervisor can end before the loop learned of its start (here the workload exits at once
/// while the spawner still syncs its record on a slow disk): the reaper thread is told of it
/// only once the loop tracks it, so the end is not lost, and the completion goes out once with
/// the real exit code.
#[test]
fn g3_a_supervisor_that_ends_before_its_start_is_reported_is_still_reported_once() {
    let (rig, node) = on_a_slow_disk(300, "cyberwave:\n  inference: exit 3\n").node();
    Start::new("inference", "quick").send(&rig.cp, &node);
    let reply = rig
        .cp
        .wait_reply("quick", Duration::from_secs(15))
        .expect("no reply");
    assert_eq!(reply["status"], "ok", "{reply}");
    let all = rig
        .cp
        .wait_status("wl-quick", "completed", Duration::from_secs(20))
        .expect("no completion");
    let done: Vec<&Value> = all.iter().filter(|b| b["status"] == "completed").collect();
    assert_eq!(done.len(), 1, "{all:?}");
    assert_eq!(done[0]["exit_code"], 3, "{all:?}");
    std::thread::sleep(Duration::from_millis(500));
    let again: Vec<Value> = rig
        .cp
        .statuses("wl-quick")
        .into_iter()
        .filter(|b| b["status"] == "completed")
        .collect();
    assert_eq!(again.len(), 1, "still exactly one completion");
}
