//! The spawner: starts workloads off the node's loop (DESIGN §1) and reports each start back as
//! one [`Outcome`] on a channel the loop selects on. The loop never waits on a fork, a child's pid
//! line or an fsync.
//!
//! Two threads, a pipeline, so a slow disk never delays the next fork:
//! - `spawner`: per request, the directory, params and record (unsynced) and the shim forked
//!   ([`super::launch`]); the workload is exec'd by the shim right away;
//! - `settler`: takes every launched start waiting (a batch), reads their pid lines (all at once,
//!   [`super::settle`]), syncs the records of those that started ([`super::make_durable`]),
//!   appends their ledger entries (one fsync for the batch), then reports them in order.
//!
//! So a start is answered only once its record and its ledger entry are durable (guarantee 1
//! across a host crash), while the workload itself runs before either sync completed.
//!
//! A panic while handling one request is caught and reported as that request's failure (in builds
//! that unwind; the shipped static binary aborts instead, which the node recovers from as from a
//! kill -9: see `panic` in Cargo.toml). If a thread ends anyway, the other one ends too and the channel disconnects: the loop notices, fails
//! the starts in flight and refuses new ones with a clear error.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};
use serde_json::Value;

use super::forkserver::{self, ForkServer};
use super::settle::PID_TIMEOUT;
use super::{Launched, Layout, Meta, SpawnError, StartRequest};
use crate::config::Settings;
use crate::ledger;

/// The most launched starts synced and settled together.
const MAX_BATCH: usize = 64;

/// How a start ended, as the loop learns it.
#[derive(Debug)]
pub enum Outcome {
    /// The workload runs; its ledger entry (`ledger`) is durable, the reply is the loop's.
    Spawned {
        safe_id: String,
        meta: Box<Meta>,
        ledger: ledger::Entry,
        /// Request received by the spawner → shim forked, and → reported (for the log).
        launch: Duration,
        total: Duration,
    },
    /// Nothing runs and nothing is left of it on disk.
    SpawnFailed { safe_id: String, why: SpawnError },
}

/// What the spawner needs for every start, fixed for the node's lifetime.
pub struct Context {
    pub settings: Settings,
    pub layout: Layout,
    pub exe: PathBuf,
    pub ledger: PathBuf,
    /// The reply (and ledger) body of a started workload.
    pub body: fn(&Meta) -> Value,
}

/// The loop's handle: where start requests go.
pub struct Spawner {
    jobs: Sender<(StartRequest, Instant)>,
}

impl Spawner {
    pub fn start(ctx: Context, out: Sender<Outcome>) -> std::io::Result<Spawner> {
        let (jobs, jobs_rx) = unbounded::<(StartRequest, Instant)>();
        let (launched_tx, launched_rx) = unbounded::<(Launched, Instant, Duration)>();
        let ctx = std::sync::Arc::new(ctx);
        let settle_ctx = ctx.clone();
        let settle_out = out.clone();
        std::thread::Builder::new()
            .name("settler".into())
            .spawn(move || settle_loop(&settle_ctx, &launched_rx, &settle_out))?;
        std::thread::Builder::new()
            .name("spawner".into())
            .spawn(move || spawn_loop(&ctx, &jobs_rx, &launched_tx, &out))?;
        Ok(Spawner { jobs })
    }

    /// A spawner with no thread behind it: what is submitted waits in the returned receiver
    /// (unit tests of the loop's bookkeeping).
    #[cfg(test)]
    pub fn for_tests() -> (Spawner, Receiver<(StartRequest, Instant)>) {
        let (jobs, rx) = unbounded();
        (Spawner { jobs }, rx)
    }

    /// Hands a start to the spawner; false when the spawner is gone.
    pub fn submit(&self, req: StartRequest) -> bool {
        self.jobs.send((req, Instant::now())).is_ok()
    }
}

fn spawn_loop(
    ctx: &Context,
    jobs: &Receiver<(StartRequest, Instant)>,
    launched: &Sender<(Launched, Instant, Duration)>,
    out: &Sender<Outcome>,
) {
    let (mut fork, enabled) = start_fork_server(&ctx.exe);
    let mut restart = Restart {
        enabled,
        after: ctx.settings.tuning.forkserver_restart,
        due: None,
    };
    let again = |fork: &mut Option<ForkServer>, restart: &mut Restart| {
        if restart.now(fork.is_some(), Instant::now()) {
            *fork = ForkServer::start(&ctx.exe)
                .inspect(|f| log::info!("fork server started again (pid {})", f.pid()))
                .map_err(|e| log::warn!("cannot start the fork server again ({e})"))
                .ok();
        }
    };
    for (req, received) in jobs {
        again(&mut fork, &mut restart);
        let safe_id = req.safe_id.clone();
        let run = std::panic::AssertUnwindSafe(|| {
            super::launch(&ctx.settings, &ctx.layout, &ctx.exe, &mut fork, req)
        });
        let result = std::panic::catch_unwind(run).unwrap_or_else(|_| Err(SpawnError::Internal));
        // A fork server dropped by this start: its wait counts from now.
        again(&mut fork, &mut restart);
        match result {
            Ok(l) => {
                let took = received.elapsed();
                if let Err(e) = launched.send((l, received, took)) {
                    // The settler is gone: stop this shim's start, and this thread with it.
                    let (l, ..) = e.into_inner();
                    let id = l.meta.safe_id.clone();
                    let _ = super::settle(&ctx.layout, vec![l], Duration::ZERO);
                    let _ = out.send(Outcome::SpawnFailed {
                        safe_id: id,
                        why: SpawnError::Stopped,
                    });
                    return;
                }
            }
            Err(why) => {
                if out.send(Outcome::SpawnFailed { safe_id, why }).is_err() {
                    return;
                }
            }
        }
    }
}

