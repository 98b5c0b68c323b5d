//! Workloads end to end: starts, exactly-once, capacity, hostile input, cancel, completion,
//! recovery after the node was killed, and the outbox across a broker outage.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::node::{NodeSetup, TOKEN};
use crate::support::scenario::{completion, Start};
use crate::support::timeouts::{DONE, EXIT, READY, REPLY};
use crate::support::{wait_for, Broker, ControlPlane, NodeProcess, TempDir};

struct Rig {
    broker: Broker,
    cp: ControlPlane,
    setup: NodeSetup,
}

impl Rig {
    fn new(manifest: &str) -> Rig {
        let broker = Broker::start();
        let cp = ControlPlane::start(broker.port, "");
        let setup = NodeSetup::new(&broker, &cp);
        setup.write("cyberwave.yml", manifest);
        Rig { broker, cp, setup }
    }

    fn node(&self) -> NodeProcess {
        let node = self.setup.spawn();
        node.wait_ready(READY);
        node
    }

    fn work(&self, rel: &str) -> std::path::PathBuf {
        self.setup.cwd.join(rel)
    }
}

fn pid_alive(pid: i64) -> bool {
    // SAFETY: signal 0 only probes.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

fn files_below(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            out.push(p.display().to_string());
            if p.is_dir() {
                out.extend(files_below(&p));
            }
        }
    }
    out
}

#[test]
fn completions_carry_the_real_exit_code() {
    let rig = Rig::new(
        "cyberwave:\n  training: |\n    mode=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[\"mode\"])' {body})\n    case $mode in\n      ok) echo fine ;;\n      three) echo 'it broke badly' >&2; exit 3 ;;\n      signal) kill -KILL $$ ;;\n      fast) exit 0 ;;\n    esac\n  max_concurrent_workloads: 4\n",
    );
    let node = rig.node();
    for (mode, wl) in [
        ("ok", "wl-ok"),
        ("three", "wl-three"),
        ("signal", "wl-signal"),
        ("fast", "wl-fast"),
    ] {
        let r = Start::new("training", &format!("r-{mode}"))
            .params(json!({"workload_uuid": wl, "mode": mode}))
            .reply(&rig.cp, &node);
        assert_eq!(r["status"], "ok", "{r}");
        assert!(r["output"]["pid"].as_i64().unwrap_or(0) > 0, "{r}");
        assert_eq!(r["output"]["workload_request_id"], format!("r-{mode}"));
    }
    let ok = completion(&rig.cp, "wl-ok");
    assert_eq!(
        ok,
        json!({"status": "completed", "success": true, "exit_code": 0})
    );
    let three = completion(&rig.cp, "wl-three");
    assert_eq!(three["success"], false);
    assert_eq!(three["exit_code"], 3);
    assert_eq!(three["error"], "it broke badly");
    assert_eq!(three["stderr"], "it broke badly");
    let sig = completion(&rig.cp, "wl-signal");
    assert_eq!(sig["success"], false);
    assert_eq!(sig["exit_code"], -9, "killed by signal 9: {sig}");
    let fast = completion(&rig.cp, "wl-fast");
    assert_eq!(fast["exit_code"], 0);
    assert_eq!(fast["success"], true);
    // R7 running came first, with the workload's pid.
    let all = rig.cp.statuses("wl-ok");
    assert_eq!(all[0]["status"], "running");
    assert!(all[0]["pid"].as_i64().unwrap_or(0) > 0);
}

