//! Life on the wire: token check, registration, identity, heartbeat, reconnects, TLS, shutdown.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::node::{NodeSetup, TOKEN};
use crate::support::timeouts::{EXIT, READY, REPLY};
use crate::support::{backend_with, wait_for, Broker, ControlPlane, HeartbeatMode, TempDir};

#[test]
fn first_start_registers_and_second_start_reuses_the_identity() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    let mut node = setup.spawn();
    node.wait_ready(READY);
    let creates = cp.requests("request-instance");
    let registers = cp.requests("register");
    assert_eq!(creates.len(), 1, "one R1");
    assert_eq!(registers.len(), 1, "one R2");
    assert!(creates[0].at <= registers[0].at, "R1 before R2");
    assert_eq!(creates[0].id, TOKEN, "R1 carries the token in its topic");
    assert_eq!(creates[0].body["provider"], "self-hosted");
    assert_eq!(creates[0].body["profile_slug"], "default");
    assert_eq!(
        creates[0].api_token.as_deref(),
        Some(TOKEN),
        "X-API-Token user property"
    );
    assert!(creates[0].has_correlation);
    let uuid = node.uuid();
    assert_eq!(registers[0].id, uuid);
    let ident = node.identity().unwrap_or_default();
    assert!(ident["registered_at"].is_string(), "{ident}");
    node.sigterm();
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)));

    let mut again = setup.spawn();
    again.wait_ready(READY);
    assert_eq!(cp.requests("request-instance").len(), 1, "no second R1");
    let registers = cp.requests("register");
    assert_eq!(registers.len(), 2);
    assert_eq!(registers[1].id, uuid, "same instance re-registered");
    assert_eq!(again.uuid(), uuid);
    again.sigterm();
    assert_eq!(again.wait_exit(EXIT), Some(Some(0)));
}

#[test]
fn env_uuid_overrides_the_identity_file() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.home.write(
        ".cyberwave/instance_identity.json",
        r#"{"uuid":"file-uuid","slug":"file-slug"}"#,
    );
    setup.set("CYBERWAVE_CLOUD_NODE_INSTANCE_UUID", "env-uuid");
    let node = setup.spawn();
    node.wait_ready(READY);
    assert!(cp.requests("request-instance").is_empty());
    let r = cp.requests("register");
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].id, "env-uuid");
    assert_eq!(node.uuid(), "env-uuid");
}

#[test]
fn both_command_topics_answer_status_with_the_local_prefix() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "local");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_INFERENCE_CMD", "echo {body}");
    let node = setup.spawn();
    node.wait_ready(READY);
    assert!(cp.requests("register")[0]
        .topic
        .starts_with("localcyberwave/cloud-node/"));
    let by_uuid = cp
        .status(&node.uuid(), "s-uuid", REPLY)
        .expect("reply on the uuid topic");
    let by_slug = cp
        .status(&node.slug(), "s-slug", REPLY)
        .expect("reply on the slug topic");
    for r in [&by_uuid, &by_slug] {
        assert_eq!(r["status"], "ok");
        assert_eq!(r["instance_uuid"], node.uuid());
        assert_eq!(r["output"]["is_busy"], false);
        assert_eq!(r["output"]["has_inference"], true);
        assert_eq!(r["output"]["has_training"], false);
        assert!(r["output"]["active_workloads"].is_array(), "{r}");
    }
    assert_eq!(
        cp.reply_topic("s-slug").unwrap_or_default(),
        format!("localcyberwave/cloud-node/{}/response", node.uuid())
    );
}

#[test]
fn production_environment_means_no_prefix() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_ENVIRONMENT", "production");
    let node = setup.spawn();
    node.wait_ready(READY);
    assert!(cp.requests("register")[0]
        .topic
        .starts_with("cyberwave/cloud-node/"));
    assert!(cp.status(&node.uuid(), "p1", REPLY).is_some());
}

