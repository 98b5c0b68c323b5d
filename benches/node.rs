//! Benchmarks of the real binary against a local mosquitto and the fake backend (the test rig).
//! Prints named figures with the machine they ran on; judges nothing. Run: `./scripts/bench`.

// Tests may panic: the no-panic lints (Cargo.toml `[lints.clippy]`) are for the node's own code.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::json;
use support::node::NodeSetup;
use support::{Broker, ControlPlane};

#[path = "node/brokers.rs"]
mod brokers;
#[path = "node/emit.rs"]
mod emit;
#[path = "node/fleet.rs"]
mod fleet;
#[path = "node/original.rs"]
mod original;
#[path = "node/preview.rs"]
mod preview;
#[path = "node/start.rs"]
mod start;
#[path = "node/upload.rs"]
mod upload;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn report(name: &str, mut samples: Vec<Duration>, target: &str) {
    samples.sort();
    println!(
        "{name:<44} n={:<4} p50={:>9.3} ms  p99={:>9.3} ms  max={:>9.3} ms  (target {target})",
        samples.len(),
        percentile(&samples, 0.5).as_secs_f64() * 1e3,
        percentile(&samples, 0.99).as_secs_f64() * 1e3,
        samples.last().copied().unwrap_or_default().as_secs_f64() * 1e3
    );
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown cpu".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cpu}, {cores} cores, Linux {}", kernel.trim())
}

/// (peak RSS KiB, current RSS KiB, CPU seconds) of a process.
/// Every process below `pid` (its children, theirs, …), from `/proc/<pid>/task/*/children`.
fn descendants(pid: i32) -> Vec<i32> {
    let children = |p: i32| -> Vec<i32> {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            return Vec::new();
        };
        tasks
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
            .flat_map(|s| {
                s.split_whitespace()
                    .filter_map(|c| c.parse().ok())
                    .collect::<Vec<i32>>()
            })
            .collect()
    };
    let mut all = children(pid);
    let mut i = 0;
    while let Some(p) = all.get(i).copied() {
        all.extend(children(p));
        i += 1;
    }
    all
}

