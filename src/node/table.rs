//! The workload table: every workload the node tracks, its phase in the lifecycle machine
//! ([`lifecycle::step`]), its runtime limit, the checks of a workload whose supervisor was
//! killed (D27) or stopped (D66) and the progress of its result uploads. The table owns that
//! state; it reads the processes through [`World`] and returns what it wants done as
//! [`Effect`]s (requests, worker jobs, records on disk, reports) that the loop carries out
//! (`effect.rs`). Every method takes `now`, so escalation, max runtime and upload retries are
//! unit-tested with a fake world and a fake clock (the tests below).
//!
//! The result uploads are a value of their own ([`Uploads`]) that the table owns and drives:
//! they add their effects to the table's and tell the table when a workload's uploads are
//! over. Only the table and the loop that owns it see [`Active`]; the table never sees the
//! connection, the pending requests or the outbox.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::gpus::Hold;
pub use super::uploads::UploadCfg;
use super::uploads::Uploads;
use crate::logtext::shown;
use crate::protocol::commands::Seconds;
use crate::workers::Done;
use crate::workload::lifecycle::{self, Action, Event, Phase};
use crate::workload::shim::Exit;
use crate::workload::{self, procinfo, Cancel, Layout, Meta};

use super::effect::{Effect, Fx, LeftOnDisk};

/// Default grace between the cancel signal and SIGKILL of the whole group (D10).
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);
/// How often the group of a workload whose supervisor was killed is checked (D27).
const LINGER_CHECK: Duration = Duration::from_millis(250);
/// How often a running workload's supervisor is looked at for a stop (D66): at the loop's
/// busy tick, which wakes it at least this often while a workload is tracked.
const SUPERVISOR_CHECK: Duration = Duration::from_secs(1);

/// The report of a workload that ended while its supervisor stayed stopped (D66).
pub const SUPERVISOR_STOPPED: &str =
    "workload ended while its supervisor was stopped (SIGSTOP) and kept stopped; exit status unknown";

/// The error of a completion for a workload whose record did not validate at recovery.
pub const SALVAGED: &str =
    "workload record was corrupt (moved to the quarantine folder); its outcome cannot be trusted";

/// What the table reads of the processes when it decides, and the signals it sends at once
/// (their answer is the cancel's answer). [`Procs`] on the host; the unit tests fake it.
pub trait World {
    /// The workload's process group when it can be proven at this moment to be the one its
    /// supervisor created (D26); None: nothing of it is left, and a signal could reach a
    /// stranger.
    fn provable_group(&self, meta: &Meta) -> Option<i32>;
    /// Sends `sig` to process group `group` (only ever one [`World::provable_group`] just
    /// returned).
    fn signal_group(&mut self, group: i32, sig: i32) -> std::io::Result<()>;
    /// The supervisor's exit record of workload `id`, if it wrote one.
    fn exit_record(&self, id: &str) -> Option<Exit>;
    /// The workload's supervisor is provably still the one it was, and stopped (state T, D66).
    fn supervisor_stopped(&self, meta: &Meta) -> bool;
    /// SIGCONT to the workload's supervisor, if it is provably still the one it was (D66).
    fn continue_supervisor(&mut self, meta: &Meta) -> std::io::Result<()>;
}

/// The [`World`] of this host: procinfo, and the exit records in the state dir.
pub struct Procs<'a> {
    pub layout: &'a Layout,
}

impl World for Procs<'_> {
    fn provable_group(&self, meta: &Meta) -> Option<i32> {
        let st = meta.started.as_ref()?;
        // A supervisor is a session leader below the node: never session 0 or 1.
        (st.boot_id == procinfo::boot_id()
            && st.shim_pid > 1
            && procinfo::group_members(st.pid, st.shim_pid) > 0)
            .then_some(st.pid)
    }

    fn signal_group(&mut self, group: i32, sig: i32) -> std::io::Result<()> {
        procinfo::signal_group(group, sig)
    }

    fn exit_record(&self, id: &str) -> Option<Exit> {
        workload::load_exit(&self.layout.dir(id))
    }

    fn supervisor_stopped(&self, meta: &Meta) -> bool {
        meta.started
            .as_ref()
            .is_some_and(|st| procinfo::stopped(st.shim_pid, st.shim_start_ticks))
    }

    fn continue_supervisor(&mut self, meta: &Meta) -> std::io::Result<()> {
        let Some(st) = meta.started.as_ref() else {
            return Ok(());
        };
        procinfo::signal_process(st.shim_pid, st.shim_start_ticks, libc::SIGCONT)
    }
}

/// A workload the node tracks.
pub struct Active {
    pub meta: Meta,
    /// Where it is: the one source of truth, changed only through [`Table::advance`].
    pub phase: Phase,
    pub runtime_deadline: Option<Instant>,
    pub next_check: Instant,
    /// When its supervisor is next looked at for a stop (D66).
    supervisor_check: Instant,
    /// Its stopped supervisor was sent SIGCONT (D66): found stopped again with nothing of its
    /// workload left, the workload counts as ended.
    continued: bool,
}

impl Active {
    pub fn new(meta: Meta, now: Instant) -> Active {
        let elapsed = (workload::unix_now() - meta.created_unix).max(0.0);
        // A limit read back from disk is bounded again here: no value can overflow the clock.
        let runtime_deadline = meta
            .max_runtime_s
            .and_then(Seconds::from_f64)
            .and_then(|m| Duration::try_from_secs_f64((m.get() - elapsed).max(0.0)).ok())
            .and_then(|left| now.checked_add(left));
        // A cancel recorded before a restart is still under way, with its original deadline.
        let phase = match &meta.cancel {
            Some(c) => Phase::Cancelling {
                escalate_at: crate::util::secs_f64(
                    (c.requested_unix + c.grace_s - workload::unix_now()).max(0.0),
                )
                .checked_add(Duration::ZERO)
                .and_then(|left| now.checked_add(left)),
            },
            None => Phase::Running,
        };
        Active {
            meta,
            phase,
            runtime_deadline,
            next_check: now,
            supervisor_check: now,
            continued: false,
        }
    }

    /// Nothing of it runs any more: it waits for its logs, uploads or report and is never
    /// signalled again (D26).
    pub fn finished(&self) -> bool {
        self.phase.finished()
    }

    pub fn state(&self) -> &'static str {
        self.phase.label()
    }

    /// The moments its timers fall due, each only in the state in which [`Table::tick`] acts on
    /// it, so a deadline that has passed never keeps the loop spinning.
    fn deadlines(&self) -> impl Iterator<Item = Instant> + '_ {
        let lingering = matches!(self.phase, Phase::Lingering { .. });
        [
            self.runtime_deadline
                .filter(|_| self.meta.cancel.is_none() && !self.finished()),
            self.phase.deadline(),
            lingering.then_some(self.next_check),
        ]
        .into_iter()
        .flatten()
    }
}

/// The tracked workloads by safe id.
pub struct Table {
    active: BTreeMap<String, Active>,
    /// Workloads whose completion could not be written to disk: their record is removed once
    /// the backend acknowledged it (outbox sequence → safe id, D28).
    retire_on_ack: HashMap<u64, String>,
    /// The result uploads of the workloads in their `Uploading` phase.
    uploads: Uploads,
}

impl<'a> IntoIterator for &'a Table {
    type Item = (&'a String, &'a Active);
    type IntoIter = std::collections::btree_map::Iter<'a, String, Active>;
    fn into_iter(self) -> Self::IntoIter {
        self.active.iter()
    }
}

impl Table {
    pub fn new(cfg: UploadCfg) -> Table {
        Table {
            active: BTreeMap::new(),
            retire_on_ack: HashMap::new(),
            uploads: Uploads::new(cfg),
        }
    }

    // ---- reading ----------------------------------------------------------------------------

