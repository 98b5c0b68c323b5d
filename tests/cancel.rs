//! Cancelling a workload (guarantee 9): by pid or request id, with each signal, escalated to
//! the whole group after the grace; signals go only to what is provably the workload's (D26),
//! never to a foreign or recycled pid; a second cancel keeps the first deadline; a cancel after
//! the exit answers `already finished` (D29); one while the workload starts is carried out as it
//! runs; `max_runtime_seconds` is a cancel too.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::scenario::completion;
use crate::support::scenario::error_of;
use crate::support::timeouts::{DONE, REPLY};
use crate::support::{procs, wait_for, NodeProcess, Rig, Scenario, Start};

/// A node whose result uploads take `put_delay`, so an exited workload stays tracked.
fn uploading_node(put_delay: Duration, training: &str) -> (Rig, NodeProcess) {
    Scenario::new(&format!(
        "cyberwave:\n  training: {training}\n  results_folder: out\n"
    ))
    .backend(|b| b.put_delay = put_delay)
    .node()
}

#[test]
fn cancel_by_pid_and_by_request_id_with_each_signal() {
    let rig = Scenario::new(
        "cyberwave:\n  simulate: sleep 30\n  training: sleep 30\n  max_concurrent_workloads: 3\n",
    )
    .rig();
    let node = rig.node();
    let a = Start::new("simulate", "c-term")
        .workload("wl-term")
        .reply(&rig.cp, &node);
    let b = Start::new("training", "c-int")
        .workload("wl-int")
        .reply(&rig.cp, &node);
    let c = Start::new("simulate", "c-kill")
        .workload("wl-kill")
        .reply(&rig.cp, &node);
    let pid_a = a["output"]["pid"].as_i64().unwrap_or(0);
    let pid_c = c["output"]["pid"].as_i64().unwrap_or(0);
    rig.cp.command(
        &node.uuid(),
        json!({"command": "cancel", "request_id": "x1", "params": {"pid": pid_a}}),
    );
    rig.cp.command(&node.uuid(), json!({"command": "cancel", "request_id": "x2", "params": {"workload_request_id": "c-int", "signal": "SIGINT"}}));
    rig.cp.command(&node.uuid(), json!({"command": "cancel", "request_id": "x3", "params": {"pid": pid_c, "signal": "SIGKILL"}}));
    let r1 = rig.cp.wait_reply("x1", REPLY).expect("x1");
    assert_eq!(r1["status"], "ok", "{r1}");
    assert_eq!(
        r1["output"],
        json!({"message": "Workload cancelled with SIGTERM", "pid": pid_a, "workload_type": "simulate", "workload_request_id": "c-term", "signal": "SIGTERM"})
    );
    let r2 = rig.cp.wait_reply("x2", REPLY).expect("x2");
    assert_eq!(r2["output"]["signal"], "SIGINT");
    assert_eq!(r2["output"]["pid"], b["output"]["pid"]);
    let r3 = rig.cp.wait_reply("x3", REPLY).expect("x3");
    assert_eq!(r3["output"]["signal"], "SIGKILL");
    // SIGTERM alone stops a workload that does not ignore it: well before the 10 s grace.
    assert!(
        wait_for(Duration::from_secs(3), || (!procs::exists(pid_a))
            .then_some(()))
        .is_some(),
        "SIGTERM did not reach the workload"
    );
    let cancelled = rig
        .cp
        .wait_status("wl-term", "cancelled", DONE)
        .expect("R7 cancelled");
    let last = cancelled.last().cloned().unwrap_or_default();
    assert_eq!(
        last,
        json!({"status": "cancelled", "message": "Workload cancelled by SIGTERM", "signal": "SIGTERM", "pid": pid_a})
    );
    let pid_b = b["output"]["pid"].as_i64().unwrap_or(0);
    assert!(
        wait_for(Duration::from_secs(3), || (!procs::exists(pid_b))
            .then_some(()))
        .is_some(),
        "SIGINT did not reach the workload"
    );
    let training = rig
        .cp
        .wait_status("wl-int", "failed", DONE)
        .expect("training → failed");
    assert_eq!(
        training.last().map(|b| b["signal"].clone()),
        Some(json!("SIGINT"))
    );
    assert!(rig.cp.wait_status("wl-kill", "cancelled", DONE).is_some());
    for wl in ["wl-term", "wl-int", "wl-kill"] {
        let all = rig.cp.statuses(wl);
        assert!(
            all.iter().all(|b| b["status"] != "completed"),
            "a cancel is reported once, as the cancel: {all:?}"
        );
        assert_eq!(
            all.iter().filter(|b| b["status"] != "running").count(),
            1,
            "{all:?}"
        );
    }
    assert!(!procs::exists(pid_a) && !procs::exists(pid_c));
    let st = rig.cp.status(&node.uuid(), "after", REPLY).expect("status");
    assert_eq!(st["output"]["active_workloads"], json!([]));
}