/// When a fork server is started again after the last one was dropped (killed, silent,
/// refused: launch.rs) or could not start: `after` past the first start that found none, before
/// the next start; until then, and while a new one cannot start, supervisors are exec'd.
struct Restart {
    /// False when `CYBERWAVE_NO_FORKSERVER` turned it off.
    enabled: bool,
    after: Duration,
    due: Option<Instant>,
}

impl Restart {
    /// Before a start, `up`: whether a fork server is there. True: start one now.
    fn now(&mut self, up: bool, now: Instant) -> bool {
        if !self.enabled || up {
            self.due = None;
            return false;
        }
        match self.due {
            None => {
                self.due = Some(crate::util::later(now, self.after));
                false
            }
            Some(due) if now >= due => {
                self.due = None;
                true
            }
            Some(_) => false,
        }
    }
}

/// The fork server supervisors are forked from (issue 25 item 5), unless
/// `CYBERWAVE_NO_FORKSERVER` is set or it cannot start: then every supervisor is exec'd. The
/// second value: whether the fork server is wanted at all (started again later if it is).
fn start_fork_server(exe: &Path) -> (Option<ForkServer>, bool) {
    if let Some(v) = std::env::var_os(forkserver::OFF_VAR) {
        match v.to_str().and_then(crate::config::env::parse_bool) {
            Some(false) => {}
            Some(true) => {
                log::info!("{}: every supervisor is exec'd", forkserver::OFF_VAR);
                return (None, false);
            }
            None => {
                log::warn!(
                    "{} is not a boolean ({}): every supervisor is exec'd",
                    forkserver::OFF_VAR,
                    crate::logtext::shown(&v.to_string_lossy())
                );
                return (None, false);
            }
        }
    }
    match ForkServer::start(exe) {
        Ok(f) => {
            log::debug!("fork server started (pid {})", f.pid());
            (Some(f), true)
        }
        Err(e) => {
            log::warn!(
                "cannot start the fork server ({e}); supervisors are exec'd until one starts"
            );
            (None, true)
        }
    }
}

fn settle_loop(
    ctx: &Context,
    launched: &Receiver<(Launched, Instant, Duration)>,
    out: &Sender<Outcome>,
) {
    while let Ok(first) = launched.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match launched.try_recv() {
                Ok(l) => batch.push(l),
                Err(_) => break,
            }
        }
        let run = std::panic::AssertUnwindSafe(|| settle_batch(ctx, batch));
        let outcomes = match std::panic::catch_unwind(run) {
            Ok(o) => o,
            // What was in the batch is lost to the loop: it fails them when it notices.
            Err(_) => return,
        };
        for o in outcomes {
            if out.send(o).is_err() {
                return;
            }
        }
    }
}

fn settle_batch(ctx: &Context, batch: Vec<(Launched, Instant, Duration)>) -> Vec<Outcome> {
    let (launched, times): (Vec<Launched>, Vec<(Instant, Duration)>) = batch
        .into_iter()
        .map(|(l, received, took)| (l, (received, took)))
        .unzip();
    let settled = super::settle(&ctx.layout, launched, PID_TIMEOUT);
    // Synced once the workloads run, and before anything is answered.
    let started: Vec<&str> = settled
        .iter()
        .filter(|(_, _, r)| r.is_ok())
        .map(|(id, _, _)| id.as_str())
        .collect();
    super::make_durable(&ctx.layout, &started);
    let entries: Vec<ledger::Entry> = settled
        .iter()
        .filter_map(|(_, _, r)| r.as_ref().ok())
        .map(|m| ledger::entry(&m.request_id_text(), true, (ctx.body)(m)))
        .collect();
    record(&ctx.ledger, &entries);
    let mut entries = entries.into_iter();
    settled
        .into_iter()
        .zip(times)
        .map(|((safe_id, _, result), (received, launch))| match result {
            Ok(meta) => Outcome::Spawned {
                safe_id,
                ledger: entries
                    .next()
                    .unwrap_or_else(|| ledger::entry(&meta.request_id_text(), true, Value::Null)),
                meta: Box::new(meta),
                launch,
                total: received.elapsed(),
            },
            Err(why) => Outcome::SpawnFailed { safe_id, why },
        })
        .collect()
}

fn record(path: &Path, entries: &[ledger::Entry]) {
    if entries.is_empty() {
        return;
    }
    if let Err(e) = ledger::append(path, entries) {
        log::error!(
            "cannot record {} started request(s) in {}: {e}",
            entries.len(),
            crate::store::shown(path)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_fork_server_is_started_again_after_its_wait_and_only_then() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut r = Restart {
            enabled: true,
            after: Duration::from_millis(30_000),
            due: None,
        };
        // Up: nothing to do.
        assert!(!r.now(true, ms(0)));
        // Gone at the start at 1 s: due 30 s later, not before.
        assert!(!r.now(false, ms(1_000)));
        assert!(!r.now(false, ms(30_999)));
        assert!(r.now(false, ms(31_000)));
        // That attempt failed: the next start schedules the next one, 30 s on.
        assert!(!r.now(false, ms(31_500)));
        assert!(!r.now(false, ms(61_499)));
        assert!(r.now(false, ms(61_500)));
        // It came up: a later loss waits its own 30 s.
        assert!(!r.now(true, ms(62_000)));
        assert!(!r.now(false, ms(70_000)));
        assert!(!r.now(false, ms(99_999)));
        assert!(r.now(false, ms(100_000)));
        // Turned off: never.
        let mut off = Restart {
            enabled: false,
            after: Duration::ZERO,
            due: None,
        };
        assert!(!off.now(false, ms(0)));
        assert!(!off.now(false, ms(1_000_000)));
    }
}
