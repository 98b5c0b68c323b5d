//! The node's session with the platform: the token check, registration and its identity,
//! heartbeats, the topic prefix and workspace scoping, systemd's readiness and watchdog, and a
//! standalone node that needs no backend.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::node::TOKEN;
use crate::support::timeouts::{EXIT, READY, REPLY};
use crate::support::{wait_for, HeartbeatMode, Scenario};

#[test]
fn first_start_registers_and_second_start_reuses_the_identity() {
    let (rig, mut node) = Scenario::default().node();
    let creates = rig.cp.requests("request-instance");
    let registers = rig.cp.requests("register");
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

    let mut again = rig.node();
    assert_eq!(rig.cp.requests("request-instance").len(), 1, "no second R1");
    let registers = rig.cp.requests("register");
    assert_eq!(registers.len(), 2);
    assert_eq!(registers[1].id, uuid, "same instance re-registered");
    assert_eq!(again.uuid(), uuid);
    again.sigterm();
    assert_eq!(again.wait_exit(EXIT), Some(Some(0)));
}

#[test]
fn env_uuid_overrides_the_identity_file() {
    let rig = Scenario::default()
        .env("CYBERWAVE_CLOUD_NODE_INSTANCE_UUID", "env-uuid")
        .rig();
    rig.setup.plant(
        "instance_identity.json",
        r#"{"uuid":"file-uuid","slug":"file-slug"}"#,
    );
    let node = rig.node();
    assert!(rig.cp.requests("request-instance").is_empty());
    let r = rig.cp.requests("register");
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].id, "env-uuid");
    assert_eq!(node.uuid(), "env-uuid");
}

#[test]
fn both_command_topics_answer_status_with_the_local_prefix() {
    let (rig, node) = Scenario::default()
        .prefix("local")
        .env("CYBERWAVE_INFERENCE_CMD", "echo {body}")
        .node();
    assert!(rig.cp.requests("register")[0]
        .topic
        .starts_with("localcyberwave/cloud-node/"));
    let by_uuid = rig
        .cp
        .status(&node.uuid(), "s-uuid", REPLY)
        .expect("reply on the uuid topic");
    let by_slug = rig
        .cp
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
        rig.cp.reply_topic("s-slug").unwrap_or_default(),
        format!("localcyberwave/cloud-node/{}/response", node.uuid())
    );
}

#[test]
fn production_environment_means_no_prefix() {
    let (rig, node) = Scenario::default()
        .env("CYBERWAVE_ENVIRONMENT", "production")
        .node();
    assert!(rig.cp.requests("register")[0]
        .topic
        .starts_with("cyberwave/cloud-node/"));
    assert!(rig.cp.status(&node.uuid(), "p1", REPLY).is_some());
}

#[test]
fn g6_heartbeats_keep_cadence_and_commands_never_wait_behind_slow_replies() {
    let delay = Duration::from_millis(1500);
    let (rig, node) = Scenario::default()
        .backend(|b| b.heartbeat = HeartbeatMode::Delay(delay))
        .env("CYBERWAVE_HEARTBEAT_INTERVAL", "0.5")
        .node();
    let first = rig.cp.wait_requests("heartbeat", 1, REPLY);
    assert!(!first.is_empty());
    // Status commands while heartbeat replies are outstanding.
    for i in 0..3 {
        std::thread::sleep(Duration::from_millis(400));
        let hb = rig.cp.requests("heartbeat");
        let last_hb = hb.last().map(|r| r.at).unwrap_or_else(Instant::now);
        let rid = format!("slow-{i}");
        let sent = Instant::now();
        rig.cp.command(
            &node.uuid(),
            json!({"command": "status", "request_id": rid}),
        );
        assert!(rig.cp.wait_reply(&rid, REPLY).is_some());
        let answered = rig.cp.reply_time(&rid).unwrap_or_else(Instant::now);
        assert!(
            answered < last_hb + delay,
            "status answered {:?} after sending, not before the pending heartbeat reply",
            answered - sent
        );
    }
    // Beats go on while their replies are late. (The cadence itself, ±10 % over an hour, is
    // unit-tested with a fake clock in node::session.)
    std::thread::sleep(Duration::from_millis(700));
    let hb = rig.cp.requests("heartbeat");
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
fn persistent_heartbeat_401_exits_3() {
    let rig = Scenario::default()
        .backend(|b| b.heartbeat = HeartbeatMode::Code(401, "token revoked"))
        .env("CYBERWAVE_HEARTBEAT_INTERVAL", "0.2")
        .env("CYBERWAVE_NODE_AUTH_RETRY_BASE_SECONDS", "0.05")
        .rig();
    let mut node = rig.spawn();
    node.assert_exit(3, Duration::from_secs(20));
    assert_eq!(
        rig.cp.requests("heartbeat").len(),
        5,
        "five attempts, then stop"
    );
    node.assert_logged("invalid or revoked");
}

#[test]
fn token_rejected_at_start_exits_3_without_retrying() {
    let rig = Scenario::default().backend(|b| b.token_status = 401).rig();
    let mut node = rig.spawn();
    let started = Instant::now();
    node.assert_exit(3, EXIT);
    assert!(started.elapsed() < Duration::from_secs(5));
    let hits = rig.cp.http_hits();
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
        rig.cp.all_requests().is_empty(),
        "no MQTT request after a rejected token"
    );
}

#[test]
fn backend_down_at_start_still_becomes_ready() {
    let nobody_there = format!("http://127.0.0.1:{}", crate::support::free_port());
    let (_rig, node) = Scenario::default()
        .env("CYBERWAVE_BASE_URL", &nobody_there)
        .node();
    node.assert_logged("could not validate the API token");
}

