//! GPUs end to end against real `nvidia-smi` captures: the stand-in of the shared folder
//! (`../shared/fixtures/gpu/real`, or `CW_SHARED_DIR`; build.rs finds it) answers the node's
//! own calls from a capture, and its failure modes are switched on and off while the node runs.
//! A build without the shared folder lists these tests as ignored, saying why.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::{env_of, finish, g, gpu_check, gpu_rig, holders, look, refusal_of, visible};
use crate::support::node::NodeSetup;
use crate::support::scenario::error_of;
use crate::support::timeouts::{DONE, REPLY};
use crate::support::{wait_for, NodeProcess, Rig, TempDir};

/// The folder of the captures and their stand-in.
fn real() -> PathBuf {
    let Some(d) = option_env!("CW_GPU_REAL") else {
        panic!(
            "the real nvidia-smi captures are not here: this build found no fixtures/gpu/real \
             in ../shared (set CW_SHARED_DIR to the shared folder and build again)"
        );
    };
    let d = PathBuf::from(d);
    assert!(d.join("nvidia-smi").is_file(), "{}", d.display());
    d
}

/// The capture whose file name holds `part` (exactly one).
fn capture(part: &str) -> PathBuf {
    let all: Vec<PathBuf> = std::fs::read_dir(real().join("captures"))
        .expect("captures")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().contains(part))
        .collect();
    assert_eq!(all.len(), 1, "{part}: {all:?}");
    all[0].clone()
}

/// The stand-in, first on the node's PATH behind a wrapper that reads its settings from a
/// file: rewriting the file switches a failure on or off while the node runs.
struct RealSmi {
    dir: TempDir,
    capture: PathBuf,
    phase: &'static str,
}