    /// Every tracked workload counts against capacity, whatever its phase: one that exited
    /// still holds its slot while its logs drain, its results upload and its completion is
    /// queued (the busy reply then says "uploading results").
    pub fn len(&self) -> usize {
        self.active.len()
    }
    pub fn is_empty(&self) -> bool {
        self.active.is_empty()
    }
    pub fn get(&self, id: &str) -> Option<&Active> {
        self.active.get(id)
    }
    pub fn get_mut(&mut self, id: &str) -> Option<&mut Active> {
        self.active.get_mut(id)
    }
    pub fn contains_key(&self, id: &str) -> bool {
        self.active.contains_key(id)
    }
    pub fn keys(&self) -> impl Iterator<Item = &String> + '_ {
        self.active.keys()
    }
    pub fn values(&self) -> impl Iterator<Item = &Active> + '_ {
        self.active.values()
    }
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut Active> + '_ {
        self.active.values_mut()
    }
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Active)> + '_ {
        self.active.iter()
    }
    /// The GPU holds of the tracked workloads: each is held by its request id (its safe id
    /// when it has none) and its process group.
    pub(super) fn holds(&self) -> impl Iterator<Item = Hold<'_>> + '_ {
        self.active.iter().map(|(id, a)| Hold {
            id,
            holder: match &a.meta.request_id {
                Value::Null => serde_json::json!(id),
                r => r.clone(),
            },
            pid: Some(a.meta.pid()),
            gpus: a.meta.gpus.as_deref().unwrap_or_default(),
        })
    }
    /// Starts tracking a workload (a replaced entry is returned).
    pub fn insert(&mut self, id: String, a: Active) -> Option<Active> {
        self.active.insert(id, a)
    }
    /// The safe id of the first workload `pred` picks.
    pub fn find(&self, pred: impl Fn(&Active) -> bool) -> Option<String> {
        self.active
            .iter()
            .find(|(_, a)| pred(a))
            .map(|(k, _)| k.clone())
    }
    /// Safe ids of the workloads whose logs are draining.
    pub fn draining(&self) -> Vec<String> {
        self.active
            .iter()
            .filter(|(_, a)| matches!(a.phase, Phase::Draining { .. }))
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// The earliest moment one of the table's timers falls due (for the loop's sleep).
    pub fn next_due(&self) -> Option<Instant> {
        self.active
            .values()
            .flat_map(Active::deadlines)
            .chain(self.uploads.next_due())
            .min()
    }

    // ---- cancel -----------------------------------------------------------------------------

    /// Signals the workload's process group (if provably its own) and arms the escalation to
    /// SIGKILL. The message is the command's answer.
    #[allow(clippy::too_many_arguments)]
    pub fn cancel(
        &mut self,
        id: &str,
        sig: i32,
        sig_name: &str,
        grace: Duration,
        timed_out: bool,
        now: Instant,
        w: &mut dyn World,
        fx: &mut Fx,
    ) -> Result<String, String> {
        let Some(a) = self.active.get_mut(id) else {
            return Err("No active workload found".into());
        };
        let pid = a.meta.pid();
        if a.finished() {
            // D29: its real outcome is what the backend gets; nothing is signalled (D26).
            let uploading = matches!(a.phase, Phase::Uploading { .. });
            if uploading
                && self
                    .uploads
                    .abandon(id, "the workload was cancelled while finalizing")
            {
                // D68: what is not uploaded stays on disk, and the completion goes out now.
                let left = self.uploads.left(id);
                self.advance(id, Event::UploadsDone, now, w, fx);
                return Ok(format!(
                    "Workload already finished; its result uploads were abandoned: {left} file(s) stay on disk, named in its completion's results_not_uploaded"
                ));
            }
            return Ok("Workload already finished; its completion reports how it ended".into());
        }
        if let Some(c) = &a.meta.cancel {
            // Cancelling already: the escalation keeps its original deadline; only a SIGKILL
            // asked for now goes out now.
            let first = c.signal.clone();
            if sig == libc::SIGKILL {
                if let Some(g) = w.provable_group(&a.meta) {
                    w.signal_group(g, sig)
                        .map_err(|e| format!("Failed to cancel workload: {e}"))?;
                }
                return Ok(format!(
                    "Workload was already being cancelled with {first}; SIGKILL sent to its group"
                ));
            }
            return Ok(format!(
                "Workload is already being cancelled with {first}; anything left of it gets SIGKILL at the original deadline"
            ));
        }
        let sent = match w.provable_group(&a.meta) {
            Some(g) => w.signal_group(g, sig),
            // Its group is gone: the exit is about to be noticed, and reported as it was.
            None => return Ok(format!("Process {pid} was already terminated")),
        };
        let message = match sent {
            Ok(()) => format!("Workload cancelled with {sig_name}"),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                return Ok(format!("Process {pid} was already terminated"))
            }
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                return Err(format!("Permission denied to send signal to process {pid}"))
            }
            Err(e) => return Err(format!("Failed to cancel workload: {e}")),
        };
        log::info!(
            "cancelling {} {} (pid {pid}) with {sig_name}; SIGKILL to its group after {:.1}s",
            a.meta.kind,
            shown(&a.meta.request_id_text()),
            grace.as_secs_f64()
        );
        a.meta.cancel = Some(Cancel {
            signal: sig_name.to_string(),
            requested_unix: workload::unix_now(),
            grace_s: grace.as_secs_f64(),
            timed_out,
            stale: false,
            reason: None,
        });
        fx.push(Effect::SaveMeta {
            meta: Box::new(a.meta.clone()),
            what: "the cancel",
        });
        self.advance(id, Event::Cancelled { grace }, now, w, fx);
        Ok(message)
    }

    /// The node's own cancel of every running workload (D58: its container is stopping):
    /// SIGTERM now, SIGKILL after `kill_after`, `reason` in each completion. Returns how many.
    pub fn cancel_all(
        &mut self,
        reason: &str,
        kill_after: Duration,
        now: Instant,
        w: &mut dyn World,
        fx: &mut Fx,
    ) -> usize {
        let ids: Vec<String> = self
            .active
            .iter()
            .filter(|(_, a)| !a.finished() && a.meta.cancel.is_none())
            .map(|(k, _)| k.clone())
            .collect();
        let mut n = 0usize;
        for id in ids {
            match self.cancel(&id, libc::SIGTERM, "SIGTERM", kill_after, false, now, w, fx) {
                Ok(_) => n = n.saturating_add(1),
                Err(e) => log::warn!("cannot stop workload {}: {e}", shown(&id)),
            }
            if let Some(a) = self.active.get_mut(&id) {
                if let Some(c) = a.meta.cancel.as_mut() {
                    c.reason = Some(reason.to_string());
                    fx.push(Effect::SaveMeta {
                        meta: Box::new(a.meta.clone()),
                        what: "the cancel",
                    });
                }
            }
        }
        n
    }

    /// How many running workloads no cancel has reached yet.
    pub fn uncancelled(&self) -> usize {
        self.active
            .values()
            .filter(|a| !a.finished() && a.meta.cancel.is_none())
            .count()
    }

    /// D70: a second SIGTERM to a container's main process while it stops its workloads: SIGKILL
    /// now to what is left of each one, `reason` in each completion (the grace it names is the
    /// time the workload had). Returns how many still ran.
    pub fn kill_all_now(
        &mut self,
        reason: &str,
        now: Instant,
        w: &mut dyn World,
        fx: &mut Fx,
    ) -> usize {
        let ids: Vec<String> = self
            .active
            .iter()
            .filter(|(_, a)| !a.finished())
            .map(|(k, _)| k.clone())
            .collect();
        for id in &ids {
            if let Some(c) = self.active.get_mut(id).and_then(|a| a.meta.cancel.as_mut()) {
                let had = (workload::unix_now() - c.requested_unix).max(0.0);
                c.grace_s = (had * 10.0).round() / 10.0;
            }
            let sig = (libc::SIGKILL, "SIGKILL");
            if let Err(e) = self.cancel(id, sig.0, sig.1, Duration::ZERO, false, now, w, fx) {
                log::warn!("cannot kill workload {}: {e}", shown(id));
            }
            if let Some(a) = self.active.get_mut(id) {
                if let Some(c) = a.meta.cancel.as_mut() {
                    c.reason = Some(reason.to_string());
                }
                fx.push(Effect::SaveMeta {
                    meta: Box::new(a.meta.clone()),
                    what: "the kill",
                });
            }
        }
        ids.len()
    }

    /// Self-heal: terminate a stale workload; it will be forgotten without a report.
    pub fn cancel_stale(
        &mut self,
        id: &str,
        grace: Duration,
        now: Instant,
        w: &mut dyn World,
        fx: &mut Fx,
    ) -> Result<(), String> {
        self.cancel(id, libc::SIGTERM, "SIGTERM", grace, false, now, w, fx)?;
        if let Some(a) = self.active.get_mut(id) {
            if let Some(c) = a.meta.cancel.as_mut() {
                c.stale = true;
            }
            fx.push(Effect::SaveMeta {
                meta: Box::new(a.meta.clone()),
                what: "the stale mark",
            });
        }
        Ok(())
    }

    // ---- exits ------------------------------------------------------------------------------

    /// The supervisor of workload `id` ended (the reaper reports each one the loop handed it,
    /// fresh or re-adopted, once it is in the table).
    pub fn on_reaped(&mut self, id: &str, now: Instant, w: &mut dyn World, fx: &mut Fx) {
        if !self.active.contains_key(id) {
            return log::debug!("the supervisor of {} ended; not tracked", shown(id));
        }
        log::debug!("the supervisor of workload {} exited", shown(id));
        let exit = w.exit_record(id);
        self.on_exit(id, exit, now, w, fx);
    }

    /// The workload's supervisor ended (`exit` is its record, if it wrote one).
    fn on_exit(
        &mut self,
        id: &str,
        exit: Option<Exit>,
        now: Instant,
        w: &mut dyn World,
        fx: &mut Fx,
    ) {
        log::debug!("workload {} ended: {exit:?}", shown(id));
        let Some(a) = self.active.get(id) else {
            return;
        };
        let group_alive = w.provable_group(&a.meta).is_some();
        if group_alive && exit.is_none() {
            // D27: the supervisor was killed; the workload stays tracked, counted and
            // cancellable until its group is empty.
            log::error!(
                "the supervisor of {} {} (pid {}) ended without an exit record while the workload still runs; tracking its process group until it is empty",
                a.meta.kind,
                shown(&a.meta.request_id_text()),
                a.meta.pid()
            );
        }
        if a.meta.salvaged.is_some() && !group_alive {
            // A record rebuilt at recovery: whatever the exit, its outcome cannot be trusted.
            let event = Event::Lost {
                exit,
                reason: SALVAGED,
            };
            return self.advance(id, event, now, w, fx);
        }
        self.advance(id, Event::SupervisorEnded { exit, group_alive }, now, w, fx);
    }

    /// A workload known to have ended (found at recovery): ship what is left of its logs, then
    /// report it — as lost when `lost` says why, or when its record was rebuilt.
    pub fn end(
        &mut self,
        id: &str,
        exit: Option<Exit>,
        lost: Option<&'static str>,
        now: Instant,
        w: &mut dyn World,
        fx: &mut Fx,
    ) {
        let salvaged = self
            .active
            .get(id)
            .is_some_and(|a| a.meta.salvaged.is_some());
        let event = match (lost, salvaged) {
            (_, true) => Event::Lost {
                exit,
                reason: SALVAGED,
            },
            (Some(reason), false) => Event::Lost { exit, reason },
            (None, false) => Event::SupervisorEnded {
                exit,
                group_alive: false,
            },
        };
        self.advance(id, event, now, w, fx);
    }

    /// Feeds `event` to the workload's lifecycle ([`lifecycle::step`]) and carries out what it
    /// says. The only place a workload's phase changes.
    pub fn advance(
        &mut self,
        id: &str,
        event: Event,
        now: Instant,
        w: &mut dyn World,
        fx: &mut Fx,
    ) {
        let Some(a) = self.active.get_mut(id) else {
            return;
        };
        let (next, actions) = lifecycle::step(&a.phase, event, now);
        a.phase = next;
        for action in actions {
            match action {
                Action::KillGroup => {
                    if let Some(a) = self.active.get(id) {
                        if let Some(g) = w.provable_group(&a.meta) {
                            log::warn!(
                                "workload pid {} outlived its grace period; SIGKILL to its process group",
                                a.meta.pid()
                            );
                            let _ = w.signal_group(g, libc::SIGKILL);
                        }
                    }
                }
                Action::ShipLogs => fx.push(Effect::ShipLogs),
                Action::StartUploads => {
                    let exit = match self.active.get(id).map(|a| &a.phase) {
                        Some(Phase::Uploading { exit }) => exit.clone(),
                        _ => None,
                    };
                    let tracked = self.tracked();
                    let begun = self.active.get(id).is_some_and(|a| {
                        self.uploads
                            .begin(id, &a.meta, exit.as_ref(), &tracked, now, fx)
                    });
                    if !begun {
                        self.advance(id, Event::UploadsDone, now, w, fx);
                    }
                }
                Action::Report { exit, lost } => {
                    let tracked = self.tracked();
                    let left = LeftOnDisk {
                        unattributed: self.uploads.unattributed(id, &tracked),
                        not_uploaded: self.uploads.not_uploaded(id),
                    };
                    if let Some(a) = self.active.remove(id) {
                        fx.push(Effect::Report {
                            id: id.to_string(),
                            meta: Box::new(a.meta),
                            exit,
                            lost,
                            left,
                        });
                    }
                }
            }
        }
    }

    /// The tracked workloads, as the uploads see them.
    fn tracked(&self) -> Vec<super::uploads::Owner> {
        self.active
            .iter()
            .map(|(id, a)| super::uploads::Owner {
                id: id.clone(),
                uid: a.meta.uid,
            })
            .collect()
    }

    // ---- the completion's record (D28) --------------------------------------------------------

    /// The loop queued the completion of `id`: with `held` None it is on disk and the record
    /// goes now; with `Some(seq)` the outbox could not write it, and the record stays until the
    /// backend acknowledged `seq`, so a restart still knows of the workload.
    pub fn completion_queued(&mut self, id: &str, held: Option<u64>) -> Option<Effect> {
        match held {
            Some(seq) => {
                self.retire_on_ack.insert(seq, id.to_string());
                None
            }
            None => Some(Effect::Retire(id.to_string())),
        }
    }

    /// The backend acknowledged outbox message `seq`.
    pub fn acknowledged(&mut self, seq: u64) -> Option<Effect> {
        self.retire_on_ack.remove(&seq).map(Effect::Retire)
    }

    // ---- result uploads ([`Uploads`]) --------------------------------------------------------

    /// D24: the workload's own results folder (see [`Uploads::results_dir_for`]).
    pub fn results_dir_for(&self, safe_id: &str) -> Option<PathBuf> {
        self.uploads.results_dir_for(safe_id)
    }

    /// Workloads uploading their results.
    pub fn uploading(&self) -> usize {
        self.uploads.uploading()
    }

    /// R9's answer (`None`: no answer in time).
    pub fn on_signed_url_reply(
        &mut self,
        id: &str,
        body: Option<Value>,
        now: Instant,
        w: &mut dyn World,
        fx: &mut Fx,
    ) {
        let over = self.uploads.on_signed_url_reply(id, body, now, fx);
        self.uploads_over(over, now, w, fx);
    }

    /// R10's answer over MQTT (`ok` false: refused or silent, so the REST fallback).
    pub fn on_upload_reply(
        &mut self,
        id: &str,
        ok: bool,
        now: Instant,
        w: &mut dyn World,
        fx: &mut Fx,
    ) {
        if self.uploads.on_upload_reply(id, ok, fx) {
            self.advance(id, Event::UploadsDone, now, w, fx);
        }
    }

    /// A worker's answer to an upload job (other answers are not the table's: ignored).
    pub fn on_worker_done(&mut self, done: Done, now: Instant, w: &mut dyn World, fx: &mut Fx) {
        let over = self.uploads.on_worker_done(done, now, fx);
        self.uploads_over(over, now, w, fx);
    }

    /// The workloads whose uploads are over move on.
    fn uploads_over(&mut self, ids: Vec<String>, now: Instant, w: &mut dyn World, fx: &mut Fx) {
        for id in ids {
            self.advance(&id, Event::UploadsDone, now, w, fx);
        }
    }

    // ---- timers -----------------------------------------------------------------------------

    /// Everything due at `now`: max runtime, escalation and drain deadlines, logs that finished
    /// draining (`drained`: the loop's verdict, by safe id), upload retries and lingering groups.
    pub fn tick(&mut self, now: Instant, drained: &[String], w: &mut dyn World, fx: &mut Fx) {
        let active = &self.active;
        self.uploads.retain(|id| active.contains_key(id));
        // Upload retries that fell due.
        let over = self.uploads.pump_all(now, fx);
        self.uploads_over(over, now, w, fx);
        let ids: Vec<String> = self.active.keys().cloned().collect();
        for id in ids {
            let Some(a) = self.active.get(&id) else {
                continue;
            };
            // Max runtime.
            if a.runtime_deadline.is_some_and(|d| now >= d)
                && a.meta.cancel.is_none()
                && !a.finished()
            {
                log::warn!(
                    "{} {} exceeded its max runtime; cancelling",
                    a.meta.kind,
                    shown(&a.meta.request_id_text())
                );
                if let Some(a) = self.active.get_mut(&id) {
                    a.runtime_deadline = None;
                }
                let _ = self.cancel(
                    &id,
                    libc::SIGTERM,
                    "SIGTERM",
                    DEFAULT_GRACE,
                    true,
                    now,
                    w,
                    fx,
                );
                continue;
            }
            // Deadlines of its phase (escalation, drain limit).
            if a.phase.deadline().is_some_and(|t| now >= t) {
                self.advance(&id, Event::Tick, now, w, fx);
            }
            let Some(a) = self.active.get(&id) else {
                continue;
            };
            match &a.phase {
                Phase::Draining { .. } if drained.contains(&id) => {
                    self.advance(&id, Event::LogsDrained, now, w, fx);
                }
                Phase::Lingering { .. } if now >= a.next_check => {
                    let gone = w.provable_group(&a.meta).is_none();
                    if let Some(a) = self.active.get_mut(&id) {
                        a.next_check = crate::util::later(now, LINGER_CHECK);
                    }
                    if gone {
                        self.advance(&id, Event::GroupEmpty, now, w, fx);
                    }
                }
                Phase::Running | Phase::Cancelling { .. } if now >= a.supervisor_check => {
                    self.check_supervisor(&id, now, w, fx);
                }
                _ => {}
            }
        }
    }

    /// D66: a workload can stop its own supervisor (same uid) and then end: nothing reaps it
    /// then, and the supervisor's end, which reports it, never comes. A stopped supervisor whose
    /// workload has nothing left but zombies gets SIGCONT, then reaps and reports it as usual;
    /// found stopped again with nothing left, the workload counts as ended (reported once). A
    /// workload that still runs keeps its supervisor as it is: it is running.
    fn check_supervisor(&mut self, id: &str, now: Instant, w: &mut dyn World, fx: &mut Fx) {
        let Some(a) = self.active.get_mut(id) else {
            return;
        };
        a.supervisor_check = crate::util::later(now, SUPERVISOR_CHECK);
        if !w.supervisor_stopped(&a.meta) || w.provable_group(&a.meta).is_some() {
            return;
        }
        let (kind, rid, shim) = (
            a.meta.kind,
            a.meta.request_id_text(),
            a.meta.started.as_ref().map_or(0, |s| s.shim_pid),
        );
        let rid = shown(&rid);
        if !a.continued {
            a.continued = true;
            log::warn!(
                "the supervisor of {kind} {rid} (pid {shim}) is stopped and nothing of its workload runs any more; SIGCONT to it, so that it reaps and reports the workload"
            );
            if let Err(e) = w.continue_supervisor(&a.meta) {
                log::warn!("cannot continue the supervisor of {rid} (pid {shim}): {e}");
            }
            return;
        }
        log::error!(
            "the supervisor of {kind} {rid} (pid {shim}) is stopped again and nothing of its workload runs any more; reporting its end"
        );
        let event = match w.exit_record(id) {
            Some(exit) => Event::SupervisorEnded {
                exit: Some(exit),
                group_alive: false,
            },
            None => Event::Lost {
                exit: None,
                reason: SUPERVISOR_STOPPED,
            },
        };
        self.advance(id, event, now, w, fx);
    }
}