#[test]
fn g1_the_same_start_twice_spawns_once_and_capacity_is_enforced() {
    let rig = Rig::new("cyberwave:\n  simulate: echo started >> starts.txt; sleep 3\n");
    let node = rig.node();
    let first = Start::new("simulate", "dup").reply(&rig.cp, &node);
    rig.cp.command(
        &node.uuid(),
        json!({"command": "simulate", "request_id": "dup", "params": {"workload_uuid": "wl-dup"}}),
    );
    assert!(wait_for(REPLY, || (rig.cp.replies_for("dup").len() == 2)
        .then_some(()))
    .is_some());
    let replies = rig.cp.replies_for("dup");
    assert_eq!(
        replies[0], replies[1],
        "the redelivery gets the original answer"
    );
    assert_eq!(first["output"]["pid"], replies[1]["output"]["pid"]);
    // Two more at once: capacity 1 rejects both.
    for rid in ["busy-1", "busy-2"] {
        rig.cp.command(
            &node.uuid(),
            json!({"command": "simulate", "request_id": rid, "params": {"workload_uuid": rid}}),
        );
    }
    for rid in ["busy-1", "busy-2"] {
        let r = rig.cp.wait_reply(rid, REPLY).expect("reply");
        assert_eq!(r["status"], "error");
        let err = r["error"].as_str().unwrap_or_default();
        assert!(
            err.starts_with("Controller host is busy with 1 active workload(s)"),
            "{err}"
        );
        let failed = rig.cp.wait_status(rid, "failed", REPLY).expect("R7 failed");
        assert_eq!(failed[0]["rejection_reason"], "host_busy");
        assert_eq!(failed[0]["busy_reason"], "capacity");
        assert_eq!(failed[0]["rejecting_instance_uuid"], node.uuid());
        assert!(failed[0]["error"]
            .as_str()
            .unwrap_or_default()
            .starts_with("Controller host is busy with"));
    }
    std::thread::sleep(Duration::from_millis(500));
    let starts = std::fs::read_to_string(rig.work("starts.txt")).unwrap_or_default();
    assert_eq!(starts.lines().count(), 1, "spawned exactly once");
    let status = rig.cp.status(&node.uuid(), "st", REPLY).expect("status");
    assert_eq!(status["output"]["is_busy"], true);
    assert_eq!(
        status["output"]["active_workloads"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    // Once it is done, the same request id is still answered from the ledger, not run again.
    completion(&rig.cp, "wl-dup");
    rig.cp.command(
        &node.uuid(),
        json!({"command": "simulate", "request_id": "dup", "params": {}}),
    );
    assert!(wait_for(REPLY, || (rig.cp.replies_for("dup").len() == 3)
        .then_some(()))
    .is_some());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        std::fs::read_to_string(rig.work("starts.txt"))
            .unwrap_or_default()
            .lines()
            .count(),
        1
    );
}

#[test]
fn g5_hostile_params_reach_the_workload_intact_and_never_a_shell() {
    let rig = Rig::new("cyberwave:\n  inference: mkdir -p got && cp {body} \"got/$(date +%s%N).json\"\n  max_concurrent_workloads: 8\n");
    let node = rig.node();
    let values = [
        json!("it's \"quoted\""),
        json!("$(touch canary)"),
        json!("`touch canary2`"),
        json!("line1\nline2; touch canary3"),
        json!("ünïcødé ✅ 🚀"),
        json!("x".repeat(1024 * 1024)),
    ];
    let params = json!({"workload_uuid": "wl-hostile", "a": values[0], "b": values[1], "c": values[2], "d": values[3], "e": values[4], "f": values[5], "cyberwave_workload_token": "cw_workload_secret"});
    let r = Start::new("inference", "hostile")
        .params(params.clone())
        .reply(&rig.cp, &node);
    assert_eq!(r["status"], "ok", "{r}");
    completion(&rig.cp, "wl-hostile");
    let got_dir = rig.work("got");
    let files = files_below(&got_dir);
    assert_eq!(files.len(), 1, "{files:?}");
    let received: Value =
        serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap_or_default())
            .unwrap_or_default();
    let mut expected = params;
    expected
        .as_object_mut()
        .map(|m| m.remove("cyberwave_workload_token"));
    assert_eq!(
        received, expected,
        "params reach the workload unchanged, token removed"
    );
    for c in ["canary", "canary2", "canary3"] {
        assert!(
            !rig.work(c).exists(),
            "{c} was created: request data reached a shell"
        );
    }
    // Hostile request ids create nothing outside the state dir.
    let home = rig.setup.home.path().to_path_buf();
    let before: Vec<String> = files_below(&home)
        .into_iter()
        .filter(|f| !f.contains("/.cyberwave/") && !f.contains("/got"))
        .collect();
    let long = "y".repeat(10_000);
    for (i, rid) in ["../../x", "/etc/cw-hostile-x", &long, "a\u{0}b", "..", "."]
        .iter()
        .enumerate()
    {
        rig.cp.command(&node.uuid(), json!({"command": "inference", "request_id": rid, "params": {"workload_uuid": format!("wl-id-{i}")}}));
        let r = rig
            .cp
            .wait_reply(rid, REPLY)
            .unwrap_or_else(|| panic!("no reply for id #{i}"));
        assert_eq!(r["status"], "ok", "{r}");
        completion(&rig.cp, &format!("wl-id-{i}"));
    }
    let after: Vec<String> = files_below(&home)
        .into_iter()
        .filter(|f| !f.contains("/.cyberwave/") && !f.contains("/got"))
        .collect();
    assert_eq!(before, after, "files appeared outside the state dir");
    assert!(!Path::new("/etc/cw-hostile-x").exists());
    for f in files_below(&home.join(".cyberwave/workload_logs")) {
        let name = Path::new(&f)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        assert!(name.len() < 100 && !name.starts_with('.'), "{name}");
    }
}

