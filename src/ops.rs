//! Operator commands: `status`, `logs`, `drain`, `resume`, `doctor`. They work whether or not
//! the node runs: a running node answers on its control socket; otherwise the state dir says
//! what it knows.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use crate::config::{self, env::EnvLayers, Flags, Settings};
use crate::control::{self, CallError};
use crate::error::CliError;
use crate::workload::{self, procinfo, Meta};

fn state_dir() -> Result<PathBuf, CliError> {
    config::config_dir(&EnvLayers::from_process())
        .map(|s| s.value)
        .map_err(|e| CliError::Usage(e.to_string()))
}

fn ask(state: &Path, op: &str) -> Result<Value, CallError> {
    control::call(
        &state.join("control.sock"),
        &json!({"op": op}),
        Duration::from_secs(10),
    )
}

/// `v[key]` without the panic of `Index` (null when absent).
fn field<'a>(v: &'a Value, key: &str) -> &'a Value {
    v.get(key).unwrap_or(&Value::Null)
}

fn count_files(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
                .count()
        })
        .unwrap_or(0)
}

fn metas(state: &Path) -> Vec<Meta> {
    let mut out: Vec<Meta> = std::fs::read_dir(state.join("workloads"))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| workload::load_meta(&e.path()))
                .collect()
        })
        .unwrap_or_default();
    out.sort_by(|a, b| a.created_unix.total_cmp(&b.created_unix));
    out
}

/// What the state dir says when no node answers.
fn offline_status(state: &Path) -> Value {
    let identity: Value =
        workload::read_json(&state.join("instance_identity.json")).unwrap_or(Value::Null);
    let now = workload::unix_now();
    json!({
        "running": false,
        "instance_uuid": field(&identity, "uuid"),
        "slug": field(&identity, "slug"),
        "state_dir": state,
        "workloads": metas(state).iter().map(|m| {
            let alive = m.started.as_ref().is_some_and(|s| procinfo::same_process_alive(s.pid, s.start_ticks));
            json!({
                "pid": m.pid(),
                "type": m.kind,
                "request_id": m.request_id,
                "workload_uuid": m.workload_uuid,
                "state": if alive { "running (node down)" } else { "ended (not yet reported)" },
                "running_for_seconds": (now - m.created_unix).max(0.0) as u64,
                "stdout_log": m.stdout_log,
                "stderr_log": m.stderr_log,
            })
        }).collect::<Vec<_>>(),
        "services": saved_services(state),
        "outbox": count_files(&state.join("outbox")),
        "ingress_queue": count_files(&state.join("ingress")),
    })
}

/// The services the state dir lists (D59), each with whether it still runs: what `status`
/// shows when no node answers, and what `doctor` shows. Read only (a bad file is the node's to
/// quarantine).
fn saved_services(state: &Path) -> Vec<Value> {
    use workload::services::{self, Tracked, SERVICES_FILE};
    let tracked: Tracked =
        crate::store::read_record(&state.join(SERVICES_FILE), 1 << 20).unwrap_or_default();
    let boot = procinfo::boot_id();
    tracked
        .services
        .iter()
        .map(|s| {
            let alive = s.boot_id == boot && services::alive(&s.process);
            json!({
                "pid": s.process.pid,
                "command": s.process.cmdline,
                "started_by": s.started_by,
                "request_id": s.request_id,
                "workload_uuid": s.workload_uuid,
                "uid": s.process.uid,
                "since": s.since,
                "state": if alive { "running" } else { "ended" },
            })
        })
        .collect()
}

/// `status`: what workloads and the install script left running (D59).
fn print_services(st: &Value) {
    let s = text;
    let list = field(st, "services")
        .as_array()
        .cloned()
        .unwrap_or_default();
    crate::outln!("services:   {}", list.len());
    for v in list {
        let by = match field(&v, "request_id").as_str() {
            Some(r) => format!(
                "{} {}",
                s(field(&v, "started_by")),
                crate::logtext::terminal(r)
            ),
            None => s(field(&v, "started_by")),
        };
        crate::outln!(
            "  pid {:<8} {:<8} since {}  started by {by}",
            field(&v, "pid"),
            s(field(&v, "state")),
            s(field(&v, "since")),
        );
        crate::outln!("    {}", s(field(&v, "command")));
        if let Some(g) = field(&v, "gpus").as_array().filter(|g| !g.is_empty()) {
            let ids: Vec<String> = g.iter().map(s).collect();
            crate::outln!("    gpus: {}", ids.join(", "));
        }
    }
}

