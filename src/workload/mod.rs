//! Workloads: the persisted record of each one, and how one is started (params file, command
//! rendering, environment, the shim). The node's event loop owns the table of active workloads
//! (`node/workloads.rs`); this module holds no state of its own.

pub mod lifecycle;
pub mod procinfo;
pub mod reaper;
pub mod shim;
pub mod spawner;
pub mod tail;
pub mod user;

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::config::Settings;
use crate::store;
use shim::{ShimArgs, Started};

pub const KINDS: [&str; 3] = ["inference", "simulate", "training"];

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The directory exists; the shim has not reported a pid yet.
    #[default]
    Starting,
    Running,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Cancel {
    pub signal: String,
    pub requested_unix: f64,
    pub grace_s: f64,
    /// Set when the cancel came from the max-runtime limit.
    #[serde(default)]
    pub timed_out: bool,
    /// Set when self-healing found the workload stale: it ends without any report.
    #[serde(default)]
    pub stale: bool,
    /// Why the node itself cancelled it (D58: its container is stopping); in the completion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The workflow a workload belongs to (from its start params), for node events (D18).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WorkflowCtx {
    pub workflow: String,
    pub execution: String,
    pub node: String,
    pub source_type: String,
    #[serde(default)]
    pub activation_index: Option<u64>,
    #[serde(default)]
    pub caller_uuid: Option<String>,
}

/// `workloads/<safe-id>/meta.json`: everything needed to report the workload after a restart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Meta {
    pub safe_id: String,
    pub kind: String,
    pub request_id: Value,
    #[serde(default)]
    pub workload_uuid: Option<String>,
    pub created_unix: f64,
    pub command: String,
    pub stdout_log: PathBuf,
    pub stderr_log: PathBuf,
    #[serde(default)]
    pub max_runtime_s: Option<f64>,
    #[serde(default)]
    pub phase: Phase,
    #[serde(default)]
    pub started: Option<Started>,
    #[serde(default)]
    pub cancel: Option<Cancel>,
    #[serde(default)]
    pub workflow: Option<WorkflowCtx>,
    /// The workload's secret for `emit` (in its environment; this file is 0600).
    #[serde(default)]
    pub event_token: String,
    /// The GPUs (UUIDs) assigned to it, exclusively (D36); `None` on a CPU-only node and in
    /// records written before GPUs were scheduled.
    #[serde(default)]
    pub gpus: Option<Vec<String>>,
    /// Set when this record was rebuilt at recovery because the original did not validate
    /// (what was wrong): the workload is tracked by what could be proven, and its end is
    /// reported as a failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub salvaged: Option<String>,
}

impl Meta {
    pub fn pid(&self) -> i32 {
        self.started.as_ref().map(|s| s.pid).unwrap_or(0)
    }

    pub fn request_id_text(&self) -> String {
        crate::protocol::messages::request_id_text(&self.request_id)
    }
}

pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The on-disk layout below the state dir.
#[derive(Debug, Clone)]
pub struct Layout {
    pub state: PathBuf,
}

impl Layout {
    pub fn workloads(&self) -> PathBuf {
        self.state.join("workloads")
    }
    pub fn dir(&self, safe_id: &str) -> PathBuf {
        self.workloads().join(safe_id)
    }
    pub fn logs(&self) -> PathBuf {
        self.state.join("workload_logs")
    }
    pub fn inputs(&self) -> PathBuf {
        self.state.join("inputs")
    }
    pub fn meta(&self, safe_id: &str) -> PathBuf {
        self.dir(safe_id).join("meta.json")
    }
    pub fn exit(&self, safe_id: &str) -> PathBuf {
        self.dir(safe_id).join("exit.json")
    }
}

pub fn save_meta(layout: &Layout, meta: &Meta) -> std::io::Result<()> {
    let json = serde_json::to_vec_pretty(meta).map_err(std::io::Error::other)?;
    store::write_atomic(&layout.meta(&meta.safe_id), &json, 0o600)
}

/// A workload's record from its directory, completed from the shim's `started.json` (the pid
/// and start times are recorded there, not in `meta.json`). `None` when either does not
/// validate; nothing is moved (for readers other than the node: `status`, `emit`).
pub fn load_meta(dir: &Path) -> Option<Meta> {
    let mut meta = parse_meta(dir).ok()?;
    if meta.started.is_none() {
        meta.started = read_json(&dir.join("started.json"));
        if meta.started.is_some() {
            meta.phase = Phase::Running;
        }
    }
    Some(meta)
}

/// A validated JSON record of at most 64 KiB (`None`: missing, unreadable or invalid; nothing
/// is moved).
pub fn read_json<T: serde::de::DeserializeOwned + store::Validate>(path: &Path) -> Option<T> {
    store::read_record(path, store::MAX_RECORD_BYTES).ok()
}

/// Like [`read_json`], but a file that is there and invalid is quarantined (the node's own
/// reads at recovery).
pub fn load_json<T: serde::de::DeserializeOwned + store::Validate>(
    path: &Path,
    what: &str,
) -> Option<T> {
    store::load_record(path, store::MAX_RECORD_BYTES, what)
}

/// The node's read of a workload's exit record in `dir` (D54): `exit.json` (quarantined when
/// invalid), else the status the supervisor left in [`shim::EXIT_LINK`] when the disk was full.
/// A status found only there is written to `exit.json` as soon as the disk takes it (then the
/// link goes; until then it stays, so a restart finds it too).
pub fn load_exit(dir: &Path) -> Option<shim::Exit> {
    let path = dir.join("exit.json");
    if let Some(exit) = load_json(&path, "workload exit record") {
        return Some(exit);
    }
    let link = dir.join(shim::EXIT_LINK);
    let exit = read_exit_link(&link)?;
    let written = serde_json::to_vec(&exit)
        .map_err(std::io::Error::other)
        .and_then(|json| store::write_atomic(&path, &json, 0o600));
    match written {
        Ok(()) => {
            let _ = std::fs::remove_file(&link);
        }
        Err(e) => log::warn!(
            "the supervisor of {} left its exit status in {} (the disk was full); reporting it from there, exit.json still cannot be written: {e}",
            store::shown(dir),
            shim::EXIT_LINK
        ),
    }
    Some(exit)
}

/// The status in an `exit.status` link: only a symbolic link (never followed) with a short
/// target in the exact form the supervisor writes; anything else is no record.
fn read_exit_link(path: &Path) -> Option<shim::Exit> {
    let md = std::fs::symlink_metadata(path).ok()?;
    if !md.file_type().is_symlink() || md.len() > 64 {
        return None;
    }
    let target = std::fs::read_link(path).ok()?;
    shim::Exit::from_link_text(target.to_str()?)
}

/// `meta.json` parsed and validated; the log paths are re-rooted in the state dir's log folder.
fn parse_meta(dir: &Path) -> Result<Meta, store::ReadError> {
    let bytes = store::read_state_file(&dir.join("meta.json"), store::MAX_RECORD_BYTES)?;
    parse_meta_bytes(&bytes, &logs_dir_of(dir))
}

/// The bytes of a `meta.json` parsed and validated (also the entry point for fuzzing); the log
/// paths are re-rooted in `logs`.
pub fn parse_meta_bytes(bytes: &[u8], logs: &Path) -> Result<Meta, store::ReadError> {
    let mut meta: Meta = store::parse_record(bytes)?;
    for p in [&mut meta.stdout_log, &mut meta.stderr_log] {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !log_name_ok(&name) {
            return Err(store::ReadError::Invalid(format!(
                "a log path must end in a plain file name, got {}",
                store::shown(p)
            )));
        }
        // Only the file name is trusted: a record can never point the node at a file
        // outside its own log folder.
        *p = logs.join(name);
    }
    if meta.workload_uuid.as_deref() == Some("") {
        meta.workload_uuid = None;
    }
    Ok(meta)
}

