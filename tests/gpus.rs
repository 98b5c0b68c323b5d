//! GPUs end to end (D35–D38), against the fake `nvidia-smi` in tests/fixtures: exclusive
//! assignment across a kill -9 and for starts still in flight, the busy / unhealthy refusals,
//! health changes mid-run, a hanging `nvidia-smi`, the completion's accounting, `doctor`, and a
//! CPU-only node.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::node::NodeSetup;
use crate::support::scenario::{assert_host_busy, error_of};
use crate::support::timeouts::{DONE, REPLY};
use crate::support::{procs, wait_for, NodeProcess, Rig, Scenario, Start, TempDir};

mod real;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A directory the fake `nvidia-smi` answers from, and a bin dir holding it.
struct FakeSmi {
    dir: TempDir,
}

impl FakeSmi {
    fn new(query: &str) -> FakeSmi {
        let dir = TempDir::new("smi");
        std::fs::create_dir_all(dir.join("bin")).expect("bin");
        std::os::unix::fs::symlink(fixtures().join("nvidia-smi"), dir.join("bin/nvidia-smi"))
            .expect("symlink");
        let f = FakeSmi { dir };
        f.answer(query);
        f
    }

    /// Swaps the answer to the GPU query (atomically: the node may be reading it).
    fn answer(&self, fixture: &str) {
        let tmp = self.dir.join("query.tmp");
        std::fs::copy(fixtures().join("gpu").join(fixture), &tmp).expect("fixture");
        std::fs::rename(&tmp, self.dir.join("query.csv")).expect("swap");
    }

    /// Replays a host state (tests/fixtures/gpu/hosts/CASE, synthetic: see FACTS.md there):
    /// each invocation's stdout, stderr and exit code; what the case lacks is removed (each
    /// file swapped atomically).
    fn host(&self, case: &str) {
        let src = fixtures().join("gpu/hosts").join(case);
        assert!(src.is_dir(), "{}", src.display());
        for old in ["query.csv", "list.txt", "apps.csv"] {
            let _ = std::fs::remove_file(self.dir.join(old));
        }
        for name in ["query", "list", "apps"] {
            for ext in ["out", "err", "rc"] {
                let file = format!("{name}.{ext}");
                if src.join(&file).exists() {
                    let tmp = self.dir.join(&format!("{file}.tmp"));
                    std::fs::copy(src.join(&file), &tmp).expect("fixture");
                    std::fs::rename(&tmp, self.dir.join(&file)).expect("swap");
                } else {
                    let _ = std::fs::remove_file(self.dir.join(&file));
                }
            }
        }
    }

    fn file(&self, name: &str, fixture: &str) {
        std::fs::copy(fixtures().join("gpu").join(fixture), self.dir.join(name)).expect("fixture");
    }

