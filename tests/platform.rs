//! Speaking the platform's language (issue 13): upload methods (D40), retryable refusals
//! (D21), the SDK's topic prefix and workspace scoping.

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::node::{NodeSetup, TOKEN};
use crate::support::{Broker, ControlPlane};

use crate::results::pattern;
use crate::support::scenario::Start;
use crate::support::timeouts::{DONE, EXIT, READY, REPLY};

#[test]
fn each_file_goes_up_by_the_route_its_attachment_reply_names() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    // Names with a quote, a CR-free unicode name and a boundary-looking body test the framing.
    let odd = "sub/r\u{e9}sultat \"final\".txt";
    cp.set_behaviour(|b| {
        for (name, method) in [
            ("big.bin", json!("multipart")),
            (odd, json!("multipart")),
            ("explicit.bin", json!("signed_url")),
            ("null.bin", Value::Null),
            ("weird.bin", json!("ftp")),
            ("number.bin", json!(7)),
        ] {
            b.upload_methods.insert(name.to_string(), method);
        }
        // The form upload is an API call: scoped like every other one.
        b.require_workspace_uuid = true;
    });
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_WORKSPACE_ID", "ws-1");
    let src = setup.cwd.join("src");
    std::fs::create_dir_all(src.join("sub")).expect("src");
    let mut files = vec![
        ("big.bin", pattern(3, 6 * 1024 * 1024 + 17)),
        (
            odd,
            b"--cyberwave-node-\r\n\r\nnot a boundary\r\n--".to_vec(),
        ),
        ("explicit.bin", pattern(5, 1000)),
        ("null.bin", pattern(9, 10)),
        ("plain.bin", Vec::new()),
        ("weird.bin", pattern(11, 100)),
        ("number.bin", pattern(13, 100)),
    ];
    files.sort();
    for (name, bytes) in &files {
        std::fs::write(src.join(name), bytes).expect("write");
    }
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  training: cp -r src/. out/\n  results_folder: out\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::training("mp").ok(&cp, &node);
    assert!(
        cp.wait_status("wl-mp", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    let puts = cp.uploads();
    let forms = cp.form_uploads();
    for (name, bytes) in &files {
        let att = cp
            .attachment_name(name)
            .unwrap_or_else(|| panic!("R9 for {name}"));
        let uuid = att.rsplit_once('.').map_or(att.as_str(), |(s, _)| s);
        match *name {
            "big.bin" | "sub/r\u{e9}sultat \"final\".txt" => {
                let f = forms
                    .get(uuid)
                    .unwrap_or_else(|| panic!("{name} by multipart"));
                assert_eq!(&f.bytes, bytes, "{name} byte-identical");
                assert_eq!((f.field.as_str(), f.parts), ("file", 1));
                let expect = name
                    .rsplit('/')
                    .next()
                    .unwrap_or_default()
                    .replace('"', "%22");
                assert_eq!(f.filename, expect);
                assert_eq!(f.authorization, Some(format!("Token {TOKEN}")));
                assert!(!puts.contains_key(&att), "{name} not PUT as well");
            }
            "explicit.bin" | "null.bin" | "plain.bin" => {
                assert_eq!(puts.get(&att), Some(bytes), "{name} PUT byte-identical");
                assert!(!forms.contains_key(uuid), "{name} not POSTed as well");
            }
            _ => {
                assert!(
                    !puts.contains_key(&att) && !forms.contains_key(uuid),
                    "{name}"
                );
                let why = if *name == "weird.bin" {
                    "\"ftp\""
                } else {
                    "\"7\""
                };
                assert!(
                    node.log()
                        .lines()
                        .any(|l| l.contains(name) && l.contains(why)),
                    "the error names {name} and the method: {}",
                    node.log()
                );
            }
        }
    }
    let r10 = cp.requests("workload:upload-results");
    assert_eq!(r10.len(), 1);
    assert_eq!(
        r10[0].body["filenames"],
        json!(["big.bin", "explicit.bin", "null.bin", "plain.bin", odd]),
        "the failed files are left out"
    );
}

#[test]
fn a_start_during_shutdown_is_a_retryable_host_busy_refusal() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    cp.set_behaviour(|b| b.terminate_delay = Duration::from_millis(2500));
    let setup = NodeSetup::new(&broker, &cp);
    setup.write("cyberwave.yml", "cyberwave:\n  training: sleep 5\n");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    node.sigterm();
    assert!(node.wait_log("shutting down", REPLY));
    let r = Start::training("late").reply(&cp, &node);
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
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write("cyberwave.yml", "cyberwave:\n  training: sleep 5\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    cp.command(
        &node.uuid(),
        json!({"command": "simulate", "request_id": "nope", "params": {"workload_uuid": "wl-nope"}}),
    );
    assert_eq!(
        cp.wait_reply("nope", REPLY).expect("reply")["status"],
        "error"
    );
    let failed = cp
        .wait_status("wl-nope", "failed", REPLY)
        .expect("R7 failed");
    assert!(failed[0].get("rejection_reason").is_none(), "{}", failed[0]);
    assert!(failed[0].get("busy_reason").is_none(), "{}", failed[0]);
}