pub fn status(json_out: bool) -> Result<(), CliError> {
    let state = state_dir()?;
    let mut st = match ask(&state, "status") {
        Ok(r) if field(&r, "ok") == true => field(&r, "status").clone(),
        _ => offline_status(&state),
    };
    match st.as_object_mut() {
        Some(o) => {
            o.insert("state_dir".into(), json!(state));
        }
        None => st = json!({ "state_dir": state }),
    }
    if json_out {
        crate::outln!("{}", crate::out::json(&st));
        return Ok(());
    }
    print_node(&st, &state);
    print_workloads(&st);
    print_services(&st);
    print_gpus(&st);
    Ok(())
}

/// A string field, escaped for the terminal (D69: it may come from outside), else "-".
fn text(v: &Value) -> String {
    v.as_str()
        .map(|s| crate::logtext::terminal(s).into_owned())
        .unwrap_or_else(|| "-".into())
}

/// A request id as `status` shows it: its text, escaped for the terminal (D69).
fn request_text(v: &Value) -> String {
    crate::logtext::terminal(&crate::protocol::commands::request_id_text(v)).into_owned()
}

/// `status`: the node, its instance, heartbeat, admission and outbox.
fn print_node(st: &Value, state: &Path) {
    let s = text;
    if field(st, "running") == true {
        crate::outln!(
            "node:       running (pid {}), broker {} ({}), {}",
            field(st, "pid"),
            s(field(st, "broker")),
            if field(st, "connected") == true {
                "connected"
            } else {
                "disconnected"
            },
            if field(st, "registered") == true {
                "registered"
            } else {
                "not registered yet"
            }
        );
    } else {
        crate::outln!(
            "node:       not running (state from {})",
            crate::logtext::terminal(&state.display().to_string())
        );
    }
    crate::outln!(
        "instance:   {} (slug {}){}",
        s(field(st, "instance_uuid")),
        s(field(st, "slug")),
        field(st, "environment_uuid")
            .as_str()
            .map(|e| format!(", reserved for environment {}", crate::logtext::terminal(e)))
            .unwrap_or_default()
    );
    if field(st, "running") == true {
        crate::outln!(
            "heartbeat:  last acknowledged {}",
            s(field(st, "last_heartbeat_ok"))
        );
        crate::outln!(
            "accepting:  {}",
            if field(st, "accepting") == true {
                "yes"
            } else if field(st, "draining") == true {
                "no (draining)"
            } else {
                "no"
            }
        );
        if let Some(users) = field(st, "workload_users").as_array() {
            let names: Vec<String> = users.iter().map(text).collect();
            crate::outln!("users:      workloads run as {}", names.join(", "));
        }
        if let Some(note) = field(st, "workload_user_shared").as_str() {
            crate::outln!("WARNING:    {note}");
        }
    }
    crate::outln!(
        "outbox:     {} completion(s), {} workflow event(s) waiting for acknowledgement",
        field(st, "outbox"),
        field(st, "ingress_queue")
    );
}

/// `status`: each workload, its logs and GPUs.
fn print_workloads(st: &Value) {
    let s = text;
    let wl = field(st, "workloads")
        .as_array()
        .cloned()
        .unwrap_or_default();
    crate::outln!("workloads:  {}", wl.len());
    for w in wl {
        crate::outln!(
            "  pid {:<8} {:<10} {:<24} {:>6}s  request {}",
            field(&w, "pid"),
            s(field(&w, "type")),
            s(field(&w, "state")),
            field(&w, "running_for_seconds"),
            request_text(field(&w, "request_id"))
        );
        crate::outln!(
            "    logs: {}  {}",
            s(field(&w, "stdout_log")),
            s(field(&w, "stderr_log"))
        );
        if let Some(g) = field(&w, "gpus").as_array() {
            let ids: Vec<String> = g.iter().map(s).collect();
            crate::outln!(
                "    gpus: {}",
                if ids.is_empty() {
                    "none".into()
                } else {
                    ids.join(", ")
                }
            );
        }
    }
}

