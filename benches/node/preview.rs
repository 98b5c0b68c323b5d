//! `./scripts/bench preview [N]`: the platform's own inference pattern (its SmolVLA compute
//! repository): a preview entry point that starts a model server in a session of its own when
//! none answers, polls its `/health`, posts the request and exits; the server stays warm for the
//! next preview. The stand-ins are `tests/support/preview.rs`; the server "loads its model" for
//! `CW_PREVIEW_LOAD_SECONDS` (default 3) and answers each prediction after
//! `CW_PREVIEW_PREDICT_MS` (default 20).
//!
//! Each round: a cold preview (no server: it is started and loads) and then a warm one (the
//! server the first left running), each measured from the command to the `completed` status at
//! the fake backend (the answer the platform waits for); then the server is stopped. The same
//! rounds run on `CYBERWAVE_NODE_BIN_B` when set (e.g. a build without D59, where the first
//! preview's end kills the server) and on the Python original when `CYBERWAVE_BENCH_ORIGINAL`
//! names it (which leaves the server alone, and notices an exit by a 5 s poll).

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;

use super::report;
use super::support::node::NodeSetup;
use super::support::preview::{PREVIEW, SERVER};
use super::support::{free_port, Broker, ControlPlane};

/// The stand-in's timings: (model load, one prediction).
fn timings() -> (f64, Duration) {
    let secs = |k: &str, d: f64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| *v >= 0.0)
            .unwrap_or(d)
    };
    (
        secs("CW_PREVIEW_LOAD_SECONDS", 3.0),
        Duration::from_secs_f64(secs("CW_PREVIEW_PREDICT_MS", 20.0) / 1e3),
    )
}

/// The `inference` template of the stand-in on `port`.
pub fn template(port: u16, load: f64) -> String {
    format!("python3 preview.py {{body}} {port} {load}")
}

/// The same, between two stamps of the wall clock (`t/<request id>.start` and `.end`): the
/// node's own share of a preview is the time outside them (command → start, end → completed).
fn stamped(port: u16, load: f64) -> String {
    format!(
        "|\n    echo $EPOCHREALTIME > t/$CYBERWAVE_REQUEST_ID.start\n    {}\n    rc=$?\n    echo $EPOCHREALTIME > t/$CYBERWAVE_REQUEST_ID.end\n    exit $rc",
        template(port, load)
    )
}

fn stamp(cwd: &Path, rid: &str, which: &str) -> Option<f64> {
    std::fs::read_to_string(cwd.join(format!("t/{rid}.{which}")))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Writes the stand-ins into a working dir.
pub fn write_scripts(cwd: &Path) {
    std::fs::write(cwd.join("preview.py"), PREVIEW).expect("preview.py");
    std::fs::write(cwd.join("server.py"), SERVER).expect("server.py");
}

/// Stops the server a round left (its pid in `server.pid`) and forgets it.
pub fn stop_server(cwd: &Path) {
    if let Some(pid) = std::fs::read_to_string(cwd.join("server.pid"))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
    {
        // SAFETY: the server this benchmark's preview started (its own session).
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
            libc::kill(pid, libc::SIGKILL);
        }
        let gone = super::support::wait_for(Duration::from_secs(5), || {
            (!Path::new(&format!("/proc/{pid}")).exists()).then_some(())
        });
        if gone.is_none() {
            println!("(server pid {pid} is still there)");
        }
    }
    let _ = std::fs::remove_file(cwd.join("server.pid"));
}

/// The server a preview started still runs.
fn server_alive(cwd: &Path) -> bool {
    std::fs::read_to_string(cwd.join("server.pid"))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .is_some_and(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
                st.rsplit_once(')')
                    .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
            })
        })
}

/// One preview on the node `uuid`: command → its `completed` status.
pub fn one(cp: &ControlPlane, uuid: &str, rid: &str, predict: Duration) -> Option<Duration> {
    timed(cp, uuid, rid, predict).map(|(d, _, _)| d)
}

/// [`one`], with the wall clock when the command was sent and when `completed` arrived.
fn timed(
    cp: &ControlPlane,
    uuid: &str,
    rid: &str,
    predict: Duration,
) -> Option<(Duration, f64, f64)> {
    let wl = format!("w{rid}");
    let sent = super::epoch(std::time::SystemTime::now());
    let t = Instant::now();
    cp.command(
        uuid,
        json!({"command": "inference", "request_id": rid,
               "params": {"workload_uuid": wl, "mlmodel_uuid": "m-1", "delay": predict.as_secs_f64()}}),
    );
    cp.wait_status(&wl, "completed", Duration::from_secs(120))?;
    cp.all_requests()
        .iter()
        .find(|r| r.op == "workload:update-status" && r.id == wl && r.body["status"] == "completed")
        .map(|r| {
            (
                r.at.saturating_duration_since(t),
                sent,
                super::epoch(r.wall),
            )
        })
}