#[test]
fn the_sdk_topic_prefix_and_workspace_uuid_are_honoured() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "sdkpfx/");
    cp.set_behaviour(|b| b.require_workspace_uuid = true);
    let mut setup = NodeSetup::new(&broker, &cp);
    // The SDK's second name for the prefix; CYBERWAVE_ENVIRONMENT (set by the rig) loses to it.
    setup.set("CYBERWAVE_ENVIRONMENT", "staging");
    setup.set("CYBERWAVE_TOPIC_PREFIX", "sdkpfx/");
    setup.set("CYBERWAVE_WORKSPACE_ID", "ws-0000-1111");
    let node = setup.spawn();
    node.wait_ready(READY);
    assert!(
        cp.requests("register")
            .iter()
            .all(|r| r.topic.starts_with("sdkpfx/cyberwave/cloud-node/")),
        "registered under the prefix"
    );
    let st = cp
        .status(&node.uuid(), "st", REPLY)
        .expect("a reply under the prefix");
    assert_eq!(st["status"], "ok");
    assert!(node.wait_log("accepted by", REPLY), "{}", node.log());
    let hits = cp.http_hits();
    assert!(
        hits.iter()
            .any(|(url, _)| url.starts_with("/api/v1/cloud-node/instances")
                && url.contains("workspace_uuid=ws-0000-1111")),
        "{hits:?}"
    );
}

#[test]
fn workspace_required_is_explained_and_the_node_keeps_running() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    cp.set_behaviour(|b| b.require_workspace_uuid = true);
    let node = NodeSetup::new(&broker, &cp).spawn();
    node.wait_ready(READY);
    assert!(node.wait_log("workspace_required", REPLY), "{}", node.log());
    assert!(node
        .log()
        .lines()
        .any(|l| l.contains("workspace_required") && l.contains("set CYBERWAVE_WORKSPACE_ID")));
    assert_eq!(
        cp.status(&node.uuid(), "st", REPLY).expect("reply")["status"],
        "ok"
    );
}

#[test]
fn the_login_workspace_goes_with_the_login_token_only() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    cp.set_behaviour(|b| b.require_workspace_uuid = true);
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.unset("CYBERWAVE_API_KEY");
    std::fs::create_dir_all(setup.config_dir()).expect("config dir");
    std::fs::write(
        setup.config_dir().join("credentials.json"),
        json!({"token": TOKEN, "workspace_uuid": "ws-login"}).to_string(),
    )
    .expect("credentials");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    assert!(node.wait_log("accepted by", REPLY), "{}", node.log());
    assert!(cp
        .http_hits()
        .iter()
        .any(|(url, _)| url.contains("workspace_uuid=ws-login")));
    node.sigterm();
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)));
    // Another token (from the environment) is not sent with the login's workspace.
    setup.set("CYBERWAVE_API_KEY", "cw_another_token_entirely");
    let hits_before = cp.http_hits().len();
    let node = setup.spawn();
    node.wait_ready(READY);
    assert!(node.wait_log("workspace_required", REPLY), "{}", node.log());
    assert!(cp
        .http_hits()
        .iter()
        .skip(hits_before)
        .all(|(url, _)| !url.contains("workspace_uuid")));
}
