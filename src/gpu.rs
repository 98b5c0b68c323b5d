//! GPUs (D35–D38): the inventory from `nvidia-smi` (the static binary cannot load NVML), the
//! health rules, and the monitor thread that queries it off the node's loop, with a timeout
//! after which the query (its whole process group) is killed. No `nvidia-smi` on `PATH`: a
//! CPU-only node. Assignment, the node's view of health and per-workload accounting live in
//! `node/gpus.rs`.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use serde::{Deserialize, Serialize};

/// The fields the node asks for, in this order (one query serves inventory, health and
/// accounting).
pub const QUERY_FIELDS: &str = "index,uuid,name,pci.bus_id,memory.total,memory.used,utilization.gpu,power.draw,temperature.gpu,ecc.errors.uncorrected.volatile.total,retired_pages.pending,remapped_rows.failure";
const FIELD_COUNT: usize = 12;
/// For drivers older than row remapping (before R450), which refuse the whole query when one
/// field is unknown: the same fields without `remapped_rows.failure`, read as `[N/A]`.
pub const LEGACY_FIELDS: &str = "index,uuid,name,pci.bus_id,memory.total,memory.used,utilization.gpu,power.draw,temperature.gpu,ecc.errors.uncorrected.volatile.total,retired_pages.pending";
/// Per-process GPU memory, matched against each workload's process group.
pub const APPS_FIELDS: &str = "pid,used_memory";
/// The most output read from one query: a host has at most a few dozen GPUs.
const MAX_OUTPUT: usize = 1 << 20;

/// Production timings; tests shorten them with `CYBERWAVE_NODE_GPU_*_SECONDS`.
pub const INVENTORY_EVERY: Duration = Duration::from_secs(60);
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "reason")]
pub enum Health {
    Healthy,
    /// One of the D37 rules: it gets no new workload.
    Unhealthy(String),
    /// A field did not parse: excluded like an unhealthy GPU, and said so.
    Unknown(String),
}

impl Health {
    pub fn is_healthy(&self) -> bool {
        matches!(self, Health::Healthy)
    }
    pub fn label(&self) -> &'static str {
        match self {
            Health::Healthy => "healthy",
            Health::Unhealthy(_) => "unhealthy",
            Health::Unknown(_) => "unknown",
        }
    }
    pub fn reason(&self) -> Option<&str> {
        match self {
            Health::Healthy => None,
            Health::Unhealthy(r) | Health::Unknown(r) => Some(r),
        }
    }
}

/// One schedulable unit: a whole GPU, or a MIG instance of one (then `index` is `"0:1"` and the
/// readings are its parent's).
#[derive(Debug, Clone, PartialEq)]
pub struct Gpu {
    pub index: String,
    pub uuid: String,
    pub name: String,
    pub bus_id: String,
    pub memory_total_mib: Option<u64>,
    pub memory_used_mib: Option<u64>,
    pub util_pct: Option<u64>,
    pub power_w: Option<f64>,
    pub temperature_c: Option<u64>,
    pub health: Health,
}

/// One answer of the monitor thread.
#[derive(Debug, Clone)]
pub enum Snapshot {
    /// No `nvidia-smi` on `PATH`: a CPU-only node.
    Absent,
    Gpus {
        gpus: Vec<Gpu>,
        /// Per-process GPU memory: pid → MiB.
        apps: BTreeMap<i32, u64>,
        /// Why the query failed (timeout, error text), when it did.
        error: Option<String>,
        at: Instant,
    },
}

/// A "[N/A]", "[Not Supported]", "N/A", "[Unknown Error]" … value: not reported.
fn not_reported(v: &str) -> bool {
    let v = v.trim();
    v.is_empty() || v.eq_ignore_ascii_case("n/a") || (v.starts_with('[') && v.ends_with(']'))
}

/// A field that is either not reported (`Ok(None)`) or parses (`Ok(Some)`); anything else is
/// an error naming the field.
fn field<T: std::str::FromStr>(name: &str, v: &str) -> Result<Option<T>, String> {
    if not_reported(v) {
        return Ok(None);
    }
    v.trim()
        .parse::<T>()
        .map(Some)
        .map_err(|_| format!("{name} is not readable ({:?})", crate::logtext::shown(v)))
}

