//! The starts in flight: this node's, and those a node killed before it left (D53).
//!
//! The start path, off the loop. The loop checks a start (exactly once per
//! request id, reservation, capacity, GPUs), puts it in flight ([`Starts`]: it counts towards
//! capacity, holds its GPUs, shows in `status` as `starting`, and can be cancelled) and hands it
//! to the spawner thread ([`crate::workload::spawner`]), then returns at once. The spawner
//! reports back with an [`Outcome`]; only then is the start answered, recorded and tracked as an
//! active workload, exactly as a start was before.
//!
//! Exactly once, and what a crash at each point leaves (the order of the writes):
//! 1. loop: the start's note (`starts/<safe-id>.json`, [`note`]) is left, then the request is
//!    in flight and handed to the spawner ([`Starts::begin`]), so no workload runs without its
//!    note. A node killed from here on until the answer leaves the note: the next node answers
//!    the start (D53), from its workload if it started, else with a retryable refusal.
//! 2. spawner: the workload's directory (created exclusively: a second spawn of the same id
//!    fails), params, and `meta.json` (phase `starting`) are written, unsynced; then the shim is
//!    started and starts the workload. A node killed now leaves the record for the next node:
//!    the shim's `started.json` completes it and the workload is re-adopted, and a redelivery of
//!    the request is answered from that workload, never started again. If the shim had not yet
//!    written `started.json`, recovery waits for it while the shim is provably alive
//!    ([`crate::workload::recover_meta`]); no shim, no workload: the record is dropped.
//! 3. spawner: the pid line read, the record synced, the ledger entry appended and synced.
//! 4. loop: the reply, `running` status, tracking (the reaper thread told of the shim). Every answered start thus has a durable
//!    record and ledger entry (a host crash cannot make an answered start run twice); a host
//!    crash before that loses, at worst, an unanswered start whose workload died with the host.
//!
//! Cancel while starting: the cancel is written into the start's note ([`Starts::cancel`]),
//! then answered at once and recorded; it is carried out (the signal, the grace, the
//! escalation) as soon as the spawn reports the workload's process, and the note goes only once
//! the workload's record says it is being cancelled. A node killed in between leaves the cancel
//! in the note: the next node carries it out as it re-adopts the workload. If the spawn fails
//! there is nothing to signal and the start's failure is reported as usual.
//!
//! Many starts in flight: no bound of their own; the capacity (`max_concurrent_workloads`, which
//! counts them) is the bound. A redelivery of a start in flight is answered with the original
//! answer once the spawn reports.
//!
//! The starts a killed node left (D53: [`load_notes`], [`settle_interrupted`]). The backend
//! never waits for an answer that will not come: every start the node takes leaves a note,
//! `<state dir>/starts/<safe-id>.json` ([`Taken`]: the request id, type and workload uuid, all a
//! reply and a status need, since replies go to the node's fixed response topic and name the
//! request by its id), written before the start's supervisor is started and removed once it is
//! answered ([`forget`]). A note that is still there at the next start-up is a start that was
//! taken and not answered; once the node is registered again each gets its answer:
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

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::gpus::Hold;
use crate::ledger;
use crate::logtext::shown;
use crate::protocol::commands::request_id_text;
use crate::protocol::commands::{Kind, TopicId};
use crate::store;
use crate::workload::spawner::{Outcome, Spawner};
use crate::workload::{Layout, StartRequest, WorkflowCtx};

/// A cancel that came while its workload was starting, carried out once it runs.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingCancel {
    pub signal: i32,
    pub name: &'static str,
    pub grace: Duration,
}

/// A start handed to the spawner, not reported yet.
pub struct Starting {
    pub kind: Kind,
    pub request_id: Value,
    pub workload_uuid: Option<TopicId>,
    pub ctx: Option<WorkflowCtx>,
    pub gpus: Option<Vec<String>>,
    pub created_unix: f64,
    pub cancel: Option<PendingCancel>,
    /// Redeliveries of the same request that came meanwhile: they get the same answer.
    pub waiters: Vec<Value>,
    /// The workload's secret for `emit`.
    pub event_token: String,
    /// `emit` requests of the workload (it runs before its start is reported): answered once
    /// the start is.
    pub held: Vec<crate::control::Request>,
    /// The uid it is to run as (D65: held while it starts).
    pub uid: Option<u32>,
}

