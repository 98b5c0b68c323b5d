//! The node's side of GPUs: the inventory the monitor thread reports (D35), exclusive
//! assignment (D36), the health gate (D37) and per-workload accounting (D38). Which workload
//! holds which GPU is not kept here: it is each active workload's persisted record, so an
//! assignment survives a restart and is released when the workload is forgotten.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{json, Value};

use super::parts::{Busy, BUSY_PREFIX};
use crate::gpu::{Gpu, Health, Snapshot, Usage};

/// What the node knows about its GPUs.
#[derive(Default)]
pub struct Gpus {
    /// `nvidia-smi` answered (the node schedules GPUs); false: a CPU-only node.
    pub present: bool,
    pub units: Vec<Gpu>,
    /// Why the last query failed, when it did.
    pub error: Option<String>,
    /// `cloud_node.gpus_per_workload` (D36).
    pub per_workload: Option<u32>,
    /// Accounting of workloads holding GPUs, by safe id.
    pub usage: HashMap<String, Usage>,
    /// GPU count and VRAM tier (hardware telemetry), learned at start-up.
    pub telemetry: (usize, Option<&'static str>),
    /// GPUs a service uses (D59): a start gets others first, and is never refused for them.
    pub avoid: std::collections::BTreeSet<String>,
}

impl Gpus {
    /// From the first snapshot (taken before the loop starts).
    pub fn new(
        first: Option<Snapshot>,
        env: &crate::config::env::EnvLayers,
        manifest: Option<u32>,
    ) -> Gpus {
        // `cloud_node.gpus_per_workload` from cyberwave.yml first; the variable is its fallback.
        let per_workload = manifest.or_else(|| env.value("CYBERWAVE_GPUS_PER_WORKLOAD").and_then(|v| {
            let n = v
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|n| u64::from(*n) <= crate::protocol::commands::MAX_GPUS);
            if n.is_none() && v.trim() != "auto" {
                log::warn!(
                    "CYBERWAVE_GPUS_PER_WORKLOAD={:?} is not a whole number from 0 to {} or \"auto\"; using auto",
                    crate::logtext::shown(&v),
                    crate::protocol::commands::MAX_GPUS
                );
            }
            n
        }));
        let mut g = Gpus {
            per_workload,
            ..Gpus::default()
        };
        if let Some(s) = first {
            g.apply(s);
        }
        match (g.present, &g.error) {
            (false, _) => log::info!("no nvidia-smi: a CPU-only node"),
            // Logged by `apply`.
            (true, Some(_)) => {}
            (true, None) => log::info!(
                "GPUs: {} ({} healthy){}",
                g.units.len(),
                g.healthy(),
                g.units
                    .iter()
                    .map(|u| format!("; {} {} {} {}", u.index, u.uuid, u.name, u.health.label()))
                    .collect::<String>()
            ),
        }
        g
    }

    /// Takes a snapshot in; logs each change: a GPU's health or its reason (one unhealthy
    /// reason giving way to another is a change too), the query failing or answering again.
    /// Nothing is logged again while it stays the same.
    fn apply(&mut self, s: Snapshot) {
        let Snapshot::Gpus { gpus, error, .. } = s else {
            self.present = false;
            self.units.clear();
            self.error = None;
            return;
        };
        if error != self.error {
            match (&error, &self.error) {
                (Some(e), _) => log::warn!("GPU query failed: {e}"),
                (None, Some(_)) => log::info!("GPU query answers again"),
                (None, None) => {}
            }
        }
        let before: BTreeMap<String, &Health> = self
            .units
            .iter()
            .map(|u| (unit_key(u), &u.health))
            .collect();
        for u in &gpus {
            let was = before.get(&unit_key(u)).copied();
            if was == Some(&u.health) || (was.is_none() && u.health.is_healthy()) {
                continue;
            }
            let name = if u.uuid.is_empty() {
                format!("at {}", u.bus_id)
            } else {
                format!("{} {}", u.index, u.uuid)
            };
            match u.health.reason() {
                None => log::info!("GPU {name} is healthy again"),
                Some(r) => log::warn!(
                    "GPU {name} is {}: {r}; it gets no new workload",
                    u.health.label()
                ),
            }
        }
        self.present = true;
        self.units = gpus;
        self.error = error;
    }

    pub fn healthy(&self) -> usize {
        self.units.iter().filter(|u| u.health.is_healthy()).count()
    }