fn yes_no(name: &str, v: &str) -> Result<Option<bool>, String> {
    if not_reported(v) {
        return Ok(None);
    }
    match v.trim().to_ascii_lowercase().as_str() {
        "yes" | "true" => Ok(Some(true)),
        "no" | "false" => Ok(Some(false)),
        other => match other.parse::<u64>() {
            Ok(n) => Ok(Some(n > 0)),
            Err(_) => Err(format!(
                "{name} is not readable ({:?})",
                crate::logtext::shown(v)
            )),
        },
    }
}

/// A GPU or MIG UUID as `nvidia-smi` prints it (`GPU-…`, `MIG-…`): it goes into a workload's
/// environment, so nothing else passes.
pub fn valid_uuid(u: &str) -> bool {
    (u.starts_with("GPU-") || u.starts_with("MIG-"))
        && u.len() <= 96
        && u.len() > 4
        && u.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '/')
}

fn clean_text(v: &str, max: usize) -> String {
    v.trim()
        .chars()
        .filter(|c| !c.is_control())
        .take(max)
        .collect()
}

/// Parses the output of `nvidia-smi --query-gpu=QUERY_FIELDS --format=csv,noheader,nounits`.
/// Never fails: a line that cannot be read becomes a GPU in state unknown (so the count stays
/// true), a field that does not parse marks its GPU unknown.
pub fn parse_query(text: &str) -> Vec<Gpu> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let cols: Vec<&str> = line.split(',').map(str::trim).collect();
        let col = |i: usize| cols.get(i).copied().unwrap_or("");
        let mut problems: Vec<String> = Vec::new();
        if cols.len() != FIELD_COUNT {
            problems.push(format!(
                "nvidia-smi printed {} fields where {FIELD_COUNT} were asked for",
                cols.len()
            ));
        }
        let index = match field::<u32>("index", col(0)) {
            Ok(Some(i)) => i.to_string(),
            Ok(None) | Err(_) => {
                problems.push("index is not readable".into());
                format!("?{n}")
            }
        };
        let uuid = if valid_uuid(col(1)) {
            col(1).to_string()
        } else {
            problems.push("uuid is not readable".into());
            String::new()
        };
        let mut num = |name: &str, v: &str| match field::<u64>(name, v) {
            Ok(x) => x,
            Err(e) => {
                problems.push(e);
                None
            }
        };
        let memory_total_mib = num("memory.total", col(4));
        let memory_used_mib = num("memory.used", col(5));
        let util_pct = num("utilization.gpu", col(6));
        let temperature_c = num("temperature.gpu", col(8));
        let ecc = num("ecc.errors.uncorrected.volatile.total", col(9));
        let power_w = match field::<f64>("power.draw", col(7)) {
            Ok(p) => p.filter(|p| p.is_finite() && *p >= 0.0),
            Err(e) => {
                problems.push(e);
                None
            }
        };
        let mut flag = |name: &str, v: &str| match yes_no(name, v) {
            Ok(x) => x,
            Err(e) => {
                problems.push(e);
                None
            }
        };
        let retired = flag("retired_pages.pending", col(10));
        let remap = flag("remapped_rows.failure", col(11));
        let mut bad: Vec<String> = Vec::new();
        if let Some(e) = ecc.filter(|e| *e > 0) {
            bad.push(format!("{e} uncorrected volatile ECC error(s)"));
        }
        if retired == Some(true) {
            bad.push("pending retired pages".into());
        }
        if remap == Some(true) {
            bad.push("a row remap failed".into());
        }
        let health = if !bad.is_empty() {
            Health::Unhealthy(bad.join("; "))
        } else if !problems.is_empty() {
            Health::Unknown(problems.join("; "))
        } else {
            Health::Healthy
        };
        out.push(Gpu {
            index,
            uuid,
            name: clean_text(col(2), 96),
            bus_id: clean_text(col(3), 32),
            memory_total_mib,
            memory_used_mib,
            util_pct,
            power_w,
            temperature_c,
            health,
        });
    }
    out
}

/// A MIG instance from `nvidia-smi -L`.
#[derive(Debug, Clone, PartialEq)]
pub struct Mig {
    pub parent_uuid: String,
    pub device: u32,
    pub profile: String,
    pub uuid: String,
}

