//! Workflow execution ingress (D67): the node reports its own workloads as node events,
//! workloads `emit` theirs (in order, with their own token, which a forger lacks) through the
//! node's control socket, bad input is refused with exit 2 and nothing queued, and the queue
//! keeps its events across broker outages and a SIGKILL of the node, each workload within its
//! share, one refused workflow never holding back another's (guarantees 3 and 13).

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::control_plane::Request;
use crate::support::node::NodeSetup;
use crate::support::scenario::error_of;
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{node_bin, wait_for, Broker, ControlPlane, NodeProcess, Rig, Scenario, Start};

/// The node has not exited.
fn assert_running(node: &mut NodeProcess, what: &str) {
    assert!(
        node.wait_exit(Duration::ZERO).is_none(),
        "the node died ({what}); log:\n{}",
        node.log()
    );
}

fn events(cp: &ControlPlane, prefix: &str) -> Vec<Request> {
    cp.requests("ingress")
        .into_iter()
        .filter(|r| r.id.starts_with(prefix))
        .collect()
}

fn wait_events(cp: &ControlPlane, prefix: &str, n: usize) -> Vec<Request> {
    wait_for(DONE, || {
        let e = events(cp, prefix);
        (e.len() >= n).then_some(e)
    })
    .unwrap_or_else(|| {
        panic!(
            "fewer than {n} events for {prefix}: {:?}",
            events(cp, prefix)
                .iter()
                .map(|r| &r.body)
                .collect::<Vec<_>>()
        )
    })
}

#[test]
fn the_node_reports_its_own_workloads_as_node_events() {
    let (rig, node) = Scenario::new("cyberwave:\n  training: sleep 0.3\n  simulate: echo 'physics exploded' >&2; exit 4\n  max_concurrent_workloads: 2\n").node();
    let ctx = |n: &str| json!({"workload_uuid": format!("wl-{n}"), "workflow_uuid": "wf-1", "workflow_execution_uuid": "ex-1", "workflow_node_uuid": n, "activation_index": 2, "caller_uuid": "caller-1"});
    Start::new("training", "ok")
        .params(ctx("node-ok"))
        .ok(&rig.cp, &node);
    let ok = wait_events(&rig.cp, "wf-1/execution/ex-1/node/node-ok", 2);
    assert_eq!(ok[0].body["status"], "running");
    assert_eq!(ok[0].body["source_type"], "edge");
    assert_eq!(ok[0].body["activation_index"], 2);
    assert_eq!(ok[0].body["caller_uuid"], "caller-1");
    assert!(ok[0].body["started_at"]
        .as_str()
        .unwrap_or_default()
        .ends_with('Z'));
    assert_eq!(ok[1].body["status"], "success");
    assert_eq!(
        ok[1].body["output_data"],
        json!([{"exit_code": 0, "workload_uuid": "wl-node-ok"}])
    );
    let ms = ok[1].body["execution_time_ms"].as_i64().unwrap_or(0);
    assert!((250..5000).contains(&ms), "duration {ms} ms");
    assert!(ok[1].body.get("error_message").is_none());
    assert!(ok[1].body["finished_at"].is_string());
    for e in &ok {
        assert!(
            e.body
                .as_object()
                .map(|o| o.values().all(|v| !v.is_null()))
                .unwrap_or(false),
            "no nulls: {}",
            e.body
        );
    }
    // A failing workload (simulate ⇒ source_type sim) reports error with its summary.
    let mut p = ctx("node-bad");
    p["execution_uuid"] = json!("ex-1");
    Start::new("simulate", "bad").params(p).ok(&rig.cp, &node);
    let bad = wait_events(&rig.cp, "wf-1/execution/ex-1/node/node-bad", 2);
    assert_eq!(bad[1].body["status"], "error");
    assert_eq!(bad[1].body["source_type"], "sim");
    assert_eq!(bad[1].body["error_message"], "physics exploded");
    assert_eq!(bad[1].body["output_data"][0]["exit_code"], 4);
    // A refused start reports error; the node never opens or closes the execution itself.
    let mut p = ctx("node-refused");
    p["workflow_node_uuid"] = json!("node-refused");
    rig.cp.command(
        &node.uuid(),
        json!({"command": "inference", "request_id": "nocmd", "params": p}),
    );
    let refused = wait_events(&rig.cp, "wf-1/execution/ex-1/node/node-refused", 1);
    assert_eq!(refused[0].body["status"], "error");
    assert!(refused[0].body["error_message"]
        .as_str()
        .unwrap_or_default()
        .contains("not configured"));
    assert!(rig
        .cp
        .requests("ingress")
        .iter()
        .all(|r| !r.id.ends_with("/started") && !r.id.ends_with("/finished")));
}