/// `<state>/workload_logs` for a workload directory `<state>/workloads/<id>`.
fn logs_dir_of(dir: &Path) -> PathBuf {
    dir.parent()
        .and_then(Path::parent)
        .unwrap_or_else(|| Path::new("."))
        .join("workload_logs")
}

fn log_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// How a workload's directory was read back at recovery.
#[derive(Debug)]
pub enum Recovered {
    /// The record validated.
    Intact(Meta),
    /// `meta.json` did not validate (it is quarantined): this record was rebuilt from what
    /// could be proven — the directory name, the pid identity (`started.json`), the
    /// workload uuid (`params.json`), the log files' names. Its `salvaged` says why.
    Salvaged(Meta),
}

/// A placeholder workload type for a rebuilt record whose type is unknown.
pub const UNKNOWN_KIND: &str = "workload";

/// Reads a workload's directory for recovery: every file validated, an invalid one
/// quarantined (one ERROR line each), a bad `meta.json` replaced by a rebuilt record that is
/// saved so the next start reads it as it is (recovery never repeats the same work or loops).
pub fn recover_meta(layout: &Layout, dir: &Path, name: &str) -> Recovered {
    let meta_path = dir.join("meta.json");
    let why = match parse_meta(dir) {
        Ok(mut meta) => {
            if meta.started.is_none() {
                let path = dir.join("started.json");
                // A node killed between forking the shim and the shim's start record: the
                // shim is still at work, and the record comes (never forget a workload that
                // is about to run: a redelivery would start it a second time).
                wait_for_shim_record(dir, &path);
                match store::read_record::<Started>(&path, store::MAX_RECORD_BYTES) {
                    Ok(st) => {
                        meta.started = Some(st);
                        meta.phase = Phase::Running;
                    }
                    Err(store::ReadError::Missing) => {}
                    // The shim wrote it, so the workload did start: it cannot be tracked
                    // without it, but it is reported, not forgotten.
                    Err(e) => {
                        let why = format!("started.json is not a valid workload start record: {e}");
                        if e.is_bad_content() {
                            let _ = store::quarantine(&path, &why);
                        }
                        meta.safe_id = name.to_string();
                        meta.salvaged = Some(why);
                        return Recovered::Salvaged(meta);
                    }
                }
            }
            meta.safe_id = name.to_string();
            return if meta.salvaged.is_some() {
                Recovered::Salvaged(meta)
            } else {
                Recovered::Intact(meta)
            };
        }
        Err(store::ReadError::Missing) => "meta.json is missing".to_string(),
        Err(e) => {
            let why = format!("meta.json is not a valid workload record: {e}");
            let _ = store::quarantine(&meta_path, &why);
            why
        }
    };
    let started: Option<Started> = load_json(&dir.join("started.json"), "workload start record");
    let workload_uuid = store::load_record::<Params>(
        &dir.join("params.json"),
        store::MAX_ENTRY_BYTES,
        "workload params file",
    )
    .and_then(|p| p.workload_uuid());
    let kind = KINDS
        .iter()
        .find(|k| {
            layout
                .logs()
                .join(format!("{k}_{name}.stdout.log"))
                .exists()
        })
        .copied()
        .unwrap_or(UNKNOWN_KIND);
    // D36: the GPUs it holds, read back from its own environment when it provably still runs
    // (else they would look free and be given to a second workload).
    let gpus = started
        .as_ref()
        .filter(|s| procinfo::same_process_alive(s.pid, s.start_ticks))
        .and_then(|s| crate::gpu::assigned_in_environ(s.pid));
    let meta = Meta {
        safe_id: name.to_string(),
        kind: kind.to_string(),
        request_id: Value::Null,
        workload_uuid,
        created_unix: unix_now(),
        command: String::new(),
        stdout_log: layout.logs().join(format!("{kind}_{name}.stdout.log")),
        stderr_log: layout.logs().join(format!("{kind}_{name}.stderr.log")),
        max_runtime_s: None,
        phase: if started.is_some() {
            Phase::Running
        } else {
            Phase::Starting
        },
        started,
        cancel: None,
        workflow: None,
        event_token: String::new(),
        salvaged: Some(why),
        gpus,
    };
    // Saved only when it names a process to track: a record without one is reported and
    // retired right away.
    if meta.started.is_some() && log_name_ok(name) {
        if let Err(e) = save_meta(layout, &meta) {
            log::warn!(
                "cannot save the rebuilt record of workload {}: {e}",
                store::clip(name, 80)
            );
        }
    }
    Recovered::Salvaged(meta)
}

