//! The broker connection: reconnects after an outage or a restart loop (which is no copied
//! state dir), commands queued while the node was down, several endpoints of a clustered broker,
//! TLS, the broker's credentials, and the token check over HTTPS.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::node::NodeSetup;
use crate::support::timeouts::{READY, RECONNECT, REPLY};
use crate::support::tls::Pki;
use crate::support::{wait_for, Broker, Scenario};

#[test]
fn reconnects_and_resubscribes_after_a_broker_outage() {
    let (mut rig, node) = Scenario::default().node();
    assert!(rig.cp.status(&node.uuid(), "before", REPLY).is_some());
    rig.broker.stop();
    // Long enough for several refused reconnects (the tests' back-off is at most 0.5 s; its
    // growth and cap are unit-tested in node::session).
    std::thread::sleep(Duration::from_secs(2));
    rig.broker.restart(); // a fresh broker: the node's session is gone
    let back = Instant::now();
    let answered = rig.cp.status_eventually(&node.uuid(), "after", RECONNECT);
    assert!(
        answered.is_some(),
        "no status answered after the outage; log:\n{}",
        node.log()
    );
    let took = back.elapsed();
    assert!(took < Duration::from_secs(15), "took {took:?}");
    node.assert_logged("MQTT connection problem");
    assert!(
        node.log().contains("connection refused"),
        "the reason is logged: {}",
        node.log()
    );
}

#[test]
fn g1_a_command_sent_while_the_node_is_down_is_answered_once_after_restart() {
    let (rig, mut node) = Scenario::default().node();
    let uuid = node.uuid();
    node.kill9();
    rig.cp.command(
        &uuid,
        json!({"command": "status", "request_id": "while-down"}),
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(rig.cp.replies_for("while-down").is_empty());
    let again = rig.node();
    assert!(
        rig.cp.wait_reply("while-down", REPLY).is_some(),
        "queued command answered; log:\n{}",
        again.log()
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        rig.cp.replies_for("while-down").len(),
        1,
        "answered exactly once"
    );
    again.assert_logged("session resumed");
}

const ACCUSED: &str = "another client uses this node's MQTT client id";

/// D33: a broker that restarts three times within a minute (a crash loop, a rolling update of a
/// broker cluster) closes connections right after accepting them. That is no copy of the state
/// dir on another host (no 0x8E was sent): no ERROR telling the operator to delete the node's
/// identity, no `client_id_conflict` marker for `doctor` to FAIL on, no 30 s wait before the
/// next connect.
#[test]
fn g11_d33_a_broker_restart_loop_is_not_reported_as_a_duplicate_client_id() {
    let (mut rig, node) = Scenario::new("cyberwave:\n  training: sleep 1\n").node();
    // The n-th connection, or the accusation (after which the node waits 30 s to reconnect).
    let connects = |n: usize| {
        wait_for(Duration::from_secs(10), || {
            let log = node.log();
            (log.matches("connected to MQTT broker").count() >= n || log.contains(ACCUSED))
                .then_some(())
        })
        .is_some()
    };
    assert!(connects(1), "{}", node.log());
    for i in 2..=4 {
        rig.broker.restart();
        assert!(connects(i), "reconnect {i}; log:\n{}", node.log());
    }
    assert!(
        !node.log().contains(ACCUSED),
        "a broker restart loop was reported as a copied state dir:\n{}",
        node.log()
    );
    assert!(
        !rig.state("client_id_conflict").exists(),
        "doctor would FAIL on a duplicate client id that does not exist"
    );
    // It still serves once it is back.
    let answered =
        rig.cp
            .status_eventually(&node.uuid(), "after-restarts", Duration::from_secs(10));
    assert!(
        answered.is_some(),
        "no status reply within 10 s after the broker came back:\n{}",
        node.log()
    );
}

// ---- several endpoints: CYBERWAVE_MQTT_HOST lists the addresses of a clustered broker ------

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
    let mut a = Broker::start_bridged(hub.port);
    let mut b = Broker::start_bridged(hub.port);
    let rig = Scenario::new(
        "cyberwave:\n  inference: |\n    while [ ! -f go ]; do sleep 0.05; done\n    echo finished\n    exit 3\n",
    )
    .env(
        "CYBERWAVE_MQTT_HOST",
        &format!(" 127.0.0.1:{} ,127.0.0.1:{}", a.port, b.port),
    )
    .broker(hub)
    .rig();
    let node = rig.spawn();
    node.wait_ready(RECONNECT);
    let uuid = node.uuid();
    let client_id = std::fs::read_to_string(rig.state("node_id")).ok();
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
        rig.cp.command(
            &uuid,
            json!({"command": "inference", "request_id": "ep-1", "params": {"workload_uuid": "wl-ep"}}),
        );
        rig.cp.wait_reply("ep-1", Duration::from_secs(2))
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
    let r = rig
        .cp
        .status_eventually(&uuid, "ep-status", RECONNECT)
        .expect("no status answered");
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["output"]["instance_uuid"], uuid.as_str());
    assert_eq!(node.uuid(), uuid);
    assert_eq!(
        std::fs::read_to_string(rig.state("node_id")).ok(),
        client_id,
        "the client id is kept"
    );

    // The workload started on the first endpoint completes through the second.
    rig.touch("go");
    let all = rig
        .cp
        .wait_status("wl-ep", "completed", RECONNECT)
        .unwrap_or_else(|| {
            panic!(
                "no completion: {:?}\n{}",
                rig.cp.statuses("wl-ep"),
                node.log()
            )
        });
    let done: Vec<_> = all.iter().filter(|s| s["status"] == "completed").collect();
    assert_eq!(done.len(), 1, "{all:?}");
    assert_eq!(done[0]["exit_code"], 3);
}

