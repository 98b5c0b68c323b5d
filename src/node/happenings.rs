//! The loop's side of the broker session ([`super::session`]): what the loop does when the
//! session reports (dispatched in `mod.rs`) a connection made or lost, a request's reply or
//! timeout, a refusal (D34) or a heartbeat due, and the heartbeat's body (R3).

use std::time::Instant;

use serde_json::{json, Value};

use super::events::Ingress;
use super::gpus::{Gpus, Hold};
use super::parts::{refused_in, Life, Op, Shutdown};
use super::selfheal::Heal;
use super::session::Session;
use super::streams::Streams;
use super::workloads::Work;
use crate::config::Settings;
use crate::ingress_queue::EventQueue;
use crate::logtext::Throttle;
use crate::mqtt::Mqtt;
use crate::outbox::Outbox;
use crate::protocol::replies::Reply;
use crate::util;
use crate::workload::tail::Key;

/// The connection is made: what waited for it goes (the outbox, the workflow events).
pub(super) fn on_connected(w: &mut Work<'_>, reconnect: bool) {
    if reconnect {
        w.life.metrics.reconnects = w.life.metrics.reconnects.saturating_add(1);
    }
    w.flush_outbox();
    w.with_ingress(|i, out| i.send(out));
}

/// The connection is lost ([`connection_lost`]).
pub(super) fn on_lost(w: &mut Work<'_>) {
    let now = w.now();
    connection_lost(w.session, w.outbox, w.ingress, w.streams, now);
}

/// The broker refused one of the loop's requests, or it can never be sent ([`refused`]).
pub(super) fn on_refused(w: &mut Work<'_>, tag: Op, why: &str, permanent: bool) {
    let now = w.now();
    let throttle = &mut w.throttle.refusals;
    let (outbox, mqtt) = (&mut *w.outbox, &w.io.mqtt);
    match refused(tag, why, permanent, outbox, mqtt, throttle, now) {
        AfterRefusal::Nothing => {}
        AfterRefusal::SkipLog(key) => w.on_log_ack(&key, true),
        AfterRefusal::Fail(op) => on_outcome(w, op, None, &[]),
    }
}

/// A heartbeat is due: the self-heal pass beside it, never in front of it, then the heartbeat.
pub(super) fn on_heartbeat_due(w: &mut Work<'_>, heal: &mut Heal) {
    heal.start_pass(w.s.standalone, w.active, &w.io.workers, w.session.uuid());
    let holds = w.holds();
    let mut body = heartbeat_body(w.s, w.life, w.in_use(), w.gpu, &holds);
    // D59: the services workloads left running, beside (not among) the active workloads.
    util::set(&mut body, "services", json!(w.services.len()));
    let now = w.now();
    w.session.send_heartbeat(&body, now, &mut w.io.link(w.s));
}

/// A request's reply (`Some`) or its timeout (`None`).
pub(super) fn on_outcome(w: &mut Work<'_>, op: Op, body: Option<Reply>, corr: &[u8]) {
    match op {
        Op::Outbox(seq) => w.on_outbox_reply(seq, body),
        Op::Log(key) => w.on_log_ack(&key, body.as_ref().is_some_and(|b| b.success)),
        Op::SignedUrl(id) => {
            let body = body.map(|b| b.body);
            w.with_table(|t, w, fx, now| t.on_signed_url_reply(&id, body, now, w, fx));
        }
        Op::UploadResults(id) => {
            let ok = body.as_ref().is_some_and(|b| b.success);
            w.with_table(|t, w, fx, now| t.on_upload_reply(&id, ok, now, w, fx));
        }
        Op::WorkloadStatus => on_status_outcome(body, w.s.standalone),
        Op::Terminate | Op::Fail => {
            let now = w.now();
            let shutdown = w.life.shutdown.as_mut();
            on_goodbye_outcome(&op, body.is_some(), shutdown, corr, now);
        }
    }
}

/// Whether messages of the loop are in flight: a loss may then be the broker refusing one of
/// them (D34), not another client taking the session (D33).
pub(super) fn publishing(session: &Session<Op>, outbox: &Outbox, events: &EventQueue) -> bool {
    outbox.in_flight_count() > 0 || events.in_flight_count() > 0 || session.loop_requests_pending()
}