/// Parses `nvidia-smi -L`: `GPU 0: NAME (UUID: GPU-…)` lines, each followed by its
/// `  MIG 1g.5gb Device 0: (UUID: MIG-…)` lines. Lines that do not read are skipped.
pub fn parse_list(text: &str) -> Vec<Mig> {
    let mut out = Vec::new();
    let mut parent: Option<String> = None;
    for line in text.lines() {
        let uuid = line
            .rsplit_once("(UUID:")
            .and_then(|(_, rest)| rest.trim().strip_suffix(')'))
            .map(str::trim);
        let t = line.trim_start();
        if t.starts_with("GPU ") {
            parent = uuid.filter(|u| valid_uuid(u)).map(String::from);
        } else if let Some(rest) = t.strip_prefix("MIG ") {
            let (Some(p), Some(u)) = (parent.as_ref(), uuid.filter(|u| valid_uuid(u))) else {
                continue;
            };
            let mut words = rest.split_whitespace();
            let profile = clean_text(words.next().unwrap_or(""), 32);
            let device = rest
                .split_once("Device")
                .and_then(|(_, d)| d.split(':').next())
                .and_then(|d| d.trim().parse::<u32>().ok());
            if let Some(device) = device {
                out.push(Mig {
                    parent_uuid: p.clone(),
                    device,
                    profile,
                    uuid: u.to_string(),
                });
            }
        }
    }
    out
}

/// Parses `--query-compute-apps=pid,used_memory --format=csv,noheader,nounits`.
pub fn parse_apps(text: &str) -> BTreeMap<i32, u64> {
    let mut out: BTreeMap<i32, u64> = BTreeMap::new();
    for line in text.lines() {
        let mut cols = line.split(',').map(str::trim);
        let (Some(pid), Some(mem)) = (cols.next(), cols.next()) else {
            continue;
        };
        let (Ok(pid), Ok(Some(mem))) = (pid.parse::<i32>(), field::<u64>("used_memory", mem))
        else {
            continue;
        };
        if pid > 0 {
            let e = out.entry(pid).or_default();
            *e = e.saturating_add(mem);
        }
    }
    out
}

/// The schedulable units: a GPU with MIG instances is replaced by them (its health and
/// readings carried over).
pub fn units(gpus: Vec<Gpu>, migs: &[Mig]) -> Vec<Gpu> {
    let mut out = Vec::new();
    for g in gpus {
        let mine: Vec<&Mig> = migs
            .iter()
            .filter(|m| !g.uuid.is_empty() && m.parent_uuid == g.uuid)
            .collect();
        if mine.is_empty() {
            out.push(g);
            continue;
        }
        for m in mine {
            out.push(Gpu {
                index: format!("{}:{}", g.index, m.device),
                uuid: m.uuid.clone(),
                name: format!("{} MIG {}", g.name, m.profile),
                memory_total_mib: None,
                ..g.clone()
            });
        }
    }
    out
}

#[derive(Debug)]
pub enum RunError {
    NotFound,
    TimedOut,
    Failed(String),
}

