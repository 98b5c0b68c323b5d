//! What the workload table and its uploads ask the loop to do ([`Effect`]), and the one place
//! that does it ([`Work::carry_out`]). The table decides and records what it wants; it never
//! holds the session, the outbox or the workers, so its decisions are unit-tested by reading
//! the list it returns.

use serde_json::{json, Value};

use super::parts::Op;
use super::table::Left;
use super::workloads::Work;
use crate::protocol::commands::TopicId;
use crate::workers::Job;
use crate::workload::shim::Exit;
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
        left: Left,
    },
    /// Remove a reported workload's record from disk.
    Retire(String),
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
            match e {
                Effect::WorkloadStatus { wl, body } => self.workload_status(&wl, body),
                Effect::AskSignedUrl { id, wl, filename } => {
                    let topic = self.io.topics.signed_url(&wl);
                    let timeout = self.s.tuning.request_timeout;
                    let body = json!({ "filename": filename });
                    self.request(Op::SignedUrl(id), &topic, body, timeout);
                }
                Effect::TellUploaded { id, wl, body } => {
                    let topic = self.io.topics.upload_results(&wl);
                    let timeout = self.s.tuning.request_timeout;
                    self.request(Op::UploadResults(id), &topic, body, timeout);
                }
                Effect::Submit(job) => self.io.workers.submit(job),
                Effect::SaveMeta { meta, what } => {
                    if let Err(e) = workload::save_meta(&self.io.layout, &meta) {
                        let id = crate::logtext::shown(&meta.safe_id);
                        log::warn!("workload {id}: cannot record {what}: {e}");
                    }
                }
                Effect::Retire(id) => retire(&self.io.layout, &self.io.sweeper, &id),
                e @ (Effect::ShipLogs | Effect::Report { .. }) => last.push(e),
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
                        self.carry_out(Fx {
                            connected: fx.connected,
                            list: vec![e],
                        });
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
