//! A workload's end reaches the backend exactly once, with its real outcome (exit code,
//! signal, stderr tail): after the processes it left behind are ended (D25), across a broker
//! outage, a kill -9 or a restart of the node before the backend acknowledged it, and a full
//! disk (guarantees 2, 3 and 9).

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::disk::Tmpfs;
use crate::support::scenario::completion;
use crate::support::timeouts::{DONE, REPLY};
use crate::support::{procs, wait_for, Scenario, Start};

#[test]
fn completions_carry_the_real_exit_code() {
    let rig = Scenario::new("cyberwave:\n  training: |\n    mode=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[\"mode\"])' {body})\n    case $mode in\n      ok) echo fine ;;\n      three) echo 'it broke badly' >&2; exit 3 ;;\n      signal) kill -KILL $$ ;;\n      fast) exit 0 ;;\n    esac\n  max_concurrent_workloads: 4\n").rig();
    let node = rig.node();
    for (mode, wl) in [
        ("ok", "wl-ok"),
        ("three", "wl-three"),
        ("signal", "wl-signal"),
        ("fast", "wl-fast"),
    ] {
        let r = Start::new("training", &format!("r-{mode}"))
            .params(json!({"workload_uuid": wl, "mode": mode}))
            .reply(&rig.cp, &node);
        assert_eq!(r["status"], "ok", "{r}");
        assert!(r["output"]["pid"].as_i64().unwrap_or(0) > 0, "{r}");
        assert_eq!(r["output"]["workload_request_id"], format!("r-{mode}"));
    }
    let ok = completion(&rig.cp, "wl-ok");
    assert_eq!(
        ok,
        json!({"status": "completed", "success": true, "exit_code": 0})
    );
    let three = completion(&rig.cp, "wl-three");
    assert_eq!(three["success"], false);
    assert_eq!(three["exit_code"], 3);
    assert_eq!(three["error"], "it broke badly");
    assert_eq!(three["stderr"], "it broke badly");
    let sig = completion(&rig.cp, "wl-signal");
    assert_eq!(sig["success"], false);
    assert_eq!(sig["exit_code"], -9, "killed by signal 9: {sig}");
    let fast = completion(&rig.cp, "wl-fast");
    assert_eq!(fast["exit_code"], 0);
    assert_eq!(fast["success"], true);
    // R7 running came first, with the workload's pid.
    let all = rig.cp.statuses("wl-ok");
    assert_eq!(all[0]["status"], "running");
    assert!(all[0]["pid"].as_i64().unwrap_or(0) > 0);
}

#[test]
fn g2_workloads_survive_kill_9_of_the_node_and_are_reported_once_after_restart() {
    let rig = Scenario::new("cyberwave:\n  training: |\n    n=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[\"n\"])' {body})\n    while [ ! -f release-$n ]; do sleep 0.05; done\n    exit $n\n  max_concurrent_workloads: 3\n").rig();
    let mut node = rig.node();
    let mut pids = Vec::new();
    for n in 1..=3 {
        let r = Start::new("training", &format!("k{n}"))
            .params(json!({"workload_uuid": format!("wl-k{n}"), "n": n}))
            .reply(&rig.cp, &node);
        pids.push(r["output"]["pid"].as_i64().unwrap_or(0));
    }
    node.kill9();
    std::thread::sleep(Duration::from_millis(300));
    for p in &pids {
        assert!(procs::exists(*p), "workload {p} died with the node");
    }
    // One ends while the node is down.
    std::fs::write(rig.work("release-1"), "").expect("release");
    assert!(wait_for(REPLY, || (!procs::exists(pids[0])).then_some(())).is_some());
    let node = rig.node();
    node.assert_logged("re-adopted running workload k2");
    // k1's supervisor may still be writing its exit record as the node comes up (it first
    // clears what is left of the group): the node learns of it within its next check.
    let mut st = Value::Null;
    let mut n = 0;
    let listed = wait_for(REPLY, || {
        n += 1;
        st = rig.cp.status(&node.uuid(), &format!("st-{n}"), REPLY)?;
        let listed: Vec<i64> = st["output"]["active_workloads"]
            .as_array()
            .map(|a| a.iter().filter_map(|w| w["pid"].as_i64()).collect())
            .unwrap_or_default();
        (listed.len() == 2).then_some(listed)
    });
    assert!(listed.is_some(), "{st}");
    assert_eq!(
        completion(&rig.cp, "wl-k1")["exit_code"],
        1,
        "ended while the node was down"
    );
    std::fs::write(rig.work("release-2"), "").expect("release");
    assert_eq!(completion(&rig.cp, "wl-k2")["exit_code"], 2);
    // Cancel works on an adopted workload.
    rig.cp.command(&node.uuid(), json!({"command": "cancel", "request_id": "ck3", "params": {"workload_request_id": "k3", "grace_seconds": 1}}));
    assert_eq!(
        rig.cp.wait_reply("ck3", REPLY).expect("reply")["status"],
        "ok"
    );
    assert!(
        rig.cp.wait_status("wl-k3", "failed", DONE).is_some(),
        "{}",
        node.log()
    );
    std::thread::sleep(Duration::from_millis(500));
    for wl in ["wl-k1", "wl-k2", "wl-k3"] {
        let terminal = rig
            .cp
            .statuses(wl)
            .into_iter()
            .filter(|b| b["status"] != "running")
            .count();
        assert_eq!(terminal, 1, "{wl}: {:?}", rig.cp.statuses(wl));
    }
}