/// The connection is gone (the session schedules the reconnect): what was in flight goes
/// again, except what the broker refused too often (D34).
pub(super) fn connection_lost(
    session: &mut Session<Op>,
    outbox: &mut Outbox,
    events: &mut Ingress,
    streams: &mut Streams,
    now: Instant,
) {
    // Outbox messages in flight are sent again after the reconnect.
    session.forget(|op| matches!(op, Op::Outbox(_)));
    let refused = outbox.reset_in_flight();
    let refused = refused.into_iter().map(|(item, aside)| (item.label, aside));
    let refused_events = events.connection_lost(now);
    for (label, aside) in refused.chain(refused_events) {
        log::error!(
            "the broker dropped the connection each of the last {} times the {} was sent; it is set aside in {} and not sent again",
            crate::outbox::MAX_REFUSALS,
            crate::logtext::shown(&label),
            aside.display()
        );
    }
    // The refused message sat in the MQTT client too: the next connect uses a fresh client
    // (never a clean session, see `Mqtt::start_connect`), which resends nothing of the
    // loop's requests but a standalone node's (`Mqtt::resend_requests`).
    super::logs::reset(streams, session, now);
}

/// What the loop does once a refusal was noted ([`refused`]).
pub(super) enum AfterRefusal {
    Nothing,
    /// A log chunk that can never fit: skipped as if acknowledged.
    SkipLog(Key),
    /// Failed now rather than at its timeout.
    Fail(Op),
}

/// A request the broker refused, or that can never be sent as it is: an outbox message is
/// set aside (at once when it can never fit, else after the broker refused it
/// [`crate::outbox::MAX_REFUSALS`] times) with one ERROR line; the others fail now (D34).
pub(super) fn refused(
    op: Op,
    why: &str,
    permanent: bool,
    outbox: &mut Outbox,
    mqtt: &Mqtt,
    throttle: &mut Throttle,
    now: Instant,
) -> AfterRefusal {
    match op {
        Op::Outbox(seq) => {
            refused_in(outbox, seq, why, permanent, now, "outbox message");
            AfterRefusal::Nothing
        }
        // A chunk that can never fit would hold its stream (and the workload's completion,
        // until the drain limit) for good: it is skipped, the rest of the log still goes.
        Op::Log(key) if permanent => {
            mqtt.log_too_big(
                &format!(
                    "a log chunk of {} (skipped)",
                    crate::logtext::shown(&key.safe_id)
                ),
                why,
            );
            AfterRefusal::SkipLog(key)
        }
        other => {
            if permanent {
                // At most once a minute: a log stream offers its chunk again and again.
                mqtt.log_too_big(&format!("the {other:?} request"), why);
            } else if let Some(held) = throttle.ready(now) {
                // A refused log chunk is offered again at its stream's pace: once a minute.
                log::warn!(
                    "{other:?} not delivered: {}{}",
                    crate::logtext::shown(why),
                    crate::logtext::held_note(held)
                );
            }
            // Failed now rather than at its timeout (a log chunk is read and sent again).
            AfterRefusal::Fail(other)
        }
    }
}

/// The outcome of a non-terminal workload status (R7): only logged.
pub(super) fn on_status_outcome(body: Option<Reply>, standalone: bool) {
    match body {
        Some(b) if b.success => {}
        Some(b) => log::warn!(
            "workload status update refused: {}",
            crate::logtext::shown(&b.message)
        ),
        // A standalone node has no backend to acknowledge it: no reply is expected.
        None if standalone => {
            log::debug!("workload status update published (standalone: no reply expected)")
        }
        None => log::warn!("workload status update not acknowledged in time"),
    }
}

/// The outcome of the goodbye (R5) or the start-up failure (R6): the shutdown waiting for it
/// ends now.
pub(super) fn on_goodbye_outcome(
    op: &Op,
    answered: bool,
    shutdown: Option<&mut Shutdown>,
    corr: &[u8],
    now: Instant,
) {
    if !answered {
        log::warn!("the backend did not acknowledge the {op:?} notice in time");
    }
    if let Some(s) = shutdown {
        if s.waiting_for.as_deref() == Some(corr) {
            s.waiting_for = None;
            s.deadline = now;
        }
    }
}

/// The heartbeat's body (R3): what the loop knows.
pub(super) fn heartbeat_body(
    s: &Settings,
    life: &Life,
    in_use: usize,
    gpu: &Gpus,
    holds: &[Hold<'_>],
) -> Value {
    let mut body = json!({
        "node_version": crate::cli::VERSION,
        "active_workloads": in_use,
        "max_concurrent_workloads": s.max_concurrent_workloads.value,
        "accepting": life.shutdown.is_none() && !life.drain.on,
        "draining": life.drain.on,
        "uptime_s": life.started.elapsed().as_secs(),
    });
    gpu.heartbeat(holds, &mut body);
    if let Some(h) = super::operate::hardware(s, gpu) {
        util::set(&mut body, "hardware", h);
    }
    body
}
