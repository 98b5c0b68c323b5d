//! What an operator needs: drain / resume, the disk guard, the Prometheus metrics file, and
//! opt-in coarse hardware telemetry in the heartbeat.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::gpus::Gpus;
use super::parts::Life;
use super::starts::Starts;
use super::table::Table;
use crate::config::Settings;
use crate::outbox::Outbox;
use crate::workload::Layout;

/// GPU count and a coarse VRAM tier, learned once at start-up (never serials or exact sizes).
pub fn gpu_inventory() -> (usize, Option<&'static str>) {
    let count = std::fs::read_dir("/dev")
        .map(|rd| {
            rd.flatten()
                .filter(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n.strip_prefix("nvidia")
                        .is_some_and(|r| !r.is_empty() && r.chars().all(|c| c.is_ascii_digit()))
                })
                .count()
        })
        .unwrap_or(0);
    let tier = if count == 0 {
        None
    } else {
        // Killed at its timeout: a wedged driver never holds the node's start-up (D35).
        crate::gpu::run(
            &["--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            Duration::from_secs(10),
        )
        .ok()
        .and_then(|o| {
            o.stdout
                .lines()
                .filter_map(|l| l.trim().parse::<u64>().ok())
                .max()
        })
        .map(|mb| match mb {
            0..=16_383 => "<16GB",
            16_384..=32_767 => "16-32GB",
            32_768..=65_535 => "32-64GB",
            _ => ">=64GB",
        })
    };
    (count, tier)
}

/// Deletes workload log files and input images older than `days` (never those in `keep`).
/// Returns how many files went. Runs on its own short-lived thread.
pub fn prune(
    dirs: &[std::path::PathBuf],
    keep: &std::collections::BTreeSet<std::path::PathBuf>,
    days: u64,
) -> usize {
    // A retention longer than the clock reaches back: nothing is old enough.
    let Some(cutoff) =
        std::time::SystemTime::now().checked_sub(Duration::from_secs(days.saturating_mul(86_400)))
    else {
        return 0;
    };
    let mut removed = 0usize;
    for dir in dirs {
        let Ok(rd) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in rd.flatten() {
            let path = e.path();
            let Ok(md) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            let old = md.modified().map(|m| m < cutoff).unwrap_or(false);
            if md.is_file() && old && !keep.contains(&path) && std::fs::remove_file(&path).is_ok() {
                removed = removed.saturating_add(1);
            }
        }
    }
    removed
}

/// `--drain-after-one`: how long the outbox may take to empty before the node stops anyway.
pub const DRAIN_AFTER_ONE_WAIT: Duration = Duration::from_secs(10);

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// `--drain-after-one`: true once the one workload finished and was reported (then the node
/// stops).
pub(super) fn drain_after_one_done(
    s: &Settings,
    life: &mut Life,
    active: &Table,
    outbox: &Outbox,
    now: Instant,
) -> bool {
    if !s.drain_after_one
        || !life.drain.one_started
        || !active.is_empty()
        || life.shutdown.is_some()
    {
        return false;
    }
    let since = *life.drain.idle_since.get_or_insert(now);
    outbox.is_empty() || now.saturating_duration_since(since) > DRAIN_AFTER_ONE_WAIT
}

/// Opt-in coarse hardware facts for the heartbeat: no process lists, users, paths,
/// environment, serials or exact memory.
pub(super) fn hardware(s: &Settings, gpu: &Gpus) -> Option<Value> {
    if !s.hardware_telemetry {
        return None;
    }
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1) as f64;
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<f64>().ok());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib = |k: &str| {
        meminfo
            .lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
    };
    let ram = match (kib("MemTotal:"), kib("MemAvailable:")) {
        (Some(t), Some(a)) if t > 0.0 => Some(round1(1.0 - a / t)),
        _ => None,
    };
    Some(json!({
        "gpu_count": gpu.telemetry.0,
        "vram_tier": gpu.telemetry.1,
        "cpu_load_ratio": load.map(|l| round1(l / cores)),
        "ram_used_ratio": ram,
    }))
}