fn proc_stats(pid: i32) -> (u64, u64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    // After the command name: state is field 0, utime 11, stime 12 (in clock ticks).
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // SAFETY: sysconf is always safe to call.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (
        kib("VmHWM:"),
        kib("VmRSS:"),
        (ticks(11) + ticks(12)) / hz.max(1.0),
    )
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("__stamp") {
        return start::stamp(); // the start benchmark's workload
    }
    if std::env::args().nth(1).as_deref() == Some("__stamp_original") {
        return original::stamp(); // the same, under the Python original
    }
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` asks for a list; nothing to list
    }
    println!("cyberwave-cloud-node benchmarks on {}", machine());
    println!("binary: {}", support::node_bin().display());
    // `cargo bench` passes `--bench`; the words after it choose a benchmark.
    let words: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let number = |i: usize, default: u64| {
        words
            .get(i)
            .and_then(|w| w.parse::<u64>().ok())
            .unwrap_or(default)
    };
    match words.first().map(String::as_str) {
        Some("idle") => return idle(Duration::from_secs(number(1, 60))),
        Some("brokers") => return brokers::run(number(1, 5) as usize),
        Some("emit") => return emit::run(),
        Some("fleet") => return fleet::run(number(1, 100) as usize),
        Some("start") => return start::run(number(1, 100) as usize),
        Some("preview") => return preview::run(number(1, 5) as usize),
        Some("upload") => {
            let sizes: Vec<u64> = words
                .get(1)
                .map(|w| w.split(',').filter_map(|s| s.trim().parse().ok()).collect())
                .filter(|v: &Vec<u64>| !v.is_empty())
                .unwrap_or_else(|| vec![256, 1024, 4096]);
            return upload::run(&sizes);
        }
        Some("stream") => {
            let broker = Broker::start();
            let cp = ControlPlane::start(broker.port, "");
            return logs(&broker, &cp);
        }
        _ => {}
    }
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");

    // 1. exec → first status answered, and SIGTERM → exit.
    let mut first_status = Vec::new();
    let mut term_to_exit = Vec::new();
    let setup = NodeSetup::new(&broker, &cp);
    for i in 0..15 {
        let t0 = Instant::now();
        let mut node = setup.spawn();
        let rid = format!("first-{i}");
        // Poll with status commands until one is answered (the first one may beat registration).
        let uuid = support::wait_for(Duration::from_secs(10), || {
            Some(node.uuid()).filter(|u| !u.is_empty())
        });
        let Some(uuid) = uuid else { continue };
        let mut answered = false;
        for k in 0..200 {
            let r = format!("{rid}-{k}");
            cp.command(&uuid, json!({"command": "status", "request_id": r}));
            if cp.wait_reply(&r, Duration::from_millis(50)).is_some() {
                answered = true;
                break;
            }
        }
        if answered {
            first_status.push(t0.elapsed());
        }
        let t1 = Instant::now();
        node.sigterm();
        if node.wait_exit(Duration::from_secs(10)).is_some() {
            term_to_exit.push(t1.elapsed());
        }
    }
    report(
        "exec → first status answered (restart)",
        first_status,
        "< 100 ms",
    );
    report("SIGTERM → exit (R5 acknowledged)", term_to_exit, "< 1 s");

    // 2. status round trip on a running node, and its footprint.
    let node = setup.spawn();
    node.wait_ready(Duration::from_secs(10));
    let uuid = node.uuid();
    let mut rtt = Vec::new();
    for i in 0..300 {
        let r = format!("rtt-{i}");
        let t = Instant::now();
        cp.command(&uuid, json!({"command": "status", "request_id": r}));
        if cp.wait_reply(&r, Duration::from_secs(2)).is_some() {
            rtt.push(t.elapsed());
        }
    }
    report("status command round trip (broker + node)", rtt, "-");
    let (peak, rss, cpu) = proc_stats(node.pid());
    println!(
        "{:<44} peak RSS {} KiB, RSS {} KiB, CPU {:.3} s after 300 commands",
        "node footprint (idle + 300 status)", peak, rss, cpu
    );
    let before = proc_stats(node.pid()).2;
    std::thread::sleep(Duration::from_secs(3));
    let idle = proc_stats(node.pid()).2 - before;
    println!("{:<44} {:.4} CPU s per second", "node idle CPU", idle / 3.0);
    drop(node);

    workloads(&broker, &cp);
    logs(&broker, &cp);
}

/// Log streaming (part 4 of the suite) at the default settings (stream interval 3 s): line
/// written → published, node CPU per 100 MiB shipped, messages per MiB, and a 500 MB flood.
/// `./scripts/bench stream` runs only this part.
fn logs(broker: &Broker, cp: &ControlPlane) {
    let setup = NodeSetup::new(broker, cp);
    // Lines at random gaps of 0–0.5 s (isolated lines and bursts), each carrying when it was
    // written; the volume run writes 100 MiB of 100-byte lines at once and ends, so most of it
    // is shipped by the drain at the end (as fast as the backend acknowledges).
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  inference: for i in $(seq 1 80); do echo \"t $EPOCHREALTIME\"; sleep 0.$((RANDOM % 5))$((RANDOM % 10)); done\n  training: head -c 104857600 /dev/zero | tr '\\0' 'x' | fold -w 99\n  simulate: yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c 500000000\n",
    );
    let node = setup.spawn();
    node.wait_ready(Duration::from_secs(10));
    let uuid = node.uuid();
    cp.command(
        &uuid,
        json!({"command": "inference", "request_id": "lat", "params": {"workload_uuid": "wl-lat"}}),
    );
    cp.wait_status("wl-lat", "completed", Duration::from_secs(60));
    let mut lat = Vec::new();
    let mut messages = 0;
    for r in cp
        .requests("logs")
        .into_iter()
        .filter(|r| r.body["workload_uuid"] == "wl-lat")
    {
        messages += 1;
        let arrived = epoch(r.wall);
        for line in r.body["log_content"].as_str().unwrap_or("").lines() {
            if let Some(t) = line.strip_prefix("t ").and_then(|t| t.parse::<f64>().ok()) {
                lat.push(Duration::from_secs_f64((arrived - t).max(0.0)));
            }
        }
    }
    let lines = lat.len();
    report(
        "log line written → published (defaults)",
        lat,
        "p99 ≤ 300 ms",
    );
    println!(
        "{:<44} {messages} messages for {lines} lines at random gaps of 0–0.5 s",
        "log messages (latency run)"
    );

    let sched = |pid| threads(pid).values().map(|v| v.1).sum::<f64>();
    let shipped_of = |wl: &str| {
        let logs = cp.requests("logs");
        let mine: Vec<_> = logs
            .iter()
            .filter(|r| r.body["workload_uuid"] == wl)
            .collect();
        let bytes: u64 = mine
            .iter()
            .map(|r| r.body["length"].as_u64().unwrap_or(0))
            .sum();
        (bytes, mine.len())
    };
    let cpu0 = sched(node.pid());
    let t0 = Instant::now();
    cp.command(
        &uuid,
        json!({"command": "training", "request_id": "vol", "params": {"workload_uuid": "wl-vol"}}),
    );
    cp.wait_status("wl-vol", "completed", Duration::from_secs(300));
    let cpu = sched(node.pid()) - cpu0;
    let (shipped, n) = shipped_of("wl-vol");
    let mib = shipped as f64 / 1_048_576.0;
    println!(
        "{:<44} {:.3} CPU s per 100 MiB ({:.1} MiB shipped in {:.1} s; target ≤ 0.5 s)",
        "node CPU while streaming",
        cpu * 100.0 / mib.max(1e-9),
        mib,
        t0.elapsed().as_secs_f64()
    );
    println!(
        "{:<44} {:.2} messages per MiB ({n} messages)",
        "log messages (100 MiB run)",
        n as f64 / mib.max(1e-9)
    );

    cp.command(&uuid, json!({"command": "simulate", "request_id": "flood", "params": {"workload_uuid": "wl-flood"}}));
    let log = setup
        .home
        .join(".cyberwave/workload_logs/simulate_flood.stdout.log");
    let mut worst = Duration::ZERO;
    let mut n = 0;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        let rid = format!("flood-{n}");
        n += 1;
        let sent = Instant::now();
        cp.command(&uuid, json!({"command": "status", "request_id": rid}));
        if cp.wait_reply(&rid, Duration::from_secs(5)).is_some() {
            worst = worst.max(sent.elapsed());
        }
        if std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0) >= 500_000_000
            && t.elapsed() > Duration::from_secs(3)
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (peak, _, _) = proc_stats(node.pid());
    println!(
        "{:<44} {} status commands, worst {:.1} ms (target ≤ 100 ms)",
        "status latency during a 500 MB flood",
        n,
        worst.as_secs_f64() * 1e3
    );
    cp.wait_status("wl-flood", "completed", Duration::from_secs(300));
    let (shipped, n) = shipped_of("wl-flood");
    let mib = shipped as f64 / 1_048_576.0;
    println!(
        "{:<44} {:.2} messages per MiB ({n} messages, {:.1} MiB in {:.1} s)",
        "log messages (500 MB flood)",
        n as f64 / mib.max(1e-9),
        mib,
        t.elapsed().as_secs_f64()
    );
    let (peak2, _, _) = proc_stats(node.pid());
    println!(
        "{:<44} {} KiB = {:.1} MiB (target ≤ 32 MiB)",
        "node peak RSS through the flood",
        peak.max(peak2),
        peak.max(peak2) as f64 / 1024.0
    );
}

/// Seconds since the epoch, as bash's $EPOCHREALTIME prints them.
fn epoch(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// 3. Workloads: command → workload process running, and workload exit → completion published.
fn workloads(broker: &Broker, cp: &ControlPlane) {
    let setup = NodeSetup::new(broker, cp);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  inference: |\n    echo $EPOCHREALTIME > t/$CYBERWAVE_REQUEST_ID.start\n    echo $EPOCHREALTIME > t/$CYBERWAVE_REQUEST_ID.end\n",
    );
    std::fs::create_dir_all(setup.cwd.join("t")).ok();
    let node = setup.spawn();
    node.wait_ready(Duration::from_secs(10));
    let uuid = node.uuid();
    let (mut start, mut done) = (Vec::new(), Vec::new());
    let read = |p: std::path::PathBuf| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
    };
    for i in 0..100 {
        let rid = format!("b{i}");
        let wl = format!("wb{i}");
        let sent = SystemTime::now();
        cp.command(
            &uuid,
            json!({"command": "inference", "request_id": rid, "params": {"workload_uuid": wl}}),
        );
        let Some(all) = cp.wait_status(&wl, "completed", Duration::from_secs(10)) else {
            continue;
        };
        let _ = all;
        let arrived = cp
            .all_requests()
            .into_iter()
            .find(|r| r.id == wl && r.body["status"] == "completed")
            .map(|r| epoch(r.wall));
        if let (Some(s), Some(e), Some(a)) = (
            read(setup.cwd.join(format!("t/{rid}.start"))),
            read(setup.cwd.join(format!("t/{rid}.end"))),
            arrived,
        ) {
            start.push(Duration::from_secs_f64((s - epoch(sent)).max(0.0)));
            done.push(Duration::from_secs_f64((a - e).max(0.0)));
        }
    }
    report("command → workload process running", start, "< 5 ms");
    report("workload exit → completion published", done, "< 20 ms");
    let (peak, rss, cpu) = proc_stats(node.pid());
    println!(
        "{:<44} peak RSS {} KiB, RSS {} KiB, CPU {:.3} s after 100 workloads",
        "node footprint (100 workloads)", peak, rss, cpu
    );
}

/// One thread of a process: (name, CPU seconds, times it was scheduled onto a CPU).
fn threads(pid: i32) -> BTreeMap<i32, (String, f64, u64)> {
    // SAFETY: sysconf is always safe to call.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|t| t.parse::<i32>().ok()) else {
            continue;
        };
        let base = e.path();
        let name = std::fs::read_to_string(base.join("comm")).unwrap_or_default();
        let stat = std::fs::read_to_string(base.join("stat")).unwrap_or_default();
        let f: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        // schedstat: time on CPU (ns), time waiting (ns), number of timeslices run.
        let sched = std::fs::read_to_string(base.join("schedstat")).unwrap_or_default();
        let mut it = sched.split_whitespace();
        let on_cpu = it.next().and_then(|v| v.parse::<f64>().ok());
        let slices = it.nth(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let cpu = on_cpu
            .map(|ns| ns / 1e9)
            .unwrap_or((t(11) + t(12)) / hz.max(1.0));
        out.insert(tid, (name.trim().to_string(), cpu, slices));
    }
    out
}

/// An idle, registered node (heartbeat every 30 s, the default): CPU, wake-ups per thread and
/// RSS over `window`.
fn idle(window: Duration) {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("RUST_LOG", "info");
    let node = setup.spawn();
    node.wait_ready(Duration::from_secs(20));
    std::thread::sleep(Duration::from_secs(3));
    let before = threads(node.pid());
    let (_, _, cpu0) = proc_stats(node.pid());
    let beats0 = cp.requests("heartbeat").len();
    std::thread::sleep(window);
    let after = threads(node.pid());
    let (peak, rss, cpu1) = proc_stats(node.pid());
    let beats = cp.requests("heartbeat").len().saturating_sub(beats0);
    // The node's own helper processes, if any (its children while no workload runs).
    let helpers = descendants(node.pid());
    let helpers_rss: u64 = helpers.iter().map(|p| proc_stats(*p).1).sum();
    let per_min = 60.0 / window.as_secs_f64().max(1e-3);
    let sched = |t: &BTreeMap<i32, (String, f64, u64)>| t.values().map(|v| v.1).sum::<f64>();
    println!(
        "idle node over {:.0} s: {:.4} CPU s per minute ({:.4} by clock ticks), RSS {} KiB (peak {} KiB), {} heartbeat(s)",
        window.as_secs_f64(),
        (sched(&after) - sched(&before)) * per_min,
        (cpu1 - cpu0) * per_min,
        rss,
        peak,
        beats
    );
    println!(
        "idle node with its {} helper process(es): RSS {} KiB",
        helpers.len(),
        rss + helpers_rss
    );
    println!(
        "{:<8} {:<16} {:>14} {:>16}",
        "tid", "thread", "wakeups/min", "CPU ms/min"
    );
    for (tid, (name, cpu, slices)) in &after {
        let (c0, s0) = before
            .get(tid)
            .map(|(_, c, s)| (*c, *s))
            .unwrap_or((0.0, 0));
        println!(
            "{tid:<8} {name:<16} {:>14.1} {:>16.3}",
            slices.saturating_sub(s0) as f64 * per_min,
            (cpu - c0) * 1e3 * per_min
        );
    }
}
