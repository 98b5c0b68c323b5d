//! Workloads: the persisted record of each one, and how one is started (params file, command
//! rendering, environment, the shim). The node's event loop owns the table of active workloads
//! (`node/workloads.rs`); this module holds no state of its own.

pub mod procinfo;
pub mod reaper;
pub mod shim;
pub mod tail;

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
/// and start times are recorded there, not in `meta.json`).
pub fn load_meta(dir: &Path) -> Option<Meta> {
    let mut meta: Meta = read_json(&dir.join("meta.json"))?;
    if meta.started.is_none() {
        meta.started = read_json(&dir.join("started.json"));
        if meta.started.is_some() {
            meta.phase = Phase::Running;
        }
    }
    Some(meta)
}

pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Option<T> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// What a start needs beyond the settings.
pub struct StartRequest<'a> {
    pub kind: &'a str,
    pub request_id: &'a Value,
    pub safe_id: &'a str,
    pub params: Map<String, Value>,
    pub template: &'a str,
    /// The node's own API token (empty in standalone mode).
    pub node_token: &'a str,
    pub max_runtime_s: Option<f64>,
    pub workflow: Option<WorkflowCtx>,
    /// The node's control socket, for `emit`.
    pub socket: PathBuf,
    /// Its GPUs (D36): `Some` sets the CUDA/NVIDIA variables (an empty list hides every GPU).
    pub gpus: Option<Vec<String>>,
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

/// Starts a workload under the shim. Returns its record with `started` filled in, or the
/// reason it could not start (then nothing is left running and the directory is gone).
pub fn start(
    s: &Settings,
    layout: &Layout,
    exe: &Path,
    req: StartRequest<'_>,
) -> Result<Meta, String> {
    let dir = layout.dir(req.safe_id);
    store::ensure_private_dir(&layout.workloads())
        .map_err(|e| format!("cannot create {}: {e}", layout.workloads().display()))?;
    std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let result = start_in(s, layout, exe, &dir, req);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn start_in(
    s: &Settings,
    layout: &Layout,
    exe: &Path,
    dir: &Path,
    mut req: StartRequest<'_>,
) -> Result<Meta, String> {
    let _ = std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700));
    store::ensure_private_dir(&layout.logs())
        .map_err(|e| format!("cannot create {}: {e}", layout.logs().display()))?;
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
    let module = module_of(req.template).map(|m| (m, s.working_dir.join(m)));
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
    let command = match &module {
        None => req
            .template
            .replace("{body}", &shell_quote(&params_file.display().to_string())),
        Some((value, path)) => {
            let runner = dir.join("module_runner.py");
            store::write_replace_unsynced(&runner, MODULE_RUNNER.as_bytes(), 0o600)
                .map_err(|e| format!("cannot write the module runner: {e}"))?;
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
                module_function(req.kind),
                shell_quote(&params_file.display().to_string()),
                shell_quote(value)
            )
        }
    };
    let stdout_log = layout.logs().join(format!("{stem}.stdout.log"));
    let stderr_log = layout.logs().join(format!("{stem}.stderr.log"));
    let mut meta = Meta {
        safe_id: req.safe_id.to_string(),
        kind: req.kind.to_string(),
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
        event_token: crate::util::hex(&crate::util::random_bytes::<16>()),
        gpus: req.gpus.clone(),
    };
    save_meta(layout, &meta).map_err(|e| format!("cannot write the workload record: {e}"))?;

    // The workload's environment (D2/D3 and the per-workload token of ecosystem §5).
    let mut env: BTreeMap<String, String> = s.env.merged();
    for k in NODE_ONLY_VARS {
        env.remove(*k);
    }
    let credential = token.unwrap_or_else(|| req.node_token.to_string());
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
    env.insert("CYBERWAVE_WORKLOAD_TYPE".into(), req.kind.to_string());
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
    };
    let shim_log = std::fs::File::create(dir.join("shim.log"))
        .map_err(|e| format!("cannot create the shim log: {e}"))?;
    let mut child = Command::new(exe)
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
    let shim_pid = child.id() as i32;
    let line = child
        .stdout
        .take()
        .map(|out| read_line_timeout(out, Duration::from_secs(10)))
        .unwrap_or_default();
    drop(child); // the reaper thread waits for it
    let pid: i32 = match line
        .strip_prefix("pid ")
        .and_then(|p| p.trim().parse().ok())
    {
        Some(p) => p,
        None => {
            let why = line
                .strip_prefix("error: ")
                .unwrap_or(&line)
                .trim()
                .to_string();
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
        shim_start_ticks: procinfo::start_ticks(shim_pid).unwrap_or(0),
        boot_id: procinfo::boot_id(),
        started_at: crate::util::rfc3339(SystemTime::now()),
    };
    // meta.json on disk keeps saying "starting": the shim's started.json (written durably before
    // it reported the pid) completes it at recovery, so a second synced write is not needed here.
    meta.started = Some(started);
    meta.phase = Phase::Running;
    Ok(meta)
}

/// Reads one line from the shim's pipe, waiting at most `timeout`.
fn read_line_timeout(mut out: std::process::ChildStdout, timeout: Duration) -> String {
    let fd = out.as_raw_fd();
    let deadline = std::time::Instant::now() + timeout;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 256];
    while !buf.contains(&b'\n') {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            break;
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        if rc <= 0 {
            break;
        }
        match out.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    String::from_utf8_lossy(&buf)
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
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
        b if b.len() >= 12 && &b[..4] == b"RIFF" && &b[8..12] == b"WEBP" => "webp",
        _ => "jpg",
    };
    store::ensure_private_dir(&layout.inputs()).map_err(|e| e.to_string())?;
    let name = format!("image_{stem}.{ext}");
    store::write_atomic(&layout.inputs().join(&name), &bytes, 0o600).map_err(|e| e.to_string())?;
    Ok(name)
}

/// Lenient standard base64 (whitespace ignored, padding optional; URL-safe letters accepted).
pub fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
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
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::new();
    let _ = f.take(max).read_to_end(&mut buf);
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
}