/// At start-up and every hour: the quarantine is held to its bounds (D67), and with log
/// retention, old workload logs and input images go.
pub(super) fn prune_old_files(
    s: &Settings,
    due: &mut Instant,
    active: &Table,
    layout: &Layout,
    now: Instant,
) {
    if now < *due {
        return;
    }
    *due = now.checked_add(Duration::from_secs(3600)).unwrap_or(now);
    crate::store::prune_quarantine_in_background(layout.state.clone());
    let days = s.log_retention_days.value;
    if days == 0 {
        return;
    }
    let keep: std::collections::BTreeSet<std::path::PathBuf> = active
        .values()
        .flat_map(|a| [a.meta.stdout_log.clone(), a.meta.stderr_log.clone()])
        .collect();
    let dirs = vec![layout.logs(), layout.inputs()];
    let spawned = std::thread::Builder::new()
        .name("prune".into())
        .spawn(move || {
            let n = prune(&dirs, &keep, days);
            if n > 0 {
                log::info!("log retention: removed {n} file(s) older than {days} day(s)");
            }
        });
    if let Err(e) = spawned {
        log::warn!("log retention skipped: {e}");
    }
}

/// Writes the metrics file (atomically) when one is configured.
// Each argument is one thing the file reports; a struct of them would only rename them.
#[allow(clippy::too_many_arguments)]
pub(super) fn write_metrics(
    s: &Settings,
    due: &mut Instant,
    now: Instant,
    life: &Life,
    queued: usize,
    active: &Table,
    starts: &Starts,
    gpu: &Gpus,
) {
    let Some(path) = s.metrics_file.as_ref().map(|m| m.value.clone()) else {
        return;
    };
    if now < *due {
        return;
    }
    *due = crate::util::later(now, s.tuning.metrics_interval);
    let m = &life.metrics;
    let queued = queued as u64;
    let mut t = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, rows: Vec<(String, u64)>| {
        let _ = writeln!(
            t,
            "# HELP cyberwave_node_{name} {help}\n# TYPE cyberwave_node_{name} {kind}"
        );
        for (labels, v) in rows {
            let _ = writeln!(t, "cyberwave_node_{name}{labels} {v}");
        }
    };
    let mut states: BTreeMap<&str, u64> = ["running", "cancelling", "finishing", "finalizing"]
        .iter()
        .map(|s| (*s, 0))
        .collect();
    for a in active.values() {
        let n = states.entry(a.state()).or_default();
        *n = n.saturating_add(1);
    }
    metric(
        "workloads",
        "gauge",
        "Workloads by state.",
        states
            .into_iter()
            .map(|(k, v)| (format!("{{state=\"{k}\"}}"), v))
            .collect(),
    );
    metric(
        "starts_total",
        "counter",
        "Workloads started.",
        vec![(String::new(), m.starts)],
    );
    metric(
        "rejections_total",
        "counter",
        "Starts refused, by reason.",
        m.rejections
            .iter()
            .map(|(k, v)| (format!("{{reason=\"{k}\"}}"), *v))
            .collect(),
    );
    metric(
        "completions_total",
        "counter",
        "Workloads ended, by outcome.",
        m.completions
            .iter()
            .map(|(k, v)| (format!("{{outcome=\"{k}\"}}"), *v))
            .collect(),
    );
    metric(
        "reconnects_total",
        "counter",
        "MQTT reconnections after the first connection.",
        vec![(String::new(), m.reconnects)],
    );
    metric(
        "heartbeat_failures_total",
        "counter",
        "Heartbeats not acknowledged.",
        vec![(String::new(), m.heartbeat_failures)],
    );
    metric(
        "outbox_depth",
        "gauge",
        "Completions and events waiting for acknowledgement.",
        vec![(String::new(), queued)],
    );
    metric(
        "log_bytes_streamed_total",
        "counter",
        "Workload log bytes acknowledged by the backend.",
        vec![(String::new(), m.log_bytes)],
    );
    metric(
        "draining",
        "gauge",
        "1 while the node refuses new workloads.",
        vec![(String::new(), u64::from(life.drain.on))],
    );
    gpu.metrics(&super::workloads::holds_of(active, starts), &mut t);
    if let Err(e) = crate::store::write_atomic(&path, t.as_bytes(), 0o644) {
        log::warn!("cannot write the metrics file {}: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_retention_beyond_the_clock_prunes_nothing_and_does_not_panic() {
        let dir = std::env::temp_dir().join(format!("cw-prune-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("old.log"), "x").unwrap();
        let keep = std::collections::BTreeSet::new();
        assert_eq!(super::prune(std::slice::from_ref(&dir), &keep, u64::MAX), 0);
        assert_eq!(super::prune(std::slice::from_ref(&dir), &keep, 1 << 40), 0);
        assert!(dir.join("old.log").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