/// While a shim started for `dir` is alive and `started` does not exist yet, waits for it (at
/// most the spawner's pid timeout).
fn wait_for_shim_record(dir: &Path, started: &Path) {
    if started.exists() {
        return;
    }
    let Some((pid, ticks)) = shim_of(dir) else {
        return;
    };
    log::info!(
        "the supervisor of {} (pid {pid}) is still starting its workload; waiting for its start record",
        store::shown(dir)
    );
    let until = crate::util::later(std::time::Instant::now(), spawner::PID_TIMEOUT);
    while !started.exists()
        && procinfo::same_process_alive(pid, ticks)
        && std::time::Instant::now() < until
    {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The live shim process (pid, start ticks) supervising `dir`, found by its command line
/// (`<exe> __shim <dir> …`) among this user's processes.
fn shim_of(dir: &Path) -> Option<(i32, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let want = dir.as_os_str().as_bytes();
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .find_map(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
            let is_shim = args
                .windows(2)
                .any(|w| w.first() == Some(&b"__shim".as_slice()) && w.get(1) == Some(&want));
            let ticks = procinfo::start_ticks(pid)?;
            (is_shim && procinfo::same_process_alive(pid, ticks)).then_some((pid, ticks))
        })
}

/// `params.json` as far as the node reads it back: a JSON object.
#[derive(Debug, Deserialize)]
#[serde(transparent)]
struct Params(Map<String, Value>);

impl Params {
    /// The workload uuid, if it is there and valid (D20).
    fn workload_uuid(&self) -> Option<String> {
        self.0
            .get("workload_uuid")
            .and_then(Value::as_str)
            .filter(|u| store::check_id("workload_uuid", u).is_ok())
            .map(String::from)
    }
}

impl store::Validate for Params {
    fn validate(&self) -> Result<(), String> {
        Ok(())
    }
}

impl store::Validate for Value {
    fn validate(&self) -> Result<(), String> {
        Ok(())
    }
}

impl store::Validate for Started {
    fn validate(&self) -> Result<(), String> {
        store::check_pid("pid", self.pid)?;
        store::check_pid("shim_pid", self.shim_pid)?;
        store::check_text("boot_id", &self.boot_id, 64)?;
        store::check_text("started_at", &self.started_at, 64)
    }
}

impl store::Validate for shim::Exit {
    fn validate(&self) -> Result<(), String> {
        if let Some(c) = self.exit_code {
            if !(0..=255).contains(&c) {
                return Err(format!("exit_code must be from 0 to 255, got {c}"));
            }
        }
        if let Some(sig) = self.signal {
            if !(1..=64).contains(&sig) {
                return Err(format!("signal must be from 1 to 64, got {sig}"));
            }
        }
        store::check_text("started_at", &self.started_at, 64)?;
        store::check_text("ended_at", &self.ended_at, 64)
    }
}

impl store::Validate for Cancel {
    fn validate(&self) -> Result<(), String> {
        if !matches!(self.signal.as_str(), "SIGTERM" | "SIGINT" | "SIGKILL") {
            return Err("cancel.signal must be SIGTERM, SIGINT or SIGKILL".into());
        }
        store::check_unix("cancel.requested_unix", self.requested_unix)?;
        store::check_seconds("cancel.grace_s", self.grace_s, true)
    }
}

impl store::Validate for WorkflowCtx {
    fn validate(&self) -> Result<(), String> {
        store::check_id("workflow.workflow", &self.workflow)?;
        store::check_id("workflow.execution", &self.execution)?;
        store::check_id("workflow.node", &self.node)?;
        store::check_text("workflow.source_type", &self.source_type, 64)?;
        if let Some(c) = &self.caller_uuid {
            store::check_id("workflow.caller_uuid", c)?;
        }
        Ok(())
    }
}

impl store::Validate for Meta {
    fn validate(&self) -> Result<(), String> {
        let kind_ok = KINDS.contains(&self.kind.as_str())
            || (self.salvaged.is_some() && self.kind == UNKNOWN_KIND);
        if !kind_ok {
            return Err(format!("kind must be one of {}", KINDS.join(", ")));
        }
        if !matches!(
            self.request_id,
            Value::Null | Value::String(_) | Value::Number(_)
        ) {
            return Err("request_id must be a string or a number".into());
        }
        if let Some(u) = self.workload_uuid.as_deref().filter(|u| !u.is_empty()) {
            store::check_id("workload_uuid", u)?;
        }
        store::check_unix("created_unix", self.created_unix)?;
        if let Some(m) = self.max_runtime_s {
            store::check_seconds("max_runtime_s", m, false)?;
        }
        if let Some(st) = &self.started {
            st.validate()?;
        }
        if let Some(c) = &self.cancel {
            c.validate()?;
        }
        if let Some(w) = &self.workflow {
            w.validate()?;
        }
        if !self.event_token.chars().all(|c| c.is_ascii_alphanumeric())
            || self.event_token.len() > 128
        {
            return Err("event_token must be at most 128 letters and digits".into());
        }
        Ok(())
    }
}

/// What a start needs beyond the settings (owned: it travels to the spawner thread).
#[derive(Debug, Clone)]
pub struct StartRequest {
    pub kind: String,
    pub request_id: Value,
    pub safe_id: String,
    pub params: Map<String, Value>,
    pub template: String,
    /// The node's own API token (empty in standalone mode).
    pub node_token: String,
    pub max_runtime_s: Option<f64>,
    pub workflow: Option<WorkflowCtx>,
    /// The node's control socket, for `emit`.
    pub socket: PathBuf,
    /// Its GPUs (D36): `Some` sets the CUDA/NVIDIA variables (an empty list hides every GPU).
    pub gpus: Option<Vec<String>>,
    /// This workload's own results folder (D24), when result uploads are on.
    pub results_dir: Option<PathBuf>,
    /// Its secret for `emit` (chosen by the node, which must know it before the workload runs).
    pub event_token: String,
    /// The node's instance UUID (`CYBERWAVE_CLOUD_NODE_ID`, D45).
    pub node_uuid: String,
}

/// Environment variables that hold the node's own secrets or identity; never passed on as they
/// are (a workload gets its own credentials explicitly, and derives its own MQTT username).
pub const NODE_ONLY_VARS: &[&str] = &[
    "CYBERWAVE_API_KEY",
    "CYBERWAVE_MQTT_PASSWORD",
    "CYBERWAVE_MQTT_USERNAME",
    "CYBERWAVE_CLOUD_NODE_INSTANCE_UUID",
];

/// Module dispatch (product documentation, "Module dispatch for .py values"): a command value
/// that, trimmed, ends in `.py` and holds no whitespace names a Python file in the working
/// directory whose `infer` / `train` / `simulate` function is called with the params as keyword
/// arguments. It runs as an ordinary tracked workload through `module_runner.py`.
pub fn module_of(template: &str) -> Option<&str> {
    let t = template.trim();
    (t.ends_with(".py") && !t.contains(char::is_whitespace)).then_some(t)
}

/// The function a module must export for this workload type.
pub fn module_function(kind: &str) -> &'static str {
    match kind {
        "inference" => "infer",
        "training" => "train",
        _ => "simulate",
    }
}

const MODULE_RUNNER: &str = include_str!("module_runner.py");

/// Keys the platform puts into params that are not the module function's arguments (with every
/// `workflow_*` key and the workload token, which never reaches the params file).
const PLATFORM_PARAMS: &[&str] = &["workload_uuid", "command_type", "status"];

/// A shim that was forked and has not reported the workload's pid yet.
pub struct Launched {
    /// The record as written (not yet synced): phase `Starting`, no pid.
    pub meta: Meta,
    pub shim_pid: i32,
    /// The shim's start time (its identity, read right after the fork).
    pub shim_start_ticks: u64,
    child: std::process::Child,
}