#[test]
fn a_bad_endpoint_list_is_refused_at_start_with_a_clear_error() {
    let rig = Scenario::default().rig();
    for (list, says) in [
        ("127.0.0.1:1883,,127.0.0.1:1884", "entry 2"),
        ("127.0.0.1:0", "1 to 65535"),
        ("bröker.example", "ASCII"),
        ("::1", "brackets"),
    ] {
        let mut setup = rig.setup.clone();
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
    let mut setup = rig.setup.clone();
    setup.set("CYBERWAVE_MQTT_HOST", &vec!["h"; 1000].join(","));
    let mut node = setup.spawn();
    node.wait_exit(RECONNECT).expect("the node exits");
    let log = node.log();
    assert!(log.contains("1000") && log.contains("at most"), "{log}");
    assert!(log.len() < 10_000, "the error does not echo the whole list");
}

// ---- TLS and credentials ---------------------------------------------------------------------

/// A standalone node on a TLS broker, trusting `ca` (or only the system's trust store).
fn tls_node(broker: &Broker, ca: Option<&std::path::Path>) -> crate::support::NodeProcess {
    let mut setup = NodeSetup::standalone(broker.port);
    setup.set("CYBERWAVE_MQTT_USE_TLS", "true");
    if let Some(ca) = ca {
        setup.set("CYBERWAVE_MQTT_TLS_CA_CERTS", &ca.display().to_string());
    }
    setup.spawn()
}

#[test]
fn tls_connects_with_the_right_ca_and_refuses_otherwise() {
    let pki = Pki::new();
    let good = pki.broker("good");
    let node = tls_node(&good, Some(&pki.ca()));
    node.wait_ready(READY);
    node.assert_logged("(TLS)");
    drop(node);

    // A certificate for another host name.
    let wrong = pki.broker("wrong");
    let node = tls_node(&wrong, Some(&pki.ca()));
    assert!(node.wait_log("TLS handshake", READY), "{}", node.log());
    assert!(!node.log().contains("node ready"));
    node.assert_logged("another host name");
    drop(node);

    // Without the test CA the system trust store does not know the broker.
    let node = tls_node(&good, None);
    assert!(node.wait_log("TLS handshake", READY), "{}", node.log());
    assert!(!node.log().contains("node ready"));
}

/// An HTTPS stand-in for the REST API (`openssl s_server -www` answers any GET with 200).
struct HttpsServer(std::process::Child, u16);

impl HttpsServer {
    fn start(pki: &Pki) -> HttpsServer {
        let port = crate::support::free_port();
        let child = Command::new("openssl")
            .args(["s_server", "-quiet", "-www", "-accept", &port.to_string()])
            .arg("-cert")
            .arg(pki.cert("good"))
            .arg("-key")
            .arg(pki.key("good"))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("openssl s_server");
        let up = wait_for(Duration::from_secs(5), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).ok()
        });
        assert!(up.is_some(), "s_server did not start");
        HttpsServer(child, port)
    }
}

impl Drop for HttpsServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_token_check_over_https_verifies_against_the_system_trust_store() {
    let pki = Pki::new();
    let https = HttpsServer::start(&pki);
    let mut rig = Scenario::default()
        .env(
            "CYBERWAVE_BASE_URL",
            &format!("https://127.0.0.1:{}", https.1),
        )
        .env("SSL_CERT_FILE", &pki.ca().display().to_string())
        .rig();
    let node = rig.node();
    node.assert_logged("accepted by https://127.0.0.1");
    drop(node);
    // Without the test CA, the real system store does not trust the server: a warning, not a stop.
    rig.setup.unset("SSL_CERT_FILE");
    let node = rig.node();
    node.assert_logged("could not validate the API token");
}

#[test]
fn bad_broker_credentials_are_named_in_the_log() {
    let broker = Broker::start_with_password("node-user", "right-password");
    let mut setup = NodeSetup::standalone(broker.port);
    setup.set("CYBERWAVE_MQTT_USERNAME", "node-user");
    setup.set("CYBERWAVE_MQTT_PASSWORD", "wrong-password");
    let node = setup.spawn();
    assert!(
        node.wait_log("rejected the credentials", READY),
        "{}",
        node.log()
    );
    assert!(!node.log().contains("node ready"));
    assert!(
        !node.log().contains("wrong-password"),
        "the password never reaches the log"
    );
    drop(node);
    setup.set("CYBERWAVE_MQTT_PASSWORD", "right-password");
    let node = setup.spawn();
    node.wait_ready(READY);
}

#[test]
fn the_sdk_placeholder_username_connects_as_the_token_hash() {
    let token = "cw_placeholder_token_0123456789";
    // The broker knows only `cwh_` + SHA-256 of the token (computed here by coreutils).
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("printf %s '{token}' | sha256sum"))
        .output()
        .expect("sha256sum");
    let hash = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    assert_eq!(hash.len(), 64, "{out:?}");
    let broker = Broker::start_with_password(&format!("cwh_{hash}"), token);
    let mut setup = NodeSetup::standalone(broker.port);
    setup.set("CYBERWAVE_MQTT_USERNAME", "mqttcyb");
    setup.set("CYBERWAVE_MQTT_PASSWORD", token);
    let node = setup.spawn();
    node.wait_ready(READY);
}
