//! `./scripts/bench emit`: an `emit` flood with the broker away (D67). Four running workloads
//! send workflow events of 250 KiB as fast as the node answers, two connections each, straight
//! to its control socket with their own event tokens (as `emit` does), until each has tried
//! 1 024 times. Printed: what was queued and refused, the node's RSS before, at its peak and
//! after, and the queue's bytes on disk. Target: the node's RSS stays under 64 MiB.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::support::node::NodeSetup;
use super::support::{wait_for, Broker, ControlPlane};

const WORKLOADS: usize = 4;
const PER_CONNECTION: usize = 1024;
const PAD: usize = 250 * 1024;

fn call(sock: &Path, line: &[u8]) -> Option<Value> {
    let mut s = UnixStream::connect(sock).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
    s.write_all(line).ok()?;
    s.write_all(b"\n").ok()?;
    let mut reply = String::new();
    BufReader::new(s).read_line(&mut reply).ok()?;
    serde_json::from_str(&reply).ok()
}

/// The event tokens of the running workloads, from their records.
fn tokens(state: &Path) -> Vec<String> {
    std::fs::read_dir(state.join("workloads"))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let meta: Value =
                        serde_json::from_slice(&std::fs::read(e.path().join("meta.json")).ok()?)
                            .ok()?;
                    meta["event_token"].as_str().map(String::from)
                })
                .collect()
        })
        .unwrap_or_default()
}

fn queue_bytes(state: &Path) -> u64 {
    std::fs::read_dir(state.join("ingress"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.metadata().map_or(0, |m| m.len()))
                .sum()
        })
        .unwrap_or(0)
}

pub fn run() {
    let mut broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        &format!("cyberwave:\n  max_concurrent_workloads: {WORKLOADS}\n  training: while [ ! -f stop ]; do sleep 0.1; done\n"),
    );
    let node = setup.spawn();
    node.wait_ready(Duration::from_secs(20));
    for i in 0..WORKLOADS {
        let rid = format!("emit-{i}");
        cp.command(
            &node.uuid(),
            json!({"command": "training", "request_id": rid, "params": {"workload_uuid": format!("wl-emit-{i}")}}),
        );
        cp.wait_reply(&rid, Duration::from_secs(20));
    }
    let state = setup.config_dir();
    let tokens = wait_for(Duration::from_secs(20), || {
        Some(tokens(&state)).filter(|t| t.len() == WORKLOADS)
    })
    .expect("the workloads' event tokens");
    broker.stop();
    std::thread::sleep(Duration::from_secs(1));
    let (_, idle_rss, _) = super::proc_stats(node.pid());
    let sock = state.join("control.sock");
    let t0 = Instant::now();
    let threads: Vec<_> = tokens
        .iter()
        .flat_map(|t| [t.clone(), t.clone()])
        .enumerate()
        .map(|(c, token)| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let pad = "x".repeat(PAD);
                let (mut ok, mut refused) = (0usize, 0usize);
                for i in 0..PER_CONNECTION {
                    let req = json!({"op": "emit", "token": token, "fields": {
                        "kind": "node", "workflow": "wf-bench", "execution": format!("ex-{c}"),
                        "node": format!("n{i}"), "status": "running", "metadata": {"pad": pad}}});
                    match call(&sock, req.to_string().as_bytes()) {
                        Some(r) if r["ok"] == true => ok += 1,
                        _ => refused += 1,
                    }
                }
                (ok, refused)
            })
        })
        .collect();
    // The node's RSS while the flood runs.
    let mut peak_rss = idle_rss;
    while !threads.iter().all(|t| t.is_finished()) {
        peak_rss = peak_rss.max(super::proc_stats(node.pid()).1);
        std::thread::sleep(Duration::from_millis(20));
    }
    let (ok, refused) = threads
        .into_iter()
        .map(|t| t.join().unwrap_or((0, 0)))
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    let secs = t0.elapsed().as_secs_f64();
    let (hwm, rss, _) = super::proc_stats(node.pid());
    println!(
        "{:<44} {} events of {} KiB from {WORKLOADS} workloads in {secs:.1} s: {ok} queued, {refused} refused; queue {} KiB on disk",
        "emit flood, broker away",
        ok + refused,
        PAD / 1024,
        queue_bytes(&state) / 1024
    );
    println!(
        "{:<44} RSS {idle_rss} KiB before, {peak_rss} KiB at most during (VmHWM {hwm} KiB), {rss} KiB after (target < 64 MiB)",
        "node memory under the emit flood"
    );
    let _ = std::fs::write(setup.cwd.join("stop"), "");
}
