//! Seconds at the edge of every range (commands, manifest, environment) never make the node
//! panic: not when they arrive, and not when recovery rebuilds them after a restart.

use std::time::Duration;

use serde_json::json;

use crate::support::node::{NodeSetup, TOKEN};
use crate::support::timeouts::{READY, REPLY};
use crate::support::{rig, wait_for};

#[test]
fn g8_a_huge_max_runtime_neither_kills_the_node_nor_makes_it_crash_loop() {
    // A manifest limit past 30 days is a configuration error (exit 2, naming the key), never
    // a panic; the command's own huge limit is refused at the edge.
    let (_b, cp, setup) = rig("cyberwave:\n  training: sleep 30\n  max_runtime_seconds: 1e300\n");
    let out = setup.run(&["start"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("max_runtime_seconds"), "{out:?}");
    assert!(!out.stderr.contains("panicked"), "{out:?}");
    setup.write("cyberwave.yml", "cyberwave:\n  training: sleep 30\n");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    let uuid = node.uuid();
    cp.command(
        &uuid,
        json!({"command": "training", "request_id": "huge", "params": {"workload_uuid": "wl-huge", "max_runtime_seconds": 1e19}}),
    );
    // Accepted or refused (a range check may refuse it): either way an answer, and a live node.
    assert!(
        cp.wait_reply("huge", REPLY).is_some(),
        "no reply; log:\n{}",
        node.log()
    );
    assert!(
        cp.status(&uuid, "st-1", REPLY).is_some(),
        "the node stopped answering; log:\n{}",
        node.log()
    );
    // Recovery rebuilds the deadline from the record on disk: the restarted node must live too.
    node.kill9();
    let mut node = setup.spawn();
    node.wait_ready(READY);
    assert!(
        cp.status(&uuid, "st-2", REPLY).is_some(),
        "the restarted node stopped answering; log:\n{}",
        node.log()
    );
    assert_eq!(
        node.wait_exit(Duration::from_millis(200)),
        None,
        "{}",
        node.log()
    );
    assert!(!node.log().contains("panicked"), "{}", node.log());
    cp.command(
        &uuid,
        json!({"command": "cancel", "request_id": "c-huge", "params": {"workload_request_id": "huge", "grace_seconds": 1}}),
    );
    let _ = cp.wait_reply("c-huge", REPLY);
    node.sigterm();
    assert!(wait_for(READY, || node.wait_exit(Duration::ZERO)).is_some());
}

#[test]
fn g8_huge_seconds_in_the_environment_are_no_panic() {
    let mut base = NodeSetup::bare();
    base.set("CYBERWAVE_API_KEY", TOKEN);
    base.set("CYBERWAVE_MQTT_HOST", "127.0.0.1");
    for var in [
        "CYBERWAVE_HEARTBEAT_INTERVAL",
        "CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL",
        "CYBERWAVE_NODE_REQUEST_TIMEOUT_SECONDS",
        "CYBERWAVE_NODE_RECONNECT_BASE_SECONDS",
    ] {
        for v in ["1e300", "1e19", "18446744073709551616"] {
            let mut s = NodeSetup {
                home: base.home.clone(),
                env: base.env.clone(),
                args: base.args.clone(),
                cwd: base.cwd.clone(),
                uid: None,
                under: Vec::new(),
                bin: None,
            };
            s.set(var, v);
            let out = s.run(&["config", "--json"]);
            assert!(!out.stderr.contains("panicked"), "{var}={v}: {out:?}");
            assert!(
                out.code == Some(0) || out.code == Some(2),
                "{var}={v}: accepted or a usage error, nothing else: {out:?}"
            );
        }
    }
}