#[test]
fn with_tls_the_workload_gets_the_broker_ca_under_the_sdks_name_too() {
    // D45: the platform SDK reads `CYBERWAVE_MQTT_TLS_CA_CERT`; the node's own name is
    // `…_CERTS`. A workload's SDK client must reach the same broker the same way.
    let pki = TempDir::new("pki");
    let sh = |script: &str| {
        let ok = std::process::Command::new("sh")
            .arg("-c")
            .arg(script)
            .current_dir(pki.path())
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        assert!(ok, "openssl failed: {script}");
    };
    sh("openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=cw-test-ca 2>/dev/null");
    sh("openssl req -newkey rsa:2048 -nodes -keyout srv.key -out srv.csr -subj /CN=srv 2>/dev/null && \
        printf 'subjectAltName=IP:127.0.0.1\n' > srv.ext && \
        openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out srv.pem -days 2 -extfile srv.ext 2>/dev/null && \
        chmod 644 srv.key");
    // One broker: plain for the fake backend, TLS for the node.
    let tls_port = crate::support::free_port();
    let broker = Broker::start_with_conf(&format!(
        "listener {tls_port} 127.0.0.1\ncafile {}\ncertfile {}\nkeyfile {}\n",
        pki.join("ca.pem").display(),
        pki.join("srv.pem").display(),
        pki.join("srv.key").display()
    ));
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_MQTT_PORT", &tls_port.to_string());
    setup.set("CYBERWAVE_MQTT_USE_TLS", "true");
    // Relative to the working dir in the manifest: the workload gets the absolute path.
    std::fs::copy(pki.join("ca.pem"), setup.cwd.join("ca.pem")).unwrap();
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  mqtt_tls_ca_certs: ca.pem\n  training: env | grep -E '^CYBERWAVE_' | sort > env.txt\n",
    );
    let rig = Rig { broker, cp, setup };
    let node = rig.node();
    assert!(node.log().contains("(TLS)"), "{}", node.log());
    Start::new("training", "tls-1")
        .workload("wl-tls")
        .reply(&rig.cp, &node);
    completion(&rig.cp, "wl-tls");
    let env = std::fs::read_to_string(rig.work("env.txt")).unwrap_or_default();
    let ca = rig.setup.cwd.join("ca.pem").display().to_string();
    for name in ["CYBERWAVE_MQTT_TLS_CA_CERT", "CYBERWAVE_MQTT_TLS_CA_CERTS"] {
        assert!(env.contains(&format!("{name}={ca}\n")), "{name}: {env}");
    }
    assert!(env.contains("CYBERWAVE_MQTT_USE_TLS=true\n"), "{env}");
    assert!(
        env.contains(&format!("CYBERWAVE_MQTT_PORT={tls_port}\n")),
        "{env}"
    );
}

