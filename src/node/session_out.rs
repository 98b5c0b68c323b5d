//! The loop's side of the broker session ([`super::session`]): what the session reports
//! ([`Happening`]) carried out on the node, the loop's requests sent through it and their
//! outcomes (replies, timeouts, the broker's refusals, D34), and the heartbeat's body (R3).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::session::Happening;
use super::{workloads, Node, Op, EXIT_CREDENTIALS};
use crate::mqtt::MqttEvent;
use crate::outbox::Outbox;
use crate::protocol::replies::Reply;
use crate::util;

impl Node {
    /// Whether messages of the loop are in flight: a loss may then be the broker refusing one
    /// of them (D34), not another client taking the session (D33).
    pub(super) fn publishing(&self) -> bool {
        self.durable.outbox.in_flight_count() > 0
            || self.ingress.queue.in_flight_count() > 0
            || self.session.loop_requests_pending()
    }

    pub(super) fn on_mqtt(&mut self, ev: MqttEvent) {
        let now = self.io.clock.now();
        let publishing = self.publishing();
        let happened = self
            .session
            .on_mqtt(ev, publishing, now, &mut self.io.wire(&self.s));
        self.carry_out(happened);
    }

    /// Acts on what the session reports.
    pub(super) fn carry_out(&mut self, happened: Vec<Happening<Op>>) {
        for h in happened {
            match h {
                Happening::Connected { reconnect } => {
                    if reconnect {
                        self.life.metrics.reconnects =
                            self.life.metrics.reconnects.saturating_add(1);
                    }
                    self.flush_outbox();
                    self.with_ingress(|i, out| i.send(out));
                }
                Happening::Lost => self.connection_lost(),
                Happening::Registered => {
                    self.ship_install_logs();
                    self.answer_interrupted_starts();
                }
                Happening::RegisteredAfterFailedStart(err) => self.report_failed_start(err),
                Happening::Command(payload) => self.on_command(&payload),
                Happening::Outcome {
                    tag,
                    reply,
                    correlation,
                } => self.on_outcome(tag, reply, &correlation),
                Happening::Refused {
                    tag,
                    why,
                    permanent,
                } => self.on_refused(tag, &why, permanent),
                Happening::HeartbeatDue => self.send_heartbeat(),
                Happening::HeartbeatFailed => {
                    self.life.metrics.heartbeat_failures =
                        self.life.metrics.heartbeat_failures.saturating_add(1);
                }
                Happening::TokenRejected => self.begin_shutdown(EXIT_CREDENTIALS, "token rejected"),
            }
        }
    }

    /// The connection is gone (the session schedules the reconnect): what was in flight goes
    /// again, except what the broker refused too often (D34).
    pub(super) fn connection_lost(&mut self) {
        // Outbox messages in flight are sent again after the reconnect.
        self.session.forget(|op| matches!(op, Op::Outbox(_)));
        let refused = self.durable.outbox.reset_in_flight();
        let refused_events = self.ingress.queue.reset_in_flight();
        for (item, aside) in refused.into_iter().chain(refused_events) {
            log::error!(
                "the broker dropped the connection each of the last {} times the {} was sent; it is set aside in {} and not sent again",
                crate::outbox::MAX_REFUSALS,
                crate::logtext::shown(&item.label),
                aside.display()
            );
        }
        // The refused message sat in the MQTT client too: the next connect uses a fresh client
        // (never a clean session, see `Mqtt::start_connect`), which resends nothing of the
        // loop's requests but a standalone node's (`Mqtt::resend_requests`).
        self.reset_streams();
    }