/// The floor: the preview client run by this benchmark itself (a bare fork+exec) against the
/// warm server, spawn → exit: what the stand-in costs without any node.
fn floor(cwd: &Path, port: u16, load: f64, predict: Duration) -> Option<Duration> {
    let params = cwd.join("floor.params.json");
    let body = json!({"mlmodel_uuid": "m-1", "delay": predict.as_secs_f64()});
    std::fs::write(&params, body.to_string()).ok()?;
    let t = Instant::now();
    let out = std::process::Command::new("python3")
        .arg("preview.py")
        .arg(&params)
        .arg(port.to_string())
        .arg(load.to_string())
        .current_dir(cwd)
        .stdin(std::process::Stdio::null())
        .output()
        .ok()?;
    out.status.success().then(|| t.elapsed())
}

pub fn run(rounds: usize) {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let (load, predict) = timings();
    println!(
        "preview benchmark: {rounds} rounds of a cold then a warm preview; the stand-in server loads for {load:.1} s and predicts in {:.0} ms",
        predict.as_secs_f64() * 1e3
    );
    let mut bins = vec![(String::new(), super::support::node_bin())];
    if let Some(b) = std::env::var_os("CYBERWAVE_NODE_BIN_B") {
        bins[0].0 = " A".into();
        bins.push((" B".into(), b.into()));
    }
    for (label, bin) in &bins {
        // SAFETY (edition 2021: safe): the bench is single-threaded here.
        std::env::set_var("CYBERWAVE_NODE_BIN", bin);
        let port = free_port();
        let mut setup = NodeSetup::new(&broker, &cp);
        setup.write(
            "cyberwave.yml",
            &format!(
                "cyberwave:\n  inference: {}\n  upload_results: false\n",
                stamped(port, load)
            ),
        );
        setup.set("RUST_LOG", "info");
        write_scripts(&setup.cwd);
        std::fs::create_dir_all(setup.cwd.join("t")).expect("t");
        let node = setup.spawn();
        node.wait_ready(Duration::from_secs(20));
        let mut rows = Rows::default();
        for i in 0..rounds {
            let tag = label.trim().to_lowercase();
            rows.cold
                .extend(one(&cp, &node.uuid(), &format!("cold{tag}{i}"), predict));
            let rid = format!("warm{tag}{i}");
            if let Some((d, sent, done)) = timed(&cp, &node.uuid(), &rid, predict) {
                rows.warm.push(d);
                let cwd = &setup.cwd;
                if let (Some(a), Some(b)) = (stamp(cwd, &rid, "start"), stamp(cwd, &rid, "end")) {
                    let share = (a - sent).max(0.0) + (done - b).max(0.0);
                    rows.own.push(Duration::from_secs_f64(share));
                }
            }
            // The stand-in alone, against the same warm server (none when the node killed it).
            if server_alive(&setup.cwd) {
                rows.bare.extend(floor(&setup.cwd, port, load, predict));
            }
            stop_server(&setup.cwd);
        }
        rows.report(label, predict);
    }
    super::original::previews(&broker, &cp, rounds, load, predict);
}

/// One build's samples.
#[derive(Default)]
struct Rows {
    cold: Vec<Duration>,
    warm: Vec<Duration>,
    bare: Vec<Duration>,
    own: Vec<Duration>,
}

impl Rows {
    fn report(self, label: &str, predict: Duration) {
        let ms = predict.as_secs_f64() * 1e3;
        report(
            &format!("first preview, cold (node{label})"),
            self.cold,
            "no slower than the original",
        );
        report(
            &format!("second preview, warm (node{label})"),
            self.warm,
            "the stand-in + ≤ 50 ms",
        );
        report(
            &format!("  the stand-in alone, warm (floor{label})"),
            self.bare,
            &format!("python start-up + {ms:.0} ms predict"),
        );
        report(
            &format!("  the node's own share{label}"),
            self.own,
            "≤ 50 ms (command → started + exited → completed)",
        );
    }
}
