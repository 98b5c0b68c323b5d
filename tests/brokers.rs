//! Brokers other than mosquitto: a scripted broker (`support::mqtt5::ScriptedBroker`) does what
//! real ones do — refuse subscriptions in SUBACK, answer as a v3-only broker, hold the
//! CONNACK, drop the connection after a publish over a limit it never announced — and the node
//! neither crashes nor storms, and says what happened in the broker's own terms.

use std::time::Duration;

use crate::support::mqtt5::{Script, ScriptedBroker};
use crate::support::node::NodeSetup;
use crate::support::timeouts::{EXIT, READY, REPLY};
use crate::support::{wait_for, NodeProcess};

fn setup_on(broker: &ScriptedBroker) -> NodeSetup {
    NodeSetup::standalone(broker.port)
}

fn node_on(broker: &ScriptedBroker) -> NodeProcess {
    setup_on(broker).spawn()
}

/// A publish holding `needle` goes out and is not acknowledged; the broker then acknowledges
/// again and drops the connection: the publish goes out again on the next one.
fn assert_sent_again_on_the_next_connection(
    broker: &ScriptedBroker,
    node: &NodeProcess,
    needle: &str,
) {
    let sent = |n: usize| {
        wait_for(REPLY, || {
            (broker.publishes_containing(needle) >= n).then_some(())
        })
        .is_some()
    };
    assert!(sent(1), "{}", node.log());
    broker.set(|s| s.withhold_puback = false);
    broker.kick();
    assert!(
        sent(2),
        "{needle} was not sent again: {} connects\n{}",
        broker.connects().len(),
        node.log()
    );
}

/// A start command for a workload of the node's manifest, published by the broker itself.
fn start_command(kind: &str) -> Option<(String, Vec<u8>)> {
    Some((
        "/command".into(),
        serde_json::json!({"command": kind, "request_id": "sb-1", "params": {"workload_uuid": "wl-sb"}})
            .to_string()
            .into_bytes(),
    ))
}

#[test]
fn a_scripted_broker_serves_a_standalone_node() {
    let broker = ScriptedBroker::start(Script::default());
    let node = node_on(&broker);
    node.wait_ready(READY);
    assert!(!broker.connects().is_empty());
}

/// Paho C frees its in-flight messages when a connect asks for a clean session (or the broker
/// has none), the path of its open double-free reports: the node never asks for one while the
/// client holds QoS 1 messages the broker has not acknowledged.
#[test]
fn g14_no_reconnect_asks_for_a_clean_session_while_qos1_messages_are_in_flight() {
    // The broker never acknowledges: the node's QoS 1 messages stay in flight.
    let broker = ScriptedBroker::start(Script {
        withhold_puback: true,
        ..Script::default()
    });
    let setup = setup_on(&broker);
    // Install logs: shipped (QoS 1) as soon as the node is registered.
    setup.plant("install_logs/install.stdout.log", "pip install ok\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    let sent = wait_for(REPLY, || {
        broker.publishes().iter().any(|p| p.2 == 1).then_some(())
    });
    assert!(sent.is_some(), "{}", node.log());
    // Past the request's timeout (2 s), then the connection drops, and the next ones die
    // right after their CONNACK (a broker restarting, a cluster node handing over).
    std::thread::sleep(Duration::from_millis(2500));
    broker.set(|s| s.drop_after_connack = 3);
    broker.kick();
    let enough = wait_for(Duration::from_secs(15), || {
        (broker.connects().len() >= 4).then_some(())
    });
    let connects = broker.connects();
    assert!(enough.is_some(), "{connects:?}\n{}", node.log());
    for c in &connects {
        assert!(
            !(c.clean_start && c.unacked > 0),
            "a CONNECT asked for a clean session with {} QoS 1 messages in flight: {connects:?}\n{}",
            c.unacked,
            node.log()
        );
    }
}

