//! What the workload table, its uploads and the log streams ask the loop to do ([`Effect`]),
//! and the one place that does it ([`send`], and [`Work::carry_out`] for what needs the
//! node's other parts). The parts decide and record what they want; they never hold the
//! session, the outbox, the workers or the tailer, so their decisions are unit-tested by
//! reading the list they return.

use std::io::Write;

use serde_json::{json, Value};

use super::io::Io;
use super::parts::Op;
use super::session::Session;
use super::table::LeftOnDisk;
use super::workloads::Work;
use crate::config::Settings;
use crate::protocol::commands::TopicId;
use crate::workers::Job;
use crate::workload::shim::Exit;
use crate::workload::tail::{Key, Request};
use crate::workload::{self, Layout, Meta};

/// One thing the table or its uploads want done.
#[derive(Debug)]
pub enum Effect {
    /// A non-terminal workload status (R7), fire and forget.
    WorkloadStatus { wl: TopicId, body: Value },
    /// R9 over MQTT: a signed URL for `filename`, one result file of workload `id`; the answer
    /// comes back to [`super::table::Table::on_signed_url_reply`].
    AskSignedUrl {
        id: String,
        wl: TopicId,
        filename: String,
    },
    /// R10 over MQTT: the backend is told which result files of workload `id` were uploaded;
    /// the answer comes back to [`super::table::Table::on_upload_reply`].
    TellUploaded {
        id: String,
        wl: TopicId,
        body: Value,
    },
    /// An HTTP job for the worker threads.
    Submit(Job),
    /// Write the workload's record; `what` names the change in the warning when it fails.
    SaveMeta { meta: Box<Meta>, what: &'static str },
    /// Ship what is left of the workloads' output.
    ShipLogs,
    /// Report the end of workload `id` (no longer in the table), naming the result files it
    /// left on disk; the table then hears [`super::table::Table::completion_queued`].
    Report {
        id: String,
        meta: Box<Meta>,
        exit: Option<Exit>,
        lost: Option<&'static str>,
        left: LeftOnDisk,
    },
    /// Remove a reported workload's record from disk.
    Retire(String),
    /// A job for the tailer thread; its answer comes back to
    /// [`super::streams::Streams::on_tail`].
    Tail(Request),
    /// Publish a log chunk (a JSON body) as a request; its outcome comes back to
    /// [`super::streams::Streams::on_ack`] with the same key.
    PublishLog { key: Key, payload: Vec<u8> },
    /// Publish an install-log chunk (no acknowledgement is waited for).
    PublishInstall(Vec<u8>),
    /// Tagged lines for the console: stream 0 to stdout, 1 to stderr.
    Mirror { stream: usize, text: Vec<u8> },
}

/// What one call of the table asked for, in order, and the one fact it reads while asking:
/// whether the broker connection is up (requests go over MQTT, else over REST on the workers).
#[derive(Debug, Default)]
pub struct Fx {
    pub connected: bool,
    pub list: Vec<Effect>,
}

impl Fx {
    pub fn new(connected: bool) -> Fx {
        Fx {
            connected,
            list: Vec::new(),
        }
    }

    pub fn push(&mut self, e: Effect) {
        self.list.push(e);
    }

    pub fn submit(&mut self, job: Job) {
        self.list.push(Effect::Submit(job));
    }
}

impl Work<'_> {
    /// Carries out what the table asked for, in its order; shipping logs (once) and reporting
    /// ends come after the rest, so the requests and records of the same call are out first.
    pub(super) fn carry_out(&mut self, fx: Fx) {
        let mut last = Vec::new();
        for e in fx.list {
            if let Some(e) = send(e, self.session, self.io, self.s) {
                last.push(e);
            }
        }
        let mut shipped = false;
        for e in last {
            match e {
                Effect::ShipLogs if !shipped => {
                    shipped = true;
                    self.logs().pump();
                }
                Effect::Report {
                    id,
                    meta,
                    exit,
                    lost,
                    left,
                } => {
                    let held = self.complete(&id, *meta, exit, lost, &left);
                    if let Some(e) = self.active.completion_queued(&id, held) {
                        let _ = send(e, self.session, self.io, self.s);
                    }
                    if held.is_some() {
                        self.outgoing().flush();
                    }
                }
                _ => {}
            }
        }
    }
}

