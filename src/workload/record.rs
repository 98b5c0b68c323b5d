//! A workload's persisted record (`workloads/<safe-id>/meta.json`), the on-disk layout below the
//! state dir, and how records are written, read back and validated.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::shim::Started;
use crate::protocol::commands::{Kind, TopicId};
use crate::store;

pub const KINDS: [&str; 3] = ["inference", "simulate", "training"];

/// A placeholder workload type for a rebuilt record whose type is unknown.
pub const UNKNOWN_KIND: &str = "workload";

/// The workload type a record names: a start's [`Kind`], or [`MetaKind::Unknown`] in a record
/// rebuilt at recovery whose type could not be proven. Written as its name (`"inference"`, …,
/// [`UNKNOWN_KIND`]), as the record always held it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaKind {
    Known(Kind),
    Unknown,
}

impl MetaKind {
    pub fn as_str(self) -> &'static str {
        match self {
            MetaKind::Known(k) => k.as_str(),
            MetaKind::Unknown => UNKNOWN_KIND,
        }
    }

    pub fn parse(s: &str) -> Option<MetaKind> {
        match Kind::parse(s) {
            Some(k) => Some(MetaKind::Known(k)),
            None => (s == UNKNOWN_KIND).then_some(MetaKind::Unknown),
        }
    }
}

impl From<Kind> for MetaKind {
    fn from(k: Kind) -> MetaKind {
        MetaKind::Known(k)
    }
}

impl PartialEq<Kind> for MetaKind {
    fn eq(&self, k: &Kind) -> bool {
        *self == MetaKind::Known(*k)
    }
}

impl std::fmt::Display for MetaKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for MetaKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for MetaKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<MetaKind, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
        MetaKind::parse(&s).ok_or_else(|| serde::de::Error::custom(kind_error()))
    }
}

fn kind_error() -> store::Invalid {
    store::Invalid::OneOf {
        field: "kind",
        allowed: &KINDS,
    }
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

/// The workflow a workload belongs to, parsed from its start params at the edge
/// ([`crate::protocol::commands::StartParams`]) and persisted here as `workflow`.
pub use crate::protocol::commands::WorkflowCtx;

/// `workloads/<safe-id>/meta.json`: everything needed to report the workload after a restart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Meta {
    pub safe_id: String,
    pub kind: MetaKind,
    pub request_id: Value,
    #[serde(
        default,
        deserialize_with = "crate::protocol::commands::persisted_workload_id"
    )]
    pub workload_uuid: Option<TopicId>,
    pub created_unix: f64,
    pub command: String,
    pub stdout_log: PathBuf,
    pub stderr_log: PathBuf,
    #[serde(default)]
    pub max_runtime_s: Option<f64>,
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
    /// The uid it runs as, with `workload_user` (D46.3; with a pool, its own among the running
    /// workloads, D65): kept across a restart, and the owner its result files must have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
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
        crate::protocol::commands::request_id_text(&self.request_id)
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

/// `meta.json` parsed and validated; the log paths are re-rooted in the state dir's log folder.
pub(super) fn parse_meta(dir: &Path) -> Result<Meta, store::StoreError> {
    let bytes = store::read_state_file(&dir.join("meta.json"), store::MAX_RECORD_BYTES)?;
    parse_meta_bytes(&bytes, &logs_dir_of(dir))
}