#[test]
fn g6_heartbeats_keep_cadence_and_commands_never_wait_behind_slow_replies() {
    let delay = Duration::from_millis(1500);
    let (broker, cp) = backend_with(|b| b.heartbeat = HeartbeatMode::Delay(delay));
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_HEARTBEAT_INTERVAL", "0.5");
    let node = setup.spawn();
    node.wait_ready(READY);
    let first = cp.wait_requests("heartbeat", 1, REPLY);
    assert!(!first.is_empty());
    // Status commands while heartbeat replies are outstanding.
    for i in 0..3 {
        std::thread::sleep(Duration::from_millis(400));
        let hb = cp.requests("heartbeat");
        let last_hb = hb.last().map(|r| r.at).unwrap_or_else(Instant::now);
        let rid = format!("slow-{i}");
        let sent = Instant::now();
        cp.command(
            &node.uuid(),
            json!({"command": "status", "request_id": rid}),
        );
        assert!(cp.wait_reply(&rid, REPLY).is_some());
        let answered = cp.reply_time(&rid).unwrap_or_else(Instant::now);
        assert!(
            answered < last_hb + delay,
            "status answered {:?} after sending, not before the pending heartbeat reply",
            answered - sent
        );
    }
    // Beats go on while their replies are late. (The cadence itself, ±10 % over an hour, is
    // unit-tested with a fake clock in node::session.)
    std::thread::sleep(Duration::from_millis(700));
    let hb = cp.requests("heartbeat");
    let span = hb.last().map(|l| l.at - hb[0].at).unwrap_or_default();
    let expected = (span.as_secs_f64() / 0.5) as usize;
    assert!(hb.len() >= 4, "{} heartbeats over {span:?}", hb.len());
    assert!(
        hb.len() + 1 >= expected,
        "{} heartbeats over {span:?}: cadence slipped",
        hb.len()
    );
    for w in hb.windows(2) {
        let gap = w[1].at - w[0].at;
        assert!(gap < Duration::from_millis(900), "heartbeat gap {gap:?}");
    }
    let body = &hb[0].body;
    for field in [
        "node_version",
        "active_workloads",
        "max_concurrent_workloads",
        "accepting",
        "draining",
        "uptime_s",
    ] {
        assert!(body.get(field).is_some(), "heartbeat lacks {field}: {body}");
    }
}

#[test]
fn reconnects_and_resubscribes_after_a_broker_outage() {
    let mut broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let node = NodeSetup::new(&broker, &cp).spawn();
    node.wait_ready(READY);
    assert!(cp.status(&node.uuid(), "before", REPLY).is_some());
    broker.stop();
    // Long enough for several refused reconnects (the tests' back-off is at most 0.5 s; its
    // growth and cap are unit-tested in node::session).
    std::thread::sleep(Duration::from_secs(2));
    broker.restart(); // a fresh broker: the node's session is gone
    let back = Instant::now();
    let mut answered = None;
    for i in 0..30 {
        let rid = format!("after-{i}");
        if cp
            .status(&node.uuid(), &rid, Duration::from_millis(500))
            .is_some()
        {
            answered = Some(back.elapsed());
            break;
        }
    }
    let took = answered
        .unwrap_or_else(|| panic!("no status answered after the outage; log:\n{}", node.log()));
    assert!(took < Duration::from_secs(15), "took {took:?}");
    assert!(
        node.log().contains("MQTT connection problem"),
        "{}",
        node.log()
    );
    assert!(
        node.log().contains("connection refused"),
        "the reason is logged: {}",
        node.log()
    );
}

#[test]
fn g1_a_command_sent_while_the_node_is_down_is_answered_once_after_restart() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    let mut node = setup.spawn();
    node.wait_ready(READY);
    let uuid = node.uuid();
    node.kill9();
    cp.command(
        &uuid,
        json!({"command": "status", "request_id": "while-down"}),
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(cp.replies_for("while-down").is_empty());
    let again = setup.spawn();
    again.wait_ready(READY);
    assert!(
        cp.wait_reply("while-down", REPLY).is_some(),
        "queued command answered; log:\n{}",
        again.log()
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        cp.replies_for("while-down").len(),
        1,
        "answered exactly once"
    );
    assert!(again.log().contains("session resumed"), "{}", again.log());
}

