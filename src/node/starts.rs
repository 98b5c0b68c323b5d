//! The start path, off the loop (issue 15, item 2). The loop checks a start (exactly once per
//! request id, reservation, capacity, GPUs), puts it in flight ([`Starts`]: it counts towards
//! capacity, holds its GPUs, shows in `status` as `starting`, and can be cancelled) and hands it
//! to the spawner thread ([`crate::workload::spawner`]), then returns at once. The spawner
//! reports back with an [`Outcome`]; only then is the start answered, recorded and tracked as an
//! active workload, exactly as a start was before.
//!
//! Exactly once, and what a crash at each point leaves (the order of the writes):
//! 1. loop: the start's note (`starts/<safe-id>.json`, [`super::interrupted`]) is left, then the
//!    request is in flight. A node killed from here on until the answer leaves the note: the
//!    next node answers the start (D53), from its workload if it started, else with a
//!    retryable refusal.
//! 2. spawner: the workload's directory (created exclusively: a second spawn of the same id
//!    fails), params, and `meta.json` (phase `starting`) are written, unsynced; then the shim is
//!    forked and execs the workload. A node killed now leaves the record for the next node:
//!    the shim's `started.json` completes it and the workload is re-adopted, and a redelivery of
//!    the request is answered from that workload, never started again. If the shim had not yet
//!    written `started.json`, recovery waits for it while the shim is provably alive
//!    ([`crate::workload::recover_meta`]); no shim, no workload: the record is dropped.
//! 3. settler: the record is synced, the pid line read, the ledger entry appended and synced.
//! 4. loop: the reply, `running` status, tracking. Every answered start thus has a durable
//!    record and ledger entry (a host crash cannot make an answered start run twice); a host
//!    crash before that loses, at worst, an unanswered start whose workload died with the host.
//!
//! Cancel while starting: the cancel is answered at once and recorded; it is carried out (the
//! signal, the grace, the escalation) as soon as the spawn reports the workload's process. If
//! the spawn fails there is nothing to signal and the start's failure is reported as usual.
//!
//! Many starts in flight: no bound of their own; the capacity (`max_concurrent_workloads`, which
//! counts them) is the bound. A redelivery of a start in flight is answered with the original
//! answer once the spawn reports.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::admit::{self, Ask, Decision, Earlier, Facts, RejectReason};
use super::table::Active;
use super::workloads::start_output;
use super::Node;
use crate::logtext::shown;
use crate::protocol::commands::{Kind, Seconds, StartParams};
use crate::protocol::messages::request_id_text;
use crate::store;
use crate::workload::spawner::{Outcome, Spawner};
use crate::workload::{self, procinfo, StartRequest, WorkflowCtx};

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
    pub workload_uuid: Option<String>,
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
}

/// The starts in flight, and the spawner they go to. Pure bookkeeping (unit-tested); the node
/// carries out what it says.
pub struct Starts {
    spawner: Option<Spawner>,
    /// Why there is no spawner (it never started, or it stopped).
    gone: Option<String>,
    in_flight: BTreeMap<String, Starting>,
    /// Starts the node before this one took and did not answer (D53), answered once registered.
    pub interrupted: Vec<(
        String,
        super::interrupted::Taken,
        super::interrupted::Answer,
    )>,
}

/// What a node without a working spawner answers to a start.
pub const SPAWNER_GONE: &str =
    "the workload spawner thread stopped: this node cannot start workloads until it is restarted";