#[test]
fn workloads_emit_events_in_order_and_bad_tokens_are_refused() {
    let (rig, node) = Scenario::new("cyberwave:\n  inference: |\n    E=$(\"$CYBERWAVE_NODE_BIN\" emit started --workflow wf-e --trigger-json '{\"frame\": 7}')\n    \"$CYBERWAVE_NODE_BIN\" emit node --workflow wf-e --execution \"$E\" --node n1 --status running --started-at 2026-11-29T10:00:00+01:00\n    \"$CYBERWAVE_NODE_BIN\" emit node --workflow wf-e --execution \"$E\" --node n1 --status success --output-json '[{\"k\": 1}]' --execution-time-ms 42 --finished-at 1764410400\n    \"$CYBERWAVE_NODE_BIN\" emit finished --workflow wf-e --execution \"$E\" --status success\n    CYBERWAVE_NODE_EVENT_TOKEN=forged \"$CYBERWAVE_NODE_BIN\" emit finished --workflow wf-e --execution \"$E\" --status error; echo \"forged=$?\" > rc.txt\n  training: |\n    \"$CYBERWAVE_NODE_BIN\" emit node --workflow wf-other --execution x1 --node n1 --status running; echo \"other=$?\" >> rc.txt\n    \"$CYBERWAVE_NODE_BIN\" emit node --workflow wf-bound --execution x1 --node n2 --status running; echo \"own=$?\" >> rc.txt\n").node();
    let Rig { cp, setup, .. } = &rig;
    Start::new("inference", "em").ok(cp, &node);
    let ev = wait_events(cp, "wf-e/", 4);
    assert_eq!(
        ev.len(),
        4,
        "the forged one is not sent: {:?}",
        ev.iter().map(|r| &r.id).collect::<Vec<_>>()
    );
    let execution = ev[0].body["execution_uuid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    // Every event carries the publisher's session (the node's MQTT client id) and, unless told
    // otherwise, the SDK reporter's `edge` source type; the rest is compared exactly.
    let client_id = node
        .log()
        .lines()
        .find_map(|l| l.split("MQTT client ").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .map(String::from)
        .expect("the client id is logged");
    let ev: Vec<Request> = ev
        .into_iter()
        .map(|mut r| {
            let m = r.body.as_object_mut().expect("an object");
            assert_eq!(m.remove("session_id"), Some(json!(client_id)), "{:?}", m);
            assert_eq!(m.remove("source_type"), Some(json!("edge")), "{:?}", m);
            r
        })
        .collect();
    assert_eq!(ev[0].id, "wf-e/execution/started");
    assert_eq!(ev[0].body["trigger_data"], json!({"frame": 7}));
    assert_eq!(ev[1].id, format!("wf-e/execution/{execution}/node/n1"));
    assert_eq!(
        ev[1].body,
        json!({"status": "running", "started_at": "2026-11-29T09:00:00.000000Z"})
    );
    assert_eq!(
        ev[2].body,
        json!({"status": "success", "output_data": [{"k": 1}], "execution_time_ms": 42, "finished_at": "2025-11-29T10:00:00.000000Z"})
    );
    assert_eq!(ev[3].id, format!("wf-e/execution/{execution}/finished"));
    assert_eq!(ev[3].body, json!({"status": "success"}));
    assert!(cp.wait_status("wl-em", "completed", DONE).is_some());
    let rc = std::fs::read_to_string(setup.cwd.join("rc.txt")).unwrap_or_default();
    assert!(rc.contains("forged=3"), "{rc}");
    // A workload started for one workflow may report only that workflow.
    let bound = json!({"workload_uuid": "wl-bound", "workflow_uuid": "wf-bound", "execution_uuid": "x1", "node_uuid": "n0"});
    Start::new("training", "bound").params(bound).ok(cp, &node);
    assert!(cp.wait_status("wl-bound", "completed", DONE).is_some());
    let rc = std::fs::read_to_string(setup.cwd.join("rc.txt")).unwrap_or_default();
    assert!(rc.contains("other=3") && rc.contains("own=0"), "{rc}");
    assert!(events(cp, "wf-other/").is_empty());
    assert!(!wait_events(cp, "wf-bound/execution/x1/node/n2", 1).is_empty());
}

#[test]
fn emit_rejects_bad_input_with_exit_2_and_queues_nothing() {
    let mut s = NodeSetup::bare();
    s.set("CYBERWAVE_NODE_EVENT_TOKEN", "whatever");
    s.set(
        "CYBERWAVE_NODE_SOCKET",
        &s.home.join(".cyberwave/control.sock").display().to_string(),
    );
    // 3 × 100 KiB: over the 256 KiB payload limit, each argument under the OS's 128 KiB limit.
    let big = format!("{{\"x\": \"{}\"}}", "y".repeat(100 * 1024));
    let big_list = format!("[\"{}\"]", "y".repeat(100 * 1024));
    // Every case is a usage error: a bad status, a bad time, too big, broken JSON, no
    // execution, an unknown event.
    let node_event = |rest: &[&str]| -> Vec<String> {
        [
            "emit",
            "node",
            "--workflow",
            "w",
            "--execution",
            "e",
            "--node",
            "n",
        ]
        .iter()
        .chain(rest)
        .map(|a| a.to_string())
        .collect()
    };
    let cases: Vec<Vec<String>> = vec![
        node_event(&["--status", "done"]),
        [
            "emit",
            "finished",
            "--workflow",
            "w",
            "--execution",
            "e",
            "--status",
            "cancelled",
        ]
        .map(String::from)
        .to_vec(),
        node_event(&["--status", "running", "--started-at", "last tuesday"]),
        node_event(&[
            "--status",
            "running",
            "--metadata-json",
            &big,
            "--input-json",
            &big_list,
            "--output-json",
            &big_list,
        ]),
        node_event(&["--status", "running", "--input-json", "{broken"]),
        [
            "emit",
            "node",
            "--workflow",
            "w",
            "--node",
            "n",
            "--status",
            "running",
        ]
        .map(String::from)
        .to_vec(),
        ["emit", "restarted", "--workflow", "w"]
            .map(String::from)
            .to_vec(),
    ];
    for args in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = s.run(&args);
        assert_eq!(out.code, Some(2), "{args:?}: {out:?}");
        assert!(out.stderr.starts_with("error: "), "{out:?}");
        assert!(!out.stderr.contains("panicked"));
    }
    assert!(
        !s.home.join(".cyberwave/ingress").exists(),
        "nothing was queued"
    );
    assert!(std::path::Path::new(&node_bin()).exists());
}

#[test]
fn g3_events_survive_a_broker_outage_and_a_sigkill_of_the_node() {
    let mut rig = Scenario::new("cyberwave:\n  inference: |\n    while [ ! -f go ]; do sleep 0.05; done\n    E=$(\"$CYBERWAVE_NODE_BIN\" emit started --workflow wf-k --execution ex-k)\n    for i in $(seq 1 99); do \"$CYBERWAVE_NODE_BIN\" emit node --workflow wf-k --execution ex-k --node n$i --status success || exit 9; done\n    echo done > emitted.txt\n").rig();
    let Rig {
        broker, cp, setup, ..
    } = &mut rig;
    let mut node = setup.spawn();
    node.wait_ready(READY);
    Start::new("inference", "k").ok(cp, &node);
    broker.stop();
    std::fs::write(setup.cwd.join("go"), "").expect("go");
    // `emit` returns while the broker is down: the events are in the node's queue.
    assert!(
        wait_for(DONE, || std::fs::read_to_string(
            setup.cwd.join("emitted.txt")
        )
        .ok())
        .is_some(),
        "emit blocked: {}",
        node.log()
    );
    node.kill9();
    broker.restart();
    cp.wait_subscribed();
    let node = setup.spawn();
    node.wait_ready(READY);
    let ev = wait_for(DONE, || {
        let e = events(cp, "wf-k/");
        let mut ids: Vec<String> = e.iter().map(|r| r.id.clone()).collect();
        ids.sort();
        ids.dedup();
        (ids.len() >= 100).then_some(e)
    })
    .unwrap_or_else(|| {
        panic!(
            "only {} distinct events; log:\n{}",
            events(cp, "wf-k/").len(),
            node.log()
        )
    });
    assert_eq!(
        ev[0].id, "wf-k/execution/started",
        "node events come after their started"
    );
    for i in 1..=99 {
        assert!(
            ev.iter()
                .any(|r| r.id == format!("wf-k/execution/ex-k/node/n{i}")),
            "n{i} lost"
        );
    }
}

#[test]
fn emit_while_the_node_is_down_queues_the_event_for_its_return() {
    let (rig, mut node) = Scenario::new("cyberwave:\n  inference: |\n    while [ ! -f go ]; do sleep 0.05; done\n    \"$CYBERWAVE_NODE_BIN\" emit node --workflow wf-off --execution ex --node n1 --status success; echo \"rc=$?\" > rc.txt\n    CYBERWAVE_NODE_EVENT_TOKEN=forged \"$CYBERWAVE_NODE_BIN\" emit node --workflow wf-off --execution ex --node n2 --status success; echo \"forged=$?\" >> rc.txt\n").node();
    let Rig { cp, setup, .. } = &rig;
    Start::new("inference", "off").ok(cp, &node);
    node.kill9();
    std::fs::write(setup.cwd.join("go"), "").expect("go");
    let rc = wait_for(DONE, || {
        std::fs::read_to_string(setup.cwd.join("rc.txt"))
            .ok()
            .filter(|r| r.contains("forged"))
    })
    .expect("emit ran");
    assert!(rc.contains("rc=0") && rc.contains("forged=3"), "{rc}");
    assert!(events(cp, "wf-off/").is_empty());
    let node = setup.spawn();
    node.wait_ready(READY);
    let ev = wait_events(cp, "wf-off/", 1);
    assert_eq!(ev[0].id, "wf-off/execution/ex/node/n1");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        events(cp, "wf-off/execution/ex/node/n2").is_empty(),
        "the forged event was never queued"
    );
}