#[test]
fn persistent_heartbeat_401_exits_3() {
    let (broker, cp) = backend_with(|b| {
        b.heartbeat = HeartbeatMode::Code(401, "token revoked");
    });
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_HEARTBEAT_INTERVAL", "0.2");
    setup.set("CYBERWAVE_NODE_AUTH_RETRY_BASE_SECONDS", "0.05");
    let mut node = setup.spawn();
    assert_eq!(
        node.wait_exit(Duration::from_secs(20)),
        Some(Some(3)),
        "{}",
        node.log()
    );
    assert_eq!(
        cp.requests("heartbeat").len(),
        5,
        "five attempts, then stop"
    );
    assert!(node.log().contains("invalid or revoked"), "{}", node.log());
}

#[test]
fn token_rejected_at_start_exits_3_without_retrying() {
    let (broker, cp) = backend_with(|b| {
        b.token_status = 401;
    });
    let mut node = NodeSetup::new(&broker, &cp).spawn();
    let started = Instant::now();
    assert_eq!(node.wait_exit(EXIT), Some(Some(3)), "{}", node.log());
    assert!(started.elapsed() < Duration::from_secs(5));
    let hits = cp.http_hits();
    assert_eq!(hits.len(), 1, "no retry: {hits:?}");
    assert_eq!(
        hits[0].1.as_deref(),
        Some(format!("Token {TOKEN}").as_str())
    );
    let log = node.log();
    assert!(
        log.contains("cw_…cdef") && log.contains("env CYBERWAVE_API_KEY"),
        "{log}"
    );
    assert!(!log.contains(TOKEN), "the token never reaches the log");
    assert!(
        cp.all_requests().is_empty(),
        "no MQTT request after a rejected token"
    );
}

#[test]
fn backend_down_at_start_still_becomes_ready() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set(
        "CYBERWAVE_BASE_URL",
        &format!("http://127.0.0.1:{}", crate::support::free_port()),
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    assert!(
        node.wait_log("could not validate the API token", REPLY),
        "{}",
        node.log()
    );
}

#[test]
fn sigterm_sends_terminate_and_refuses_commands_meanwhile() {
    let (broker, cp) = backend_with(|b| {
        b.terminate_delay = Duration::from_millis(2500);
    });
    let mut node = NodeSetup::new(&broker, &cp).spawn();
    node.wait_ready(READY);
    node.sigterm();
    assert!(node.wait_log("shutting down", REPLY));
    let reply = cp
        .status(&node.uuid(), "during-shutdown", REPLY)
        .expect("error reply");
    assert_eq!(reply["status"], "error");
    assert!(
        reply["error"]
            .as_str()
            .unwrap_or_default()
            .contains("shutting down"),
        "{reply}"
    );
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)));
    assert_eq!(cp.requests("terminate").len(), 1, "R5 sent once");
}

#[test]
fn sigterm_exits_promptly_when_the_broker_is_healthy() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut node = NodeSetup::new(&broker, &cp).spawn();
    node.wait_ready(READY);
    let t = Instant::now();
    node.sigterm();
    assert_eq!(
        node.wait_exit(Duration::from_secs(5)),
        Some(Some(0)),
        "{}",
        node.log()
    );
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(cp.requests("terminate").len(), 1);
}

#[test]
fn a_second_signal_exits_at_once() {
    let (broker, cp) = backend_with(|b| {
        b.mute = false;
        b.terminate_delay = Duration::from_secs(30);
    });
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_NODE_SHUTDOWN_FLUSH_SECONDS", "30");
    let mut node = setup.spawn();
    node.wait_ready(READY);
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
fn install_script_failure_is_reported_and_exits_1() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  install: echo preparing; echo 'pip exploded' >&2; exit 7\n",
    );
    let mut node = setup.spawn();
    assert_eq!(
        node.wait_exit(Duration::from_secs(15)),
        Some(Some(1)),
        "{}",
        node.log()
    );
    let fails = cp.requests("fail");
    assert_eq!(fails.len(), 1, "R6 sent: {:?}", cp.all_requests());
    let err = fails[0].body["error"].as_str().unwrap_or_default();
    assert!(
        err.contains("exit code 7") && err.contains("pip exploded"),
        "{err}"
    );
    assert!(
        node.log().contains("[install stdout] preparing"),
        "{}",
        node.log()
    );
    let logged =
        std::fs::read_to_string(setup.config_dir().join("install_logs/install.stderr.log"))
            .unwrap_or_default();
    assert!(logged.contains("pip exploded"));
}

