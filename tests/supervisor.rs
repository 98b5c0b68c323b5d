//! The supervisor each workload runs under, killed from outside: its workload stays tracked,
//! counted against capacity and cancellable (guarantee 2), and is reported when it ends
//! (guarantee 3), as a failure that says the supervisor was killed.

use serde_json::json;

use crate::support::scenario::completion;
use crate::support::timeouts::{DONE, REPLY};
use crate::support::{procs, wait_for, NodeProcess, Rig, Scenario, Start};

/// Starts the `simulate` workload `rid`, SIGKILLs its supervisor (as an operator would) and
/// waits for the node to notice; the workload's pid.
fn start_and_kill_its_supervisor(rig: &Rig, node: &NodeProcess, rid: &str) -> i64 {
    let pid = Start::new("simulate", rid).pid(&rig.cp, node);
    procs::signal(rig.supervisor_of(rid), libc::SIGKILL);
    node.assert_logged(&format!("supervisor of simulate {rid}"));
    pid
}

#[test]
fn g2_a_killed_supervisor_leaves_its_workload_tracked_counted_and_cancellable() {
    let (rig, node) = Scenario::new("cyberwave:\n  simulate: sleep 60\n")
        .env("CYBERWAVE_NODE_CLEANUP_GRACE_SECONDS", "1")
        .node();
    let pid = start_and_kill_its_supervisor(&rig, &node, "sv");
    assert!(procs::alive(pid), "the workload itself runs on");
    // Still counted: a second start is refused at capacity 1 …
    let busy = rig.cp.ask(
        &node,
        json!({"command": "simulate", "request_id": "sv2", "params": {"workload_uuid": "wl-sv2"}}),
    );
    assert_eq!(busy["status"], "error", "{busy}");
    // … still listed …
    let st = rig.cp.status(&node.uuid(), "sv-st", REPLY).expect("status");
    assert_eq!(st["output"]["active_workloads"][0]["pid"], pid, "{st}");
    // … still cancellable, and reported once its group is empty.
    let c = rig.cp.ask(&node, json!({"command": "cancel", "request_id": "sv-c", "params": {"pid": pid, "grace_seconds": 1}}));
    assert_eq!(c["status"], "ok", "{c}");
    let all = rig
        .cp
        .wait_status("wl-sv", "cancelled", DONE)
        .or_else(|| rig.cp.wait_status("wl-sv", "completed", DONE))
        .expect("no report");
    assert!(
        wait_for(REPLY, || (!procs::alive(pid)).then_some(())).is_some(),
        "the workload was ended"
    );
    assert!(!all.is_empty());
}

#[test]
fn g3_a_workload_whose_supervisor_was_killed_is_reported_when_it_ends() {
    let (rig, node) = Scenario::new("cyberwave:\n  simulate: sleep 60\n").node();
    let pid = start_and_kill_its_supervisor(&rig, &node, "sk");
    assert!(
        rig.cp.completions("wl-sk").is_empty(),
        "not reported while it runs"
    );
    procs::signal(pid, libc::SIGKILL);
    let done = completion(&rig.cp, "wl-sk");
    assert_eq!(done["success"], false, "{done}");
    assert!(done.to_string().contains("supervisor was killed"), "{done}");
}