/// The bytes of the node's ingress queue (its entry files).
fn queued_bytes(setup: &NodeSetup) -> u64 {
    std::fs::read_dir(setup.config_dir().join("ingress"))
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
                .map(|e| e.metadata().map_or(0, |m| m.len()))
                .sum()
        })
        .unwrap_or(0)
}

/// D67: with the broker away, a workload emitting large events fills its share of the queue
/// (a quarter of 16 MiB) and is then refused with exit 1 and a message saying so, nothing
/// queued; another workload still has its own share. Once the broker is back, every queued
/// event arrives, in order within its execution.
#[test]
fn g13_d67_a_workload_emitting_while_the_broker_is_away_fills_its_share_and_no_more() {
    let mut rig = Scenario::new("cyberwave:\n  max_concurrent_workloads: 2\n  training: |\n    while [ ! -f go ]; do sleep 0.05; done\n    pad=$(head -c 120000 /dev/zero | tr '\\0' x)\n    i=0\n    while [ $i -lt 60 ]; do\n      i=$((i+1))\n      \"$CYBERWAVE_NODE_BIN\" emit node --workflow wf-big --execution ex-$((i % 2)) --node n$i --status running --metadata-json \"{\\\"pad\\\": \\\"$pad\\\"}\" 2>err.txt\n      rc=$?\n      if [ $rc -ne 0 ]; then echo \"at=$i rc=$rc\" > refused.txt; break; fi\n    done\n    echo done > big.txt\n  inference: |\n    while [ ! -f go2 ]; do sleep 0.05; done\n    \"$CYBERWAVE_NODE_BIN\" emit node --workflow wf-small --execution ex --node n1 --status running; echo \"small=$?\" > small.txt\n").rig();
    let Rig {
        broker, cp, setup, ..
    } = &mut rig;
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::new("training", "big").ok(cp, &node);
    Start::new("inference", "small").ok(cp, &node);
    broker.stop();
    std::fs::write(setup.cwd.join("go"), "").expect("go");
    let refused = wait_for(DONE, || {
        std::fs::read_to_string(setup.cwd.join("big.txt")).ok()?;
        Some(std::fs::read_to_string(setup.cwd.join("refused.txt")).unwrap_or_default())
    })
    .expect("the workload ended its loop");
    assert!(refused.contains("rc=1"), "never refused: {refused:?}");
    let at: usize = refused
        .split_whitespace()
        .find_map(|w| w.strip_prefix("at="))
        .and_then(|n| n.parse().ok())
        .expect("where it was refused");
    let err = std::fs::read_to_string(setup.cwd.join("err.txt")).unwrap_or_default();
    assert!(
        err.contains("its share of the node's queue is 4194304") && err.contains("not queued"),
        "{err}"
    );
    let queued = queued_bytes(setup);
    assert!(queued <= 4 << 20, "{queued} bytes queued");
    assert!(
        queued >= 3 << 20,
        "{queued} bytes queued: the share was not used"
    );
    // Another workload has its own share.
    std::fs::write(setup.cwd.join("go2"), "").expect("go2");
    let small = wait_for(DONE, || {
        // Not the empty file the shell's `>` made before `echo` wrote into it.
        std::fs::read_to_string(setup.cwd.join("small.txt"))
            .ok()
            .filter(|s| s.ends_with('\n'))
    })
    .expect("the second workload emitted");
    assert_eq!(small.trim(), "small=0");
    // The fake backend's subscription must be back before the node sends: an event the broker
    // acknowledged while nobody subscribed is gone (the broker keeps no session across a
    // restart), and the node, rightly, does not send it again.
    node.signal(libc::SIGSTOP);
    broker.restart();
    cp.wait_subscribed();
    node.signal(libc::SIGCONT);
    let ev = wait_events(cp, "wf-big/", at - 1);
    assert_eq!(ev.len(), at - 1, "nothing refused was queued");
    for ex in ["ex-0", "ex-1"] {
        let order: Vec<u32> = ev
            .iter()
            .filter_map(|r| r.id.strip_prefix(&format!("wf-big/execution/{ex}/node/n")))
            .map(|n| n.parse().expect("a node number"))
            .collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(order, sorted, "{ex} out of order");
    }
    assert_eq!(wait_events(cp, "wf-small/", 1).len(), 1);
}

