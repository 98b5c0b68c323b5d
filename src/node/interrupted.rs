//! Starts in flight when the node is killed (D53). The backend never waits for an answer that
//! will not come: every start the node takes leaves a note, `<state dir>/starts/<safe-id>.json`
//! (the request id, type and workload uuid: all a reply and a status need, since replies go to
//! the node's fixed response topic and name the request by its id), written before the start is
//! handed to the spawner and removed once it is answered. A note that is still there at the next
//! start-up is a start that was taken and not answered; once the node is registered again each
//! gets its answer:
//! - its workload started (it has its record with the supervisor's start record, or the ledger
//!   says so): the `ok` reply the start would have had, and `running` while it still runs;
//! - it never started: an error reply and a `failed` status, host-busy contract (retryable,
//!   `busy_reason: node_restarted`), saying the start was interrupted by a node restart.
//!
//! The answer is recorded in the request ledger at recovery, before it is sent, so a redelivery
//! of the same request gets the same answer and never spawns it (a start is never spawned
//! twice), and a second restart before the answers went out gives the same answers. The note is
//! written without a sync, like the record the spawner writes next: a node killed at any point
//! leaves it in the page cache; only a host crash can lose it, and the host crash ended the
//! workload anyway.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::ledger;
use crate::logtext::shown;
use crate::protocol::messages::request_id_text;
use crate::store;
use crate::workload::Layout;

/// The note of a start that was taken.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Taken {
    pub request_id: Value,
    pub kind: String,
    #[serde(default)]
    pub workload_uuid: Option<String>,
    pub taken_unix: f64,
}

impl store::Validate for Taken {
    fn validate(&self) -> Result<(), store::Invalid> {
        store::check_request_id(&self.request_id)?;
        if !crate::workload::KINDS.contains(&self.kind.as_str()) {
            return Err(store::Invalid::OneOf {
                field: "kind",
                allowed: &crate::workload::KINDS,
            });
        }
        if let Some(u) = &self.workload_uuid {
            store::check_id("workload_uuid", u)?;
        }
        store::check_unix("taken_unix", self.taken_unix)
    }
}

/// How an interrupted start is answered.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// Its workload started: the `ok` reply's output.
    Started(Value),
    /// It never started (or the ledger recorded it as refused): the error text.
    NeverStarted(String),
}

/// The start of `kind` was interrupted by a node restart before its workload ran (a host-busy
/// refusal: the backend may retry it).
pub fn interrupted_text(kind: &str) -> String {
    format!(
        "{} a restart: the start of this {kind} was interrupted by a node restart before its workload ran; nothing runs for it, retry it",
        super::parts::BUSY_PREFIX
    )
}

/// The answer of an interrupted start: what the ledger recorded for it if anything (the answer
/// it had, or would have had, before the restart), else `started` (the `ok` output of its
/// re-adopted workload), else the interruption.
pub fn answer(recorded: Option<&ledger::Entry>, started: Option<Value>, kind: &str) -> Answer {
    match (recorded, started) {
        (Some(e), _) if e.ok => Answer::Started(e.body.clone()),
        (Some(e), _) => Answer::NeverStarted(
            e.body
                .as_str()
                .map_or_else(|| interrupted_text(kind), String::from),
        ),
        (None, Some(out)) => Answer::Started(out),
        (None, None) => Answer::NeverStarted(interrupted_text(kind)),
    }
}

/// The folder of the notes.
pub fn dir(layout: &Layout) -> PathBuf {
    layout.state.join("starts")
}

fn path(layout: &Layout, safe_id: &str) -> PathBuf {
    dir(layout).join(format!("{safe_id}.json"))
}

/// Leaves the note of a start that is being taken (not synced: see the module's comment).
pub fn note(layout: &Layout, safe_id: &str, taken: &Taken) -> std::io::Result<()> {
    store::ensure_private_dir(&dir(layout))?;
    let json = serde_json::to_vec(taken).map_err(std::io::Error::other)?;
    store::write_replace_unsynced(&path(layout, safe_id), &json, 0o600)
}

/// The start was answered: its note goes.
pub fn forget(layout: &Layout, safe_id: &str) {
    match std::fs::remove_file(path(layout, safe_id)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => log::warn!(
            "cannot remove the note of the answered start {}: {e}",
            store::clip(safe_id, 80)
        ),
    }
}

/// Every note left by the node before this one (safe id → note); an invalid one is quarantined,
/// a stray file ignored.
pub fn load_all(layout: &Layout) -> Vec<(String, Taken)> {
    let d = dir(layout);
    if store::ensure_dir_or_quarantine(&d).is_err() {
        return Vec::new();
    }
    let Ok(entries) = std::fs::read_dir(&d) else {
        return Vec::new();
    };
    let mut notes: Vec<(String, Taken)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let id = safe_id_of(&name)?;
            let mut taken = store::load_record::<Taken>(
                &e.path(),
                store::MAX_ENTRY_BYTES,
                "note of a start in flight",
            )?;
            // A note an older version wrote may hold `""` or `"None"`: no workload either way.
            taken.workload_uuid = crate::protocol::commands::workload_id(taken.workload_uuid);
            Some((id.to_string(), taken))
        })
        .collect();
    notes.sort_by(|a, b| a.1.taken_unix.total_cmp(&b.1.taken_unix));
    notes
}