/// Starts a workload under the shim, step 1 of 2 (on the spawner thread): its directory, params
/// and record (`meta.json`, phase `starting`, written atomically but not yet synced), then the
/// shim forked. [`settle`] then reads the pid, and [`make_durable`] syncs the record once the
/// workload runs (a sync forces a journal commit, which would hold up the files the shim and
/// the workload create as they start). On `Err` nothing was forked and the directory is gone.
///
/// Crash safety of the order: a node killed at any point leaves what it wrote in the page cache
/// (a record written is read back by the next node, synced or not); only a host crash loses
/// unsynced files, and it ends the workload too. The start is answered (and recorded in the
/// ledger) only after [`make_durable`], so an answered start always has its durable record.
pub fn launch(
    s: &Settings,
    layout: &Layout,
    exe: &Path,
    req: StartRequest,
) -> Result<Launched, String> {
    let dir = layout.dir(&req.safe_id);
    store::ensure_private_dir(&layout.workloads())
        .map_err(|e| format!("cannot create {}: {e}", layout.workloads().display()))?;
    std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let result = launch_in(s, layout, exe, &dir, req);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn launch_in(
    s: &Settings,
    layout: &Layout,
    exe: &Path,
    dir: &Path,
    mut req: StartRequest,
) -> Result<Launched, String> {
    // D46.3: looked up at each start (the node checked it at its own start, exit 2 if wrong).
    let user = match s.manifest.as_ref().and_then(|m| m.workload_user.as_deref()) {
        Some(spec) => Some(user::lookup(spec)?),
        None => None,
    };
    // With a workload user the record's dir is passed through (to its params file), not listed.
    let mode = if user.is_some() { 0o711 } else { 0o700 };
    let _ = std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(mode));
    store::ensure_private_dir(&layout.logs())
        .map_err(|e| format!("cannot create {}: {e}", layout.logs().display()))?;
    let give = |path: &Path| -> Result<(), String> {
        match &user {
            Some(u) => user::hand_over(path, u).map_err(|e| {
                format!(
                    "cannot hand {} to workload_user {}: {e}",
                    path.display(),
                    u.name
                )
            }),
            None => Ok(()),
        }
    };
    if user.is_some() {
        user::traversable(&layout.workloads()).map_err(|e| {
            format!(
                "cannot open {} to the workload user: {e}",
                layout.workloads().display()
            )
        })?;
    }
    let token = req
        .params
        .remove("cyberwave_workload_token")
        .and_then(|v| v.as_str().map(String::from));
    let workload_uuid = req
        .params
        .get("workload_uuid")
        .and_then(Value::as_str)
        .map(String::from);
    // Module dispatch: a missing file is refused before anything is written; the platform's
    // own keys are not the function's arguments.
    let module = module_of(&req.template).map(|m| (m, s.working_dir.join(m)));
    if let Some((value, path)) = &module {
        if !path.is_file() {
            return Err(format!(
                "Module not found: {value}. Check '{}: {value}' in cyberwave.yml.",
                req.kind
            ));
        }
        req.params
            .retain(|k, _| !PLATFORM_PARAMS.contains(&k.as_str()) && !k.starts_with("workflow_"));
    }
    let stem = format!("{}_{}", req.kind, req.safe_id);
    if let Some(b64) = req
        .params
        .get("image_bytes_base64")
        .and_then(Value::as_str)
        .filter(|b| !b.is_empty())
    {
        match save_image(layout, &stem, b64) {
            Ok(name) => {
                if user.is_some() {
                    let _ = user::traversable(&layout.inputs());
                    give(&layout.inputs().join(&name))?;
                }
                req.params.remove("image_bytes_base64");
                req.params.insert("image".into(), Value::String(name));
            }
            Err(e) => log::warn!(
                "workload {}: image_bytes_base64 not decoded ({e}); params passed on unchanged",
                req.safe_id
            ),
        }
    }
    let params_file = dir.join("params.json");
    let params_json = serde_json::to_vec(&Value::Object(req.params)).map_err(|e| e.to_string())?;
    // Not synced: the workload needs it complete, not durable (after a host crash the workload
    // is reported lost anyway).
    store::write_replace_unsynced(&params_file, &params_json, 0o600)
        .map_err(|e| format!("cannot write the params file: {e}"))?;
    give(&params_file)?;
    let command = match &module {
        None => req
            .template
            .replace("{body}", &shell_quote(&params_file.display().to_string())),
        Some((value, path)) => {
            let runner = dir.join("module_runner.py");
            store::write_replace_unsynced(&runner, MODULE_RUNNER.as_bytes(), 0o600)
                .map_err(|e| format!("cannot write the module runner: {e}"))?;
            give(&runner)?;
            let python = s
                .env
                .value("CYBERWAVE_PYTHON")
                .filter(|p| !p.trim().is_empty())
                .unwrap_or_else(|| "python3".into());
            format!(
                "exec {} {} {} {} {} {}",
                shell_quote(python.trim()),
                shell_quote(&runner.display().to_string()),
                shell_quote(&path.display().to_string()),
                module_function(&req.kind),
                shell_quote(&params_file.display().to_string()),
                shell_quote(value)
            )
        }
    };
    let stdout_log = layout.logs().join(format!("{stem}.stdout.log"));
    let stderr_log = layout.logs().join(format!("{stem}.stderr.log"));
    let meta = Meta {
        safe_id: req.safe_id.clone(),
        kind: req.kind.clone(),
        request_id: req.request_id.clone(),
        workload_uuid: workload_uuid.clone(),
        created_unix: unix_now(),
        command: command.clone(),
        stdout_log: stdout_log.clone(),
        stderr_log: stderr_log.clone(),
        max_runtime_s: req.max_runtime_s,
        phase: Phase::Starting,
        started: None,
        cancel: None,
        workflow: req.workflow.clone(),
        event_token: req.event_token.clone(),
        gpus: req.gpus.clone(),
        salvaged: None,
    };
    // Atomic (a reader never sees half of it) but not synced here: [`make_durable`] syncs it
    // while the shim starts the workload.
    let json = serde_json::to_vec_pretty(&meta).map_err(|e| e.to_string())?;
    store::write_replace_unsynced(&layout.meta(&meta.safe_id), &json, 0o600)
        .map_err(|e| format!("cannot write the workload record: {e}"))?;

    // The workload's environment (D2/D3 and the per-workload token of ecosystem §5).
    let mut env: BTreeMap<String, String> = s.env.merged();
    for k in NODE_ONLY_VARS {
        env.remove(*k);
    }
    // The simulated slow disk (`store::slow_disk_pause`) is the node's own, not its workloads'.
    env.remove("CYBERWAVE_TEST_SLOW_FSYNC_MS");
    let credential = token.unwrap_or_else(|| req.node_token.clone());
    if !credential.is_empty() {
        env.insert("CYBERWAVE_API_KEY".into(), credential.clone());
        env.insert("CYBERWAVE_MQTT_PASSWORD".into(), credential);
    }
    env.insert(
        "CYBERWAVE_PARAMS_FILE".into(),
        params_file.display().to_string(),
    );
    // An environment value cannot hold NUL; such an id is passed with NUL as U+FFFD.
    env.insert(
        "CYBERWAVE_REQUEST_ID".into(),
        meta.request_id_text().replace('\0', "\u{FFFD}"),
    );
    env.insert("CYBERWAVE_WORKLOAD_TYPE".into(), req.kind.clone());
    if let Some(d) = &req.results_dir {
        give(d)?;
        env.insert("CYBERWAVE_RESULTS_DIR".into(), d.display().to_string());
    }
    if let Some(u) = &user {
        env.insert("HOME".into(), u.home.display().to_string());
        env.insert("USER".into(), u.name.clone());
        env.insert("LOGNAME".into(), u.name.clone());
    }
    env.insert(
        "CYBERWAVE_INPUTS_DIR".into(),
        layout.inputs().display().to_string(),
    );
    env.insert(
        "CYBERWAVE_NODE_SOCKET".into(),
        req.socket.display().to_string(),
    );
    env.insert("CYBERWAVE_NODE_BIN".into(), exe.display().to_string());
    env.insert(
        "CYBERWAVE_NODE_EVENT_TOKEN".into(),
        meta.event_token.clone(),
    );
    if let Some(wl) = &workload_uuid {
        env.insert("CYBERWAVE_WORKLOAD_UUID".into(), wl.clone());
    }
    env.insert("CYBERWAVE_BASE_URL".into(), s.base_url.value.clone());
    env.insert("CYBERWAVE_MQTT_HOST".into(), s.mqtt_host.value.clone());
    env.insert("CYBERWAVE_MQTT_PORT".into(), s.mqtt_port.value.to_string());
    env.insert(
        "CYBERWAVE_MQTT_USE_TLS".into(),
        s.mqtt_use_tls.value.to_string(),
    );
    env.insert(
        "CYBERWAVE_MQTT_TOPIC_PREFIX".into(),
        s.topic_prefix.value.clone(),
    );
    // D45: what the platform SDK and edge-core read. Edge-core labels the containers a
    // workload starts with this node and workload (`container_spec.workload_labels`); the SDK
    // takes the broker's CA under its own name.
    env.insert("CYBERWAVE_CLOUD_NODE_ID".into(), req.node_uuid.clone());
    if let Some(ca) = s.mqtt_ca_certs.as_ref().filter(|_| s.mqtt_use_tls.value) {
        for name in ["CYBERWAVE_MQTT_TLS_CA_CERTS", "CYBERWAVE_MQTT_TLS_CA_CERT"] {
            env.insert(name.into(), ca.value.display().to_string());
        }
    }
    if let Some(gpus) = &req.gpus {
        // D36: exactly its GPUs, by UUID; none at all when it needs none.
        let list = gpus.join(",");
        env.insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
        env.insert("CUDA_VISIBLE_DEVICES".into(), list.clone());
        let nvidia = if list.is_empty() { "none".into() } else { list };
        env.insert("NVIDIA_VISIBLE_DEVICES".into(), nvidia);
    }

    let shell = if Path::new("/bin/bash").exists() || Path::new("/usr/bin/bash").exists() {
        "bash"
    } else {
        "sh"
    };
    let args = ShimArgs {
        dir: dir.to_path_buf(),
        cwd: s.working_dir.clone(),
        stdout: stdout_log,
        stderr: stderr_log,
        shell: shell.to_string(),
        command,
        cleanup_grace_ms: u64::try_from(s.tuning.cleanup_grace.as_millis()).unwrap_or(u64::MAX),
        user: user.as_ref().map(user::WorkloadUser::ids),
    };
    let shim_log = store::create_state_file(&dir.join("shim.log"), 0o600)
        .map_err(|e| format!("cannot create the shim log: {e}"))?;
    let mut cmd = Command::new(exe);
    crate::fds::no_inherited_fds(&mut cmd);
    let child = cmd
        .args(args.to_args())
        .env_clear()
        .envs(&env)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(shim_log)
        .spawn()
        .map_err(|e| {
            format!(
                "cannot start the workload supervisor {}: {e}",
                exe.display()
            )
        })?;
    let shim_pid = i32::try_from(child.id()).unwrap_or(0);
    Ok(Launched {
        meta,
        shim_pid,
        shim_start_ticks: procinfo::start_ticks(shim_pid).unwrap_or(0),
        child,
    })
}

