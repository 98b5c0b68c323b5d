//! `./scripts/bench start`: how fast a start command becomes a running workload process, and
//! whether `status` is still answered at once while starts are in flight on a slow disk.
//!
//! "Process started" is the workload's own first action: it writes the wall clock to a file named
//! after its request id. In the normal-disk case the workload is this benchmark's own binary
//! (`… __stamp`, see [`stamp`]) started three ways, interleaved round by round: by the node from a
//! plain word list (run as `bash -c`, which execs it in its own place; a build without D71 execs
//! it without bash), by the node from the same words with a `# comment` (shell syntax), and by
//! the benchmark itself with a bare fork+exec, the floor. Elsewhere it is a shell writing `$EPOCHREALTIME`. The slow disk is
//! `CYBERWAVE_TEST_SLOW_FSYNC_MS` (every fsync of the node's state sleeps that long first;
//! honoured by builds with the `test-hooks` feature, as `cargo bench` builds the node).

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
    let mut original = super::original::Pool::start(&broker, &cp);
    sequential_starts(&broker, &cp, sequential, None, original.as_mut());
    if let Some(o) = original {
        o.report();
    }
    sequential_starts(&broker, &cp, sequential.min(30), Some(SLOW_FSYNC_MS), None);
    concurrent_starts(&broker, &cp);
}

/// `… __stamp`: the workload of the normal-disk case. Writes the wall clock (seconds since the
/// epoch) to `t/$CYBERWAVE_REQUEST_ID.start` in its working directory and exits.
pub fn stamp() {
    let now = epoch(SystemTime::now());
    let rid = std::env::var("CYBERWAVE_REQUEST_ID").unwrap_or_default();
    let _ = std::fs::write(format!("t/{rid}.start"), format!("{now:.6}\n"));
}

/// The stamping workload: this benchmark's own binary.
fn stamper() -> String {
    std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// `inference`: the stamper as a plain word list; `training`: the same through bash (a comment
/// is shell syntax; bash still execs the one command in its place); `simulate`: a shell script
/// (the slow-disk cases).
/// The results folder is one of the run's own (`out` in the node's working directory), not the
/// machine's `/results`: every start records what its results folder holds before the workload
/// runs, so what other runs left in `/results` would be measured too.
fn setup(broker: &Broker, cp: &ControlPlane, slow_ms: Option<u64>) -> NodeSetup {
    let mut setup = NodeSetup::new(broker, cp);
    setup.set("CYBERWAVE_MAX_CONCURRENT_WORKLOADS", "64");
    if let Some(ms) = slow_ms {
        setup.set("CYBERWAVE_TEST_SLOW_FSYNC_MS", &ms.to_string());
    }
    let exe = stamper();
    setup.write(
        "cyberwave.yml",
        &format!("cyberwave:\n  inference: {exe} __stamp\n  training: {exe} __stamp # through bash\n  simulate: |\n    echo $EPOCHREALTIME > t/$CYBERWAVE_REQUEST_ID.start\n    sleep ${{SLEEP_S:-0}}\n  results_folder: out\n"),
    );
    std::fs::create_dir_all(setup.cwd.join("t")).ok();
    setup
}

/// The floor: the stamper started by a bare fork+exec from here (std's `Command`), in the
/// node's working directory; wall time before the spawn → its stamp.
fn floor_start(setup: &NodeSetup, rid: &str) -> Option<Duration> {
    let wall = SystemTime::now();
    let mut child = std::process::Command::new(stamper())
        .arg("__stamp")
        .env("CYBERWAVE_REQUEST_ID", rid)
        .current_dir(&setup.cwd)
        .stdin(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let _ = child.wait();
    started_at(setup, rid).map(|s| Duration::from_secs_f64((s - epoch(wall)).max(0.0)))
}

fn started_at(setup: &NodeSetup, rid: &str) -> Option<f64> {
    std::fs::read_to_string(setup.cwd.join(format!("t/{rid}.start")))
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
}

/// One start at a time: command → workload process started, and command → reply. With
/// `CYBERWAVE_NODE_BIN_B` set (another build, e.g. the one before a change), a node of each runs
/// side by side and the starts alternate between them, so both see the same machine load.
/// `original`: the Python original's pool, one start of it per round (after the floor).
fn sequential_starts(
    broker: &Broker,
    cp: &ControlPlane,
    n: usize,
    slow_ms: Option<u64>,
    mut original: Option<&mut super::original::Pool>,
) {
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
    // Normal disk: per node the plain word list and the same through bash, then the floor,
    // round by round. Slow disk: the shell script.
    let kinds: &[(&str, &str)] = if slow_ms.is_some() {
        &[("simulate", "")]
    } else {
        &[
            ("inference", ", plain argv"),
            ("training", ", through bash"),
        ]
    };
    let cases = nodes.len() * kinds.len();
    let mut started = vec![Vec::new(); cases];
    let mut replied = vec![Vec::new(); cases];
    let mut floor = Vec::new();
    // Request ids of their own per run: the fake backend keeps every reply it saw.
    let tag = if slow_ms.is_some() { "slow" } else { "fast" };
    for i in 0..n * cases {
        let c = i % cases;
        let (k, kind) = (c / kinds.len(), kinds[c % kinds.len()].0);
        let (_, setup, node) = &nodes[k];
        let rid = format!("{tag}{i}");
        // Read before the clock starts (it reads the node's identity file), as the original's
        // pool reads its uuid once.
        let uuid = node.uuid();
        let wall = SystemTime::now();
        let t = Instant::now();
        cp.command(
            &uuid,
            json!({"command": kind, "request_id": rid, "params": {"workload_uuid": format!("w{rid}")}}),
        );
        if cp.wait_reply(&rid, Duration::from_secs(20)).is_none() {
            continue;
        }
        if let Some(at) = cp.reply_time(&rid) {
            replied[c].push(at.saturating_duration_since(t));
        }
        let s = super::support::wait_for(Duration::from_secs(5), || started_at(setup, &rid));
        if let Some(s) = s {
            started[c].push(Duration::from_secs_f64((s - epoch(wall)).max(0.0)));
        }
        // Let it end before the next one: one start at a time.
        cp.wait_status(&format!("w{rid}"), "completed", Duration::from_secs(10));
        if slow_ms.is_none() && c + 1 == cases {
            if let Some(d) = floor_start(setup, &format!("floor{i}")) {
                floor.push(d);
            }
            if let Some(o) = original.as_deref_mut() {
                o.round(cp, i);
            }
        }
    }
    let disk = match slow_ms {
        None => "normal disk".to_string(),
        Some(ms) => format!("fsync {ms} ms"),
    };
    for (c, (started, replied)) in started.into_iter().zip(replied).enumerate() {
        let label = &nodes[c / kinds.len()].0;
        let how = kinds[c % kinds.len()].1;
        report(
            &format!("command → workload started ({disk}{how}){label}"),
            started,
            "p99 ≤ 5 ms",
        );
        report(
            &format!("command → start reply ({disk}{how}){label}"),
            replied,
            "-",
        );
    }
    if slow_ms.is_none() {
        report("bare fork+exec → workload started (floor)", floor, "-");
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
            json!({"command": "simulate", "request_id": rid, "params": {"workload_uuid": format!("wc{i}")}}),
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
