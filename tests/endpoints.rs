//! Several broker endpoints (issue 15 item 6): `CYBERWAVE_MQTT_HOST` lists the addresses of a
//! clustered broker; the node is on one, and moves to another when that one goes.

use std::time::Duration;

use serde_json::json;

use crate::support::node::NodeSetup;
use crate::support::timeouts::RECONNECT;
use crate::support::{wait_for, Broker, ControlPlane};

/// The port of the broker the node's log last reported connecting to.
fn connected_port(log: &str) -> Option<u16> {
    log.lines()
        .rev()
        .find_map(|l| l.split("connected to MQTT broker 127.0.0.1:").nth(1))
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|p| p.parse().ok())
}

#[test]
fn the_node_moves_to_another_endpoint_when_its_broker_goes_and_loses_nothing() {
    // A hub with the backend, and two "cluster addresses" bridged to it.
    let hub = Broker::start();
    let cp = ControlPlane::start(hub.port, "");
    let mut a = Broker::start_bridged(hub.port);
    let mut b = Broker::start_bridged(hub.port);
    let mut setup = NodeSetup::new(&hub, &cp);
    setup.set(
        "CYBERWAVE_MQTT_HOST",
        &format!(" 127.0.0.1:{} ,127.0.0.1:{}", a.port, b.port),
    );
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  inference: |\n    while [ ! -f go ]; do sleep 0.05; done\n    echo finished\n    exit 3\n",
    );
    let node = setup.spawn();
    node.wait_ready(RECONNECT);
    let uuid = node.uuid();
    let client_id = std::fs::read_to_string(setup.home.join(".cyberwave/node_id")).ok();
    assert!(
        client_id.is_some(),
        "the node keeps its client id in node_id"
    );
    let first = connected_port(&node.log()).expect("connected to a listed endpoint");
    assert!(first == a.port || first == b.port, "{first}");

    // The bridges carry a command only once they are subscribed on the hub, which a loaded
    // machine may not have done yet when the node is ready: the same start is sent again (its
    // request id makes it one start) until it is answered.
    let r = wait_for(RECONNECT, || {
        cp.command(
            &uuid,
            json!({"command": "inference", "request_id": "ep-1", "params": {"workload_uuid": "wl-ep"}}),
        );
        cp.wait_reply("ep-1", Duration::from_secs(2))
    })
    .expect("start answered");
    assert_eq!(r["status"], "ok", "{r}");

    // The broker the node is on goes away.
    let t = std::time::Instant::now();
    let other = if first == a.port {
        a.stop();
        b.port
    } else {
        b.stop();
        a.port
    };
    assert!(
        wait_for(RECONNECT, || (connected_port(&node.log()) == Some(other))
            .then_some(()))
        .is_some(),
        "the node did not move to 127.0.0.1:{other}; log:\n{}",
        node.log()
    );
    eprintln!(
        "on the other endpoint {:?} after the broker stopped",
        t.elapsed()
    );

    // Re-subscribed and answering on the other endpoint, same identity.
    let mut answered = None;
    for k in 0..100 {
        let rid = format!("ep-status-{k}");
        cp.command(&uuid, json!({"command": "status", "request_id": rid}));
        if let Some(r) = cp.wait_reply(&rid, Duration::from_millis(300)) {
            answered = Some(r);
            break;
        }
    }
    let r = answered.unwrap_or_else(|| panic!("no status answered; log:\n{}", node.log()));
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["output"]["instance_uuid"], uuid.as_str());
    assert_eq!(node.uuid(), uuid);
    assert_eq!(
        std::fs::read_to_string(setup.home.join(".cyberwave/node_id")).ok(),
        client_id,
        "the client id is kept"
    );

    // The workload started on the first endpoint completes through the second.
    std::fs::write(setup.cwd.join("go"), "").expect("go");
    let all = cp
        .wait_status("wl-ep", "completed", RECONNECT)
        .unwrap_or_else(|| panic!("no completion: {:?}\n{}", cp.statuses("wl-ep"), node.log()));
    let done: Vec<_> = all.iter().filter(|s| s["status"] == "completed").collect();
    assert_eq!(done.len(), 1, "{all:?}");
    assert_eq!(done[0]["exit_code"], 3);
}

#[test]
fn a_bad_endpoint_list_is_refused_at_start_with_a_clear_error() {
    let hub = Broker::start();
    let cp = ControlPlane::start(hub.port, "");
    for (list, says) in [
        ("127.0.0.1:1883,,127.0.0.1:1884", "entry 2"),
        ("127.0.0.1:0", "1 to 65535"),
        ("bröker.example", "ASCII"),
        ("::1", "brackets"),
    ] {
        let mut setup = NodeSetup::new(&hub, &cp);
        setup.set("CYBERWAVE_MQTT_HOST", list);
        let mut node = setup.spawn();
        let code = node.wait_exit(RECONNECT).expect("the node exits");
        assert_ne!(code, Some(0), "{list}");
        let log = format!("{}{}", node.stdout(), node.log());
        assert!(
            log.contains("mqtt_host") && log.contains(says),
            "{list}: {log}"
        );
    }
    let mut setup = NodeSetup::new(&hub, &cp);
    setup.set("CYBERWAVE_MQTT_HOST", &vec!["h"; 1000].join(","));
    let mut node = setup.spawn();
    node.wait_exit(RECONNECT).expect("the node exits");
    let log = node.log();
    assert!(log.contains("1000") && log.contains("at most"), "{log}");
    assert!(log.len() < 10_000, "the error does not echo the whole list");
}