#[test]
fn g7_the_workload_gets_its_own_credentials_and_context() {
    let rig = Rig::new("cyberwave:\n  training: env | grep -E '^CYBERWAVE_' | sort > env.txt\n");
    let mut setup_env = rig.setup.env.clone();
    setup_env.insert(
        "CYBERWAVE_MQTT_PASSWORD".into(),
        "node-broker-password".into(),
    );
    let node = rig.node();
    Start::new("training", "env-1").params(json!({"workload_uuid": "wl-env", "cyberwave_workload_token": "cw_scoped_workload_token"})).reply(&rig.cp, &node);
    completion(&rig.cp, "wl-env");
    let env = std::fs::read_to_string(rig.work("env.txt")).unwrap_or_default();
    assert!(
        env.contains("CYBERWAVE_API_KEY=cw_scoped_workload_token\n"),
        "{env}"
    );
    assert!(
        env.contains("CYBERWAVE_MQTT_PASSWORD=cw_scoped_workload_token\n"),
        "{env}"
    );
    assert!(env.contains("CYBERWAVE_REQUEST_ID=env-1\n"), "{env}");
    assert!(env.contains("CYBERWAVE_WORKLOAD_UUID=wl-env\n"), "{env}");
    assert!(env.contains("CYBERWAVE_WORKLOAD_TYPE=training\n"), "{env}");
    assert!(env.contains("CYBERWAVE_PARAMS_FILE=/"), "{env}");
    // D45: edge-core labels the containers a workload starts with these two.
    assert!(
        env.contains(&format!("CYBERWAVE_CLOUD_NODE_ID={}\n", node.uuid())),
        "{env}"
    );
    // Without TLS there is no CA to pass on.
    assert!(!env.contains("CYBERWAVE_MQTT_TLS_CA_CERT"), "{env}");
    assert!(
        !env.contains(TOKEN),
        "the node's own token is not passed on when a workload token came: {env}"
    );
    // Without a workload token the node's token is used (as the original does).
    Start::new("training", "env-2")
        .workload("wl-env2")
        .reply(&rig.cp, &node);
    completion(&rig.cp, "wl-env2");
    let env = std::fs::read_to_string(rig.work("env.txt")).unwrap_or_default();
    assert!(
        env.contains(&format!("CYBERWAVE_API_KEY={TOKEN}\n")),
        "{env}"
    );
    // The params file holds no token.
    assert!(
        !node.log().contains("cw_scoped_workload_token"),
        "a workload token reached the log"
    );
}

#[test]
fn cancel_by_pid_and_by_request_id_with_each_signal() {
    let rig = Rig::new(
        "cyberwave:\n  simulate: sleep 30\n  training: sleep 30\n  max_concurrent_workloads: 3\n",
    );
    let node = rig.node();
    let a = Start::new("simulate", "c-term")
        .workload("wl-term")
        .reply(&rig.cp, &node);
    let b = Start::new("training", "c-int")
        .workload("wl-int")
        .reply(&rig.cp, &node);
    let c = Start::new("simulate", "c-kill")
        .workload("wl-kill")
        .reply(&rig.cp, &node);
    let pid_a = a["output"]["pid"].as_i64().unwrap_or(0);
    let pid_c = c["output"]["pid"].as_i64().unwrap_or(0);
    rig.cp.command(
        &node.uuid(),
        json!({"command": "cancel", "request_id": "x1", "params": {"pid": pid_a}}),
    );
    rig.cp.command(&node.uuid(), json!({"command": "cancel", "request_id": "x2", "params": {"workload_request_id": "c-int", "signal": "SIGINT"}}));
    rig.cp.command(&node.uuid(), json!({"command": "cancel", "request_id": "x3", "params": {"pid": pid_c, "signal": "SIGKILL"}}));
    let r1 = rig.cp.wait_reply("x1", REPLY).expect("x1");
    assert_eq!(r1["status"], "ok", "{r1}");
    assert_eq!(
        r1["output"],
        json!({"message": "Workload cancelled with SIGTERM", "pid": pid_a, "workload_type": "simulate", "workload_request_id": "c-term", "signal": "SIGTERM"})
    );
    let r2 = rig.cp.wait_reply("x2", REPLY).expect("x2");
    assert_eq!(r2["output"]["signal"], "SIGINT");
    assert_eq!(r2["output"]["pid"], b["output"]["pid"]);
    let r3 = rig.cp.wait_reply("x3", REPLY).expect("x3");
    assert_eq!(r3["output"]["signal"], "SIGKILL");
    // SIGTERM alone stops a workload that does not ignore it: well before the 10 s grace.
    assert!(
        wait_for(Duration::from_secs(3), || (!pid_alive(pid_a)).then_some(())).is_some(),
        "SIGTERM did not reach the workload"
    );
    let cancelled = rig
        .cp
        .wait_status("wl-term", "cancelled", DONE)
        .expect("R7 cancelled");
    let last = cancelled.last().cloned().unwrap_or_default();
    assert_eq!(
        last,
        json!({"status": "cancelled", "message": "Workload cancelled by SIGTERM", "signal": "SIGTERM", "pid": pid_a})
    );
    let pid_b = b["output"]["pid"].as_i64().unwrap_or(0);
    assert!(
        wait_for(Duration::from_secs(3), || (!pid_alive(pid_b)).then_some(())).is_some(),
        "SIGINT did not reach the workload"
    );
    let training = rig
        .cp
        .wait_status("wl-int", "failed", DONE)
        .expect("training → failed");
    assert_eq!(
        training.last().map(|b| b["signal"].clone()),
        Some(json!("SIGINT"))
    );
    assert!(rig.cp.wait_status("wl-kill", "cancelled", DONE).is_some());
    for wl in ["wl-term", "wl-int", "wl-kill"] {
        let all = rig.cp.statuses(wl);
        assert!(
            all.iter().all(|b| b["status"] != "completed"),
            "a cancel is reported once, as the cancel: {all:?}"
        );
        assert_eq!(
            all.iter().filter(|b| b["status"] != "running").count(),
            1,
            "{all:?}"
        );
    }
    assert!(!pid_alive(pid_a) && !pid_alive(pid_c));
    let st = rig.cp.status(&node.uuid(), "after", REPLY).expect("status");
    assert_eq!(st["output"]["active_workloads"], json!([]));
}

