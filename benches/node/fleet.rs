//! `./scripts/bench fleet N`: N real node processes, started at once, against one mosquitto and
//! the fake backend, with the production timings (heartbeat 30 s, reconnect backoff 0.5–30 s).
//! Prints exec → ready, RSS per node, idle publishes and CPU per node per minute, the
//! heartbeat phase spread, `status` fan-out latency, and recovery after a broker outage
//! (per-node reconnect time, peak CONNECTs per second, `status` answered afterwards).
//! Judges nothing. `CW_FLEET_IDLE_SECONDS` (default 60) and `CW_FLEET_OUTAGE_SECONDS`
//! (default 3) set the idle window and the outage.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::json;

use super::support::node::{NodeProcess, NodeSetup};
use super::support::{Broker, ControlPlane};
use super::{percentile, proc_stats, threads};

fn env_secs(key: &str, default: u64) -> Duration {
    Duration::from_secs(
        std::env::var(key)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default),
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// p50 / p99 / max of `samples`, in ms.
fn spread(name: &str, mut samples: Vec<Duration>, of: usize) {
    samples.sort();
    println!(
        "{name:<44} {}/{of}  p50 {:>9.1} ms  p99 {:>9.1} ms  max {:>9.1} ms",
        samples.len(),
        ms(percentile(&samples, 0.5)),
        ms(percentile(&samples, 0.99)),
        ms(samples.last().copied().unwrap_or_default()),
    );
}

/// CPU seconds of every thread of `pid`, summed (schedstat: nanosecond resolution).
fn cpu(pid: i32) -> f64 {
    threads(pid).values().map(|(_, c, _)| c).sum()
}

fn connects(log: &str) -> usize {
    log.matches("connected to MQTT broker").count()
}

/// Sends `status` to every node and waits for the answers: (latencies, answered).
fn fan_out(cp: &ControlPlane, uuids: &[String], tag: &str) -> Vec<Duration> {
    let mut sent = Vec::with_capacity(uuids.len());
    for (i, uuid) in uuids.iter().enumerate() {
        let rid = format!("{tag}-{i}");
        sent.push((rid.clone(), Instant::now()));
        cp.command(uuid, json!({"command": "status", "request_id": rid}));
    }
    let end = Instant::now() + Duration::from_secs(60);
    let mut got = BTreeMap::new();
    while got.len() < sent.len() && Instant::now() < end {
        for (rid, at) in &sent {
            if got.contains_key(rid) {
                continue;
            }
            if let Some(t) = cp.reply_time(rid) {
                got.insert(rid.clone(), t.saturating_duration_since(*at));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    got.into_values().collect()
}

/// One node with the production timings, not the test rig's fast ones.
fn spawn_node(broker: &Broker, cp: &ControlPlane) -> NodeProcess {
    let mut s = NodeSetup::new(broker, cp);
    for k in [
        "CYBERWAVE_NODE_RECONNECT_MAX_SECONDS",
        "CYBERWAVE_NODE_RECONNECT_BASE_SECONDS",
        "CYBERWAVE_NODE_REGISTER_RETRY_MAX_SECONDS",
        "CYBERWAVE_NODE_TOKEN_CHECK_TIMEOUT_SECONDS",
        "CYBERWAVE_NODE_REQUEST_TIMEOUT_SECONDS",
    ] {
        s.unset(k);
    }
    s.set("RUST_LOG", "info");
    s.spawn()
}

/// Prints RSS per node, then publishes and CPU per node per minute over an `idle` window and
/// the heartbeat phase spread in it.
fn idle_cost(nodes: &[NodeProcess], cp: &ControlPlane, idle: Duration) {
    let n = nodes.len();
    std::thread::sleep(Duration::from_secs(5));
    let mut rss: Vec<u64> = nodes.iter().map(|p| proc_stats(p.pid()).1).collect();
    rss.sort_unstable();
    let total: u64 = rss.iter().sum();
    println!(
        "{:<44} mean {:.1} MiB  p50 {:.1} MiB  max {:.1} MiB  fleet {:.2} GiB",
        "RSS per node",
        total as f64 / 1024.0 / n.max(1) as f64,
        rss.get(rss.len() / 2).copied().unwrap_or(0) as f64 / 1024.0,
        rss.last().copied().unwrap_or(0) as f64 / 1024.0,
        total as f64 / 1024.0 / 1024.0
    );
    let cpu0: Vec<f64> = nodes.iter().map(|p| cpu(p.pid())).collect();
    let requests0 = cp.all_requests().len();
    let w0 = SystemTime::now();
    std::thread::sleep(idle);
    let per_min = 60.0 / idle.as_secs_f64().max(1e-3);
    let requests = cp.all_requests();
    let published = requests.len().saturating_sub(requests0);
    let used: f64 = nodes
        .iter()
        .zip(&cpu0)
        .map(|(p, c0)| cpu(p.pid()) - c0)
        .sum();
    println!(
        "{:<44} {:.2} publishes, {:.4} CPU s per node per minute",
        "idle (heartbeat 30 s)",
        published as f64 / n.max(1) as f64 * per_min,
        used / n.max(1) as f64 * per_min
    );
    // D39: heartbeats per second of the idle window (lock-step = all in one second).
    let mut per_sec: BTreeMap<u64, usize> = BTreeMap::new();
    for r in requests
        .iter()
        .filter(|r| r.op == "heartbeat" && r.wall >= w0)
    {
        let s = r
            .wall
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        *per_sec.entry(s).or_default() += 1;
    }
    let beats: usize = per_sec.values().sum();
    println!(
        "{:<44} {beats} heartbeats in {} distinct seconds, peak {} in one second",
        "heartbeat phase spread (idle window)",
        per_sec.len(),
        per_sec.values().max().copied().unwrap_or(0)
    );
}

/// Prints the peak CONNECTs per second that mosquitto logged from `restart_wall` on.
fn reconnect_storm(broker_log: &str, restart_wall: u64) {
    // mosquitto logs "<unix time>: New client connected ..." per CONNECT.
    let mut connects_per_sec: BTreeMap<u64, usize> = BTreeMap::new();
    for line in broker_log.lines() {
        if !line.contains("New client connected") {
            continue;
        }
        if let Some(ts) = line
            .split(':')
            .next()
            .and_then(|t| t.trim().parse::<u64>().ok())
        {
            if ts >= restart_wall {
                *connects_per_sec.entry(ts).or_default() += 1;
            }
        }
    }
    println!(
        "{:<44} peak {} CONNECTs/s, {} in all",
        "reconnect storm (mosquitto log)",
        connects_per_sec.values().max().copied().unwrap_or(0),
        connects_per_sec.values().sum::<usize>()
    );
}

pub fn run(n: usize) {
    let idle = env_secs("CW_FLEET_IDLE_SECONDS", 60);
    let outage = env_secs("CW_FLEET_OUTAGE_SECONDS", 3);
    let mut broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    println!(
        "fleet: {n} node processes started at once, one mosquitto, the fake backend; idle window {} s, broker outage {} s",
        idle.as_secs(),
        outage.as_secs()
    );

    // 1. exec → ready, all started at once.
    let mut nodes: Vec<NodeProcess> = (0..n).map(|_| spawn_node(&broker, &cp)).collect();
    let mut ready: Vec<Option<Duration>> = vec![None; n];
    let end = Instant::now() + Duration::from_secs(300);
    while ready.iter().any(Option::is_none) && Instant::now() < end {
        for (i, node) in nodes.iter().enumerate() {
            if ready.get(i).is_some_and(Option::is_none) && node.log().contains("node ready") {
                if let Some(r) = ready.get_mut(i) {
                    *r = Some(node.started.elapsed());
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    spread(
        "exec → node ready",
        ready.iter().flatten().copied().collect(),
        n,
    );
    let uuids: Vec<String> = nodes.iter().map(NodeProcess::uuid).collect();

    // 2. Footprint and idle cost.
    idle_cost(&nodes, &cp, idle);

    // 3. status to every node at once.
    let lat = fan_out(&cp, &uuids, "fan");
    spread("status fan-out (send → reply)", lat, n);

    // 4. Broker outage and restart.
    let before: Vec<usize> = nodes.iter().map(|p| connects(&p.log())).collect();
    broker.stop();
    std::thread::sleep(outage);
    let restart_wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let t = Instant::now();
    broker.restart();
    let mut back: Vec<Option<Duration>> = vec![None; n];
    let end = Instant::now() + Duration::from_secs(300);
    while back.iter().any(Option::is_none) && Instant::now() < end {
        for (i, node) in nodes.iter().enumerate() {
            if back.get(i).is_some_and(Option::is_none)
                && connects(&node.log()) > before.get(i).copied().unwrap_or(0)
            {
                if let Some(b) = back.get_mut(i) {
                    *b = Some(t.elapsed());
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    spread(
        "broker restart → node reconnected",
        back.iter().flatten().copied().collect(),
        n,
    );
    reconnect_storm(&broker.log(), restart_wall);
    let lat = fan_out(&cp, &uuids, "after");
    spread("status fan-out after the restart", lat, n);

    for node in &nodes {
        node.sigterm();
    }
    for node in &mut nodes {
        node.wait_exit(Duration::from_secs(20));
    }
}