/// The starts in flight, and the spawner they go to. Pure bookkeeping (unit-tested); the node
/// carries out what it says.
pub struct Starts {
    spawner: Option<Spawner>,
    /// The spawner's reports; `never` once it is gone.
    pub outcomes: crossbeam_channel::Receiver<Outcome>,
    /// Why there is no spawner (it never started, or it stopped).
    gone: Option<String>,
    in_flight: BTreeMap<String, Starting>,
    /// Starts the node before this one took and did not answer (D53), answered once registered.
    pub interrupted: Vec<(String, Taken, Answer)>,
}

/// What a node without a working spawner answers to a start.
pub const SPAWNER_GONE: &str =
    "the workload spawner thread stopped: this node cannot start workloads until it is restarted";

impl Starts {
    pub fn new(
        spawner: Result<Spawner, String>,
        outcomes: crossbeam_channel::Receiver<Outcome>,
    ) -> Starts {
        let (spawner, gone) = match spawner {
            Ok(s) => (Some(s), None),
            Err(why) => (None, Some(why)),
        };
        Starts {
            spawner,
            outcomes,
            gone,
            in_flight: BTreeMap::new(),
            interrupted: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.in_flight.len()
    }

    pub fn is_empty(&self) -> bool {
        self.in_flight.is_empty()
    }

    /// Why starts are refused (no spawner), if they are.
    pub fn gone(&self) -> Option<&str> {
        self.gone.as_deref()
    }

    pub fn get_mut(&mut self, safe_id: &str) -> Option<&mut Starting> {
        self.in_flight.get_mut(safe_id)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Starting)> {
        self.in_flight.iter()
    }

    /// The GPU holds of the starts in flight (no process group yet).
    pub(super) fn holds(&self) -> impl Iterator<Item = Hold<'_>> + '_ {
        self.in_flight.iter().map(|(id, st)| Hold {
            id,
            holder: st.request_id.clone(),
            pid: None,
            gpus: st.gpus.as_deref().unwrap_or_default(),
        })
    }

    /// The start in flight for this request id (as the backend names it).
    pub fn find_request(&self, rid: &str) -> Option<String> {
        self.in_flight
            .iter()
            .find(|(_, s)| request_id_text(&s.request_id) == rid)
            .map(|(k, _)| k.clone())
    }

    /// Puts a start in flight: its note is left first (D53: from here on it is answered, if
    /// need be by the next node), then it is handed to the spawner, so no workload ever runs
    /// without its note. `Err` (with the reason) when there is no spawner any more: then nothing
    /// is in flight for it and no note is left.
    pub fn begin(
        &mut self,
        layout: &Layout,
        starting: Starting,
        req: StartRequest,
    ) -> Result<(), String> {
        let safe_id = req.safe_id.clone();
        let Some(spawner) = &self.spawner else {
            return Err(self.gone.clone().unwrap_or_else(|| SPAWNER_GONE.into()));
        };
        if let Err(e) = note(layout, &safe_id, &Taken::of(&starting)) {
            log::warn!(
                "cannot note the start of {} in {} ({e}); a node killed before it is answered cannot answer it after its restart",
                shown(&request_id_text(&starting.request_id)),
                store::shown(&notes_dir(layout))
            );
        }
        if !spawner.submit(req) {
            forget(layout, &safe_id);
            // What is in flight stays until the loop fails it ([`Starts::stopped`]).
            self.spawner = None;
            self.gone = Some(SPAWNER_GONE.into());
            return Err(SPAWNER_GONE.into());
        }
        self.in_flight.insert(safe_id, starting);
        Ok(())
    }

    /// The spawner reported this start.
    pub fn end(&mut self, safe_id: &str) -> Option<Starting> {
        self.in_flight.remove(safe_id)
    }

    /// The spawner is gone: every start in flight is over (returned, to be failed), and no new
    /// one is taken.
    pub fn stopped(&mut self) -> Vec<(String, Starting)> {
        self.spawner = None;
        self.gone = Some(SPAWNER_GONE.into());
        std::mem::take(&mut self.in_flight).into_iter().collect()
    }

    /// The start in flight whose workload has this `emit` token.
    pub fn by_token(&mut self, token: &str) -> Option<&mut Starting> {
        self.in_flight.values_mut().find(|s| s.event_token == token)
    }

    /// Records a cancel for a start in flight, in its note first (before it is answered: a node
    /// killed before the workload runs leaves it for the next node); the first one stays (a
    /// second one changes nothing, as for a running workload). `None`: no such start.
    pub fn cancel(
        &mut self,
        layout: &Layout,
        safe_id: &str,
        c: PendingCancel,
    ) -> Option<PendingCancel> {
        let s = self.in_flight.get_mut(safe_id)?;
        if s.cancel.is_none() {
            s.cancel = Some(c);
            if let Err(e) = note(layout, safe_id, &Taken::of(s)) {
                log::warn!(
                    "cannot note the cancel of the start {} in {} ({e}); a node killed before its workload runs cannot carry it out after its restart",
                    shown(&request_id_text(&s.request_id)),
                    store::shown(&notes_dir(layout))
                );
            }
        }
        s.cancel.clone()
    }

    /// A control-socket request that must wait for a start in flight (an `emit` of a workload
    /// whose start is not reported yet: its token is not known to the workload table yet) is
    /// kept and answered once the start is; anything else is given back.
    pub fn hold_for_start(
        &mut self,
        req: crate::control::Request,
    ) -> Option<crate::control::Request> {
        let token = req
            .body
            .get("token")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty());
        let emit = req.body.get("op").and_then(Value::as_str) == Some("emit");
        let owner = token.and_then(|t| self.by_token(t));
        match owner {
            Some(st) if emit => {
                st.held.push(req);
                None
            }
            _ => Some(req),
        }
    }
}