/// Runs `nvidia-smi ARGS` in its own process group; its stdout, or why not. At `timeout` the
/// whole group is killed. The exit status is not awaited (the node's reaper owns `waitpid`):
/// the output is judged by the parsers.
pub fn run(args: &[&str], timeout: Duration) -> Result<String, RunError> {
    let mut child = match Command::new("nvidia-smi")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .env("LC_ALL", "C")
        .process_group(0)
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(RunError::NotFound),
        Err(e) => return Err(RunError::Failed(format!("cannot run nvidia-smi: {e}"))),
    };
    let pgid = i32::try_from(child.id()).unwrap_or(0);
    let Some(mut out) = child.stdout.take() else {
        return Err(RunError::Failed("no output pipe".into()));
    };
    let deadline = Instant::now().checked_add(timeout);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let fd = out.as_raw_fd();
    let result = loop {
        let left = deadline.map_or(timeout, |d| d.saturating_duration_since(Instant::now()));
        if left.is_zero() {
            break Err(RunError::TimedOut);
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1);
        // SAFETY: one valid pollfd that lives across the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            break Err(RunError::Failed("poll failed".into()));
        }
        if rc == 0 {
            continue;
        }
        match out.read(&mut chunk) {
            Ok(0) => break Ok(()),
            Ok(n) => {
                buf.extend_from_slice(chunk.get(..n).unwrap_or(&[]));
                if buf.len() > MAX_OUTPUT {
                    break Err(RunError::Failed("nvidia-smi printed too much".into()));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break Err(RunError::Failed(format!("cannot read nvidia-smi: {e}"))),
        }
    };
    if result.is_err() && pgid > 0 {
        // SAFETY: the group is the child's own (process_group(0)), which has not been waited
        // for by us; signalling a group that is gone fails harmlessly.
        unsafe {
            libc::killpg(pgid, libc::SIGKILL);
        }
    }
    // Reap it unless the node's reaper does (then this returns an error at once).
    for _ in 0..50 {
        match child.try_wait() {
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            _ => break,
        }
    }
    result.map(|()| String::from_utf8_lossy(&buf).into_owned())
}

/// The monitor's settings.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub inventory: Duration,
    pub sample: Duration,
    pub timeout: Duration,
}

impl Timing {
    /// From the environment (`CYBERWAVE_NODE_GPU_{INVENTORY,SAMPLE,TIMEOUT}_SECONDS`, which
    /// only tests set); a value that does not read keeps the default, with a warning.
    pub fn from_env(env: &crate::config::env::EnvLayers) -> Timing {
        let knob = |name: &str, default: Duration| {
            let Some(v) = env.value(name) else {
                return default;
            };
            match v.trim().parse::<f64>() {
                Ok(s) if s > 0.0 && s <= 86_400.0 => Duration::from_secs_f64(s),
                _ => {
                    log::warn!(
                        "{name}={:?} is not a number of seconds in (0, 86400]; using {}s",
                        crate::logtext::shown(&v),
                        default.as_secs_f64()
                    );
                    default
                }
            }
        };
        Timing {
            inventory: knob("CYBERWAVE_NODE_GPU_INVENTORY_SECONDS", INVENTORY_EVERY),
            sample: knob("CYBERWAVE_NODE_GPU_SAMPLE_SECONDS", SAMPLE_EVERY),
            timeout: knob("CYBERWAVE_NODE_GPU_TIMEOUT_SECONDS", QUERY_TIMEOUT),
        }
    }
}

/// One full query: the GPUs (with MIG instances when `list`), and per-process memory.
/// `known` is the last inventory: on a timeout or failure those GPUs are reported unhealthy.
pub fn query(timing: &Timing, migs: &mut Vec<Mig>, list: bool, known: &[Gpu]) -> Snapshot {
    let q = format!("--query-gpu={QUERY_FIELDS}");
    let at = Instant::now();
    let failed = |why: String| {
        let gpus = known
            .iter()
            .map(|g| Gpu {
                health: Health::Unhealthy(why.clone()),
                memory_used_mib: None,
                util_pct: None,
                power_w: None,
                temperature_c: None,
                ..g.clone()
            })
            .collect();
        Snapshot::Gpus {
            gpus,
            apps: BTreeMap::new(),
            error: Some(why),
            at,
        }
    };
    let mut answer = run(&[&q, "--format=csv,noheader,nounits"], timing.timeout);
    if matches!(&answer, Ok(t) if t.contains("is not a valid field to query")) {
        let legacy = format!("--query-gpu={LEGACY_FIELDS}");
        answer = run(&[&legacy, "--format=csv,noheader,nounits"], timing.timeout).map(|t| {
            t.lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| format!("{l}, [N/A]\n"))
                .collect()
        });
    }
    let text = match answer {
        Ok(t) => t,
        Err(RunError::NotFound) => return Snapshot::Absent,
        Err(RunError::TimedOut) => {
            return failed(format!(
                "nvidia-smi did not answer within {}s",
                timing.timeout.as_secs_f64()
            ))
        }
        Err(RunError::Failed(e)) => return failed(e),
    };
    let gpus = parse_query(&text);
    if gpus.iter().all(|g| g.uuid.is_empty()) {
        let first = text.lines().map(str::trim).find(|l| !l.is_empty());
        return failed(match first {
            Some(l) => format!(
                "nvidia-smi failed: {}",
                crate::logtext::shown(&clean_text(l, 200))
            ),
            None => "nvidia-smi reported no GPU".into(),
        });
    }
    if list {
        match run(&["-L"], timing.timeout) {
            Ok(t) => *migs = parse_list(&t),
            Err(e) => log::warn!("nvidia-smi -L failed ({e:?}); MIG instances as last seen"),
        }
    }
    let apps = run(
        &[
            &format!("--query-compute-apps={APPS_FIELDS}"),
            "--format=csv,noheader,nounits",
        ],
        timing.timeout,
    )
    .map(|t| parse_apps(&t))
    .unwrap_or_default();
    Snapshot::Gpus {
        gpus: units(gpus, migs),
        apps,
        error: None,
        at,
    }
}