    /// The GPUs a new workload gets (D36, D55, D56): `Ok(None)` on a CPU-only node (nothing
    /// changes for it), else its exclusive share of what `held` does not hold, or the refusal
    /// (busy when waiting can help). On a GPU host `auto` is never zero, and a MIG host gives a
    /// workload at most one MIG device: more than one GPU comes from whole GPUs only.
    pub fn assign(
        &self,
        requested: Option<u32>,
        capacity: usize,
        held: &Holders,
    ) -> Result<Option<Vec<String>>, GpuRefusal> {
        if !self.present {
            return match requested.filter(|n| *n > 0) {
                Some(n) => Err(GpuRefusal::NoGpus(n)),
                None => Ok(None),
            };
        }
        let mig_host = self.units.iter().any(|u| u.parent.is_some());
        let capacity = capacity.max(1);
        let explicit = requested.or(self.per_workload);
        let need = match explicit {
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None if mig_host => 1,
            None if capacity == 1 => self.healthy().max(1),
            None => self.healthy().checked_div(capacity).unwrap_or(0).max(1),
        };
        if need == 0 {
            return Ok(Some(Vec::new()));
        }
        // More than one: whole GPUs only on a MIG host (a CUDA process sees one MIG device).
        let pool: Vec<&Gpu> = self
            .units
            .iter()
            .filter(|u| need == 1 || u.parent.is_none())
            .collect();
        let total = pool.len();
        let healthy = pool.iter().filter(|u| u.health.is_healthy()).count();
        let unhealthy = || GpuRefusal::Unhealthy {
            need,
            healthy,
            total,
            // The query fails: this node's GPUs are not known, not absent.
            why: self.error.clone(),
        };
        if need > total {
            return Err(if self.error.is_some() || explicit.is_none() {
                unhealthy()
            } else if mig_host && need > 1 {
                GpuRefusal::Unsatisfiable { need, total }
            } else {
                GpuRefusal::TooFew { need, total }
            });
        }
        // D59: GPUs no service uses first (a stable sort keeps the inventory's order).
        let mut candidates: Vec<&&Gpu> = pool
            .iter()
            .filter(|u| u.health.is_healthy() && !is_held(u, held))
            .collect();
        candidates.sort_by_key(|u| self.used_by_service(u));
        let free: Vec<String> = candidates
            .into_iter()
            .map(|u| u.uuid.clone())
            .take(need)
            .collect();
        if free.len() >= need {
            return Ok(Some(free));
        }
        Err(if healthy >= need {
            GpuRefusal::InUse {
                need,
                free: free.len(),
                healthy,
            }
        } else {
            unhealthy()
        })
    }
}

impl Gpus {
    /// A service has a compute context on this unit, or on its physical GPU.
    fn used_by_service(&self, u: &Gpu) -> bool {
        self.avoid.contains(&u.uuid)
            || u.members.iter().any(|m| self.avoid.contains(m))
            || u.parent.as_ref().is_some_and(|p| self.avoid.contains(p))
    }
}

/// What a unit is known by from one snapshot to the next: its UUID, or for a GPU known only
/// from an error line its bus id.
fn unit_key(u: &Gpu) -> String {
    if u.uuid.is_empty() {
        format!("bus {}", u.bus_id)
    } else {
        u.uuid.clone()
    }
}

/// GPU UUID → the request id of the workload holding it (its safe id when the request id is
/// not known).
pub type Holders = BTreeMap<String, Value>;

/// Why a workload gets no GPUs.
#[derive(Debug, Clone, PartialEq)]
pub enum GpuRefusal {
    /// GPUs asked for on a CPU-only node: never here.
    NoGpus(u32),
    /// More than one asked for on a MIG host with too few whole GPUs (D56).
    Unsatisfiable { need: usize, total: usize },
    /// More asked for than the node has: never here.
    TooFew { need: usize, total: usize },
    /// Enough healthy GPUs, not enough free: running workloads hold them.
    InUse {
        need: usize,
        free: usize,
        healthy: usize,
    },
    /// Not enough healthy GPUs (D37), or `auto` with none usable; `why`: the query fails as a
    /// whole (D55), so the GPUs are not known.
    Unhealthy {
        need: usize,
        healthy: usize,
        total: usize,
        why: Option<String>,
    },
}