#[test]
fn g9_cancel_escalates_to_the_whole_group_and_refuses_foreign_pids() {
    let rig = Scenario::new("cyberwave:\n  simulate: |\n    trap '' TERM\n    (trap '' TERM; sleep 60) &\n    echo $! > child.pid\n    sleep 60\n").rig();
    let node = rig.node();
    let r = Start::new("simulate", "stubborn").reply(&rig.cp, &node);
    let pid = r["output"]["pid"].as_i64().unwrap_or(0);
    let child = rig.pid_in("child.pid");
    // A pid that is not the node's workload is never signalled.
    let mut bystander = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("sleep");
    rig.cp.command(
        &node.uuid(),
        json!({"command": "cancel", "request_id": "foreign", "params": {"pid": bystander.id()}}),
    );
    let f = rig.cp.wait_reply("foreign", REPLY).expect("reply");
    assert_eq!(f["status"], "error");
    assert!(
        error_of(&f).starts_with("No active workload found with PID"),
        "{f}"
    );
    assert!(procs::exists(bystander.id()));
    let _ = bystander.kill();
    let _ = bystander.wait();
    // Invalid signal.
    rig.cp.command(&node.uuid(), json!({"command": "cancel", "request_id": "badsig", "params": {"pid": pid, "signal": "SIGSTOP"}}));
    let b = rig.cp.wait_reply("badsig", REPLY).expect("reply");
    assert_eq!(
        b["error"],
        "Invalid signal: SIGSTOP. Must be SIGTERM, SIGKILL, or SIGINT"
    );
    // SIGTERM is ignored by both; after the grace period the group is killed.
    let t = Instant::now();
    rig.cp.command(&node.uuid(), json!({"command": "cancel", "request_id": "esc", "params": {"pid": pid, "grace_seconds": 1}}));
    assert_eq!(
        rig.cp.wait_reply("esc", REPLY).expect("reply")["status"],
        "ok"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        procs::exists(pid) && procs::exists(child),
        "SIGTERM alone does not stop them"
    );
    let cancelled = rig
        .cp
        .wait_status("wl-stubborn", "cancelled", DONE)
        .unwrap_or_else(|| panic!("{}", node.log()));
    // The report says it took the SIGKILL of the escalation, not SIGTERM.
    assert_eq!(
        cancelled.last().map(|s| s["message"].clone()).unwrap_or_default(),
        "Workload cancelled by SIGTERM; it was still running after the 1s grace and was killed with SIGKILL"
    );
    assert!(t.elapsed() >= Duration::from_secs(1));
    assert!(!procs::exists(pid), "the workload is gone");
    assert!(
        wait_for(REPLY, || (!procs::exists(child)).then_some(())).is_some(),
        "its child is gone too"
    );
}

