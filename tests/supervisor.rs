//! The supervisor each workload runs under, killed from outside: its workload stays tracked,
//! counted against capacity and cancellable (guarantee 2), and is reported when it ends
//! (guarantee 3), as a failure that says the supervisor was killed.

use serde_json::json;

use crate::support::scenario::completion;
use crate::support::timeouts::{DONE, REPLY};
use crate::support::{procs, wait_for, Scenario};

#[test]
fn g2_a_killed_supervisor_leaves_its_workload_tracked_counted_and_cancellable() {
    let (rig, node) = Scenario::new("cyberwave:\n  simulate: sleep 60\n")
        .env("CYBERWAVE_NODE_CLEANUP_GRACE_SECONDS", "1")
        .node();
    let r = rig.cp.ask(
        &node,
        json!({"command": "simulate", "request_id": "sv", "params": {"workload_uuid": "wl-sv"}}),
    );
    let pid = r["output"]["pid"].as_i64().unwrap_or(0);
    // SIGKILLed as an operator would.
    procs::signal(rig.supervisor_of("sv"), libc::SIGKILL);
    node.assert_logged("supervisor of simulate sv");
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
        .unwrap_or_else(|| panic!("no report; log:\n{}", node.log()));
    assert!(
        wait_for(REPLY, || (!procs::alive(pid)).then_some(())).is_some(),
        "the workload was ended"
    );
    assert!(!all.is_empty());
}

#[test]
fn g3_a_workload_whose_supervisor_was_killed_is_reported_when_it_ends() {
    let (rig, node) = Scenario::new("cyberwave:\n  simulate: sleep 60\n").node();
    let r = rig.cp.ask(
        &node,
        json!({"command": "simulate", "request_id": "sk", "params": {"workload_uuid": "wl-sk"}}),
    );
    let pid = r["output"]["pid"].as_i64().unwrap_or(0);
    procs::signal(rig.supervisor_of("sk"), libc::SIGKILL);
    node.assert_logged("supervisor of simulate sk");
    assert!(
        rig.cp
            .statuses("wl-sk")
            .iter()
            .all(|b| b["status"] != "completed"),
        "not reported while it runs"
    );
    procs::signal(pid, libc::SIGKILL);
    let done = completion(&rig.cp, "wl-sk");
    assert_eq!(done["success"], false, "{done}");
    assert!(done.to_string().contains("supervisor was killed"), "{done}");
}
