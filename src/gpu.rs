//! GPUs (D35–D38): the inventory from `nvidia-smi` (the static binary cannot load NVML), the
//! health rules, and the monitor thread that queries it off the node's loop, with a timeout
//! after which the query (its whole process group) is killed. No `nvidia-smi` on `PATH`: a
//! CPU-only node. Assignment, the node's view of health and per-workload accounting live in
//! `node/gpus.rs`.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use serde::{Deserialize, Serialize};

/// The fields the node asks for, in this order (one query serves inventory, health and
/// accounting).
pub const QUERY_FIELDS: &str = "index,uuid,name,pci.bus_id,memory.total,memory.used,utilization.gpu,power.draw,temperature.gpu,ecc.errors.uncorrected.volatile.total,retired_pages.pending,remapped_rows.failure,remapped_rows.pending";
const FIELD_COUNT: usize = 13;
/// For drivers older than row remapping (before R450), which refuse the whole query when one
/// field is unknown: the same fields without `remapped_rows.*`, read as `[N/A]`.
pub const LEGACY_FIELDS: &str = "index,uuid,name,pci.bus_id,memory.total,memory.used,utilization.gpu,power.draw,temperature.gpu,ecc.errors.uncorrected.volatile.total,retired_pages.pending";
/// Per-process GPU memory, matched against each workload's process group.
pub const APPS_FIELDS: &str = "pid,used_memory,gpu_uuid";
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

/// One schedulable unit: a whole GPU, or a GPU instance of a MIG GPU (then `index` is `"0:1"`,
/// `parent` the physical GPU and the readings are the whole board's, shared with its other
/// instances).
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
    /// A MIG unit's physical GPU (its UUID); `None` for a whole GPU.
    pub parent: Option<String>,
    /// A MIG unit's devices (compute instances of one GPU instance, which share its memory):
    /// the first is `uuid`, the one a workload is given. Empty for a whole GPU.
    pub members: Vec<String>,
    /// A MIG unit whose board has other GPU instances: the board's readings (utilisation,
    /// power, temperature) are not its own. False for a whole GPU, and for a board in MIG mode
    /// with a single GPU instance.
    pub shared: bool,
}

impl Gpu {
    /// A GPU known only from what the driver said about it (an error line naming its bus id,
    /// kept as the driver spelled it): counted, never assignable.
    fn named_in_error(bus_id: &str, words: &str) -> Gpu {
        Gpu {
            index: "?".into(),
            uuid: String::new(),
            name: String::new(),
            bus_id: clean_text(bus_id, 32),
            memory_total_mib: None,
            memory_used_mib: None,
            util_pct: None,
            power_w: None,
            temperature_c: None,
            health: Health::Unhealthy(words.to_string()),
            parent: None,
            members: Vec::new(),
            shared: false,
        }
    }

    /// The same GPU with no readings and this reason to be unhealthy.
    fn gone(&self, why: &str) -> Gpu {
        Gpu {
            health: Health::Unhealthy(why.to_string()),
            memory_used_mib: None,
            util_pct: None,
            power_w: None,
            temperature_c: None,
            ..self.clone()
        }
    }

    /// Whether `uuid` is this unit (or one of its MIG devices).
    pub fn is(&self, uuid: &str) -> bool {
        !uuid.is_empty() && (self.uuid == uuid || self.members.iter().any(|m| m == uuid))
    }
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
        /// The GPUs each process has a compute context on: pid → GPU UUIDs (D59: which GPUs
        /// the services use).
        app_gpus: BTreeMap<i32, Vec<String>>,
        /// Why the query failed as a whole (timeout, the driver's words), when it did.
        error: Option<String>,
        at: Instant,
    },
}

/// The driver's words for "no data", bracketed or not: the board or this driver does not report
/// the field (`[N/A]`, `[Not Supported]`), the driver no longer does (`[Requested functionality
/// has been deprecated]`, printed by driver 610 for six fields), or its NVML library lacks the
/// function (`[Function Not Found]`). None of them is a fault.
const NO_DATA: [&str; 4] = [
    "n/a",
    "not supported",
    "requested functionality has been deprecated",
    "function not found",
];

/// Empty, or one of [`NO_DATA`]: the driver does not report it.
fn not_reported(v: &str) -> bool {
    let t = v.trim();
    let inner = t
        .strip_prefix('[')
        .and_then(|x| x.strip_suffix(']'))
        .unwrap_or(t)
        .trim();
    inner.is_empty() || NO_DATA.iter().any(|n| inner.eq_ignore_ascii_case(n))
}

/// A bracketed value that is not "no data" (`[Unknown Error]`, `[GPU requires reset]`, `[GPU is
/// lost]`, `[Insufficient Permissions]`, …): the driver's own words for a failure.
fn bracketed_error(v: &str) -> Option<&str> {
    let t = v.trim();
    (t.starts_with('[') && t.ends_with(']') && !not_reported(t)).then_some(t)
}