impl RealSmi {
    fn new(capture: &Path, phase: &'static str) -> RealSmi {
        let dir = TempDir::new("real-smi");
        let wrapper = dir.join("bin/nvidia-smi");
        std::fs::create_dir_all(dir.join("bin")).expect("bin");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\n. '{}'\nexec '{}' \"$@\"\n",
                dir.join("settings").display(),
                real().join("nvidia-smi").display()
            ),
        )
        .expect("wrapper");
        std::fs::set_permissions(
            &wrapper,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("chmod");
        let smi = RealSmi {
            dir,
            capture: capture.to_path_buf(),
            phase,
        };
        smi.set(&[]);
        smi
    }

    /// The stand-in's settings from now on: its capture and phase, plus `extra` (`NVSMI_FAIL`,
    /// `NVSMI_SET`, `NVSMI_HANG`, …); `&[]` is a healthy driver again.
    fn set(&self, extra: &[(&str, &str)]) {
        let mut text = String::new();
        let capture = self.capture.display().to_string();
        let log = self.dir.join("calls.log").display().to_string();
        for (k, v) in [
            ("NVSMI_CAPTURE", capture.as_str()),
            ("NVSMI_PHASE", self.phase),
            ("NVSMI_LOG", log.as_str()),
        ]
        .iter()
        .chain(extra)
        {
            assert!(!v.contains('\''), "{v}");
            text.push_str(&format!("export {k}='{v}'\n"));
        }
        let tmp = self.dir.join("settings.tmp");
        std::fs::write(&tmp, text).expect("settings");
        std::fs::rename(&tmp, self.dir.join("settings")).expect("swap settings");
    }

    /// GPU queries the node has made so far.
    fn queries(&self) -> usize {
        std::fs::read_to_string(self.dir.join("calls.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("--query-gpu=index,uuid"))
            .count()
    }

    /// Waits until the node has made `n` more GPU queries (each started after this call).
    fn wait_queries(&self, n: usize) {
        let q = self.queries();
        assert!(
            wait_for(DONE, || (self.queries() >= q + n).then_some(())).is_some(),
            "the node made no {n} GPU queries"
        );
    }

    /// PATH with the stand-in first, and timings short enough for a test but long enough for
    /// a python3 stand-in on a loaded machine.
    fn install(&self, setup: &mut NodeSetup) {
        setup.path_first(&self.dir.join("bin"));
        setup.set("CYBERWAVE_NODE_GPU_INVENTORY_SECONDS", "0.3");
        setup.set("CYBERWAVE_NODE_GPU_SAMPLE_SECONDS", "0.2");
        setup.set("CYBERWAVE_NODE_GPU_TIMEOUT_SECONDS", "3");
    }
}

/// A capture of the host a `-L` listing of `lists/` shows: the listing verbatim, one query
/// row per GPU (its index, UUID and name from the listing, the rest of the GeForce capture's
/// row), bus ids `00000000:07:00.0`, `…:0B:…`, `…:0F:…` and on.
fn capture_of_list(list: &str, to: &Path) {
    let listing = std::fs::read_to_string(real().join("lists").join(list)).expect("list");
    let base = std::fs::read_to_string(capture("linux-x86_64__nvidia-geforce-rtx-2080-super__595"))
        .expect("base");
    let mut out = Vec::new();
    let mut lines = base.lines().peekable();
    let mut section = String::new();
    while let Some(l) = lines.next() {
        if l.starts_with("# ") && l.contains(" :: ") {
            section = l.to_string();
        }
        out.push(l.to_string());
        let body = lines.peek().is_some_and(|n| !n.starts_with('#'));
        if section.contains("capabilities :: list") && l.starts_with("#####") && body {
            out.extend(listing.lines().map(String::from));
            while lines.peek().is_some_and(|n| n.starts_with("GPU ")) {
                lines.next();
            }
        }
        if section.contains(":: query-gpu (csv") && l.starts_with("timestamp, ") {
            let head: Vec<&str> = l.split(", ").collect();
            let at = |n: &str| head.iter().position(|c| c.split(' ').next() == Some(n));
            let (i, u, n, b) = (at("index"), at("uuid"), at("name"), at("pci.bus_id"));
            let row: Vec<String> = lines
                .next()
                .expect("a row")
                .split(", ")
                .map(String::from)
                .collect();
            for gpu in listing.lines().filter(|l| l.starts_with("GPU ")) {
                let (idx, rest) = gpu[4..].split_once(": ").expect("GPU i:");
                let (name, uuid) = rest.rsplit_once(" (UUID: ").expect("UUID");
                let idx: u32 = idx.parse().expect("index");
                let mut r = row.clone();
                r[i.expect("index")] = idx.to_string();
                r[u.expect("uuid")] = uuid.trim_end_matches(')').to_string();
                r[n.expect("name")] = name.to_string();
                r[b.expect("bus")] = format!("00000000:{:02X}:00.0", 7 + 4 * idx);
                out.push(r.join(", "));
            }
        }
    }
    std::fs::write(to, out.join("\n") + "\n").expect("capture");
}

/// How many times the node's log says `needle`.
fn said(node: &NodeProcess, needle: &str) -> usize {
    node.log().matches(needle).count()
}

/// Looks at the node's status until `ok` holds for it (each look a fresh request id).
fn status_until(rig: &Rig, node: &NodeProcess, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let mut n = 0;
    wait_for(DONE, || {
        n += 1;
        let st = look(rig, node, &format!("{what}-{n}"));
        ok(&st).then_some(st)
    })
    .unwrap_or_else(|| panic!("{what}: never seen; log:\n{}", node.log()))
}

const BOARD: &str = "GPU-00000000-0000-0000-0000-000000000000";

#[test]
#[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
fn g15_a_node_whose_first_gpu_query_fails_says_why_and_learns_its_gpus_once_it_answers() {
    let why = "nvidia-smi failed: No devices were found";
    let smi = RealSmi::new(&capture("h200-mig"), "load");
    smi.set(&[("NVSMI_FAIL", "no-devices")]);
    let mut rig = gpu_rig(2, None);
    smi.install(&mut rig.setup);
    let node = rig.node();
    smi.wait_queries(3);
    // Logged once, not at every look.
    assert_eq!(
        said(&node, &format!("GPU query failed: {why}")),
        1,
        "{}",
        node.log()
    );
    // status says why there is no GPU: not a host without GPUs.
    let st = look(&rig, &node, "st0");
    assert_eq!(st["output"]["gpus"], json!([]), "{st}");
    assert_eq!(st["output"]["gpus_error"], why, "{st}");
    let local = rig.setup.run(&["status"]);
    local.assert_stdout("gpus:       0");
    assert!(
        local
            .stdout
            .contains(&format!("the GPU query fails: {why}")),
        "{}",
        local.stdout
    );
    let json: Value =
        serde_json::from_str(&rig.setup.run(&["status", "--json"]).stdout).expect("json");
    let json = json.get("status").unwrap_or(&json);
    assert_eq!(json["gpus_error"], why, "{json}");
    // A start is refused in the documented words (docs/workloads.md).
    g(1).reply(&rig.cp, &node);
    let r = refusal_of(&rig, 1);
    assert_eq!(r["busy_reason"], "gpus_unhealthy", "{r}");
    assert_eq!(
        r["error"],
        format!(
            "Controller host is busy with unhealthy GPUs: 1 needed, 0 of 0 GPU(s) healthy ({why})"
        ),
        "{r}"
    );
    // The driver answers again: its GPUs, no error.
    smi.set(&[]);
    let st = status_until(&rig, &node, "back", |st| {
        st["output"]["gpus"]
            .as_array()
            .is_some_and(|g| g.len() == 4)
    });
    assert!(st["output"].get("gpus_error").is_none(), "{st}");
    let unit = &st["output"]["gpus"][0];
    assert_eq!(unit["health"], "healthy", "{st}");
    assert_eq!(unit["name"], "NVIDIA H200 MIG 3g.71gb", "{st}");
    assert_eq!(unit["memory_total_mib"], 71424, "the GPU instance's: {st}");
    assert_eq!(unit["shared"], true, "{st}");
    node.assert_logged("GPU query answers again");
    assert_eq!(g(2).reply(&rig.cp, &node)["status"], "ok", "{}", node.log());
    assert!(visible(&rig, 2).starts_with("MIG-"));
    finish(&rig, 2);
    g(2).completion(&rig.cp);
}

/// Switches the stand-in to `settings`, waits for GPU 0 to read `health` with `reason` and for
/// the log line saying so; then, after a few more queries in that state, checks that it was
/// said once.
fn step(
    (rig, smi, node): (&Rig, &RealSmi, &NodeProcess),
    settings: &[(&str, &str)],
    health: &str,
    reason: Option<&str>,
) {
    let line = match reason {
        Some(r) => format!("GPU 0 {BOARD} is {health}: {r}; it gets no new workload"),
        None => format!("GPU 0 {BOARD} is healthy again"),
    };
    let had = said(node, &line);
    smi.set(settings);
    let st = status_until(rig, node, health, |st| {
        let g = &st["output"]["gpus"][0];
        g["health"] == health && g["reason"].as_str() == reason
    });
    assert_eq!(
        st["output"]["gpus"].as_array().map(Vec::len),
        Some(1),
        "{st}"
    );
    assert!(
        wait_for(REPLY, || (said(node, &line) > had).then_some(())).is_some(),
        "{line}\n{}",
        node.log()
    );
    smi.wait_queries(3);
    assert_eq!(said(node, &line), had + 1, "{line}: once\n{}", node.log());
}

#[test]
#[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
fn g15_health_follows_the_driver_switched_on_and_off_while_the_node_runs() {
    let smi = RealSmi::new(&capture("h200__590"), "load");
    let mut rig = gpu_rig(2, None);
    smi.install(&mut rig.setup);
    let node = rig.node();
    // A workload without GPUs runs throughout: the node's reaper is at work while nvidia-smi
    // fails, and no reason may depend on which of the two reaps it.
    g(1).with(json!({"gpus": 0})).ok(&rig.cp, &node);
    status_until(&rig, &node, "first", |st| {
        st["output"]["gpus"][0]["health"] == "healthy"
    });
    let before = said(&node, "GPU 0 ");

    let at = (&rig, &smi, &node);
    // The driver and its library disagree: the query fails as a whole.
    let why = "nvidia-smi failed: Failed to initialize NVML: Driver/library version mismatch / NVML library version: 535.161";
    step(
        at,
        &[("NVSMI_FAIL", "nvml-mismatch")],
        "unhealthy",
        Some(why),
    );
    assert_eq!(
        said(&node, &format!("GPU query failed: {why}")),
        1,
        "{}",
        node.log()
    );
    let st = look(&rig, &node, "mismatch");
    assert_eq!(st["output"]["gpus_error"], why, "{st}");
    // Fixed, but an ECC counter the driver cannot read; then a row remap pending: each new
    // reason is logged (once).
    let ecc = "ecc.errors.uncorrected.volatile.total";
    let set = format!("0:{ecc}=[Unknown Error]");
    let unknown = format!("{ecc} reads [Unknown Error]");
    step(at, &[("NVSMI_SET", &set)], "unhealthy", Some(&unknown));
    assert_eq!(said(&node, "GPU query answers again"), 1, "{}", node.log());
    assert!(look(&rig, &node, "ecc")["output"]
        .get("gpus_error")
        .is_none());
    let remap = "a row remap is pending (the GPU needs a reset)";
    step(
        at,
        &[("NVSMI_SET", "0:remapped_rows.pending=Yes")],
        "unhealthy",
        Some(remap),
    );
    g(2).with(json!({"gpus": 1})).reply(&rig.cp, &node);
    let r = refusal_of(&rig, 2);
    assert_eq!(
        r["error"], "Controller host is busy with unhealthy GPUs: 1 needed, 0 of 1 GPU(s) healthy",
        "{r}"
    );
    // "No data" in every health column, as driver 610 prints it for fields it dropped: healthy.
    let gone = "[Requested functionality has been deprecated]";
    let all: Vec<String> = [
        ecc,
        "retired_pages.pending",
        "remapped_rows.failure",
        "remapped_rows.pending",
    ]
    .iter()
    .map(|f| format!("0:{f}={gone}"))
    .collect();
    step(at, &[("NVSMI_SET", &all.join(";"))], "healthy", None);

    // The GPU falls off the bus: its error line on stderr, then on stdout; the same words.
    let line = "Unable to determine the device handle for GPU 0000:83:00.0: Unknown Error";
    let lost = ("NVSMI_FAIL", "lost:00000000:83:00.0");
    step(at, &[lost], "unhealthy", Some(line));
    smi.set(&[lost, ("NVSMI_LOST_STREAM", "stdout")]);
    smi.wait_queries(3);
    let failed = format!("GPU query failed: nvidia-smi failed: {line}");
    assert_eq!(said(&node, &failed), 1, "{}", node.log());
    let st = look(&rig, &node, "lost");
    assert_eq!(st["output"]["gpus"][0]["reason"], line, "{st}");
    assert_eq!(st["output"]["gpus"][0]["uuid"], BOARD, "{st}");
    step(at, &[], "healthy", None);

    // A hung driver: killed at the time limit, unhealthy, logged once; then well again.
    smi.set(&[("NVSMI_HANG", "30")]);
    let hung = "nvidia-smi did not answer within 3s";
    let st = status_until(&rig, &node, "hung", |st| st["output"]["gpus_error"] == hung);
    assert_eq!(st["output"]["gpus"][0]["reason"], hung, "{st}");
    smi.wait_queries(2);
    assert_eq!(
        said(&node, &format!("GPU query failed: {hung}")),
        1,
        "{}",
        node.log()
    );
    smi.set(&[]);
    status_until(&rig, &node, "well", |st| {
        st["output"]["gpus"][0]["health"] == "healthy"
    });
    // Every change above was logged, nothing in between: healthy, mismatch, ECC, remap,
    // healthy, lost, healthy, hung, healthy.
    let lines = said(&node, "GPU 0 ") - before;
    assert_eq!(lines, 8, "{}", node.log());
    finish(&rig, 1);
    g(1).completion(&rig.cp);
}

#[test]
#[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
fn g15_auto_never_means_zero_on_a_gpu_host() {
    // The driver down (an NVML version mismatch): a start without `gpus` is refused.
    let smi = RealSmi::new(&capture("l40s"), "idle");
    smi.set(&[("NVSMI_FAIL", "nvml-mismatch")]);
    let mut rig = gpu_rig(4, None);
    smi.install(&mut rig.setup);
    let node = rig.node();
    g(1).reply(&rig.cp, &node);
    let r = refusal_of(&rig, 1);
    assert_eq!(r["busy_reason"], "gpus_unhealthy", "{r}");
    assert_eq!(r["rejection_reason"], "host_busy", "{r}");
    assert!(
        error_of(&r).contains("Driver/library version mismatch"),
        "the driver's words: {r}"
    );
    // Only an explicit 0 runs without GPUs.
    g(2).with(json!({"gpus": 0})).ok(&rig.cp, &node);
    assert!(env_of(&rig, 2).contains(&"CUDA_VISIBLE_DEVICES=".to_string()));
    finish(&rig, 2);
    g(2).completion(&rig.cp);
    // The driver is back; one L40S and four slots: auto is one GPU, not ⌊1 ÷ 4⌋ = 0.
    smi.set(&[]);
    status_until(&rig, &node, "l40s", |st| {
        st["output"]["gpus"][0]["health"] == "healthy"
    });
    assert_eq!(g(3).reply(&rig.cp, &node)["status"], "ok", "{}", node.log());
    assert_eq!(visible(&rig, 3), BOARD);
    // The only GPU is held: the next auto start waits for it (busy), never runs GPU-less.
    g(4).reply(&rig.cp, &node);
    assert_eq!(refusal_of(&rig, 4)["busy_reason"], "gpus_busy");
    finish(&rig, 3);
    g(3).completion(&rig.cp);
}

#[test]
#[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
fn g15_a_gpu_that_falls_off_the_bus_stays_counted_unhealthy_in_the_drivers_words() {
    let words = "Unable to determine the device handle for GPU 0000:0B:00.0: Unknown Error";
    let host = TempDir::new("lost-host");
    let four = host.join("rtx2080ti-x4.capture");
    capture_of_list("open-gpu-kernel-modules-387-L.txt", &four);
    let smi = RealSmi::new(&four, "idle");
    let mut rig = gpu_rig(4, None);
    smi.install(&mut rig.setup);
    rig.setup.set("CYBERWAVE_HEARTBEAT_INTERVAL", "0.5");
    let node = rig.node();
    let st = look(&rig, &node, "st0");
    assert_eq!(
        st["output"]["gpus"].as_array().map(Vec::len),
        Some(4),
        "{st}"
    );
    // GPU 1 falls off the bus: nvidia-smi names it on stderr, exit 15, and lists the others.
    smi.set(&[("NVSMI_FAIL", "lost:00000000:0B:00.0")]);
    let st = status_until(&rig, &node, "lost", |st| {
        st["output"]["gpus"][1]["health"] == "unhealthy"
    });
    let gpus = st["output"]["gpus"].as_array().expect("gpus");
    assert_eq!(gpus.len(), 4, "never silently dropped: {st}");
    assert_eq!(gpus[1]["uuid"], "GPU-3e34e62f-d88e-f448-415e-be2cbf2c6178");
    assert_eq!(gpus[1]["reason"], words, "{st}");
    assert!(
        st["output"].get("gpus_error").is_none(),
        "the others answer: {st}"
    );
    let hb = wait_for(DONE, || {
        rig.cp
            .requests("heartbeat")
            .into_iter()
            .rev()
            .find(|r| r.body["gpus_healthy"] == 3)
    })
    .expect("a heartbeat with 3 healthy GPUs");
    assert_eq!(hb.body["gpus_total"], 4, "{}", hb.body);
    // Four can no longer be had.
    g(1).with(json!({"gpus": 4})).reply(&rig.cp, &node);
    assert_eq!(refusal_of(&rig, 1)["busy_reason"], "gpus_unhealthy");
    // doctor (which has seen nothing before) counts it from the driver's line, on stderr or
    // on stdout, at its bus id as the driver spells it.
    for stream in ["stderr", "stdout"] {
        smi.set(&[
            ("NVSMI_FAIL", "lost:00000000:0B:00.0"),
            ("NVSMI_LOST_STREAM", stream),
        ]);
        let doc = rig.setup.run(&["doctor"]);
        assert!(
            doc.stdout.contains("4 GPU(s), 3 healthy"),
            "{stream}: {}",
            doc.stdout
        );
        assert!(
            doc.stdout
                .contains(&format!("GPU at 0000:0B:00.0 is unhealthy: {words}")),
            "{stream}: {}",
            doc.stdout
        );
    }
}

#[test]
#[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
fn g15_an_h200_in_mig_mode_gives_one_instance_per_workload_billed_once() {
    let smi = RealSmi::new(&capture("h200-mig"), "load");
    let mut rig = gpu_rig(5, None);
    smi.install(&mut rig.setup);
    let metrics = rig.setup.home.join("metrics.prom");
    rig.setup
        .set("CYBERWAVE_METRICS_FILE", &metrics.display().to_string())
        .set("CYBERWAVE_NODE_METRICS_INTERVAL_SECONDS", "0.2");
    let node = rig.node();
    // The board's gauges once, marked shared; health and memory per unit.
    let text = wait_for(DONE, || {
        std::fs::read_to_string(&metrics)
            .ok()
            .filter(|t| t.contains("cyberwave_node_gpu_power_watts{"))
    })
    .expect("metrics");
    let lines = |name: &str| text.lines().filter(|l| l.starts_with(name)).count();
    assert_eq!(lines("cyberwave_node_gpu_power_watts{"), 1, "{text}");
    assert!(
        text.contains(&format!(
            "cyberwave_node_gpu_power_watts{{gpu=\"0\",uuid=\"{BOARD}\",shared=\"true\"}} 295.01"
        )),
        "{text}"
    );
    assert_eq!(lines("cyberwave_node_gpu_healthy{"), 4, "{text}");
    assert!(
        text.contains("cyberwave_node_gpu_memory_total_mib{gpu=\"0:0\",uuid=\"MIG-00000000-0000-0000-0000-000000000000\"} 71424"),
        "{text}"
    );
    let st = look(&rig, &node, "st0");
    let gpus = st["output"]["gpus"].as_array().expect("gpus");
    assert_eq!(gpus.len(), 4, "five MIG devices, four GPU instances: {st}");
    assert_eq!(gpus[0]["shared"], true);
    assert_eq!(
        gpus[0]["mig_devices"],
        json!([
            "MIG-00000000-0000-0000-0000-000000000000",
            "MIG-00000001-0000-0000-0000-000000000001"
        ])
    );
    let sizes: Vec<&Value> = gpus.iter().map(|g| &g["memory_total_mib"]).collect();
    assert_eq!(
        sizes,
        [&json!(71424), &json!(33280), &json!(16384), &json!(16384)],
        "{st}"
    );
    let mut seen = BTreeSet::new();
    for n in 1..=4 {
        assert_eq!(g(n).reply(&rig.cp, &node)["status"], "ok", "{}", node.log());
        let v = visible(&rig, n);
        assert!(
            v.starts_with("MIG-") && !v.contains(','),
            "one MIG device: {v}"
        );
        seen.insert(v);
    }
    assert_eq!(seen.len(), 4);
    assert!(
        !seen.contains("MIG-00000001-0000-0000-0000-000000000001"),
        "the second compute instance of a held GPU instance is not another GPU"
    );
    g(5).reply(&rig.cp, &node);
    assert_eq!(refusal_of(&rig, 5)["busy_reason"], "gpus_busy");
    g(6).with(json!({"gpus": 2})).reply(&rig.cp, &node);
    let r = refusal_of(&rig, 6);
    assert_eq!(r["busy_reason"], "gpus_unsatisfiable", "{r}");
    assert_eq!(r["rejection_reason"], "host_busy", "{r}");
    let st = look(&rig, &node, "held");
    assert!(holders(&st).iter().all(|(_, h)| h.is_string()), "{st}");
    smi.wait_queries(3);
    for n in 1..=4 {
        finish(&rig, n);
    }
    for n in 1..=4 {
        let done = g(n).completion(&rig.cp);
        let gpu = &done["gpu"];
        assert_eq!(gpu["count"], 1, "{done}");
        assert_eq!(gpu["shared"], true, "{done}");
        assert!(
            gpu["util_avg_pct"].is_null(),
            "the board reports none: {done}"
        );
        // The capture's processes are strangers: none is the workload's; never the board's
        // 16959 MiB.
        assert_eq!(gpu["mem_peak_mib"], 0, "{done}");
        let e = gpu["energy_wh"].as_f64().unwrap_or(0.0);
        assert!(e > 0.0 && e < 295.01 * 60.0 / 3600.0, "{done}");
    }
}

#[test]
#[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
fn g15_doctor_reads_every_real_capture_and_every_failure() {
    let mut setup = NodeSetup::bare();
    let mut caps: Vec<PathBuf> = std::fs::read_dir(real().join("captures"))
        .expect("captures")
        .flatten()
        .map(|e| e.path())
        .collect();
    caps.sort();
    assert_eq!(caps.len(), 10);
    for cap in &caps {
        for phase in ["idle", "load"] {
            let smi = RealSmi::new(cap, phase);
            smi.install(&mut setup);
            let out = setup.run(&["doctor"]);
            let n = if cap.to_string_lossy().contains("mig") {
                4
            } else {
                1
            };
            assert!(
                out.stdout.contains(&format!("{n} GPU(s), {n} healthy")),
                "{} {phase}: {}",
                cap.display(),
                out.stdout
            );
        }
    }
    let smi = RealSmi::new(&capture("h100-80gb"), "load");
    smi.install(&mut setup);
    for (settings, words) in [
        (("NVSMI_FAIL", "no-devices"), "nvidia-smi failed: No devices were found"),
        (
            ("NVSMI_FAIL", "nvml-mismatch"),
            "nvidia-smi failed: Failed to initialize NVML: Driver/library version mismatch / NVML library version: 535.161",
        ),
        (
            ("NVSMI_SET", "0:ecc.errors.uncorrected.volatile.total=[Unknown Error]"),
            "(NVIDIA H100 80GB HBM3) is unhealthy: ecc.errors.uncorrected.volatile.total reads [Unknown Error]",
        ),
        (
            ("NVSMI_SET", "0:remapped_rows.pending=Yes"),
            "is unhealthy: a row remap is pending (the GPU needs a reset)",
        ),
    ] {
        smi.set(&[settings]);
        let out = setup.run(&["doctor"]);
        assert!(out.stdout.contains(words), "{settings:?}: {}", out.stdout);
    }
}

#[test]
#[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
fn g15_the_device_check_captures_a_host_as_the_shared_captures_are_laid_out() {
    // scripts/gpu-check on a "host" whose nvidia-smi is the stand-in of the H200 in MIG mode:
    // what it captures, replayed by the same stand-in, answers as the original does.
    let original = capture("h200-mig");
    let smi = RealSmi::new(&original, "load");
    let out = TempDir::new("gpu-check-real");
    let bin = smi.dir.join("bin");
    let (_, text) = gpu_check(&bin, out.path(), &[("GPU_CHECK_NO_CUDA", "1")]);
    for check in ["inventory", "health-ecc", "health-hang", "health-recovery"] {
        assert!(text.contains(&format!("PASS  {check}")), "{check}: {text}");
    }
    let mine = out.join("capture/linux-x86_64__nvidia-h200-mig__590.48.01.txt");
    assert!(mine.is_file(), "{text}");
    let answer = |cap: &Path, phase: &str, args: &[&str]| {
        let o = std::process::Command::new(real().join("nvidia-smi"))
            .args(args)
            .env("NVSMI_CAPTURE", cap)
            .env("NVSMI_PHASE", phase)
            .output()
            .expect("stand-in");
        // (The capture masks the board's PDI, which the original left as it was.)
        let text = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| !l.trim_start().starts_with("GPU PDI"))
            .map(|l| format!("{l}\n"))
            .collect::<String>();
        (o.status.code(), text)
    };
    let node = "--query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.used,utilization.gpu,power.draw,temperature.gpu,ecc.errors.uncorrected.volatile.total,retired_pages.pending,remapped_rows.failure,remapped_rows.pending";
    let apps = "--query-compute-apps=pid,used_memory";
    for phase in ["idle", "load"] {
        for args in [
            &["-L"][..],
            &["-q"][..],
            &[node, "--format=csv,noheader,nounits"][..],
            &[apps, "--format=csv,noheader,nounits"][..],
        ] {
            let want = answer(&original, "load", args);
            assert_eq!(want.0, Some(0), "{args:?}");
            assert_eq!(answer(&mine, phase, args), want, "{phase} {args:?}");
        }
    }
    let head = std::fs::read_to_string(&mine).expect("capture");
    assert!(head.contains("\nmasked:         yes\n"), "{head}");
}
