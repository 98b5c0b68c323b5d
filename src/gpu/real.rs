//! Tests only: the real `nvidia-smi` captures of the shared folder (`../shared/fixtures/gpu/real`,
//! or `CW_SHARED_DIR`, found by build.rs) replayed through their stand-in, which projects a
//! capture onto whatever fields are asked, refuses a field its driver does not know, and plays
//! the failures of a broken driver (`NVSMI_FAIL`, `NVSMI_SET`). A build without them lists the
//! tests that need them as ignored (`no_gpu_captures`); run there with `--include-ignored`,
//! they fail, saying what is missing.

use std::path::{Path, PathBuf};

use super::{Output, RunError};

/// The folder of the captures and the stand-in.
pub fn dir() -> PathBuf {
    let Some(d) = option_env!("CW_GPU_REAL") else {
        panic!(
            "the real nvidia-smi captures are not here: this build found no \
             fixtures/gpu/real in ../shared (set CW_SHARED_DIR to the shared folder and build again)"
        );
    };
    let d = PathBuf::from(d);
    assert!(
        d.join("nvidia-smi").is_file(),
        "{} has no nvidia-smi stand-in",
        d.display()
    );
    d
}

/// The files of one folder of [`dir`], sorted.
fn files(sub: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir().join(sub))
        .unwrap_or_else(|e| panic!("{sub}: {e}"))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    out.sort();
    out
}

/// Every whole-machine capture (ten).
pub fn captures() -> Vec<PathBuf> {
    let c = files("captures");
    assert_eq!(c.len(), 10, "{c:?}");
    c
}

/// Every `-L` listing of a multi-GPU or MIG host (five).
pub fn lists() -> Vec<PathBuf> {
    let l = files("lists");
    assert_eq!(l.len(), 5, "{l:?}");
    l
}

/// One capture by a part of its name.
pub fn capture(part: &str) -> PathBuf {
    let all: Vec<PathBuf> = captures()
        .into_iter()
        .filter(|p| p.to_string_lossy().contains(part))
        .collect();
    assert_eq!(all.len(), 1, "{part}: {all:?}");
    all.into_iter().next().unwrap_or_default()
}

/// The stand-in answering from `capture` in `phase`, with these `NVSMI_*` settings.
pub struct Standin {
    pub env: Vec<(String, String)>,
}

impl Standin {
    pub fn new(capture: &Path, phase: &str) -> Standin {
        Standin {
            env: vec![
                ("NVSMI_CAPTURE".into(), capture.display().to_string()),
                ("NVSMI_PHASE".into(), phase.into()),
            ],
        }
    }

    pub fn with(mut self, k: &str, v: &str) -> Standin {
        self.env.push((k.into(), v.into()));
        self
    }

    /// One call: what it printed and its exit code, as the node's runner returns it.
    pub fn call(&self, args: &[&str]) -> Result<Output, RunError> {
        let o = std::process::Command::new(dir().join("nvidia-smi"))
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap_or_else(|e| panic!("the stand-in did not run: {e}"));
        Ok(Output {
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
            code: o.status.code(),
        })
    }

    /// The stand-in's `-L`.
    pub fn list(&self) -> String {
        self.call(&["-L"]).map(|o| o.stdout).unwrap_or_default()
    }
}

/// The sections of a capture file: (name, the two header lines, body).
fn sections(text: &str) -> Vec<(String, Vec<String>, Vec<String>)> {
    let lines: Vec<&str> = text.lines().collect();
    let rule = |l: &str| l.starts_with(&"#".repeat(20));
    let mut out: Vec<(String, Vec<String>, Vec<String>)> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i];
        if rule(l) && lines.get(i + 1).is_some_and(|n| n.contains(" :: ")) {
            let mut head = vec![lines[i + 1].to_string()];
            i += 2;
            while i < lines.len() && !rule(lines[i]) {
                head.push(lines[i].to_string());
                i += 1;
            }
            let name = head[0].trim_start_matches("# ").to_string();
            out.push((name, head, Vec::new()));
        } else if let Some(last) = out.last_mut() {
            last.2.push(l.to_string());
        }
        i += 1;
    }
    out
}