/// Syncs the records of freshly launched workloads (each `meta.json` and its directory, and the
/// workloads folder once, which holds their new directories), several at once: concurrent
/// syncs share the disk's flushes (one journal commit can serve them all). Errors are logged: the
/// record is there for a node restart either way, only a host crash could lose it.
pub fn make_durable(layout: &Layout, safe_ids: &[&str]) {
    let mut paths: Vec<PathBuf> = safe_ids
        .iter()
        .flat_map(|id| [layout.meta(id), layout.dir(id)])
        .collect();
    if !safe_ids.is_empty() {
        paths.push(layout.workloads());
    }
    let sync = |path: &PathBuf| {
        store::slow_disk_pause();
        // Never blocks on a FIFO planted in place of a record (D48).
        use std::os::unix::fs::OpenOptionsExt;
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path);
        if let Err(e) = opened.and_then(|f| f.sync_all()) {
            log::warn!("cannot sync {}: {e}", store::shown(path));
        }
    };
    const WORKERS: usize = 8;
    let per = paths.len().div_ceil(WORKERS).max(1);
    std::thread::scope(|scope| {
        for chunk in paths.chunks(per) {
            let spawned = std::thread::Builder::new()
                .name("sync".into())
                .spawn_scoped(scope, move || chunk.iter().for_each(sync));
            if spawned.is_err() {
                chunk.iter().for_each(sync);
            }
        }
    });
}

/// Step 2 of a start (on the spawner thread): waits for each shim's pid line, all at once, at
/// most `timeout`. Each gets its record with `started` filled in, or the reason it could not
/// start (then its shim, if still provably ours, is killed and its directory is gone).
pub fn settle(
    layout: &Layout,
    launched: Vec<Launched>,
    timeout: Duration,
) -> Vec<(String, i32, Result<Meta, String>)> {
    let lines = read_lines_timeout(&launched, timeout);
    launched
        .into_iter()
        .zip(lines)
        .map(|(l, line)| {
            let id = l.meta.safe_id.clone();
            let shim = l.shim_pid;
            (id, shim, finish(layout, l, &line))
        })
        .collect()
}

fn finish(layout: &Layout, l: Launched, line: &str) -> Result<Meta, String> {
    let Launched {
        mut meta,
        shim_pid,
        shim_start_ticks,
        child,
    } = l;
    drop(child); // the reaper thread waits for it
    let pid: i32 = match line
        .strip_prefix("pid ")
        .and_then(|p| p.trim().parse().ok())
    {
        Some(p) => p,
        None => {
            let why = line
                .strip_prefix("error: ")
                .unwrap_or(line)
                .trim()
                .to_string();
            // A shim that said nothing in time is stopped before its directory goes, so it
            // cannot start an untracked workload later (only while it is provably the shim:
            // the node's own unreaped child, with the start time it had at the fork).
            if shim_pid > 1 && procinfo::same_process_alive(shim_pid, shim_start_ticks) {
                // SAFETY: kill on a pid just proven to be this node's live child.
                unsafe {
                    libc::kill(shim_pid, libc::SIGKILL);
                }
            }
            let _ = std::fs::remove_dir_all(layout.dir(&meta.safe_id));
            return Err(if why.is_empty() {
                "the workload supervisor did not report a pid".to_string()
            } else {
                why
            });
        }
    };
    // The shim reports the pid first and records started.json right after (for recovery); the
    // node reads the same facts from /proc itself rather than wait for that file.
    let started = Started {
        pid,
        start_ticks: procinfo::start_ticks(pid).unwrap_or(0),
        shim_pid,
        shim_start_ticks,
        boot_id: procinfo::boot_id(),
        started_at: crate::util::rfc3339(SystemTime::now()),
    };
    // meta.json on disk keeps saying "starting": the shim's started.json completes it at
    // recovery, so a second synced write is not needed here.
    meta.started = Some(started);
    meta.phase = Phase::Running;
    Ok(meta)
}

/// Reads the first line from each shim's pipe, all at once, waiting at most `timeout` in all.
fn read_lines_timeout(launched: &[Launched], timeout: Duration) -> Vec<String> {
    let begun = std::time::Instant::now();
    let fds: Vec<i32> = launched
        .iter()
        .map(|l| l.child.stdout.as_ref().map_or(-1, AsRawFd::as_raw_fd))
        .collect();
    let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); launched.len()];
    let mut open: Vec<bool> = fds.iter().map(|fd| *fd >= 0).collect();
    let mut chunk = [0u8; 256];
    while open.iter().any(|o| *o) {
        let left = timeout.saturating_sub(begun.elapsed());
        if left.is_zero() {
            break;
        }
        let mut pfds: Vec<libc::pollfd> = fds
            .iter()
            .zip(&open)
            .map(|(fd, o)| libc::pollfd {
                fd: if *o { *fd } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
        let n = libc::nfds_t::try_from(pfds.len()).unwrap_or(0);
        // SAFETY: `pfds` is a valid array of `n` pollfds (negative fds are ignored by poll).
        let rc = unsafe { libc::poll(pfds.as_mut_ptr(), n, ms) };
        if rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        if rc <= 0 {
            break;
        }
        for ((p, buf), o) in pfds.iter().zip(bufs.iter_mut()).zip(open.iter_mut()) {
            if !*o || p.revents == 0 {
                continue;
            }
            // SAFETY: read into a local buffer of its own length from an fd poll reported.
            let got = unsafe { libc::read(p.fd, chunk.as_mut_ptr().cast(), chunk.len()) };
            match usize::try_from(got) {
                Ok(0) | Err(_) => *o = false,
                Ok(k) => buf.extend_from_slice(chunk.get(..k).unwrap_or_default()),
            }
            if buf.contains(&b'\n') {
                *o = false;
            }
        }
    }
    bufs.iter()
        .map(|b| {
            String::from_utf8_lossy(b)
                .lines()
                .next()
                .unwrap_or("")
                .to_string()
        })
        .collect()
}

/// Quotes for a POSIX shell: bare when only safe characters, else single quotes.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_@%+=:,./-".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Decodes a (data-URL or plain) base64 image into the inputs folder; returns its file name.
fn save_image(layout: &Layout, stem: &str, b64: &str) -> Result<String, String> {
    let data = b64.split_once(',').map(|(_, d)| d).unwrap_or(b64);
    let bytes = base64_decode(data).ok_or("not valid base64")?;
    let ext = match bytes.as_slice() {
        [0xFF, 0xD8, 0xFF, ..] => "jpg",
        [0x89, b'P', b'N', b'G', ..] => "png",
        [b'G', b'I', b'F', ..] => "gif",
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'E', b'B', b'P', ..] => "webp",
        _ => "jpg",
    };
    store::ensure_private_dir(&layout.inputs()).map_err(|e| e.to_string())?;
    let name = format!("image_{stem}.{ext}");
    store::write_atomic(&layout.inputs().join(&name), &bytes, 0o600).map_err(|e| e.to_string())?;
    Ok(name)
}