/// A reading that is either absent (`Ok(None)`: not reported, or any bracketed value, which the
/// health columns judge) or parses (`Ok(Some)`); anything else is an error naming the field.
fn field<T: std::str::FromStr>(name: &str, v: &str) -> Result<Option<T>, String> {
    if not_reported(v) || bracketed_error(v).is_some() {
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

/// A PCI bus id in one spelling (`00000000:0B:00.0` in the query, `0000:0B:00.0` in error
/// lines): `b:0b:00.0`-like, lower case, the domain without leading zeros.
pub fn bus_key(id: &str) -> Option<String> {
    let mut parts = id.trim().split(':');
    let (Some(domain), Some(bus), Some(devfn), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let (dev, func) = devfn.split_once('.')?;
    let dev = u8::from_str_radix(dev, 16).ok()?;
    let func = u8::from_str_radix(func, 16).ok()?;
    Some(format!("{domain:x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// The bus id an error line of `nvidia-smi` names (`Unable to determine the device handle for
/// GPU 0000:0B:00.0: Unknown Error`, also spelled `GPU0000:0B:00.0`), as [`bus_key`].
pub fn bus_named_in(line: &str) -> Option<String> {
    bus_in(line).map(|(key, _)| key)
}

/// The bus id an error line names: its [`bus_key`] and the driver's own spelling.
fn bus_in(line: &str) -> Option<(String, String)> {
    let mut rest = line;
    while let Some(at) = rest.find("GPU") {
        let after = rest.get(at.saturating_add(3)..).unwrap_or("");
        let token: String = after
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_hexdigit() || *c == ':' || *c == '.')
            .collect();
        let token = token.trim_end_matches([':', '.']);
        if let Some(k) = bus_key(token) {
            return Some((k, token.to_string()));
        }
        rest = after;
    }
    None
}

/// A line of the CSV answer, as opposed to a message of the driver's (whose first field is
/// not an index).
fn is_gpu_line(line: &str) -> bool {
    line.split(',')
        .next()
        .is_some_and(|i| i.trim().parse::<u32>().is_ok())
        && line.contains(',')
}

/// Parses the output of `nvidia-smi --query-gpu=QUERY_FIELDS --format=csv,noheader,nounits`.
/// Never fails: a GPU line that cannot be read becomes a GPU in state unknown (so the count
/// stays true), a field that does not parse marks its GPU unknown. Returns the GPUs (each UUID
/// once: a repeated one keeps the worst health) and the lines that are the driver's messages.
pub fn parse_answer(text: &str) -> (Vec<Gpu>, Vec<String>) {
    let mut out: Vec<Gpu> = Vec::new();
    let mut said = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if !is_gpu_line(line) {
            said.push(clean_text(line, 300));
            continue;
        }
        let g = parse_line(n, line);
        if let Some(first) = out
            .iter_mut()
            .find(|o| !g.uuid.is_empty() && o.uuid == g.uuid)
        {
            if first.health.is_healthy() && !g.health.is_healthy() {
                first.health = g.health;
            }
            continue;
        }
        out.push(g);
    }
    (out, said)
}

/// The GPUs of [`parse_answer`].
pub fn parse_query(text: &str) -> Vec<Gpu> {
    parse_answer(text).0
}

fn parse_line(n: usize, line: &str) -> Gpu {
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
    let mut bad: Vec<String> = Vec::new();
    // The health columns: a bracketed error there is the driver saying it cannot tell (D56).
    for (name, i) in [
        ("ecc.errors.uncorrected.volatile.total", 9),
        ("retired_pages.pending", 10),
        ("remapped_rows.failure", 11),
        ("remapped_rows.pending", 12),
    ] {
        if let Some(e) = bracketed_error(col(i)) {
            bad.push(format!("{name} reads {}", clean_text(e, 80)));
        }
    }
    let mut flag = |name: &str, v: &str| {
        if bracketed_error(v).is_some() {
            return None;
        }
        match yes_no(name, v) {
            Ok(x) => x,
            Err(e) => {
                problems.push(e);
                None
            }
        }
    };
    let retired = flag("retired_pages.pending", col(10));
    let remap = flag("remapped_rows.failure", col(11));
    let remap_pending = flag("remapped_rows.pending", col(12));
    if let Some(e) = ecc.filter(|e| *e > 0) {
        bad.insert(0, format!("{e} uncorrected volatile ECC error(s)"));
    }
    if retired == Some(true) {
        bad.push("pending retired pages".into());
    }
    if remap == Some(true) {
        bad.push("a row remap failed".into());
    }
    if remap_pending == Some(true) {
        bad.push("a row remap is pending (the GPU needs a reset)".into());
    }
    let health = if !bad.is_empty() {
        Health::Unhealthy(bad.join("; "))
    } else if !problems.is_empty() {
        Health::Unknown(problems.join("; "))
    } else {
        Health::Healthy
    };
    Gpu {
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
        parent: None,
        members: Vec::new(),
        shared: false,
    }
}

/// A MIG device from `nvidia-smi -L`.
#[derive(Debug, Clone, PartialEq)]
pub struct Mig {
    pub parent_uuid: String,
    pub device: u32,
    pub profile: String,
    pub uuid: String,
}

/// Parses `nvidia-smi -L`: `GPU 0: NAME (UUID: GPU-…)` lines, each followed by its
/// `  MIG 1g.5gb Device 0: (UUID: MIG-…)` lines. Lines that do not read are skipped, and a
/// MIG UUID listed twice counts once.
pub fn parse_list(text: &str) -> Vec<Mig> {
    let mut out: Vec<Mig> = Vec::new();
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
            if out.iter().any(|m| m.uuid == u) {
                continue;
            }
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

/// The GPUs of each process in the compute-apps list (`pid, used_memory, gpu_uuid` lines; a
/// line without a valid UUID is skipped).
pub fn parse_app_gpus(text: &str) -> BTreeMap<i32, Vec<String>> {
    let mut out: BTreeMap<i32, Vec<String>> = BTreeMap::new();
    for line in text.lines() {
        let cols: Vec<&str> = line.split(',').map(str::trim).collect();
        let (Some(pid), Some(uuid)) = (cols.first(), cols.get(2)) else {
            continue;
        };
        let Ok(pid) = pid.parse::<i32>() else {
            continue;
        };
        if pid > 0 && valid_uuid(uuid) {
            let e = out.entry(pid).or_default();
            if !e.iter().any(|u| u == uuid) {
                e.push((*uuid).to_string());
            }
        }
    }
    out
}

/// A compute-instance profile (`1c.3g.71gb`): its compute slices, its GPU instance's profile
/// (`3g.71gb`) and that instance's slices. `None` for a GPU instance's own profile.
fn compute_instance(profile: &str) -> Option<(u32, &str, u32)> {
    let (c, gi) = profile.split_once('.')?;
    let c = c.strip_suffix('c')?.parse::<u32>().ok()?;
    let g = gi
        .split_once('.')?
        .0
        .strip_suffix('g')?
        .parse::<u32>()
        .ok()?;
    Some((c, gi, g))
}

/// The GPU instances among one GPU's MIG devices: `nvidia-smi -L` lists the compute instances
/// of one GPU instance one after the other, named `<c>c.<instance profile>`, until their
/// slices fill it (`1c.3g.71gb` + `2c.3g.71gb` are one `3g.71gb` instance).
fn gpu_instances<'a>(devices: &[&'a Mig]) -> Vec<(String, Vec<&'a Mig>)> {
    let mut out: Vec<(String, Vec<&'a Mig>)> = Vec::new();
    let mut left = 0u32;
    let mut open: Option<String> = None;
    for m in devices {
        match compute_instance(&m.profile) {
            Some((c, gi, g)) => {
                if open.as_deref() == Some(gi) && left > 0 {
                    if let Some((_, last)) = out.last_mut() {
                        last.push(m);
                        left = left.saturating_sub(c);
                        continue;
                    }
                }
                out.push((gi.to_string(), vec![m]));
                open = Some(gi.to_string());
                left = g.saturating_sub(c);
            }
            None => {
                out.push((m.profile.clone(), vec![m]));
                open = None;
                left = 0;
            }
        }
    }
    out
}

/// The schedulable units: a GPU with MIG devices is replaced by its GPU instances (D56), its
/// health and board readings carried over.
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
        let instances = gpu_instances(&mine);
        let shared = instances.len() > 1;
        for (profile, members) in instances {
            let Some(first) = members.first() else {
                continue;
            };
            out.push(Gpu {
                index: format!("{}:{}", g.index, first.device),
                uuid: first.uuid.clone(),
                name: format!("{} MIG {profile}", g.name),
                // Its GPU instance's own, from `nvidia-smi -q` ([`size_mig_units`]).
                memory_total_mib: None,
                parent: Some(g.uuid.clone()),
                members: members.iter().map(|m| m.uuid.clone()).collect(),
                shared,
                ..g.clone()
            });
        }
    }
    out
}

/// The memory of each MIG device that `nvidia-smi -q` lists: (its GPU's [`bus_key`], its
/// device index as `-L` numbers it) → MiB, the `Total` of the device's `FB Memory Usage`
/// (`Shared FB Memory Usage` on recent drivers: compute instances of one GPU instance share
/// it). A block without an `Index` line takes its place among its GPU's MIG devices.
pub fn parse_mig_memory(text: &str) -> BTreeMap<(String, u32), u64> {
    let mut out = BTreeMap::new();
    let mut bus: Option<String> = None;
    // The MIG device block being read: its indent, index, and the indent of its memory section.
    let mut block: Option<(usize, Option<u32>)> = None;
    let mut fb: Option<usize> = None;
    let mut count = 0u32;
    for line in text.lines() {
        let t = line.trim();
        if t.is_empty() {
            continue;
        }
        let indent = line.len().saturating_sub(line.trim_start().len());
        if indent == 0 {
            if let Some(id) = t.strip_prefix("GPU ") {
                bus = bus_key(id);
                (block, fb, count) = (None, None, 0);
            }
            continue;
        }
        if t == "MIG Device" {
            block = Some((indent, None));
            fb = None;
            count = count.saturating_add(1);
            continue;
        }
        let Some((at, index)) = block.as_mut() else {
            continue;
        };
        if indent <= *at {
            (block, fb) = (None, None);
            continue;
        }
        if fb.is_some_and(|f| indent <= f) {
            fb = None;
        }
        let (k, v) = t
            .split_once(':')
            .map_or((t, ""), |(k, v)| (k.trim(), v.trim()));
        if k == "Index" {
            *index = v.parse().ok();
        } else if t.ends_with("FB Memory Usage") {
            fb = Some(indent);
        } else if k == "Total" && fb.is_some() {
            let mib = v
                .strip_suffix("MiB")
                .and_then(|n| n.trim().parse::<u64>().ok());
            let device = index.or_else(|| count.checked_sub(1));
            if let (Some(b), Some(d), Some(mib)) = (bus.as_ref(), device, mib) {
                out.insert((b.clone(), d), mib);
            }
        }
    }
    out
}

/// Gives each MIG unit its GPU instance's memory (by its first device's UUID), where known.
fn size_mig_units(units: &mut [Gpu], sizes: &BTreeMap<String, u64>) {
    for u in units.iter_mut().filter(|u| u.parent.is_some()) {
        u.memory_total_mib = sizes.get(&u.uuid).copied();
    }
}

#[derive(Debug)]
pub enum RunError {
    NotFound,
    TimedOut,
    Failed(String),
}

/// What one `nvidia-smi` call printed, and its exit code (none when a signal ended it, or it
/// outlived the SIGKILL of its group).
#[derive(Debug, Clone, Default)]
pub struct Output {
    pub stdout: String,
    pub stderr: String,
    pub code: Option<i32>,
}

impl Output {
    /// Its stderr lines (the driver's words), cleaned.
    fn stderr_lines(&self) -> Vec<String> {
        self.stderr
            .lines()
            .map(|l| clean_text(l, 300))
            .filter(|l| !l.is_empty())
            .collect()
    }
}

/// Runs `nvidia-smi ARGS` in its own process group; what it printed, or why not. At `timeout`
/// the whole group is killed, and so is a group still alive once the output has ended: no
/// process of it is left behind.
pub fn run(args: &[&str], timeout: Duration) -> Result<Output, RunError> {
    run_program(std::ffi::OsStr::new("nvidia-smi"), args, timeout)
}

fn run_program(
    program: &std::ffi::OsStr,
    args: &[&str],
    timeout: Duration,
) -> Result<Output, RunError> {
    // Without PATH, musl's execvp default (glibc's is a part of it).
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/bin:/usr/bin".into());
    let Some(exe) = on_path(program, &path) else {
        return Err(RunError::NotFound);
    };
    let failed = |e: std::io::Error| RunError::Failed(format!("cannot run nvidia-smi: {e}"));
    // The node's environment with `LC_ALL=C`, less its secrets (D47: nvidia-smi has no use
    // for the API key or the broker's password).
    let dropped = |k: &std::ffi::OsStr| {
        k == "LC_ALL" || crate::workload::NODE_ONLY_VARS.iter().any(|s| k == *s)
    };
    let env = std::env::vars_os().filter(|(k, _)| !dropped(k));
    let cwd = std::env::current_dir()
        .ok()
        .filter(|d| d.is_dir())
        .unwrap_or_else(|| std::path::PathBuf::from("/"));
    // Started as a workload is (D46.1, D51): a process group of its own, no descriptor of the
    // node (its broker socket) and no blocked signal, so a hung one dies of the SIGKILL of its
    // group.
    let mut cmd = std::process::Command::new(&exe);
    std::os::unix::process::CommandExt::arg0(&mut cmd, program);
    cmd.args(args)
        .env_clear()
        .envs(env)
        .env("LC_ALL", "C")
        .current_dir(cwd)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    crate::fds::harden(&mut cmd);
    let mut child = match crate::workload::reaper::spawn(&mut cmd) {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(RunError::NotFound),
        Err(e) => return Err(failed(e)),
    };
    let (bufs, result) = match (child.stdout.take(), child.stderr.take()) {
        (Some(mut out), Some(mut err)) => read_both(&mut out, &mut err, timeout),
        _ => (
            [Vec::new(), Vec::new()],
            Err(RunError::Failed("no pipes".into())),
        ),
    };
    let ended = reap(&mut child, result.is_err());
    let code = ended.and_then(|s| s.code());
    if ended.is_some() {
        crate::workload::reaper::waited(child.id());
    }
    stuck(ended.is_none().then_some(child));
    let [so, se] = bufs;
    result.map(|()| Output {
        stdout: String::from_utf8_lossy(&so).into_owned(),
        stderr: String::from_utf8_lossy(&se).into_owned(),
        code,
    })
}

/// Where `program` is: itself when it names a path, else the first file of that name in
/// `PATH`'s folders that this process may execute, as `execvp` looks (empty entries, the
/// current folder, are skipped).
fn on_path(program: &std::ffi::OsStr, path: &std::ffi::OsStr) -> Option<std::path::PathBuf> {
    let runnable = |p: &Path| {
        let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else {
            return false;
        };
        // SAFETY: faccessat on a NUL-terminated path we own; no other pointer.
        let may =
            unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), libc::X_OK, libc::AT_EACCESS) };
        may == 0 && std::fs::metadata(p).is_ok_and(|m| m.is_file())
    };
    if program.as_encoded_bytes().contains(&b'/') {
        let p = Path::new(program);
        return runnable(p).then(|| p.to_path_buf());
    }
    std::env::split_paths(path)
        .filter(|d| !d.as_os_str().is_empty())
        .map(|d| d.join(program))
        .find(|p| runnable(p))
}