/// A broker (rumqttd, AWS IoT Core-class) that drops the connection on a publish over a limit
/// it never announced: the node halves its largest message after two such drops and says so
/// with the size; chunks that fit then go through, and the drops stay few (no storm).
#[test]
fn g14_a_drop_after_a_large_publish_halves_the_largest_message() {
    let broker = ScriptedBroker::start(Script {
        drop_publish_over: Some(40_000),
        command: start_command("inference"),
        ..Script::default()
    });
    let setup = setup_on(&broker);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  inference: |\n    for i in $(seq 60); do head -c 65536 /dev/zero | tr '\\0' y; echo; sleep 0.15; done\n",
    );
    let node = setup.spawn();
    let fitted = wait_for(Duration::from_secs(30), || {
        broker
            .publishes()
            .iter()
            .any(|p| p.0.ends_with("/logs") && p.1 > 16 * 1024 && p.1 <= 40_000)
            .then_some(())
    });
    let log = node.log();
    assert!(
        fitted.is_some(),
        "no log chunk under the broker's limit after {} drops:\n{log}",
        broker.drops_after_publish()
    );
    let said = log
        .matches("enforces a packet size limit it did not announce")
        .count();
    assert!((1..=5).contains(&said), "said {said} times:\n{log}");
    assert!(log.contains("after a publish of"), "{log}");
    assert!(
        broker.drops_after_publish() <= 12,
        "{} drops: a reconnect storm\n{log}",
        broker.drops_after_publish()
    );
    // No log chunk is ever smaller than 16 KiB because of it.
    let tiny = broker
        .publishes()
        .iter()
        .filter(|p| p.0.ends_with("/logs") && p.1 < 8 * 1024)
        .count();
    assert!(tiny <= 2, "{tiny} tiny chunks");
}

/// D50: a broker that refuses the command subscriptions in its SUBACK (EMQX/HiveMQ-class: 0x87,
/// 0x80) gets an ERROR naming the topic and the reason, never "node ready".
#[test]
fn g14_d50_refused_command_subscriptions_are_an_error_and_never_node_ready() {
    for (code, name) in [(0x87u8, "Not authorized"), (0x80, "Unspecified error")] {
        let broker = ScriptedBroker::start(Script {
            refuse_filter: Some(("/command".into(), code)),
            ..Script::default()
        });
        let node = node_on(&broker);
        let shown = format!("{code:#04x}");
        node.assert_logged(&shown);
        std::thread::sleep(Duration::from_millis(500));
        let log = node.log();
        let line = log
            .lines()
            .find(|l| l.contains(&shown))
            .unwrap_or_default()
            .to_string();
        assert!(
            line.contains("ERROR") && line.contains("/command") && line.contains(name),
            "{line}\n{log}"
        );
        assert!(!log.contains("node ready"), "{log}");
        assert!(!log.contains("another client uses"), "{log}");
    }
}

/// Every connect failure says what it is in the broker's own terms.
#[test]
fn g14_connect_errors_say_what_the_broker_said() {
    let cases: Vec<(Script, &str)> = vec![
        (
            Script {
                v3_only: true,
                ..Script::default()
            },
            "MQTT v5",
        ),
        (
            Script {
                connack_reason: 0x84,
                ..Script::default()
            },
            "0x84 Unsupported Protocol Version",
        ),
        (
            Script {
                connack_reason: 0x86,
                ..Script::default()
            },
            "0x86 Bad User Name or Password",
        ),
        (
            Script {
                connack_reason: 0x87,
                ..Script::default()
            },
            "0x87 Not authorized",
        ),
        (
            Script {
                hold_connack: true,
                ..Script::default()
            },
            "within 2 s (CYBERWAVE_NODE_CONNECT_TIMEOUT_SECONDS)",
        ),
    ];
    for (script, want) in cases {
        let broker = ScriptedBroker::start(script);
        let mut setup = setup_on(&broker);
        setup.set("CYBERWAVE_NODE_CONNECT_TIMEOUT_SECONDS", "2");
        let node = setup.spawn();
        assert!(node.wait_log(want, REPLY), "want {want:?}:\n{}", node.log());
        let log = node.log();
        assert!(!log.contains("is it an MQTT listener"), "{log}");
        assert!(!log.contains("node ready"), "{log}");
    }
    // Nothing listens.
    let node = NodeSetup::standalone(crate::support::free_port()).spawn();
    node.assert_logged("connection refused");
}

