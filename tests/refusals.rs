//! Why a start is refused, and how the backend hears it: a refusal that may succeed on another
//! host or later is `host_busy` with its reason (shutting down, the disk guard; capacity and
//! draining are in starts.rs and operate.rs), one that cannot succeed here is not (D21); a node
//! reserved for an environment refuses starts for any other.

use std::time::Duration;

use serde_json::json;

use crate::support::timeouts::{EXIT, REPLY};
use crate::support::{Scenario, Start};

#[test]
fn a_start_during_shutdown_is_a_retryable_host_busy_refusal() {
    let (rig, mut node) = Scenario::new("cyberwave:\n  training: sleep 5\n")
        .backend(|b| b.terminate_delay = Duration::from_millis(2500))
        .node();
    let cp = &rig.cp;
    node.sigterm();
    assert!(node.wait_log("shutting down", REPLY));
    let r = Start::training("late").reply(cp, &node);
    assert_eq!(r["status"], "error");
    let err = r["error"].as_str().unwrap_or_default().to_string();
    assert!(err.starts_with("Controller host is busy with"), "{err}");
    let failed = cp
        .wait_status("wl-late", "failed", REPLY)
        .expect("R7 failed");
    assert_eq!(failed[0]["rejection_reason"], "host_busy");
    assert_eq!(failed[0]["busy_reason"], "shutting_down");
    assert_eq!(failed[0]["rejecting_instance_uuid"], node.uuid());
    assert_eq!(failed[0]["error"], json!(err));
    // Other commands keep the plain shutting-down answer.
    let st = cp.status(&node.uuid(), "st", REPLY).expect("reply");
    assert!(st["error"]
        .as_str()
        .unwrap_or_default()
        .contains("shutting down"));
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)));
}

#[test]
fn a_refusal_that_cannot_succeed_here_is_not_host_busy() {
    let (rig, node) = Scenario::new("cyberwave:\n  training: sleep 5\n").node();
    let cp = &rig.cp;
    assert_eq!(
        Start::new("simulate", "nope").reply(cp, &node)["status"],
        "error"
    );
    let failed = cp
        .wait_status("wl-nope", "failed", REPLY)
        .expect("R7 failed");
    assert!(failed[0].get("rejection_reason").is_none(), "{}", failed[0]);
    assert!(failed[0].get("busy_reason").is_none(), "{}", failed[0]);
}

#[test]
fn the_disk_guard_refuses_starts() {
    let (rig, node) =
        Scenario::new("cyberwave:\n  training: sleep 1\n  min_free_disk_mb: 999999999999\n").node();
    let cp = &rig.cp;
    let r = Start::new("training", "full").reply(cp, &node);
    assert_eq!(r["status"], "error");
    assert!(
        r["error"]
            .as_str()
            .unwrap_or_default()
            .contains("not enough free disk"),
        "{r}"
    );
    let failed = cp.wait_status("wl-full", "failed", REPLY).expect("R7");
    assert_eq!(failed[0]["rejection_reason"], "host_busy");
    assert_eq!(failed[0]["busy_reason"], "disk_low");
    assert!(failed[0]["error"]
        .as_str()
        .unwrap_or_default()
        .starts_with("Controller host is busy with"));
}

#[test]
fn environment_reservation_is_sent_and_enforced() {
    let (rig, node) = Scenario::default()
        .env("CYBERWAVE_NODE_ENVIRONMENT_UUID", "env-from-var")
        .env("CYBERWAVE_INFERENCE_CMD", "echo {body}")
        .arg("--environment")
        .arg("env-from-flag")
        .node();
    let cp = &rig.cp;
    assert_eq!(
        cp.requests("request-instance")[0].body["environment_uuid"],
        "env-from-flag"
    );
    assert_eq!(
        cp.requests("register")[0].body["environment_uuid"],
        "env-from-flag"
    );
    let r = cp.ask(
        &node,
        json!({"command": "inference", "request_id": "wrong-env", "params": {"environment_uuid": "other-env"}}),
    );
    assert_eq!(r["status"], "error");
    assert!(
        r["error"]
            .as_str()
            .unwrap_or_default()
            .contains("reserved for environment env-from-flag"),
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
    let cp = &rig.cp;
    for (i, bad) in [json!(42), json!(["env-B"]), json!({}), json!("env-B")]
        .into_iter()
        .enumerate()
    {
        let rid = format!("env{i}");
        let r = cp.ask(
            &node,
            json!({"command": "inference", "request_id": rid, "params": {"environment_uuid": bad}}),
        );
        assert_eq!(r["status"], "error", "{r}");
        let e = r["error"].as_str().unwrap_or_default();
        assert!(e.contains("environment"), "{e}");
    }
    assert!(!rig.work("ran").exists(), "a refused start ran");
    // The reserved environment itself is served.
    let r = cp.ask(
        &node,
        json!({"command": "inference", "request_id": "env-ok", "params": {"environment_uuid": "env-A"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
}