#[test]
fn standalone_needs_no_backend() {
    let (rig, mut node) = Scenario::default()
        .unset("CYBERWAVE_API_KEY")
        .arg("--standalone")
        .arg("--slug")
        .arg("lab-gpu")
        .node();
    let uuid = node.uuid();
    assert!(!uuid.is_empty());
    assert!(rig.cp.status(&uuid, "sa-1", REPLY).is_some());
    assert!(rig.cp.status("lab-gpu", "sa-2", REPLY).is_some());
    node.sigterm();
    assert_eq!(node.wait_exit(Duration::from_secs(5)), Some(Some(0)));
    assert!(
        rig.cp.all_requests().is_empty(),
        "no backend requests: {:?}",
        rig.cp.all_requests()
    );
    assert!(rig.cp.http_hits().is_empty());
    // The identity persists across restarts.
    assert_eq!(rig.node().uuid(), uuid);
}

#[test]
fn g11_systemd_hears_ready_after_subscribing_watchdog_on_heartbeats_and_stopping() {
    let mut rig = Scenario::default()
        .env("CYBERWAVE_HEARTBEAT_INTERVAL", "0.3")
        .rig();
    let sock_path = rig.setup.home.join("notify.sock");
    let sock = std::os::unix::net::UnixDatagram::bind(&sock_path).expect("bind notify socket");
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    rig.setup
        .set("NOTIFY_SOCKET", &sock_path.display().to_string());
    let mut node = rig.spawn();
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
    rig.cp
        .set_behaviour(|b| b.heartbeat = HeartbeatMode::Code(500, "backend trouble"));
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
fn hardware_telemetry_is_opt_in_and_coarse() {
    let mut rig = Scenario::new("cyberwave:\n  training: sleep 1\n")
        .env("CYBERWAVE_HEARTBEAT_INTERVAL", "0.3")
        .rig();
    let node = rig.node();
    let cp = &rig.cp;
    let hb = cp.wait_requests("heartbeat", 1, REPLY);
    assert!(hb[0].body.get("hardware").is_none(), "off by default");
    drop(node);
    rig.setup.set("CYBERWAVE_HARDWARE_TELEMETRY", "1");
    let n = rig.cp.requests("heartbeat").len();
    let _node = rig.spawn();
    let hw = wait_for(REPLY, || {
        rig.cp
            .requests("heartbeat")
            .into_iter()
            .skip(n)
            .find_map(|h| h.body.get("hardware").cloned())
    })
    .expect("hardware");
    let keys: Vec<&String> = hw
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    assert_eq!(
        keys,
        ["cpu_load_ratio", "gpu_count", "ram_used_ratio", "vram_tier"]
    );
    let ram = hw["ram_used_ratio"].as_f64().unwrap_or(-1.0);
    assert!(
        (0.0..=1.0).contains(&ram) && (ram * 10.0).fract() == 0.0,
        "coarse: {ram}"
    );
}

#[test]
fn the_sdk_topic_prefix_and_workspace_uuid_are_honoured() {
    let (rig, node) = Scenario::default()
        .prefix("sdkpfx/")
        .backend(|b| b.require_workspace_uuid = true)
        // The SDK's second name for the prefix: CYBERWAVE_ENVIRONMENT loses to it.
        .env("CYBERWAVE_ENVIRONMENT", "staging")
        .env("CYBERWAVE_TOPIC_PREFIX", "sdkpfx/")
        .env("CYBERWAVE_WORKSPACE_ID", "ws-0000-1111")
        .node();
    assert!(
        rig.cp
            .requests("register")
            .iter()
            .all(|r| r.topic.starts_with("sdkpfx/cyberwave/cloud-node/")),
        "registered under the prefix"
    );
    let st = rig
        .cp
        .status(&node.uuid(), "st", REPLY)
        .expect("a reply under the prefix");
    assert_eq!(st["status"], "ok");
    node.assert_logged("accepted by");
    let hits = rig.cp.http_hits();
    assert!(
        hits.iter()
            .any(|(url, _)| url.starts_with("/api/v1/cloud-node/instances")
                && url.contains("workspace_uuid=ws-0000-1111")),
        "{hits:?}"
    );
}

#[test]
fn workspace_required_is_explained_and_the_node_keeps_running() {
    let (rig, node) = Scenario::default()
        .backend(|b| b.require_workspace_uuid = true)
        .node();
    node.assert_logged("workspace_required");
    assert!(node
        .log()
        .lines()
        .any(|l| l.contains("workspace_required") && l.contains("set CYBERWAVE_WORKSPACE_ID")));
    assert_eq!(
        rig.cp.status(&node.uuid(), "st", REPLY).expect("reply")["status"],
        "ok"
    );
}

#[test]
fn the_login_workspace_goes_with_the_login_token_only() {
    let mut rig = Scenario::default()
        .backend(|b| b.require_workspace_uuid = true)
        .unset("CYBERWAVE_API_KEY")
        .rig();
    rig.setup.plant(
        "credentials.json",
        json!({"token": TOKEN, "workspace_uuid": "ws-login"}).to_string(),
    );
    let mut node = rig.node();
    node.assert_logged("accepted by");
    assert!(rig
        .cp
        .http_hits()
        .iter()
        .any(|(url, _)| url.contains("workspace_uuid=ws-login")));
    node.sigterm();
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)));
    // Another token (from the environment) is not sent with the login's workspace.
    rig.setup
        .set("CYBERWAVE_API_KEY", "cw_another_token_entirely");
    let hits_before = rig.cp.http_hits().len();
    let node = rig.node();
    node.assert_logged("workspace_required");
    assert!(rig
        .cp
        .http_hits()
        .iter()
        .skip(hits_before)
        .all(|(url, _)| !url.contains("workspace_uuid")));
}
