//! The Python original (`cyberwave-cloud-node` on PyPI) run beside this node, opt-in:
//! `CYBERWAVE_BENCH_ORIGINAL` names its launcher (a command line; `start` is appended), e.g. the
//! virtualenv `scripts/original.sh` makes: `~/.cache/cyberwave-bench/original-venv/bin/cyberwave-cloud-node`.
//! Nothing of it is in this repository; it is only run, against the same broker and fake
//! backend as this node, with the same workload.
//!
//! What it needs from the rig: a `cyberwave.yml` under its own top-level key
//! (`cyberwave-cloud-node:`), the same environment as this node (base URL, API key, broker),
//! and an instance uuid given in `CYBERWAVE_CLOUD_NODE_INSTANCE_UUID` (it then skips the
//! instance request, registers that uuid, and does not write an identity file). It answers no
//! start command (only a `running` status, then `completed`), runs one workload at a time, and
//! notices an exit by a 5 s poll, so the start benchmark keeps a small pool of them
//! (`CYBERWAVE_BENCH_ORIGINAL_NODES`, default 4) and sends each start to one that is free. Its
//! workload gets no request id in its environment: the stamper takes it from the params file's
//! name (`{body}`, `<type>_<request id>.params.json`).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;

use super::support::node::NodeSetup;
use super::support::{wait_for, Broker, ControlPlane};
use super::{epoch, proc_stats, report};

const ENV: &str = "CYBERWAVE_BENCH_ORIGINAL";
/// How often the original looks whether a workload has exited (its monitor loop).
const POLL: Duration = Duration::from_secs(5);

/// The original's launcher as argv, when `CYBERWAVE_BENCH_ORIGINAL` names one.
fn launcher() -> Option<Vec<String>> {
    let line = std::env::var(ENV).ok()?;
    let argv: Vec<String> = line.split_whitespace().map(String::from).collect();
    (!argv.is_empty()).then_some(argv)
}

/// The line printed where the original is not run.
pub fn say_if_not_run() {
    if launcher().is_some() {
        return;
    }
    println!(
        "Python original: not run (scripts/original.sh <checkout of cyberwave-os/cyberwave-cloud-node> installs it; then {ENV}=<its launcher>)"
    );
}

/// `… __stamp_original <params file>`: the start benchmark's workload under the original, as
/// `start::stamp` (the wall clock to `t/<request id>.start`), the request id read from the
/// params file's name.
pub fn stamp() {
    let now = epoch(SystemTime::now());
    let params = std::env::args().nth(2).unwrap_or_default();
    let name = Path::new(&params)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let rid = name
        .strip_suffix(".params.json")
        .and_then(|s| s.split_once('_'))
        .map(|(_, r)| r.to_string())
        .unwrap_or_default();
    let _ = std::fs::write(format!("t/{rid}.start"), format!("{now:.6}\n"));
}