/// A capture of the host a `-L` listing shows, for the stand-in: the listing verbatim; one
/// query row per GPU, its index, UUID and name from the listing and the rest of a real board's
/// row (`base`'s, an H100 for data-centre boards, a GeForce for the others); bus ids
/// `00000000:07:00.0`, `…:0B:…`, `…:0F:…` and on (so the GPU that fell off the bus on the host
/// of `lists/open-gpu-kernel-modules-387-L.txt`, at `0B`, is the second). No `-q` (MIG sizes
/// stay unknown).
pub fn capture_of_list(list: &Path, to: &Path) {
    let listing = std::fs::read_to_string(list).unwrap_or_else(|e| panic!("{e}"));
    let base = if listing.contains("A100") {
        capture("h100-80gb")
    } else {
        capture("rtx-2080-super__595")
    };
    let text = std::fs::read_to_string(&base).unwrap_or_else(|e| panic!("{e}"));
    let rule = "#".repeat(80);
    let mut out = String::new();
    for (name, head, body) in sections(&text) {
        let body: Vec<String> = if name.starts_with("capabilities :: list") {
            listing.lines().map(String::from).collect()
        } else if name.ends_with(":: query-gpu (csv, what the exporter parses)") {
            rows_for(&listing, &body)
        } else if name.contains(":: query-compute-apps") || name.starts_with("capabilities") {
            body.into_iter().take(1).collect()
        } else {
            continue;
        };
        out.push_str(&format!("{rule}\n{}\n{rule}\n", head.join("\n")));
        for l in body {
            out.push_str(&l);
            out.push('\n');
        }
        out.push_str("\n\n");
    }
    std::fs::write(to, out).unwrap_or_else(|e| panic!("{e}"));
}

/// The query table of [`capture_of_list`]: `base`'s header, one row per `GPU i:` line.
fn rows_for(listing: &str, base: &[String]) -> Vec<String> {
    let head = &base[0];
    let cols: Vec<&str> = head.split(", ").collect();
    let at = |name: &str| {
        cols.iter()
            .position(|c| c.split(' ').next() == Some(name))
            .unwrap_or_else(|| panic!("{name} not in the base capture"))
    };
    let (index, uuid, name, bus) = (at("index"), at("uuid"), at("name"), at("pci.bus_id"));
    let row: Vec<String> = base[1].split(", ").map(String::from).collect();
    let mut out = vec![head.clone()];
    for l in listing.lines().filter(|l| l.starts_with("GPU ")) {
        let (i, rest) = l["GPU ".len()..].split_once(": ").expect("GPU i: …");
        let (n, u) = rest.rsplit_once(" (UUID: ").expect("(UUID: …)");
        let i: u32 = i.parse().expect("index");
        let mut r = row.clone();
        r[index] = i.to_string();
        r[uuid] = u.trim_end_matches(')').to_string();
        r[name] = n.to_string();
        r[bus] = format!("00000000:{:02X}:00.0", 7 + 4 * i);
        out.push(r.join(", "));
    }
    out
}

/// The units a `-L` listing shows, as the node must see them: each whole GPU its UUID alone;
/// a MIG GPU's devices grouped by GPU instance, taken from `gi` (device index → GPU instance
/// id, read from `-q`), else from the GPU instance in an old-style `MIG-GPU-…/GI/CI` UUID, else
/// one device a unit.
pub fn units_listed(listing: &str, gi: &[(u32, u32)]) -> Vec<Vec<String>> {
    let uuid = |l: &str| {
        l.rsplit_once("(UUID: ")
            .map(|(_, u)| u.trim_end_matches(')').to_string())
            .expect("a UUID")
    };
    let mut out: Vec<Vec<String>> = Vec::new();
    // Per GPU: (its UUID, its MIG devices as (device index, UUID)).
    let mut gpus: Vec<(String, Vec<(u32, String)>)> = Vec::new();
    for l in listing.lines() {
        if l.starts_with("GPU ") {
            gpus.push((uuid(l), Vec::new()));
        } else if l.trim_start().starts_with("MIG ") {
            let dev = l
                .split_once("Device")
                .and_then(|(_, d)| d.split(':').next())
                .and_then(|d| d.trim().parse().ok())
                .expect("Device N");
            gpus.last_mut().expect("a GPU first").1.push((dev, uuid(l)));
        }
    }
    for (g, migs) in gpus {
        if migs.is_empty() {
            out.push(vec![g]);
            continue;
        }
        let mut groups: Vec<(String, Vec<String>)> = Vec::new();
        for (dev, u) in migs {
            let key = gi
                .iter()
                .find(|(d, _)| *d == dev)
                .map(|(_, g)| g.to_string())
                .or_else(|| {
                    u.strip_prefix("MIG-GPU-")
                        .and_then(|r| r.split('/').nth(1).map(String::from))
                })
                .unwrap_or_else(|| u.clone());
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, m)) => m.push(u),
                None => groups.push((key, vec![u])),
            }
        }
        out.extend(groups.into_iter().map(|(_, m)| m));
    }
    out
}

