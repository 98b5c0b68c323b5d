//! What the broker session reports ([`Happening`]), acted on: a connection made or lost, the
//! registration, a command, a request's reply or timeout, a refusal, a heartbeat due.

use super::commands;
use super::gpus_out;
use super::parts::{Op, EXIT_CREDENTIALS};
use super::session::Happening;
use super::session_out::{self, AfterRefusal};
use super::shutdown;
use super::starts_out::Start;
use super::workloads::Work;
use crate::mqtt::MqttEvent;
use crate::protocol::replies::Reply;

/// A broker event, through the session.
pub(super) fn on_mqtt(st: &mut Start<'_>, ev: MqttEvent) {
    let w = &mut st.work;
    let now = w.now();
    let publishing = session_out::publishing(w.session, w.outbox, &w.ingress.queue);
    let happened = w.session.on_mqtt(ev, publishing, now, &mut w.io.wire(w.s));
    carry_out(st, happened);
}

/// The session's periodic work (reconnects, heartbeats, deadlines), then what it reports.
pub(super) fn tick(st: &mut Start<'_>) {
    let w = &mut st.work;
    let now = w.now();
    let publishing = session_out::publishing(w.session, w.outbox, &w.ingress.queue);
    let happened = w.session.tick(publishing, now, &mut w.io.wire(w.s));
    carry_out(st, happened);
}

/// Acts on what the session reports.
fn carry_out(st: &mut Start<'_>, happened: Vec<Happening<Op>>) {
    for h in happened {
        match h {
            Happening::Connected { reconnect } => {
                let w = &mut st.work;
                if reconnect {
                    w.life.metrics.reconnects = w.life.metrics.reconnects.saturating_add(1);
                }
                w.outgoing().flush();
                w.with_ingress(|i, out| i.send(out));
            }
            Happening::Lost => {
                let w = &mut st.work;
                let now = w.now();
                let queue = &mut w.ingress.queue;
                session_out::connection_lost(w.session, w.outbox, queue, w.streams, now);
            }
            Happening::Registered => {
                st.work.logs().ship_install();
                st.answer_interrupted();
            }
            Happening::RegisteredAfterFailedStart(err) => {
                shutdown::report_failed_start(&mut st.work, err)
            }
            Happening::Command(payload) => commands::on_command(st, &payload),
            Happening::Outcome {
                tag,
                reply,
                correlation,
            } => on_outcome(&mut st.work, tag, reply, &correlation),
            Happening::Refused {
                tag,
                why,
                permanent,
            } => {
                let w = &mut st.work;
                let now = w.now();
                let throttle = &mut w.throttle.refusals;
                let (outbox, mqtt) = (&mut *w.outbox, &w.io.mqtt);
                match session_out::refused(tag, &why, permanent, outbox, mqtt, throttle, now) {
                    AfterRefusal::Nothing => {}
                    AfterRefusal::SkipLog(key) => w.logs().on_ack(&key, true),
                    AfterRefusal::Fail(op) => on_outcome(w, op, None, &[]),
                }
            }
            Happening::HeartbeatDue => {
                let w = &mut st.work;
                // Self-heal runs beside the heartbeat, never in front of it.
                st.heal
                    .start_pass(w.s.standalone, w.active, &w.io.workers, w.session.uuid());
                let holds = gpus_out::holds_of(w.active, w.starts);
                let body = session_out::heartbeat_body(w.s, w.life, w.in_use(), w.gpu, &holds);
                let now = w.now();
                w.session.send_heartbeat(&body, now, &mut w.io.wire(w.s));
            }
            Happening::HeartbeatFailed => {
                let m = &mut st.work.life.metrics;
                m.heartbeat_failures = m.heartbeat_failures.saturating_add(1);
            }
            Happening::TokenRejected => {
                shutdown::begin(&mut st.work, EXIT_CREDENTIALS, "token rejected")
            }
        }
    }
}

/// A request's reply (`Some`) or its timeout (`None`).
fn on_outcome(w: &mut Work<'_>, op: Op, body: Option<Reply>, corr: &[u8]) {
    match op {
        Op::Outbox(seq) => w.on_outbox_reply(seq, body),
        Op::Log(key) => w
            .logs()
            .on_ack(&key, body.as_ref().is_some_and(|b| b.success)),
        Op::SignedUrl(id) => {
            let body = body.map(|b| b.body);
            w.with_table(|t, out, now| t.on_signed_url_reply(&id, body, now, out));
        }
        Op::UploadResults(id) => {
            let ok = body.as_ref().is_some_and(|b| b.success);
            w.with_table(|t, out, now| t.on_upload_reply(&id, ok, now, out));
        }
        Op::WorkloadStatus => session_out::on_status_outcome(body, w.s.standalone),
        Op::Terminate | Op::Fail => {
            let now = w.now();
            let shutdown = w.life.shutdown.as_mut();
            session_out::on_goodbye_outcome(&op, body.is_some(), shutdown, corr, now);
        }
    }
}