/// The bytes of a `meta.json` parsed and validated (also the entry point for fuzzing); the log
/// paths are re-rooted in `logs`.
pub fn parse_meta_bytes(bytes: &[u8], logs: &Path) -> Result<Meta, store::StoreError> {
    let mut meta: Meta = store::parse_record(bytes)?;
    for p in [&mut meta.stdout_log, &mut meta.stderr_log] {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !log_name_ok(&name) {
            return Err(store::StoreError::Invalid(format!(
                "a log path must end in a plain file name, got {}",
                store::shown(p)
            )));
        }
        // Only the file name is trusted: a record can never point the node at a file
        // outside its own log folder.
        *p = logs.join(name);
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

pub(super) fn log_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

impl store::Validate for Value {
    fn validate(&self) -> Result<(), store::Invalid> {
        Ok(())
    }
}

impl store::Validate for Started {
    fn validate(&self) -> Result<(), store::Invalid> {
        store::check_pid("pid", self.pid)?;
        store::check_pid("shim_pid", self.shim_pid)?;
        store::check_text("boot_id", &self.boot_id, 64)?;
        store::check_text("started_at", &self.started_at, 64)
    }
}

impl store::Validate for Cancel {
    fn validate(&self) -> Result<(), store::Invalid> {
        if !matches!(self.signal.as_str(), "SIGTERM" | "SIGINT" | "SIGKILL") {
            return Err(store::Invalid::Rule {
                field: "cancel.signal",
                must: "be SIGTERM, SIGINT or SIGKILL",
            });
        }
        store::check_unix("cancel.requested_unix", self.requested_unix)?;
        store::check_seconds("cancel.grace_s", self.grace_s, true)
    }
}

impl store::Validate for WorkflowCtx {
    fn validate(&self) -> Result<(), store::Invalid> {
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
    fn validate(&self) -> Result<(), store::Invalid> {
        if self.kind == MetaKind::Unknown && self.salvaged.is_none() {
            return Err(kind_error());
        }
        store::check_request_id(&self.request_id)?;
        // `workload_uuid` is a `TopicId`: it validated itself as it was read.
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
            return Err(store::Invalid::Rule {
                field: "event_token",
                must: "be at most 128 letters and digits",
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::shim;
    use crate::workload::testkit::{good_meta, scratch};
    use std::time::Duration;

    /// Records that must be refused: cut, not JSON, and `base` with one field made hostile.
    fn hostile_cases(base: &Value) -> Vec<(&'static str, Vec<u8>)> {
        let with = |ptr: &str, v: Value| {
            let mut m = base.clone();
            *m.pointer_mut(ptr).unwrap() = v;
            m.to_string().into_bytes()
        };
        vec![
            ("truncated", base.to_string().as_bytes()[..40].to_vec()),
            ("binary", vec![0x00, 0xff, 0x1b, b'[', 0x80]),
            ("array", b"[]".to_vec()),
            (
                "huge runtime (overflows a deadline)",
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
        ]
    }

    #[test]
    fn a_record_whose_workload_uuid_is_empty_or_none_text_has_no_workload() {
        let layout = scratch("meta-none");
        let dir = layout.dir("w1");
        let base = good_meta(&layout);
        for (uuid, want) in [("None", None), ("", None), ("w-1", Some("w-1"))] {
            let mut m = base.clone();
            m["workload_uuid"] = serde_json::json!(uuid);
            std::fs::write(dir.join("meta.json"), m.to_string()).unwrap();
            let meta = parse_meta(&dir).unwrap();
            assert_eq!(meta.workload_uuid.as_deref(), want, "{uuid:?}");
        }
        let _ = std::fs::remove_dir_all(&layout.state);
    }

    #[test]
    fn hostile_meta_records_are_refused() {
        let layout = scratch("meta");
        let dir = layout.dir("w1");
        let meta_path = dir.join("meta.json");
        let base = good_meta(&layout);
        let cases = hostile_cases(&base);
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
            Err(store::StoreError::TooBig { .. })
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

    /// The typed kind is written and read as the name the record always held; the placeholder
    /// of a rebuilt record is accepted only in a rebuilt record.
    #[test]
    fn the_kind_is_written_and_read_as_its_name() {
        let layout = scratch("kind");
        let logs = layout.logs();
        for name in ["inference", "simulate", "training"] {
            let mut m = good_meta(&layout);
            m["kind"] = serde_json::json!(name);
            let meta = parse_meta_bytes(m.to_string().as_bytes(), &logs).unwrap();
            assert_eq!(meta.kind.to_string(), name);
            let back: Value = serde_json::to_value(&meta).unwrap();
            assert_eq!(back["kind"], serde_json::json!(name));
        }
        let mut m = good_meta(&layout);
        m["kind"] = serde_json::json!(UNKNOWN_KIND);
        assert!(parse_meta_bytes(m.to_string().as_bytes(), &logs).is_err());
        m["salvaged"] = serde_json::json!("meta.json is missing");
        let meta = parse_meta_bytes(m.to_string().as_bytes(), &logs).unwrap();
        assert_eq!(meta.kind, MetaKind::Unknown);
        assert_eq!(serde_json::to_value(&meta).unwrap()["kind"], "workload");
        std::fs::remove_dir_all(&layout.state).unwrap();
    }

    /// Records written before the dead `phase` field was dropped still load (a node upgraded
    /// while its workloads run re-adopts them), and a record written now has no such field.
    #[test]
    fn an_old_record_with_a_phase_still_loads() {
        let layout = scratch("oldphase");
        let dir = layout.dir("w1");
        for phase in ["starting", "running"] {
            let mut old = good_meta(&layout);
            old["phase"] = serde_json::json!(phase);
            std::fs::write(dir.join("meta.json"), old.to_string()).unwrap();
            let m = load_meta(&dir).expect("an old record loads");
            assert_eq!(m.pid(), 123456, "{phase}");
            save_meta(&layout, &m).unwrap();
            let saved: Value =
                serde_json::from_slice(&std::fs::read(dir.join("meta.json")).unwrap()).unwrap();
            assert!(saved.get("phase").is_none(), "no phase written");
            assert_eq!(parse_meta(&dir).unwrap(), m);
        }
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
}
