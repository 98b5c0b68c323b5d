//! What the workload table, its uploads and the log streams ask the loop to do: one
//! [`Effect`] each. The parts decide and record what they want; they never hold the session,
//! the outbox, the workers or the tailer, so their decisions are unit-tested by reading the
//! list they return. One place carries effects out: `io.rs` ([`super::io::send`]), and
//! `workloads.rs` (`Work::carry_out`) for the two that need the node's other parts.

use serde_json::Value;

use crate::protocol::commands::TopicId;
use crate::workers::Job;
use crate::workload::shim::Exit;
use crate::workload::tail::{Key, Request};
use crate::workload::Meta;

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

/// The result files a workload's end left on disk, each list named by its completion.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct LeftOnDisk {
    /// D61: loose files it could have written, none of its own for sure.
    pub unattributed: Vec<String>,
    /// D68: its own result files, not uploaded (given up on, past the deadline, cancelled).
    pub not_uploaded: Vec<String>,
}