/// `-q`'s MIG devices: (device index, GPU instance id), in order (one GPU per capture).
pub fn gpu_instances_in(q: &str) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    let mut index = None;
    for l in q.lines() {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        match k.trim() {
            "Index" => index = v.trim().parse::<u32>().ok(),
            "GPU Instance ID" => {
                if let (Some(i), Ok(g)) = (index.take(), v.trim().parse::<u32>()) {
                    out.push((i, g));
                }
            }
            _ => {}
        }
    }
    out
}

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::{judge, query_with, Gpu, Health, Known, Snapshot, Usage};

/// One look through the stand-in, as the monitor takes it at an inventory: the units, the
/// per-process memory, the error.
fn look(s: &Standin, known: &mut Known) -> (Vec<Gpu>, BTreeMap<i32, u64>, Option<String>) {
    let (gpus, apps, _, error) = look_apps(s, known);
    (gpus, apps, error)
}

/// [`look`], with the GPUs of each process (D59: what a service uses).
#[allow(clippy::type_complexity)]
fn look_apps(
    s: &Standin,
    known: &mut Known,
) -> (
    Vec<Gpu>,
    BTreeMap<i32, u64>,
    BTreeMap<i32, Vec<String>>,
    Option<String>,
) {
    let mut smi = |a: &[&str]| s.call(a);
    match query_with(&mut smi, Duration::from_secs(10), known, true) {
        Snapshot::Gpus {
            gpus,
            apps,
            app_gpus,
            error,
            ..
        } => (gpus, apps, app_gpus, error),
        Snapshot::Absent => panic!("the stand-in was not found"),
    }
}

/// The units as `(members)` lists, a whole GPU as its UUID alone.
fn shape(gpus: &[Gpu]) -> Vec<Vec<String>> {
    gpus.iter()
        .map(|u| {
            if u.members.is_empty() {
                vec![u.uuid.clone()]
            } else {
                u.members.clone()
            }
        })
        .collect()
}

fn name_of(p: &Path) -> String {
    p.file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned()
}

/// The memory of each GPU instance profile of the MIG captures, as their `-q` gives it.
const MIG_MIB: [(&str, u64); 6] = [
    ("3g.71gb", 71424),
    ("2g.35gb", 33280),
    ("1g.18gb", 16384),
    ("3g.40gb", 40448),
    ("2g.20gb", 20096),
    ("1g.10gb", 9984),
];

#[test]
#[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
fn guarantee_15_every_real_capture_reads_as_its_driver_said() {
    std::thread::scope(|scope| {
        for cap in captures() {
            for phase in ["idle", "load"] {
                let cap = cap.clone();
                scope.spawn(move || one_capture(&cap, phase));
            }
        }
    });
}