/// Carries out an effect that needs no more than the broker session and the I/O handles
/// (requests are kept by the session until their reply); returns the ones that need the
/// node's other parts ([`Effect::ShipLogs`], [`Effect::Report`]).
pub(super) fn send(e: Effect, session: &mut Session<Op>, io: &Io, s: &Settings) -> Option<Effect> {
    let timeout = s.tuning.request_timeout;
    let now = io.clock.now();
    let link = &mut io.link(s);
    match e {
        Effect::WorkloadStatus { wl, body } => {
            let topic = io.topics.workload_status(&wl);
            session.request(Op::WorkloadStatus, &topic, &body, timeout, now, link);
        }
        Effect::AskSignedUrl { id, wl, filename } => {
            let topic = io.topics.signed_url(&wl);
            let body = json!({ "filename": filename });
            session.request(Op::SignedUrl(id), &topic, &body, timeout, now, link);
        }
        Effect::TellUploaded { id, wl, body } => {
            let topic = io.topics.upload_results(&wl);
            session.request(Op::UploadResults(id), &topic, &body, timeout, now, link);
        }
        Effect::Submit(job) => io.workers.submit(job),
        Effect::SaveMeta { meta, what } => {
            if let Err(e) = workload::save_meta(&io.layout, &meta) {
                let id = crate::logtext::shown(&meta.safe_id);
                log::warn!("workload {id}: cannot record {what}: {e}");
            }
        }
        Effect::Retire(id) => retire(&io.layout, &io.sweeper, &id),
        Effect::Tail(req) => io.tailer.request(req),
        Effect::PublishLog { key, payload } => {
            let topic = io.topics.logs(session.uuid());
            session.request_payload(Op::Log(key), &topic, payload, timeout, now, link);
        }
        Effect::PublishInstall(payload) => {
            let topic = io.topics.logs(session.uuid());
            session.request_payload(Op::WorkloadStatus, &topic, payload, timeout, now, link);
        }
        Effect::Mirror { stream, text } => mirror(stream, &text),
        e @ (Effect::ShipLogs | Effect::Report { .. }) => return Some(e),
    }
    None
}

/// Tagged lines of a workload's output on the node's stdout (stream 0) or stderr.
fn mirror(stream: usize, text: &[u8]) {
    static WIDEN: std::sync::Once = std::sync::Once::new();
    WIDEN.call_once(|| {
        // A journal or a terminal multiplexer reads the node's stdout and stderr through a
        // pipe of 64 KiB: a flood's console lines then cost a context switch per 64 KiB.
        // A wider pipe (1 MiB, the default most a user may ask for) lets one write go at
        // once. Not a pipe (a file, a terminal): nothing changes.
        for fd in [1, 2] {
            // SAFETY: F_SETPIPE_SZ on a standard descriptor touches no memory; failures
            // (not a pipe, a lower limit) are harmless and ignored.
            unsafe { libc::fcntl(fd, libc::F_SETPIPE_SZ, 1 << 20) };
        }
    });
    if stream == 0 {
        let mut o = std::io::stdout().lock();
        let _ = o.write_all(text);
        let _ = o.flush();
    } else {
        let mut e = std::io::stderr().lock();
        let _ = e.write_all(text);
        let _ = e.flush();
    }
}

/// Removes a reported workload's directory: first an atomic rename (so a crash never leaves
/// a half-deleted record that a restart would misread), then the deletion, off the loop.
fn retire(layout: &Layout, sweeper: &crate::store::Sweeper, safe_id: &str) {
    let dir = layout.dir(safe_id);
    let trash = layout.workloads().join(format!(".retired-{safe_id}"));
    let target = match std::fs::rename(&dir, &trash) {
        Ok(()) => trash,
        Err(e) => {
            log::warn!(
                "cannot retire {}: {e}",
                crate::logtext::shown(&dir.display().to_string())
            );
            return;
        }
    };
    sweeper.sweep(target);
}
