//! Operating the node from its host: `status` (of a running node, and of the state dir when it
//! is down), `logs`, `doctor`, drain and resume (commands and signals), `--drain-after-one`, the
//! metrics file; the control socket they use cannot be exhausted by idle connections.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::node::{NodeSetup, Output};
use crate::support::scenario::error_of;
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{procs, wait_for, Rig, Scenario, Start};

fn status_json(setup: &NodeSetup) -> Value {
    let out = setup.run(&["status", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"))
}

#[test]
fn status_shows_the_running_node_and_what_the_state_dir_says_when_it_is_down() {
    let (rig, mut node) = Scenario::new("cyberwave:\n  training: sleep 20\n").node();
    let Rig { cp, setup, .. } = &rig;
    let pid = Start::new("training", "st-1").reply(cp, &node)["output"]["pid"]
        .as_i64()
        .unwrap_or(0);
    let st = status_json(setup);
    assert_eq!(st["running"], true);
    assert_eq!(st["registered"], true);
    assert_eq!(st["connected"], true);
    assert_eq!(st["instance_uuid"], node.uuid());
    assert_eq!(st["accepting"], true);
    assert_eq!(st["workloads"][0]["pid"], pid);
    assert_eq!(st["workloads"][0]["request_id"], "st-1");
    assert!(st["workloads"][0]["stdout_log"]
        .as_str()
        .unwrap_or_default()
        .ends_with("training_st-1.stdout.log"));
    let human = setup.run(&["status"]);
    assert!(
        human.stdout.contains("node:       running") && human.stdout.contains("request st-1"),
        "{human:?}"
    );
    node.kill9();
    let st = status_json(setup);
    assert_eq!(st["running"], false);
    assert_eq!(st["instance_uuid"], node.uuid());
    assert_eq!(st["workloads"][0]["pid"], pid);
    assert_eq!(st["workloads"][0]["state"], "running (node down)");
}

#[test]
fn logs_prints_and_follows_a_workload_until_it_ends() {
    let (rig, node) = Scenario::new("cyberwave:\n  training: |\n    for i in $(seq 1 15); do echo \"line $i\"; echo \"oops $i\" >&2; sleep 0.1; done\n").node();
    let Rig { cp, setup, .. } = &rig;
    Start::new("training", "lg").reply(cp, &node);
    let t = Instant::now();
    let out = setup
        .command(&["logs", "lg", "-f"])
        .output()
        .expect("logs -f");
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    let expected: String = (1..=15).map(|i| format!("line {i}\n")).collect();
    assert_eq!(text, expected, "followed to the end");
    assert!(
        t.elapsed() >= Duration::from_millis(800),
        "it followed instead of returning at once"
    );
    let o: Output = setup.run(&["logs", "lg", "--stderr", "-n", "2"]);
    assert_eq!(o.stdout, "oops 14\noops 15\n", "{o:?}");
    let o = setup.run(&["logs", "nope"]);
    assert_eq!(o.code, Some(1));
}

#[test]
fn doctor_passes_on_a_healthy_host_and_names_each_failure() {
    let mut rig = Scenario::new("cyberwave:\n  training: sleep 1\n  results_folder: out\n").rig();
    let Rig {
        broker, cp, setup, ..
    } = &mut rig;
    let out = setup.run(&["doctor"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    for check in [
        "configuration",
        "API token",
        "MQTT broker",
        "bash",
        "state dir",
        "results folder",
        "free disk",
        "systemd unit",
    ] {
        let line = out
            .stdout
            .lines()
            .find(|l| l.contains(check))
            .unwrap_or_default();
        assert!(line.starts_with("PASS"), "{check}: {}", out.stdout);
    }
    assert!(!setup.cwd.join("out").exists(), "doctor creates nothing");
    // Unwritable results folder.
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  training: sleep 1\n  results_folder: /proc/cw-results\n",
    );
    let out = setup.run(&["doctor"]);
    assert_eq!(out.code, Some(1));
    assert!(
        out.stdout
            .lines()
            .any(|l| l.starts_with("FAIL") && l.contains("results folder")),
        "{}",
        out.stdout
    );
    setup.write("cyberwave.yml", "cyberwave:\n  training: sleep 1\n");
    // A rejected token.
    cp.set_behaviour(|b| b.token_status = 401);
    let out = setup.run(&["doctor"]);
    assert_eq!(out.code, Some(1));
    assert!(
        out.stdout
            .lines()
            .any(|l| l.starts_with("FAIL") && l.contains("API token") && l.contains("rejected")),
        "{}",
        out.stdout
    );
    cp.set_behaviour(|b| b.token_status = 200);
    // A dead broker.
    broker.stop();
    setup.set("CYBERWAVE_NODE_RECONNECT_MAX_SECONDS", "0.5");
    let out = setup.run(&["doctor"]);
    assert_eq!(out.code, Some(1));
    assert!(
        out.stdout.lines().any(|l| l.starts_with("FAIL")
            && l.contains("MQTT broker")
            && l.contains("connection refused")),
        "{}",
        out.stdout
    );
}

#[test]
fn drain_refuses_new_work_lets_running_work_finish_and_resume_accepts_again() {
    let mut rig = Scenario::new("cyberwave:\n  training: sleep 1.5\n").rig();
    let Rig { cp, setup, .. } = &mut rig;
    setup.set("CYBERWAVE_HEARTBEAT_INTERVAL", "0.3");
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::new("training", "first").ok(cp, &node);
    let drained = setup.run(&["drain"]);
    assert_eq!(drained.code, Some(0), "{drained:?}");
    let r = Start::new("training", "refused").reply(cp, &node);
    assert_eq!(r["status"], "error");
    let failed = cp
        .wait_status("wl-refused", "failed", REPLY)
        .expect("R7 failed");
    // Retryable elsewhere (D21): the host-busy contract, with the reason beside it.
    assert_eq!(failed[0]["rejection_reason"], "host_busy");
    assert_eq!(failed[0]["busy_reason"], "draining");
    assert_eq!(failed[0]["rejecting_instance_uuid"], node.uuid());
    assert!(error_of(&r).starts_with("Controller host is busy with"));
    assert!(wait_for(REPLY, || cp
        .requests("heartbeat")
        .iter()
        .any(|h| h.body["draining"] == true)
        .then_some(()))
    .is_some());
    let t = Instant::now();
    let waited = setup.run(&["drain", "--wait"]);
    assert_eq!(waited.code, Some(0), "{waited:?}");
    assert!(waited.stdout.contains("idle"));
    assert!(
        cp.wait_status("wl-first", "completed", REPLY).is_some(),
        "the running workload completed"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(setup.run(&["resume"]).code, Some(0));
    Start::new("training", "again").ok(cp, &node);
    // The signal pair does the same.
    node.signal(libc::SIGUSR1);
    assert!(wait_for(REPLY, || (status_json(setup)["draining"] == true)
        .then_some(()))
    .is_some());
    node.signal(libc::SIGUSR2);
    assert!(wait_for(REPLY, || (status_json(setup)["draining"] == false)
        .then_some(()))
    .is_some());
}

#[test]
fn drain_after_one_exits_0_once_the_workload_completed() {
    let mut rig = Scenario::new("cyberwave:\n  training: sleep 0.5\n").rig();
    let Rig { cp, setup, .. } = &mut rig;
    setup.arg("--drain-after-one");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    Start::new("training", "only").ok(cp, &node);
    assert_eq!(
        Start::new("training", "second").reply(cp, &node)["status"],
        "error",
        "one-shot: no second workload"
    );
    node.assert_exit(0, DONE);
    assert!(
        cp.statuses("wl-only")
            .iter()
            .any(|s| s["status"] == "completed"),
        "reported before exiting"
    );
}

#[test]
fn g8_idle_control_connections_cannot_exhaust_threads_or_lock_out_status() {
    let (rig, node) = Scenario::new("cyberwave:\n  training: echo done\n").node();
    let Rig { setup, .. } = &rig;
    let sock = setup.config_dir().join("control.sock");
    let before = procs::status_number(node.pid(), "Threads:");
    assert!(before > 0);
    let idle: Vec<std::os::unix::net::UnixStream> = (0..200)
        .map(|_| std::os::unix::net::UnixStream::connect(&sock).expect("connect"))
        .collect();
    // `status` is accepted after the 200 (in order), so it also proves they were all handled.
    let out = setup.run(&["status", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("status JSON");
    assert_eq!(v["running"], true, "the running node answered: {v}");
    let during = procs::status_number(node.pid(), "Threads:");
    println!("node threads: {before} before, {during} with 200 idle control connections");
    assert!(
        during <= before + 64 + 8,
        "{during} threads with 200 idle connections ({before} before)"
    );
    drop(idle);
}

/// A small Prometheus text-format parser: (name, labels, value) per sample; panics on a bad line.
fn parse_prometheus(text: &str) -> Vec<(String, String, f64)> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if let Some(rest) = line.strip_prefix('#') {
            let words: Vec<&str> = rest.split_whitespace().collect();
            assert!(
                matches!(words.first(), Some(&"HELP") | Some(&"TYPE")),
                "bad comment {line:?}"
            );
            if words[0] == "TYPE" {
                assert!(["counter", "gauge"].contains(&words[2]), "{line:?}");
            }
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad sample {line:?}"));
        let (name, labels) = match series.find('{') {
            Some(i) => {
                assert!(series.ends_with('}'), "{line:?}");
                (&series[..i], &series[i..])
            }
            None => (series, ""),
        };
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && !name.is_empty(),
            "{line:?}"
        );
        out.push((
            name.to_string(),
            labels.to_string(),
            value
                .parse()
                .unwrap_or_else(|_| panic!("bad value {line:?}")),
        ));
    }
    out
}

fn sample(samples: &[(String, String, f64)], name: &str, labels: &str) -> f64 {
    samples
        .iter()
        .find(|(n, l, _)| n == name && l == labels)
        .map(|s| s.2)
        .unwrap_or(0.0)
}

#[test]
fn the_metrics_file_is_prometheus_text_and_its_counters_move() {
    let mut rig = Scenario::new(
        "cyberwave:\n  training: echo hello\n  simulate: exit 2\n  max_concurrent_workloads: 2\n",
    )
    .rig();
    let Rig { cp, setup, .. } = &mut rig;
    let metrics = setup.home.join("metrics/node.prom");
    std::fs::create_dir_all(metrics.parent().expect("dir")).expect("mkdir");
    setup
        .arg("--metrics-file")
        .arg(&metrics.display().to_string());
    setup.set("CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL", "0.2");
    setup.set("CYBERWAVE_NODE_METRICS_INTERVAL_SECONDS", "0.2");
    let node = setup.spawn();
    node.wait_ready(READY);
    let before = parse_prometheus(
        &wait_for(REPLY, || std::fs::read_to_string(&metrics).ok()).expect("metrics file"),
    );
    assert_eq!(sample(&before, "cyberwave_node_starts_total", ""), 0.0);
    Start::new("training", "m1").reply(cp, &node);
    Start::new("simulate", "m2").reply(cp, &node);
    cp.command(
        &node.uuid(),
        json!({"command": "inference", "request_id": "m3", "params": {}}),
    );
    assert!(
        cp.wait_status("wl-m1", "completed", DONE).is_some()
            && cp.wait_status("wl-m2", "completed", DONE).is_some()
    );
    let after = wait_for(Duration::from_secs(10), || {
        let s = parse_prometheus(&std::fs::read_to_string(&metrics).ok()?);
        // Both completions counted: the file is rewritten on its own interval, so one may
        // show before the other.
        let failures = sample(
            &s,
            "cyberwave_node_completions_total",
            "{outcome=\"failure\"}",
        );
        let successes = sample(
            &s,
            "cyberwave_node_completions_total",
            "{outcome=\"success\"}",
        );
        (failures >= 1.0 && successes >= 1.0).then_some(s)
    })
    .expect("counters moved");
    assert_eq!(sample(&after, "cyberwave_node_starts_total", ""), 2.0);
    assert_eq!(
        sample(
            &after,
            "cyberwave_node_completions_total",
            "{outcome=\"success\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &after,
            "cyberwave_node_rejections_total",
            "{reason=\"not_configured\"}"
        ),
        1.0
    );
    assert!(sample(&after, "cyberwave_node_log_bytes_streamed_total", "") >= 6.0);
    assert_eq!(
        sample(&after, "cyberwave_node_workloads", "{state=\"running\"}"),
        0.0
    );
}

/// D65: one workload user for several slots: `status` and `doctor` say that workloads share a
/// uid (and how to name a pool); `doctor` fails a pool smaller than the slots.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_d65_status_and_doctor_say_when_workloads_share_a_uid() {
    crate::support::assert_root("to run workloads as nobody");
    let rig = Scenario::new("cloud_node:\n  workload_user: nobody\n  max_concurrent_workloads: 2\ncyberwave:\n  training: sleep 1\n").rig();
    let Rig { setup, .. } = &rig;
    let doctor = setup.run(&["doctor"]);
    let line = doctor
        .stdout
        .lines()
        .find(|l| l.contains("workload user"))
        .unwrap_or_default();
    assert!(
        line.starts_with("WARN") && line.contains("share workload_user nobody"),
        "{doctor:?}"
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    node.assert_logged("share workload_user nobody");
    let st = status_json(setup);
    assert_eq!(st["workload_users"], json!(["nobody"]));
    let human = setup.run(&["status"]);
    assert!(
        human
            .stdout
            .contains("share workload_user nobody (uid 65534)"),
        "{human:?}"
    );
    // A pool smaller than the slots: the node would refuse to start.
    setup.write(
        "cyberwave.yml",
        "cloud_node:\n  workload_user: nobody,root\n  max_concurrent_workloads: 3\ncyberwave:\n  training: sleep 1\n",
    );
    let doctor = setup.run(&["doctor"]);
    assert!(
        doctor
            .stdout
            .lines()
            .any(|l| l.starts_with("FAIL") && l.contains("a pool of 2 users for 3 slots")),
        "{doctor:?}"
    );
}