/// [`guarantee_15_every_real_capture_reads_as_its_driver_said`] for one capture and phase.
fn one_capture(cap: &Path, phase: &str) {
    let case = format!("{} {phase}", name_of(cap));
    let s = Standin::new(cap, phase);
    let listing = s.list();
    let q = s.call(&["-q"]).map(|o| o.stdout).unwrap_or_default();
    let want = units_listed(&listing, &gpu_instances_in(&q));
    let (gpus, apps, app_gpus, error) = look_apps(&s, &mut Known::default());
    assert_eq!(error, None, "{case}");
    // The inventory is `-L`'s: MIG devices as units, compute instances of one GPU instance
    // (by `-q`'s GPU instance id) as one.
    assert_eq!(shape(&gpus), want, "{case}");
    let row = s
        .call(&[
            "--query-gpu=uuid,name,memory.total,utilization.gpu",
            "--format=csv,noheader,nounits",
        ])
        .map(|o| o.stdout)
        .unwrap_or_default();
    let cols: Vec<&str> = row.trim().split(", ").collect();
    let (board, name, total, util) = (cols[0], cols[1], cols[2], cols[3]);
    let mig = gpus.iter().any(|u| u.parent.is_some());
    for u in &gpus {
        assert_eq!(u.health, Health::Healthy, "{case}: {u:?}");
        assert!(u.power_w.is_some_and(|p| p > 10.0), "{case}: {u:?}");
        if !mig {
            assert!(
                listing.contains(&format!("GPU 0: {name} (UUID: {board})")),
                "{case}"
            );
            assert_eq!((u.uuid.as_str(), u.name.as_str()), (board, name), "{case}");
            assert_eq!(u.memory_total_mib, total.parse().ok(), "{case}");
            assert_eq!(u.util_pct, util.parse().ok(), "{case}");
            assert!(!u.shared, "{case}");
            continue;
        }
        // A MIG unit: its GPU instance's memory, no utilisation of its own (the board
        // reports none), shared when the board has other instances.
        let profile = u.name.rsplit(' ').next().unwrap_or_default();
        assert_eq!(u.name, format!("{name} MIG {profile}"), "{case}");
        let mib = MIG_MIB.iter().find(|(p, _)| *p == profile).map(|(_, m)| *m);
        assert_eq!(u.memory_total_mib, mib, "{case}: {profile}");
        assert_eq!(u.parent.as_deref(), Some(board), "{case}");
        assert_eq!(u.util_pct, None, "{case}");
        assert_eq!(u.shared, want.len() > 1, "{case}");
    }
    // Per-process memory: each process the driver gives a figure for (none on Windows/WDDM).
    let listed = s
        .call(&[
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ])
        .map(|o| o.stdout)
        .unwrap_or_default();
    let with_memory = listed
        .lines()
        .filter(|l| {
            l.split(", ")
                .nth(1)
                .is_some_and(|m| m.parse::<u64>().is_ok())
        })
        .count();
    assert_eq!(apps.len(), with_memory, "{case}: {apps:?}");
    // D59: each listed process's GPU, as the driver names it: the board, or one of its units.
    let known: Vec<&str> = gpus
        .iter()
        .flat_map(|u| {
            std::iter::once(u.uuid.as_str())
                .chain(u.parent.as_deref())
                .chain(u.members.iter().map(String::as_str))
        })
        .collect();
    let named = s
        .call(&[
            "--query-compute-apps=pid,gpu_uuid",
            "--format=csv,noheader,nounits",
        ])
        .map(|o| o.stdout)
        .unwrap_or_default();
    for line in named.lines() {
        let (Some(pid), Some(uuid)) = (line.split(", ").next(), line.split(", ").nth(1)) else {
            continue;
        };
        let Ok(pid) = pid.parse::<i32>() else {
            continue;
        };
        let got = app_gpus.get(&pid).cloned().unwrap_or_default();
        assert!(
            got.iter().any(|g| g == uuid),
            "{case}: {pid} on {uuid}: {app_gpus:?}"
        );
        assert!(known.contains(&uuid), "{case}: {uuid} is none of {known:?}");
    }
    if case.starts_with("windows") {
        assert!(apps.is_empty() && listed.lines().count() > 0, "{case}");
    }
}

#[test]
#[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
fn guarantee_15_every_listing_of_a_multi_gpu_or_mig_host_reads_as_listed() {
    let tmp = crate::scratch::Scratch::new("gpu-lists");
    for list in lists() {
        let case = name_of(&list);
        let cap = tmp.join(format!("{case}.capture"));
        capture_of_list(&list, &cap);
        let s = Standin::new(&cap, "idle");
        let listing = s.list();
        assert_eq!(
            listing.trim_end(),
            std::fs::read_to_string(&list)
                .unwrap_or_default()
                .trim_end(),
            "{case}: the stand-in lists the host verbatim"
        );
        let (gpus, _, error) = look(&s, &mut Known::default());
        assert_eq!(error, None, "{case}");
        assert_eq!(shape(&gpus), units_listed(&listing, &[]), "{case}");
        assert!(gpus.iter().all(|u| u.health.is_healthy()), "{case}");
        // A board split in several instances shares its readings; none is one of its own.
        for u in gpus.iter().filter(|u| u.parent.is_some()) {
            assert!(u.shared, "{case}: {u:?}");
            assert_eq!(u.memory_total_mib, None, "{case}: no -q, no size");
        }
    }
}

/// The four health columns of the node's query.
const HEALTH_FIELDS: [&str; 4] = [
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.failure",
    "remapped_rows.pending",
];