#[test]
fn max_runtime_cancels_and_reports_a_timeout() {
    let rig = Scenario::new("cyberwave:\n  training: sleep 30\n  max_runtime_seconds: 60\n").rig();
    let node = rig.node();
    Start::new("training", "slow")
        .params(json!({"workload_uuid": "wl-slow", "max_runtime_seconds": 0.5}))
        .reply(&rig.cp, &node);
    let done = completion(&rig.cp, "wl-slow");
    assert_eq!(done["success"], false);
    assert_eq!(done["error"], "timed out after 0.5s");
}

#[test]
fn g9_a_second_cancel_keeps_the_first_deadline() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  simulate: |\n    trap '' TERM\n    (trap '' TERM; sleep 60) &\n    sleep 60\n",
    )
    .node();
    Start::new("simulate", "st").ok(&rig.cp, &node);
    let t0 = Instant::now();
    let first = rig.cp.ask(&node, json!({"command": "cancel", "request_id": "st-c1", "params": {"workload_request_id": "st", "grace_seconds": 2}}));
    assert_eq!(first["status"], "ok", "{first}");
    let second = rig.cp.ask(&node, json!({"command": "cancel", "request_id": "st-c2", "params": {"workload_request_id": "st", "grace_seconds": 60, "signal": "SIGINT"}}));
    assert_eq!(second["status"], "ok", "{second}");
    let msg = second["output"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("already being cancelled with SIGTERM"),
        "{second}"
    );
    // SIGKILL at the first deadline (2 s), not 60 s after the second cancel.
    let all = rig
        .cp
        .wait_status("wl-st", "cancelled", DONE)
        .expect("no cancelled status");
    let done = all
        .into_iter()
        .find(|b| b["status"] == "cancelled")
        .unwrap_or_default();
    assert!(
        t0.elapsed() < Duration::from_secs(25),
        "the second cancel pushed the escalation out: {done}"
    );
    assert_eq!(
        done["signal"], "SIGTERM",
        "the first cancel's signal is reported: {done}"
    );
}

#[test]
fn g9_cancel_of_a_workload_that_already_succeeded_answers_already_finished() {
    let (rig, node) = uploading_node(
        Duration::from_secs(3),
        "mkdir -p out && echo result > out/r.txt",
    );
    Start::training("ok1").ok(&rig.cp, &node);
    assert!(rig.cp.wait_status("wl-ok1", "finalizing", DONE).is_some());
    let c = rig.cp.ask(
        &node,
        json!({"command": "cancel", "request_id": "c1", "params": {"workload_request_id": "ok1"}}),
    );
    assert_eq!(c["status"], "ok", "{c}");
    assert!(
        c["output"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("already finished"),
        "{c}"
    );
    let done = completion(&rig.cp, "wl-ok1");
    assert_eq!(
        done["success"], true,
        "its real outcome is reported: {done}"
    );
    assert!(!done.to_string().contains("cancelled"), "{done}");
}

/// D29: a cancel of a workload that already exited is answered `ok`, `already finished`, also
/// once the node reported and forgot it: a cancel that crosses the completion on the wire (the
/// backend sends it just after) is answered from the ledger, which knows that request id ran
/// here and finished, not with "No active workload found".
#[test]
fn g9_d29_a_cancel_just_after_the_completion_was_acknowledged_answers_already_finished() {
    let (rig, node) = Scenario::new("cyberwave:\n  training: echo hi\n").node();
    Start::training("fin").ok(&rig.cp, &node);
    completion(&rig.cp, "wl-fin");
    // The completion was acknowledged: the node forgot the workload.
    let record = rig.state("workloads/fin");
    assert!(
        wait_for(REPLY, || (!record.exists()).then_some(())).is_some(),
        "record kept"
    );
    let c = rig.cp.ask(&node, json!({"command": "cancel", "request_id": "fin-c", "params": {"workload_request_id": "fin"}}));
    assert_eq!(c["status"], "ok", "{c}");
    assert!(c.to_string().contains("already finished"), "{c}");
}

/// A cancel that comes while its workload is starting is answered at once and carried out as
/// soon as the workload runs: the workload gets the signal and is reported cancelled, once.
#[test]
fn g9_a_cancel_while_starting_is_answered_at_once_and_carried_out_when_the_workload_runs() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  inference: echo $$ >> t/$CYBERWAVE_REQUEST_ID.runs; trap 'echo term >> t/$CYBERWAVE_REQUEST_ID.runs; exit 143' TERM; sleep 30 & wait\n",
    )
    .slow_disk(500)
    .dir("t")
    .node();
    Start::new("inference", "early").send(&rig.cp, &node);
    rig.cp.command(
        &node.uuid(),
        json!({"command": "cancel", "request_id": "cx", "params": {"workload_request_id": "early"}}),
    );
    let answer = rig
        .cp
        .wait_reply("cx", Duration::from_secs(5))
        .expect("cancel not answered");
    assert_eq!(answer["status"], "ok", "{answer}");
    assert_eq!(answer["output"]["state"], "starting", "{answer}");
    assert!(
        rig.cp.replies_for("early").is_empty(),
        "answered while the start was still in flight"
    );
    let all = rig
        .cp
        .wait_status("wl-early", "cancelled", Duration::from_secs(30))
        .expect("not cancelled");
    assert_eq!(
        all.iter().filter(|b| b["status"] == "cancelled").count(),
        1,
        "{all:?}"
    );
    let start = rig.cp.replies_for("early");
    assert_eq!(start.len(), 1, "{start:?}");
    assert_eq!(start[0]["status"], "ok", "{start:?}");
    let lines = std::fs::read_to_string(rig.work("t/early.runs")).unwrap();
    assert_eq!(
        lines.lines().count(),
        2,
        "ran once and got SIGTERM: {lines}"
    );
    assert!(lines.ends_with("term\n"), "{lines}");
}