/// D67: the broker refuses one workflow's events (an ACL deny): each is retried and set
/// aside in turn, and another workload's event is delivered meanwhile instead of waiting
/// behind them all (strictly in order, it waited five refusals per event ahead of it).
#[test]
fn g13_d67_a_workflow_the_broker_refuses_never_holds_back_another_workloads_events() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  max_concurrent_workloads: 2\n  training: |\n    for i in $(seq 1 20); do \"$CYBERWAVE_NODE_BIN\" emit node --workflow wf-denied --execution ex --node n$i --status running; done\n    echo done > denied.txt\n  inference: |\n    while [ ! -f go ]; do sleep 0.05; done\n    \"$CYBERWAVE_NODE_BIN\" emit node --workflow wf-ok --execution ex --node n1 --status success\n",
    )
    .broker(Broker::start_with_acl(
        "pattern deny cyberwave/workflow/wf-denied/#\npattern readwrite #\n",
    ))
    .node();
    let Rig { cp, setup, .. } = &rig;
    Start::new("training", "denied").ok(cp, &node);
    assert!(wait_for(DONE, || std::fs::read_to_string(
        setup.cwd.join("denied.txt")
    )
    .ok())
    .is_some());
    Start::new("inference", "ok").ok(cp, &node);
    std::fs::write(setup.cwd.join("go"), "").expect("go");
    let ev = wait_events(cp, "wf-ok/", 1);
    assert_eq!(ev[0].id, "wf-ok/execution/ex/node/n1");
    let set_aside = std::fs::read_dir(rig.state("quarantine"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert!(
        set_aside < 20,
        "the event waited until all {set_aside} refused ones were set aside"
    );
    assert!(events(cp, "wf-denied/").is_empty());
}

/// A time with a multibyte character inside its offset (`--started-at
/// '2026-11-30T15:48:12+0é00'`) is refused, by the CLI and by the node on its control socket,
/// where the node reads it on its main thread: a parser that cut the text by bytes would panic.
#[test]
fn a_multibyte_time_is_refused_by_emit_and_by_the_control_socket_and_the_node_lives() {
    let (rig, mut node) =
        Scenario::new("cyberwave:\n  inference: |\n    while [ ! -f go ]; do sleep 0.05; done\n")
            .node();
    Start::new("inference", "t1").ok(&rig.cp, &node);
    // The running workload's event token, as its own `emit` would send it.
    let state = rig.setup.config_dir();
    let token = wait_for(REPLY, || {
        let rd = std::fs::read_dir(state.join("workloads")).ok()?;
        rd.flatten().find_map(|e| {
            let meta: Value =
                serde_json::from_slice(&std::fs::read(e.path().join("meta.json")).ok()?).ok()?;
            meta["event_token"]
                .as_str()
                .filter(|t| !t.is_empty())
                .map(String::from)
        })
    })
    .expect("the workload's event token");
    let bad = "2026-11-30T15:48:12+0é00";
    let sock = state.join("control.sock");

    // The CLI: a usage error (exit 2), nothing sent.
    let mut cli = rig.setup.clone();
    cli.set("CYBERWAVE_NODE_EVENT_TOKEN", &token);
    cli.set("CYBERWAVE_NODE_SOCKET", &sock.display().to_string());
    let out = cli.run(&[
        "emit",
        "node",
        "--workflow",
        "wf-t",
        "--execution",
        "ex-t",
        "--node",
        "n1",
        "--status",
        "running",
        "--started-at",
        bad,
    ]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.starts_with("error: --started-at: "), "{out:?}");
    assert!(!out.stderr.contains("panicked"), "{out:?}");

    // The socket, as a workload could write it directly: an error reply, the node keeps going.
    for time in [
        bad,
        "2026-11-30T15:48:12+é:00",
        "🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒",
    ] {
        for field in ["started_at", "finished_at"] {
            let req = json!({"op": "emit", "token": token, "fields": {
                "kind": "node", "workflow": "wf-t", "execution": "ex-t", "node": "n1",
                "status": "running", field: time}});
            let reply = rig.control(req.to_string().as_bytes());
            assert_eq!(reply["ok"], false, "{time:?}: {reply}");
            let err = error_of(&reply);
            assert!(err.contains("RFC 3339"), "{time:?}: {reply}");
            assert_running(&mut node, time);
        }
    }
    let status = rig.control(br#"{"op":"status"}"#);
    assert_eq!(status["ok"], true, "{status}");
    assert_eq!(
        status["status"]["workloads"].as_array().map(Vec::len),
        Some(1)
    );
    assert!(rig.cp.status(&node.uuid(), "after", REPLY).is_some());
    assert!(
        rig.cp.requests("ingress").is_empty(),
        "no event was queued for a bad time"
    );
    rig.touch("go");
    assert_running(&mut node, "at the end");
    assert!(!node.log().contains("panicked"), "{}", node.log());
}

/// A workload runs before its start is reported: an `emit` it sends meanwhile waits for the
/// report and is then accepted (its token is the workload's own), not refused as unknown.
#[test]
fn g10_an_emit_from_a_workload_whose_start_is_not_reported_yet_is_accepted() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  inference: |\n    \"$CYBERWAVE_NODE_BIN\" emit started --workflow wf-s > t/emit.out 2>&1; echo \"rc=$?\" >> t/emit.out\n    sleep 1\n",
    )
    .slow_disk(500)
    .dir("t")
    .node();
    Start::new("inference", "em").send(&rig.cp, &node);
    let reply = rig
        .cp
        .wait_reply("em", Duration::from_secs(15))
        .expect("no reply");
    assert_eq!(reply["status"], "ok", "{reply}");
    let out = wait_for(Duration::from_secs(15), || {
        std::fs::read_to_string(rig.work("t/emit.out"))
            .ok()
            .filter(|s| s.contains("rc="))
    })
    .expect("emit did not finish");
    assert!(
        out.contains("rc=0"),
        "emit accepted: {out}\nlog:\n{}",
        node.log()
    );
    let events = wait_for(Duration::from_secs(15), || {
        Some(rig.cp.requests("ingress"))
            .filter(|r| r.iter().any(|r| r.id == "wf-s/execution/started"))
    });
    assert!(events.is_some(), "the event was sent");
}