#[test]
#[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
fn guarantee_15_no_data_values_are_not_faults_and_error_values_are() {
    // The health of GPU 0 with these fields set to these values.
    let health = |cap: &Path, set: &[(&str, &str)]| {
        let set: Vec<String> = set.iter().map(|(f, v)| format!("0:{f}={v}")).collect();
        let s = Standin::new(cap, "load").with("NVSMI_SET", &set.join(";"));
        let out = s.call(&[
            &format!("--query-gpu={}", super::QUERY_FIELDS),
            "--format=csv,noheader,nounits",
        ]);
        let (gpus, e) = judge(&out.unwrap_or_default(), &mut BTreeMap::new());
        assert_eq!((gpus.len(), e), (1, None), "{}: {set:?}", name_of(cap));
        gpus[0].health.clone()
    };
    std::thread::scope(|scope| {
        // Every board: "no data" in all four health columns at once is healthy.
        for cap in captures() {
            scope.spawn(move || {
                for value in [
                    "[Requested functionality has been deprecated]",
                    "[Not Supported]",
                    "[N/A]",
                ] {
                    let all: Vec<(&str, &str)> =
                        HEALTH_FIELDS.iter().map(|f| (*f, value)).collect();
                    assert_eq!(
                        health(&cap, &all),
                        Health::Healthy,
                        "{}: {value}",
                        name_of(&cap)
                    );
                }
            });
        }
        // A data-centre board, a MIG board and a GeForce on driver 610: an error value in any
        // one health column makes the GPU unhealthy, in the driver's words.
        for part in [
            "h100-80gb",
            "h200-mig",
            "linux-x86_64__nvidia-geforce-rtx-2080-super__610",
        ] {
            scope.spawn(move || {
                let cap = capture(part);
                for field in HEALTH_FIELDS {
                    for value in ["[Unknown Error]", "[GPU requires reset]"] {
                        assert_eq!(
                            health(&cap, &[(field, value)]),
                            Health::Unhealthy(format!("{field} reads {value}")),
                            "{part}"
                        );
                    }
                }
            });
        }
    });
    // A pending row remap (the H200 under load): unhealthy until the GPU is reset.
    let s = Standin::new(&capture("h200__590"), "load")
        .with("NVSMI_SET", "0:remapped_rows.pending=Yes");
    let (gpus, _, _) = look(&s, &mut Known::default());
    assert_eq!(
        gpus[0].health,
        Health::Unhealthy("a row remap is pending (the GPU needs a reset)".into())
    );
}

#[test]
#[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
fn guarantee_15_a_driver_failing_as_a_whole_reads_the_same_at_every_look() {
    let cap = capture("h200-mig");
    for (fail, words) in [
        ("no-devices", "nvidia-smi failed: No devices were found"),
        (
            "nvml-mismatch",
            "nvidia-smi failed: Failed to initialize NVML: Driver/library version mismatch / NVML library version: 535.161",
        ),
    ] {
        let s = Standin::new(&cap, "load").with("NVSMI_FAIL", fail);
        // The very first look: no GPU known, the reason is the driver's words.
        let (gpus, _, e) = look(&s, &mut Known::default());
        assert_eq!((gpus.len(), e.as_deref()), (0, Some(words)), "{fail}");
        // The same words whether or not the exit code could be had (the reaper may take it).
        let out = s.call(&["--query-gpu=index", "--format=csv,noheader,nounits"]);
        let out = out.unwrap_or_default();
        assert!(out.code.is_some_and(|c| c != 0), "{fail}: {out:?}");
        let without = super::Output { code: None, ..out.clone() };
        assert_eq!(judge(&out, &mut BTreeMap::new()).1.as_deref(), Some(words));
        assert_eq!(judge(&without, &mut BTreeMap::new()).1.as_deref(), Some(words));
        // Once the GPUs were seen: every unit stays, unhealthy in those words.
        let mut known = Known::default();
        let (before, _, _) = look(&Standin::new(&cap, "load"), &mut known);
        let (after, _, e) = look(&s, &mut known);
        assert_eq!(e.as_deref(), Some(words), "{fail}");
        assert_eq!(shape(&after), shape(&before), "{fail}");
        assert!(after.iter().all(|u| u.health == Health::Unhealthy(words.into())), "{fail}");
        assert!(after.iter().all(|u| u.memory_total_mib.is_some()), "{fail}: sizes kept");
    }
}