/// The node's stdout mirrors workload output: nothing of Paho's goes there.
#[test]
fn g14_nothing_of_paho_reaches_the_nodes_stdout() {
    let broker = ScriptedBroker::start(Script {
        drop_after_connack: 2,
        ..Script::default()
    });
    let mut node = node_on(&broker);
    node.wait_ready(READY);
    // C's stdout reaches a pipe when it is flushed: at the latest at exit.
    node.sigterm();
    node.assert_exit(0, EXIT);
    let out = node.stdout();
    assert!(
        !out.contains("checking") && !out.contains("tcp://") && !out.contains("Connection lost"),
        "{out:?}"
    );
}

/// CONNACK limits: Maximum QoS 0 caps what the node publishes at QoS 0 (a QoS 1 publish would
/// be a protocol error the broker disconnects for); Receive Maximum 1 keeps at most one QoS 1
/// message unacknowledged.
#[test]
fn g14_connack_maximum_qos_and_receive_maximum_are_honoured() {
    let setup_with_install = |broker: &ScriptedBroker| {
        let setup = setup_on(broker);
        setup.plant("install_logs/install.stdout.log", "out\n");
        setup.plant("install_logs/install.stderr.log", "err\n");
        setup
    };
    // Maximum QoS (0x24) = 0.
    let broker = ScriptedBroker::start(Script {
        connack_props: vec![0x24, 0],
        ..Script::default()
    });
    let node = setup_with_install(&broker).spawn();
    node.wait_ready(READY);
    let sent = wait_for(REPLY, || (broker.publishes().len() >= 2).then_some(()));
    assert!(sent.is_some(), "{}", node.log());
    let qos: Vec<u8> = broker.publishes().iter().map(|p| p.2).collect();
    assert!(qos.iter().all(|q| *q == 0), "{qos:?}");
    drop(node);

    // Receive Maximum (0x21) = 1, and no PUBACK ever: one message in flight, the rest wait.
    let broker = ScriptedBroker::start(Script {
        connack_props: vec![0x21, 0, 1],
        withhold_puback: true,
        ..Script::default()
    });
    let node = setup_with_install(&broker).spawn();
    node.wait_ready(READY);
    let sent = wait_for(REPLY, || (!broker.publishes().is_empty()).then_some(()));
    assert!(sent.is_some(), "{}", node.log());
    std::thread::sleep(Duration::from_millis(1000));
    let qos1 = broker.publishes().iter().filter(|p| p.2 == 1).count();
    assert_eq!(qos1, 1, "{:?}", broker.publishes());
}

/// A standalone node has no backend to acknowledge workload statuses: no false warning that
/// they were "not acknowledged in time".
#[test]
fn g14_a_standalone_node_does_not_warn_of_unacknowledged_statuses() {
    let broker = ScriptedBroker::start(Script {
        command: start_command("inference"),
        ..Script::default()
    });
    let mut setup = setup_on(&broker);
    setup.set("CYBERWAVE_NODE_REQUEST_TIMEOUT_SECONDS", "0.5");
    setup.write("cyberwave.yml", "cyberwave:\n  inference: echo hi\n");
    let node = setup.spawn();
    node.assert_logged("finished: success");
    std::thread::sleep(Duration::from_millis(1500));
    let log = node.log();
    assert!(
        broker.publishes().iter().any(|p| p.0.contains("wl-sb")),
        "statuses were published: {:?}",
        broker.publishes()
    );
    assert!(!log.contains("not acknowledged in time"), "{log}");
}

