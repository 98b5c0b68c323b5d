//! `./scripts/bench start`: how fast a start command becomes a running workload process, and
//! whether `status` is still answered at once while starts are in flight on a slow disk.
//!
//! "Process started" is the workload's own first action: its shell writes `$EPOCHREALTIME` to
//! a file named after its request id. The slow disk is `CYBERWAVE_TEST_SLOW_FSYNC_MS` (every
//! fsync of the node's state sleeps that long first; honoured by every build).

use std::time::{Duration, Instant, SystemTime};

use serde_json::json;

use super::support::node::NodeSetup;
use super::support::{Broker, ControlPlane};
use super::{epoch, report};

/// The simulated fsync time of the slow disk.
const SLOW_FSYNC_MS: u64 = 50;
/// Starts in flight at once on the slow disk.
const CONCURRENT: usize = 20;

pub fn run(sequential: usize) {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    println!(
        "start benchmark: {sequential} sequential starts; then {CONCURRENT} at once with every fsync {SLOW_FSYNC_MS} ms"
    );
    sequential_starts(&broker, &cp, sequential, None);
    sequential_starts(&broker, &cp, sequential.min(30), Some(SLOW_FSYNC_MS));
    concurrent_starts(&broker, &cp);
}

fn setup(broker: &Broker, cp: &ControlPlane, slow_ms: Option<u64>) -> NodeSetup {
    let mut setup = NodeSetup::new(broker, cp);
    setup.set("CYBERWAVE_MAX_CONCURRENT_WORKLOADS", "64");
    if let Some(ms) = slow_ms {
        setup.set("CYBERWAVE_TEST_SLOW_FSYNC_MS", &ms.to_string());
    }
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  inference: |\n    echo $EPOCHREALTIME > t/$CYBERWAVE_REQUEST_ID.start\n    sleep ${SLEEP_S:-0}\n",
    );
    std::fs::create_dir_all(setup.cwd.join("t")).ok();
    setup
}

fn started_at(setup: &NodeSetup, rid: &str) -> Option<f64> {
    std::fs::read_to_string(setup.cwd.join(format!("t/{rid}.start")))
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
}

/// One start at a time: command → workload process started, and command → reply. With
/// `CYBERWAVE_NODE_BIN_B` set (another build, e.g. the one before a change), a node of each runs
/// side by side and the starts alternate between them, so both see the same machine load.
fn sequential_starts(broker: &Broker, cp: &ControlPlane, n: usize, slow_ms: Option<u64>) {
    let mut bins = vec![(String::new(), super::support::node_bin())];
    if let Some(b) = std::env::var_os("CYBERWAVE_NODE_BIN_B") {
        bins[0].0 = " A".into();
        bins.push((" B".into(), b.into()));
    }
    let nodes: Vec<_> = bins
        .iter()
        .map(|(label, bin)| {
            let setup = setup(broker, cp, slow_ms);
            // SAFETY (edition 2021: safe): the bench is single-threaded here.
            std::env::set_var("CYBERWAVE_NODE_BIN", bin);
            let node = setup.spawn();
            node.wait_ready(Duration::from_secs(20));
            (label.clone(), setup, node)
        })
        .collect();
    std::env::set_var("CYBERWAVE_NODE_BIN", &bins[0].1);
    let mut started = vec![Vec::new(); nodes.len()];
    let mut replied = vec![Vec::new(); nodes.len()];
    // Request ids of their own per run: the fake backend keeps every reply it saw.
    let tag = if slow_ms.is_some() { "slow" } else { "fast" };
    for i in 0..n * nodes.len() {
        let k = i % nodes.len();
        let (_, setup, node) = &nodes[k];
        let rid = format!("{tag}{i}");
        let wall = SystemTime::now();
        let t = Instant::now();
        cp.command(
            &node.uuid(),
            json!({"command": "inference", "request_id": rid, "params": {"workload_uuid": format!("w{rid}")}}),
        );
        if cp.wait_reply(&rid, Duration::from_secs(20)).is_none() {
            continue;
        }
        if let Some(at) = cp.reply_time(&rid) {
            replied[k].push(at.saturating_duration_since(t));
        }
        let s = super::support::wait_for(Duration::from_secs(5), || started_at(setup, &rid));
        if let Some(s) = s {
            started[k].push(Duration::from_secs_f64((s - epoch(wall)).max(0.0)));
        }
        // Let it end before the next one: one start at a time.
        cp.wait_status(&format!("w{rid}"), "completed", Duration::from_secs(10));
    }
    let disk = match slow_ms {
        None => "normal disk".to_string(),
        Some(ms) => format!("fsync {ms} ms"),
    };
    for (k, (label, ..)) in nodes.iter().enumerate() {
        report(
            &format!("command → workload process started ({disk}){label}"),
            std::mem::take(&mut started[k]),
            "p99 ≤ 5 ms",
        );
        report(
            &format!("command → start reply ({disk}){label}"),
            std::mem::take(&mut replied[k]),
            "-",
        );
    }
}

/// `CONCURRENT` starts sent at once on the slow disk; `status` is sent one after the other
/// until the last start was answered, and its round trips are what this prints.
fn concurrent_starts(broker: &Broker, cp: &ControlPlane) {
    let mut setup = setup(broker, cp, Some(SLOW_FSYNC_MS));
    setup.set("SLEEP_S", "30");
    let node = setup.spawn();
    node.wait_ready(Duration::from_secs(20));
    let uuid = node.uuid();
    let mut sent = Vec::new();
    for i in 0..CONCURRENT {
        let rid = format!("c{i}");
        sent.push((rid.clone(), SystemTime::now()));
        cp.command(
            &uuid,
            json!({"command": "inference", "request_id": rid, "params": {"workload_uuid": format!("wc{i}")}}),
        );
    }
    let all_replied = || sent.iter().all(|(r, _)| !cp.replies_for(r).is_empty());
    let mut rtt = Vec::new();
    let begun = Instant::now();
    let mut k = 0;
    while !all_replied() && begun.elapsed() < Duration::from_secs(60) {
        let rid = format!("st{k}");
        k += 1;
        let t = Instant::now();
        cp.command(&uuid, json!({"command": "status", "request_id": rid}));
        if cp.wait_reply(&rid, Duration::from_secs(20)).is_some() {
            if let Some(at) = cp.reply_time(&rid) {
                rtt.push(at.saturating_duration_since(t));
            }
        }
    }
    let window = begun.elapsed();
    let mut started = Vec::new();
    for (rid, wall) in &sent {
        let s = super::support::wait_for(Duration::from_secs(5), || started_at(&setup, rid));
        if let Some(s) = s {
            started.push(Duration::from_secs_f64((s - epoch(*wall)).max(0.0)));
        }
    }
    println!(
        "{CONCURRENT} starts at once, fsync {SLOW_FSYNC_MS} ms: all answered after {:.0} ms; {} status commands meanwhile",
        window.as_secs_f64() * 1e3,
        rtt.len()
    );
    report(
        &format!("status round trip, {CONCURRENT} starts in flight"),
        rtt,
        "≤ 5 ms",
    );
    report(
        &format!("command → process started, {CONCURRENT} at once"),
        started,
        "-",
    );
}