#[test]
#[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
fn guarantee_15_a_gpu_that_falls_off_the_bus_stays_counted_in_the_drivers_words() {
    let tmp = crate::scratch::Scratch::new("gpu-lost");
    let four = tmp.join("rtx2080ti-x4.capture");
    capture_of_list(
        &dir().join("lists/open-gpu-kernel-modules-387-L.txt"),
        &four,
    );
    let words = "Unable to determine the device handle for GPU 0000:0B:00.0: Unknown Error";
    for stream in ["stderr", "stdout"] {
        let lost = Standin::new(&four, "idle")
            .with("NVSMI_FAIL", "lost:00000000:0B:00.0")
            .with("NVSMI_LOST_STREAM", stream);
        let mut known = Known::default();
        let (all, _, _) = look(&Standin::new(&four, "idle"), &mut known);
        assert_eq!(all.len(), 4);
        let (now, _, e) = look(&lost, &mut known);
        assert_eq!(e, None, "{stream}: the other three still answer");
        assert_eq!(shape(&now), shape(&all), "{stream}: never dropped");
        assert_eq!(now.iter().filter(|g| g.health.is_healthy()).count(), 3);
        assert_eq!(now[1].health, Health::Unhealthy(words.into()), "{stream}");
        assert_eq!(now[1].power_w, None);
        // Never seen before (doctor, a node started after the fall): counted from the line,
        // at the bus id as the driver spells it.
        let (fresh, _, _) = look(&lost, &mut Known::default());
        assert_eq!(fresh.len(), 4, "{stream}: {fresh:?}");
        assert_eq!(fresh[3].bus_id, "0000:0B:00.0", "{stream}");
        assert_eq!(fresh[3].health, Health::Unhealthy(words.into()));
        assert!(fresh[3].uuid.is_empty(), "never assignable");
    }
    // A one-GPU host whose only GPU falls off: the query fails as a whole; the GPU stays,
    // unhealthy in the line that names it.
    let h200 = capture("h200__590");
    let line = "Unable to determine the device handle for GPU 0000:83:00.0: Unknown Error";
    for stream in ["stderr", "stdout"] {
        let lost = Standin::new(&h200, "load")
            .with("NVSMI_FAIL", "lost:00000000:83:00.0")
            .with("NVSMI_LOST_STREAM", stream);
        let mut known = Known::default();
        look(&Standin::new(&h200, "load"), &mut known);
        let (now, _, e) = look(&lost, &mut known);
        assert_eq!(e, Some(format!("nvidia-smi failed: {line}")), "{stream}");
        assert_eq!(now.len(), 1);
        assert_eq!(now[0].health, Health::Unhealthy(line.into()), "{stream}");
        assert_eq!(now[0].bus_id, "00000000:83:00.0");
        let (fresh, _, _) = look(&lost, &mut Known::default());
        assert_eq!(fresh.len(), 1, "{stream}");
        assert_eq!(
            fresh[0].bus_id, "0000:83:00.0",
            "{stream}: the driver's spelling"
        );
    }
}

#[test]
#[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
fn guarantee_15_a_slice_is_never_billed_the_board_and_a_board_is_counted_once() {
    let s = Standin::new(&capture("h200-mig"), "load");
    let (u, _, _) = look(&s, &mut Known::default());
    let t0 = Instant::now();
    let cap = Duration::from_secs(10);
    let mut one = Usage::default();
    one.add(&[&u[0]], None, t0, cap);
    one.add(&[&u[0]], Some(3072), t0 + Duration::from_secs(10), cap);
    assert!(one.shared);
    assert_eq!(
        one.mem_peak_mib(),
        3072,
        "its own processes, not the board's 16959"
    );
    assert_eq!(one.util_avg(), None, "the board reports none in MIG mode");
    let board = 295.01 * 10.0 / 3600.0;
    assert!((one.energy_wh - board).abs() < 1e-9, "{}", one.energy_wh);
    // Two slices of one board (never handed out together, but were the record to say so):
    // the board once.
    let mut two = Usage::default();
    two.add(&[&u[0], &u[1]], None, t0, cap);
    two.add(&[&u[0], &u[1]], None, t0 + Duration::from_secs(10), cap);
    assert!((two.energy_wh - board).abs() < 1e-9, "{}", two.energy_wh);
    assert_eq!(
        two.mem_peak_mib(),
        0,
        "never the board's memory for a slice"
    );
    // A board with one GPU instance: its readings are that instance's alone.
    let mut only = u[0].clone();
    only.shared = false;
    let mut whole = Usage::default();
    whole.add(&[&only], None, t0, cap);
    assert!(!whole.shared);
}