/// The monitor thread's handle: tell it whether any workload holds GPUs (then it samples every
/// [`Timing::sample`], else it only takes the inventory every [`Timing::inventory`]).
pub struct Monitor {
    hold: Sender<bool>,
    pub timing: Timing,
}

impl Monitor {
    pub fn set_holding(&self, holding: bool) {
        let _ = self.hold.try_send(holding);
    }
}

/// Starts the monitor; its first snapshot is taken at once.
pub fn start(timing: Timing) -> std::io::Result<(Monitor, Receiver<Snapshot>)> {
    let (tx, rx) = crossbeam_channel::bounded::<Snapshot>(4);
    let (hold, hold_rx) = crossbeam_channel::bounded::<bool>(16);
    std::thread::Builder::new()
        .name("gpu".into())
        .spawn(move || monitor(timing, tx, hold_rx))?;
    Ok((Monitor { hold, timing }, rx))
}

fn monitor(timing: Timing, tx: Sender<Snapshot>, hold: Receiver<bool>) {
    let mut migs = Vec::new();
    let mut known: Vec<Gpu> = Vec::new();
    let mut holding = false;
    let mut next_list = Instant::now();
    loop {
        let now = Instant::now();
        let list = now >= next_list;
        if list {
            next_list = now.checked_add(timing.inventory).unwrap_or(now);
        }
        let snap = query(&timing, &mut migs, list, &known);
        if let Snapshot::Gpus { gpus, error, .. } = &snap {
            if error.is_none() {
                known = gpus.clone();
            }
        }
        if tx.send(snap).is_err() {
            return;
        }
        let every = if holding {
            timing.sample
        } else {
            timing.inventory
        };
        let until = Instant::now().checked_add(every).unwrap_or(next_list);
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match hold.recv_timeout(left) {
                Ok(h) => {
                    let starts = h && !holding;
                    holding = h;
                    if starts {
                        break; // a first sample right away
                    }
                }
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }
}

/// The process group of `pid` (from `/proc/PID/stat`), to match GPU processes to workloads.
pub fn pgid_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the last ')' (the command name may hold anything): state, ppid, pgrp.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(2)?.parse().ok()
}

/// The GPUs a running process was given, read back from its environment
/// (`CUDA_VISIBLE_DEVICES` as the node set it): how an assignment is recovered when a
/// workload's record is lost but the process provably still runs. `None`: no such variable,
/// or a value the node would not have set.
pub fn assigned_in_environ(pid: i32) -> Option<Vec<String>> {
    if pid <= 0 {
        return None;
    }
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let value = env
        .split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(b"CUDA_VISIBLE_DEVICES="))?;
    let text = std::str::from_utf8(value).ok()?;
    if text.is_empty() {
        return Some(Vec::new());
    }
    let ids: Vec<String> = text.split(',').map(String::from).collect();
    ids.iter().all(|u| valid_uuid(u)).then_some(ids)
}

/// Accounting of one workload's GPUs (D38), from the samples taken while it held them.
#[derive(Debug, Clone, Default)]
pub struct Usage {
    pub samples: u64,
    util_sum: f64,
    pub util_max: u64,
    /// Peak memory of the workload's own processes, once any of them was seen on its GPUs.
    own_peak_mib: Option<u64>,
    /// Peak memory in use on its GPUs (exclusive, so normally all its own).
    gpu_peak_mib: u64,
    pub energy_wh: f64,
    last: Option<Instant>,
}