/// The note of a start that was taken.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Taken {
    pub request_id: Value,
    pub kind: String,
    #[serde(
        default,
        deserialize_with = "crate::protocol::commands::persisted_workload_id"
    )]
    pub workload_uuid: Option<TopicId>,
    pub taken_unix: f64,
    /// A cancel answered while the start was in flight: carried out when the next node
    /// re-adopts its workload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel: Option<NotedCancel>,
}

/// A cancel as a note keeps it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NotedCancel {
    /// `SIGTERM`, `SIGINT` or `SIGKILL`.
    pub signal: String,
    pub grace_s: f64,
}

/// The signals a cancel may send, by name.
const CANCEL_SIGNALS: [&str; 3] = ["SIGTERM", "SIGINT", "SIGKILL"];

impl NotedCancel {
    fn of(c: &PendingCancel) -> NotedCancel {
        NotedCancel {
            signal: c.name.to_string(),
            grace_s: c.grace.as_secs_f64(),
        }
    }

    /// The cancel to carry out (`None` for a signal no cancel sends: never read from a valid note).
    pub fn pending(&self) -> Option<PendingCancel> {
        let (signal, name) = match self.signal.as_str() {
            "SIGTERM" => (libc::SIGTERM, "SIGTERM"),
            "SIGINT" => (libc::SIGINT, "SIGINT"),
            "SIGKILL" => (libc::SIGKILL, "SIGKILL"),
            _ => return None,
        };
        Some(PendingCancel {
            signal,
            name,
            grace: crate::util::secs_f64(self.grace_s),
        })
    }
}