/// `status`: the GPUs and who holds them.
fn print_gpus(st: &Value) {
    let s = text;
    if let Some(gpus) = field(st, "gpus").as_array() {
        crate::outln!("gpus:       {}", gpus.len());
        if let Some(e) = field(st, "gpus_error").as_str() {
            crate::outln!("  the GPU query fails: {}", crate::logtext::shown(e));
        }
        for g in gpus {
            let holder = match field(g, "held_by") {
                Value::Null => "free".to_string(),
                r => format!("held by {}", request_text(r)),
            };
            let reason = field(g, "reason")
                .as_str()
                .map(|r| format!(" ({})", crate::logtext::shown(r)))
                .unwrap_or_default();
            crate::outln!(
                "  {:<5} {} {}  {}{reason}, {holder}",
                s(field(g, "index")),
                s(field(g, "uuid")),
                s(field(g, "name")),
                s(field(g, "health"))
            );
        }
    }
}

pub fn drain(on: bool, wait: bool) -> Result<(), CliError> {
    let state = state_dir()?;
    match ask(&state, if on { "drain" } else { "resume" }) {
        Ok(r) if field(&r, "ok") == true => {
            crate::outln!(
                "{} ({} workload(s) running)",
                if on {
                    "draining"
                } else {
                    "accepting workloads again"
                },
                field(&r, "active_workloads")
            );
        }
        Ok(r) => {
            return Err(CliError::Runtime(
                field(&r, "error").as_str().unwrap_or("refused").to_string(),
            ));
        }
        Err(_) => {
            return Err(CliError::Runtime(format!(
                "no node is running with state dir {} (nothing to {})",
                state.display(),
                if on { "drain" } else { "resume" }
            )));
        }
    }
    if on && wait {
        loop {
            match ask(&state, "status") {
                Ok(r)
                    if field(field(&r, "status"), "workloads")
                        .as_array()
                        .is_some_and(Vec::is_empty) =>
                {
                    break
                }
                Ok(_) => std::thread::sleep(Duration::from_millis(300)),
                Err(_) => break, // the node stopped: nothing runs under it any more
            }
        }
        crate::outln!("idle: no workload running");
    }
    Ok(())
}

/// The log file of a workload named by request id or pid.
fn find_log(state: &Path, id: &str, stderr: bool) -> Option<(PathBuf, Option<String>)> {
    let pick = |m: &Meta| {
        (
            if stderr {
                m.stderr_log.clone()
            } else {
                m.stdout_log.clone()
            },
            Some(m.safe_id.clone()),
        )
    };
    let pid: Option<i32> = id.parse().ok();
    if let Some(m) = metas(state)
        .iter()
        .find(|m| m.request_id_text() == id || pid.is_some_and(|p| p == m.pid()))
    {
        return Some(pick(m));
    }
    // A finished workload: its log files stay in workload_logs/.
    let safe = crate::store::safe_id(id);
    let suffix = format!("_{safe}.{}.log", if stderr { "stderr" } else { "stdout" });
    let rd = std::fs::read_dir(state.join("workload_logs")).ok()?;
    rd.flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name().is_some_and(|n| {
                n.to_string_lossy().ends_with(&suffix)
                    && workload::KINDS
                        .iter()
                        .any(|k| n.to_string_lossy().starts_with(&format!("{k}_")))
            })
        })
        .map(|p| (p, None))
}

/// The longest line `logs` prints: the rest of a longer one is cut, with a note (D69).
pub const MAX_LINE: usize = 1 << 20;

/// What `logs` prints of a workload's log (D69): its lines escaped for the terminal. A line
/// ends at `\n`, `\r\n` or a lone `\r` (a progress bar's redraw is one line); the empty line
/// a redraw leaves is dropped, and a line over [`MAX_LINE`] bytes is cut. Fed a chunk at a
/// time, it holds at most one line.
#[derive(Debug, Default)]
struct View {
    /// The line so far (at most [`MAX_LINE`] bytes).
    line: Vec<u8>,
    /// Bytes of the line past [`MAX_LINE`], not kept.
    cut: u64,
    /// The last byte fed was a `\r` that ended a line: a `\n` right after it belongs to it.
    cr: bool,
    /// … and that line was empty: printed only when the `\n` comes (an empty `\r\n` line).
    empty_cr: bool,
}

