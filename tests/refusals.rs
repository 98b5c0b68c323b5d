//! Why a start is refused, and how the backend hears it: a refusal that may succeed on another
//! host or later is `host_busy` with its reason (shutting down, the disk guard; capacity and
//! draining are in starts.rs and operate.rs), one that cannot succeed here is not (D21); a node
//! reserved for an environment refuses starts for any other.

use std::time::Duration;

use serde_json::json;

use crate::support::scenario::{assert_host_busy, error_of};
use crate::support::timeouts::{EXIT, REPLY};
use crate::support::{Scenario, Start};

#[test]
fn a_start_during_shutdown_is_a_retryable_host_busy_refusal() {
    let (rig, mut node) = Scenario::new("cyberwave:\n  training: sleep 5\n")
        .backend(|b| b.terminate_delay = Duration::from_millis(2500))
        .node();
    node.sigterm();
    assert!(node.wait_log("shutting down", REPLY));
    let r = Start::training("late").reply(&rig.cp, &node);
    assert_eq!(r["status"], "error");
    let err = error_of(&r).to_string();
    assert!(err.starts_with("Controller host is busy with"), "{err}");
    let failed = rig
        .cp
        .wait_status("wl-late", "failed", REPLY)
        .expect("R7 failed");
    assert_host_busy(&failed[0], "shutting_down");
    assert_eq!(failed[0]["rejecting_instance_uuid"], node.uuid());
    assert_eq!(failed[0]["error"], json!(err));
    // Other commands keep the plain shutting-down answer.
    let st = rig.cp.status(&node.uuid(), "st", REPLY).expect("reply");
    assert!(error_of(&st).contains("shutting down"));
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)));
}

#[test]
fn a_refusal_that_cannot_succeed_here_is_not_host_busy() {
    let (rig, node) = Scenario::new("cyberwave:\n  training: sleep 5\n").node();
    assert_eq!(
        Start::new("simulate", "nope").reply(&rig.cp, &node)["status"],
        "error"
    );
    let failed = rig
        .cp
        .wait_status("wl-nope", "failed", REPLY)
        .expect("R7 failed");
    assert!(failed[0].get("rejection_reason").is_none(), "{}", failed[0]);
    assert!(failed[0].get("busy_reason").is_none(), "{}", failed[0]);
}

#[test]
fn the_disk_guard_refuses_starts() {
    let (rig, node) =
        Scenario::new("cyberwave:\n  training: sleep 1\n  min_free_disk_mb: 999999999999\n").node();
    let r = Start::new("training", "full").reply(&rig.cp, &node);
    assert_eq!(r["status"], "error");
    assert!(error_of(&r).contains("not enough free disk"), "{r}");
    let failed = rig.cp.wait_status("wl-full", "failed", REPLY).expect("R7");
    assert_host_busy(&failed[0], "disk_low");
}

#[test]
fn environment_reservation_is_sent_and_enforced() {
    let (rig, node) = Scenario::default()
        .env("CYBERWAVE_NODE_ENVIRONMENT_UUID", "env-from-var")
        .env("CYBERWAVE_INFERENCE_CMD", "echo {body}")
        .arg("--environment")
        .arg("env-from-flag")
        .node();
    assert_eq!(
        rig.cp.requests("request-instance")[0].body["environment_uuid"],
        "env-from-flag"
    );
    assert_eq!(
        rig.cp.requests("register")[0].body["environment_uuid"],
        "env-from-flag"
    );
    let r = rig.cp.ask(
        &node,
        json!({"command": "inference", "request_id": "wrong-env", "params": {"environment_uuid": "other-env"}}),
    );
    assert_eq!(r["status"], "error");
    assert!(
        error_of(&r).contains("reserved for environment env-from-flag"),
        "{r}"
    );
}

#[test]
fn g8_a_non_string_environment_uuid_cannot_slip_past_a_reservation() {
    let (rig, node) =
        Scenario::new("cyberwave:\n  inference: mkdir -p ran && touch \"ran/$(date +%s%N)\"\n")
            .arg("--environment")
            .arg("env-A")
            .node();
    for (i, bad) in [json!(42), json!(["env-B"]), json!({}), json!("env-B")]
        .into_iter()
        .enumerate()
    {
        let rid = format!("env{i}");
        let r = rig.cp.ask(
            &node,
            json!({"command": "inference", "request_id": rid, "params": {"environment_uuid": bad}}),
        );
        assert_eq!(r["status"], "error", "{r}");
        let e = error_of(&r);
        assert!(e.contains("environment"), "{e}");
    }
    assert!(!rig.work("ran").exists(), "a refused start ran");
    // The reserved environment itself is served.
    let r = rig.cp.ask(
        &node,
        json!({"command": "inference", "request_id": "env-ok", "params": {"environment_uuid": "env-A"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
}
