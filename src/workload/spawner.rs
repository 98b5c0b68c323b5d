//! The spawner: starts workloads off the node's loop and reports each start back as one
//! [`Outcome`] on a channel the loop selects on. The loop never waits on a fork, a child's pid
//! line or an fsync.
//!
//! One thread takes every start waiting (a batch, so many starts at once share their syncs),
//! and for each one writes its directory, params and record (unsynced) and starts its supervisor
//! ([`super::launch`]), which starts the workload right away; then it reads their pid lines (all
//! at once, [`super::settle`]), syncs the records of those that started
//! ([`super::make_durable`]), appends their ledger entries (one fsync for the batch) and
//! reports them in order.
//!
//! So a start is answered only once its record and its ledger entry are durable (guarantee 1
//! across a host crash), while the workload itself runs before either sync completed.
//!
//! A panic while handling one request is caught and reported as that request's failure (in builds
//! that unwind; the shipped static binary aborts instead, which the node recovers from as from a
//! kill -9: see `panic` in Cargo.toml). If the thread ends anyway, the channel disconnects: the
//! loop notices, fails the starts in flight and refuses new ones with a clear error.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};
use serde_json::Value;

use super::settle::PID_TIMEOUT;
use super::{Launched, Layout, Meta, SpawnError, StartRequest};
use crate::config::Settings;
use crate::ledger;

/// The most starts launched and settled together.
const MAX_BATCH: usize = 64;

/// How a start ended, as the loop learns it.
#[derive(Debug)]
pub enum Outcome {
    /// The workload runs; its ledger entry (`ledger`) is durable, the reply is the loop's.
    Spawned {
        safe_id: String,
        meta: Box<Meta>,
        ledger: ledger::Entry,
        /// Request received by the spawner → supervisor started, and → reported (for the log).
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
        std::thread::Builder::new()
            .name("spawner".into())
            .spawn(move || spawn_loop(&ctx, &jobs_rx, &out))?;
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

fn spawn_loop(ctx: &Context, jobs: &Receiver<(StartRequest, Instant)>, out: &Sender<Outcome>) {
    while let Ok(first) = jobs.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match jobs.try_recv() {
                Ok(j) => batch.push(j),
                Err(_) => break,
            }
        }
        let mut launched = Vec::new();
        for (req, received) in batch {
            let safe_id = req.safe_id.clone();
            let run = std::panic::AssertUnwindSafe(|| {
                super::launch(&ctx.settings, &ctx.layout, &ctx.exe, req)
            });
            match std::panic::catch_unwind(run).unwrap_or(Err(SpawnError::Internal)) {
                Ok(l) => launched.push((l, received, received.elapsed())),
                Err(why) => {
                    if out.send(Outcome::SpawnFailed { safe_id, why }).is_err() {
                        return;
                    }
                }
            }
        }
        if launched.is_empty() {
            continue;
        }
        let run = std::panic::AssertUnwindSafe(|| settle_batch(ctx, launched));
        let Ok(outcomes) = std::panic::catch_unwind(run) else {
            // What was in the batch is lost to the loop: it fails them when it notices.
            return;
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