#[cfg(test)]
pub(crate) mod fake {
    //! A [`World`] whose processes are a few sets, and the readings of a table's effects.

    use std::collections::{BTreeMap, BTreeSet};

    use super::*;
    use crate::protocol::commands::TopicId;
    use crate::workers::Job;

    #[derive(Default)]
    pub struct FakeProcs {
        /// Safe ids whose group is provably theirs (group = pid).
        pub provable: BTreeSet<String>,
        pub exits: BTreeMap<String, Exit>,
        pub signals: Vec<(i32, i32)>,
        /// Safe ids whose supervisor is stopped.
        pub stopped: BTreeSet<String>,
        /// Safe ids whose supervisor got SIGCONT.
        pub continued: Vec<String>,
    }

    impl World for FakeProcs {
        fn provable_group(&self, meta: &Meta) -> Option<i32> {
            self.provable.contains(&meta.safe_id).then(|| meta.pid())
        }
        fn signal_group(&mut self, group: i32, sig: i32) -> std::io::Result<()> {
            self.signals.push((group, sig));
            Ok(())
        }
        fn exit_record(&self, id: &str) -> Option<Exit> {
            self.exits.get(id).cloned()
        }
        fn supervisor_stopped(&self, meta: &Meta) -> bool {
            self.stopped.contains(&meta.safe_id)
        }
        fn continue_supervisor(&mut self, meta: &Meta) -> std::io::Result<()> {
            self.continued.push(meta.safe_id.clone());
            Ok(())
        }
    }