#[test]
fn g9_cancel_escalates_to_the_whole_group_and_refuses_foreign_pids() {
    let rig = Rig::new(
        "cyberwave:\n  simulate: |\n    trap '' TERM\n    (trap '' TERM; sleep 60) &\n    echo $! > child.pid\n    sleep 60\n",
    );
    let node = rig.node();
    let r = Start::new("simulate", "stubborn").reply(&rig.cp, &node);
    let pid = r["output"]["pid"].as_i64().unwrap_or(0);
    let child: i64 = wait_for(REPLY, || {
        std::fs::read_to_string(rig.work("child.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    })
    .expect("child pid");
    // A pid that is not the node's workload is never signalled.
    let mut bystander = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("sleep");
    rig.cp.command(
        &node.uuid(),
        json!({"command": "cancel", "request_id": "foreign", "params": {"pid": bystander.id()}}),
    );
    let f = rig.cp.wait_reply("foreign", REPLY).expect("reply");
    assert_eq!(f["status"], "error");
    assert!(
        f["error"]
            .as_str()
            .unwrap_or_default()
            .starts_with("No active workload found with PID"),
        "{f}"
    );
    assert!(pid_alive(i64::from(bystander.id())));
    let _ = bystander.kill();
    let _ = bystander.wait();
    // Invalid signal.
    rig.cp.command(&node.uuid(), json!({"command": "cancel", "request_id": "badsig", "params": {"pid": pid, "signal": "SIGSTOP"}}));
    let b = rig.cp.wait_reply("badsig", REPLY).expect("reply");
    assert_eq!(
        b["error"],
        "Invalid signal: SIGSTOP. Must be SIGTERM, SIGKILL, or SIGINT"
    );
    // SIGTERM is ignored by both; after the grace period the group is killed.
    let t = Instant::now();
    rig.cp.command(&node.uuid(), json!({"command": "cancel", "request_id": "esc", "params": {"pid": pid, "grace_seconds": 1}}));
    assert_eq!(
        rig.cp.wait_reply("esc", REPLY).expect("reply")["status"],
        "ok"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        pid_alive(pid) && pid_alive(child),
        "SIGTERM alone does not stop them"
    );
    let cancelled = rig
        .cp
        .wait_status("wl-stubborn", "cancelled", DONE)
        .unwrap_or_else(|| panic!("{}", node.log()));
    // The report says it took the SIGKILL of the escalation, not SIGTERM.
    assert_eq!(
        cancelled.last().map(|s| s["message"].clone()).unwrap_or_default(),
        "Workload cancelled by SIGTERM; it was still running after the 1s grace and was killed with SIGKILL"
    );
    assert!(t.elapsed() >= Duration::from_secs(1));
    assert!(!pid_alive(pid), "the workload is gone");
    assert!(
        wait_for(REPLY, || (!pid_alive(child)).then_some(())).is_some(),
        "its child is gone too"
    );
}

#[test]
fn max_runtime_cancels_and_reports_a_timeout() {
    let rig = Rig::new("cyberwave:\n  training: sleep 30\n  max_runtime_seconds: 60\n");
    let node = rig.node();
    Start::new("training", "slow")
        .params(json!({"workload_uuid": "wl-slow", "max_runtime_seconds": 0.5}))
        .reply(&rig.cp, &node);
    let done = completion(&rig.cp, "wl-slow");
    assert_eq!(done["success"], false);
    assert_eq!(done["error"], "timed out after 0.5s");
}

#[test]
fn workload_received_dispatches_a_start() {
    let rig = Rig::new("cyberwave:\n  simulate: cp {body} wr.json\n");
    let node = rig.node();
    rig.cp.command(
        &node.uuid(),
        json!({"command": "workload_received", "request_id": "wr", "params": {"workload_uuid": "wl-wr", "command_type": "simulate", "command_params": {"scene": 1}}}),
    );
    assert_eq!(
        rig.cp.wait_reply("wr", REPLY).expect("reply")["status"],
        "ok"
    );
    completion(&rig.cp, "wl-wr");
    let got: Value =
        serde_json::from_str(&std::fs::read_to_string(rig.work("wr.json")).unwrap_or_default())
            .unwrap_or_default();
    assert_eq!(got, json!({"scene": 1, "workload_uuid": "wl-wr"}));
    rig.cp.command(&node.uuid(), json!({"command": "workload_received", "request_id": "wr2", "params": {"workload_uuid": "wl-x", "command_type": "other"}}));
    let r = rig.cp.wait_reply("wr2", REPLY).expect("reply");
    assert_eq!(
        r["output"]["message"],
        "Workload wl-x received and acknowledged"
    );
}

#[test]
fn g2_workloads_survive_kill_9_of_the_node_and_are_reported_once_after_restart() {
    let rig = Rig::new(
        "cyberwave:\n  training: |\n    n=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[\"n\"])' {body})\n    while [ ! -f release-$n ]; do sleep 0.05; done\n    exit $n\n  max_concurrent_workloads: 3\n",
    );
    let mut node = rig.node();
    let mut pids = Vec::new();
    for n in 1..=3 {
        let r = Start::new("training", &format!("k{n}"))
            .params(json!({"workload_uuid": format!("wl-k{n}"), "n": n}))
            .reply(&rig.cp, &node);
        pids.push(r["output"]["pid"].as_i64().unwrap_or(0));
    }
    node.kill9();
    std::thread::sleep(Duration::from_millis(300));
    for p in &pids {
        assert!(pid_alive(*p), "workload {p} died with the node");
    }
    // One ends while the node is down.
    std::fs::write(rig.work("release-1"), "").expect("release");
    assert!(wait_for(REPLY, || (!pid_alive(pids[0])).then_some(())).is_some());
    let node = rig.node();
    assert!(
        node.log().contains("re-adopted running workload k2"),
        "{}",
        node.log()
    );
    // k1's supervisor may still be writing its exit record as the node comes up (it first
    // clears what is left of the group): the node learns of it within its next check.
    let mut st = serde_json::Value::Null;
    let listed = wait_for(REPLY, || {
        let rid = format!("st-{}", rig.cp.all_requests().len());
        st = rig.cp.status(&node.uuid(), &rid, REPLY)?;
        let listed: Vec<i64> = st["output"]["active_workloads"]
            .as_array()
            .map(|a| a.iter().filter_map(|w| w["pid"].as_i64()).collect())
            .unwrap_or_default();
        (listed.len() == 2).then_some(listed)
    });
    assert!(listed.is_some(), "{st}");
    assert_eq!(
        completion(&rig.cp, "wl-k1")["exit_code"],
        1,
        "ended while the node was down"
    );
    std::fs::write(rig.work("release-2"), "").expect("release");
    assert_eq!(completion(&rig.cp, "wl-k2")["exit_code"], 2);
    // Cancel works on an adopted workload.
    rig.cp.command(&node.uuid(), json!({"command": "cancel", "request_id": "ck3", "params": {"workload_request_id": "k3", "grace_seconds": 1}}));
    assert_eq!(
        rig.cp.wait_reply("ck3", REPLY).expect("reply")["status"],
        "ok"
    );
    assert!(
        rig.cp.wait_status("wl-k3", "failed", DONE).is_some(),
        "{}",
        node.log()
    );
    std::thread::sleep(Duration::from_millis(500));
    for wl in ["wl-k1", "wl-k2", "wl-k3"] {
        let terminal = rig
            .cp
            .statuses(wl)
            .into_iter()
            .filter(|b| b["status"] != "running")
            .count();
        assert_eq!(terminal, 1, "{wl}: {:?}", rig.cp.statuses(wl));
    }
}

#[test]
fn g3_a_completion_during_a_broker_outage_arrives_once_afterwards() {
    let mut rig =
        Rig::new("cyberwave:\n  inference: while [ ! -f go ]; do sleep 0.05; done; exit 4\n");
    let node = rig.node();
    Start::new("inference", "out-1")
        .workload("wl-outage")
        .reply(&rig.cp, &node);
    rig.broker.stop();
    std::fs::write(rig.work("go"), "").expect("go");
    assert!(
        node.wait_log("finished: failure, exit code 4", DONE),
        "{}",
        node.log()
    );
    std::thread::sleep(Duration::from_secs(1));
    rig.broker.restart();
    let done = completion(&rig.cp, "wl-outage");
    assert_eq!(done["exit_code"], 4);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        rig.cp
            .statuses("wl-outage")
            .iter()
            .filter(|b| b["status"] == "completed")
            .count(),
        1
    );
}

#[test]
fn g3_completion_survives_a_node_restart_before_acknowledgement() {
    let rig = Rig::new("cyberwave:\n  inference: exit 5\n");
    let mut node = rig.node();
    rig.cp.set_behaviour(|b| b.mute = true);
    rig.start_muted(&node);
    assert!(
        node.wait_log("finished: failure, exit code 5", DONE),
        "{}",
        node.log()
    );
    node.kill9();
    let before = rig.cp.statuses("wl-restart").len();
    rig.cp.set_behaviour(|b| b.mute = false);
    let _node = rig.node();
    // Sent again from the outbox (or, if the kill came before it was queued, from the exit record).
    assert_eq!(rig.completion_after("wl-restart", before)["exit_code"], 5);
    std::thread::sleep(Duration::from_millis(500));
    let all = rig.cp.statuses("wl-restart");
    assert!(
        all.iter()
            .all(|b| b["status"] != "completed" || b["exit_code"] == 5),
        "never reported as lost: {all:?}"
    );
}

impl Rig {
    /// Starts `wl-restart` while the backend answers nothing (the command reply still flows).
    fn start_muted(&self, node: &NodeProcess) {
        self.cp.command(&node.uuid(), json!({"command": "inference", "request_id": "mr", "params": {"workload_uuid": "wl-restart"}}));
        assert!(self.cp.wait_reply("mr", REPLY).is_some());
    }

    /// A completion for `wl` among the status updates after the first `skip` (an unacknowledged
    /// earlier one may have reached the backend too: a repeat is allowed, a loss is not).
    fn completion_after(&self, wl: &str, skip: usize) -> Value {
        let found = wait_for(DONE, || {
            self.cp
                .statuses(wl)
                .into_iter()
                .skip(skip)
                .find(|b| b["status"] == "completed")
        });
        found.unwrap_or_else(|| {
            panic!(
                "no completion after the restart: {:?}",
                self.cp.statuses(wl)
            )
        })
    }
}

#[test]
fn g2_sigterm_leaves_workloads_running_and_names_them() {
    let rig = Rig::new("cyberwave:\n  training: sleep 20\n");
    let mut node = rig.node();
    let r = Start::new("training", "keep")
        .params(json!({}))
        .reply(&rig.cp, &node);
    let pid = r["output"]["pid"].as_i64().unwrap_or(0);
    node.sigterm();
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)));
    assert!(
        node.log()
            .contains(&format!("left running: training keep pid {pid}")),
        "{}",
        node.log()
    );
    assert!(
        node.log().contains("training_keep.stdout.log"),
        "{}",
        node.log()
    );
    assert!(pid_alive(pid));
    // SAFETY: cleaning up the test's own workload group.
    unsafe {
        libc::kill(-(pid as i32), libc::SIGKILL);
    }
}