/// Each connection uses a fresh MQTT client (never a clean session on one with messages in
/// flight): a command reply the broker never acknowledged is sent again on the next
/// connection, as a resumed session would.
#[test]
fn g14_a_reply_in_flight_when_the_connection_drops_is_sent_again_on_the_next() {
    let broker = ScriptedBroker::start(Script {
        withhold_puback: true,
        command: Some((
            "/command".into(),
            serde_json::json!({"command": "status", "request_id": "sb-resend"})
                .to_string()
                .into_bytes(),
        )),
        ..Script::default()
    });
    let node = node_on(&broker);
    assert_sent_again_on_the_next_connection(&broker, &node, "sb-resend");
}

/// A standalone node has no backend to acknowledge its workload statuses, so nothing else
/// sends one again: a completion the broker had not acknowledged when the connection dropped
/// goes out again on the next connection.
#[test]
fn g14_a_standalone_completion_in_flight_when_the_connection_drops_is_sent_again() {
    let broker = ScriptedBroker::start(Script {
        withhold_puback: true,
        command: start_command("inference"),
        ..Script::default()
    });
    let setup = setup_on(&broker);
    setup.write("cyberwave.yml", "cyberwave:\n  inference: echo hi\n");
    let node = setup.spawn();
    assert_sent_again_on_the_next_connection(&broker, &node, "completed");
}

// ---- a second real broker: rumqttd 0.20 ------------------------------------------------------

mod rumqttd {
    use std::time::Duration;

    use serde_json::json;

    use crate::support::rumqttd::Rumqttd;
    use crate::support::timeouts::{EXIT, RECONNECT};
    use crate::support::Scenario;

    /// Connect, registration, `status`, a workload printing 64 KiB lines to its completion
    /// (rumqttd drops a client that publishes more than its `max_payload_size`, which it never
    /// announces), and a broker restart: the node neither crashes nor storms.
    #[test]
    fn g14_rumqttd_serves_a_node_through_a_64k_line_flood_and_a_restart() {
        let mut rig = Scenario::new(
            "cyberwave:\n  training: |\n    for i in $(seq 40); do head -c 65536 /dev/zero | tr '\\0' z; echo; done\n    echo flood-done\n",
        )
        .broker(Rumqttd::start(100 * 1024))
        .rig();
        let mut node = rig.spawn();
        node.wait_ready(RECONNECT);
        let uuid = node.uuid();
        assert!(
            rig.cp.status(&uuid, "rq-1", RECONNECT).is_some(),
            "{}",
            node.log()
        );
        rig.cp.command(
            &uuid,
            json!({"command": "training", "request_id": "rq-2", "params": {"workload_uuid": "wl-rq"}}),
        );
        assert!(
            rig.cp
                .wait_status("wl-rq", "completed", Duration::from_secs(60))
                .is_some(),
            "{}\n{}",
            node.log(),
            rig.broker.log()
        );
        let logs: String = rig
            .cp
            .requests("logs")
            .iter()
            .filter(|r| r.body["workload_uuid"] == json!("wl-rq"))
            .filter_map(|r| r.body["log_content"].as_str().map(str::to_string))
            .collect();
        assert!(logs.contains("flood-done"), "the log's end arrived");
        let losses = node.log().matches("MQTT connection problem").count();
        assert!(losses <= 10, "{losses} connection losses:\n{}", node.log());
        // A broker restart (its sessions gone): back, and serving. A command published before
        // the node resubscribed is lost with the broker's session: ask until one is answered.
        rig.broker.restart();
        let answered = rig.cp.status_eventually(&uuid, "rq-3", RECONNECT);
        assert!(answered.is_some(), "{}", node.log());
        node.sigterm();
        assert!(node.wait_exit(EXIT).is_some());
    }
}