#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g9_a_recycled_pid_of_an_exited_workload_is_never_signalled() {
    crate::support::assert_root("to recycle a pid through ns_last_pid");
    assert!(
        std::fs::OpenOptions::new()
            .write(true)
            .open("/proc/sys/kernel/ns_last_pid")
            .is_ok(),
        "recycling a pid needs a writable /proc/sys/kernel/ns_last_pid"
    );
    let (rig, node) = uploading_node(
        Duration::from_secs(4),
        "mkdir -p out && echo result > out/r.txt",
    );
    let r = rig.cp.ask(&node, json!({"command": "training", "request_id": "rp", "params": {"workload_uuid": "wl-rp", "max_runtime_seconds": 1}}));
    let pid = r["output"]["pid"].as_u64().unwrap_or(0) as u32;
    assert!(pid > 1, "{r}");
    assert!(rig.cp.wait_status("wl-rp", "finalizing", DONE).is_some());
    // A stranger gets the workload's pid, as its own session and group leader.
    let mut stranger = None;
    // Another process may take the pid between the write and the fork; on a busy machine that
    // takes more than one try, never hundreds.
    for _ in 0..500 {
        let _ = std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string());
        let child = std::process::Command::new("setsid")
            .args(["sleep", "30"])
            .spawn()
            .expect("setsid");
        if child.id() == pid {
            stranger = Some(child);
            break;
        }
        let mut child = child;
        let _ = child.kill();
        let _ = child.wait();
    }
    // No silent pass: a run that could not recycle the pid proved nothing.
    let mut stranger =
        stranger.unwrap_or_else(|| panic!("could not recycle pid {pid} in 500 tries"));
    // Cancel by that pid while the exited workload is still tracked; and its max runtime
    // (1 s) passes meanwhile.
    let c = rig.cp.ask(&node, json!({"command": "cancel", "request_id": "rp-c", "params": {"pid": pid, "signal": "SIGKILL"}}));
    assert_eq!(c["status"], "ok", "{c}");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        procs::alive(pid),
        "the stranger holding a recycled pid was signalled"
    );
    let done = completion(&rig.cp, "wl-rp");
    assert_eq!(done["success"], true, "{done}");
    assert!(
        procs::alive(pid),
        "the stranger was signalled after the completion"
    );
    let _ = stranger.kill();
    let _ = stranger.wait();
}