#[test]
fn missing_install_script_is_a_clear_error() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write("cyberwave.yml", "cyberwave:\n  install: ./setup.sh --gpu\n");
    let mut node = setup.spawn();
    assert_eq!(
        node.wait_exit(Duration::from_secs(15)),
        Some(Some(1)),
        "{}",
        node.log()
    );
    assert!(
        node.log().contains("install script ./setup.sh not found"),
        "{}",
        node.log()
    );
    let fails = cp.requests("fail");
    assert_eq!(fails.len(), 1);
    assert!(fails[0].body["error"]
        .as_str()
        .unwrap_or_default()
        .contains("not found"));
}

#[test]
fn a_good_install_script_runs_before_registration() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "install.sh",
        "#!/bin/sh\necho installing\necho \"token:${CYBERWAVE_API_KEY:-none}\" > installed.txt\n",
    );
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  install: bash ./install.sh\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let marker = std::fs::read_to_string(setup.cwd.join("installed.txt")).unwrap_or_default();
    assert_eq!(
        marker.trim(),
        "token:none",
        "the node's token is not handed to the install script"
    );
    // Its output is shipped to the backend once registered.
    let logs = cp.wait_requests("logs", 1, REPLY);
    let install: Vec<_> = logs
        .iter()
        .filter(|r| r.body["source"] == "install")
        .collect();
    assert_eq!(install.len(), 1, "{logs:?}");
    assert_eq!(
        install[0].body["log_content"], "installing",
        "no trailing newline (protocol §2.6.4)"
    );
}

#[test]
fn environment_reservation_is_sent_and_enforced() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_NODE_ENVIRONMENT_UUID", "env-from-var");
    setup.set("CYBERWAVE_INFERENCE_CMD", "echo {body}");
    setup.arg("--environment").arg("env-from-flag");
    let node = setup.spawn();
    node.wait_ready(READY);
    assert_eq!(
        cp.requests("request-instance")[0].body["environment_uuid"],
        "env-from-flag"
    );
    assert_eq!(
        cp.requests("register")[0].body["environment_uuid"],
        "env-from-flag"
    );
    cp.command(
        &node.uuid(),
        json!({"command": "inference", "request_id": "wrong-env", "params": {"environment_uuid": "other-env"}}),
    );
    let r = cp.wait_reply("wrong-env", REPLY).expect("reply");
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
fn g5_bad_commands_get_clear_errors_and_the_node_keeps_serving() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let node = NodeSetup::new(&broker, &cp).spawn();
    node.wait_ready(READY);
    let uuid = node.uuid();
    cp.command_raw(&uuid, b"{not json".to_vec());
    cp.command(&uuid, json!({"request_id": "no-command"}));
    cp.command(&uuid, json!({"command": "reboot", "request_id": "unknown"}));
    cp.command(
        &uuid,
        json!({"command": "training", "request_id": "bad-params", "params": [1, 2]}),
    );
    cp.command(&uuid, json!({"status": "ok", "request_id": "echo"}));
    for (rid, needle) in [
        ("no-command", "no 'command' field"),
        ("unknown", "Unknown command: reboot"),
        ("bad-params", "params must be a JSON object"),
    ] {
        let r = cp
            .wait_reply(rid, REPLY)
            .unwrap_or_else(|| panic!("no reply to {rid}"));
        assert_eq!(r["status"], "error", "{r}");
        assert!(
            r["error"].as_str().unwrap_or_default().contains(needle),
            "{r}"
        );
    }
    assert!(cp.status(&uuid, "still-alive", REPLY).is_some());
    assert!(cp.replies_for("echo").is_empty(), "echoes are ignored");
    assert!(node.log().contains("not valid JSON"), "{}", node.log());
}