impl Usage {
    /// Adds one snapshot: `mine` are the workload's GPUs in it; `own_mib` its own processes'
    /// memory, when any of them appears in the per-process list. Energy is power × the time
    /// since the previous sample, at most `cap` (a gap is not billed at the last reading).
    pub fn add(&mut self, mine: &[&Gpu], own_mib: Option<u64>, at: Instant, cap: Duration) {
        if mine.is_empty() {
            return;
        }
        let utils: Vec<u64> = mine.iter().filter_map(|g| g.util_pct).collect();
        if !utils.is_empty() {
            let sum: u64 = utils.iter().fold(0u64, |a, u| a.saturating_add(*u));
            let n = utils.len() as f64;
            self.util_sum += sum as f64 / n;
            self.util_max = self.util_max.max(utils.iter().copied().max().unwrap_or(0));
            self.samples = self.samples.saturating_add(1);
        }
        if let Some(own) = own_mib {
            self.own_peak_mib = Some(self.own_peak_mib.unwrap_or(0).max(own));
        }
        let used = mine
            .iter()
            .filter_map(|g| g.memory_used_mib)
            .fold(0u64, u64::saturating_add);
        self.gpu_peak_mib = self.gpu_peak_mib.max(used);
        let power: f64 = mine.iter().filter_map(|g| g.power_w).sum();
        if let Some(last) = self.last {
            let dt = at.saturating_duration_since(last).min(cap);
            self.energy_wh += power * dt.as_secs_f64() / 3600.0;
        }
        self.last = Some(at);
    }

    /// The workload's own processes' peak when they were ever seen in the per-process list
    /// (the only true figure on a MIG slice), else its GPUs' peak.
    pub fn mem_peak_mib(&self) -> u64 {
        self.own_peak_mib.unwrap_or(self.gpu_peak_mib)
    }

    pub fn util_avg(&self) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            self.util_sum / self.samples as f64
        }
    }
}