    /// A request the table asked for, as the tests read it.
    #[derive(Debug, Clone, PartialEq)]
    pub enum Asked {
        /// R9: a signed URL for one result file of workload `id`.
        SignedUrl {
            id: String,
            wl: TopicId,
            filename: String,
        },
        /// R10: the backend is told which result files were uploaded.
        UploadResults {
            id: String,
            wl: TopicId,
            body: Value,
        },
    }

    /// The fake world and every effect the table asked for so far.
    #[derive(Default)]
    pub struct FakeWorld {
        pub w: FakeProcs,
        pub fx: Fx,
    }

    impl FakeWorld {
        fn each<T>(&self, f: impl FnMut(&Effect) -> Option<T>) -> Vec<T> {
            self.fx.list.iter().filter_map(f).collect()
        }
        pub fn saved(&self) -> Vec<String> {
            self.each(|e| match e {
                Effect::SaveMeta { meta, .. } => Some(meta.safe_id.clone()),
                _ => None,
            })
        }
        pub fn statuses(&self) -> Vec<(String, Value)> {
            self.each(|e| match e {
                Effect::WorkloadStatus { wl, body } => Some((wl.to_string(), body.clone())),
                _ => None,
            })
        }
        pub fn requests(&self) -> Vec<Asked> {
            self.each(|e| match e {
                Effect::AskSignedUrl { id, wl, filename } => Some(Asked::SignedUrl {
                    id: id.clone(),
                    wl: wl.clone(),
                    filename: filename.clone(),
                }),
                Effect::TellUploaded { id, wl, body } => Some(Asked::UploadResults {
                    id: id.clone(),
                    wl: wl.clone(),
                    body: body.clone(),
                }),
                _ => None,
            })
        }
        pub fn jobs(&self) -> Vec<&Job> {
            self.fx
                .list
                .iter()
                .filter_map(|e| match e {
                    Effect::Submit(j) => Some(j),
                    _ => None,
                })
                .collect()
        }
        pub fn shipped(&self) -> usize {
            self.each(|e| matches!(e, Effect::ShipLogs).then_some(()))
                .len()
        }
        pub fn reports(&self) -> Vec<(String, Option<Exit>, Option<&'static str>)> {
            self.each(|e| match e {
                Effect::Report { id, exit, lost, .. } => Some((id.clone(), exit.clone(), *lost)),
                _ => None,
            })
        }
        pub fn not_uploaded(&self) -> Vec<(String, Vec<String>)> {
            self.each(|e| match e {
                Effect::Report { id, left, .. } => Some((id.clone(), left.not_uploaded.clone())),
                _ => None,
            })
        }
        pub fn retired(&self) -> Vec<String> {
            self.each(|e| match e {
                Effect::Retire(id) => Some(id.clone()),
                _ => None,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::{Asked, FakeWorld};
    use super::*;
    use crate::workers::Job;
    use crate::workload::shim::Started;

    const TERM: i32 = libc::SIGTERM;
    const KILL: i32 = libc::SIGKILL;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    fn cfg(folder: PathBuf) -> UploadCfg {
        UploadCfg {
            enabled: true,
            records: folder.with_extension("records"),
            ledger: folder.with_extension("ledger.json"),
            folder,
            max_bytes: 1 << 30,
            workers: 2,
            checked: None,
            deadline: None,
        }
    }

    fn meta(id: &str, pid: i32, max_runtime_s: Option<f64>) -> Meta {
        Meta {
            safe_id: id.into(),
            kind: crate::protocol::commands::Kind::Training.into(),
            request_id: Value::String(id.into()),
            workload_uuid: crate::protocol::commands::TopicId::new(
                "workload_uuid",
                &format!("wl-{id}"),
            )
            .ok(),
            created_unix: workload::unix_now(),
            command: "true".into(),
            stdout_log: PathBuf::from("/nonexistent/out.log"),
            stderr_log: PathBuf::from("/nonexistent/err.log"),
            max_runtime_s,
            started: Some(Started {
                pid,
                start_ticks: 1,
                shim_pid: pid.saturating_sub(1),
                shim_start_ticks: 1,
                boot_id: "boot".into(),
                started_at: String::new(),
            }),
            cancel: None,
            workflow: None,
            event_token: String::new(),
            gpus: None,
            uid: None,
            salvaged: None,
        }
    }

    fn exit(code: i32) -> Exit {
        Exit {
            exit_code: Some(code),
            signal: None,
            started_at: String::new(),
            ended_at: String::new(),
        }
    }

    /// A table with one running child workload "w" (pid 100, supervisor 99) whose group is
    /// provably its own, and no results folder.
    fn one(t0: Instant, max_runtime_s: Option<f64>) -> (Table, FakeWorld) {
        let mut t = Table::new(cfg(PathBuf::from("/nonexistent/results")));
        t.insert("w".into(), Active::new(meta("w", 100, max_runtime_s), t0));
        let mut f = FakeWorld::default();
        f.w.provable.insert("w".into());
        f.fx.connected = true;
        (t, f)
    }

    fn cancel(t: &mut Table, f: &mut FakeWorld, sig: i32, grace_ms: u64, now: Instant) -> String {
        let name = if sig == KILL { "SIGKILL" } else { "SIGTERM" };
        t.cancel(
            "w",
            sig,
            name,
            Duration::from_millis(grace_ms),
            false,
            now,
            &mut f.w,
            &mut f.fx,
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_cancel_signals_the_group_and_escalates_exactly_at_its_deadline() {
        let t0 = Instant::now();
        let (mut t, mut f) = one(t0, None);
        let msg = cancel(&mut t, &mut f, TERM, 1000, t0);
        assert_eq!(msg, "Workload cancelled with SIGTERM");
        assert_eq!(f.w.signals, vec![(100, TERM)]);
        assert_eq!(f.saved(), vec!["w".to_string()], "the cancel is recorded");
        assert_eq!(t.next_due(), Some(at(t0, 1000)));
        t.tick(at(t0, 999), &[], &mut f.w, &mut f.fx);
        assert_eq!(f.w.signals.len(), 1, "nothing before the deadline");
        t.tick(at(t0, 1000), &[], &mut f.w, &mut f.fx);
        assert_eq!(f.w.signals, vec![(100, TERM), (100, KILL)]);
        t.tick(at(t0, 5000), &[], &mut f.w, &mut f.fx);
        assert_eq!(f.w.signals.len(), 2, "SIGKILL goes once");
        assert_eq!(t.next_due(), None, "no deadline left to spin on");
    }

    #[test]
    fn a_second_cancel_neither_signals_again_nor_pushes_the_escalation() {
        let t0 = Instant::now();
        let (mut t, mut f) = one(t0, None);
        cancel(&mut t, &mut f, TERM, 1000, t0);
        let msg = cancel(&mut t, &mut f, TERM, 10_000, at(t0, 600));
        assert!(
            msg.contains("already being cancelled with SIGTERM"),
            "{msg}"
        );
        assert_eq!(f.w.signals, vec![(100, TERM)]);
        assert_eq!(t.next_due(), Some(at(t0, 1000)), "the original deadline");
        t.tick(at(t0, 1000), &[], &mut f.w, &mut f.fx);
        assert_eq!(f.w.signals, vec![(100, TERM), (100, KILL)]);
    }

    #[test]
    fn a_sigkill_asked_for_while_cancelling_goes_out_at_once_and_the_deadline_stays() {
        let t0 = Instant::now();
        let (mut t, mut f) = one(t0, None);
        cancel(&mut t, &mut f, TERM, 1000, t0);
        let msg = cancel(&mut t, &mut f, KILL, 0, at(t0, 10));
        assert!(msg.contains("SIGKILL sent"), "{msg}");
        assert_eq!(f.w.signals, vec![(100, TERM), (100, KILL)]);
        assert_eq!(t.next_due(), Some(at(t0, 1000)));
    }

    #[test]
    fn the_max_runtime_cancels_with_sigterm_then_escalates_after_the_default_grace() {
        let t0 = Instant::now();
        let (mut t, mut f) = one(t0, Some(2.0));
        let due = t.next_due().unwrap_or_else(|| panic!("a runtime deadline"));
        assert!(due > at(t0, 1900) && due <= at(t0, 2000), "{due:?}");
        t.tick(at(t0, 1000), &[], &mut f.w, &mut f.fx);
        assert!(f.w.signals.is_empty());
        t.tick(due, &[], &mut f.w, &mut f.fx);
        assert_eq!(f.w.signals, vec![(100, TERM)]);
        let a = t.get("w").unwrap_or_else(|| panic!("tracked"));
        assert!(a.meta.cancel.as_ref().is_some_and(|c| c.timed_out));
        let kill_at = due + DEFAULT_GRACE;
        assert_eq!(t.next_due(), Some(kill_at), "only the escalation is due");
        t.tick(kill_at - Duration::from_millis(1), &[], &mut f.w, &mut f.fx);
        assert_eq!(f.w.signals.len(), 1);
        t.tick(kill_at, &[], &mut f.w, &mut f.fx);
        assert_eq!(f.w.signals, vec![(100, TERM), (100, KILL)]);
    }

    #[test]
    fn a_cancel_after_the_exit_is_answered_already_finished_and_signals_nothing() {
        let t0 = Instant::now();
        let (mut t, mut f) = one(t0, None);
        f.w.exits.insert("w".into(), exit(0));
        // The supervisor ends with the group gone; the pid could be anyone's now.
        f.w.provable.clear();
        t.on_reaped("w", at(t0, 5), &mut f.w, &mut f.fx);
        assert_eq!(f.shipped(), 1, "its logs are shipped");
        f.w.provable.insert("w".into()); // even a group that looks like it is not signalled
        let msg = cancel(&mut t, &mut f, TERM, 1000, at(t0, 10));
        assert_eq!(
            msg,
            "Workload already finished; its completion reports how it ended"
        );
        assert!(f.w.signals.is_empty());
        assert!(t.get("w").is_some_and(|a| a.meta.cancel.is_none()));
        // Its logs drain: reported once, as the success it was (no results to upload).
        t.tick(at(t0, 20), &["w".to_string()], &mut f.w, &mut f.fx);
        assert_eq!(f.reports(), vec![("w".to_string(), Some(exit(0)), None)]);
        assert!(t.is_empty());
    }

    #[test]
    fn a_group_that_can_no_longer_be_proven_is_never_signalled() {
        let t0 = Instant::now();
        let (mut t, mut f) = one(t0, Some(1.0));
        f.w.provable.clear();
        let msg = cancel(&mut t, &mut f, TERM, 1000, t0);
        assert_eq!(msg, "Process 100 was already terminated");
        assert!(t.get("w").is_some_and(|a| a.phase == Phase::Running));
        // Nor by the max runtime, nor by an escalation whose group vanished meanwhile.
        t.tick(at(t0, 1000), &[], &mut f.w, &mut f.fx);
        assert!(f.w.signals.is_empty());
        let (mut t, mut f) = one(t0, None);
        cancel(&mut t, &mut f, TERM, 1000, t0);
        f.w.provable.clear();
        t.tick(at(t0, 1000), &[], &mut f.w, &mut f.fx);
        assert_eq!(
            f.w.signals,
            vec![(100, TERM)],
            "no SIGKILL to a group not proven"
        );
    }

    #[test]
    fn a_killed_supervisor_lingers_counted_then_is_reported_lost_when_its_group_empties() {
        let t0 = Instant::now();
        let (mut t, mut f) = one(t0, None);
        t.on_reaped("w", at(t0, 1), &mut f.w, &mut f.fx); // no exit record, group alive
        assert!(matches!(
            t.get("w").map(|a| &a.phase),
            Some(Phase::Lingering { .. })
        ));
        assert_eq!(t.len(), 1, "still counted");
        assert_eq!(t.next_due(), Some(t0), "its group is checked");
        t.tick(at(t0, 2), &[], &mut f.w, &mut f.fx);
        assert!(f.reports().is_empty(), "its group still runs");
        assert_eq!(t.next_due(), Some(at(t0, 252)));
        cancel(&mut t, &mut f, TERM, 1000, at(t0, 100));
        assert_eq!(
            f.w.signals,
            vec![(100, TERM)],
            "cancellable while it lingers"
        );
        f.w.provable.clear();
        t.tick(at(t0, 252), &[], &mut f.w, &mut f.fx);
        t.tick(at(t0, 253), &["w".to_string()], &mut f.w, &mut f.fx);
        assert_eq!(
            f.reports(),
            vec![("w".to_string(), None, Some(lifecycle::SUPERVISOR_KILLED))]
        );
        assert_eq!(f.w.signals.len(), 1, "no SIGKILL to an empty group");
    }

    /// Fresh or re-adopted, a running workload has no timer of its own (the reaper thread says
    /// when its supervisor ends); one that ended without a record and left nothing is lost, and
    /// an end reported for a workload the table does not track changes nothing.
    #[test]
    fn a_supervisor_that_ended_without_a_record_is_lost_and_nothing_is_polled() {
        let t0 = Instant::now();
        let mut t = Table::new(cfg(PathBuf::from("/nonexistent/results")));
        let mut f = FakeWorld::default();
        t.insert("w".into(), Active::new(meta("w", 100, None), t0));
        assert_eq!(t.next_due(), None, "nothing to poll while it runs");
        t.on_reaped("x", t0, &mut f.w, &mut f.fx);
        assert_eq!(t.get("w").map(|a| &a.phase), Some(&Phase::Running));
        t.on_reaped("w", at(t0, 1), &mut f.w, &mut f.fx);
        assert!(matches!(
            t.get("w").map(|a| &a.phase),
            Some(Phase::Draining { lost: Some(_), .. })
        ));
        assert!(f.reports().is_empty() && f.w.signals.is_empty());
    }

    #[test]
    fn every_tracked_workload_counts_against_capacity_until_it_is_reported() {
        let t0 = Instant::now();
        let (mut t, mut f) = one(t0, None);
        t.insert("v".into(), Active::new(meta("v", 200, None), t0));
        f.w.provable.insert("v".into());
        cancel(&mut t, &mut f, TERM, 1000, t0);
        assert_eq!(t.len(), 2, "running and cancelling count");
        f.w.exits.insert("w".into(), exit(0));
        f.w.provable.remove("w");
        t.on_reaped("w", at(t0, 1), &mut f.w, &mut f.fx);
        assert!(t.get("w").is_some_and(Active::finished));
        assert_eq!(
            t.len(),
            2,
            "an exited workload holds its slot while it drains"
        );
        t.tick(at(t0, 2), &["w".to_string()], &mut f.w, &mut f.fx);
        assert_eq!(t.len(), 1, "reported: the slot is free");
        assert_eq!(t.uploading(), 0);
    }

    #[test]
    fn a_completion_the_disk_refused_keeps_its_record_until_the_ack() {
        let t0 = Instant::now();
        let (mut t, mut f) = one(t0, None);
        f.fx.list.extend(t.completion_queued("w", Some(7)));
        assert!(
            f.retired().is_empty(),
            "the record stays while only memory holds it"
        );
        f.fx.list.extend(t.acknowledged(6));
        assert!(
            f.retired().is_empty(),
            "another message's ack changes nothing"
        );
        f.fx.list.extend(t.acknowledged(7));
        assert_eq!(f.retired(), vec!["w".to_string()]);
        f.fx.list.extend(t.acknowledged(7));
        assert_eq!(f.retired().len(), 1, "retired once");
        f.fx.list.extend(t.completion_queued("v", None));
        assert_eq!(f.retired(), vec!["w".to_string(), "v".to_string()]);
    }

    /// A results folder of its own for one test, with workload `w`'s files in it.
    fn results(tag: &str, files: &[&str]) -> PathBuf {
        let root = std::env::temp_dir().join(format!("cw-table-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for f in files {
            let p = root.join("w").join(f);
            std::fs::create_dir_all(p.parent().unwrap_or(&root)).unwrap_or_else(|e| panic!("{e}"));
            std::fs::write(&p, f.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
        }
        root
    }

    /// Workload `w` exited 0 with its logs shipped: its uploads begin at `now`.
    fn exited_ok(root: &std::path::Path, connected: bool, now: Instant) -> (Table, FakeWorld) {
        let mut t = Table::new(cfg(root.to_path_buf()));
        t.insert("w".into(), Active::new(meta("w", 100, None), now));
        let mut f = FakeWorld::default();
        f.fx.connected = connected;
        f.w.exits.insert("w".into(), exit(0));
        t.on_reaped("w", now, &mut f.w, &mut f.fx);
        t.tick(now, &["w".to_string()], &mut f.w, &mut f.fx);
        (t, f)
    }

    fn signed(name: &str) -> Value {
        serde_json::json!({"signed_url": format!("http://store/{name}"), "filename": format!("att-{name}")})
    }

    fn last_signed_url_request(f: &FakeWorld) -> Option<String> {
        match f.requests().last().cloned() {
            Some(Asked::SignedUrl { filename, .. }) => Some(filename.clone()),
            _ => None,
        }
    }

    #[test]
    fn a_failing_upload_is_retried_after_2_s_and_4_s_given_up_after_three_attempts_and_reported_once(
    ) {
        let t0 = Instant::now();
        let root = results("retry", &["a.txt", "b.txt"]);
        let (mut t, mut f) = exited_ok(&root, true, t0);
        assert_eq!(f.statuses().len(), 1);
        assert_eq!(f.statuses()[0].1["status"], "finalizing");
        assert_eq!(f.statuses()[0].1["file_count"], 2);
        assert_eq!(t.uploading(), 1);
        assert_eq!(t.get("w").map(Active::state), Some("finalizing"));
        // a.txt's URL first; b.txt's is asked for while a.txt is sent, and with two upload
        // workers b.txt goes beside it.
        assert_eq!(last_signed_url_request(&f).as_deref(), Some("a.txt"));
        t.on_signed_url_reply("w", Some(signed("a.txt")), t0, &mut f.w, &mut f.fx);
        assert!(matches!(
            f.jobs().last().copied(),
            Some(Job::Put { file: 0, .. })
        ));
        assert_eq!(
            last_signed_url_request(&f).as_deref(),
            Some("b.txt"),
            "the next URL while a.txt is sent"
        );
        t.on_signed_url_reply("w", Some(signed("b.txt")), t0, &mut f.w, &mut f.fx);
        assert!(matches!(
            f.jobs().last().copied(),
            Some(Job::Put { file: 1, .. })
        ));
        let ok = Done::Put {
            key: "w".into(),
            file: 1,
            result: Ok(()),
        };
        t.on_worker_done(ok, t0, &mut f.w, &mut f.fx);
        // Three attempts at a.txt, each PUT refused with a retriable error.
        let mut asked = vec![t0];
        let mut now = t0;
        for attempt in 1..=3u64 {
            if attempt > 1 {
                assert_eq!(last_signed_url_request(&f).as_deref(), Some("a.txt"));
                asked.push(now);
                t.on_signed_url_reply("w", Some(signed("a.txt")), now, &mut f.w, &mut f.fx);
                assert!(matches!(
                    f.jobs().last().copied(),
                    Some(Job::Put { file: 0, .. })
                ));
            }
            now += Duration::from_millis(100);
            let done = Done::Put {
                key: "w".into(),
                file: 0,
                result: Err(crate::backend::BackendError::Status {
                    status: 503,
                    detail: "HTTP 503".into(),
                }),
            };
            t.on_worker_done(done, now, &mut f.w, &mut f.fx);
            if attempt < 3 {
                let wait = Duration::from_secs(2 << (attempt - 1));
                assert_eq!(t.next_due(), Some(now + wait), "attempt {attempt}");
                let before = f.requests().len();
                t.tick(
                    now + wait - Duration::from_millis(1),
                    &[],
                    &mut f.w,
                    &mut f.fx,
                );
                assert_eq!(f.requests().len(), before, "no retry before its time");
                now += wait;
                t.tick(now, &[], &mut f.w, &mut f.fx);
                assert_eq!(f.requests().len(), before + 1, "retried at its time");
            }
        }
        assert_eq!(asked, vec![t0, at(t0, 2100), at(t0, 6200)]);
        // Given up on a.txt: the backend is told of b.txt alone.
        let Some(Asked::UploadResults { body, .. }) = f.requests().last().cloned() else {
            panic!("R10 expected: {:?}", f.requests());
        };
        assert_eq!(body["filenames"], serde_json::json!(["b.txt"]));
        assert_eq!(body["attachment_uuids"], serde_json::json!(["att-b"]));
        assert!(f.reports().is_empty(), "not before the backend knows");
        t.on_upload_reply("w", true, now, &mut f.w, &mut f.fx);
        assert_eq!(f.reports(), vec![("w".to_string(), Some(exit(0)), None)]);
        assert!(root.join("w/a.txt").exists(), "a file not uploaded stays");
        assert_eq!(
            f.not_uploaded(),
            vec![("w".to_string(), vec!["a.txt".to_string()])],
            "and its completion names it"
        );
        assert!(
            !root.join("w/b.txt").exists(),
            "an uploaded file is deleted"
        );
        // Late answers change nothing.
        t.on_upload_reply("w", true, now, &mut f.w, &mut f.fx);
        t.tick(now + Duration::from_secs(60), &[], &mut f.w, &mut f.fx);
        assert_eq!(f.reports().len(), 1);
        assert!(t.is_empty());
        let _ = std::fs::remove_dir_all(&root);
    }

    /// Never more transfers at once than the pool holds, the next file's URL in hand
    /// while they are sent, and a second workload always gets one of its own at once.
    #[test]
    fn one_workloads_files_share_the_pool_without_keeping_another_workload_waiting() {
        let t0 = Instant::now();
        let root = results("pool", &["a", "b", "c", "d"]);
        std::fs::create_dir_all(root.join("v")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(root.join("v/x"), b"x").unwrap_or_else(|e| panic!("{e}"));
        let mut t = Table::new(cfg(root.clone()));
        t.insert("w".into(), Active::new(meta("w", 100, None), t0));
        t.insert("v".into(), Active::new(meta("v", 200, None), t0));
        let mut f = FakeWorld::default();
        f.fx.connected = true;
        f.w.exits.insert("w".into(), exit(0));
        f.w.exits.insert("v".into(), exit(0));
        t.on_reaped("w", t0, &mut f.w, &mut f.fx);
        t.tick(t0, &["w".to_string()], &mut f.w, &mut f.fx);
        let puts = |f: &FakeWorld, id: &str| {
            f.jobs()
                .iter()
                .filter(|j| matches!(j, Job::Put { key, .. } if key == id))
                .count()
        };
        for name in ["a", "b", "c"] {
            assert_eq!(last_signed_url_request(&f).as_deref(), Some(name));
            t.on_signed_url_reply("w", Some(signed(name)), t0, &mut f.w, &mut f.fx);
        }
        assert_eq!(puts(&f, "w"), 2, "two workers: two transfers, c waits");
        assert_eq!(
            f.requests().len(),
            3,
            "one URL in hand beyond the transfers"
        );
        // v ends while w holds both workers: it still sends its file at once.
        t.on_reaped("v", t0, &mut f.w, &mut f.fx);
        t.tick(t0, &["v".to_string()], &mut f.w, &mut f.fx);
        assert_eq!(last_signed_url_request(&f).as_deref(), Some("x"));
        t.on_signed_url_reply("v", Some(signed("x")), t0, &mut f.w, &mut f.fx);
        assert_eq!(puts(&f, "v"), 1);
        // One of w's transfers ends: c takes its place only when a worker is idle.
        let ok = |file| Done::Put {
            key: "w".into(),
            file,
            result: Ok(()),
        };
        t.on_worker_done(ok(0), t0, &mut f.w, &mut f.fx);
        assert_eq!(puts(&f, "w"), 2, "w:1 + v:1 fill the pool");
        assert_eq!(last_signed_url_request(&f).as_deref(), Some("d"));
        t.on_worker_done(
            Done::Put {
                key: "v".into(),
                file: 0,
                result: Ok(()),
            },
            t0,
            &mut f.w,
            &mut f.fx,
        );
        assert_eq!(puts(&f, "w"), 3, "a worker is free: c goes");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn uploads_without_the_broker_go_through_the_workers_and_clean_up_after_themselves() {
        let t0 = Instant::now();
        let root = results("rest", &["a.txt", "sub/b.txt"]);
        let (mut t, mut f) = exited_ok(&root, false, t0);
        assert!(
            f.requests().is_empty(),
            "no MQTT request while disconnected"
        );
        for (i, name) in ["a.txt", "sub/b.txt"].into_iter().enumerate() {
            let Some(Job::SignedUrl { filename, .. }) = f.jobs().last().copied() else {
                panic!("E8 expected: {:?}", f.jobs().len());
            };
            assert_eq!(filename, name);
            let attachment = crate::backend::parse_signed_url(&signed("x.txt"))
                .unwrap_or_else(|e| panic!("{e}"));
            let done = Done::SignedUrl {
                key: "w".into(),
                result: Ok(attachment),
            };
            t.on_worker_done(done, t0, &mut f.w, &mut f.fx);
            let put = f.jobs().into_iter().find_map(|j| match j {
                Job::Put { file, path, .. } if *file == i => Some(path.clone()),
                _ => None,
            });
            assert_eq!(
                put.map(|p| p.path()),
                Some(root.join("w").join(name)),
                "PUT expected"
            );
        }
        for i in [1, 0] {
            let ok = Done::Put {
                key: "w".into(),
                file: i,
                result: Ok(()),
            };
            t.on_worker_done(ok, t0, &mut f.w, &mut f.fx);
        }
        assert!(matches!(
            f.jobs().last().copied(),
            Some(Job::UploadResults { .. })
        ));
        let told = Done::UploadResults {
            key: "w".into(),
            result: Ok(()),
        };
        t.on_worker_done(told, t0, &mut f.w, &mut f.fx);
        assert_eq!(f.reports().len(), 1);
        assert!(!root.join("w").exists(), "files and folders removed");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_stale_workload_is_terminated_and_marked_so_its_end_is_not_reported_as_a_cancel() {
        let t0 = Instant::now();
        let (mut t, mut f) = one(t0, None);
        t.cancel_stale("w", Duration::from_millis(500), t0, &mut f.w, &mut f.fx)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.w.signals, vec![(100, TERM)]);
        assert!(t
            .get("w")
            .and_then(|a| a.meta.cancel.as_ref())
            .is_some_and(|c| c.stale && !c.timed_out));
        assert_eq!(
            f.saved().len(),
            2,
            "the cancel, then the stale mark, are recorded"
        );
        assert_eq!(t.next_due(), Some(at(t0, 500)));
    }

    #[test]
    fn a_rebuilt_record_is_reported_lost_whatever_its_exit_said() {
        let t0 = Instant::now();
        let mut t = Table::new(cfg(PathBuf::from("/nonexistent/results")));
        let mut m = meta("w", 100, None);
        m.salvaged = Some("bad json".into());
        t.insert("w".into(), Active::new(m, t0));
        let mut f = FakeWorld::default();
        f.w.exits.insert("w".into(), exit(0));
        t.on_reaped("w", t0, &mut f.w, &mut f.fx);
        t.tick(at(t0, 1), &["w".to_string()], &mut f.w, &mut f.fx);
        assert_eq!(
            f.reports(),
            vec![("w".to_string(), Some(exit(0)), Some(SALVAGED))]
        );
        // At recovery the same: `end` with no reason still reports it lost.
        let mut m = meta("v", 200, None);
        m.salvaged = Some("bad json".into());
        t.insert("v".into(), Active::new(m, t0));
        t.end("v", None, None, at(t0, 2), &mut f.w, &mut f.fx);
        t.tick(at(t0, 3), &["v".to_string()], &mut f.w, &mut f.fx);
        assert_eq!(
            f.reports().get(1),
            Some(&("v".to_string(), None, Some(SALVAGED)))
        );
    }

    /// D68: a workload's uploads have one deadline as a whole. Past it (an endpoint that never
    /// answers), the files not uploaded stay on disk, the completion names them and goes out,
    /// and a late answer changes nothing; each transfer is bounded by the same deadline.
    #[test]
    fn d68_uploads_past_their_deadline_are_abandoned_and_the_completion_names_what_is_left() {
        let t0 = Instant::now();
        let root = results("deadline", &["a.txt", "b.txt", "c.txt"]);
        let mut c = cfg(root.clone());
        c.deadline = Some(Duration::from_secs(10));
        let mut t = Table::new(c);
        t.insert("w".into(), Active::new(meta("w", 100, None), t0));
        let mut f = FakeWorld::default();
        f.fx.connected = true;
        f.w.exits.insert("w".into(), exit(0));
        t.on_reaped("w", t0, &mut f.w, &mut f.fx);
        t.tick(t0, &["w".to_string()], &mut f.w, &mut f.fx);
        assert_eq!(t.get("w").map(Active::state), Some("finalizing"));
        t.on_signed_url_reply("w", Some(signed("a.txt")), t0, &mut f.w, &mut f.fx);
        let Some(Job::Put { until, .. }) = f.jobs().last().copied() else {
            panic!("a transfer: {:?}", f.jobs());
        };
        assert_eq!(
            *until,
            at(t0, 10_000),
            "the transfer is bounded by the deadline"
        );
        // The endpoint hangs: no answer comes.
        assert_eq!(t.next_due(), Some(at(t0, 10_000)), "the loop wakes for it");
        t.tick(at(t0, 9_999), &[], &mut f.w, &mut f.fx);
        assert!(f.reports().is_empty(), "not before the deadline");
        t.tick(at(t0, 10_000), &[], &mut f.w, &mut f.fx);
        assert_eq!(f.reports(), vec![("w".to_string(), Some(exit(0)), None)]);
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            f.not_uploaded(),
            vec![("w".to_string(), names(&["a.txt", "b.txt", "c.txt"]))]
        );
        for name in ["a.txt", "b.txt", "c.txt"] {
            assert!(root.join("w").join(name).exists(), "{name} stays on disk");
        }
        assert!(t.is_empty(), "its slot is free");
        assert_eq!(t.next_due(), None);
        // The transfer's late answer, a late URL: nothing more.
        let late = Done::Put {
            key: "w".into(),
            file: 0,
            result: Ok(()),
        };
        t.on_worker_done(late, at(t0, 20_000), &mut f.w, &mut f.fx);
        t.on_signed_url_reply(
            "w",
            Some(signed("b.txt")),
            at(t0, 20_000),
            &mut f.w,
            &mut f.fx,
        );
        assert_eq!(f.reports().len(), 1, "reported once");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn d68_the_default_upload_deadline_is_half_an_hour_and_a_second_per_mib() {
        use crate::node::uploads::deadline_for;
        let s = Duration::from_secs;
        assert_eq!(deadline_for(None, 0), s(1800));
        assert_eq!(deadline_for(None, 1), s(1801));
        assert_eq!(deadline_for(None, 5 * 1024 * 1024), s(1805));
        assert_eq!(deadline_for(None, u64::MAX), s(1800 + (u64::MAX >> 20) + 1));
        assert_eq!(
            deadline_for(Some(s(3)), 1 << 40),
            s(3),
            "the operator's, whole"
        );
    }

    /// D68: a cancel of a finalizing workload abandons its uploads at once: answered so, the
    /// completion goes out now, naming the files left on disk; nothing is signalled.
    #[test]
    fn d68_a_cancel_of_a_finalizing_workload_abandons_its_uploads_at_once() {
        let t0 = Instant::now();
        let root = results("cancel-up", &["a.txt", "b.txt"]);
        let (mut t, mut f) = exited_ok(&root, true, t0);
        assert_eq!(t.get("w").map(Active::state), Some("finalizing"));
        f.w.provable.insert("w".into()); // even a group that looks alive is not signalled
        let msg = cancel(&mut t, &mut f, TERM, 1000, at(t0, 5));
        assert!(
            msg.contains("result uploads were abandoned: 2 file(s)"),
            "{msg}"
        );
        assert!(f.w.signals.is_empty());
        assert_eq!(f.reports(), vec![("w".to_string(), Some(exit(0)), None)]);
        assert_eq!(
            f.not_uploaded(),
            vec![(
                "w".to_string(),
                vec!["a.txt".to_string(), "b.txt".to_string()]
            )]
        );
        assert!(root.join("w/a.txt").exists() && root.join("w/b.txt").exists());
        assert!(t.is_empty());
        let _ = std::fs::remove_dir_all(&root);
    }

    /// D66: a workload that stops its own supervisor and ends leaves it unable to reap and
    /// report it. The supervisor gets SIGCONT (once), and found stopped again with nothing of
    /// the workload left, the workload counts as ended: reported once. A supervisor stopped
    /// while its workload still runs is left as it is.
    #[test]
    fn d66_a_stopped_supervisor_whose_workload_ended_is_continued_then_the_workload_counts_as_ended(
    ) {
        let t0 = Instant::now();
        let (mut t, mut f) = one(t0, None);
        f.w.stopped.insert("w".into());
        t.tick(t0, &[], &mut f.w, &mut f.fx);
        assert!(f.w.continued.is_empty(), "its workload still runs");
        f.w.provable.clear(); // only zombies left
        t.tick(at(t0, 500), &[], &mut f.w, &mut f.fx);
        assert!(f.w.continued.is_empty(), "looked at once a second");
        t.tick(at(t0, 1000), &[], &mut f.w, &mut f.fx);
        assert_eq!(
            f.w.continued,
            vec!["w".to_string()],
            "SIGCONT to the supervisor"
        );
        assert!(f.w.signals.is_empty(), "nothing to the workload's group");
        assert_eq!(t.get("w").map(Active::state), Some("running"));
        // Stopped again (a leftover of the workload stops it): counts as ended.
        t.tick(at(t0, 2000), &[], &mut f.w, &mut f.fx);
        assert_eq!(f.w.continued.len(), 1, "continued once");
        assert!(matches!(
            t.get("w").map(|a| &a.phase),
            Some(Phase::Draining {
                lost: Some(SUPERVISOR_STOPPED),
                ..
            })
        ));
        t.tick(at(t0, 2001), &["w".to_string()], &mut f.w, &mut f.fx);
        assert_eq!(
            f.reports(),
            vec![("w".to_string(), None, Some(SUPERVISOR_STOPPED))]
        );
        // Its supervisor's end, when it comes, reports nothing more.
        t.on_reaped("w", at(t0, 3000), &mut f.w, &mut f.fx);
        assert_eq!(f.reports().len(), 1);
        // One that wrote its exit record before it was stopped again is reported with it.
        let (mut t, mut f) = one(t0, None);
        f.w.stopped.insert("w".into());
        f.w.provable.clear();
        t.tick(t0, &[], &mut f.w, &mut f.fx);
        f.w.exits.insert("w".into(), exit(0));
        t.tick(at(t0, 1000), &[], &mut f.w, &mut f.fx);
        t.tick(at(t0, 1001), &["w".to_string()], &mut f.w, &mut f.fx);
        assert_eq!(f.reports(), vec![("w".to_string(), Some(exit(0)), None)]);
    }
}