impl View {
    fn feed(&mut self, mut data: &[u8], out: &mut Vec<u8>) {
        while !data.is_empty() {
            if std::mem::take(&mut self.cr) {
                let empty = std::mem::take(&mut self.empty_cr);
                if let Some(rest) = data.strip_prefix(b"\n") {
                    if empty {
                        self.end_line(out);
                    }
                    data = rest;
                    continue;
                }
            }
            let Some(p) = memchr::memchr2(b'\n', b'\r', data) else {
                self.push(data);
                return;
            };
            self.push(data.get(..p).unwrap_or_default());
            let eol = data.get(p).copied();
            data = data.get(p.saturating_add(1)..).unwrap_or_default();
            if eol == Some(b'\r') {
                self.cr = true;
                if self.line.is_empty() && self.cut == 0 {
                    self.empty_cr = true;
                    continue;
                }
            }
            self.end_line(out);
        }
    }

    /// The log ended (or was read to its end): a last line without its line end.
    fn finish(&mut self, out: &mut Vec<u8>) {
        if !self.line.is_empty() || self.cut > 0 {
            self.end_line(out);
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        let room = MAX_LINE.saturating_sub(self.line.len());
        let take = if bytes.len() > room {
            crate::node::streams::text::utf8_cut(bytes, room).min(room)
        } else {
            bytes.len()
        };
        self.line
            .extend_from_slice(bytes.get(..take).unwrap_or_default());
        self.cut = self
            .cut
            .saturating_add(bytes.len().saturating_sub(take) as u64);
    }

    fn end_line(&mut self, out: &mut Vec<u8>) {
        crate::logtext::push_terminal(out, &self.line);
        if self.cut > 0 {
            out.extend_from_slice(
                format!(" … ({} more bytes of this line in the log file)", self.cut).as_bytes(),
            );
        }
        out.push(b'\n');
        self.line.clear();
        self.cut = 0;
    }
}

/// Where the last `n` lines of the file (`len` bytes) start: found from its end, a block at a
/// time, so neither time nor memory depends on what comes before them. A line ends at `\n`;
/// the file's final `\n` ends its last line, it does not start another.
fn last_lines_start(f: &std::fs::File, len: u64, n: usize) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    const BLOCK: u64 = 64 * 1024;
    let mut buf = vec![0u8; BLOCK as usize];
    let mut end = len;
    let mut seen = 0usize;
    while end > 0 {
        let from = end.saturating_sub(BLOCK);
        let block = buf
            .get_mut(..usize::try_from(end.saturating_sub(from)).unwrap_or(0))
            .unwrap_or_default();
        f.read_exact_at(block, from)?;
        for i in memchr::memrchr_iter(b'\n', block) {
            let at = from.saturating_add(i as u64);
            if at.saturating_add(1) == len {
                continue;
            }
            seen = seen.saturating_add(1);
            if seen == n {
                return Ok(at.saturating_add(1));
            }
        }
        end = from;
    }
    Ok(0)
}