#[test]
fn g3_a_completion_during_a_broker_outage_arrives_once_afterwards() {
    let mut rig =
        Scenario::new("cyberwave:\n  inference: while [ ! -f go ]; do sleep 0.05; done; exit 4\n")
            .rig();
    let node = rig.node();
    Start::new("inference", "out-1")
        .workload("wl-outage")
        .reply(&rig.cp, &node);
    rig.broker.stop();
    rig.touch("go");
    assert!(
        node.wait_log("finished: failure, exit code 4", DONE),
        "{}",
        node.log()
    );
    std::thread::sleep(Duration::from_secs(1));
    rig.broker.restart();
    let done = completion(&rig.cp, "wl-outage");
    assert_eq!(done["exit_code"], 4);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        rig.cp
            .statuses("wl-outage")
            .iter()
            .filter(|b| b["status"] == "completed")
            .count(),
        1
    );
}

#[test]
fn g3_completion_survives_a_node_restart_before_acknowledgement() {
    let rig = Scenario::new("cyberwave:\n  inference: exit 5\n").rig();
    let mut node = rig.node();
    rig.cp.set_behaviour(|b| b.mute = true);
    // The command's reply still flows.
    Start::new("inference", "mr")
        .workload("wl-restart")
        .ok(&rig.cp, &node);
    assert!(
        node.wait_log("finished: failure, exit code 5", DONE),
        "{}",
        node.log()
    );
    node.kill9();
    let before = rig.cp.statuses("wl-restart").len();
    rig.cp.set_behaviour(|b| b.mute = false);
    let _node = rig.node();
    // Sent again from the outbox (or, if the kill came before it was queued, from the exit record).
    // An unacknowledged earlier one may have reached the backend too: a repeat is allowed, a
    // loss is not.
    let again = wait_for(DONE, || {
        rig.cp
            .statuses("wl-restart")
            .into_iter()
            .skip(before)
            .find(|b| b["status"] == "completed")
    })
    .unwrap_or_else(|| {
        panic!(
            "no completion after the restart: {:?}",
            rig.cp.statuses("wl-restart")
        )
    });
    assert_eq!(again["exit_code"], 5);
    std::thread::sleep(Duration::from_millis(500));
    let all = rig.cp.statuses("wl-restart");
    assert!(
        all.iter()
            .all(|b| b["status"] != "completed" || b["exit_code"] == 5),
        "never reported as lost: {all:?}"
    );
}

#[test]
fn g9_processes_a_workload_leaves_behind_are_ended_before_it_is_reported() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  training: |\n    for i in $(seq 1 20); do sleep 40 & echo $! >> kids; done\n    (trap '' TERM; exec sleep 40) & echo $! >> kids\n    exit 0\n",
    )
    .env("CYBERWAVE_NODE_CLEANUP_GRACE_SECONDS", "1")
    .node();
    Start::training("lb").ok(&rig.cp, &node);
    let done = completion(&rig.cp, "wl-lb");
    assert_eq!(done["success"], true, "{done}");
    let kids: Vec<u32> = std::fs::read_to_string(rig.work("kids"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert_eq!(kids.len(), 21, "{kids:?}");
    let left: Vec<u32> = kids.into_iter().filter(|p| procs::alive(*p)).collect();
    assert!(left.is_empty(), "left running after the report: {left:?}");
    let st = rig.cp.status(&node.uuid(), "idle", REPLY).expect("status");
    assert_eq!(st["output"]["is_busy"], false, "{st}");
}

#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g3_a_completion_survives_a_full_disk_and_goes_out_when_space_returns() {
    crate::support::assert_root("to mount a small tmpfs");
    let rig = Scenario::new(
        "cyberwave:\n  training: head -c 3000000 /dev/zero | tr '\\0' x; echo; exit 7\n",
    )
    .env("CYBERWAVE_MIN_FREE_DISK_MB", "0")
    .rig();
    let _disk = Tmpfs::on_state_dir(&rig.setup, "size=2m,mode=0700");
    let node = rig.node();
    Start::training("full").ok(&rig.cp, &node);
    // The disk fills up; the node keeps answering and says so, but not once per attempt.
    assert!(
        rig.cp.status(&node.uuid(), "while-full", REPLY).is_some(),
        "{}",
        node.log()
    );
    std::thread::sleep(Duration::from_secs(2));
    let complaints = node
        .log()
        .lines()
        .filter(|l| l.contains("cannot persist the log cursor"))
        .count();
    assert!(complaints <= 2, "{complaints} cursor errors logged");
    // Space comes back (the workload's own log is what filled it).
    for stream in ["stdout", "stderr"] {
        let log = rig.state(&format!("workload_logs/training_full.{stream}.log"));
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .open(&log)
            .map(|f| f.set_len(0));
    }
    let done = completion(&rig.cp, "wl-full");
    assert_eq!(done["success"], false, "{done}");
    assert_eq!(
        done["exit_code"], 7,
        "the real exit code, not a lost one: {done}"
    );
    let n = rig
        .cp
        .statuses("wl-full")
        .iter()
        .filter(|b| b["status"] == "completed")
        .count();
    assert_eq!(n, 1);
}