/// The safe id a note's file name stands for (`<safe-id>.json`, the form `store::safe_id`
/// gives); `None` for anything else (temporary files, quarantined ones).
fn safe_id_of(name: &str) -> Option<&str> {
    let id = name.strip_suffix(".json")?;
    let ok = !id.is_empty()
        && !id.starts_with('.')
        && id.len() <= 80
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    ok.then_some(id)
}

/// At recovery: the answer of every start taken and not answered before the restart,
/// `started` (with its `ok` output) or not (`never`), recorded in the ledger and kept for
/// the loop to send once registered.
pub(super) fn settle(
    ledger: &mut ledger::Ledger,
    interrupted: &mut Vec<(String, Taken, Answer)>,
    started: Vec<(String, Taken, Value)>,
    never: std::collections::BTreeMap<String, Taken>,
) {
    let all = started
        .into_iter()
        .map(|(id, t, out)| (id, t, Some(out)))
        .chain(never.into_iter().map(|(id, t)| (id, t, None)));
    for (safe_id, taken, out) in all {
        let rid = request_id_text(&taken.request_id);
        let recorded = (!rid.is_empty())
            .then(|| ledger.get(&rid).cloned())
            .flatten();
        let a = answer(recorded.as_ref(), out, &taken.kind);
        if recorded.is_none() && !rid.is_empty() {
            // Before it is sent: a redelivery gets the same answer and spawns nothing.
            match &a {
                Answer::Started(out) => ledger.record(&rid, true, out.clone()),
                Answer::NeverStarted(why) => ledger.record(&rid, false, json!(why)),
            }
        }
        log::warn!(
            "the start of {} {} was interrupted by the node's restart before it was answered; {}",
            taken.kind,
            shown(&rid),
            match &a {
                Answer::Started(_) =>
                    "its workload started: it gets its answer once the node is registered",
                Answer::NeverStarted(_) =>
                    "it never started: it is refused (retryable) once the node is registered",
            }
        );
        interrupted.push((safe_id, taken, a));
    }
    interrupted.sort_by(|a, b| a.1.taken_unix.total_cmp(&b.1.taken_unix));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> Layout {
        let state = std::env::temp_dir().join(format!("cw-int-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state).unwrap();
        Layout { state }
    }

    fn taken(rid: &str, at: f64) -> Taken {
        Taken {
            request_id: json!(rid),
            kind: "inference".into(),
            workload_uuid: Some(format!("wl-{rid}")),
            taken_unix: at,
        }
    }

    #[test]
    fn an_interrupted_start_gets_the_answer_it_had_or_would_have_had() {
        let out = json!({"message": "inference started", "pid": 42});
        assert_eq!(
            answer(None, Some(out.clone()), "inference"),
            Answer::Started(out.clone())
        );
        let refused = answer(None, None, "training");
        let Answer::NeverStarted(text) = &refused else {
            panic!("{refused:?}")
        };
        assert!(text.starts_with("Controller host is busy with"), "{text}");
        assert!(text.contains("interrupted by a node restart"), "{text}");
        assert!(text.contains("training"), "{text}");
        // What the ledger says wins: a restart after the answers were recorded repeats them.
        let ok = ledger::entry("r", true, json!({"pid": 7}));
        assert_eq!(
            answer(Some(&ok), None, "inference"),
            Answer::Started(json!({"pid": 7}))
        );
        let failed = ledger::entry("r", false, json!("refused before"));
        assert_eq!(
            answer(Some(&failed), Some(out), "inference"),
            Answer::NeverStarted("refused before".into())
        );
    }

    #[test]
    fn notes_are_left_read_back_and_forgotten_and_bad_ones_set_aside() {
        let layout = scratch("notes");
        assert!(load_all(&layout).is_empty());
        note(&layout, "b", &taken("b", 2.0e9)).unwrap();
        note(&layout, "a", &taken("a", 1.0e9)).unwrap();
        let all = load_all(&layout);
        let ids: Vec<&str> = all.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["a", "b"], "in the order they were taken");
        assert_eq!(all[0].1, taken("a", 1.0e9));
        forget(&layout, "a");
        forget(&layout, "a"); // twice: nothing to say
        assert_eq!(load_all(&layout).len(), 1);
        // Hostile or broken: invalid JSON, a wrong kind, a FIFO (never opened blocking: D48),
        // a stray name.
        let d = dir(&layout);
        std::fs::write(d.join("c.json"), "{not json").unwrap();
        let mut bad = serde_json::to_value(taken("d", 1.0)).unwrap();
        bad["kind"] = json!("rm -rf");
        std::fs::write(d.join("d.json"), bad.to_string()).unwrap();
        let fifo = std::ffi::CString::new(d.join("e.json").to_str().unwrap()).unwrap();
        // SAFETY: mkfifo with a valid C string.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        std::fs::write(d.join(".b.json.tmp-1234"), "{}").unwrap();
        let all = load_all(&layout);
        let ids: Vec<&str> = all.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["b"]);
        assert!(!d.join("c.json").exists(), "quarantined");
        assert!(!d.join("e.json").exists(), "quarantined");
        std::fs::remove_dir_all(&layout.state).unwrap();
    }
}