impl GpuRefusal {
    pub fn busy(&self) -> Option<Busy> {
        match self {
            GpuRefusal::NoGpus(_) | GpuRefusal::TooFew { .. } => None,
            GpuRefusal::Unhealthy { .. } => Some(Busy::GpusUnhealthy),
            GpuRefusal::Unsatisfiable { .. } => Some(Busy::GpusUnsatisfiable),
            GpuRefusal::InUse { .. } => Some(Busy::GpusBusy),
        }
    }
}

impl std::fmt::Display for GpuRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuRefusal::NoGpus(n) => write!(
                f,
                "this workload needs {n} GPU(s) and this node has none (no nvidia-smi)"
            ),
            GpuRefusal::Unsatisfiable { need, total } => write!(
                f,
                "{BUSY_PREFIX} unsatisfiable GPUs: {need} needed, and a workload gets at most one MIG device; this node has {total} whole GPU(s)"
            ),
            GpuRefusal::TooFew { need, total } => write!(
                f,
                "this workload needs {need} GPU(s) and this node has {total}"
            ),
            GpuRefusal::InUse {
                need,
                free,
                healthy,
            } => write!(
                f,
                "{BUSY_PREFIX} GPUs in use: {need} needed, {free} of {healthy} healthy GPU(s) free"
            ),
            GpuRefusal::Unhealthy {
                need,
                healthy,
                total,
                why,
            } => {
                write!(
                    f,
                    "{BUSY_PREFIX} unhealthy GPUs: {need} needed, {healthy} of {total} GPU(s) healthy"
                )?;
                match why {
                    Some(w) => write!(f, " ({w})"),
                    None => Ok(()),
                }
            }
        }
    }
}

/// Sets `key` in a JSON object (nothing when `v` is not one).
pub(super) fn put(v: &mut Value, key: &str, x: Value) {
    if let Some(o) = v.as_object_mut() {
        o.insert(key.to_string(), x);
    }
}

/// Whether a workload holds this unit (by its UUID, or one of its MIG devices' from an
/// assignment made before compute instances were grouped).
fn is_held(u: &Gpu, held: &Holders) -> bool {
    holder_of(u, held).is_some()
}

fn holder_of<'a>(u: &Gpu, held: &'a BTreeMap<String, Value>) -> Option<&'a Value> {
    if u.uuid.is_empty() {
        return None;
    }
    held.get(&u.uuid)
        .or_else(|| u.members.iter().find_map(|m| held.get(m)))
}

/// One per-GPU gauge's value: (the GPU, whether a workload holds it).
type Gauge = fn(&Gpu, bool) -> Option<f64>;

fn round(x: f64, places: i32) -> f64 {
    let f = 10f64.powi(places);
    (x * f).round() / f
}

/// A workload that holds (or may hold) GPUs, as the part sees it: a tracked workload (with its
/// process group) or a start in flight (which holds its GPUs already, node/starts.rs).
pub struct Hold<'a> {
    /// Its safe id.
    pub id: &'a str,
    /// The request id shown as its holder.
    pub holder: Value,
    /// The workload's process group (its pid); `None` for a start in flight.
    pub pid: Option<i32>,
    pub gpus: &'a [String],
}

/// What the GPU part needs of the world: the monitor thread's sampling switch and the process
/// groups of the processes using GPUs. On the node: the monitor thread, none when it could not
/// start; the unit tests fake it.
pub trait Sampler {
    /// Sampling every few seconds on (a workload holds GPUs) or off.
    fn set_holding(&self, holding: bool);
    /// How often the monitor samples.
    fn sample_every(&self) -> Duration;
    fn pgid_of(&self, pid: i32) -> Option<i32>;
}

impl Sampler for Option<&crate::gpu::Monitor> {
    fn set_holding(&self, holding: bool) {
        if let Some(m) = self {
            m.set_holding(holding);
        }
    }
    fn sample_every(&self) -> Duration {
        self.map_or(crate::gpu::SAMPLE_EVERY, |m| m.timing.sample)
    }
    fn pgid_of(&self, pid: i32) -> Option<i32> {
        crate::gpu::pgid_of(pid)
    }
}

/// A workload's status entry, with its GPUs when it has an assignment.
pub(super) fn with_gpus(mut w: Value, meta: &crate::workload::Meta) -> Value {
    if let Some(g) = &meta.gpus {
        put(&mut w, "gpus", serde_json::json!(g));
    }
    w
}