#[test]
fn module_values_call_the_python_function_with_the_params() {
    let rig = Rig::new(
        "cyberwave:\n  training: train.py\n  inference: broken.py\n  simulate: missing.py\n  max_concurrent_workloads: 4\n",
    );
    // A sibling import proves the module's folder is on sys.path.
    rig.setup
        .write("helper.py", "def double(x):\n    return 2 * x\n");
    rig.setup.write(
        "train.py",
        "import os, sys, time\nfrom helper import double\n\ndef train(**params):\n    print('kwargs', sorted(params), flush=True)\n    print('token', os.environ.get('CYBERWAVE_API_KEY'), flush=True)\n    if params.get('sleep'):\n        time.sleep(params['sleep'])\n    if params.get('boom'):\n        raise ValueError('boom: ' + params['boom'])\n    return {'doubled': double(params['n'])}\n",
    );
    rig.setup
        .write("broken.py", "def train(**params):\n    return 1\n");
    let node = rig.node();

    // Platform keys and workflow keys are not arguments; the workload token is the credential.
    let params = json!({"workload_uuid": "wl-mod", "n": 21, "note": "it's $(touch canary)",
        "workflow_uuid": "wf-1", "workflow_execution_uuid": "ex-1", "workflow_node_uuid": "n-1",
        "command_type": "training", "status": "x", "cyberwave_workload_token": "cw_workload_tok"});
    let r = Start::new("training", "m-ok")
        .params(params)
        .reply(&rig.cp, &node);
    assert_eq!(r["status"], "ok", "{r}");
    let done = completion(&rig.cp, "wl-mod");
    assert_eq!(done["success"], true, "{done}");
    assert!(
        node.wait_stdout("[workload wl-mod stdout] {\"doubled\": 42}\n", REPLY),
        "{}",
        node.stdout()
    );
    let out = node.stdout();
    assert!(
        out.contains("[workload wl-mod stdout] kwargs ['n', 'note']\n"),
        "{out}"
    );
    assert!(
        out.contains("[workload wl-mod stdout] token cw_workload_tok\n"),
        "{out}"
    );
    assert!(!rig.work("canary").exists());
    assert!(
        !rig.work("__pycache__").exists(),
        "no bytecode left in the working dir"
    );

    // The function's exception fails the workload with exit code 1 and names the error.
    Start::new("training", "m-boom")
        .params(json!({"workload_uuid": "wl-boom", "n": 1, "boom": "bad input"}))
        .reply(&rig.cp, &node);
    let boom = completion(&rig.cp, "wl-boom");
    assert_eq!(boom["success"], false);
    assert_eq!(boom["exit_code"], 1);
    assert_eq!(boom["error"], "ValueError: boom: bad input", "{boom}");

    // A module without the type's function says what to add.
    Start::new("inference", "m-nofn")
        .workload("wl-nofn")
        .reply(&rig.cp, &node);
    let nofn = completion(&rig.cp, "wl-nofn");
    assert_eq!(nofn["exit_code"], 2);
    assert_eq!(
        nofn["error"],
        "Module broken.py does not export infer(). Add 'def infer(**params): ...' to the module."
    );

    // A missing file is refused before anything starts, without a local path.
    rig.cp.command(&node.uuid(), json!({"command": "simulate", "request_id": "m-missing", "params": {"workload_uuid": "wl-missing"}}));
    let r = rig.cp.wait_reply("m-missing", REPLY).expect("reply");
    assert_eq!(r["status"], "error");
    assert_eq!(
        r["error"],
        "Failed to start simulate: Module not found: missing.py. Check 'simulate: missing.py' in cyberwave.yml.",
        "{r}"
    );

    // Module workloads are tracked like any other: busy, listed and cancellable.
    let r = Start::new("training", "m-long")
        .params(json!({"workload_uuid": "wl-long", "n": 1, "sleep": 30}))
        .reply(&rig.cp, &node);
    let pid = r["output"]["pid"].as_i64().unwrap_or(0);
    assert!(pid > 0 && pid_alive(pid), "{r}");
    rig.cp.command(&node.uuid(), json!({"command": "cancel", "request_id": "m-cancel", "params": {"workload_request_id": "m-long"}}));
    assert_eq!(
        rig.cp.wait_reply("m-cancel", REPLY).expect("cancel")["status"],
        "ok"
    );
    let long = rig
        .cp
        .wait_status("wl-long", "failed", DONE)
        .expect("cancelled");
    assert_eq!(
        long[1]["message"], "Workload cancelled by SIGTERM",
        "{long:?}"
    );
    assert!(wait_for(REPLY, || (!pid_alive(pid)).then_some(())).is_some());
}
