//! The start path on the loop: a start command checked ([`admit::decide`] over what the node
//! knows) and handed to the spawner, the spawner's [`Outcome`] answered, recorded and tracked,
//! refusals, deferred starts (self-heal) and the starts interrupted by a restart (D53). See
//! `starts.rs` for the order of the writes and what a crash at each point leaves.

use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::admit::{self, Ask, Decision, Earlier, Facts, RejectReason};
use super::selfheal::{self, Heal};
use super::starts::{self, Answer, Starting, SPAWNER_GONE};
use super::workloads::{start_output, Work};
use crate::ledger::Ledger;
use crate::logtext::shown;
use crate::protocol::commands::request_id_text;
use crate::protocol::commands::{Kind, Seconds, StartParams, TopicId};
use crate::store;
use crate::workload::spawner::Outcome;
use crate::workload::{self, StartRequest};

/// What the start path touches, borrowed apart from the node for one call (the loop builds
/// it): a workload's parts ([`Work`]), the ledger of handled request ids and the self-heal
/// part that defers starts.
pub(super) struct Start<'a> {
    pub(super) work: Work<'a>,
    pub(super) ledger: &'a mut Ledger,
    pub(super) heal: &'a mut Heal,
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

impl Start<'_> {
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
        let workload_uuid = start.workload_uuid.clone();
        let ctx = start.workflow.clone();
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
                return self.work.replies().replay(request_id, ok, body);
            }
            Decision::Replay(Earlier::Running(out)) => {
                return self.work.replies().ok(request_id, out)
            }
            // In flight: answered with the original answer once the spawn reports.
            Decision::Replay(Earlier::InFlight) => {
                log::info!(
                    "request {} is being started; it gets the same answer",
                    shown(&rid)
                );
                if let Some(st) = self.work.starts.get_mut(&safe_id) {
                    st.waiters.push(request_id.clone());
                }
                return;
            }
            Decision::Reject(why) => {
                return self.reject_start(request_id, workload_uuid.as_ref(), &why, ctx)
            }
            Decision::Defer { until, otherwise } => {
                let (active, workers) = (&*self.work.active, &self.work.io.workers);
                let uuid = self.work.session.uuid();
                if self
                    .heal
                    .start_pass(self.work.s.standalone, active, workers, uuid)
                {
                    self.heal.defer(kind_t, request_id, &start, until);
                } else {
                    self.reject_start(request_id, workload_uuid.as_ref(), &otherwise, ctx);
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
            return self.reject_start(request_id, workload_uuid.as_ref(), &why, ctx);
        };
        let user = match self.work.free_user() {
            Ok(u) => u,
            Err(why) => {
                let why = RejectReason::Failed {
                    kind: kind.into(),
                    why,
                };
                return self.reject_start(request_id, workload_uuid.as_ref(), &why, ctx);
            }
        };
        let params = start.params;
        let req = StartRequest {
            kind: kind_t,
            request_id: request_id.clone(),
            safe_id: safe_id.clone(),
            params,
            workload_uuid: workload_uuid.clone(),
            template,
            node_token: self.work.io.token.clone(),
            max_runtime_s,
            workflow: ctx.clone(),
            socket: self.work.io.layout.state.join("control.sock"),
            gpus,
            results_dir: self.work.active.results_dir_for(&safe_id),
            event_token: crate::util::hex(&token_bytes),
            node_uuid: self.work.session.uuid().to_string(),
            user,
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
            uid: req.user.as_ref().map(|u| u.uid),
        };
        // D53: noted as taken, then handed to the spawner.
        if let Err(e) = self.work.starts.begin(&self.work.io.layout, starting, req) {
            let why = RejectReason::Failed {
                kind: kind.into(),
                why: e,
            };
            self.reject_start(request_id, workload_uuid.as_ref(), &why, ctx);
            // The spawner is gone: what is still in flight will never be reported.
            return self.on_spawner_gone();
        }
        log::debug!("{kind} {} handed to the spawner", shown(&rid));
        if self.work.s.drain_after_one {
            // One workload: no second start is taken while this one is in flight.
            self.work
                .life
                .drain
                .set(true, "--drain-after-one", self.work.in_use());
        }
    }

    /// The admission decision for this start: the node's facts gathered, then [`admit::decide`].
    fn admission(&mut self, ask: &Ask<'_>, safe_id: &str) -> Decision {
        let running = self.work.active.get(safe_id).map(|a| start_output(&a.meta));
        let in_flight = self.work.starts.get_mut(safe_id).is_some();
        let facts = Facts {
            running,
            in_flight,
            template: self.work.s.command_template(ask.kind.as_str()),
            shutting_down: self.work.life.shutdown.is_some(),
            draining: self.work.life.drain.on,
            min_free_disk_mb: self.work.s.min_free_disk_mb.value,
            state: &self.work.io.layout.state,
            free_mb: &crate::store::free_mb,
            spawner_gone: self.work.starts.gone(),
            capacity: self.work.s.max_concurrent_workloads.value as usize,
            used: self.work.in_use(),
            uploading: self.work.active.uploading(),
            manifest_limit: self
                .work
                .s
                .manifest
                .as_ref()
                .and_then(|m| m.max_runtime_seconds)
                .and_then(Seconds::from_f64),
        };
        let held = super::gpus::holders(&self.work.holds());
        let now = self.work.io.clock.now();
        let wait = admit::defer_wait();
        admit::decide(ask, &facts, self.ledger, self.work.gpu, &held, now, wait)
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
                let mut st = self.work.starts.end(&safe_id);
                // No other thread appends to the ledger while no start is in flight.
                let quiet = self.work.starts.is_empty();
                self.ledger.remember(ledger, quiet);
                let kind = meta.kind;
                let rid = meta.request_id_text();
                log::info!(
                    "{kind} {} started: pid {} (supervisor started {:.1} ms after the request reached the spawner, answered after {:.1} ms); logs {} and {}",
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
                self.work.replies().ok(&request_id, out.clone());
                for w in st.iter().flat_map(|s| s.waiters.iter()) {
                    self.work.replies().ok(w, out.clone());
                }
                if let Some(wl) = &meta.workload_uuid {
                    let body = json!({"status": "running", "message": format!("{kind} started in background"), "pid": meta.pid()});
                    self.work.workload_status(wl, body);
                }
                // Only a start with a workflow context has a workflow node event.
                if meta.workflow.is_some() {
                    self.work
                        .with_ingress(|i, out| i.report_started(&meta, out));
                }
                self.work.life.metrics.starts = self.work.life.metrics.starts.saturating_add(1);
                if self.work.s.drain_after_one {
                    self.work.life.drain.one_started = true;
                    self.work
                        .life
                        .drain
                        .set(true, "--drain-after-one", self.work.in_use());
                }
                self.work.track(&safe_id, *meta, true);
                self.work.update_sampling();
                // What the workload asked of the node before its start was reported.
                for req in st.iter_mut().flat_map(|s| s.held.drain(..)) {
                    let reply = self.work.on_emit(&req.body);
                    let _ = req.reply.send(reply);
                }
                if let Some(c) = st.and_then(|s| s.cancel) {
                    log::info!(
                        "carrying out the cancel recorded while {} was starting",
                        shown(&rid)
                    );
                    let cancelled = self.work.with_table(|t, w, fx, now| {
                        t.cancel(&safe_id, c.signal, c.name, c.grace, false, now, w, fx)
                    });
                    if let Err(e) = cancelled {
                        log::warn!(
                            "the cancel recorded for {} failed: {}",
                            shown(&rid),
                            shown(&e)
                        );
                    }
                }
                // Last: until the workload's record says it is being cancelled, the note keeps
                // the cancel answered while it started.
                starts::forget(&self.work.io.layout, &safe_id);
            }
            Outcome::SpawnFailed { safe_id, why } => {
                let full = why.disk_full();
                let why = why.to_string();
                let Some(st) = self.work.starts.end(&safe_id) else {
                    log::error!("a start that was not in flight failed: {}", shown(&why));
                    return;
                };
                let reason = if full {
                    RejectReason::DiskFull {
                        state: self.work.io.layout.state.display().to_string(),
                        why,
                    }
                } else {
                    RejectReason::Failed {
                        kind: st.kind.as_str().into(),
                        why,
                    }
                };
                self.fail_start(&safe_id, st, reason);
                if self.work.s.drain_after_one
                    && !self.work.life.drain.one_started
                    && self.work.starts.is_empty()
                {
                    // The one workload did not start: the node takes the next start.
                    self.work.life.drain.set(
                        false,
                        "--drain-after-one: the start failed",
                        self.work.in_use(),
                    );
                }
                self.retry_deferred();
            }
        }
    }

    /// The spawner's channel closed: its threads are gone. Every start in flight fails, and
    /// every later one is refused with [`SPAWNER_GONE`].
    pub(super) fn on_spawner_gone(&mut self) {
        log::error!("{SPAWNER_GONE}");
        // What it reported before it went is still taken up.
        while let Ok(o) = self.work.starts.outcomes.try_recv() {
            self.on_spawn_outcome(o);
        }
        self.work.starts.outcomes = crossbeam_channel::never();
        for (safe_id, st) in self.work.starts.stopped() {
            let reason = RejectReason::Failed {
                kind: st.kind.as_str().into(),
                why: SPAWNER_GONE.into(),
            };
            self.fail_start(&safe_id, st, reason);
        }
    }

    /// A start in flight that did not start: refused for `reason` (a full disk keeps the
    /// host-busy contract: it may be retried).
    fn fail_start(&mut self, safe_id: &str, st: Starting, reason: RejectReason) {
        let why = reason.to_string();
        log::error!("{why}");
        for req in st.held {
            let _ = req
                .reply
                .send(json!({"ok": false, "refused": true, "error": why}));
        }
        for w in &st.waiters {
            self.work.replies().error(w, &why);
        }
        self.reject_start(&st.request_id, st.workload_uuid.as_ref(), &reason, st.ctx);
        starts::forget(&self.work.io.layout, safe_id);
    }

    /// At exit: the starts still in flight are waited for (each is bounded by the shim's pid
    /// timeout), so each is answered and its workload named before the node goes.
    pub(super) fn finish_starts(&mut self) {
        let until = crate::util::later(
            Instant::now(),
            workload::spawner::PID_TIMEOUT.saturating_add(Duration::from_secs(5)),
        );
        let before: Vec<String> = self.work.active.keys().cloned().collect();
        while !self.work.starts.is_empty() {
            let left = until.saturating_duration_since(Instant::now());
            match self.work.starts.outcomes.recv_timeout(left) {
                Ok(o) => self.on_spawn_outcome(o),
                Err(_) => break,
            }
        }
        for (id, a) in self.work.active.iter() {
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
        if !self.work.starts.is_empty() {
            log::warn!(
                "{} start(s) still in flight at exit; the next node start re-adopts what they started",
                self.work.starts.len()
            );
        }
    }

    /// An error reply and, when the backend named the workload, R7 `failed` (docs/protocol.md).
    /// A `busy` refusal keeps the host-busy contract (D13, D21); any other cannot succeed here.
    pub(super) fn reject_start(
        &mut self,
        request_id: &Value,
        workload_uuid: Option<&TopicId>,
        reason: &RejectReason,
        ctx: Option<workload::WorkflowCtx>,
    ) {
        let why = reason.to_string();
        let why = why.as_str();
        let busy = reason.busy();
        if ctx.is_some() {
            self.work
                .with_ingress(|i, out| i.report_rejected(ctx, why, out));
        }
        self.work.life.metrics.count_rejection(reason.metric());
        log::warn!(
            "refused start {}: {}",
            shown(&request_id_text(request_id)),
            shown(why)
        );
        self.work.replies().error(request_id, why);
        if let Some(wl) = workload_uuid {
            let mut body = Map::new();
            body.insert("status".into(), json!("failed"));
            body.insert("error".into(), json!(why));
            body.insert("failure_detail".into(), json!(why));
            if let Some(b) = busy {
                body.insert("rejection_reason".into(), json!("host_busy"));
                body.insert("busy_reason".into(), json!(b.reason()));
                body.insert(
                    "rejecting_instance_uuid".into(),
                    json!(self.work.session.uuid()),
                );
            }
            self.work.workload_status(wl, Value::Object(body));
        }
    }

    /// Once registered: every interrupted start gets its answer (D53), and its note goes.
    pub(super) fn answer_interrupted(&mut self) {
        for (safe_id, taken, a) in std::mem::take(&mut self.work.starts.interrupted) {
            match a {
                Answer::Started(out) => {
                    self.work.replies().ok(&taken.request_id, out);
                    let pid = self
                        .work
                        .active
                        .get(&safe_id)
                        .filter(|a| !a.finished())
                        .map(|a| a.meta.pid());
                    if let (Some(pid), Some(wl)) = (pid, &taken.workload_uuid) {
                        let body = serde_json::json!({"status": "running", "message": format!("{} started in background", taken.kind), "pid": pid});
                        self.work.workload_status(wl, body);
                    }
                }
                Answer::NeverStarted(why) => {
                    let why = admit::RejectReason::Interrupted(why);
                    self.reject_start(&taken.request_id, taken.workload_uuid.as_ref(), &why, None);
                }
            }
            starts::forget(&self.work.io.layout, &safe_id);
        }
    }

    /// A self-heal lookup's answer: a stale workload is terminated without a completion.
    pub(super) fn on_workload_check(&mut self, key: &str, check: crate::backend::WorkloadCheck) {
        let what = match self.heal.on_check(key, check, self.work.active) {
            selfheal::HealCheck::Moot => return,
            selfheal::HealCheck::Kept => None,
            selfheal::HealCheck::Stale(what) => Some(what),
        };
        if let Some(what) = what {
            let grace = admit::STALE_GRACE;
            if let Err(e) = self
                .work
                .with_table(|t, w, fx, now| t.cancel_stale(key, grace, now, w, fx))
            {
                log::error!(
                    "self-heal: cannot terminate {}: {e}; it stays tracked",
                    crate::logtext::shown(&what)
                );
            }
        }
        self.retry_deferred();
    }

    /// Deferred starts go ahead once there is room, or are refused once their time is up.
    pub(super) fn retry_deferred(&mut self) {
        if self.heal.deferred.is_empty() {
            return;
        }
        let now = self.work.io.clock.now();
        let capacity = self.work.s.max_concurrent_workloads.value as usize;
        let pending = std::mem::take(&mut self.heal.deferred);
        for (kind, rid, params, until) in pending {
            let stale_left = self
                .work
                .active
                .values()
                .any(|a| a.meta.cancel.as_ref().is_some_and(|c| c.stale));
            let room = self.work.in_use() < capacity;
            let undecided = !self.heal.checking.is_empty() || stale_left;
            if admit::go_ahead(now, until, room, undecided) {
                self.start_workload_now(kind, &rid, params);
            } else {
                self.heal.deferred.push((kind, rid, params, until));
            }
        }
    }
}