/// The version the launcher reports (`--version`).
fn version(argv: &[String]) -> String {
    Command::new(&argv[0])
        .args(&argv[1..])
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// One running original: its own HOME and working dir, its log in `original.log` there.
struct Original {
    setup: NodeSetup,
    uuid: String,
    child: Child,
}

static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Original {
    /// Starts one with this `cyberwave.yml` body (under `cyberwave-cloud-node:`).
    fn spawn(
        argv: &[String],
        broker: &Broker,
        cp: &ControlPlane,
        manifest: &str,
        env: &[(&str, String)],
    ) -> Original {
        let mut setup = NodeSetup::new(broker, cp);
        for (k, v) in env {
            setup.set(k, v);
        }
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let uuid = format!(
            "00000000-0000-4000-9000-{:06}{n:06}",
            std::process::id() % 1_000_000
        );
        setup.set("CYBERWAVE_CLOUD_NODE_INSTANCE_UUID", &uuid);
        setup.write(
            "cyberwave.yml",
            &format!("cyberwave-cloud-node:\n{manifest}"),
        );
        std::fs::create_dir_all(setup.cwd.join("t")).ok();
        let log = std::fs::File::create(setup.home.join("original.log")).expect("original.log");
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .arg("start")
            .env_clear()
            .envs(&setup.env)
            .current_dir(&setup.cwd)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn the Python original");
        Original { setup, uuid, child }
    }

    /// Registered and answering `status`: (exec → answered), or None (its log is printed).
    fn wait_ready(&self, cp: &ControlPlane, started: Instant) -> Option<Duration> {
        let registered = wait_for(Duration::from_secs(60), || {
            cp.requests("register")
                .iter()
                .any(|r| r.id == self.uuid)
                .then_some(())
        });
        for k in 0..200 {
            if registered.is_none() {
                break;
            }
            let rid = format!("orig-ready-{}-{k}", self.uuid);
            cp.command(&self.uuid, json!({"command": "status", "request_id": rid}));
            if cp.wait_reply(&rid, Duration::from_millis(250)).is_some() {
                return Some(started.elapsed());
            }
        }
        let log = std::fs::read_to_string(self.setup.home.join("original.log")).unwrap_or_default();
        println!(
            "Python original {} never became ready; its log:\n{log}",
            self.uuid
        );
        None
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for Original {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `n` originals at once and waits until each is ready; those that never are, dropped.
fn start_ready(
    argv: &[String],
    broker: &Broker,
    cp: &ControlPlane,
    manifest: &str,
    n: usize,
    env: &[(&str, String)],
) -> (Vec<Original>, Vec<Duration>) {
    let t0 = Instant::now();
    let all: Vec<Original> = (0..n)
        .map(|_| Original::spawn(argv, broker, cp, manifest, env))
        .collect();
    let mut ready = Vec::new();
    let mut up = Vec::new();
    for o in all {
        if let Some(d) = o.wait_ready(cp, t0) {
            up.push(d);
            ready.push(o);
        }
    }
    (ready, up)
}

/// The start benchmark's originals: a pool, each start sent to the next one once its previous
/// workload was reported completed.
pub struct Pool {
    nodes: Vec<(Original, Option<String>)>,
    next: usize,
    started: Vec<Duration>,
    running: Vec<Duration>,
}

impl Pool {
    /// None (and the line saying so) unless `CYBERWAVE_BENCH_ORIGINAL` is set.
    pub fn start(broker: &Broker, cp: &ControlPlane) -> Option<Pool> {
        let Some(argv) = launcher() else {
            say_if_not_run();
            return None;
        };
        let n = std::env::var("CYBERWAVE_BENCH_ORIGINAL_NODES")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|n| *n > 0)
            .unwrap_or(4);
        let exe = std::env::current_exe()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        let manifest =
            format!("  inference: {exe} __stamp_original {{body}}\n  upload_results: false\n");
        let (nodes, up) = start_ready(&argv, broker, cp, &manifest, n, &[]);
        println!(
            "Python original: {} ({}), {} of {n} instances ready, interleaved with each round",
            version(&argv),
            argv.join(" "),
            nodes.len()
        );
        report("Python original: exec → first status answered", up, "-");
        (!nodes.is_empty()).then(|| Pool {
            nodes: nodes.into_iter().map(|o| (o, None)).collect(),
            next: 0,
            started: Vec::new(),
            running: Vec::new(),
        })
    }

    /// One start on the next instance (after its previous workload completed): command →
    /// its workload's stamp, and command → its `running` status.
    pub fn round(&mut self, cp: &ControlPlane, i: usize) {
        let k = self.next % self.nodes.len();
        self.next += 1;
        let (node, last) = &mut self.nodes[k];
        if let Some(wl) = last.take() {
            cp.wait_status(&wl, "completed", Duration::from_secs(30));
        }
        let rid = format!("orig{i}");
        let wl = format!("w{rid}");
        let wall = SystemTime::now();
        let t = Instant::now();
        cp.command(
            &node.uuid,
            json!({"command": "inference", "request_id": rid, "params": {"workload_uuid": wl}}),
        );
        let stamp = node.setup.cwd.join(format!("t/{rid}.start"));
        let s = wait_for(Duration::from_secs(10), || {
            std::fs::read_to_string(&stamp)
                .ok()
                .and_then(|s| s.trim().parse::<f64>().ok())
        });
        if let Some(s) = s {
            self.started
                .push(Duration::from_secs_f64((s - epoch(wall)).max(0.0)));
        }
        let running = cp.wait_status(&wl, "running", Duration::from_secs(10));
        if running.is_some() {
            if let Some(r) = cp.all_requests().iter().find(|r| {
                r.op == "workload:update-status" && r.id == wl && r.body["status"] == "running"
            }) {
                self.running.push(r.at.saturating_duration_since(t));
            }
        }
        *last = Some(wl);
    }

    pub fn report(self) {
        report(
            "command → workload started (Python original)",
            self.started,
            "-",
        );
        report(
            "command → `running` status (Python original)",
            self.running,
            "-",
        );
    }
}

/// The upload benchmark's single-file case under the original, plain HTTP or HTTPS (`cert`):
/// `runs` fresh originals, each one workload that links `file` into its results folder;
/// prints the medians of its busy window (exit → `completed` at the fake backend) and of the
/// part of it after its `finalizing` status (signed URL, transfer, report), CPU, peak RSS.
pub fn upload(
    broker: &Broker,
    base: &str,
    cert: Option<&Path>,
    file: &Path,
    mib: u64,
    runs: usize,
) {
    let Some(argv) = launcher() else {
        return;
    };
    let label = if cert.is_some() { "https" } else { "http" };
    let mut samples = Vec::new();
    for r in 0..runs {
        // Its exit poll runs every 5 s from its start: the starts are spread over that period
        // (the middle of each of `runs` slices), so the median is the mean case, not the worst.
        let phase = POLL.mul_f64((r as f64 + 0.5) / runs as f64);
        if let Some(s) = upload_run(&argv, broker, base, cert, file, phase) {
            samples.push(s);
        }
    }
    if samples.is_empty() {
        println!("Python original {label}: no upload completed");
        return;
    }
    let med = |f: &dyn Fn(&UploadRun) -> f64| {
        let mut v: Vec<f64> = samples.iter().map(f).collect();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        v[v.len() / 2]
    };
    let (busy, transfer) = (med(&|s| s.busy), med(&|s| s.transfer));
    let rss = samples.iter().map(|s| s.rss_mib).fold(0.0, f64::max);
    println!(
        "{:<34} {busy:>10.3} {:>10.0} {:>9.2} {rss:>9.1}",
        format!("Python original {label} PUT"),
        mib as f64 / busy,
        med(&|s| s.cpu)
    );
    println!(
        "{:<34} {transfer:>10.3} {:>10.0}   (from its `finalizing` status: URL, transfer, report; the rest is its 5 s exit poll)",
        "  of which finalizing → completed",
        mib as f64 / transfer
    );
}

struct UploadRun {
    busy: f64,
    transfer: f64,
    cpu: f64,
    rss_mib: f64,
}

/// One original, one workload: started `phase` after it answered its first status, let go,
/// its completion awaited.
fn upload_run(
    argv: &[String],
    broker: &Broker,
    base: &str,
    cert: Option<&Path>,
    file: &Path,
    phase: Duration,
) -> Option<UploadRun> {
    let behaviour = super::support::control_plane::Behaviour {
        upload_base: Some(base.to_string()),
        ..Default::default()
    };
    let cp = ControlPlane::start_with(broker.port, "", behaviour);
    let manifest = format!(
        "  training: |\n    while [ ! -f go ]; do sleep 0.01; done\n    ln {} out/\n    echo $EPOCHREALTIME > t/end\n  results_folder: out\n",
        file.display()
    );
    // The sink's throwaway certificate, for httpx (it reads SSL_CERT_FILE).
    let env: Vec<(&str, String)> = cert
        .map(|c| ("SSL_CERT_FILE", c.display().to_string()))
        .into_iter()
        .collect();
    let (nodes, _) = start_ready(argv, broker, &cp, &manifest, 1, &env);
    let mut o = nodes.into_iter().next()?;
    std::fs::create_dir_all(o.setup.cwd.join("out")).ok();
    std::thread::sleep(phase);
    let wl = "wl-orig-up".to_string();
    cp.command(
        &o.uuid,
        json!({"command": "training", "request_id": "orig-up", "params": {"workload_uuid": wl}}),
    );
    cp.wait_status(&wl, "running", Duration::from_secs(20))?;
    let (_, _, cpu0) = proc_stats(o.pid());
    std::fs::write(o.setup.cwd.join("go"), "").ok()?;
    cp.wait_status(&wl, "completed", Duration::from_secs(1800))?;
    let (peak_kib, _, cpu1) = proc_stats(o.pid());
    let at = |status: &str| {
        cp.all_requests()
            .into_iter()
            .find(|r| r.op == "workload:update-status" && r.id == wl && r.body["status"] == status)
            .map(|r| epoch(r.wall))
    };
    let ended = std::fs::read_to_string(o.setup.cwd.join("t/end"))
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())?;
    let (done, finalizing) = (at("completed")?, at("finalizing")?);
    let _ = o.child.kill();
    Some(UploadRun {
        busy: done - ended,
        transfer: done - finalizing,
        cpu: cpu1 - cpu0,
        rss_mib: peak_kib as f64 / 1024.0,
    })
}

/// The preview benchmark's rounds under the original (`super::preview`): one fresh original,
/// a cold then a warm preview per round, each command → `completed` status.
pub fn previews(broker: &Broker, cp: &ControlPlane, rounds: usize, load: f64, predict: Duration) {
    let Some(argv) = launcher() else {
        say_if_not_run();
        return;
    };
    let port = super::support::free_port();
    let manifest = format!(
        "  inference: {}\n  upload_results: false\n",
        super::preview::template(port, load)
    );
    let (nodes, _) = start_ready(&argv, broker, cp, &manifest, 1, &[]);
    let Some(node) = nodes.first() else {
        return;
    };
    println!("Python original: {} ({})", version(&argv), argv.join(" "));
    super::preview::write_scripts(&node.setup.cwd);
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        cold.extend(super::preview::one(
            cp,
            &node.uuid,
            &format!("ocold{i}"),
            predict,
        ));
        warm.extend(super::preview::one(
            cp,
            &node.uuid,
            &format!("owarm{i}"),
            predict,
        ));
        super::preview::stop_server(&node.setup.cwd);
    }
    report("first preview, cold (Python original)", cold, "-");
    report(
        "second preview, warm (Python original)",
        warm,
        "its 5 s exit poll",
    );
}