impl Starts {
    pub fn new(spawner: Result<Spawner, String>) -> Starts {
        let (spawner, gone) = match spawner {
            Ok(s) => (Some(s), None),
            Err(why) => (None, Some(why)),
        };
        Starts {
            spawner,
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

    /// The start in flight for this request id (as the backend names it).
    pub fn find_request(&self, rid: &str) -> Option<String> {
        self.in_flight
            .iter()
            .find(|(_, s)| request_id_text(&s.request_id) == rid)
            .map(|(k, _)| k.clone())
    }

    /// Puts a start in flight and hands it to the spawner; `Err` (with the reason) when there
    /// is no spawner any more: then nothing is in flight for it.
    pub fn begin(&mut self, starting: Starting, req: StartRequest) -> Result<(), String> {
        let safe_id = req.safe_id.clone();
        let Some(spawner) = &self.spawner else {
            return Err(self.gone.clone().unwrap_or_else(|| SPAWNER_GONE.into()));
        };
        if !spawner.submit(req) {
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

    /// Records a cancel for a start in flight; the first one stays (a second one changes
    /// nothing, as for a running workload). `None`: no such start.
    pub fn cancel(&mut self, safe_id: &str, c: PendingCancel) -> Option<PendingCancel> {
        let s = self.in_flight.get_mut(safe_id)?;
        Some(s.cancel.get_or_insert(c).clone())
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

/// Notes the start as taken (D53), so that a node killed before it is answered answers it
/// after its restart.
fn note_taken(layout: &crate::workload::Layout, safe_id: &str, rid: &str, starting: &Starting) {
    let taken = super::interrupted::Taken {
        request_id: starting.request_id.clone(),
        kind: starting.kind.as_str().to_string(),
        workload_uuid: starting.workload_uuid.clone(),
        taken_unix: starting.created_unix,
    };
    if let Err(e) = super::interrupted::note(layout, safe_id, &taken) {
        log::warn!(
            "cannot note the start of {} in {} ({e}); a node killed before it is answered cannot answer it after its restart",
            shown(rid),
            crate::logtext::shown(&super::interrupted::dir(layout).display().to_string())
        );
    }
}

/// The request id as the ledger keys it: the request's own, or one made up for a request
/// without one.
fn ledger_id(request_id: &Value) -> String {
    let rid = request_id_text(request_id);
    if rid.is_empty() {
        format!(
            "auto-{}-{}",
            workload::unix_now() as u64,
            crate::util::hex(&crate::util::random_bytes::<4>())
        )
    } else {
        rid
    }
}

impl Node {
    // ---- start ------------------------------------------------------------------------------

    pub(super) fn start_workload(&mut self, kind: Kind, request_id: &Value, params: StartParams) {
        self.start_workload_inner(kind, request_id, params, true);
    }

    /// A start after the self-heal pass it waited for: no second wait.
    pub(super) fn start_workload_now(
        &mut self,
        kind: Kind,
        request_id: &Value,
        params: StartParams,
    ) {
        self.start_workload_inner(kind, request_id, params, false);
    }

    fn start_workload_inner(
        &mut self,
        kind_t: Kind,
        request_id: &Value,
        start: StartParams,
        may_wait: bool,
    ) {
        let kind = kind_t.as_str();
        let rid = ledger_id(request_id);
        let safe_id = store::safe_id(&rid);
        let workload_uuid = start.workload_uuid.as_ref().map(|u| u.as_str().to_string());
        let ctx = super::ingress::context_of(kind, &start.params);
        let ask = Ask {
            kind: kind_t,
            rid: &rid,
            gpus: start.gpus,
            max_runtime: start.max_runtime,
            may_wait,
        };
        let decision = self.admission(&ask, &safe_id);
        let (template, gpus, max_runtime_s) = match decision {
            Decision::Replay(Earlier::Answered { ok, body }) => {
                log::info!(
                    "request {} was handled before; repeating its answer",
                    shown(&rid)
                );
                return self.replies().replay(request_id, ok, body);
            }
            Decision::Replay(Earlier::Running(out)) => return self.replies().ok(request_id, out),
            // In flight: answered with the original answer once the spawn reports.
            Decision::Replay(Earlier::InFlight) => {
                log::info!(
                    "request {} is being started; it gets the same answer",
                    shown(&rid)
                );
                if let Some(st) = self.starts.get_mut(&safe_id) {
                    st.waiters.push(request_id.clone());
                }
                return;
            }
            Decision::Reject(why) => {
                return self.reject_start(request_id, workload_uuid.as_deref(), &why, ctx)
            }
            Decision::Defer { until, otherwise } => {
                let (active, workers) = (&self.active, &self.io.workers);
                let uuid = self.session.uuid();
                if self
                    .heal
                    .start_pass(self.s.standalone, active, workers, uuid)
                {
                    self.heal.defer(kind_t, request_id, &start, until);
                } else {
                    self.reject_start(request_id, workload_uuid.as_deref(), &otherwise, ctx);
                }
                return;
            }
            Decision::Spawn {
                template,
                gpus,
                max_runtime_s,
            } => (template, gpus, max_runtime_s),
        };
        // The token a workload proves its workflow events with: never from guessable bytes.
        let Some(token_bytes) = crate::util::secret_bytes::<16>() else {
            let why = RejectReason::Failed {
                kind: kind.into(),
                why: "the kernel gave no random bytes for the workload's event token".into(),
            };
            return self.reject_start(request_id, workload_uuid.as_deref(), &why, ctx);
        };
        let params = start.params;
        let req = StartRequest {
            kind: kind_t,
            request_id: request_id.clone(),
            safe_id: safe_id.clone(),
            params,
            template,
            node_token: self.io.token.clone(),
            max_runtime_s,
            workflow: ctx.clone(),
            socket: self.io.layout.state.join("control.sock"),
            gpus,
            results_dir: self.active.results_dir_for(&safe_id),
            event_token: crate::util::hex(&token_bytes),
            node_uuid: self.uuid().to_string(),
        };
        let starting = Starting {
            kind: kind_t,
            request_id: request_id.clone(),
            workload_uuid: workload_uuid.clone(),
            ctx: ctx.clone(),
            gpus: req.gpus.clone(),
            created_unix: workload::unix_now(),
            cancel: None,
            waiters: Vec::new(),
            event_token: req.event_token.clone(),
            held: Vec::new(),
        };
        // D53: taken; from here on this start is answered, if need be by the next node.
        note_taken(&self.io.layout, &safe_id, &rid, &starting);
        if let Err(e) = self.starts.begin(starting, req) {
            super::interrupted::forget(&self.io.layout, &safe_id);
            let why = RejectReason::Failed {
                kind: kind.into(),
                why: e,
            };
            self.reject_start(request_id, workload_uuid.as_deref(), &why, ctx);
            // The spawner is gone: what is still in flight will never be reported.
            return self.on_spawner_gone();
        }
        log::debug!("{kind} {} handed to the spawner", shown(&rid));
        if self.s.drain_after_one {
            // One workload: no second start is taken while this one is in flight.
            self.life
                .drain
                .set(true, "--drain-after-one", self.in_use());
        }
    }

    /// The admission decision for this start: the node's facts gathered, then [`admit::decide`].
    fn admission(&mut self, ask: &Ask<'_>, safe_id: &str) -> Decision {
        let running = self.active.get(safe_id).map(|a| start_output(&a.meta));
        let in_flight = self.starts.get_mut(safe_id).is_some();
        let facts = Facts {
            running,
            in_flight,
            template: self.s.command_template(ask.kind.as_str()),
            shutting_down: self.life.shutdown.is_some(),
            draining: self.life.drain.on,
            min_free_disk_mb: self.s.min_free_disk_mb.value,
            state: &self.io.layout.state,
            free_mb: &crate::store::free_mb,
            spawner_gone: self.starts.gone(),
            capacity: self.s.max_concurrent_workloads.value as usize,
            used: self.in_use(),
            uploading: self.active.uploading(),
            manifest_limit: self
                .s
                .manifest
                .as_ref()
                .and_then(|m| m.max_runtime_seconds)
                .and_then(Seconds::from_f64),
        };
        let held = super::gpus::holders(&super::gpus_out::holds_of(&self.active, &self.starts));
        let now = self.io.clock.now();
        let wait = super::selfheal::defer_wait();
        admit::decide(
            ask,
            &facts,
            &self.durable.ledger,
            &self.gpu,
            &held,
            now,
            wait,
        )
    }

    /// The spawner reported a start: from here on it is what a start was before (answer, status
    /// `running`, tracking), or its refusal.
    pub(super) fn on_spawn_outcome(&mut self, outcome: Outcome) {
        match outcome {
            Outcome::Spawned {
                safe_id,
                meta,
                ledger,
                launch,
                total,
            } => {
                let mut st = self.starts.end(&safe_id);
                // No other thread appends to the ledger while no start is in flight.
                let quiet = self.starts.is_empty();
                self.durable.ledger.remember(ledger, quiet);
                let kind = meta.kind;
                let rid = meta.request_id_text();
                log::info!(
                    "{kind} {} started: pid {} (supervisor forked {:.1} ms after the request reached the spawner, answered after {:.1} ms); logs {} and {}",
                    shown(&rid),
                    meta.pid(),
                    launch.as_secs_f64() * 1e3,
                    total.as_secs_f64() * 1e3,
                    meta.stdout_log.display(),
                    meta.stderr_log.display()
                );
                let out = start_output(&meta);
                let request_id = st
                    .as_ref()
                    .map_or_else(|| meta.request_id.clone(), |s| s.request_id.clone());
                self.replies().ok(&request_id, out.clone());
                for w in st.iter().flat_map(|s| s.waiters.iter()) {
                    self.replies().ok(w, out.clone());
                }
                if let Some(wl) = &meta.workload_uuid {
                    let body = json!({"status": "running", "message": format!("{kind} started in background"), "pid": meta.pid()});
                    self.workload_status(wl, body);
                }
                super::interrupted::forget(&self.io.layout, &safe_id);
                self.with_ingress(|i, out| i.report_started(&meta, out));
                self.life.metrics.starts = self.life.metrics.starts.saturating_add(1);
                if self.s.drain_after_one {
                    self.life.drain.one_started = true;
                    self.life
                        .drain
                        .set(true, "--drain-after-one", self.in_use());
                }
                let shim = meta
                    .started
                    .as_ref()
                    .map(|s| (s.shim_pid, s.shim_start_ticks));
                let now = self.io.clock.now();
                self.active
                    .insert(safe_id.clone(), Active::new(*meta, true, now));
                super::gpus_out::update_sampling(
                    &self.gpu,
                    &self.active,
                    &self.starts,
                    self.io.gpu_monitor.as_ref(),
                );
                // What the workload asked of the node before its start was reported.
                for req in st.iter_mut().flat_map(|s| s.held.drain(..)) {
                    let reply = self.on_emit(&req.body);
                    let _ = req.reply.send(reply);
                }
                // The reaper may have reported the supervisor's end before this report (it then
                // matched no workload and was dropped): taken up now; a duplicate later changes
                // nothing (the lifecycle ignores a second end).
                if let Some((pid, ticks)) = shim {
                    if !procinfo::same_process_alive(pid, ticks) {
                        log::debug!(
                            "the supervisor of {} (pid {pid}) ended before its start was reported",
                            shown(&rid)
                        );
                        self.on_reaped(pid);
                    }
                }
                if let Some(c) = st.and_then(|s| s.cancel) {
                    log::info!(
                        "carrying out the cancel recorded while {} was starting",
                        shown(&rid)
                    );
                    let cancelled = self.with_table(|t, out, now| {
                        t.cancel(&safe_id, c.signal, c.name, c.grace, false, now, out)
                    });
                    if let Err(e) = cancelled {
                        log::warn!(
                            "the cancel recorded for {} failed: {}",
                            shown(&rid),
                            shown(&e)
                        );
                    }
                }
            }
            Outcome::SpawnFailed { safe_id, why } => {
                let why = why.to_string();
                let Some(st) = self.starts.end(&safe_id) else {
                    log::error!("a start that was not in flight failed: {}", shown(&why));
                    return;
                };
                self.fail_start(&safe_id, st, &why);
                if self.s.drain_after_one && !self.life.drain.one_started && self.starts.is_empty()
                {
                    // The one workload did not start: the node takes the next start.
                    self.life.drain.set(
                        false,
                        "--drain-after-one: the start failed",
                        self.in_use(),
                    );
                }
                self.retry_deferred_starts();
            }
        }
    }

    /// The spawner's channel closed: its threads are gone. Every start in flight fails, and
    /// every later one is refused with [`SPAWNER_GONE`].
    pub(super) fn on_spawner_gone(&mut self) {
        log::error!("{SPAWNER_GONE}");
        // What it reported before it went is still taken up.
        while let Ok(o) = self.io.spawned.try_recv() {
            self.on_spawn_outcome(o);
        }
        self.io.spawned = crossbeam_channel::never();
        for (safe_id, st) in self.starts.stopped() {
            self.fail_start(&safe_id, st, SPAWNER_GONE);
        }
    }

    fn fail_start(&mut self, safe_id: &str, st: Starting, why: &str) {
        let reason = RejectReason::Failed {
            kind: st.kind.as_str().into(),
            why: why.into(),
        };
        let why = reason.to_string();
        log::error!("{why}");
        for req in st.held {
            let _ = req
                .reply
                .send(json!({"ok": false, "refused": true, "error": why}));
        }
        for w in &st.waiters {
            self.replies().error(w, &why);
        }
        self.reject_start(&st.request_id, st.workload_uuid.as_deref(), &reason, st.ctx);
        super::interrupted::forget(&self.io.layout, safe_id);
    }

    /// At exit: the starts still in flight are waited for (each is bounded by the shim's pid
    /// timeout), so each is answered and its workload named before the node goes.
    pub(super) fn finish_starts(&mut self) {
        let until = crate::util::later(
            Instant::now(),
            workload::spawner::PID_TIMEOUT.saturating_add(Duration::from_secs(5)),
        );
        let before: Vec<String> = self.active.keys().cloned().collect();
        while !self.starts.is_empty() {
            let left = until.saturating_duration_since(Instant::now());
            match self.io.spawned.recv_timeout(left) {
                Ok(o) => self.on_spawn_outcome(o),
                Err(_) => break,
            }
        }
        for (id, a) in &self.active {
            if !before.contains(id) {
                log::info!(
                    "left running: {} {} pid {} (logs {} and {})",
                    a.meta.kind,
                    shown(&a.meta.request_id_text()),
                    a.meta.pid(),
                    shown(&a.meta.stdout_log.display().to_string()),
                    shown(&a.meta.stderr_log.display().to_string())
                );
            }
        }
        if !self.starts.is_empty() {
            log::warn!(
                "{} start(s) still in flight at exit; the next node start re-adopts what they started",
                self.starts.len()
            );
        }
    }

    /// An error reply and, when the backend named the workload, R7 `failed` (protocol §4.3.3).
    /// A `busy` refusal keeps the host-busy contract (D13, D21); any other cannot succeed here.
    pub(super) fn reject_start(
        &mut self,
        request_id: &Value,
        workload_uuid: Option<&str>,
        reason: &RejectReason,
        ctx: Option<workload::WorkflowCtx>,
    ) {
        let why = reason.to_string();
        let why = why.as_str();
        let busy = reason.busy();
        self.with_ingress(|i, out| i.report_rejected(ctx, why, out));
        self.life.metrics.count_rejection(reason.metric());
        log::warn!(
            "refused start {}: {}",
            shown(&request_id_text(request_id)),
            shown(why)
        );
        self.replies().error(request_id, why);
        if let Some(wl) = workload_uuid {
            let mut body = Map::new();
            body.insert("status".into(), json!("failed"));
            body.insert("error".into(), json!(why));
            body.insert("failure_detail".into(), json!(why));
            if let Some(b) = busy {
                body.insert("rejection_reason".into(), json!("host_busy"));
                body.insert("busy_reason".into(), json!(b.reason()));
                body.insert("rejecting_instance_uuid".into(), json!(self.uuid()));
            }
            self.workload_status(wl, Value::Object(body));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn starting(rid: &str) -> Starting {
        Starting {
            kind: Kind::Inference,
            request_id: json!(rid),
            workload_uuid: Some(format!("wl-{rid}")),
            ctx: None,
            gpus: Some(vec![format!("GPU-{rid}")]),
            created_unix: 1.7e9,
            cancel: None,
            waiters: Vec::new(),
            event_token: format!("tok{rid}"),
            held: Vec::new(),
        }
    }

    fn request(rid: &str) -> StartRequest {
        StartRequest {
            kind: Kind::Inference,
            request_id: json!(rid),
            safe_id: store::safe_id(rid),
            params: Map::new(),
            template: "true".into(),
            node_token: String::new(),
            max_runtime_s: None,
            workflow: None,
            socket: "/nonexistent/control.sock".into(),
            gpus: None,
            results_dir: None,
            event_token: format!("tok{rid}"),
            node_uuid: "node-uuid".into(),
        }
    }

    #[test]
    fn a_start_in_flight_is_found_by_its_request_id_and_ends_once() {
        let (spawner, jobs) = Spawner::for_tests();
        let mut s = Starts::new(Ok(spawner));
        assert!(s.begin(starting("r1"), request("r1")).is_ok());
        assert!(s.begin(starting("r2"), request("r2")).is_ok());
        assert_eq!(jobs.len(), 2, "both handed to the spawner");
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
    }

    #[test]
    fn a_cancel_while_starting_is_recorded_once_and_the_first_one_stays() {
        let (spawner, _jobs) = Spawner::for_tests();
        let mut s = Starts::new(Ok(spawner));
        s.begin(starting("r1"), request("r1")).unwrap();
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
        assert_eq!(s.cancel(&id, term.clone()), Some(term.clone()));
        assert_eq!(s.cancel(&id, kill), Some(term.clone()), "the first stays");
        assert_eq!(s.cancel("other", term.clone()), None);
        assert_eq!(
            s.end(&id).unwrap().cancel,
            Some(term),
            "carried to the report"
        );
    }

    #[test]
    fn a_gone_spawner_fails_what_is_in_flight_and_refuses_what_comes() {
        let (spawner, jobs) = Spawner::for_tests();
        let mut s = Starts::new(Ok(spawner));
        s.begin(starting("r1"), request("r1")).unwrap();
        s.begin(starting("r2"), request("r2")).unwrap();
        drop(jobs); // the spawner thread ends
        let e = s.begin(starting("r3"), request("r3")).unwrap_err();
        assert_eq!(e, SPAWNER_GONE);
        assert_eq!(s.gone(), Some(SPAWNER_GONE));
        assert_eq!(s.len(), 2, "the refused one is not in flight");
        // The loop notices the closed channel: both in flight are returned to be failed.
        let failed: Vec<String> = s.stopped().into_iter().map(|(k, _)| k).collect();
        assert_eq!(failed, vec![store::safe_id("r1"), store::safe_id("r2")]);
        assert!(s.is_empty());
        assert!(s.begin(starting("r4"), request("r4")).is_err());
        // A spawner that never started refuses with its own reason.
        let never = Starts::new(Err("cannot start the workload spawner thread: x".into()));
        assert!(never.gone().unwrap().contains("cannot start"));
        let mut never = never;
        assert!(never
            .begin(starting("r5"), request("r5"))
            .unwrap_err()
            .contains("cannot start"));
    }
}
