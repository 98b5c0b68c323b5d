//! The workload table's [`Outbound`] on the loop's real pieces: signals through procinfo,
//! requests over MQTT (recorded as pending), jobs for the workers, records in the state dir.
//! What needs more than the table (shipping logs, building and queueing a completion) is done
//! right after the table's call returns (`workloads::Work::with_table`).

use crate::protocol::commands::TopicId;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::io::Io;
use super::io::Wire;
use super::parts::Op;
use super::session::Session;
use super::table::{Left, Outbound, Request};
use crate::config::Settings;
use crate::workers::Job;
use crate::workload::shim::Exit;
use crate::workload::{self, procinfo, Layout, Meta};

/// What the loop does once the table's call returned.
pub(super) enum Later {
    ShipLogs,
    Report {
        id: String,
        meta: Box<Meta>,
        exit: Option<Exit>,
        lost: Option<&'static str>,
        /// Result files it left on disk (D61, D68).
        left: Left,
    },
}

pub(super) struct NodeOut<'a> {
    connected: bool,
    /// Requests go through the broker session, which keeps them until their reply.
    session: &'a mut Session<Op>,
    wire: Wire<'a>,
    layout: &'a Layout,
    sweeper: &'a crate::store::Sweeper,
    timeout: Duration,
    now: Instant,
    later: Vec<Later>,
}

impl<'a> NodeOut<'a> {
    /// The table's [`Outbound`] for one call at `now`: requests through `session`.
    pub(super) fn new(
        session: &'a mut Session<Op>,
        io: &'a Io,
        s: &'a Settings,
        now: Instant,
    ) -> Self {
        NodeOut {
            connected: session.connected(),
            session,
            wire: io.wire(s),
            layout: &io.layout,
            sweeper: &io.sweeper,
            timeout: s.tuning.request_timeout,
            now,
            later: Vec::new(),
        }
    }

    /// What the table left for the loop, in the order it asked.
    pub(super) fn into_later(self) -> Vec<Later> {
        self.later
    }

    fn send(&mut self, op: Op, topic: &str, body: &Value) -> Vec<u8> {
        self.session
            .request(op, topic, body, self.timeout, self.now, &mut self.wire)
    }
}

impl Outbound for NodeOut<'_> {
    fn connected(&self) -> bool {
        self.connected
    }

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

    fn save_meta(&mut self, meta: &Meta) -> std::io::Result<()> {
        workload::save_meta(self.layout, meta)
    }

    fn workload_status(&mut self, wl: &TopicId, body: Value) {
        let topic = self.wire.io.topics.workload_status(wl);
        self.send(Op::WorkloadStatus, &topic, &body);
    }

    fn request(&mut self, req: Request) -> Vec<u8> {
        match req {
            Request::SignedUrl { id, wl, filename } => {
                let topic = self.wire.io.topics.signed_url(&wl);
                self.send(
                    Op::SignedUrl(id),
                    &topic,
                    &serde_json::json!({ "filename": filename }),
                )
            }
            Request::UploadResults { id, wl, body } => {
                let topic = self.wire.io.topics.upload_results(&wl);
                self.send(Op::UploadResults(id), &topic, &body)
            }
        }
    }

    fn submit(&mut self, job: Job) {
        self.wire.io.workers.submit(job);
    }

    fn ship_logs(&mut self) {
        self.later.push(Later::ShipLogs);
    }

    fn report(
        &mut self,
        id: &str,
        meta: Meta,
        exit: Option<Exit>,
        lost: Option<&'static str>,
        left: Left,
    ) {
        self.later.push(Later::Report {
            id: id.to_string(),
            meta: Box::new(meta),
            exit,
            lost,
            left,
        });
    }

    fn retire(&mut self, id: &str) {
        retire(self.layout, self.sweeper, id);
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
