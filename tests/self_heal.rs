//! Self-healing: the node asks the backend (E7) about the workloads it runs, before heartbeats
//! and on their cadence; one the backend says is finished (or does not know: 404) is stale,
//! ended and its slot reused without a completion; an inconclusive answer (500, a hang) keeps the
//! workload and never delays a heartbeat (guarantee 6); a workload id is asked about on its own
//! REST path only.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::timeouts::REPLY;
use crate::support::{procs, wait_for, Scenario, Start};

#[test]
fn a_stale_workload_is_terminated_and_its_slot_reused() {
    let (rig, node) = Scenario::new("cyberwave:\n  training: sleep 60\n")
        .env("CYBERWAVE_HEARTBEAT_INTERVAL", "30")
        .node();
    let first = Start::training("old").reply(&rig.cp, &node);
    let pid = first["output"]["pid"].as_i64().unwrap_or(0);
    // The backend finished with it long ago; a new start must not be refused because of it.
    rig.cp.set_behaviour(|b| {
        b.workloads
            .insert("wl-old".into(), Some((200, json!({"status": "completed"}))));
    });
    let t = Instant::now();
    let r = Start::training("new").reply(&rig.cp, &node);
    assert_eq!(r["status"], "ok", "{r}\n{}", node.log());
    assert!(t.elapsed() < Duration::from_secs(8));
    assert!(!procs::exists(pid), "the stale workload is gone");
    std::thread::sleep(Duration::from_millis(500));
    let old = rig.cp.statuses("wl-old");
    assert!(
        old.iter().all(|s| s["status"] == "running"),
        "no completion for a stale workload: {old:?}"
    );
    assert!(
        node.log()
            .contains("is stale (the backend says it is completed)"),
        "{}",
        node.log()
    );
}

#[test]
fn self_heal_runs_before_heartbeats_and_404_means_stale() {
    let (rig, node) = Scenario::new("cyberwave:\n  training: sleep 60\n")
        .env("CYBERWAVE_HEARTBEAT_INTERVAL", "0.5")
        .node();
    let r = Start::training("gone").reply(&rig.cp, &node);
    let pid = r["output"]["pid"].as_i64().unwrap_or(0);
    rig.cp.set_behaviour(|b| {
        b.workloads.insert(
            "wl-gone".into(),
            Some((404, json!({"detail": "not found"}))),
        );
    });
    let gone = wait_for(Duration::from_secs(8), || {
        (!procs::exists(pid)).then_some(())
    });
    assert!(
        gone.is_some(),
        "terminated by the pass before a heartbeat; log:\n{}",
        node.log()
    );
    let mut n = 0;
    let emptied = wait_for(REPLY, || {
        n += 1;
        let st = rig.cp.status(&node.uuid(), &format!("st-{n}"), REPLY)?;
        (st["output"]["active_workloads"] == json!([])).then_some(())
    });
    assert!(emptied.is_some(), "the stale workload is no longer tracked");
    assert!(
        rig.cp
            .statuses("wl-gone")
            .iter()
            .all(|s| s["status"] == "running"),
        "and was not reported"
    );
}

/// D20 allows `.`, `?` and `=` in a workload id: a workload named `..` or `x?y=1` is still asked
/// about on its own REST path (`…/cloud-node-workloads/%2E%2E`), never on another endpoint, nor
/// with a query of its choosing, with the node's token.
#[test]
fn g5_a_workload_id_of_dots_or_a_query_stays_on_its_own_rest_path() {
    let (rig, node) = Scenario::new("cyberwave:\n  training: sleep 60\n")
        .env("CYBERWAVE_HEARTBEAT_INTERVAL", "0.5")
        .env("CYBERWAVE_MAX_CONCURRENT_WORKLOADS", "2")
        .node();
    for (rid, wl) in [("dots", ".."), ("query", "x?y=1")] {
        let r = Start::training(rid).workload(wl).reply(&rig.cp, &node);
        assert_eq!(r["status"], "ok", "{r}");
    }
    let asked = wait_for(Duration::from_secs(8), || {
        let hits: Vec<String> = rig.cp.http_hits().into_iter().map(|(url, _)| url).collect();
        let both = [
            "/api/v1/cloud-node-workloads/%2E%2E",
            "/api/v1/cloud-node-workloads/x%3Fy%3D1",
        ]
        .iter()
        .all(|want| hits.iter().any(|u| u == want));
        both.then_some(())
    });
    assert!(asked.is_some(), "{:?}\n{}", rig.cp.http_hits(), node.log());
    for (url, _) in rig.cp.http_hits() {
        assert!(!url.contains("/..") && !url.contains('?'), "{url}");
    }
}

#[test]
fn g6_an_inconclusive_backend_keeps_the_workload_and_heartbeats_stay_on_time() {
    let (rig, node) =
        Scenario::new("cyberwave:\n  training: sleep 60\n  max_concurrent_workloads: 2\n")
            .env("CYBERWAVE_HEARTBEAT_INTERVAL", "0.5")
            .backend(|b| {
                b.workloads.insert("wl-500".into(), Some((500, json!({}))));
                b.workloads.insert("wl-hang".into(), None);
            })
            .node();
    let p1 = Start::training("k500")
        .workload("wl-500")
        .reply(&rig.cp, &node)["output"]["pid"]
        .as_i64()
        .unwrap_or(0);
    let p2 = Start::training("khang")
        .workload("wl-hang")
        .reply(&rig.cp, &node)["output"]["pid"]
        .as_i64()
        .unwrap_or(0);
    let from = Instant::now();
    // Within a second a pass asks about wl-hang, whose lookup hangs for its whole 5 s timeout:
    // 3 s of beats fall inside the hang (the table's timers are unit-tested in node/table.rs).
    std::thread::sleep(Duration::from_secs(3));
    let beats: Vec<Instant> = rig
        .cp
        .requests("heartbeat")
        .into_iter()
        .map(|r| r.at)
        .filter(|t| *t >= from)
        .collect();
    assert!(beats.len() >= 5, "{} heartbeats in 3 s", beats.len());
    for w in beats.windows(2) {
        assert!(
            w[1] - w[0] < Duration::from_millis(900),
            "a heartbeat was late: {:?}",
            w[1] - w[0]
        );
    }
    assert!(procs::exists(p1) && procs::exists(p2), "both kept");
    let hits = rig
        .cp
        .http_hits()
        .iter()
        .filter(|(u, _)| u.starts_with("/api/v1/cloud-node-workloads/"))
        .count();
    assert!(hits >= 2, "the backend was asked: {hits}");
}