/// `doctor`'s lines about GPUs: (level, detail).
pub fn doctor_lines(timing: &Timing) -> Vec<(&'static str, String)> {
    let mut migs = Vec::new();
    match query(timing, &mut migs, true, &[]) {
        Snapshot::Absent => vec![(
            "WARN",
            "nvidia-smi not found: no NVIDIA GPU visible to this user (a CPU-only node)".into(),
        )],
        Snapshot::Gpus { error: Some(e), .. } => vec![("FAIL", e)],
        Snapshot::Gpus { gpus, .. } => {
            let healthy = gpus.iter().filter(|g| g.health.is_healthy()).count();
            let mut out = vec![(
                if healthy == gpus.len() {
                    "PASS"
                } else {
                    "WARN"
                },
                format!("{} GPU(s), {healthy} healthy", gpus.len()),
            )];
            for g in gpus.iter().filter(|g| !g.health.is_healthy()) {
                out.push((
                    "WARN",
                    format!(
                        "GPU {} {} ({}) is {}: {}",
                        g.index,
                        g.uuid,
                        g.name,
                        g.health.label(),
                        g.health.reason().unwrap_or("")
                    ),
                ));
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FOUR: &str = "0, GPU-6b1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e60, NVIDIA A100-SXM4-80GB, 00000000:07:00.0, 81920, 1234, 87, 312.45, 61, 0, No, No\n\
1, GPU-6b1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e61, NVIDIA A100-SXM4-80GB, 00000000:0F:00.0, 81920, 0, 0, 61.20, 34, 0, No, No\n\
2, GPU-6b1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e62, NVIDIA A100-SXM4-80GB, 00000000:47:00.0, 81920, 0, 0, 60.80, 33, 2, No, No\n\
3, GPU-6b1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e63, NVIDIA A100-SXM4-80GB, 00000000:4E:00.0, 81920, 0, 0, 59.10, 33, 0, Yes, No\n";

    #[test]
    fn reads_a_healthy_gpu_and_each_health_rule() {
        let g = parse_query(FOUR);
        assert_eq!(g.len(), 4);
        assert_eq!(g[0].index, "0");
        assert_eq!(g[0].uuid, "GPU-6b1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e60");
        assert_eq!(g[0].name, "NVIDIA A100-SXM4-80GB");
        assert_eq!(g[0].bus_id, "00000000:07:00.0");
        assert_eq!(g[0].memory_total_mib, Some(81920));
        assert_eq!(g[0].memory_used_mib, Some(1234));
        assert_eq!(g[0].util_pct, Some(87));
        assert_eq!(g[0].power_w, Some(312.45));
        assert_eq!(g[0].health, Health::Healthy);
        assert_eq!(g[1].health, Health::Healthy);
        assert_eq!(
            g[2].health,
            Health::Unhealthy("2 uncorrected volatile ECC error(s)".into())
        );
        assert_eq!(
            g[3].health,
            Health::Unhealthy("pending retired pages".into())
        );
        let remap = parse_query(&FOUR.lines().next().unwrap().replace("No, No", "No, Yes"));
        assert_eq!(
            remap[0].health,
            Health::Unhealthy("a row remap failed".into())
        );
    }

    #[test]
    fn not_available_fields_are_not_faults() {
        let line = "0, GPU-0e1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e60, NVIDIA GeForce RTX 4090, 00000000:01:00.0, 24564, 13, 0, [N/A], 38, [N/A], [N/A], [Not Supported]\n";
        let g = parse_query(line);
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].health, Health::Healthy, "{g:?}");
        assert_eq!(g[0].power_w, None);
    }

    #[test]
    fn a_bad_field_marks_that_gpu_unknown_and_nothing_else() {
        let text = FOUR.replacen(", 81920, 1234,", ", lots, 1234,", 1);
        let g = parse_query(&text);
        assert_eq!(g.len(), 4);
        assert!(matches!(&g[0].health, Health::Unknown(r) if r.contains("memory.total")));
        assert_eq!(g[1].health, Health::Healthy);
    }

    #[test]
    fn hostile_output_never_panics_and_never_yields_an_assignable_gpu() {
        let long = "9".repeat(100_000);
        let inputs = [
            "",
            "\n\n",
            "garbage",
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
            ",,,,,,,,,,,",
            ",,,,,,,,,,,,,,,,,,,,,,,,,,,,,,",
            "0, GPU-\u{0}bad, x, y, 1, 1, 1, 1, 1, 0, No, No",
            "0, GPU-ünïcode, x, y, 1, 1, 1, 1, 1, 0, No, No",
            "-1, GPU-aa, x, y, -5, 1, 1, NaN, 1, -3, maybe, No",
            "0, GPU-aa, x, y, 1, 1, 1, inf, 1, 0, No, No",
            long.as_str(),
            "\u{FEFF}0, GPU-aa, \u{7}name, y, 1, 1, 1, 1, 1, 0, No, No",
        ];
        for t in inputs {
            for g in parse_query(t) {
                if g.health.is_healthy() {
                    assert!(valid_uuid(&g.uuid), "{t:?} → {g:?}");
                    assert!(!g.name.chars().any(char::is_control));
                }
                assert!(g.power_w.is_none_or(f64::is_finite));
            }
            let _ = parse_list(t);
            let _ = parse_apps(t);
        }
        assert!(!valid_uuid("GPU-a b"));
        assert!(!valid_uuid("GPU-a,b"));
        assert!(!valid_uuid("GPU-"));
        assert!(!valid_uuid(&format!("GPU-{}", "a".repeat(200))));
    }

    #[test]
    fn mig_instances_replace_their_parent() {
        let list = "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)\n  MIG 1g.5gb      Device  0: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f)\n  MIG 1g.5gb      Device  1: (UUID: MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb)\nGPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-7e6ca1d0-d33d-2b2c-524d-9e3d8d2b8a78)\n";
        let migs = parse_list(list);
        assert_eq!(migs.len(), 2);
        assert_eq!(migs[1].device, 1);
        assert_eq!(migs[1].profile, "1g.5gb");
        let q = "0, GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77, NVIDIA A100-SXM4-40GB, 00000000:07:00.0, 40960, 0, 0, 50.0, 30, 0, No, No\n1, GPU-7e6ca1d0-d33d-2b2c-524d-9e3d8d2b8a78, NVIDIA A100-SXM4-40GB, 00000000:0F:00.0, 40960, 0, 0, 50.0, 30, 0, No, No\n";
        let u = units(parse_query(q), &migs);
        let ids: Vec<&str> = u.iter().map(|g| g.index.as_str()).collect();
        assert_eq!(ids, ["0:0", "0:1", "1"]);
        assert_eq!(u[0].uuid, "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f");
        assert!(u[0].health.is_healthy());
        // A MIG line without a parent, or with a hostile uuid, is skipped.
        assert!(parse_list("  MIG 1g.5gb Device 0: (UUID: MIG-aa)\n").is_empty());
        assert!(
            parse_list("GPU 0: x (UUID: GPU-aa)\n  MIG 1g Device 0: (UUID: MIG-a;b)\n").is_empty()
        );
    }

    #[test]
    fn per_process_memory_is_summed_per_pid() {
        let a = parse_apps("4242, 1000\n4242, 24\n77, [N/A]\nx, 5\n-3, 9\n");
        assert_eq!(a.get(&4242), Some(&1024));
        assert_eq!(a.len(), 1);
    }

    #[test]
    fn a_record_written_before_gpus_were_scheduled_reads_as_no_assignment() {
        let old = r#"{"safe_id":"a","kind":"training","request_id":"r","created_unix":1.0,
            "command":"x","stdout_log":"/o","stderr_log":"/e"}"#;
        let meta: crate::workload::Meta = serde_json::from_str(old).unwrap();
        assert_eq!(meta.gpus, None);
        let mut with = serde_json::to_value(&meta).unwrap();
        with["gpus"] = serde_json::json!(["GPU-aa", "MIG-bb"]);
        let back: crate::workload::Meta = serde_json::from_value(with).unwrap();
        assert_eq!(
            back.gpus,
            Some(vec!["GPU-aa".to_string(), "MIG-bb".to_string()])
        );
    }

    #[test]
    fn an_assignment_is_read_back_from_a_running_process() {
        let run = |v: &str| {
            let mut c = Command::new("sleep")
                .arg("5")
                .env("CUDA_VISIBLE_DEVICES", v)
                .spawn()
                .unwrap();
            // Its environment is the one given only once exec has set it up.
            let proc = format!("/proc/{}", c.id());
            for _ in 0..200 {
                let comm = std::fs::read_to_string(format!("{proc}/comm")).unwrap_or_default();
                let env = std::fs::read(format!("{proc}/environ")).unwrap_or_default();
                if comm.trim() == "sleep" && !env.is_empty() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let got = assigned_in_environ(c.id() as i32);
            let _ = c.kill();
            let _ = c.wait();
            got
        };
        assert_eq!(
            run("GPU-aa,MIG-bb"),
            Some(vec!["GPU-aa".to_string(), "MIG-bb".to_string()])
        );
        assert_eq!(run(""), Some(vec![]));
        assert_eq!(run("0,1"), None, "not what the node sets");
        assert_eq!(assigned_in_environ(0), None);
        assert_eq!(assigned_in_environ(-5), None);
        assert_eq!(assigned_in_environ(i32::MAX), None);
    }

    #[test]
    fn usage_averages_and_integrates_power() {
        let g = parse_query(FOUR);
        let t0 = Instant::now();
        let mut u = Usage::default();
        let cap = Duration::from_secs(10);
        u.add(&[&g[0]], None, t0, cap);
        assert_eq!(
            u.mem_peak_mib(),
            1234,
            "the GPU's memory until its processes show"
        );
        u.add(&[&g[0]], Some(700), t0 + Duration::from_secs(3600), cap);
        assert_eq!(u.samples, 2);
        assert_eq!(u.util_avg(), 87.0);
        assert_eq!(u.util_max, 87);
        assert_eq!(u.mem_peak_mib(), 700);
        // The hour-long gap is billed at most `cap`.
        assert!((u.energy_wh - 312.45 * 10.0 / 3600.0).abs() < 1e-9);
        let mut none = Usage::default();
        none.add(&[], None, t0, cap);
        assert_eq!(none.samples, 0);
        assert_eq!(none.util_avg(), 0.0);
    }
}