pub fn logs(id: &str, follow: bool, stderr: bool, lines: Option<usize>) -> Result<(), CliError> {
    let state = state_dir()?;
    let Some((path, tracked)) = find_log(&state, id, stderr) else {
        return Err(CliError::Runtime(format!(
            "no workload with request id or pid {} in {}",
            crate::logtext::terminal(&format!("{id:?}")),
            state.display()
        )));
    };
    // Not through a link the workload may have planted (it would print another file).
    let f = crate::workload::tail::open_log(&path, false)
        .map_err(|e| CliError::Runtime(format!("cannot open {}: {e}", path.display())))?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut pos = match lines {
        Some(n) if n > 0 => last_lines_start(&f, len, n)
            .map_err(|e| CliError::Runtime(format!("cannot read {}: {e}", path.display())))?,
        _ => 0, // `-n 0` has always shown the whole log
    };
    drop(f);
    // Read as the node streams it (D52): holes and NUL runs skipped, not read into memory; a
    // chunk at a time, so a log of any size costs at most a chunk and a line.
    let key = crate::workload::tail::Key::default();
    let mut view = View::default();
    let mut out = Vec::new();
    let dir = tracked.map(|t| state.join("workloads").join(t));
    loop {
        let ended = !follow || dir.as_ref().is_none_or(|d| !d.exists());
        // A log truncated below `pos` is followed from its start.
        let c = crate::workload::tail::read(key.clone(), &path, pos, 1 << 20, &[]);
        pos = c.at().saturating_add(c.data.len() as u64);
        view.feed(&c.data, &mut out);
        crate::out::stdout_bytes(&out);
        out.clear();
        if c.data.is_empty() && c.skipped == 0 {
            if ended {
                view.finish(&mut out);
                crate::out::stdout_bytes(&out);
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// One line of `doctor`'s report: its level (`PASS`, `WARN`, `FAIL`) and what it found.
type Finding = (&'static str, String);

/// One of `doctor`'s checks: its findings on the resolved settings.
type Check = fn(&Settings) -> Vec<Finding>;

/// `doctor`'s checks after the configuration, run in this order: each is named in the report's
/// second column and returns its lines.
const CHECKS: &[(&str, Check)] = &[
    ("API token", check_api_token),
    ("MQTT client id", check_client_id),
    ("MQTT broker", check_broker),
    ("bash", check_bash),
    ("state dir", check_state_dir),
    ("results folder", check_results_folder),
    ("workload user", check_workload_user),
    ("free disk", check_free_disk),
    ("systemd unit", check_systemd_unit),
    ("GPUs", check_gpus),
    ("services", check_services),
    ("HOME", check_home),
];

fn pass(detail: impl Into<String>) -> Vec<Finding> {
    vec![("PASS", detail.into())]
}
fn warn(detail: impl Into<String>) -> Vec<Finding> {
    vec![("WARN", detail.into())]
}
fn fail(detail: impl Into<String>) -> Vec<Finding> {
    vec![("FAIL", detail.into())]
}

/// Prints one report line; counts the failures.
fn report(fails: &mut u32, level: &str, what: &str, detail: &str) {
    if level == "FAIL" {
        *fails = fails.saturating_add(1);
    }
    crate::outln!("{level:<4}  {what:<22} {detail}");
}

/// `doctor`: one line per check; exit 1 on any FAIL.
pub fn doctor(flags: &Flags, cwd: &Path) -> Result<(), CliError> {
    let mut fails = 0u32;
    let settings = match config::resolve(flags, EnvLayers::from_process(), cwd) {
        Ok(s) => {
            report(&mut fails, "PASS", "configuration", &configuration_line(&s));
            s
        }
        Err(e) => {
            let detail = format!(
                "{} — fix it (`cyberwave-cloud-node validate` lists every problem)",
                e.0.join("; ")
            );
            report(&mut fails, "FAIL", "configuration", &detail);
            crate::outln!("\n{fails} check(s) failed");
            return Err(CliError::Found);
        }
    };
    for (what, check) in CHECKS {
        for (level, detail) in check(&settings) {
            report(&mut fails, level, what, &detail);
        }
    }
    if fails > 0 {
        crate::outln!("\n{fails} check(s) failed");
        Err(CliError::Found)
    } else {
        Ok(())
    }
}

fn configuration_line(s: &Settings) -> String {
    s.manifest
        .as_ref()
        .map(|m| {
            let refused = s.manifest_platform_refusals;
            if refused == 0 {
                format!("{} is valid", m.path.display())
            } else {
                format!(
                    "{} runs, but the platform's validator would refuse it ({refused} problem(s); `cyberwave-cloud-node validate` lists them)",
                    m.path.display()
                )
            }
        })
        .unwrap_or_else(|| "no manifest; environment only".into())
}

fn check_api_token(settings: &Settings) -> Vec<Finding> {
    if settings.standalone {
        return pass("not needed (--standalone)");
    }
    let Some(t) = &settings.api_token else {
        return fail("none: set CYBERWAVE_API_KEY or run `cyberwave login`");
    };
    match crate::backend::check_token(
        &crate::backend::Backend::of(settings, &t.value),
        settings.tuning.token_check_timeout,
    ) {
        crate::backend::TokenCheck::Accepted => pass(format!(
            "{} accepted by {}",
            crate::util::mask_secret(&t.value),
            settings.base_url.value
        )),
        crate::backend::TokenCheck::Rejected(s) => fail(format!(
            "{} rejected (HTTP {s}); it came from {} — replace it there",
            crate::util::mask_secret(&t.value),
            t.source
        )),
        crate::backend::TokenCheck::Inconclusive(why) => warn(format!("could not check it: {why}")),
    }
}

/// D33: a running node records when another client took its broker session over.
fn check_client_id(settings: &Settings) -> Vec<Finding> {
    let marker = settings
        .config_dir
        .value
        .join(crate::store::CLIENT_ID_CONFLICT);
    let recent = std::fs::metadata(&marker)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age <= Duration::from_secs(600));
    if !recent {
        return pass("no other client took this node's session in the last 10 minutes");
    }
    fail(format!(
        "another client took this node's broker session over (at {}): a copy of {} runs elsewhere with the same node_id; stop the copy, delete node_id and instance_identity.json in its state dir, start it again",
        crate::store::read_state_file(&marker, crate::store::MAX_RECORD_BYTES)
            .map(|b| crate::store::clip(String::from_utf8_lossy(&b).trim(), 64))
            .unwrap_or_default(),
        settings.config_dir.value.display()
    ))
}

/// A real CONNECT with the node's settings (its own client id, so a running node is not
/// disturbed).
fn check_broker(settings: &Settings) -> Vec<Finding> {
    let client_id = format!(
        "cloud_node_dr{}",
        crate::util::hex(&crate::util::random_bytes::<3>())
    );
    let opts = match crate::config::broker::mqtt_options(settings, client_id, Duration::ZERO) {
        Ok(opts) => opts,
        Err(e) => return fail(e.to_string()),
    };
    let (tx, rx) = crossbeam_channel::unbounded();
    let m = match crate::mqtt::Mqtt::new(opts, tx) {
        Ok(m) => m,
        Err(e) => return fail(e.to_string()),
    };
    m.start_connect();
    let outcome = loop {
        match rx.recv_timeout(Duration::from_secs(15)) {
            Ok(crate::mqtt::MqttEvent::Connect(r)) => break Some(r),
            Ok(_) => continue,
            Err(_) => break None,
        }
    };
    let found = match outcome {
        Some(Ok(_)) => pass(format!(
            "{} accepted the connection and credentials",
            m.endpoint()
        )),
        Some(Err(why)) => fail(why),
        None => fail(format!("no answer from {} in 15 s", m.endpoint())),
    };
    m.disconnect(Duration::from_millis(500));
    found
}

fn check_bash(_: &Settings) -> Vec<Finding> {
    let bash = ["/bin/bash", "/usr/bin/bash"]
        .iter()
        .any(|p| Path::new(p).exists());
    if bash {
        pass("present (workload commands run with bash -c)")
    } else {
        warn("missing: commands run with sh -c, which lacks `source` and other bashisms")
    }
}

/// Why a folder is neither writable nor creatable.
#[derive(Debug)]
enum NotWritable {
    NoParent,
    /// The nearest existing path is no folder.
    NotAFolder(PathBuf),
    /// A probe file cannot be created in the nearest existing folder.
    Refused(PathBuf, std::io::Error),
}

impl std::fmt::Display for NotWritable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotWritable::NoParent => write!(f, "no existing parent"),
            NotWritable::NotAFolder(p) => write!(f, "{} is not a folder", p.display()),
            NotWritable::Refused(p, e) => write!(f, "cannot write in {}: {e}", p.display()),
        }
    }
}

/// Writable, or creatable: a probe file in the folder or its nearest existing parent (nothing
/// is left behind).
fn writable(dir: &Path) -> Result<(), NotWritable> {
    let existing = dir
        .ancestors()
        .find(|a| a.exists())
        .ok_or(NotWritable::NoParent)?;
    if !existing.is_dir() {
        return Err(NotWritable::NotAFolder(existing.to_path_buf()));
    }
    // A fresh name, created exclusively: never a planted FIFO or link (D48).
    let probe = existing.join(format!(
        ".cw-doctor-{}-{}",
        std::process::id(),
        crate::util::hex(&crate::util::random_bytes::<4>())
    ));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .map_err(|e| NotWritable::Refused(existing.to_path_buf(), e))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

fn check_state_dir(settings: &Settings) -> Vec<Finding> {
    let state = &settings.config_dir.value;
    match writable(state) {
        Ok(()) => pass(format!("{} is writable", state.display())),
        Err(e) => fail(format!(
            "{}: {e} — fix its ownership or set CYBERWAVE_EDGE_CONFIG_DIR",
            state.display()
        )),
    }
}

fn check_results_folder(settings: &Settings) -> Vec<Finding> {
    let results = &settings.results_folder.value;
    if !settings.upload_results.value {
        return pass("uploads are off");
    }
    match writable(results) {
        Ok(()) => pass(format!("{} is writable", results.display())),
        Err(e) => fail(format!(
            "{}: {e} — create it writable for the node's user, or set results_folder",
            results.display()
        )),
    }
}

/// D46.3 and D65: who workloads run as, whether several share a uid, and whether the node's
/// secrets in the state dir would be readable by them.
fn check_workload_user(settings: &Settings) -> Vec<Finding> {
    use std::os::unix::fs::PermissionsExt;
    let Some(spec) = settings
        .manifest
        .as_ref()
        .and_then(|m| m.workload_user.as_deref())
    else {
        return pass("none: workloads run as the node's user");
    };
    let pool = match crate::workload::user::lookup_pool(spec) {
        Ok(p) => p,
        Err(e) => return fail(e.to_string()),
    };
    let slots = settings.max_concurrent_workloads.value;
    let n = u32::try_from(pool.len()).unwrap_or(u32::MAX);
    let mut out = Vec::new();
    for name in [".env", "credentials.json"] {
        let path = settings.config_dir.value.join(name);
        let mode = std::fs::metadata(&path).map_or(0, |m| m.permissions().mode());
        if mode & 0o044 != 0 {
            out.push((
                "FAIL",
                format!(
                    "{} is readable by group or others: run `chmod 600 {}`",
                    path.display(),
                    path.display()
                ),
            ));
        }
    }
    match pool.as_slice() {
        [u] if slots > 1 => out.push((
            "WARN",
            crate::workload::user::shared_uid_note(&u.name, u.uid, slots),
        )),
        [u] => out.push(("PASS", format!("{} (uid {})", u.name, u.uid))),
        _ if n < slots => out.push((
            "FAIL",
            format!("a pool of {n} users for {slots} slots: the node refuses to start"),
        )),
        _ => out.push((
            "PASS",
            format!("a pool of {n} users, one per running workload"),
        )),
    }
    out
}

fn check_free_disk(settings: &Settings) -> Vec<Finding> {
    let min = settings.min_free_disk_mb.value;
    match crate::store::free_mb(&settings.config_dir.value) {
        Some(free) if free < min => fail(format!(
            "{free} MiB free, min_free_disk_mb is {min}: free space or lower the limit"
        )),
        Some(free) => pass(format!("{free} MiB free (minimum {min})")),
        None => warn("cannot measure"),
    }
}

/// D59: what workloads and the install script left running, as the state dir lists it.
fn check_services(settings: &Settings) -> Vec<Finding> {
    let list = saved_services(&settings.config_dir.value);
    if list.is_empty() {
        return pass("none: no workload or install script left a server running");
    }
    list.iter()
        .map(|v| {
            let by = match field(v, "request_id").as_str() {
                Some(r) => format!(
                    "{} {}",
                    text(field(v, "started_by")),
                    crate::logtext::terminal(r)
                ),
                None => text(field(v, "started_by")),
            };
            (
                "PASS",
                format!(
                    "pid {} ({}) {}, started by {by} at {}; `cancel` with its pid stops it",
                    field(v, "pid"),
                    text(field(v, "command")),
                    text(field(v, "state")),
                    text(field(v, "since"))
                ),
            )
        })
        .collect()
}

/// Where the install script and the workloads keep what they put under `$HOME` (a venv, a
/// model cache): a HOME inside the state dir (the packaged service's user has its home there)
/// goes with it when the package is purged. Told by the HOME `doctor` runs with, and by what
/// such a HOME left in the state dir (`.venv`, `.cache`, `.local`).
fn check_home(settings: &Settings) -> Vec<Finding> {
    let state = &settings.config_dir.value;
    let home = settings.env.value("HOME").filter(|h| !h.is_empty());
    let inside = home
        .as_deref()
        .is_some_and(|h| std::path::Path::new(h).starts_with(state));
    let left: Vec<&str> = [".venv", ".cache", ".local"]
        .into_iter()
        .filter(|n| state.join(n).is_dir())
        .collect();
    let fix = "set HOME (and HF_HOME) to a folder of its own in the service's environment, or use workload_user (README: Running the platform's compute repositories)";
    if !left.is_empty() {
        return warn(format!(
            "the state dir {} holds {}: what an install script or a workload kept under a HOME there; `apt-get purge` deletes it with the state dir; {fix}",
            state.display(),
            left.join(", ")
        ));
    }
    match home {
        Some(h) if inside => warn(format!(
            "HOME is {h}, inside the state dir: a venv or model cache kept under $HOME is deleted with it (`apt-get purge`); {fix}"
        )),
        Some(h) => pass(format!("{h}, outside the state dir")),
        None => pass("not set"),
    }
}

/// D44: the unit in effect, and whether it is the packaged one.
fn check_systemd_unit(_: &Settings) -> Vec<Finding> {
    let (dirs, with_user_unit) = crate::systemd::unit_dirs();
    let user_unit = with_user_unit
        .then(|| crate::systemd::paths(true).ok().map(|p| p.unit))
        .flatten();
    crate::systemd::doctor_lines(&dirs, user_unit)
}

/// GPUs (D35, D37): the node's own query; each unhealthy GPU named with its reason.
fn check_gpus(_: &Settings) -> Vec<Finding> {
    let timing = crate::gpu::Timing::from_env(&EnvLayers::from_process());
    crate::gpu::doctor_lines(&timing)
}

#[cfg(test)]
mod tests {
    use super::{last_lines_start, View, MAX_LINE};

    /// The last `n` lines by their plain definition: split into lines, keep the last `n`.
    fn last_lines(text: &[u8], n: usize) -> usize {
        let body = text.strip_suffix(b"\n").unwrap_or(text);
        let starts: Vec<usize> = std::iter::once(0)
            .chain(
                body.iter()
                    .enumerate()
                    .filter(|(_, b)| **b == b'\n')
                    .map(|(i, _)| i + 1),
            )
            .collect();
        if starts.len() > n {
            starts[starts.len() - n]
        } else {
            0
        }
    }

    /// `logs -n N` finds where the last N lines start from the end of the file: for any text
    /// (blocks of 64 KiB cut it anywhere), the start of the last N lines of the whole.
    #[test]
    fn d69_logs_n_finds_the_last_lines_from_the_end() {
        let scratch = crate::scratch::Scratch::new("logs-n");
        let path = scratch.path().join("log");
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for round in 0..300 {
            // Mostly short texts; some over a block, so that lines span blocks.
            let len = if round % 10 == 0 {
                70_000 + next(100_000)
            } else {
                next(60)
            } as usize;
            let text: Vec<u8> = (0..len)
                .map(|_| {
                    if next(if round % 10 == 0 { 9000 } else { 4 }) == 0 {
                        b'\n'
                    } else {
                        b'a'
                    }
                })
                .collect();
            std::fs::write(&path, &text).unwrap();
            let f = std::fs::File::open(&path).unwrap();
            for n in [1, 2, 3, 7, 100] {
                assert_eq!(
                    last_lines_start(&f, text.len() as u64, n).unwrap() as usize,
                    last_lines(&text, n),
                    "round {round}, n={n}"
                );
            }
        }
    }

    fn view(chunks: &[&[u8]]) -> String {
        let mut v = View::default();
        let mut out = Vec::new();
        for c in chunks {
            v.feed(c, &mut out);
        }
        v.finish(&mut out);
        String::from_utf8(out).unwrap()
    }

    /// D69: `logs` shows a log as the mirror does: escaped, a redraw one line, the empty lines
    /// of redraws dropped, however the reads cut it.
    #[test]
    fn d69_logs_shows_lines_escaped_whatever_the_chunks() {
        let text: &[u8] = b"a\x1b[2J\r\n\r10%\r20%\r\r\nb\xff\n\nlast";
        let want = "a\\x1b[2J\n10%\n20%\n\nb\\xff\n\nlast\n";
        assert_eq!(view(&[text]), want);
        for cut in 0..text.len() {
            assert_eq!(view(&[&text[..cut], &text[cut..]]), want, "cut at {cut}");
        }
        let bytewise: Vec<&[u8]> = text.chunks(1).collect();
        assert_eq!(view(&bytewise), want);
        assert_eq!(view(&[b""]), "");
        assert_eq!(view(&[b"\r"]), "");
    }

    #[test]
    fn d69_a_line_over_a_mib_is_cut_with_a_note() {
        let long = vec![b'x'; MAX_LINE + 10];
        let out = view(&[&long[..MAX_LINE - 5], &long[MAX_LINE - 5..], b"\nnext\n"]);
        let (first, rest) = out.split_once('\n').unwrap();
        assert!(first.starts_with(&"x".repeat(MAX_LINE)));
        assert!(
            first.ends_with(" … (10 more bytes of this line in the log file)"),
            "{}",
            &first[MAX_LINE..]
        );
        assert_eq!(rest, "next\n");
        // Cut on a character boundary: no half character shown as bytes.
        let mut wide = vec![b'x'; MAX_LINE - 1];
        wide.extend_from_slice("é".as_bytes());
        let out = view(&[&wide]);
        assert!(out.ends_with("x … (2 more bytes of this line in the log file)\n"));
    }
}