/// Reads the child's two pipes until both end, `timeout` passes or the output grows past
/// [`MAX_OUTPUT`]; what each printed so far comes back either way.
fn read_both(
    out: &mut std::process::ChildStdout,
    err: &mut std::process::ChildStderr,
    timeout: Duration,
) -> ([Vec<u8>; 2], Result<(), RunError>) {
    let deadline = Instant::now().checked_add(timeout);
    let mut bufs: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
    let mut open = [true, true];
    let fds = [out.as_raw_fd(), err.as_raw_fd()];
    let mut chunk = [0u8; 8192];
    let result = loop {
        if !open.iter().any(|o| *o) {
            break Ok(());
        }
        let left = deadline.map_or(timeout, |d| d.saturating_duration_since(Instant::now()));
        if left.is_zero() {
            break Err(RunError::TimedOut);
        }
        let mut pfds: Vec<libc::pollfd> = fds
            .iter()
            .zip(open.iter())
            .map(|(fd, o)| libc::pollfd {
                fd: if *o { *fd } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1);
        // SAFETY: a valid array of pollfds (negative fds are ignored) that lives across the
        // call; its length is the count passed.
        let rc = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
        if rc < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            break Err(RunError::Failed("poll failed".into()));
        }
        if rc == 0 {
            continue;
        }
        let mut failed = None;
        for (i, p) in pfds.iter().enumerate() {
            if p.fd < 0 || p.revents == 0 {
                continue;
            }
            let r = if i == 0 {
                out.read(&mut chunk)
            } else {
                err.read(&mut chunk)
            };
            match r {
                Ok(0) => {
                    if let Some(o) = open.get_mut(i) {
                        *o = false;
                    }
                }
                Ok(n) => {
                    if let Some(b) = bufs.get_mut(i) {
                        b.extend_from_slice(chunk.get(..n).unwrap_or(&[]));
                    }
                    if bufs.iter().map(Vec::len).sum::<usize>() > MAX_OUTPUT {
                        failed = Some(RunError::Failed("nvidia-smi printed too much".into()));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    failed = Some(RunError::Failed(format!("cannot read nvidia-smi: {e}")));
                }
            }
        }
        if let Some(f) = failed {
            break Err(f);
        }
    };
    (bufs, result)
}

/// Kills the child's group when `failed` (a timeout or a read error), then waits for the
/// leader; a leader that outlives its output is killed with its group. How it ended, unless it
/// outlived even that.
fn reap(child: &mut std::process::Child, failed: bool) -> Option<std::process::ExitStatus> {
    let pid = i32::try_from(child.id()).unwrap_or(0);
    let kill = || {
        if pid > 1 {
            // SAFETY: the group is the child's own (it leads it) and the leader is not waited
            // for yet, so its number is no one else's.
            unsafe {
                libc::killpg(pid, libc::SIGKILL);
            }
        }
    };
    if failed {
        kill();
    }
    let mut status = None;
    for round in 0..60 {
        match child.try_wait() {
            Ok(Some(s)) => {
                status = Some(s);
                break;
            }
            Ok(None) => {
                if round == 50 {
                    kill();
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(_) => break,
        }
    }
    status
}

/// Runs that outlived the SIGKILL of their group (stuck in the kernel, a hung driver), waited
/// for at each later run rather than by blocking the GPU thread.
static STUCK: std::sync::Mutex<Vec<std::process::Child>> = std::sync::Mutex::new(Vec::new());

/// Waits for the stuck runs that have ended since; keeps `child` among them when given.
fn stuck(child: Option<std::process::Child>) {
    let mut left = STUCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    left.extend(child);
    left.retain_mut(|c| {
        let running = matches!(c.try_wait(), Ok(None));
        if !running {
            crate::workload::reaper::waited(c.id());
        }
        running
    });
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

/// Sorts GPUs by index (`"2"` before `"10"`; GPUs known only from an error line last).
fn by_index(gpus: &mut [Gpu]) {
    gpus.sort_by_key(|g| {
        g.index
            .split(':')
            .next()
            .and_then(|i| i.parse::<u32>().ok())
            .unwrap_or(u32::MAX)
    });
}

/// Adds a GPU for each error line naming a bus id that no GPU in `gpus` has (D57: a GPU the
/// driver names but cannot reach is counted, unhealthy, in the driver's words).
fn add_named(gpus: &mut Vec<Gpu>, said: &[String]) {
    for l in said {
        let Some((k, spelled)) = bus_in(l) else {
            continue;
        };
        if gpus
            .iter()
            .any(|g| bus_key(&g.bus_id).as_deref() == Some(k.as_str()))
        {
            continue;
        }
        gpus.push(Gpu::named_in_error(&spelled, l));
    }
}

/// The error line of `said` that names this GPU's bus id, if one does.
fn line_naming<'a>(g: &Gpu, said: &'a [String]) -> Option<&'a String> {
    let key = bus_key(&g.bus_id)?;
    said.iter()
        .find(|l| bus_named_in(l).as_deref() == Some(key.as_str()))
}

/// Judges one answer to the GPU query (D55, D57): the whole GPUs it lists, plus each GPU seen
/// before (`seen`, by UUID, updated here) that it no longer lists, and each one its error lines
/// name, unhealthy in the driver's own words (from stdout or stderr). When it lists no GPU at
/// all the query failed as a whole: every GPU ever seen is unhealthy, and the error says why.
///
/// The reasons hold what `nvidia-smi` printed, never its exit code: whether the exit code can
/// be had depends on who reaps the process first, and a reason must read the same at every
/// look (it is compared to log only changes, and shown to the backend).
pub fn judge(out: &Output, seen: &mut BTreeMap<String, Gpu>) -> (Vec<Gpu>, Option<String>) {
    let (mut gpus, mut said) = parse_answer(&out.stdout);
    said.extend(out.stderr_lines());
    let words = said
        .iter()
        .take(3)
        .map(|l| crate::logtext::shown(l).to_string())
        .collect::<Vec<_>>()
        .join(" / ");
    if gpus.iter().all(|g| g.uuid.is_empty()) {
        let why = if words.is_empty() {
            "nvidia-smi reported no GPU".to_string()
        } else {
            format!("nvidia-smi failed: {words}")
        };
        let mut all: Vec<Gpu> = seen
            .values()
            .map(|g| g.gone(line_naming(g, &said).map_or(why.as_str(), String::as_str)))
            .collect();
        add_named(&mut all, &said);
        by_index(&mut all);
        return (all, Some(why));
    }
    let mut missing = Vec::new();
    for (uuid, g) in seen.iter() {
        if gpus.iter().any(|x| x.uuid == *uuid) {
            continue;
        }
        let why = match line_naming(g, &said) {
            Some(l) => l.clone(),
            None if !words.is_empty() => {
                format!("no longer listed by nvidia-smi, which said: {words}")
            }
            None => "no longer listed by nvidia-smi".into(),
        };
        missing.push(g.gone(&why));
    }
    for g in gpus.iter().filter(|g| !g.uuid.is_empty()) {
        seen.insert(g.uuid.clone(), g.clone());
    }
    gpus.extend(missing);
    add_named(&mut gpus, &said);
    by_index(&mut gpus);
    (gpus, None)
}

/// What the monitor keeps from one query to the next.
#[derive(Debug, Default)]
pub struct Known {
    /// The MIG devices of the last `nvidia-smi -L`.
    pub migs: Vec<Mig>,
    /// Every GPU seen since start, by UUID: on a timeout or failure those GPUs are reported
    /// unhealthy, and one missing from an answer stays, unhealthy (D57).
    pub seen: BTreeMap<String, Gpu>,
    /// The memory of each MIG device's GPU instance, by the device's UUID (`nvidia-smi -q`,
    /// asked once per new MIG layout: it changes only with the layout, and so do the UUIDs).
    pub mig_mib: BTreeMap<String, u64>,
    /// The MIG devices `-q` last answered for: it is not asked again until they change (a
    /// driver whose `-q` names no MIG memory is not asked at every inventory).
    pub mig_asked: Vec<String>,
}

/// One call of `nvidia-smi ARGS`: [`run`] with the monitor's time limit (tests answer with a
/// stand-in).
pub type Smi<'a> = dyn FnMut(&[&str]) -> Result<Output, RunError> + 'a;

/// One full query: the GPUs (with MIG instances when `list`), and per-process memory.
pub fn query(timing: &Timing, known: &mut Known, list: bool) -> Snapshot {
    query_with(
        &mut |args: &[&str]| run(args, timing.timeout),
        timing.timeout,
        known,
        list,
    )
}

/// The GPU query, with a driver that refuses `remapped_rows.*` (before R450) asked again
/// without them (read as `[N/A]`).
fn ask_gpus(smi: &mut Smi<'_>) -> Result<Output, RunError> {
    let q = format!("--query-gpu={QUERY_FIELDS}");
    let answer = smi(&[&q, "--format=csv,noheader,nounits"]);
    let refused = |o: &Output| {
        let f = "is not a valid field to query";
        o.stdout.contains(f) || o.stderr.contains(f)
    };
    if !matches!(&answer, Ok(o) if refused(o)) {
        return answer;
    }
    let legacy = format!("--query-gpu={LEGACY_FIELDS}");
    smi(&[&legacy, "--format=csv,noheader,nounits"]).map(|o| Output {
        stdout: o
            .stdout
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                if is_gpu_line(l) {
                    format!("{l}, [N/A], [N/A]\n")
                } else {
                    format!("{l}\n")
                }
            })
            .collect(),
        ..o
    })
}