/// D64: a command refused before its params are read (nested deeper than serde_json goes, cut
/// short, over `CYBERWAVE_NODE_MAX_COMMAND_BYTES`) still gets its error reply, and a `failed`
/// status when it is a start that names its workload: the backend never waits for its own
/// timeout. What cannot be read soundly gets nothing.
#[test]
fn g5_d64_a_command_refused_before_its_params_are_read_gets_its_reply_and_a_failed_status() {
    let (_broker, cp, mut setup) = crate::support::rig("cyberwave:\n  inference: 'true'\n");
    setup.set("CYBERWAVE_NODE_MAX_COMMAND_BYTES", "1048576");
    let node = setup.spawn();
    node.wait_ready(READY);
    let uuid = node.uuid();
    let deep = format!(
        r#"{{"command":"inference","request_id":"deep","params":{{"workload_uuid":"wl-deep","x":{}{}}}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    cp.command_raw(&uuid, deep.into_bytes());
    cp.command_raw(
        &uuid,
        br#"{"request_id":"cut","command":"training","params":{"workload_uuid":"wl-cut","x":[1,"#
            .to_vec(),
    );
    let big = format!(
        r#"{{"request_id":"big","command":"simulate","params":{{"workload_uuid":"wl-big","image_bytes_base64":"{}"}}}}"#,
        "A".repeat(2 << 20)
    );
    cp.command_raw(&uuid, big.into_bytes());
    // A cancel names a workload to act on, not one that failed: a reply, no status.
    let cancel = format!(
        r#"{{"command":"cancel","request_id":"deep-cancel","params":{{"workload_uuid":"wl-other","x":{}{}}}}}"#,
        "{\"a\":".repeat(200),
        "}".repeat(200)
    );
    cp.command_raw(&uuid, cancel.into_bytes());
    // Read twice: which one is meant? No reply.
    cp.command_raw(
        &uuid,
        br#"{"request_id":"twice","request_id":"twice","command":"inference","params":{"workload_uuid":"wl-twice","#
            .to_vec(),
    );
    for (rid, wl, needle) in [
        ("deep", Some("wl-deep"), "recursion limit"),
        ("cut", Some("wl-cut"), "not valid JSON"),
        ("big", Some("wl-big"), "the limit is 1048576"),
        ("deep-cancel", None, "recursion limit"),
    ] {
        let r = cp
            .wait_reply(rid, REPLY)
            .unwrap_or_else(|| panic!("no reply to {rid}; log:\n{}", node.log()));
        assert_eq!(r["status"], "error", "{r}");
        assert!(
            r["error"].as_str().unwrap_or_default().contains(needle),
            "{r}"
        );
        if let Some(wl) = wl {
            let st = cp
                .wait_status(wl, "failed", REPLY)
                .unwrap_or_else(|| panic!("no failed status for {wl}; log:\n{}", node.log()));
            let last = st.last().cloned().unwrap_or_default();
            assert!(
                last["error"].as_str().unwrap_or_default().contains(needle),
                "{last}"
            );
        }
    }
    assert!(cp.statuses("wl-other").is_empty(), "a cancel fails nothing");
    assert!(cp.status(&uuid, "still-alive", REPLY).is_some());
    assert!(cp.replies_for("twice").is_empty());
    assert!(cp.statuses("wl-twice").is_empty());
}

/// D64: a preview sends its image inline; a command of up to 32 MiB (the default limit) goes
/// through the broker and the node's client and runs; one over it is refused with its reply
/// and a `failed` status.
#[test]
fn g5_d64_a_start_of_31_mib_runs_and_one_of_33_mib_gets_its_reply_and_a_failed_status() {
    let (_broker, cp, setup) = crate::support::rig("cyberwave:\n  inference: 'true'\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    let uuid = node.uuid();
    let start = |rid: &str, wl: &str, mib: usize| {
        format!(
            r#"{{"request_id":"{rid}","command":"inference","params":{{"workload_uuid":"{wl}","image_bytes_base64":"{}"}}}}"#,
            "QUFB".repeat(mib << 18)
        )
        .into_bytes()
    };
    cp.command_raw(&uuid, start("inline", "wl-inline", 31));
    let r = cp
        .wait_reply("inline", DONE_BIG)
        .expect("a reply to the 31 MiB start");
    assert_eq!(r["status"], "ok", "{r}");
    assert!(cp.wait_status("wl-inline", "completed", DONE_BIG).is_some());
    cp.command_raw(&uuid, start("over", "wl-over", 33));
    let r = cp
        .wait_reply("over", DONE_BIG)
        .expect("a reply to the 33 MiB start");
    assert_eq!(r["status"], "error", "{r}");
    assert!(
        r["error"].as_str().unwrap_or_default().contains("limit"),
        "{r}"
    );
    assert!(cp.wait_status("wl-over", "failed", REPLY).is_some());
    assert!(cp.status(&uuid, "still-alive", REPLY).is_some());
}

/// Long enough for tens of MiB through the broker and a debug build's JSON parser.
const DONE_BIG: Duration = Duration::from_secs(60);

#[test]
fn standalone_needs_no_backend() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.unset("CYBERWAVE_API_KEY");
    setup.arg("--standalone").arg("--slug").arg("lab-gpu");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    let uuid = node.uuid();
    assert!(!uuid.is_empty());
    assert!(cp.status(&uuid, "sa-1", REPLY).is_some());
    assert!(cp.status("lab-gpu", "sa-2", REPLY).is_some());
    node.sigterm();
    assert_eq!(node.wait_exit(Duration::from_secs(5)), Some(Some(0)));
    assert!(
        cp.all_requests().is_empty(),
        "no backend requests: {:?}",
        cp.all_requests()
    );
    assert!(cp.http_hits().is_empty());
    // The identity persists across restarts.
    let again = setup.spawn();
    again.wait_ready(READY);
    assert_eq!(again.uuid(), uuid);
}

// ---- TLS --------------------------------------------------------------------------------------

struct Pki {
    dir: TempDir,
}

impl Pki {
    fn new() -> Pki {
        let dir = TempDir::new("pki");
        let sh = |script: &str| {
            let ok = Command::new("sh")
                .arg("-c")
                .arg(script)
                .current_dir(dir.path())
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false);
            assert!(ok, "openssl failed: {script}");
        };
        sh("openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=cw-test-ca 2>/dev/null");
        for (name, san) in [
            ("good", "DNS:localhost,IP:127.0.0.1"),
            ("wrong", "DNS:other.example"),
        ] {
            sh(&format!(
                "openssl req -newkey rsa:2048 -nodes -keyout {name}.key -out {name}.csr -subj /CN={name} 2>/dev/null && \
                 printf 'subjectAltName={san}\\n' > {name}.ext && \
                 openssl x509 -req -in {name}.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out {name}.pem -days 2 -extfile {name}.ext 2>/dev/null"
            ));
        }
        // mosquitto started as root drops to its own user: it must be able to read the key.
        sh("chmod 644 good.key wrong.key");
        Pki { dir }
    }

    fn broker(&self, name: &str) -> Broker {
        Broker::start_tls(
            self.dir.join("ca.pem"),
            self.dir.join(&format!("{name}.pem")),
            self.dir.join(&format!("{name}.key")),
        )
    }
}