    fn queries(&self) -> usize {
        std::fs::read_to_string(self.dir.join("calls.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("--query-gpu"))
            .count()
    }

    /// PATH with the fake first.
    fn put_on_path(&self, setup: &mut NodeSetup) {
        setup.path_first(&self.dir.join("bin"));
        setup.set(
            "FAKE_NVIDIA_SMI_DIR",
            &self.dir.path().display().to_string(),
        );
    }

    /// PATH with the fake first, and the knobs that shorten the monitor's timings.
    fn install(&self, setup: &mut NodeSetup) {
        self.put_on_path(setup);
        setup.set("CYBERWAVE_NODE_GPU_INVENTORY_SECONDS", "0.3");
        setup.set("CYBERWAVE_NODE_GPU_SAMPLE_SECONDS", "0.1");
        setup.set("CYBERWAVE_NODE_GPU_TIMEOUT_SECONDS", "1");
    }
}

/// Each workload writes its GPU variables to `env-<n>` and runs until `stop-<n>` exists; with
/// `own-mem-<n>` it lists itself in the fake's per-process GPU memory.
const RECORDING: &str = "cyberwave:\n  training: |\n    n=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[\"n\"])' {body})\n    if [ -f own-mem-$n ]; then echo \"$$, $(cat own-mem-$n)\" >> \"$FAKE_NVIDIA_SMI_DIR/apps.csv\"; fi\n    env | grep -E '^(CUDA_VISIBLE_DEVICES|NVIDIA_VISIBLE_DEVICES|CUDA_DEVICE_ORDER)=' | sort > env-$n.tmp\n    mv env-$n.tmp env-$n\n    while [ ! -f stop-$n ]; do sleep 0.05; done\n";

/// Workload `n` of these tests: request id `g<n>`, workload `wl-g<n>`, `n` in its params.
fn g(n: u32) -> Start {
    Start::training(&format!("g{n}")).with(json!({ "n": n }))
}

/// A node with `capacity` slots that runs [`RECORDING`] workloads, with the fake `nvidia-smi`
/// (or none) first on its PATH.
fn gpu_rig(capacity: u32, smi: Option<&FakeSmi>) -> Rig {
    let mut rig = Scenario::new(&format!(
        "{RECORDING}  max_concurrent_workloads: {capacity}\n"
    ))
    .rig();
    if let Some(s) = smi {
        s.install(&mut rig.setup);
    }
    rig
}

/// The GPU variables workload `n` saw.
fn env_of(rig: &Rig, n: u32) -> Vec<String> {
    let path = rig.work(&format!("env-{n}"));
    wait_for(REPLY, || std::fs::read_to_string(&path).ok())
        .unwrap_or_else(|| panic!("workload {n} wrote no env"))
        .lines()
        .map(String::from)
        .collect()
}

/// The `CUDA_VISIBLE_DEVICES` workload `n` saw.
fn visible(rig: &Rig, n: u32) -> String {
    env_of(rig, n)
        .iter()
        .find_map(|l| l.strip_prefix("CUDA_VISIBLE_DEVICES="))
        .map(String::from)
        .unwrap_or_else(|| panic!("no CUDA_VISIBLE_DEVICES for {n}"))
}

/// Lets workload `n` end.
fn finish(rig: &Rig, n: u32) {
    rig.touch(&format!("stop-{n}"));
}

/// The `failed` status that refused workload `n`.
fn refusal_of(rig: &Rig, n: u32) -> Value {
    let wl = format!("wl-g{n}");
    rig.cp
        .wait_status(&wl, "failed", REPLY)
        .and_then(|all| all.into_iter().find(|b| b["status"] == "failed"))
        .unwrap_or_else(|| panic!("no refusal for {wl}"))
}

/// The fixture's GPU line for this UUID: (utilisation, memory used).
fn fixture_reading(fixture: &str, uuid: &str) -> (u64, u64) {
    let text = std::fs::read_to_string(fixtures().join("gpu").join(fixture)).expect("fixture");
    let line = text
        .lines()
        .find(|l| l.contains(uuid))
        .unwrap_or_else(|| panic!("{uuid} not in {fixture}"));
    let cols: Vec<&str> = line.split(", ").collect();
    (cols[6].parse().unwrap(), cols[5].parse().unwrap())
}

fn holders(status: &Value) -> Vec<(String, Value)> {
    status["output"]["gpus"]
        .as_array()
        .unwrap_or_else(|| panic!("no gpus in status: {status}"))
        .iter()
        .map(|g| {
            (
                g["uuid"].as_str().unwrap_or("").to_string(),
                g["held_by"].clone(),
            )
        })
        .collect()
}

#[test]
fn g10_four_gpus_four_workloads_each_get_their_own_kept_across_kill_9_and_accounted() {
    let smi = FakeSmi::new("four-a100.csv");
    let mut rig = gpu_rig(4, Some(&smi));
    // Only the samples taken because workloads hold GPUs: none from the inventory timer.
    rig.setup.set("CYBERWAVE_NODE_GPU_INVENTORY_SECONDS", "300");
    let mut node = rig.node();
    for n in 1..=4 {
        assert_eq!(g(n).reply(&rig.cp, &node)["status"], "ok", "{}", node.log());
    }
    let mut seen = BTreeSet::new();
    for n in 1..=4 {
        let env = env_of(&rig, n);
        let uuid = visible(&rig, n);
        assert!(
            uuid.starts_with("GPU-") && !uuid.contains(','),
            "one GPU: {env:?}"
        );
        assert!(
            env.contains(&format!("NVIDIA_VISIBLE_DEVICES={uuid}")),
            "{env:?}"
        );
        assert!(
            env.contains(&"CUDA_DEVICE_ORDER=PCI_BUS_ID".to_string()),
            "{env:?}"
        );
        seen.insert(uuid);
    }
    assert_eq!(seen.len(), 4, "four distinct GPUs: {seen:?}");
    // A fifth: every GPU is held.
    let fifth = g(5).reply(&rig.cp, &node);
    assert_eq!(fifth["status"], "error", "{fifth}");
    let refusal = refusal_of(&rig, 5);
    assert_host_busy(&refusal, "gpus_busy");
    let st = rig.cp.status(&node.uuid(), "st1", REPLY).expect("status");
    let before = holders(&st);
    assert_eq!(before.len(), 4);
    assert!(before.iter().all(|(_, h)| h.is_string()), "{st}");
    for w in st["output"]["active_workloads"].as_array().expect("active") {
        assert_eq!(w["gpus"].as_array().map(Vec::len), Some(1), "{w}");
    }

    // kill -9 and restart: the same assignment, still exclusive.
    node.kill9();
    let node = rig.node();
    let st = rig.cp.status(&node.uuid(), "st2", REPLY).expect("status");
    assert_eq!(holders(&st), before, "assignment kept across the restart");
    g(6).reply(&rig.cp, &node);
    assert_eq!(refusal_of(&rig, 6)["busy_reason"], "gpus_busy");
    let local = rig.setup.run(&["status"]);
    local.assert_stdout("gpus:       4");
    for n in 1..=4 {
        local.assert_stdout(&format!("held by g{n}"));
    }
    let hb = wait_for(DONE, || {
        rig.cp
            .requests("heartbeat")
            .into_iter()
            .rev()
            .find(|r| r.body.get("gpus_total").is_some())
    })
    .expect("a heartbeat with GPU fields");
    assert_eq!(hb.body["gpus_total"], 4, "{}", hb.body);
    assert_eq!(hb.body["gpus_healthy"], 4);
    assert_eq!(hb.body["gpus_free"], 0);

    // Samples are taken while the workloads hold GPUs; then they end.
    let q = smi.queries();
    assert!(wait_for(DONE, || (smi.queries() >= q + 4).then_some(())).is_some());
    for n in 1..=4 {
        finish(&rig, n);
    }
    for n in 1..=4 {
        let done = g(n).completion(&rig.cp);
        let gpu = &done["gpu"];
        let (util, mem) = fixture_reading("four-a100.csv", &visible(&rig, n));
        assert_eq!(gpu["count"], 1, "{done}");
        assert_eq!(gpu["util_avg_pct"].as_f64(), Some(util as f64), "{done}");
        assert_eq!(gpu["util_max_pct"], util, "{done}");
        assert_eq!(gpu["mem_peak_mib"], mem, "{done}");
        assert!(gpu["energy_wh"].as_f64().unwrap_or(0.0) > 0.0, "{done}");
        assert!(gpu["seconds"].as_f64().unwrap_or(0.0) > 0.0, "{done}");
    }
    // Released: a new workload gets a GPU again.
    g(7).ok(&rig.cp, &node);
    assert!(visible(&rig, 7).starts_with("GPU-"));
    finish(&rig, 7);
    g(7).completion(&rig.cp);
}

#[test]
fn g10_unhealthy_gpus_get_nothing_and_health_is_followed_mid_run() {
    let smi = FakeSmi::new("four-a100-ecc.csv");
    let mut rig = gpu_rig(4, Some(&smi));
    let metrics = rig.setup.home.join("metrics.prom");
    rig.setup
        .set("CYBERWAVE_METRICS_FILE", &metrics.display().to_string())
        .set("CYBERWAVE_NODE_METRICS_INTERVAL_SECONDS", "0.2");
    let node = rig.node();
    let bad = "GPU-6b1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e62";
    for n in 1..=3 {
        g(n).with(json!({"gpus": 1})).ok(&rig.cp, &node);
        assert_ne!(visible(&rig, n), bad, "the GPU with ECC errors got work");
    }
    // The only GPU left is unhealthy: busy (waiting for the others helps).
    g(4).with(json!({"gpus": 1})).reply(&rig.cp, &node);
    assert_eq!(refusal_of(&rig, 4)["busy_reason"], "gpus_busy");
    // Four healthy GPUs can never be had now: unhealthy.
    g(5).with(json!({"gpus": 4})).reply(&rig.cp, &node);
    assert_eq!(refusal_of(&rig, 5)["busy_reason"], "gpus_unhealthy");
    let st = rig.cp.status(&node.uuid(), "st", REPLY).expect("status");
    let g2 = &st["output"]["gpus"][2];
    assert_eq!(g2["health"], "unhealthy", "{st}");
    assert!(g2["reason"].as_str().unwrap_or("").contains("ECC"), "{st}");
    assert!(g2["held_by"].is_null());
    // GPU 0 goes bad mid-run: the holder keeps it, the count drops.
    smi.answer("four-a100-retired.csv");
    // Status replies are keyed by request id: each look uses a fresh one.
    let mut look = 0;
    let st = wait_for(DONE, || {
        look += 1;
        let st = rig.cp.status(&node.uuid(), &format!("st-{look}"), REPLY)?;
        (st["output"]["gpus"][0]["health"] == "unhealthy").then_some(st)
    });
    let st = st.expect("GPU 0 seen unhealthy");
    assert_eq!(
        st["output"]["gpus"][0]["reason"], "pending retired pages",
        "{st}"
    );
    assert!(node.wait_log("is unhealthy: pending retired pages", REPLY));
    let text = wait_for(DONE, || {
        std::fs::read_to_string(&metrics)
            .ok()
            .filter(|t| t.contains("cyberwave_node_gpu_healthy{gpu=\"0\",uuid=\"GPU-6b1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e60\"} 0"))
    })
    .expect("metrics with GPU 0 unhealthy");
    assert!(
        text.contains(&format!(
            "cyberwave_node_gpu_healthy{{gpu=\"2\",uuid=\"{bad}\"}} 0"
        )),
        "{text}"
    );
    assert!(text.contains("cyberwave_node_gpu_healthy{gpu=\"1\",uuid=\"GPU-6b1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e61\"} 1"), "{text}");
    assert!(text.contains("cyberwave_node_gpu_power_watts{gpu=\"3\",uuid=\"GPU-6b1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e63\"} 400"), "{text}");
    // doctor names each unhealthy GPU and why.
    let doc = rig.setup.run(&["doctor"]);
    doc.assert_stdout("4 GPU(s), 2 healthy");
    doc.assert_stdout(&format!("GPU 2 {bad}"));
    doc.assert_stdout("3 uncorrected volatile ECC error(s)");
    doc.assert_stdout("pending retired pages");
    for n in 1..=3 {
        finish(&rig, n);
        g(n).completion(&rig.cp);
    }
}

#[test]
fn g10_a_hanging_nvidia_smi_marks_gpus_unhealthy_and_delays_nothing() {
    let smi = FakeSmi::new("four-a100.csv");
    let mut rig = gpu_rig(4, Some(&smi));
    rig.setup.set("CYBERWAVE_NODE_GPU_TIMEOUT_SECONDS", "0.3");
    let node = rig.node();
    let q0 = smi.queries();
    std::fs::write(smi.dir.join("hang"), "").expect("hang");
    assert!(
        node.wait_log("nvidia-smi did not answer within 0.3s", DONE),
        "{}",
        node.log()
    );
    // Commands are answered while the query hangs; starts needing a GPU are refused.
    let st = rig
        .cp
        .status(&node.uuid(), "st", REPLY)
        .expect("status while hanging");
    assert_eq!(st["output"]["gpus"][0]["health"], "unhealthy", "{st}");
    g(1).with(json!({"gpus": 1})).reply(&rig.cp, &node);
    assert_eq!(refusal_of(&rig, 1)["busy_reason"], "gpus_unhealthy");
    // Each hanging query was killed with its whole process group (the fake's `sleep` too).
    assert!(wait_for(DONE, || (smi.queries() >= q0 + 3).then_some(())).is_some());
    let mine = smi.dir.path().display().to_string();
    let alive = hanging_sleeps(&mine);
    assert!(
        alive <= 2,
        "{alive} hanging sleeps alive: only the query in flight (and its child) may be"
    );
    // Back to normal: a GPU is assigned again (each try is a new request).
    std::fs::remove_file(smi.dir.join("hang")).expect("unhang");
    let mut n = 1;
    let ok = wait_for(DONE, || {
        n += 1;
        (g(n).with(json!({"gpus": 1})).reply(&rig.cp, &node)["status"] == "ok").then_some(n)
    })
    .expect("a GPU once nvidia-smi answers again");
    assert!(visible(&rig, ok).starts_with("GPU-"));
    // Nothing of any hung query is left: neither the tool nor the child it started.
    assert!(
        wait_for(REPLY, || (hanging_sleeps(&mine) == 0).then_some(())).is_some(),
        "{} hanging sleeps left behind",
        hanging_sleeps(&mine)
    );
    finish(&rig, ok);
    g(ok).completion(&rig.cp);
}

/// Live `sleep 3600` processes started by this test's fake.
fn hanging_sleeps(dir: &str) -> usize {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return 0;
    };
    rd.flatten()
        .filter(|e| {
            let p = e.path();
            std::fs::read(p.join("cmdline")).is_ok_and(|c| c == b"sleep\x003600\x00")
                && std::fs::read(p.join("environ"))
                    .is_ok_and(|env| String::from_utf8_lossy(&env).contains(dir))
        })
        .count()
}

#[test]
fn a_node_starting_while_nvidia_smi_hangs_starts_and_refuses_gpu_work_as_busy() {
    let smi = FakeSmi::new("four-a100.csv");
    std::fs::write(smi.dir.join("hang"), "").expect("hang");
    let rig = gpu_rig(2, Some(&smi));
    let node = rig.node();
    node.assert_logged("nvidia-smi did not answer within 1s");
    g(1).with(json!({"gpus": 1})).reply(&rig.cp, &node);
    let r = refusal_of(&rig, 1);
    assert_eq!(r["busy_reason"], "gpus_unhealthy", "{r}");
}

#[test]
fn doctor_reads_one_eight_mig_and_garbage() {
    let smi = FakeSmi::new("one-rtx4090.csv");
    let mut setup = NodeSetup::bare();
    smi.install(&mut setup);
    let out = setup.run(&["doctor"]);
    out.assert_stdout("1 GPU(s), 1 healthy");
    smi.answer("eight-h100.csv");
    let out = setup.run(&["doctor"]);
    out.assert_stdout("8 GPU(s), 8 healthy");
    smi.answer("mig-a100.csv");
    smi.file("list.txt", "mig-a100-list.txt");
    let out = setup.run(&["doctor"]);
    assert!(
        out.stdout.contains("3 GPU(s), 3 healthy"),
        "two MIG instances and one whole GPU: {}",
        out.stdout
    );
    // A driver without row remapping refuses that field: the rest is still read.
    smi.answer("four-a100-ecc.csv");
    std::fs::write(smi.dir.join("old-driver"), "").expect("old driver");
    std::fs::remove_file(smi.dir.join("list.txt")).expect("no MIG");
    let out = setup.run(&["doctor"]);
    out.assert_stdout("4 GPU(s), 3 healthy");
    out.assert_stdout("3 uncorrected volatile ECC error(s)");
    smi.answer("garbage.txt");
    let out = setup.run(&["doctor"]);
    out.assert_stdout("nvidia-smi failed: NVIDIA-SMI has failed because it couldn't communicate");
}

#[test]
fn the_manifest_sets_gpus_per_workload_and_params_win() {
    let smi = FakeSmi::new("four-a100.csv");
    let rig = gpu_rig(4, Some(&smi));
    rig.setup.write(
        "cyberwave.yml",
        &format!("{RECORDING}cloud_node:\n  max_concurrent_workloads: 4\n  gpus_per_workload: 2\n"),
    );
    let node = rig.node();
    g(1).ok(&rig.cp, &node);
    assert_eq!(
        visible(&rig, 1).split(',').count(),
        2,
        "two GPUs from the manifest"
    );
    g(2).with(json!({"gpus": 1})).ok(&rig.cp, &node);
    assert_eq!(visible(&rig, 2).split(',').count(), 1, "params win");
    g(3).reply(&rig.cp, &node);
    assert_eq!(
        refusal_of(&rig, 3)["busy_reason"],
        "gpus_busy",
        "one GPU left, two needed"
    );
    for n in 1..=2 {
        finish(&rig, n);
        g(n).completion(&rig.cp);
    }
}

#[test]
fn g10_a_workload_whose_record_is_rebuilt_keeps_its_gpus() {
    let smi = FakeSmi::new("four-a100.csv");
    let rig = gpu_rig(4, Some(&smi));
    let mut node = rig.node();
    g(1).with(json!({"gpus": 1})).ok(&rig.cp, &node);
    let held = visible(&rig, 1);
    node.kill9();
    let meta = rig.setup.config_dir().join("workloads/g1/meta.json");
    assert!(meta.exists(), "{}", meta.display());
    std::fs::write(&meta, "{ not json").expect("corrupt");
    let node = rig.node();
    // Its GPU is still its own: four cannot be had, and status names the holder.
    g(2).with(json!({"gpus": 4})).reply(&rig.cp, &node);
    assert_eq!(refusal_of(&rig, 2)["busy_reason"], "gpus_busy");
    let st = rig.cp.status(&node.uuid(), "st", REPLY).expect("status");
    let holder = holders(&st)
        .into_iter()
        .find(|(u, _)| *u == held)
        .map(|(_, h)| h);
    assert_eq!(holder, Some(json!("g1")), "{st}");
    finish(&rig, 1);
}

#[test]
fn mig_instances_are_assigned_by_their_uuid() {
    let smi = FakeSmi::new("mig-a100.csv");
    smi.file("list.txt", "mig-a100-list.txt");
    let rig = gpu_rig(3, Some(&smi));
    let node = rig.node();
    // Workload 1's own processes use 777 MiB (a stranger, pid 1, uses more).
    std::fs::write(smi.dir.join("apps.csv"), "1, 5000\n").expect("apps");
    std::fs::write(rig.setup.cwd.join("own-mem-1"), "777").expect("own");
    // auto: 3 healthy units ÷ capacity 3 = 1 each, in order.
    for n in 1..=3 {
        g(n).ok(&rig.cp, &node);
    }
    assert_eq!(visible(&rig, 1), "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f");
    assert_eq!(visible(&rig, 2), "MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb");
    assert_eq!(visible(&rig, 3), "GPU-7e6ca1d0-d33d-2b2c-524d-9e3d8d2b8a78");
    let q = smi.queries();
    assert!(wait_for(DONE, || (smi.queries() >= q + 3).then_some(())).is_some());
    for n in 1..=3 {
        finish(&rig, n);
    }
    let one = g(1).completion(&rig.cp);
    assert_eq!(
        one["gpu"]["mem_peak_mib"], 777,
        "its own processes only: {one}"
    );
    // The whole GPU's memory when none of its processes was listed.
    assert_eq!(g(3).completion(&rig.cp)["gpu"]["mem_peak_mib"], 0);
    g(2).completion(&rig.cp);
}

#[test]
fn g10_zero_gpus_hides_every_gpu_and_bad_counts_are_refused_at_the_edge() {
    let smi = FakeSmi::new("four-a100.csv");
    let rig = gpu_rig(4, Some(&smi));
    let node = rig.node();
    g(1).with(json!({"gpus": 0})).ok(&rig.cp, &node);
    let env = env_of(&rig, 1);
    assert!(
        env.contains(&"CUDA_VISIBLE_DEVICES=".to_string()),
        "{env:?}"
    );
    assert!(
        env.contains(&"NVIDIA_VISIBLE_DEVICES=none".to_string()),
        "{env:?}"
    );
    finish(&rig, 1);
    assert!(
        g(1).completion(&rig.cp).get("gpu").is_none(),
        "no GPU, no accounting"
    );
    for (n, bad) in [
        (10, json!(-1)),
        (11, json!(1.5)),
        (12, json!("two")),
        (13, json!(1025)),
        (14, json!(u64::MAX)),
        (15, json!([1])),
        (16, json!("１")),
    ] {
        let r = g(n).with(json!({"gpus": bad})).reply(&rig.cp, &node);
        assert_eq!(r["status"], "error", "{bad}: {r}");
        assert!(error_of(&r).contains("params.gpus"), "{r}");
    }
    // More than the node has: never possible here, so not "busy".
    g(20).with(json!({"gpus": 5})).reply(&rig.cp, &node);
    assert!(refusal_of(&rig, 20).get("busy_reason").is_none());
}

#[test]
fn a_cpu_only_node_runs_workloads_as_before() {
    let rig = gpu_rig(2, None);
    let node = rig.node();
    node.assert_logged("a CPU-only node");
    g(1).ok(&rig.cp, &node);
    assert!(
        env_of(&rig, 1).is_empty(),
        "no GPU variables on a CPU-only node"
    );
    let st = rig.cp.status(&node.uuid(), "st", REPLY).expect("status");
    assert!(st["output"].get("gpus").is_none(), "{st}");
    assert!(
        st["output"]["active_workloads"][0].get("gpus").is_none(),
        "{st}"
    );
    finish(&rig, 1);
    assert_eq!(
        g(1).completion(&rig.cp),
        json!({"status": "completed", "success": true, "exit_code": 0})
    );
    g(2).with(json!({"gpus": 1})).reply(&rig.cp, &node);
    let r = refusal_of(&rig, 2);
    assert!(r.get("busy_reason").is_none(), "{r}");
    assert!(error_of(&r).contains("has none"), "{r}");
}

/// An `nvidia-smi` that is the script `text`, first on the node's PATH: its folder (removed
/// when dropped) and that PATH.
fn script_smi(setup: &mut NodeSetup, text: &str) -> (TempDir, String) {
    let bin = TempDir::new("smi-script");
    let smi = bin.path().join("nvidia-smi");
    std::fs::write(&smi, text).expect("write");
    std::fs::set_permissions(&smi, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let path = format!("{}:/usr/bin:/bin", bin.path().display());
    setup.set("PATH", &path);
    (bin, path)
}

/// A host without a usable `nvidia-smi` is looked at again at every inventory, and each look's
/// exec fails. A reaper thread that waited for any child (`waitpid(-1)`) would often collect
/// such a child first, and `std::process::Command` would panic ("wait() should either return Ok
/// or panic"): the packaged build (`panic = "abort"`) would abort within a minute on every such
/// host. Nothing of the node waits for another's child: every look is waited for by the GPU
/// thread, and none is left a zombie. Here one `nvidia-smi` names a
/// missing interpreter (its exec fails) and the node looks twenty times a second, while a
/// workload's supervisor runs and ends.
#[test]
fn g8_a_host_whose_nvidia_smi_cannot_run_is_looked_at_again_and_again_and_the_node_lives() {
    let mut rig = gpu_rig(1, None);
    let _bin = script_smi(&mut rig.setup, "#!/nonexistent/cw-no-such-interpreter\n");
    rig.setup
        .set("CYBERWAVE_NODE_GPU_INVENTORY_SECONDS", "0.05");
    let node = rig.node();
    g(1).ok(&rig.cp, &node);
    finish(&rig, 1);
    g(1).completion(&rig.cp);
    // Twenty looks or so.
    std::thread::sleep(Duration::from_secs(1));
    let log = node.log();
    assert!(!log.contains("panicked"), "{log}");
    // A look's child is a zombie for a moment before the GPU thread waits for it: only one
    // that is still there 300 ms later is left behind.
    let zombies = || -> BTreeSet<String> {
        std::fs::read_dir("/proc")
            .expect("/proc")
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
            .filter(|st| {
                let after = st.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
                let fields: Vec<&str> = after.split_whitespace().collect();
                fields.first() == Some(&"Z")
                    && fields.get(1) == Some(&node.pid().to_string().as_str())
            })
            .collect()
    };
    let first = zombies();
    std::thread::sleep(Duration::from_millis(300));
    let zombies: Vec<String> = zombies().intersection(&first).cloned().collect();
    assert!(zombies.is_empty(), "zombies of the node: {zombies:?}");
    let threads: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", node.pid()))
        .expect("the node is alive")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect();
    assert!(
        threads.iter().any(|t| t == "gpu"),
        "the GPU thread died: {threads:?}\n{log}"
    );
    let st = rig.cp.status(&node.uuid(), "st", REPLY).expect("status");
    assert!(st["output"].get("gpus").is_none(), "{st}");
}

/// A thread of the node that ends (here the GPU monitor, by a test knob) must not leave the
/// loop spinning on its closed channel, as it did before: the node says which thread stopped
/// and exits 1 to be started again (crash-only), and its workload keeps running.
#[test]
fn g8_a_thread_of_the_node_that_ends_makes_it_exit_1_and_its_workload_keeps_running() {
    let mut rig = gpu_rig(1, None);
    let stop = rig.setup.cwd.join("stop-gpu-monitor");
    rig.setup.set(
        "CYBERWAVE_TEST_GPU_MONITOR_STOP_FILE",
        &stop.display().to_string(),
    );
    rig.setup
        .set("CYBERWAVE_NODE_GPU_INVENTORY_SECONDS", "0.05");
    let mut node = rig.node();
    g(1).ok(&rig.cp, &node);
    let started = rig.setup.config_dir().join("workloads/g1/started.json");
    let pid = wait_for(REPLY, || {
        let v: Value = serde_json::from_slice(&std::fs::read(&started).ok()?).ok()?;
        v["pid"].as_i64().map(|p| p as i32)
    })
    .expect("the workload's start record");
    std::fs::write(&stop, "").expect("write the stop file");
    let exit = node.wait_exit(DONE);
    assert_eq!(exit, Some(Some(1)), "log:\n{}", node.log());
    node.assert_logged("the GPU monitor thread stopped");
    assert!(procs::exists(pid), "the workload died with the node");
    finish(&rig, 1);
}

/// D47: the `nvidia-smi` the node runs gets the node's environment (its `PATH`, library
/// paths) with `LC_ALL=C`, but not the node's API key or broker password.
#[test]
fn g7_the_nvidia_smi_the_node_runs_sees_none_of_its_secrets() {
    let mut rig = gpu_rig(1, None);
    let out = TempDir::new("smi-env");
    let seen = out.path().join("seen.env");
    let script = format!(
        "#!/bin/sh\nenv > {}.tmp && mv {0}.tmp {0}\nexit 9\n",
        seen.display()
    );
    let (_bin, path) = script_smi(&mut rig.setup, &script);
    rig.setup
        .set("CYBERWAVE_MQTT_PASSWORD", "cw-test-broker-password-42");
    let _node = rig.node();
    let env = wait_for(DONE, || std::fs::read_to_string(&seen).ok()).expect("nvidia-smi never ran");
    assert!(env.lines().any(|l| l == "LC_ALL=C"), "{env}");
    assert!(env.lines().any(|l| l == format!("PATH={path}")), "{env}");
    for secret in rig.setup.secrets() {
        assert!(
            !env.contains(&secret),
            "nvidia-smi saw a secret of the node:\n{env}"
        );
    }
    assert!(!env.contains("CYBERWAVE_API_KEY="), "{env}");
    assert!(!env.contains("cw-test-broker-password-42"), "{env}");
}

/// The node's status, each look under a fresh request id.
fn look(rig: &Rig, node: &NodeProcess, tag: &str) -> Value {
    rig.cp.status(&node.uuid(), tag, REPLY).expect("no status")
}

/// Runs scripts/gpu-check with the `nvidia-smi` of `bin` first on PATH, and `env`.
fn gpu_check(bin: &Path, out: &Path, env: &[(&str, &str)]) -> (i32, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu-check");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into())
    );
    let mut cmd = std::process::Command::new(script);
    cmd.arg(crate::support::node_bin())
        .env("PATH", path)
        .env("OUT", out)
        .env("LOAD_SECONDS", "4")
        .env("GPU_CHECK_SAMPLE_SECONDS", "0.3")
        .env("GPU_CHECK_DEADLINE_SECONDS", "110")
        .env_remove("CYBERWAVE_EDGE_CONFIG_DIR");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let o = cmd.output().expect("run gpu-check");
    (
        o.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

#[test]
fn g15_the_device_check_runs_in_ci_against_the_fake_and_never_passes_what_it_skipped() {
    let smi = FakeSmi::new("four-a100.csv");
    let out = TempDir::new("gpu-check-out");
    let t0 = std::time::Instant::now();
    let fake = smi.dir.path().display().to_string();
    let bin = smi.dir.join("bin");
    let (rc, text) = gpu_check(
        &bin,
        out.path(),
        &[("GPU_CHECK_NO_CUDA", "1"), ("FAKE_NVIDIA_SMI_DIR", &fake)],
    );
    assert!(
        t0.elapsed() < Duration::from_secs(100),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(rc, 0, "{text}");
    for check in [
        "inventory",
        "health-ecc",
        "health-hang",
        "health-recovery",
        "accounting",
    ] {
        assert!(text.contains(&format!("PASS  {check}")), "{check}: {text}");
    }
    // The CUDA view is not checked here, and says so: skipped, not counted as passed.
    assert!(text.contains("SKIP  isolation "), "{text}");
    assert!(text.contains("SKIP  isolation-zero"), "{text}");
    assert!(
        text.contains("VERDICT: PASS 5/5 (skipped, not applicable here: isolation isolation-zero)"),
        "{text}"
    );
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("verdict.json")).expect("verdict.json"),
    )
    .expect("json");
    assert_eq!(v["verdict"], "PASS");
    assert_eq!(v["skipped"], json!(["isolation", "isolation-zero"]));
    // Raw captures of every call: the node's own query among them, with its exit code.
    let calls: Vec<String> = std::fs::read_dir(out.join("smi-calls"))
        .expect("smi-calls")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let query = calls
        .iter()
        .filter(|n| n.ends_with(".args"))
        // One that ran to its end: on a loaded machine a call may pass the node's short time
        // limit and be killed before the wrapper recorded its exit code.
        .find(|n| {
            let id = n.trim_end_matches(".args");
            std::fs::read_to_string(out.join("smi-calls").join(n))
                .is_ok_and(|a| a.starts_with("--query-gpu=index,uuid"))
                && calls.contains(&format!("{id}.rc"))
        })
        .expect("a query call that ran to its end");
    let id = query.trim_end_matches(".args");
    assert!(calls.contains(&format!("{id}.out")) && calls.contains(&format!("{id}.rc")));
    for f in [
        "node.log",
        "nvidia-smi-q.out",
        "nvidia-smi-q.rc",
        "mqtt.jsonl",
        "power.csv",
    ] {
        assert!(out.join(f).exists(), "{f} not in $OUT");
    }
    // A capture of the host, named as the shared captures are (the fake knows no --version).
    let capture = std::fs::read_to_string(out.join("capture").join(format!(
        "linux-{}__nvidia-a100-sxm4-80gb__unknown.txt",
        std::env::consts::ARCH
    )))
    .expect("the capture");
    for section in [
        "# capabilities :: list (-L)",
        "# idle :: query-gpu (csv, what the exporter parses)",
        "# load :: dmon (per-device monitor, incl. PCIe rx/tx)",
    ] {
        assert!(capture.contains(section), "{section}:\n{capture}");
    }

    // The same host without libcuda.so.1 and without the CI flag: it cannot run, and says why.
    let out2 = TempDir::new("gpu-check-out2");
    let (rc, text) = gpu_check(&bin, out2.path(), &[("FAKE_NVIDIA_SMI_DIR", &fake)]);
    assert_eq!(rc, 2, "{text}");
    assert!(
        text.contains("VERDICT: CANNOT RUN (libcuda.so.1 cannot be loaded"),
        "{text}"
    );
    // A host without nvidia-smi.
    let (rc, text) = gpu_check(&bin, out2.path(), &[("PATH", "/usr/bin:/bin")]);
    assert_eq!(rc, 2, "{text}");
    assert!(
        text.contains("VERDICT: CANNOT RUN (nvidia-smi missing)"),
        "{text}"
    );
}

/// Two synthetic host states that no real capture shows (tests/fixtures/gpu/hosts/FACTS.md):
/// one UUID on two lines, and NVML failing with an unknown error.
#[test]
fn g15_doctor_names_a_uuid_listed_twice_and_an_unknown_nvml_error() {
    let smi = FakeSmi::new("four-a100.csv");
    let mut setup = NodeSetup::bare();
    smi.install(&mut setup);
    smi.host("duplicate-uuid");
    let out = setup.run(&["doctor"]);
    out.assert_stdout("1 GPU(s), 0 healthy");
    out.assert_stdout("is unhealthy: 2 uncorrected volatile ECC error(s)");
    smi.host("nvml-unknown-error");
    let out = setup.run(&["doctor"]);
    out.assert_stdout("nvidia-smi failed: Failed to initialize NVML: Unknown Error");
    out.assert_stdout("FAIL");
}

/// Guarantee 10: starts in flight hold their GPUs. Four starts at once on a slow disk on a node
/// with four GPUs (one each) get four different GPUs, although none was reported yet when the
/// next was accepted.
#[test]
fn g10_starts_in_flight_hold_their_gpus() {
    let mut rig = Scenario::new(
        "cyberwave:\n  max_concurrent_workloads: 4\n  inference: |\n    echo \"$CUDA_VISIBLE_DEVICES\" > t/$CYBERWAVE_REQUEST_ID.gpu\n    sleep 2\n",
    )
    .slow_disk(300)
    .dir("t")
    .rig();
    let smi = FakeSmi::new("four-a100.csv");
    smi.put_on_path(&mut rig.setup);
    let node = rig.node();
    let rids = ["g0", "g1", "g2", "g3"];
    for rid in rids {
        Start::new("inference", rid).send(&rig.cp, &node);
    }
    let mut seen = std::collections::BTreeSet::new();
    for rid in rids {
        let reply = rig
            .cp
            .wait_reply(rid, Duration::from_secs(20))
            .unwrap_or_else(|| panic!("no reply to {rid}; log:\n{}", node.log()));
        assert_eq!(reply["status"], "ok", "{reply}");
        let gpu = wait_for(Duration::from_secs(10), || {
            std::fs::read_to_string(rig.work(&format!("t/{rid}.gpu")))
                .ok()
                .filter(|g| !g.trim().is_empty())
        })
        .unwrap_or_else(|| panic!("{rid} saw no GPU; log:\n{}", node.log()));
        assert!(
            seen.insert(gpu.trim().to_string()),
            "{rid} got a GPU another start holds: {gpu} (all: {seen:?})"
        );
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
}

/// D59: a GPU a service uses (a model server a workload left running, seen in `nvidia-smi`'s
/// compute-apps list) is the last one a new workload gets, and never a reason to refuse one;
/// `status` lists the service with its GPU. Without this the next workload would get the
/// first GPU, the one the server holds.
#[test]
fn g10_d59_a_new_workload_gets_a_gpu_no_service_uses_and_is_never_refused_for_one() {
    let smi = FakeSmi::new("four-a100.csv");
    let rig = gpu_rig(2, Some(&smi));
    rig.setup.write(
        "cyberwave.yml",
        concat!(
            "cyberwave:\n  training: |\n",
            "    n=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[\"n\"])' {body})\n",
            "    if [ \"$n\" = 1 ]; then setsid sleep 600 < /dev/null > /dev/null 2>&1 & echo $! > svc.pid; fi\n",
            "    echo \"$CUDA_VISIBLE_DEVICES\" > gpus-$n\n",
            "cloud_node:\n  max_concurrent_workloads: 2\n",
        ),
    );
    let node = rig.node();
    let first = g(1).with(json!({"gpus": 1}));
    first.ok(&rig.cp, &node);
    first.completion(&rig.cp);
    let svc: i32 = wait_for(REPLY, || {
        std::fs::read_to_string(rig.setup.cwd.join("svc.pid"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    })
    .expect("the service's pid");
    let gpu0 = std::fs::read_to_string(rig.setup.cwd.join("gpus-1"))
        .unwrap()
        .trim()
        .to_string();
    assert!(gpu0.starts_with("GPU-"), "{gpu0}");
    std::fs::write(smi.dir.join("apps.csv"), format!("{svc}, 500, {gpu0}\n")).unwrap();
    let mut asked = 0;
    let listed = wait_for(REPLY, || {
        asked += 1;
        let st = rig.cp.status(&node.uuid(), &format!("st-{asked}"), REPLY)?;
        (st["output"]["services"][0]["gpus"] == json!([gpu0])).then_some(st)
    });
    let _kill = scopeguard(svc);
    assert!(
        listed.is_some(),
        "the service's GPU in status; log:\n{}",
        node.log()
    );
    let second = g(2).with(json!({"gpus": 1}));
    second.ok(&rig.cp, &node);
    second.completion(&rig.cp);
    let got = std::fs::read_to_string(rig.setup.cwd.join("gpus-2")).unwrap();
    assert_ne!(got.trim(), gpu0, "another GPU than the service's");
    let all = g(3).with(json!({"gpus": 4}));
    all.ok(&rig.cp, &node);
    assert_eq!(all.completion(&rig.cp)["success"], true);
    let got = std::fs::read_to_string(rig.setup.cwd.join("gpus-3")).unwrap();
    assert_eq!(
        got.trim().split(',').count(),
        4,
        "not refused for the service's GPU"
    );
}

/// Kills `pid` on drop.
fn scopeguard(pid: i32) -> impl Drop {
    struct Kill(i32);
    impl Drop for Kill {
        fn drop(&mut self) {
            // SAFETY: a process the test's workload started.
            unsafe {
                libc::kill(self.0, libc::SIGKILL);
            }
        }
    }
    Kill(pid)
}
