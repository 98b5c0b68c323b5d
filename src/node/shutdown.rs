//! Signals and shutdown: SIGTERM/SIGINT begin it (a second one exits at once), the goodbye to
//! the backend (R5) or the start-up failure (R6) ends it once answered or at its deadline; as
//! a container's main process the node first stops and reports its workloads (D58).

use std::time::Instant;

use serde_json::json;

use super::container;
use super::io::Io;
use super::parts::{Exit, Op};
use super::parts::{Life, Shutdown};
use super::session::Session;
use super::table::Table;
use super::workloads::Work;
use crate::config::Settings;
use crate::outbox::Outbox;
use crate::signals::Signal;
use crate::util;

/// R5: the goodbye to the backend when there is one to hear it, then the shutdown's last
/// stretch: until its reply or the flush time (at most `limit`), at once without a backend.
pub(super) fn goodbye(
    session: &mut Session<Op>,
    io: &Io,
    s: &Settings,
    now: Instant,
    exit: Exit,
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
        exit,
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
    let (limit, exit) = (sd.deadline, sd.exit);
    log::info!("every workload of the container is reported; exiting");
    let now = io.clock.now();
    life.shutdown = Some(goodbye(session, io, s, now, exit, Some(limit)));
}

pub(super) fn on_signal(w: &mut Work<'_>, sig: Signal) {
    match sig {
        Signal::Term | Signal::Int => {
            if w.life.shutdown.is_some() {
                log::warn!("second {sig:?}: exiting now");
                w.life.exit = Some(Exit::Ok);
                return;
            }
            begin(w, Exit::Ok, &format!("{sig:?} received"));
        }
        Signal::Hup => {
            log::info!("SIGHUP ignored (restart the service to reload the configuration)")
        }
        Signal::Usr1 => w.life.drain.set(true, "SIGUSR1", w.in_use()),
        Signal::Usr2 => w.life.drain.set(false, "SIGUSR2", w.in_use()),
    }
}

/// Begins the shutdown (once): the goodbye (R5), or as a container's main process its
/// workloads stopped and reported first (D58).
pub(super) fn begin(w: &mut Work<'_>, exit: Exit, why: &str) {
    if w.life.shutdown.is_some() {
        return;
    }
    crate::systemd::notify("STOPPING=1");
    let now = w.now();
    if container::is_init(&w.s.env) {
        // D58: its workloads die with the container; stop them and report them first.
        let grace = container::stop_grace(&w.s.env);
        let kill = container::kill_after(grace);
        let n = w.with_table(|t, out, now| t.cancel_all(container::REASON, kill, now, out));
        log::info!(
            "shutting down ({why}); as its container's main process the node stops its {n} running workload(s) (SIGTERM, SIGKILL after {:.1}s) and reports them before it exits, within {:.1}s",
            kill.as_secs_f64(),
            grace.as_secs_f64()
        );
        w.session.close();
        w.life.shutdown = Some(Shutdown {
            deadline: util::later(now, container::deadline_after(grace)),
            exit,
            waiting_for: None,
            stopping_workloads: true,
        });
        return;
    }
    log::info!("shutting down ({why}); running workloads are left running");
    super::workloads::log_running(w.active);
    w.session.close();
    w.life.shutdown = Some(goodbye(w.session, w.io, w.s, now, exit, None));
}

/// Registered after start-up failed: tell the backend (R6), then exit.
pub(super) fn report_failed_start(w: &mut Work<'_>, err: String) {
    let uuid = w.session.uuid().to_string();
    log::error!("reporting the start-up failure to the backend, then exiting");
    if w.s.standalone {
        return begin(w, Exit::Runtime, "start-up failed");
    }
    let topic = w.io.topics.fail(&uuid);
    let corr = w.request(
        Op::Fail,
        &topic,
        json!({"instance_uuid": uuid, "error": err}),
        w.s.tuning.heartbeat_timeout,
    );
    begin(w, Exit::Runtime, "start-up failed");
    if let Some(s) = &mut w.life.shutdown {
        s.waiting_for = Some(corr);
    }
}
