//! The loop's side of the streams part ([`super::streams`]), as methods of [`Work`]: it tells the part which workloads
//! exist and whether the node may publish, has what the part asks for carried out (tailer jobs,
//! publishes as requests, console lines: [`Effect`]s) and maps a log request's outcome
//! (`Op::Log(key)`) back to the part. Only this file sees both the part and the loop's types.

use std::time::Instant;

use super::effect::Effect;
use super::parts::Op;
use super::session::Session;
use super::streams::{self, Cursor, StreamSource, Streams};
use super::table::Table;
use super::workloads::Work;
use crate::workload::lifecycle::Phase;
use crate::workload::tail::{Event, Key};

/// The part's settings, from the node's.
pub(super) fn settings(s: &crate::config::Settings) -> streams::StreamSettings {
    streams::StreamSettings {
        interval: s.log_stream_interval.value,
        max_log_bytes: s.max_log_bytes.value,
        standalone: s.standalone,
        mirror_per_second: s.tuning.mirror_bytes_per_second,
    }
}

impl Work<'_> {
    /// The ending workloads whose logs were shipped to their end, or whose drain limit passed.
    pub(super) fn drained_logs(&self, now: Instant) -> Vec<String> {
        let (streams, active) = (&*self.streams, &*self.active);
        active
            .draining()
            .into_iter()
            .filter(|id| drained(streams, active, id, now))
            .collect()
    }

    /// Runs `f` on the streams part, then carries out what it asked for ([`super::io::send`]).
    fn with_streams<R>(&mut self, f: impl FnOnce(&mut Streams, &mut Vec<Effect>) -> R) -> R {
        let mut fx = Vec::new();
        let r = f(self.streams, &mut fx);
        for e in fx {
            // A streams call asks for nothing that needs the node's other parts.
            let _ = super::io::send(e, self.session, self.io, self.s);
        }
        r
    }

    /// Tells the part the link state and the workloads: new ones are tracked from their
    /// persisted cursor, ended ones ship their rest, forgotten ones are dropped.
    pub(super) fn sync_logs(&mut self) {
        let now = self.io.clock.now();
        let connected = self.session.connected() && self.session.registered();
        let uuid = self.session.uuid();
        self.streams.link(connected, uuid, now);
        self.streams
            .set_packet_limit(self.io.mqtt.max_packet_size().map(u64::from));
        let active = &*self.active;
        self.streams.retain(|id| active.contains_key(id));
        let mut ended = Vec::new();
        for (id, a) in active {
            if !self.streams.is_tracked(id) {
                let dir = self.io.layout.dir(id);
                let cursor: Cursor =
                    crate::workload::load_json(&dir.join("cursor.json"), "log cursor")
                        .unwrap_or_default();
                let src = StreamSource {
                    kind: a.meta.kind.to_string(),
                    request_id: a.meta.request_id.clone(),
                    workload_uuid: a.meta.workload_uuid.as_deref().map(String::from),
                    logs: [a.meta.stdout_log.clone(), a.meta.stderr_log.clone()],
                    cursor_path: dir.join("cursor.json"),
                };
                self.streams.track(id, src, cursor, now);
            }
            if a.phase.finished() {
                ended.push(id.clone());
            }
        }
        self.with_streams(|part, fx| {
            for id in &ended {
                part.end(id, now, fx);
            }
        });
    }

    /// Reads whatever is due (and, for a workload that just ended, its rest at once).
    pub(super) fn pump_logs(&mut self) {
        self.sync_logs();
        let now = self.io.clock.now();
        self.with_streams(|part, fx| part.pump(now, fx));
    }

    /// What the tailer thread did.
    pub(super) fn on_tail(&mut self, ev: Event) {
        if let Event::Persisted {
            result: Err(e),
            path,
            ..
        } = &ev
        {
            // A full disk: once a minute, not once per chunk (D28).
            if let Some(held) = self.throttle.disk.ready(self.io.clock.now()) {
                log::warn!(
                    "cannot persist the log cursor {}: {e}{}",
                    crate::logtext::shown(&path.display().to_string()),
                    crate::logtext::held_note(held)
                );
            }
        }
        self.sync_logs();
        let now = self.io.clock.now();
        let n = self.with_streams(|part, fx| part.on_tail(ev, now, fx));
        let m = &mut self.life.metrics;
        m.log_bytes = m.log_bytes.saturating_add(n);
    }

    /// A log chunk's request ended: acknowledged (`ok`), refused or timed out.
    pub(super) fn on_log_ack(&mut self, key: &Key, ok: bool) {
        let now = self.io.clock.now();
        let n = self.with_streams(|part, fx| part.on_ack(key, ok, now, fx));
        let m = &mut self.life.metrics;
        m.log_bytes = m.log_bytes.saturating_add(n);
    }

    /// Ships the install script's output (captured in `install_logs/`) once, after the first
    /// registration: the last 1 MiB of each stream at most, in 64 KiB chunks.
    pub(super) fn ship_install_logs(&mut self) {
        if self.streams.install_shipped() || !self.session.registered() {
            return;
        }
        self.sync_logs();
        let dir = self.s.config_dir.value.join("install_logs");
        let texts = streams::STREAM_NAMES.map(|name| {
            crate::workload::tail(
                &dir.join(format!("install.{name}.log")),
                streams::INSTALL_TAIL,
            )
        });
        self.with_streams(|part, fx| part.ship_install(texts, fx));
    }
}

/// Forgets chunks in flight (after a lost connection): they are read and sent again.
pub(super) fn reset(streams: &mut Streams, session: &mut Session<Op>, now: Instant) {
    streams.reset(now);
    session.forget(|op| matches!(op, Op::Log(_)));
}

/// True once every stream of a finished workload was shipped to its end, or the drain limit
/// passed.
fn drained(streams: &Streams, active: &Table, id: &str, now: Instant) -> bool {
    let Some(a) = active.get(id) else {
        return true;
    };
    let Phase::Draining { until, .. } = &a.phase else {
        return false;
    };
    if now >= *until {
        let left = streams.undrained(id);
        if !left.is_empty() {
            log::warn!(
                "{} {}: {} not fully shipped before its completion (backend unreachable?)",
                a.meta.kind,
                crate::logtext::shown(&a.meta.request_id_text()),
                left.join(" and ")
            );
        }
        return true;
    }
    streams.drained(id)
}
