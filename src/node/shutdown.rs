//! Signals and shutdown: SIGTERM/SIGINT begin it (a second one exits at once), the goodbye to
//! the backend (R5) or the start-up failure (R6) ends it once answered or at its deadline; as
//! a container's main process the node first stops and reports its workloads (D58).

use std::time::Instant;

use serde_json::json;

use super::io::Io;
use super::parts::Op;
use super::parts::{Life, Shutdown};
use super::session::Session;
use super::table::Table;
use crate::config::Settings;
use crate::outbox::Outbox;
use crate::util;

/// R5: the goodbye to the backend when there is one to hear it, then the shutdown's last
/// stretch: until its reply or the flush time (at most `limit`), at once without a backend.
pub(super) fn goodbye(
    session: &mut Session<Op>,
    io: &Io,
    s: &Settings,
    now: Instant,
    exit_code: i32,
    limit: Option<Instant>,
) -> Shutdown {
    let waiting_for = if !session.registered()
        || !session.connected()
        || s.standalone
        || session.startup_failed()
    {
        None
    } else {
        let topic = io.topics.terminate(session.uuid());
        let timeout = s.tuning.shutdown_flush;
        let sent = io.clock.now();
        Some(session.request(
            Op::Terminate,
            &topic,
            &json!({}),
            timeout,
            sent,
            &mut io.wire(s),
        ))
    };
    let deadline = match (&waiting_for, limit) {
        (None, _) => now,
        (Some(_), None) => util::later(now, s.tuning.shutdown_flush),
        (Some(_), Some(l)) => util::later(now, s.tuning.shutdown_flush).min(l),
    };
    Shutdown {
        deadline,
        exit_code,
        waiting_for,
        stopping_workloads: false,
    }
}

/// D58: once every stopped workload's completion is out (acknowledged, or published when
/// standalone), the goodbye (R5) goes out as in any shutdown, within the same deadline.
pub(super) fn finish_stopping_workloads(
    life: &mut Life,
    active: &Table,
    outbox: &Outbox,
    session: &mut Session<Op>,
    io: &Io,
    s: &Settings,
) {
    let Some(sd) = &life.shutdown else {
        return;
    };
    if !sd.stopping_workloads || !active.is_empty() || !outbox.is_empty() {
        return;
    }
    let (limit, exit_code) = (sd.deadline, sd.exit_code);
    log::info!("every workload of the container is reported; exiting");
    let now = io.clock.now();
    life.shutdown = Some(goodbye(session, io, s, now, exit_code, Some(limit)));
}
