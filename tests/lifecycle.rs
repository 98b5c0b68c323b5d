//! Signals only to what is provably the workload's (D26), cancel after the exit (D29), and
//! repeated cancels (issue 12; guarantee 9).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::node::NodeSetup;
use crate::support::{Broker, ControlPlane, NodeProcess};

const READY: Duration = Duration::from_secs(15);
const REPLY: Duration = Duration::from_secs(5);
const DONE: Duration = Duration::from_secs(30);

fn command(cp: &ControlPlane, node: &NodeProcess, body: Value) -> Value {
    let rid = body["request_id"].as_str().unwrap_or_default().to_string();
    cp.command(&node.uuid(), body);
    cp.wait_reply(&rid, REPLY)
        .unwrap_or_else(|| panic!("no reply to {rid}; log:\n{}", node.log()))
}

/// A node whose result uploads take `put_delay`, so an exited workload stays tracked.
fn uploading_node(
    put_delay: Duration,
    training: &str,
) -> (Broker, ControlPlane, NodeSetup, NodeProcess) {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    cp.set_behaviour(|b| b.put_delay = put_delay);
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        &format!("cyberwave:\n  training: {training}\n  results_folder: out\n"),
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    (broker, cp, setup, node)
}

fn completion(cp: &ControlPlane, wl: &str) -> Value {
    let all = cp
        .wait_status(wl, "completed", DONE)
        .unwrap_or_else(|| panic!("no completion for {wl}"));
    all.into_iter()
        .find(|b| b["status"] == "completed")
        .unwrap_or_default()
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only probes.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

#[test]
fn guarantee_9_cancel_of_a_workload_that_already_succeeded_answers_already_finished() {
    let (_b, cp, _setup, node) = uploading_node(
        Duration::from_secs(3),
        "mkdir -p out && echo result > out/r.txt",
    );
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "ok1", "params": {"workload_uuid": "wl-ok1"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    assert!(cp.wait_status("wl-ok1", "finalizing", DONE).is_some());
    let c = command(
        &cp,
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
    let done = completion(&cp, "wl-ok1");
    assert_eq!(
        done["success"], true,
        "its real outcome is reported: {done}"
    );
    assert!(!done.to_string().contains("cancelled"), "{done}");
}

#[test]
fn guarantee_9_a_recycled_pid_of_an_exited_workload_is_never_signalled() {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0
        || std::fs::OpenOptions::new()
            .write(true)
            .open("/proc/sys/kernel/ns_last_pid")
            .is_err()
    {
        eprintln!("skipped: recycling a pid needs root and a writable ns_last_pid");
        return;
    }
    let (_b, cp, _setup, node) = uploading_node(
        Duration::from_secs(4),
        "mkdir -p out && echo result > out/r.txt",
    );
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "rp", "params": {"workload_uuid": "wl-rp", "max_runtime_seconds": 1}}),
    );
    let pid = r["output"]["pid"].as_u64().unwrap_or(0) as u32;
    assert!(pid > 1, "{r}");
    assert!(cp.wait_status("wl-rp", "finalizing", DONE).is_some());
    // A stranger gets the workload's pid, as its own session and group leader.
    let mut stranger = None;
    for _ in 0..50 {
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
    let Some(mut stranger) = stranger else {
        eprintln!("skipped: could not recycle pid {pid} (the machine is busy)");
        return;
    };
    // Cancel by that pid while the exited workload is still tracked; and its max runtime
    // (1 s) passes meanwhile.
    let c = command(
        &cp,
        &node,
        json!({"command": "cancel", "request_id": "rp-c", "params": {"pid": pid, "signal": "SIGKILL"}}),
    );
    assert_eq!(c["status"], "ok", "{c}");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        alive(pid),
        "the stranger holding a recycled pid was signalled"
    );
    let done = completion(&cp, "wl-rp");
    assert_eq!(done["success"], true, "{done}");
    assert!(
        alive(pid),
        "the stranger was signalled after the completion"
    );
    let _ = stranger.kill();
    let _ = stranger.wait();
}

#[test]
fn guarantee_9_a_second_cancel_keeps_the_first_deadline() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  simulate: |\n    trap '' TERM\n    (trap '' TERM; sleep 60) &\n    sleep 60\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let r = command(
        &cp,
        &node,
        json!({"command": "simulate", "request_id": "st", "params": {"workload_uuid": "wl-st"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    let t0 = Instant::now();
    let first = command(
        &cp,
        &node,
        json!({"command": "cancel", "request_id": "st-c1", "params": {"workload_request_id": "st", "grace_seconds": 2}}),
    );
    assert_eq!(first["status"], "ok", "{first}");
    let second = command(
        &cp,
        &node,
        json!({"command": "cancel", "request_id": "st-c2", "params": {"workload_request_id": "st", "grace_seconds": 60, "signal": "SIGINT"}}),
    );
    assert_eq!(second["status"], "ok", "{second}");
    let msg = second["output"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("already being cancelled with SIGTERM"),
        "{second}"
    );
    // SIGKILL at the first deadline (2 s), not 60 s after the second cancel.
    let all = cp
        .wait_status("wl-st", "cancelled", DONE)
        .unwrap_or_else(|| panic!("no cancelled status; log:\n{}", node.log()));
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