/// Lenient standard base64 (whitespace ignored, padding optional; URL-safe letters accepted).
// Each arm subtracts its own range's start, and `bits` stays below 14.
#[allow(clippy::arithmetic_side_effects)]
pub fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let mut acc = 0u32;
    let mut bits = 0;
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            b'=' => break,
            b' ' | b'\n' | b'\r' | b'\t' => continue,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

/// The last `max` bytes of a file as text (invalid UTF-8 replaced).
pub fn tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = tail::open_log(path, false) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::new();
    let _ = f.take(max).read_to_end(&mut buf);
    // No NUL of a hole the workload made in its log is kept (D52).
    buf.retain(|b| *b != 0);
    String::from_utf8_lossy(&buf).into_owned()
}

/// The failure summary of protocol §2.6.8: (`error` ≤ 300 chars, `stderr` tail ≤ 2000 chars).
pub fn failure_summary(meta: &Meta, what: &str) -> (String, Option<String>) {
    let err_text = tail(&meta.stderr_log, 16 * 1024);
    let trimmed = err_text.trim();
    let stderr = (!trimmed.is_empty()).then(|| last_chars(trimmed, 2000));
    let last_line = |t: &str| {
        t.lines()
            .rev()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .map(|l| last_chars(l, 300))
    };
    let error = last_line(trimmed)
        .or_else(|| last_line(tail(&meta.stdout_log, 16 * 1024).trim()))
        .unwrap_or_else(|| what.to_string());
    (error, stderr)
}

