//! Signals and shutdown: SIGTERM/SIGINT begin it (a second one exits at once), the goodbye to
//! the backend (R5) or the start-up failure (R6) ends it once answered or at its deadline; as
//! a container's main process the node first stops and reports its workloads (D58), and a
//! second SIGTERM there only hastens their SIGKILL (D70).

use std::time::{Duration, Instant};

use serde_json::json;

use super::container;
use super::io::Io;
use super::parts::Shutdown;
use super::parts::{Exit, Op};
use super::session::Session;
use super::workloads::Work;
use crate::config::Settings;
use crate::logtext::shown;
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
            &mut io.link(s),
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
        killed: false,
    }
}

/// D58: once every stopped workload's completion is out (acknowledged, or published when
/// standalone), the goodbye (R5) goes out as in any shutdown, within the same deadline. A
/// workload whose start was in flight when the stop began is stopped as soon as it is tracked.
pub(super) fn finish_stopping_workloads(w: &mut Work<'_>) {
    let Some(sd) = &w.life.shutdown else {
        return;
    };
    if !sd.stopping_workloads {
        return;
    }
    let late = w.active.uncancelled();
    if late > 0 {
        stop_all(w, late_kill(w));
    }
    let services_stopping = w.services.len() > 0;
    if !w.active.is_empty() || !w.outbox.is_empty() || !w.starts.is_empty() || services_stopping {
        return;
    }
    let Some(sd) = &w.life.shutdown else {
        return;
    };
    let (limit, exit) = (sd.deadline, sd.exit);
    log::info!("every workload of the container is reported; exiting");
    let now = w.io.clock.now();
    w.life.shutdown = Some(goodbye(w.session, w.io, w.s, now, exit, Some(limit)));
}

/// D70: the stop's deadline passed before every stopped workload was reported: the node exits
/// 1 and names what the backend did not hear of (a restarted node reports them as lost).
pub(super) fn stop_overdue(w: &Work<'_>) -> Option<Exit> {
    let sd = w.life.shutdown.as_ref()?;
    if !sd.stopping_workloads {
        return Some(sd.exit);
    }
    let unreported: Vec<String> = w.active.keys().map(|id| shown(id).to_string()).collect();
    log::error!(
        "the container's stop grace is over and not every workload was reported: {} still tracked ({}), {} completion(s) not yet acknowledged; exiting 1",
        unreported.len(),
        unreported.join(", "),
        w.outbox.len()
    );
    Some(Exit::Runtime)
}

/// SIGKILL after what is left of the grace for a workload stopped late (or at once after a
/// second SIGTERM).
fn late_kill(w: &Work<'_>) -> Duration {
    let sd = w.life.shutdown.as_ref();
    if sd.is_some_and(|s| s.killed) {
        return Duration::ZERO;
    }
    let left = sd.map_or(Duration::ZERO, |s| {
        s.deadline.saturating_duration_since(w.now())
    });
    container::kill_after(left)
}

/// SIGTERM to every running workload not yet stopped, SIGKILL after `kill`; returns how many.
fn stop_all(w: &mut Work<'_>, kill: Duration) -> usize {
    w.with_table(|t, w, fx, now| t.cancel_all(container::REASON, kill, now, w, fx))
}

pub(super) fn on_signal(w: &mut Work<'_>, sig: Signal) {
    match sig {
        Signal::Term | Signal::Int => match &mut w.life.shutdown {
            None => begin(w, Exit::Ok, &format!("{sig:?} received")),
            Some(sd) if sd.stopping_workloads => {
                // D70: the container's workloads would die unreported if the node left now.
                sd.killed = true;
                let n = w.with_table(|t, w, fx, now| t.kill_all_now(container::REASON, now, w, fx));
                let now = w.now();
                w.services.kill_now(now);
                log::warn!(
                    "second {sig:?}: SIGKILL now to the {n} workload(s) still running; the node exits once each one is reported"
                );
            }
            Some(_) => {
                log::warn!("second {sig:?}: exiting now");
                w.life.exit = Some(Exit::Ok);
            }
        },
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
    if w.life.container.is_some() {
        // D58: its workloads die with the container; stop them and report them first.
        let grace = container::stop_grace(&w.s.env);
        let kill = container::kill_after(grace);
        let n = stop_all(w, kill);
        // D59: its services die with the container too; stopped and logged like workloads.
        let now = w.now();
        w.services
            .stop_all("the node's container is stopping", kill, now);
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
            killed: false,
        });
        return;
    }
    log::info!("shutting down ({why}); running workloads and services are left running");
    super::workloads::log_running(w.active);
    w.services.log_running();
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