fn tls_node(broker: &Broker, ca: Option<&std::path::Path>) -> crate::support::NodeProcess {
    let mut setup = NodeSetup::bare();
    setup.set("CYBERWAVE_MQTT_HOST", "127.0.0.1");
    setup.set("CYBERWAVE_MQTT_PORT", &broker.port.to_string());
    setup.set("CYBERWAVE_MQTT_USE_TLS", "true");
    if let Some(ca) = ca {
        setup.set("CYBERWAVE_MQTT_TLS_CA_CERTS", &ca.display().to_string());
    }
    setup.arg("--standalone");
    setup.spawn()
}

#[test]
fn tls_connects_with_the_right_ca_and_refuses_otherwise() {
    let pki = Pki::new();
    let good = pki.broker("good");
    let node = tls_node(&good, Some(&pki.dir.join("ca.pem")));
    node.wait_ready(READY);
    assert!(node.log().contains("(TLS)"), "{}", node.log());
    drop(node);

    // A certificate for another host name.
    let wrong = pki.broker("wrong");
    let node = tls_node(&wrong, Some(&pki.dir.join("ca.pem")));
    assert!(node.wait_log("TLS handshake", READY), "{}", node.log());
    assert!(!node.log().contains("node ready"));
    assert!(node.log().contains("another host name"), "{}", node.log());
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
            .arg(pki.dir.join("good.pem"))
            .arg("-key")
            .arg(pki.dir.join("good.key"))
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
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set(
        "CYBERWAVE_BASE_URL",
        &format!("https://127.0.0.1:{}", https.1),
    );
    setup.set(
        "SSL_CERT_FILE",
        &pki.dir.join("ca.pem").display().to_string(),
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    assert!(
        node.log().contains("accepted by https://127.0.0.1"),
        "{}",
        node.log()
    );
    drop(node);
    // Without the test CA, the real system store does not trust the server: a warning, not a stop.
    setup.unset("SSL_CERT_FILE");
    let node = setup.spawn();
    node.wait_ready(READY);
    assert!(
        node.wait_log("could not validate the API token", REPLY),
        "{}",
        node.log()
    );
}

#[test]
fn g11_systemd_hears_ready_after_subscribing_watchdog_on_heartbeats_and_stopping() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    let sock_path = setup.home.join("notify.sock");
    let sock = std::os::unix::net::UnixDatagram::bind(&sock_path).expect("bind notify socket");
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    setup.set("NOTIFY_SOCKET", &sock_path.display().to_string());
    setup.set("CYBERWAVE_HEARTBEAT_INTERVAL", "0.3");
    let mut node = setup.spawn();
    let mut got: Vec<String> = Vec::new();
    let mut buf = [0u8; 256];
    let end = Instant::now() + READY;
    while Instant::now() < end && !got.iter().any(|m| m == "WATCHDOG=1") {
        if let Ok(n) = sock.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }
    assert_eq!(got.first().map(String::as_str), Some("READY=1"), "{got:?}");
    assert!(
        node.wait_log("node ready", REPLY),
        "READY=1 comes with readiness"
    );
    assert!(
        got.iter().any(|m| m == "WATCHDOG=1"),
        "fed by acknowledged heartbeats: {got:?}"
    );
    // No watchdog pings while heartbeats are refused.
    cp.set_behaviour(|b| b.heartbeat = HeartbeatMode::Code(500, "backend trouble"));
    std::thread::sleep(Duration::from_millis(700));
    while sock.recv(&mut buf).is_ok() {}
    let quiet_from = Instant::now();
    let mut pings = 0;
    while quiet_from.elapsed() < Duration::from_millis(1200) {
        if let Ok(n) = sock.recv(&mut buf) {
            if &buf[..n] == b"WATCHDOG=1" {
                pings += 1;
            }
        }
    }
    assert_eq!(
        pings, 0,
        "the watchdog is fed only while heartbeats succeed"
    );
    node.sigterm();
    let mut stopping = false;
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end && !stopping {
        if let Ok(n) = sock.recv(&mut buf) {
            stopping = &buf[..n] == b"STOPPING=1";
        }
    }
    assert!(stopping, "STOPPING=1 on shutdown");
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)));
}

#[test]
fn bad_broker_credentials_are_named_in_the_log() {
    let broker = Broker::start_with_password("node-user", "right-password");
    let mut setup = NodeSetup::bare();
    setup.set("CYBERWAVE_MQTT_HOST", "127.0.0.1");
    setup.set("CYBERWAVE_MQTT_PORT", &broker.port.to_string());
    setup.set("CYBERWAVE_MQTT_USERNAME", "node-user");
    setup.set("CYBERWAVE_MQTT_PASSWORD", "wrong-password");
    setup.arg("--standalone");
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
    let mut setup = NodeSetup::bare();
    setup.set("CYBERWAVE_MQTT_HOST", "127.0.0.1");
    setup.set("CYBERWAVE_MQTT_PORT", &broker.port.to_string());
    setup.set("CYBERWAVE_MQTT_USERNAME", "mqttcyb");
    setup.set("CYBERWAVE_MQTT_PASSWORD", token);
    setup.arg("--standalone");
    let node = setup.spawn();
    node.wait_ready(READY);
}