/// GPU UUID → the request id of the workload holding it (its safe id when the request id is
/// not known).
pub fn holders(holds: &[Hold<'_>]) -> Holders {
    let mut out = BTreeMap::new();
    for h in holds {
        for u in h.gpus {
            out.insert(u.clone(), h.holder.clone());
        }
    }
    out
}

impl Gpus {
    /// A monitor snapshot: the accounting of each tracked workload holding GPUs (D38), then
    /// the inventory and health (D37).
    pub fn on_snapshot(&mut self, s: Snapshot, holds: &[Hold<'_>], out: &dyn Sampler) {
        if let Snapshot::Gpus {
            gpus,
            apps,
            error: None,
            at,
            ..
        } = &s
        {
            let cap = out
                .sample_every()
                .saturating_mul(2)
                .max(Duration::from_secs(1));
            // Per-process memory by process group: the workload's group is its pid.
            let mut by_group: BTreeMap<i32, u64> = BTreeMap::new();
            for (pid, mib) in apps {
                if let Some(g) = out.pgid_of(*pid) {
                    let e = by_group.entry(g).or_default();
                    *e = e.saturating_add(*mib);
                }
            }
            for h in holds {
                let Some(pid) = h.pid.filter(|_| !h.gpus.is_empty()) else {
                    continue;
                };
                let units: Vec<&Gpu> = gpus
                    .iter()
                    .filter(|g| h.gpus.iter().any(|m| g.is(m)))
                    .collect();
                let own = by_group.get(&pid).copied();
                self.usage
                    .entry(h.id.to_string())
                    .or_default()
                    .add(&units, own, *at, cap);
            }
        }
        self.usage
            .retain(|id, _| holds.iter().any(|h| h.pid.is_some() && h.id == id));
        self.apply(s);
        self.update_sampling(holds, out);
    }

    /// Sampling runs every few seconds only while a tracked workload holds GPUs.
    pub fn update_sampling(&self, holds: &[Hold<'_>], out: &dyn Sampler) {
        let holding = holds.iter().any(|h| h.pid.is_some() && !h.gpus.is_empty());
        out.set_holding(holding);
    }

    /// Adds the GPUs to a `status` answer (nothing on a CPU-only node): `gpus`, and while the
    /// query fails as a whole `gpus_error`, why (`gpus` then holds the GPUs seen before, all
    /// unhealthy, or none when the very first query failed).
    pub fn add_status(&self, holds: &[Hold<'_>], out: &mut Value) {
        if let Some(g) = self.status(holds) {
            put(out, "gpus", g);
            if let Some(e) = &self.error {
                put(out, "gpus_error", json!(e));
            }
        }
    }

    /// `status`: each GPU with its health and holder (absent on a CPU-only node).
    pub fn status(&self, holds: &[Hold<'_>]) -> Option<Value> {
        if !self.present {
            return None;
        }
        let holders = holders(holds);
        Some(Value::Array(
            self.units
                .iter()
                .map(|u| {
                    let mut v = json!({
                        "index": u.index,
                        "uuid": u.uuid,
                        "name": u.name,
                        "bus_id": u.bus_id,
                        "memory_total_mib": u.memory_total_mib,
                        "health": u.health.label(),
                        "reason": u.health.reason(),
                        "held_by": holder_of(u, &holders),
                    });
                    if let Some(p) = &u.parent {
                        put(&mut v, "shared", json!(u.shared));
                        put(&mut v, "parent_uuid", json!(p));
                        put(&mut v, "mig_devices", json!(u.members));
                    }
                    v
                })
                .collect(),
        ))
    }

    /// Heartbeat fields (D37), on a node with GPUs.
    pub fn heartbeat(&self, holds: &[Hold<'_>], body: &mut Value) {
        if !self.present {
            return;
        }
        let held = holders(holds);
        let free = self
            .units
            .iter()
            .filter(|u| u.health.is_healthy() && !is_held(u, &held))
            .count();
        put(body, "gpus_total", json!(self.units.len()));
        put(body, "gpus_healthy", json!(self.healthy()));
        put(body, "gpus_free", json!(free));
    }

    /// The completion's `gpu` object (D38), for a workload that held GPUs.
    pub fn usage_of(&mut self, safe_id: &str, meta: &crate::workload::Meta) -> Option<Value> {
        let usage = self.usage.remove(safe_id).unwrap_or_default();
        let count = meta.gpus.as_ref().map_or(0, Vec::len);
        if count == 0 {
            return None;
        }
        let seconds = (crate::workload::unix_now() - meta.created_unix).max(0.0);
        let shared = usage.shared
            || meta
                .gpus
                .iter()
                .flatten()
                .any(|m| self.units.iter().any(|u| u.shared && u.is(m)));
        let util = usage.util_avg();
        let mut out = json!({
            "count": count,
            "seconds": round(seconds, 1),
            // Not reported (a MIG board reports none): null, never a made-up 0.
            "util_avg_pct": util.map(|u| round(u, 1)),
            "util_max_pct": util.map(|_| usage.util_max),
            "mem_peak_mib": usage.mem_peak_mib(),
            "energy_wh": round(usage.energy_wh, 3),
        });
        if shared {
            // Utilisation, power and energy are the whole board's, shared with its other
            // instances; the memory is the workload's own processes'.
            put(&mut out, "shared", json!(true));
        }
        Some(out)
    }
    /// Per-GPU gauges for the metrics file.
    pub fn metrics(&self, holds: &[Hold<'_>], t: &mut String) {
        if !self.present {
            return;
        }
        let held = holders(holds);
        // (name, help, value, board-level: once per physical GPU, never per MIG slice (D56))
        let gauges: [(&str, &str, Gauge, bool); 7] = [
            (
                "gpu_healthy",
                "1 when the GPU takes workloads (D37).",
                |g, _| Some(f64::from(u8::from(g.health.is_healthy()))),
                false,
            ),
            (
                "gpu_assigned",
                "1 while a workload holds the GPU.",
                |_, h| Some(f64::from(u8::from(h))),
                false,
            ),
            (
                "gpu_utilization_percent",
                "GPU utilisation.",
                |g, _| g.util_pct.map(|v| v as f64),
                true,
            ),
            (
                "gpu_memory_used_mib",
                "GPU memory in use.",
                |g, _| g.memory_used_mib.map(|v| v as f64),
                true,
            ),
            (
                "gpu_memory_total_mib",
                "GPU memory.",
                |g, _| g.memory_total_mib.map(|v| v as f64),
                false,
            ),
            ("gpu_power_watts", "GPU power draw.", |g, _| g.power_w, true),
            (
                "gpu_temperature_celsius",
                "GPU temperature.",
                |g, _| g.temperature_c.map(|v| v as f64),
                true,
            ),
        ];
        for (name, help, get, board) in gauges {
            let _ = writeln!(
                t,
                "# HELP cyberwave_node_{name} {help}\n# TYPE cyberwave_node_{name} gauge"
            );
            let mut boards: BTreeSet<&str> = BTreeSet::new();
            for u in &self.units {
                let (gpu, uuid, shared) = match (&u.parent, board) {
                    (Some(p), true) => {
                        if !boards.insert(p.as_str()) {
                            continue;
                        }
                        let index = u.index.split(':').next().unwrap_or(&u.index);
                        let shared = if u.shared { ",shared=\"true\"" } else { "" };
                        (index, p.as_str(), shared)
                    }
                    _ => (u.index.as_str(), u.uuid.as_str(), ""),
                };
                if let Some(v) = get(u, is_held(u, &held)) {
                    let _ = writeln!(
                        t,
                        "cyberwave_node_{name}{{gpu=\"{gpu}\",uuid=\"{uuid}\"{shared}}} {v}"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::time::Instant;

    /// A recording fake of the monitor and `/proc`.
    #[derive(Default)]
    struct FakeSampler {
        holding: RefCell<Vec<bool>>,
    }
    impl Sampler for FakeSampler {
        fn set_holding(&self, holding: bool) {
            self.holding.borrow_mut().push(holding);
        }
        fn sample_every(&self) -> Duration {
            Duration::from_secs(5)
        }
        fn pgid_of(&self, pid: i32) -> Option<i32> {
            Some(pid)
        }
    }

    fn unit(uuid: &str) -> Gpu {
        Gpu {
            index: "0".into(),
            uuid: uuid.into(),
            name: "H200".into(),
            bus_id: String::new(),
            memory_total_mib: Some(1000),
            memory_used_mib: Some(10),
            util_pct: Some(50),
            power_w: Some(100.0),
            temperature_c: Some(40),
            health: Health::Healthy,
            parent: None,
            members: Vec::new(),
            shared: false,
        }
    }

    fn snapshot(units: &[&str], at: Instant) -> Snapshot {
        Snapshot::Gpus {
            gpus: units.iter().map(|u| unit(u)).collect(),
            apps: BTreeMap::from([(7, 300)]),
            app_gpus: BTreeMap::new(),
            error: None,
            at,
        }
    }

    #[test]
    fn a_start_gets_a_gpu_no_service_uses_first_and_is_never_refused_for_one() {
        let mut g = Gpus::default();
        g.on_snapshot(
            snapshot(&["GPU-a", "GPU-b", "GPU-c"], Instant::now()),
            &[],
            &FakeSampler::default(),
        );
        g.avoid = ["GPU-a".to_string(), "GPU-b".to_string()].into();
        let none = holders(&[]);
        assert_eq!(g.assign(Some(1), 3, &none), Ok(Some(vec!["GPU-c".into()])));
        assert_eq!(
            g.assign(Some(2), 3, &none),
            Ok(Some(vec!["GPU-c".into(), "GPU-a".into()])),
            "then those a service uses, in their order"
        );
        let c = vec!["GPU-c".to_string()];
        let held = [Hold {
            id: "w",
            holder: json!("r"),
            pid: None,
            gpus: &c,
        }];
        assert_eq!(
            g.assign(Some(1), 3, &holders(&held)),
            Ok(Some(vec!["GPU-a".into()])),
            "a service's GPU rather than a refusal"
        );
    }

    #[test]
    fn a_tracked_workload_holding_gpus_is_sampled_and_accounted_a_start_only_holds() {
        let mut g = Gpus::default();
        let fake = FakeSampler::default();
        let a = vec!["GPU-a".to_string()];
        let b = vec!["GPU-b".to_string()];
        let starting = [Hold {
            id: "s1",
            holder: json!("r1"),
            pid: None,
            gpus: &b,
        }];
        let t0 = Instant::now();
        g.on_snapshot(snapshot(&["GPU-a", "GPU-b"], t0), &starting, &fake);
        assert_eq!(
            *fake.holding.borrow(),
            vec![false],
            "a start is not sampled"
        );
        assert!(g.usage.is_empty());
        // The start holds its GPU already: no other workload gets it.
        assert_eq!(
            g.assign(Some(1), 2, &holders(&starting)),
            Ok(Some(vec!["GPU-a".to_string()]))
        );
        let running = [Hold {
            id: "w1",
            holder: json!("r0"),
            pid: Some(7),
            gpus: &a,
        }];
        g.on_snapshot(snapshot(&["GPU-a", "GPU-b"], t0), &running, &fake);
        assert_eq!(*fake.holding.borrow(), vec![false, true]);
        assert!(g.usage.contains_key("w1"), "accounted");
        let mut body = json!({});
        g.heartbeat(&running, &mut body);
        assert_eq!(body["gpus_free"], json!(1));
        assert_eq!(g.status(&running).unwrap()[0]["held_by"], json!("r0"));
        // Gone from the table: its accounting goes with it.
        g.on_snapshot(snapshot(&["GPU-a", "GPU-b"], t0), &[], &fake);
        assert!(g.usage.is_empty());
        assert_eq!(fake.holding.borrow().last(), Some(&false));
    }
}

/// Assignment on every real capture and listing (tests/fixtures: `src/gpu/real.rs`), as
/// docs/gpus.md says: `gpus` absent (auto), 1, 2, 0.
#[cfg(test)]
mod on_real_hosts {
    use super::*;
    use crate::gpu::real::{self, Standin};
    use crate::gpu::{query_with, Known};

    fn node_on(s: &Standin) -> Gpus {
        let mut smi = |a: &[&str]| s.call(a);
        let snap = query_with(
            &mut smi,
            Duration::from_secs(10),
            &mut Known::default(),
            true,
        );
        let mut g = Gpus::default();
        g.apply(snap);
        g
    }

    /// What docs/gpus.md promises for each count on this host.
    fn check(case: &str, g: &Gpus) {
        let held = Holders::new();
        let ids = |us: &[&Gpu]| Ok(Some(us.iter().map(|u| u.uuid.clone()).collect::<Vec<_>>()));
        let all: Vec<&Gpu> = g.units.iter().collect();
        let whole: Vec<&Gpu> = g.units.iter().filter(|u| u.parent.is_none()).collect();
        let mig_host = whole.len() < all.len();
        assert!(!all.is_empty(), "{case}");
        // Auto, one slot: every healthy GPU; on a MIG host one MIG device.
        let auto = if mig_host { &all[..1] } else { &all[..] };
        assert_eq!(g.assign(None, 1, &held), ids(auto), "{case}: auto");
        // Auto, four slots: ⌊healthy ÷ 4⌋, never 0.
        let quarter = if mig_host { 1 } else { (all.len() / 4).max(1) };
        assert_eq!(
            g.assign(None, 4, &held),
            ids(&all[..quarter]),
            "{case}: auto/4"
        );
        assert_eq!(g.assign(Some(1), 4, &held), ids(&all[..1]), "{case}: 1");
        let two = g.assign(Some(2), 4, &held);
        if whole.len() >= 2 {
            assert_eq!(two, ids(&whole[..2]), "{case}: 2 whole GPUs");
        } else if mig_host {
            let r = two.expect_err("unsatisfiable");
            assert_eq!(r.busy(), Some(Busy::GpusUnsatisfiable), "{case}: {r}");
        } else {
            let r = two.expect_err("too few");
            assert_eq!(r.busy(), None, "{case}: never here: {r}");
            assert_eq!(
                r.to_string(),
                "this workload needs 2 GPU(s) and this node has 1"
            );
        }
        assert_eq!(
            g.assign(Some(0), 4, &held),
            Ok(Some(Vec::new())),
            "{case}: 0"
        );
    }

    #[test]
    #[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
    fn guarantee_15_every_real_host_is_assigned_as_the_readme_says() {
        std::thread::scope(|scope| {
            for cap in real::captures() {
                scope.spawn(move || {
                    let case = cap.display().to_string();
                    check(&case, &node_on(&Standin::new(&cap, "idle")));
                });
            }
        });
        let tmp = crate::scratch::Scratch::new("gpu-assign-lists");
        for list in real::lists() {
            let cap = tmp.join("host.capture");
            real::capture_of_list(&list, &cap);
            check(
                &list.display().to_string(),
                &node_on(&Standin::new(&cap, "idle")),
            );
        }
    }

    #[test]
    #[cfg_attr(no_gpu_captures, ignore = "needs ../shared/fixtures/gpu/real")]
    fn a_failing_query_is_refused_in_the_documented_words_and_shown_in_status() {
        let cap = real::capture("h200-mig");
        let mut g = node_on(&Standin::new(&cap, "load").with("NVSMI_FAIL", "no-devices"));
        let why = "nvidia-smi failed: No devices were found";
        // The very first query failed: no GPU known, the reason in status and in the refusal.
        assert!(g.units.is_empty());
        let mut st = json!({});
        g.add_status(&[], &mut st);
        assert_eq!(st, json!({"gpus": [], "gpus_error": why}));
        let r = g.assign(None, 1, &Holders::new()).expect_err("refused");
        assert_eq!(r.busy(), Some(Busy::GpusUnhealthy));
        assert_eq!(
            r.to_string(),
            format!("Controller host is busy with unhealthy GPUs: 1 needed, 0 of 0 GPU(s) healthy ({why})")
        );
        // GPUs known, then the driver fails: the same form, with the count it had.
        let mut known = Known::default();
        let ok = Standin::new(&cap, "load");
        let bad = Standin::new(&cap, "load").with("NVSMI_FAIL", "nvml-mismatch");
        for s in [&ok, &bad] {
            let mut smi = |a: &[&str]| s.call(a);
            g.apply(query_with(
                &mut smi,
                Duration::from_secs(10),
                &mut known,
                true,
            ));
        }
        let r = g.assign(Some(1), 1, &Holders::new()).expect_err("refused");
        assert!(
            r.to_string().starts_with(
                "Controller host is busy with unhealthy GPUs: 1 needed, 0 of 4 GPU(s) healthy (nvidia-smi failed: Failed to initialize NVML"
            ),
            "{r}"
        );
        // Answering again: no error in status.
        let mut smi = |a: &[&str]| ok.call(a);
        g.apply(query_with(
            &mut smi,
            Duration::from_secs(10),
            &mut known,
            true,
        ));
        let mut st = json!({});
        g.add_status(&[], &mut st);
        assert!(st.get("gpus_error").is_none(), "{st}");
        assert_eq!(st["gpus"][0]["memory_total_mib"], 71424, "{st}");
        assert_eq!(st["gpus"][0]["shared"], true, "{st}");
    }
}