/// Learns the memory of MIG devices not sized yet from `nvidia-smi -q` (their GPU by its bus
/// id, the device by its index); forgets devices no longer listed.
fn learn_mig_memory(smi: &mut Smi<'_>, gpus: &[Gpu], known: &mut Known) {
    let Known {
        migs,
        mig_mib,
        mig_asked,
        ..
    } = known;
    mig_mib.retain(|u, _| migs.iter().any(|m| m.uuid == *u));
    let layout: Vec<String> = migs.iter().map(|m| m.uuid.clone()).collect();
    if migs.iter().all(|m| mig_mib.contains_key(&m.uuid)) || *mig_asked == layout {
        return;
    }
    // A call that did not run (timed out) is tried again at the next inventory.
    let Ok(o) = smi(&["-q"]) else {
        return;
    };
    *mig_asked = layout;
    let sizes = parse_mig_memory(&o.stdout);
    for m in migs.iter() {
        let bus = gpus
            .iter()
            .find(|g| g.uuid == m.parent_uuid)
            .and_then(|g| bus_key(&g.bus_id));
        if let Some(mib) = bus.and_then(|b| sizes.get(&(b, m.device))) {
            mig_mib.insert(m.uuid.clone(), *mib);
        }
    }
}

/// [`query`] through `smi`; `timeout` is only named in the reason of a query that timed out.
pub fn query_with(smi: &mut Smi<'_>, timeout: Duration, known: &mut Known, list: bool) -> Snapshot {
    let at = Instant::now();
    let failed = |gpus: Vec<Gpu>, why: String, known: &Known| {
        let mut gpus = gpus;
        by_index(&mut gpus);
        let mut gpus = units(gpus, &known.migs);
        size_mig_units(&mut gpus, &known.mig_mib);
        Snapshot::Gpus {
            gpus,
            apps: BTreeMap::new(),
            app_gpus: BTreeMap::new(),
            error: Some(why),
            at,
        }
    };
    let gone = |why: &str, known: &Known| -> Vec<Gpu> {
        known.seen.values().map(|g| g.gone(why)).collect()
    };
    let out = match ask_gpus(smi) {
        Ok(o) => o,
        Err(RunError::NotFound) => return Snapshot::Absent,
        Err(RunError::TimedOut) => {
            let why = format!(
                "nvidia-smi did not answer within {}s",
                timeout.as_secs_f64()
            );
            return failed(gone(&why, known), why, known);
        }
        Err(RunError::Failed(e)) => return failed(gone(&e, known), e, known),
    };
    let (gpus, error) = judge(&out, &mut known.seen);
    if let Some(e) = error {
        return failed(gpus, e, known);
    }
    if list {
        match smi(&["-L"]) {
            Ok(o) => known.migs = parse_list(&o.stdout),
            Err(e) => log::warn!("nvidia-smi -L failed ({e:?}); MIG instances as last seen"),
        }
        learn_mig_memory(smi, &gpus, known);
    }
    let apps_text = smi(&[
        &format!("--query-compute-apps={APPS_FIELDS}"),
        "--format=csv,noheader,nounits",
    ])
    .map(|o| o.stdout)
    .unwrap_or_default();
    let (apps, app_gpus) = (parse_apps(&apps_text), parse_app_gpus(&apps_text));
    let mut gpus = units(gpus, &known.migs);
    size_mig_units(&mut gpus, &known.mig_mib);
    Snapshot::Gpus {
        gpus,
        apps,
        app_gpus,
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
    // Test builds only (`test-hooks`): the thread ends once this file exists (the loop must
    // then exit, not spin).
    let stop = std::env::var_os("CYBERWAVE_TEST_GPU_MONITOR_STOP_FILE")
        .filter(|_| cfg!(feature = "test-hooks"))
        .map(std::path::PathBuf::from);
    let mut known = Known::default();
    let mut holding = false;
    let mut next_list = Instant::now();
    loop {
        let now = Instant::now();
        let list = now >= next_list;
        if list {
            next_list = now.checked_add(timing.inventory).unwrap_or(now);
        }
        let snap = query(&timing, &mut known, list);
        if tx.send(snap).is_err() || stop.as_deref().is_some_and(Path::exists) {
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
    // Bytes, not text: a process may name itself with bytes that are not UTF-8, and must not
    // drop out of the match for that.
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    let stat = String::from_utf8_lossy(&stat);
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

/// Accounting of one workload's GPUs (D38, D56), from the samples taken while it held them.
/// Board-level figures (utilisation, power, energy) are taken once per physical GPU, however
/// many of its units the workload holds; on a MIG slice they are the board's, shared with its
/// other instances (`shared`), and the slice's memory is its own processes' only.
#[derive(Debug, Clone, Default)]
pub struct Usage {
    pub samples: u64,
    util_sum: f64,
    pub util_max: u64,
    /// Peak memory of the workload's own processes, once any of them was seen on its GPUs.
    own_peak_mib: Option<u64>,
    /// Peak memory in use on its whole GPUs (exclusive, so normally all its own).
    gpu_peak_mib: u64,
    pub energy_wh: f64,
    /// It holds a MIG slice of a board with other GPU instances: the board's figures are
    /// shared with whatever runs on them.
    pub shared: bool,
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
        // Once per physical GPU.
        let mut boards: Vec<&Gpu> = Vec::new();
        for g in mine {
            let board = g.parent.as_deref().unwrap_or(&g.uuid);
            if !boards
                .iter()
                .any(|b| b.parent.as_deref().unwrap_or(&b.uuid) == board)
            {
                boards.push(g);
            }
        }
        self.shared |= mine.iter().any(|g| g.shared);
        let utils: Vec<u64> = boards.iter().filter_map(|g| g.util_pct).collect();
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
        let used = boards
            .iter()
            .filter(|g| g.parent.is_none())
            .filter_map(|g| g.memory_used_mib)
            .fold(0u64, u64::saturating_add);
        self.gpu_peak_mib = self.gpu_peak_mib.max(used);
        let power: f64 = boards.iter().filter_map(|g| g.power_w).sum();
        if let Some(last) = self.last {
            let dt = at.saturating_duration_since(last).min(cap);
            self.energy_wh += power * dt.as_secs_f64() / 3600.0;
        }
        self.last = Some(at);
    }

    /// The workload's own processes' peak when they were ever seen in the per-process list
    /// (the only true figure on a MIG slice, 0 there until they are), else its GPUs' peak.
    pub fn mem_peak_mib(&self) -> u64 {
        self.own_peak_mib.unwrap_or(self.gpu_peak_mib)
    }

    /// The mean utilisation over the samples that reported one; `None` when none did (a MIG
    /// board reports none).
    pub fn util_avg(&self) -> Option<f64> {
        (self.samples > 0).then(|| self.util_sum / self.samples as f64)
    }
}

/// One `doctor` line about an unhealthy GPU.
fn doctor_line(g: &Gpu) -> String {
    let reason = g.health.reason().unwrap_or("");
    if g.uuid.is_empty() {
        format!("GPU at {} is {}: {reason}", g.bus_id, g.health.label())
    } else {
        format!(
            "GPU {} {} ({}) is {}: {reason}",
            g.index,
            g.uuid,
            g.name,
            g.health.label()
        )
    }
}

/// `doctor`'s lines about GPUs: (level, detail).
pub fn doctor_lines(timing: &Timing) -> Vec<(&'static str, String)> {
    match query(timing, &mut Known::default(), true) {
        Snapshot::Absent => vec![(
            "WARN",
            "nvidia-smi not found: no NVIDIA GPU visible to this user (a CPU-only node)".into(),
        )],
        Snapshot::Gpus {
            error: Some(e),
            gpus,
            ..
        } => {
            let mut out = vec![("FAIL", e)];
            out.extend(gpus.iter().map(|g| ("WARN", doctor_line(g))));
            out
        }
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
                out.push(("WARN", doctor_line(g)));
            }
            out
        }
    }
}

#[cfg(test)]
pub(crate) mod real;

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPU process that names itself in bytes that are not UTF-8 is still matched to its
    /// workload by its process group.
    #[test]
    fn the_group_of_a_process_named_in_bytes_that_are_not_utf8_is_read() {
        let named = crate::scratch::NamedThread::new(c"\xff\xfe)x");
        // SAFETY: getpgrp has no preconditions.
        assert_eq!(pgid_of(named.tid), Some(unsafe { libc::getpgrp() }));
    }

    const FOUR: &str = "0, GPU-6b1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e60, NVIDIA A100-SXM4-80GB, 00000000:07:00.0, 81920, 1234, 87, 312.45, 61, 0, No, No, No\n\
1, GPU-6b1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e61, NVIDIA A100-SXM4-80GB, 00000000:0F:00.0, 81920, 0, 0, 61.20, 34, 0, No, No, No\n\
2, GPU-6b1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e62, NVIDIA A100-SXM4-80GB, 00000000:47:00.0, 81920, 0, 0, 60.80, 33, 2, No, No, No\n\
3, GPU-6b1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e63, NVIDIA A100-SXM4-80GB, 00000000:4E:00.0, 81920, 0, 0, 59.10, 33, 0, Yes, No, No\n";

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
        let remap = parse_query(
            &FOUR
                .lines()
                .next()
                .unwrap()
                .replace("No, No, No", "No, Yes, No"),
        );
        assert_eq!(
            remap[0].health,
            Health::Unhealthy("a row remap failed".into())
        );
    }

    #[test]
    fn not_available_fields_are_not_faults() {
        let line = "0, GPU-0e1f8a3e-1d3c-4c7b-9f1a-0a2b3c4d5e60, NVIDIA GeForce RTX 4090, 00000000:01:00.0, 24564, 13, 0, [N/A], 38, [N/A], [N/A], [Not Supported], [N/A]\n";
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
            "0, GPU-\u{0}bad, x, y, 1, 1, 1, 1, 1, 0, No, No, No",
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
            let _ = parse_mig_memory(t);
        }
        for l in [
            "GPU",
            "GPU ",
            "for GPU :",
            "GPU 0000:0B",
            "GPU zz:0B:00.0",
            "GPU 0000:0B:00.0.0:1",
            "Unable to determine the device handle for GPU 0000:0B:00.0",
        ] {
            let _ = bus_named_in(l);
        }
        assert_eq!(
            bus_named_in("handle for GPU0000:0B:00.0: Unknown Error").as_deref(),
            Some("0:0b:00.0")
        );
        assert_eq!(bus_key("00000000:0B:00.0"), bus_key("0000:0b:00.0"));
        assert_eq!(bus_key("0000:0B:00"), None);
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
        let q = "0, GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77, NVIDIA A100-SXM4-40GB, 00000000:07:00.0, 40960, 0, 0, 50.0, 30, 0, No, No, No\n1, GPU-7e6ca1d0-d33d-2b2c-524d-9e3d8d2b8a78, NVIDIA A100-SXM4-40GB, 00000000:0F:00.0, 40960, 0, 0, 50.0, 30, 0, No, No, No\n";
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
    fn the_gpus_of_each_process_are_read_from_the_apps_list() {
        let a = parse_app_gpus(concat!(
            "4242, 1000, GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77\n",
            "4242, 24, GPU-7e6ca1d0-d33d-2b2c-524d-9e3d8d2b8a78\n",
            "4242, 24, GPU-7e6ca1d0-d33d-2b2c-524d-9e3d8d2b8a78\n",
            "77, [N/A], MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f\n",
            "78, 5\n",
            "79, 5, GPU-a;rm -rf\n",
            "-3, 9, GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77\n",
        ));
        assert_eq!(a.get(&4242).map(Vec::len), Some(2));
        assert_eq!(
            a.get(&77).map(Vec::len),
            Some(1),
            "memory not reported: still its GPU"
        );
        assert_eq!(a.len(), 2);
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
            let mut c = std::process::Command::new("sleep")
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
    fn mig_memory_is_read_from_each_devices_own_memory_section() {
        // Older drivers say "FB Memory Usage"; a block may lack its Index (then its place);
        // BAR1 and the whole board's totals are not a device's.
        let q = "GPU 00000000:07:00.0\n    MIG Device\n        FB Memory Usage\n            Total : 4864 MiB\n            Used : 3 MiB\n        BAR1 Memory Usage\n            Total : 8191 MiB\n    MIG Device\n        Index : 5\n        Shared FB Memory Usage\n            Total                  : 9728 MiB\n    FB Memory Usage\n        Total : 40960 MiB\nGPU 00000000:0F:00.0\n    MIG Device\n        Index : 0\n        Shared FB Memory Usage\n            Total : lots\n";
        let m = parse_mig_memory(q);
        let key = |b: &str, d: u32| (bus_key(b).unwrap(), d);
        assert_eq!(m.get(&key("0:07:00.0", 0)), Some(&4864));
        assert_eq!(m.get(&key("0:07:00.0", 5)), Some(&9728));
        assert_eq!(m.len(), 2, "{m:?}");
    }

    /// `-q` is asked for the sizes of a MIG layout once: again only when the layout changes
    /// (or when the call did not run), never at every inventory.
    #[test]
    fn mig_sizes_are_asked_once_per_layout() {
        let query = "0, GPU-a, X, 00000000:07:00.0, 40960, 1, [N/A], 50.0, 30, 0, No, No, No\n";
        let list = std::cell::RefCell::new(
            "GPU 0: X (UUID: GPU-a)\n  MIG 3g.20gb Device 0: (UUID: MIG-a)\n".to_string(),
        );
        let asked = std::cell::Cell::new(0);
        // What -q does: 0 time out, 1 answer with the sizes, 2 answer without them.
        let q = std::cell::Cell::new(0u8);
        let mut smi = |args: &[&str]| {
            let stdout = match args.first().copied().unwrap_or("") {
                "-L" => list.borrow().clone(),
                "-q" => {
                    asked.set(asked.get() + 1);
                    match q.get() {
                        0 => return Err(RunError::TimedOut),
                        2 => return Ok(Output::default()),
                        _ => {}
                    }
                    "GPU 00000000:07:00.0\n    MIG Device\n        Index : 0\n        Shared FB Memory Usage\n            Total : 19968 MiB\n".into()
                }
                a if a.starts_with("--query-gpu") => query.into(),
                _ => String::new(),
            };
            Ok(Output {
                stdout,
                ..Output::default()
            })
        };
        let mut known = Known::default();
        let mib = |smi: &mut Smi<'_>, known: &mut Known| match query_with(
            smi,
            Duration::from_secs(1),
            known,
            true,
        ) {
            Snapshot::Gpus { gpus, .. } => gpus[0].memory_total_mib,
            Snapshot::Absent => panic!("absent"),
        };
        // A call that timed out is tried again; one that answered is not.
        assert_eq!(mib(&mut smi, &mut known), None);
        q.set(1);
        assert_eq!(mib(&mut smi, &mut known), Some(19968));
        assert_eq!(mib(&mut smi, &mut known), Some(19968));
        assert_eq!(asked.get(), 2);
        // A new layout whose -q names no MIG memory: asked once, then not again.
        *list.borrow_mut() =
            "GPU 0: X (UUID: GPU-a)\n  MIG 3g.20gb Device 0: (UUID: MIG-b)\n".into();
        q.set(2);
        assert_eq!(mib(&mut smi, &mut known), None);
        assert_eq!(mib(&mut smi, &mut known), None);
        assert_eq!(asked.get(), 3);
    }

    #[test]
    fn two_full_compute_instances_in_a_row_are_two_gpu_instances() {
        let two = "GPU 0: X (UUID: GPU-a)\n  MIG 1c.2g.20gb Device 0: (UUID: MIG-a)\n  MIG 1c.2g.20gb Device 1: (UUID: MIG-b)\n  MIG 1c.2g.20gb Device 2: (UUID: MIG-c)\n";
        let g = parse_query("0, GPU-a, X, 00000000:01:00.0, 1, 1, 1, 1, 1, 0, No, No, No\n");
        let u = units(g, &parse_list(two));
        assert_eq!(u.len(), 2, "{u:?}");
        assert_eq!(u[0].members, ["MIG-a", "MIG-b"]);
        assert!(u.iter().all(|x| x.shared), "two instances share the board");
        // A MIG line without its GPU's line in the query is no unit.
        assert!(units(Vec::new(), &parse_list(two)).is_empty());
        // A board in MIG mode with one GPU instance (here split in two compute instances)
        // shares nothing: its readings are that instance's.
        let one = "GPU 0: X (UUID: GPU-a)\n  MIG 3c.7g.80gb Device 0: (UUID: MIG-a)\n  MIG 4c.7g.80gb Device 1: (UUID: MIG-b)\n";
        let g = parse_query("0, GPU-a, X, 00000000:01:00.0, 1, 1, 1, 1, 1, 0, No, No, No\n");
        let u = units(g, &parse_list(one));
        assert_eq!(u.len(), 1, "{u:?}");
        assert!(!u[0].shared, "{u:?}");
    }

    #[test]
    fn guarantee_15_bracketed_errors_and_pending_remaps_are_unhealthy_na_is_not() {
        let base = "0, GPU-aa, NVIDIA H100 80GB HBM3, 00000000:00:09.0, 81559, 0, 0, 69.85, 41";
        let health = |tail: &str| parse_query(&format!("{base}, {tail}\n"))[0].health.clone();
        assert_eq!(health("0, [N/A], No, No"), Health::Healthy);
        assert_eq!(
            health("[N/A], [N/A], [Not Supported], [N/A]"),
            Health::Healthy
        );
        assert_eq!(health("N/A, N/A, N/A, N/A"), Health::Healthy);
        // "No data" in the driver's other words: a field it no longer reports (driver 610), a
        // function its NVML lacks.
        let gone = "[Requested functionality has been deprecated]";
        assert_eq!(
            health(&format!("{gone}, {gone}, {gone}, {gone}")),
            Health::Healthy
        );
        assert_eq!(
            health("[Function Not Found], [N/A], No, No"),
            Health::Healthy
        );
        for error in [
            "[GPU requires reset]",
            "[Insufficient Permissions]",
            "[Timeout]",
        ] {
            let h = health(&format!("{error}, [N/A], No, No"));
            assert!(
                matches!(&h, Health::Unhealthy(r) if r.ends_with(error)),
                "{error}: {h:?}"
            );
        }
        let bad = health("[Unknown Error], [N/A], No, No");
        assert!(
            matches!(&bad, Health::Unhealthy(r) if r.contains("ecc.errors.uncorrected.volatile.total reads [Unknown Error]")),
            "{bad:?}"
        );
        assert!(!health("0, [GPU is lost], No, No").is_healthy());
        assert!(!health("0, [N/A], [Unknown Error], No").is_healthy());
        assert!(!health("0, [N/A], No, [Unknown Error]").is_healthy());
        let pending = health("0, [N/A], No, Yes");
        assert!(
            matches!(&pending, Health::Unhealthy(r) if r.contains("row remap is pending")),
            "{pending:?}"
        );
        // A bracketed error in a reading is only an absent reading.
        let g = &parse_query(
            "0, GPU-aa, X, 00000000:00:09.0, 81559, [Unknown Error], 0, [Unknown Error], 41, 0, No, No, No\n",
        )[0];
        assert!(g.health.is_healthy());
        assert_eq!((g.memory_used_mib, g.power_w), (None, None));
    }

    #[test]
    fn guarantee_15_a_uuid_listed_twice_counts_once_with_its_worst_health() {
        let line = "0, GPU-aa, X, 00000000:01:00.0, 1, 1, 1, 1, 1, 0, No, No, No\n";
        let twice = format!("{line}{}", line.replace("0, No, No, No", "3, No, No, No"));
        let g = parse_query(&twice);
        assert_eq!(g.len(), 1, "{g:?}");
        assert!(!g[0].health.is_healthy());
        let list = "GPU 0: X (UUID: GPU-aa)\n  MIG 1g.10gb Device 0: (UUID: MIG-a)\n  MIG 1g.10gb Device 0: (UUID: MIG-a)\n";
        assert_eq!(units(parse_query(line), &parse_list(list)).len(), 1);
    }

    #[test]
    fn nvidia_smi_is_found_only_as_an_executable_file_on_path() {
        use std::os::unix::fs::PermissionsExt;
        let root = std::env::temp_dir().join(format!("cw-on-path-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (dir_named, plain, good) = (root.join("a"), root.join("b"), root.join("c"));
        std::fs::create_dir_all(dir_named.join("nvidia-smi")).unwrap();
        std::fs::create_dir_all(&plain).unwrap();
        std::fs::write(plain.join("nvidia-smi"), "#!/bin/sh\n").unwrap();
        std::fs::create_dir_all(&good).unwrap();
        std::fs::write(good.join("nvidia-smi"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(
            good.join("nvidia-smi"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        let name = std::ffi::OsStr::new("nvidia-smi");
        let path = |dirs: &[&Path]| std::env::join_paths(dirs).unwrap();
        assert_eq!(
            on_path(name, &path(&[&dir_named, &plain, &good])),
            Some(good.join("nvidia-smi"))
        );
        std::fs::copy(good.join("nvidia-smi"), root.join("nvidia-smi")).unwrap();
        let first = |dirs: &[&Path]| on_path(name, &path(dirs));
        assert_eq!(first(&[&good, &root]), Some(good.join("nvidia-smi")));
        assert_eq!(first(&[&root, &good]), Some(root.join("nvidia-smi")));
        assert_eq!(on_path(name, &path(&[&dir_named, &plain])), None);
        let direct = good.join("nvidia-smi");
        assert_eq!(
            on_path(direct.as_os_str(), std::ffi::OsStr::new("")),
            Some(direct)
        );
        assert_eq!(
            on_path(
                plain.join("nvidia-smi").as_os_str(),
                std::ffi::OsStr::new("")
            ),
            None
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn guarantee_15_a_hung_nvidia_smi_is_killed_with_its_whole_process_group() {
        let dir = std::env::temp_dir().join(format!("cw-gpu-hang-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("nvidia-smi");
        let pids = dir.join("pids");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\nsleep 3600 &\necho $! > {p}\necho $$ >> {p}\nsleep 3600\n",
                p = pids.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let t0 = Instant::now();
        let r = run_program(script.as_os_str(), &["-L"], Duration::from_millis(400));
        assert!(matches!(r, Err(RunError::TimedOut)), "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(5));
        let alive = |pid: &str| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .map(|(_, r)| r.trim_start().starts_with('Z'))
                        .map(|z| !z)
                })
                .unwrap_or(false)
        };
        let listed = std::fs::read_to_string(&pids).unwrap();
        let listed: Vec<&str> = listed.split_whitespace().collect();
        assert_eq!(listed.len(), 2);
        let mut left: Vec<&str> = listed.clone();
        for _ in 0..100 {
            left.retain(|p| alive(p));
            if left.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(left.is_empty(), "left behind: {left:?}");
        // Its stderr and exit code come back with its stdout.
        std::fs::write(&script, "#!/bin/sh\necho out; echo err >&2; exit 15\n").unwrap();
        let o = run_program(script.as_os_str(), &[], Duration::from_secs(5)).unwrap();
        assert_eq!(
            (o.stdout.as_str(), o.stderr.as_str(), o.code),
            ("out\n", "err\n", Some(15))
        );
        let _ = std::fs::remove_dir_all(&dir);
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
        assert_eq!(u.util_avg(), Some(87.0));
        assert_eq!(u.util_max, 87);
        assert_eq!(u.mem_peak_mib(), 700);
        // The hour-long gap is billed at most `cap`.
        assert!((u.energy_wh - 312.45 * 10.0 / 3600.0).abs() < 1e-9);
        let mut none = Usage::default();
        none.add(&[], None, t0, cap);
        assert_eq!(none.samples, 0);
        assert_eq!(none.util_avg(), None);
    }
}