fn last_chars(s: &str, n: usize) -> String {
    let count = s.chars().count();
    s.chars().skip(count.saturating_sub(n)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_for_the_shell() {
        assert_eq!(shell_quote("/a/b_c.json"), "/a/b_c.json");
        assert_eq!(shell_quote("/a b/c"), "'/a b/c'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn decodes_base64() {
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVs\nbG8").unwrap(), b"hello");
        assert!(base64_decode("!!").is_none());
    }

    fn scratch(tag: &str) -> Layout {
        let state = std::env::temp_dir().join(format!("cw-wl-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(state.join("workloads/w1")).unwrap();
        std::fs::create_dir_all(state.join("workload_logs")).unwrap();
        Layout { state }
    }

    fn good_meta(layout: &Layout) -> Value {
        serde_json::json!({
            "safe_id": "w1", "kind": "inference", "request_id": "r1",
            "workload_uuid": "wl-1", "created_unix": 1.7e9, "command": "echo hi",
            "stdout_log": layout.logs().join("inference_w1.stdout.log"),
            "stderr_log": layout.logs().join("inference_w1.stderr.log"),
            "max_runtime_s": 60.0, "phase": "running",
            "started": {"pid": 123456, "start_ticks": 5, "shim_pid": 123455,
                        "shim_start_ticks": 4, "boot_id": "b", "started_at": "t"},
            "event_token": "abc123"
        })
    }

    #[test]
    fn hostile_meta_records_are_refused() {
        let layout = scratch("meta");
        let dir = layout.dir("w1");
        let meta_path = dir.join("meta.json");
        let base = good_meta(&layout);
        let with = |ptr: &str, v: Value| {
            let mut m = base.clone();
            *m.pointer_mut(ptr).unwrap() = v;
            m.to_string().into_bytes()
        };
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("truncated", base.to_string().as_bytes()[..40].to_vec()),
            ("binary", vec![0x00, 0xff, 0x1b, b'[', 0x80]),
            ("array", b"[]".to_vec()),
            (
                "huge runtime (finding 1)",
                with("/max_runtime_s", serde_json::json!(1e19)),
            ),
            (
                "negative runtime",
                with("/max_runtime_s", serde_json::json!(-1)),
            ),
            ("zero runtime", with("/max_runtime_s", serde_json::json!(0))),
            (
                "runtime string",
                with("/max_runtime_s", serde_json::json!("60")),
            ),
            ("pid 0", with("/started/pid", serde_json::json!(0))),
            ("pid negative", with("/started/pid", serde_json::json!(-1))),
            (
                "pid too big",
                with("/started/pid", serde_json::json!(2147483648u64)),
            ),
            (
                "shim pid 0",
                with("/started/shim_pid", serde_json::json!(0)),
            ),
            ("kind", with("/kind", serde_json::json!("rm -rf"))),
            (
                "uuid topic chars",
                with("/workload_uuid", serde_json::json!("a/#")),
            ),
            ("uuid plus", with("/workload_uuid", serde_json::json!("+"))),
            (
                "uuid control",
                with("/workload_uuid", serde_json::json!("a\nb")),
            ),
            ("uuid number", with("/workload_uuid", serde_json::json!(42))),
            (
                "request id object",
                with("/request_id", serde_json::json!({"a": 1})),
            ),
            (
                "created NaN-ish",
                with("/created_unix", serde_json::json!(1e300)),
            ),
            (
                "created negative",
                with("/created_unix", serde_json::json!(-5)),
            ),
            (
                "log without a name",
                with("/stdout_log", serde_json::json!("/")),
            ),
            ("log empty", with("/stdout_log", serde_json::json!(""))),
            (
                "log dotdot",
                with("/stderr_log", serde_json::json!("/x/..")),
            ),
            (
                "log hidden",
                with("/stderr_log", serde_json::json!("/x/.ssh")),
            ),
            ("token", with("/event_token", serde_json::json!("a b"))),
            ("phase", with("/phase", serde_json::json!("flying"))),
        ];
        for (what, bytes) in &cases {
            std::fs::write(&meta_path, bytes).unwrap();
            assert!(parse_meta(&dir).is_err(), "{what} must be refused");
            assert!(load_meta(&dir).is_none(), "{what}");
        }
        let mut cancel = base.clone();
        cancel["cancel"] =
            serde_json::json!({"signal": "SIGSTOP", "requested_unix": 1.0, "grace_s": 1.0});
        std::fs::write(&meta_path, cancel.to_string()).unwrap();
        assert!(parse_meta(&dir).is_err(), "cancel signal");
        cancel["cancel"] =
            serde_json::json!({"signal": "SIGTERM", "requested_unix": 1.0, "grace_s": 1e19});
        std::fs::write(&meta_path, cancel.to_string()).unwrap();
        assert!(parse_meta(&dir).is_err(), "grace");
        let mut wf = base.clone();
        wf["workflow"] = serde_json::json!({"workflow": "w/x", "execution": "e", "node": "n", "source_type": "edge"});
        std::fs::write(&meta_path, wf.to_string()).unwrap();
        assert!(parse_meta(&dir).is_err(), "workflow id");
        let mut big = base.clone();
        big["command"] = serde_json::json!("x".repeat(store::MAX_RECORD_BYTES as usize));
        std::fs::write(&meta_path, big.to_string()).unwrap();
        assert!(matches!(
            parse_meta(&dir),
            Err(store::ReadError::TooBig { .. })
        ));

        // The good one loads, and its log paths are re-rooted in the log folder.
        let mut moved = base.clone();
        moved["stdout_log"] = serde_json::json!("/somewhere/else/inference_w1.stdout.log");
        moved["stderr_log"] = serde_json::json!("/etc/shadow");
        std::fs::write(&meta_path, moved.to_string()).unwrap();
        let m = parse_meta(&dir).unwrap();
        assert_eq!(m.stdout_log, layout.logs().join("inference_w1.stdout.log"));
        assert_eq!(
            m.stderr_log,
            layout.logs().join("shadow"),
            "never outside the log folder"
        );
        assert_eq!(m.max_runtime_s, Some(60.0));
        std::fs::remove_dir_all(&layout.state).unwrap();
    }

    #[test]
    fn hostile_exit_start_and_cursor_records_are_refused() {
        let layout = scratch("exit");
        let p = layout.dir("w1").join("x.json");
        let exit = |v: Value| {
            std::fs::write(&p, v.to_string()).unwrap();
            read_json::<shim::Exit>(&p)
        };
        for bad in [
            serde_json::json!({"signal": i32::MIN, "started_at": "", "ended_at": ""}),
            serde_json::json!({"signal": 0, "started_at": "", "ended_at": ""}),
            serde_json::json!({"exit_code": -1, "started_at": "", "ended_at": ""}),
            serde_json::json!({"exit_code": 256, "started_at": "", "ended_at": ""}),
            serde_json::json!({"exit_code": "0", "started_at": "", "ended_at": ""}),
            serde_json::json!({"exit_code": 0, "started_at": "a\u{1b}[2J", "ended_at": ""}),
            serde_json::json!({"exit_code": 0}),
        ] {
            assert!(exit(bad.clone()).is_none(), "{bad}");
        }
        let ok =
            exit(serde_json::json!({"signal": 9, "started_at": "a", "ended_at": "b"})).unwrap();
        assert_eq!(ok.code(), -9);
        std::fs::remove_dir_all(&layout.state).unwrap();
    }

    #[test]
    fn a_workload_with_a_bad_record_is_salvaged_from_what_can_be_proven() {
        let layout = scratch("salvage");
        let dir = layout.dir("w1");
        let mut bad = good_meta(&layout);
        bad["max_runtime_s"] = serde_json::json!(1e19);
        std::fs::write(dir.join("meta.json"), bad.to_string()).unwrap();
        std::fs::write(dir.join("started.json"), bad["started"].to_string()).unwrap();
        std::fs::write(dir.join("params.json"), r#"{"workload_uuid":"wl-9","x":1}"#).unwrap();
        std::fs::write(layout.logs().join("training_w1.stdout.log"), "").unwrap();
        let Recovered::Salvaged(m) = recover_meta(&layout, &dir, "w1") else {
            panic!("must be salvaged");
        };
        assert_eq!(m.workload_uuid.as_deref(), Some("wl-9"));
        assert_eq!(m.kind, "training");
        assert_eq!(m.pid(), 123456);
        assert!(m.salvaged.as_deref().unwrap().contains("max_runtime_s"));
        assert_eq!(m.max_runtime_s, None);
        let q = layout.state.join("quarantine");
        assert_eq!(
            std::fs::read_dir(&q).unwrap().count(),
            1,
            "meta.json quarantined"
        );
        // The rebuilt record is saved: the next recovery reads it without quarantining again.
        let Recovered::Salvaged(again) = recover_meta(&layout, &dir, "w1") else {
            panic!("still a salvaged record");
        };
        assert_eq!(again.workload_uuid.as_deref(), Some("wl-9"));
        assert_eq!(std::fs::read_dir(&q).unwrap().count(), 1);

        // Nothing provable: no pid, params invalid (quarantined too), unknown kind.
        std::fs::remove_file(dir.join("meta.json")).unwrap();
        std::fs::write(dir.join("started.json"), r#"{"pid":-4}"#).unwrap();
        std::fs::write(dir.join("params.json"), "\u{0}\u{0}").unwrap();
        std::fs::remove_file(layout.logs().join("training_w1.stdout.log")).unwrap();
        let Recovered::Salvaged(m) = recover_meta(&layout, &dir, "w1") else {
            panic!("salvaged");
        };
        assert!(m.started.is_none() && m.workload_uuid.is_none());
        assert_eq!(m.kind, UNKNOWN_KIND);
        assert_eq!(
            std::fs::read_dir(&q).unwrap().count(),
            3,
            "started.json and params.json"
        );
        assert!(
            !dir.join("meta.json").exists(),
            "nothing to track: not saved"
        );

        // A valid record whose start record is bad: reported, not forgotten as "never started".
        let mut no_start = good_meta(&layout);
        no_start.as_object_mut().unwrap().remove("started");
        std::fs::write(dir.join("meta.json"), no_start.to_string()).unwrap();
        std::fs::write(dir.join("started.json"), r#"{"pid":0}"#).unwrap();
        let Recovered::Salvaged(m) = recover_meta(&layout, &dir, "w1") else {
            panic!("a bad started.json makes it salvaged");
        };
        assert!(m.started.is_none());
        assert_eq!(m.workload_uuid.as_deref(), Some("wl-1"));
        assert!(m.salvaged.unwrap().contains("started.json"));
        assert_eq!(std::fs::read_dir(&q).unwrap().count(), 4);
        std::fs::remove_dir_all(&layout.state).unwrap();
    }

    /// Mutated versions of valid records (bytes flipped, cut, repeated, numbers swapped for
    /// edge values) never panic a loader, and whatever validates is safe for the arithmetic
    /// the node does with it.
    #[test]
    fn mutated_records_never_panic_and_what_validates_is_safe_to_compute_with() {
        let layout = scratch("mutate");
        let logs = layout.logs();
        let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let edges = [
            "1e19",
            "-1",
            "0",
            "1e308",
            "-0",
            "2147483648",
            "-2147483648",
            "18446744073709551616",
            "NaN",
            "\"x\"",
            "null",
            "[]",
            "{}",
            "true",
            "1e-320",
        ];
        let meta = good_meta(&layout).to_string();
        let samples = [
            meta.clone(),
            r#"{"exit_code":0,"signal":9,"started_at":"a","ended_at":"b"}"#.to_string(),
            r#"{"rid":"r","at":1.8e9,"ok":true,"body":{"pid":1}}"#.to_string(),
            r#"{"topic":"a/b","body":{"x":1},"label":"l","key":"k"}"#.to_string(),
        ];
        for round in 0..4000u32 {
            let base = samples.get(round as usize % samples.len()).unwrap();
            let mut text = base.clone();
            match rnd() % 4 {
                0 => {
                    // Swap a number for an edge value.
                    let digits: Vec<usize> = text
                        .char_indices()
                        .filter(|(_, c)| c.is_ascii_digit())
                        .map(|(i, _)| i)
                        .collect();
                    if let Some(i) = digits.get(rnd() as usize % digits.len().max(1)) {
                        let edge = edges[rnd() as usize % edges.len()];
                        text.replace_range(*i..*i + 1, edge);
                    }
                }
                1 => text.truncate(rnd() as usize % (text.len() + 1)),
                _ => {}
            }
            let mut bytes = text.into_bytes();
            if rnd() % 2 == 0 && !bytes.is_empty() {
                let i = rnd() as usize % bytes.len();
                bytes[i] = rnd() as u8;
            }
            if let Ok(m) = parse_meta_bytes(&bytes, &logs) {
                if let Some(r) = m.max_runtime_s {
                    let left = (r - (unix_now() - m.created_unix).max(0.0)).max(0.0);
                    let _ = std::time::Instant::now() + Duration::from_secs_f64(left);
                }
                assert!(m.stdout_log.starts_with(&logs) && m.stderr_log.starts_with(&logs));
                assert!(m
                    .started
                    .as_ref()
                    .is_none_or(|s| s.pid >= 1 && s.shim_pid >= 1));
            }
            if let Ok(e) = store::parse_record::<shim::Exit>(&bytes) {
                let _ = e.code();
            }
            if let Ok(e) = crate::ledger::parse_line(&bytes) {
                assert!(e.at.is_finite());
            }
            if let Ok(i) = crate::outbox::parse_entry(&bytes) {
                assert!(!i.topic.contains('#') && !i.topic.contains('+'));
            }
        }
        std::fs::remove_dir_all(&layout.state).unwrap();
    }

    fn fake_shim(layout: &Layout, id: &str, script: &str) -> Launched {
        std::fs::create_dir_all(layout.dir(id)).unwrap();
        let child = Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let shim_pid = child.id() as i32;
        let mut meta =
            parse_meta_bytes(good_meta(layout).to_string().as_bytes(), &layout.logs()).unwrap();
        meta.safe_id = id.into();
        meta.started = None;
        Launched {
            meta,
            shim_pid,
            shim_start_ticks: procinfo::start_ticks(shim_pid).unwrap(),
            child,
        }
    }

    /// The settler reads every shim's pid line at once: a slow shim does not hold up the
    /// others, one that reports an error is refused with it, and one that says nothing in time
    /// is killed (it must not start an untracked workload later) and its directory removed.
    #[test]
    fn pid_lines_are_read_all_at_once_and_a_silent_shim_is_stopped() {
        let layout = scratch("settle");
        let launched = vec![
            fake_shim(&layout, "slow", "sleep 0.3; echo pid 4242; sleep 1"),
            fake_shim(&layout, "err", "echo 'error: cannot open the log files'"),
            fake_shim(&layout, "mute", "exec sleep 30"),
            fake_shim(&layout, "fast", "echo pid 4343"),
        ];
        let mute = (launched[2].shim_pid, launched[2].shim_start_ticks);
        let out = settle(&layout, launched, Duration::from_secs(2));
        make_durable(&layout, &["slow", "fast"]);
        let ids: Vec<&str> = out.iter().map(|(id, _, _)| id.as_str()).collect();
        assert_eq!(ids, ["slow", "err", "mute", "fast"], "in order");
        let pid = |i: usize| out[i].2.as_ref().map(|m| m.pid());
        assert_eq!(pid(0), Ok(4242));
        assert_eq!(pid(3), Ok(4343));
        assert_eq!(out[3].2.as_ref().unwrap().phase, Phase::Running);
        assert_eq!(out[1].2.as_ref().unwrap_err(), "cannot open the log files");
        assert_eq!(
            out[2].2.as_ref().unwrap_err(),
            "the workload supervisor did not report a pid"
        );
        assert!(
            !procinfo::same_process_alive(mute.0, mute.1),
            "the silent shim was killed"
        );
        assert!(!layout.dir("mute").exists() && !layout.dir("err").exists());
        assert!(layout.dir("slow").exists() && layout.dir("fast").exists());
        std::fs::remove_dir_all(&layout.state).unwrap();
    }

    /// A node killed between forking a shim and the shim's start record: recovery waits for
    /// the record while that shim lives, so the workload is re-adopted, not forgotten (and
    /// then started a second time by a redelivery).
    #[test]
    fn recovery_waits_for_the_start_record_of_a_shim_still_starting() {
        let layout = scratch("waitshim");
        let dir = layout.dir("w1");
        let mut meta = good_meta(&layout);
        meta.as_object_mut().unwrap().remove("started");
        meta["phase"] = serde_json::json!("starting");
        std::fs::write(dir.join("meta.json"), meta.to_string()).unwrap();
        // Stands in for the shim: `__shim <dir>` on its command line.
        let mut shim = Command::new("sh")
            .arg("-c")
            .arg("sleep 5; true")
            .arg("__shim")
            .arg(&dir)
            .spawn()
            .unwrap();
        let record = good_meta(&layout)["started"].to_string();
        let writer = {
            let path = dir.join("started.json");
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                std::fs::write(path, record).unwrap();
            })
        };
        let Recovered::Intact(m) = recover_meta(&layout, &dir, "w1") else {
            panic!("intact");
        };
        writer.join().unwrap();
        assert_eq!(m.pid(), 123456, "the start record the shim wrote meanwhile");
        assert_eq!(m.phase, Phase::Running);
        shim.kill().unwrap();
        shim.wait().unwrap();
        // No shim: nothing to wait for (a record without a pid is forgotten by the node).
        std::fs::remove_file(dir.join("started.json")).unwrap();
        let Recovered::Intact(m) = recover_meta(&layout, &dir, "w1") else {
            panic!("intact");
        };
        assert!(m.started.is_none());
        std::fs::remove_dir_all(&layout.state).unwrap();
    }

    #[test]
    fn summarises_failures() {
        let dir = std::env::temp_dir().join(format!("cw-sum-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let meta = Meta {
            safe_id: "x".into(),
            kind: "training".into(),
            request_id: Value::Null,
            workload_uuid: None,
            created_unix: 0.0,
            command: String::new(),
            stdout_log: dir.join("o"),
            stderr_log: dir.join("e"),
            max_runtime_s: None,
            phase: Phase::Running,
            started: None,
            cancel: None,
            workflow: None,
            event_token: String::new(),
            gpus: None,
            salvaged: None,
        };
        assert_eq!(failure_summary(&meta, "fallback").0, "fallback");
        std::fs::write(dir.join("o"), "out line\n").unwrap();
        assert_eq!(failure_summary(&meta, "fallback").0, "out line");
        std::fs::write(
            dir.join("e"),
            format!("first\nTraceback: {}\n\n", "x".repeat(400)),
        )
        .unwrap();
        let (error, stderr) = failure_summary(&meta, "fallback");
        assert_eq!(error.chars().count(), 300);
        assert!(stderr.unwrap().starts_with("first"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_exit_status_link_holds_exactly_what_the_supervisor_writes() {
        use shim::Exit;
        let e = |c: Option<i32>, s: Option<i32>| Exit {
            exit_code: c,
            signal: s,
            started_at: String::new(),
            ended_at: String::new(),
        };
        for exit in [
            e(Some(0), None),
            e(Some(255), None),
            e(None, Some(9)),
            e(None, None),
        ] {
            let text = exit.link_text();
            assert!(text.len() <= 59, "fits a fast symlink: {text}");
            assert_eq!(Exit::from_link_text(&text), Some(exit));
        }
        for bad in [
            "",
            "v1",
            "v1 ",
            "exit=3",
            "v2 exit=3",
            "v1 exit=",
            "v1 exit=256",
            "v1 exit=-1",
            "v1 exit=+3",
            "v1 exit=0003",
            "v1 exit=3 ",
            "v1 signal=0",
            "v1 signal=65",
            "v1 signal=9x",
            "v1 unknown ",
            "v1 exit=3\n",
        ] {
            assert_eq!(Exit::from_link_text(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_status_left_in_the_link_is_read_and_written_to_exit_json() {
        let layout = scratch("exitlink");
        let dir = layout.dir("w1");
        assert!(load_exit(&dir).is_none());
        // Planted in its place: a regular file, a FIFO, a link to a file, an overlong target.
        let link = dir.join(shim::EXIT_LINK);
        std::fs::write(&link, "v1 exit=0").unwrap();
        assert!(load_exit(&dir).is_none(), "a regular file is no record");
        std::fs::remove_file(&link).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &link).unwrap();
        assert!(load_exit(&dir).is_none(), "a link is never followed");
        std::fs::remove_file(&link).unwrap();
        std::os::unix::fs::symlink(format!("v1 exit=3{}", " ".repeat(100)), &link).unwrap();
        assert!(load_exit(&dir).is_none());
        std::fs::remove_file(&link).unwrap();
        assert!(!dir.join("exit.json").exists());
        // What the supervisor leaves on a full disk: reported, then written as exit.json.
        std::os::unix::fs::symlink("v1 exit=7", &link).unwrap();
        let exit = load_exit(&dir).unwrap();
        assert_eq!(exit.code(), 7);
        assert!(std::fs::symlink_metadata(&link).is_err(), "the link went");
        let again = load_exit(&dir).unwrap();
        assert_eq!(again, exit, "exit.json holds it now");
        std::fs::remove_dir_all(&layout.state).unwrap();
    }
}