    /// A request the broker refused, or that can never be sent as it is: an outbox message is
    /// set aside (at once when it can never fit, else after the broker refused it
    /// [`crate::outbox::MAX_REFUSALS`] times) with one ERROR line; the others fail now (D34).
    pub(super) fn on_refused(&mut self, op: Op, why: &str, permanent: bool) {
        match op {
            Op::Outbox(seq) => {
                let now = self.io.clock.now();
                refused_in(
                    &mut self.durable.outbox,
                    seq,
                    why,
                    permanent,
                    now,
                    "outbox message",
                );
            }
            // A chunk that can never fit would hold its stream (and the workload's completion,
            // until the drain limit) for good: it is skipped, the rest of the log still goes.
            Op::Log(key) if permanent => {
                self.io.mqtt.log_too_big(
                    &format!(
                        "a log chunk of {} (skipped)",
                        crate::logtext::shown(&key.safe_id)
                    ),
                    why,
                );
                self.on_log_ack(&key, true);
            }
            other => {
                if permanent {
                    // At most once a minute: a log stream offers its chunk again and again.
                    self.io
                        .mqtt
                        .log_too_big(&format!("the {other:?} request"), why);
                } else if let Some(held) = self.timers.throttle.refusals.ready(self.io.clock.now())
                {
                    // A refused log chunk is offered again at its stream's pace: once a minute.
                    log::warn!(
                        "{other:?} not delivered: {}{}",
                        crate::logtext::shown(why),
                        workloads::held_note(held)
                    );
                }
                // Failed now rather than at its timeout (a log chunk is read and sent again).
                self.on_outcome(other, None, &[]);
            }
        }
    }

    /// Sends one of the loop's requests through the session; returns its correlation.
    pub(super) fn request(
        &mut self,
        op: Op,
        topic: &str,
        body: Value,
        timeout: Duration,
    ) -> Vec<u8> {
        let now = self.io.clock.now();
        self.session
            .request(op, topic, &body, timeout, now, &mut self.io.wire(&self.s))
    }

    /// A request's reply (`Some`) or its timeout (`None`).
    pub(super) fn on_outcome(&mut self, op: Op, body: Option<Reply>, corr: &[u8]) {
        match op {
            Op::Outbox(seq) => self.on_outbox_reply(seq, body),
            Op::Log(key) => self.on_log_ack(&key, body.as_ref().is_some_and(|b| b.success)),
            Op::SignedUrl(id) => self.on_signed_url_reply(&id, body.map(|b| b.body)),
            Op::UploadResults(id) => {
                self.on_upload_reply(&id, body.as_ref().is_some_and(|b| b.success))
            }
            Op::WorkloadStatus => match body {
                Some(b) if b.success => {}
                Some(b) => log::warn!(
                    "workload status update refused: {}",
                    crate::logtext::shown(&b.message)
                ),
                // A standalone node has no backend to acknowledge it: no reply is expected.
                None if self.s.standalone => {
                    log::debug!("workload status update published (standalone: no reply expected)")
                }
                None => log::warn!("workload status update not acknowledged in time"),
            },
            Op::Terminate | Op::Fail => {
                if body.is_none() {
                    log::warn!("the backend did not acknowledge the {op:?} notice in time");
                }
                if let Some(s) = &mut self.life.shutdown {
                    if s.waiting_for.as_deref() == Some(corr) {
                        s.waiting_for = None;
                        s.deadline = self.io.clock.now();
                    }
                }
            }
        }
    }

    /// A heartbeat is due (R3): its body is what the loop knows.
    pub(super) fn send_heartbeat(&mut self) {
        // Self-heal runs beside the heartbeat, never in front of it.
        self.start_heal_pass();
        let mut body = json!({
            "node_version": crate::cli::VERSION,
            "active_workloads": self.in_use(),
            "max_concurrent_workloads": self.s.max_concurrent_workloads.value,
            "accepting": self.life.shutdown.is_none() && !self.life.drain.on,
            "draining": self.life.drain.on,
            "uptime_s": self.life.started.elapsed().as_secs(),
        });
        self.gpu.heartbeat(&self.gpu_holds(), &mut body);
        if let Some(h) = self.hardware() {
            util::set(&mut body, "hardware", h);
        }
        let now = self.io.clock.now();
        self.session
            .send_heartbeat(&body, now, &mut self.io.wire(&self.s));
    }
}

/// Counts a broker's refusal of queue entry `seq` (D34): one ERROR line when it is set aside
/// (at once when it can never fit, else after [`crate::outbox::MAX_REFUSALS`]), else a WARN.
pub(super) fn refused_in(
    q: &mut Outbox,
    seq: u64,
    why: &str,
    permanent: bool,
    now: Instant,
    what: &str,
) {
    match q.refused(seq, permanent, now) {
        Some((item, aside)) => log::error!(
            "the {} cannot be delivered ({}); it is set aside in {} and not sent again",
            crate::logtext::shown(&item.label),
            crate::logtext::shown(why),
            aside.display()
        ),
        None => log::warn!(
            "{what} {seq} not delivered ({}); retrying later",
            crate::logtext::shown(why)
        ),
    }
}