impl Taken {
    /// The note of a start in flight (with the cancel recorded for it, if any).
    pub fn of(s: &Starting) -> Taken {
        Taken {
            request_id: s.request_id.clone(),
            kind: s.kind.as_str().to_string(),
            workload_uuid: s.workload_uuid.clone(),
            taken_unix: s.created_unix,
            cancel: s.cancel.as_ref().map(NotedCancel::of),
        }
    }
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
        if let Some(c) = &self.cancel {
            if !CANCEL_SIGNALS.contains(&c.signal.as_str()) {
                return Err(store::Invalid::OneOf {
                    field: "cancel.signal",
                    allowed: &CANCEL_SIGNALS,
                });
            }
            store::check_seconds("cancel.grace_s", c.grace_s, true)?;
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
pub fn notes_dir(layout: &Layout) -> PathBuf {
    layout.state.join("starts")
}

fn note_path(layout: &Layout, safe_id: &str) -> PathBuf {
    notes_dir(layout).join(format!("{safe_id}.json"))
}

/// Leaves the note of a start that is being taken (not synced: see the module's comment, D53).
pub fn note(layout: &Layout, safe_id: &str, taken: &Taken) -> std::io::Result<()> {
    store::ensure_private_dir(&notes_dir(layout))?;
    let json = serde_json::to_vec(taken).map_err(std::io::Error::other)?;
    store::write_replace_unsynced(&note_path(layout, safe_id), &json, 0o600)
}

/// The start was answered: its note goes.
pub fn forget(layout: &Layout, safe_id: &str) {
    match std::fs::remove_file(note_path(layout, safe_id)) {
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
pub fn load_notes(layout: &Layout) -> Vec<(String, Taken)> {
    let d = notes_dir(layout);
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
            let taken = store::load_record::<Taken>(
                &e.path(),
                store::MAX_ENTRY_BYTES,
                "note of a start in flight",
            )?;
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
pub(super) fn settle_interrupted(
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
    use serde_json::Map;

    fn starting(rid: &str) -> Starting {
        Starting {
            kind: Kind::Inference,
            request_id: json!(rid),
            workload_uuid: TopicId::new("workload_uuid", &format!("wl-{rid}")).ok(),
            ctx: None,
            gpus: Some(vec![format!("GPU-{rid}")]),
            created_unix: 1.7e9,
            cancel: None,
            waiters: Vec::new(),
            event_token: format!("tok{rid}"),
            held: Vec::new(),
            uid: None,
        }
    }

    fn request(rid: &str) -> StartRequest {
        StartRequest {
            kind: Kind::Inference,
            request_id: json!(rid),
            safe_id: store::safe_id(rid),
            params: Map::new(),
            workload_uuid: None,
            template: "true".into(),
            node_token: String::new(),
            max_runtime_s: None,
            workflow: None,
            socket: "/nonexistent/control.sock".into(),
            gpus: None,
            results_dir: None,
            event_token: format!("tok{rid}"),
            node_uuid: "node-uuid".into(),
            user: None,
        }
    }

    #[test]
    fn a_start_in_flight_is_found_by_its_request_id_and_ends_once() {
        let layout = scratch("flight");
        let (spawner, jobs) = Spawner::for_tests();
        let mut s = Starts::new(Ok(spawner), crossbeam_channel::never());
        assert!(s.begin(&layout, starting("r1"), request("r1")).is_ok());
        assert!(s.begin(&layout, starting("r2"), request("r2")).is_ok());
        assert_eq!(jobs.len(), 2, "both handed to the spawner");
        // D53: each noted as it was handed over.
        let mut noted: Vec<String> = load_notes(&layout).into_iter().map(|(id, _)| id).collect();
        noted.sort();
        assert_eq!(noted, [store::safe_id("r1"), store::safe_id("r2")]);
        assert_eq!(s.len(), 2);
        assert_eq!(s.find_request("r2"), Some(store::safe_id("r2")));
        assert_eq!(s.find_request("r3"), None);
        // An `emit` of a workload still starting is matched by its token.
        assert_eq!(
            s.by_token("tokr2").map(|st| st.request_id.clone()),
            Some(json!("r2"))
        );
        assert!(s.by_token("forged").is_none());
        let ended = s.end(&store::safe_id("r1")).unwrap();
        assert_eq!(ended.request_id, json!("r1"));
        assert!(
            s.end(&store::safe_id("r1")).is_none(),
            "a report ends it once"
        );
        assert_eq!(s.len(), 1);
        assert_eq!(s.gone(), None);
        std::fs::remove_dir_all(&layout.state).unwrap();
    }

    #[test]
    fn a_cancel_while_starting_is_recorded_once_and_the_first_one_stays() {
        let layout = scratch("cancel");
        let (spawner, _jobs) = Spawner::for_tests();
        let mut s = Starts::new(Ok(spawner), crossbeam_channel::never());
        s.begin(&layout, starting("r1"), request("r1")).unwrap();
        let id = store::safe_id("r1");
        let term = PendingCancel {
            signal: libc::SIGTERM,
            name: "SIGTERM",
            grace: Duration::from_secs(10),
        };
        let kill = PendingCancel {
            signal: libc::SIGKILL,
            name: "SIGKILL",
            grace: Duration::ZERO,
        };
        assert_eq!(load_notes(&layout)[0].1.cancel, None);
        assert_eq!(s.cancel(&layout, &id, term.clone()), Some(term.clone()));
        // In the note before it is answered: a node killed now leaves it for the next one.
        let noted = load_notes(&layout).remove(0).1.cancel;
        assert_eq!(
            noted.as_ref().and_then(NotedCancel::pending),
            Some(term.clone()),
            "{noted:?}"
        );
        assert_eq!(
            s.cancel(&layout, &id, kill),
            Some(term.clone()),
            "the first stays"
        );
        assert_eq!(
            load_notes(&layout)[0]
                .1
                .cancel
                .as_ref()
                .map(|c| c.signal.as_str()),
            Some("SIGTERM")
        );
        assert_eq!(s.cancel(&layout, "other", term.clone()), None);
        assert_eq!(
            s.end(&id).unwrap().cancel,
            Some(term),
            "carried to the report"
        );
        std::fs::remove_dir_all(&layout.state).unwrap();
    }

    #[test]
    fn a_gone_spawner_fails_what_is_in_flight_and_refuses_what_comes() {
        let layout = scratch("gone");
        let (spawner, jobs) = Spawner::for_tests();
        let mut s = Starts::new(Ok(spawner), crossbeam_channel::never());
        s.begin(&layout, starting("r1"), request("r1")).unwrap();
        s.begin(&layout, starting("r2"), request("r2")).unwrap();
        drop(jobs); // the spawner thread ends
        let e = s.begin(&layout, starting("r3"), request("r3")).unwrap_err();
        assert_eq!(e, SPAWNER_GONE);
        assert_eq!(s.gone(), Some(SPAWNER_GONE));
        assert_eq!(s.len(), 2, "the refused one is not in flight");
        let noted: Vec<String> = load_notes(&layout).into_iter().map(|(id, _)| id).collect();
        assert_eq!(noted.len(), 2, "nor noted: {noted:?}");
        // The loop notices the closed channel: both in flight are returned to be failed.
        let failed: Vec<String> = s.stopped().into_iter().map(|(k, _)| k).collect();
        assert_eq!(failed, vec![store::safe_id("r1"), store::safe_id("r2")]);
        assert!(s.is_empty());
        assert!(s.begin(&layout, starting("r4"), request("r4")).is_err());
        // A spawner that never started refuses with its own reason.
        let never = Starts::new(
            Err("cannot start the workload spawner thread: x".into()),
            crossbeam_channel::never(),
        );
        assert!(never.gone().unwrap().contains("cannot start"));
        let mut never = never;
        assert!(never
            .begin(&layout, starting("r5"), request("r5"))
            .unwrap_err()
            .contains("cannot start"));
        std::fs::remove_dir_all(&layout.state).unwrap();
    }

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
            workload_uuid: TopicId::new("workload_uuid", &format!("wl-{rid}")).ok(),
            taken_unix: at,
            cancel: None,
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

    /// A note that says no workload in the ways an older version or a Python sender may (absent,
    /// `null`, `""`, `"None"`) is read back as one without a workload, never as `…/None/…`.
    #[test]
    fn d20_a_note_whose_workload_uuid_says_none_has_no_workload() {
        let layout = scratch("notes-none");
        note(&layout, "a", &taken("a", 1.0e9)).unwrap();
        let d = notes_dir(&layout);
        for (i, none) in [json!(null), json!(""), json!("None")]
            .into_iter()
            .enumerate()
        {
            let mut v = serde_json::to_value(taken("a", 1.0e9)).unwrap();
            v["workload_uuid"] = none.clone();
            std::fs::write(d.join("a.json"), v.to_string()).unwrap();
            let all = load_notes(&layout);
            assert_eq!(all.len(), 1, "{i}: {none}");
            assert_eq!(all[0].1.workload_uuid, None, "{none}");
        }
        let mut v = serde_json::to_value(taken("a", 1.0e9)).unwrap();
        v.as_object_mut().unwrap().remove("workload_uuid");
        std::fs::write(d.join("a.json"), v.to_string()).unwrap();
        assert_eq!(load_notes(&layout)[0].1.workload_uuid, None, "absent");
        std::fs::remove_dir_all(&layout.state).unwrap();
    }

    #[test]
    fn notes_are_left_read_back_and_forgotten_and_bad_ones_set_aside() {
        let layout = scratch("notes");
        assert!(load_notes(&layout).is_empty());
        note(&layout, "b", &taken("b", 2.0e9)).unwrap();
        note(&layout, "a", &taken("a", 1.0e9)).unwrap();
        let all = load_notes(&layout);
        let ids: Vec<&str> = all.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["a", "b"], "in the order they were taken");
        assert_eq!(all[0].1, taken("a", 1.0e9));
        forget(&layout, "a");
        forget(&layout, "a"); // twice: nothing to say
        assert_eq!(load_notes(&layout).len(), 1);
        // Hostile or broken: invalid JSON, a wrong kind, a FIFO (never opened blocking: D48),
        // a stray name.
        let d = notes_dir(&layout);
        std::fs::write(d.join("c.json"), "{not json").unwrap();
        let mut bad = serde_json::to_value(taken("d", 1.0)).unwrap();
        bad["kind"] = json!("rm -rf");
        std::fs::write(d.join("d.json"), bad.to_string()).unwrap();
        let fifo = std::ffi::CString::new(d.join("e.json").to_str().unwrap()).unwrap();
        // SAFETY: mkfifo with a valid C string.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        std::fs::write(d.join(".b.json.tmp-1234"), "{}").unwrap();
        // A workload uuid that could not be a topic's (D20): refused as it is read.
        let mut hostile = serde_json::to_value(taken("f", 1.0)).unwrap();
        hostile["workload_uuid"] = json!("wl/#");
        std::fs::write(d.join("f.json"), hostile.to_string()).unwrap();
        // A cancel with a signal no cancel sends, or a grace out of range.
        for (name, cancel) in [
            ("g", json!({"signal": "SIGSTOP", "grace_s": 1.0})),
            ("h", json!({"signal": "SIGTERM", "grace_s": -1.0})),
        ] {
            let mut v = serde_json::to_value(taken(name, 1.0)).unwrap();
            v["cancel"] = cancel;
            std::fs::write(d.join(format!("{name}.json")), v.to_string()).unwrap();
        }
        let all = load_notes(&layout);
        let ids: Vec<&str> = all.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["b"]);
        assert!(!d.join("c.json").exists(), "quarantined");
        assert!(!d.join("e.json").exists(), "quarantined");
        assert!(!d.join("f.json").exists(), "quarantined");
        assert!(!d.join("g.json").exists() && !d.join("h.json").exists());
        std::fs::remove_dir_all(&layout.state).unwrap();
    }
}
