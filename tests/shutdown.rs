//! The node's shutdown on SIGTERM: R5 terminate, commands refused meanwhile, a second signal
//! exits at once, starts in flight are answered first, and workloads are left running (named in
//! the log) for the next node to adopt.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::scenario::error_of;
use crate::support::timeouts::{EXIT, REPLY};
use crate::support::{procs, wait_for, Scenario, Start};

#[test]
fn node_starts_connects_and_exits_0_on_sigterm() {
    let (_rig, mut node) = Scenario::default().node();
    node.assert_logged("connected to MQTT broker");
    node.sigterm();
    node.assert_exit(0, EXIT);
}

#[test]
fn sigterm_sends_terminate_and_refuses_commands_meanwhile() {
    let (rig, mut node) = Scenario::default()
        .backend(|b| b.terminate_delay = Duration::from_millis(2500))
        .node();
    node.sigterm();
    assert!(node.wait_log("shutting down", REPLY));
    let reply = rig
        .cp
        .status(&node.uuid(), "during-shutdown", REPLY)
        .expect("error reply");
    assert_eq!(reply["status"], "error");
    assert!(error_of(&reply).contains("shutting down"), "{reply}");
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)));
    assert_eq!(rig.cp.requests("terminate").len(), 1, "R5 sent once");
}

#[test]
fn sigterm_exits_promptly_when_the_broker_is_healthy() {
    let (rig, mut node) = Scenario::default().node();
    let t = Instant::now();
    node.sigterm();
    node.assert_exit(0, Duration::from_secs(5));
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(rig.cp.requests("terminate").len(), 1);
}

#[test]
fn a_second_signal_exits_at_once() {
    let (_rig, mut node) = Scenario::default()
        .backend(|b| b.terminate_delay = Duration::from_secs(30))
        .env("CYBERWAVE_NODE_SHUTDOWN_FLUSH_SECONDS", "30")
        .node();
    node.sigterm();
    assert!(node.wait_log("shutting down", REPLY));
    assert_eq!(
        node.wait_exit(Duration::from_millis(500)),
        None,
        "still waiting for the R5 reply"
    );
    node.signal(libc::SIGINT);
    assert!(
        node.wait_exit(Duration::from_secs(3)).is_some(),
        "{}",
        node.log()
    );
}

#[test]
fn g2_sigterm_leaves_workloads_running_and_names_them() {
    let (rig, mut node) = Scenario::new("cyberwave:\n  training: sleep 20\n").node();
    let pid = Start::training("keep")
        .params(json!({}))
        .pid(&rig.cp, &node);
    node.sigterm();
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)));
    assert!(
        node.log()
            .contains(&format!("left running: training keep pid {pid}")),
        "{}",
        node.log()
    );
    node.assert_logged("training_keep.stdout.log");
    assert!(procs::exists(pid));
    procs::kill_group(pid);
}

/// A shutdown while a start is in flight (on a slow disk): the node waits for it, answers it
/// and names the workload it leaves running (guarantee 2), then exits cleanly.
#[test]
fn g2_a_start_in_flight_at_shutdown_is_answered_before_the_node_exits() {
    let (rig, mut node) = Scenario::new(
        "cyberwave:\n  inference: echo $$ >> t/$CYBERWAVE_REQUEST_ID.runs; sleep 5\n",
    )
    .slow_disk(700)
    .dir("t")
    .node();
    Start::new("inference", "late").send(&rig.cp, &node);
    wait_for(Duration::from_secs(10), || {
        (rig.runs("late") == 1).then_some(())
    })
    .expect("the workload did not run");
    assert!(rig.cp.replies_for("late").is_empty(), "still in flight");
    node.sigterm();
    let code = node.wait_exit(Duration::from_secs(30));
    assert_eq!(code, Some(Some(0)), "log:\n{}", node.log());
    let replies = rig.cp.replies_for("late");
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
