//! The loop's side of the streams part ([`super::streams`]): it tells the part which workloads
//! exist and whether the node may publish, carries out what the part asks ([`Outbound`] as
//! `StreamsOut`: tailer jobs, publishes as requests, console lines) and maps a log request's outcome
//! (`Op::Log(key)`) back to the part. Only this file sees both the part and the loop's types.

use std::io::Write;
use std::time::{Duration, Instant};

use super::io::{Io, Wire};
use super::parts::{Clock, Op};
use super::session::Session;
use super::streams::{self, Cursor, Outbound, Source, Streams};
use super::table::Table;
use crate::config::Settings;
use crate::logtext::Throttle;
use crate::workload::lifecycle::Phase;
use crate::workload::tail::{Event, Key, Request};

/// The part's settings, from the node's.
pub(super) fn settings(s: &crate::config::Settings) -> streams::Settings {
    streams::Settings {
        interval: s.log_stream_interval.value,
        max_log_bytes: s.max_log_bytes.value,
        standalone: s.standalone,
        mirror_per_second: s.tuning.mirror_bytes_per_second,
    }
}

/// The streams part's [`Outbound`] on the loop's pieces: the tailer, the broker session (a
/// chunk is a request kept until its reply) and the console.
struct StreamsOut<'a> {
    session: &'a mut Session<Op>,
    wire: Wire<'a>,
    clock: &'a dyn Clock,
    /// The logs topic of this node.
    topic: String,
    timeout: Duration,
}

impl StreamsOut<'_> {
    /// A request on the logs topic whose body is already encoded (the chunk's text is escaped
    /// once, straight into the payload).
    fn publish_log(&mut self, op: Op, payload: Vec<u8>) {
        let now = self.clock.now();
        self.session
            .request_payload(op, &self.topic, payload, self.timeout, now, &mut self.wire);
    }
}

impl Outbound for StreamsOut<'_> {
    fn tail(&mut self, req: Request) {
        self.wire.io.tailer.request(req);
    }

    fn publish(&mut self, key: &Key, payload: Vec<u8>) {
        self.publish_log(Op::Log(key.clone()), payload);
    }

    fn publish_install(&mut self, payload: Vec<u8>) {
        self.publish_log(Op::WorkloadStatus, payload);
    }

    fn mirror(&mut self, stream: usize, text: &[u8]) {
        static WIDEN: std::sync::Once = std::sync::Once::new();
        WIDEN.call_once(|| {
            // A journal or a terminal multiplexer reads the node's stdout and stderr through a
            // pipe of 64 KiB: a flood's console lines then cost a context switch per 64 KiB.
            // A wider pipe (1 MiB, the default most a user may ask for) lets one write go at
            // once. Not a pipe (a file, a terminal): nothing changes.
            for fd in [1, 2] {
                // SAFETY: F_SETPIPE_SZ on a standard descriptor touches no memory; failures
                // (not a pipe, a lower limit) are harmless and ignored.
                unsafe { libc::fcntl(fd, libc::F_SETPIPE_SZ, 1 << 20) };
            }
        });
        if stream == 0 {
            let mut o = std::io::stdout().lock();
            let _ = o.write_all(text);
            let _ = o.flush();
        } else {
            let mut e = std::io::stderr().lock();
            let _ = e.write_all(text);
            let _ = e.flush();
        }
    }
}

/// The parts a streams call touches, borrowed apart from the node for the length of one call
/// (built by `workloads::Work::logs`): the part itself, the broker session its
/// chunks go through, the loop's I/O handles, the settings, the workloads it follows, the
/// throttle of full-disk warnings and the counter of log bytes acknowledged.
pub(super) struct Logs<'a> {
    pub(super) streams: &'a mut Streams,
    pub(super) session: &'a mut Session<Op>,
    pub(super) io: &'a Io,
    pub(super) s: &'a Settings,
    pub(super) active: &'a Table,
    pub(super) disk: &'a mut Throttle,
    pub(super) log_bytes: &'a mut u64,
}

impl Logs<'_> {
    /// Runs `f` on the streams part with its [`Outbound`].
    fn with_streams<R>(&mut self, f: impl FnOnce(&mut Streams, &mut dyn Outbound) -> R) -> R {
        let topic = self.io.topics.logs(self.session.uuid());
        let mut out = StreamsOut {
            session: self.session,
            wire: self.io.wire(self.s),
            clock: self.io.clock.as_ref(),
            topic,
            timeout: self.s.tuning.request_timeout,
        };
        f(self.streams, &mut out)
    }

    /// Tells the part the link state and the workloads: new ones are tracked from their
    /// persisted cursor, ended ones ship their rest, forgotten ones are dropped.
    pub(super) fn sync(&mut self) {
        let now = self.io.clock.now();
        let connected = self.session.connected() && self.session.registered();
        let uuid = self.session.uuid();
        self.streams.link(connected, uuid, now);
        self.streams
            .set_packet_limit(self.io.mqtt.max_packet_size().map(u64::from));
        let active = self.active;
        self.streams.retain(|id| active.contains_key(id));
        let mut ended = Vec::new();
        for (id, a) in active {
            if !self.streams.is_tracked(id) {
                let dir = self.io.layout.dir(id);
                let cursor: Cursor =
                    crate::workload::load_json(&dir.join("cursor.json"), "log cursor")
                        .unwrap_or_default();
                let src = Source {
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
        self.with_streams(|part, out| {
            for id in &ended {
                part.end(id, now, out);
            }
        });
    }

    /// Reads whatever is due (and, for a workload that just ended, its rest at once).
    pub(super) fn pump(mut self) {
        self.sync();
        let now = self.io.clock.now();
        self.with_streams(|part, out| part.pump(now, out));
    }

    /// What the tailer thread did.
    pub(super) fn on_tail(mut self, ev: Event) {
        if let Event::Persisted {
            result: Err(e),
            path,
            ..
        } = &ev
        {
            // A full disk: once a minute, not once per chunk (D28).
            if let Some(held) = self.disk.ready(self.io.clock.now()) {
                log::warn!(
                    "cannot persist the log cursor {}: {e}{}",
                    crate::logtext::shown(&path.display().to_string()),
                    crate::logtext::held_note(held)
                );
            }
        }
        self.sync();
        let now = self.io.clock.now();
        let n = self.with_streams(|part, out| part.on_tail(ev, now, out));
        *self.log_bytes = self.log_bytes.saturating_add(n);
    }

    /// A log chunk's request ended: acknowledged (`ok`), refused or timed out.
    pub(super) fn on_ack(mut self, key: &Key, ok: bool) {
        let now = self.io.clock.now();
        let n = self.with_streams(|part, out| part.on_ack(key, ok, now, out));
        *self.log_bytes = self.log_bytes.saturating_add(n);
    }

    /// Ships the install script's output (captured in `install_logs/`) once, after the first
    /// registration: the last 1 MiB of each stream at most, in 64 KiB chunks.
    pub(super) fn ship_install(mut self) {
        if self.streams.install_shipped() || !self.session.registered() {
            return;
        }
        self.sync();
        let dir = self.s.config_dir.value.join("install_logs");
        let texts = streams::STREAM_NAMES.map(|name| {
            crate::workload::tail(
                &dir.join(format!("install.{name}.log")),
                streams::INSTALL_TAIL,
            )
        });
        self.with_streams(|part, out| part.ship_install(texts, out));
    }
}

/// Forgets chunks in flight (after a lost connection): they are read and sent again.
pub(super) fn reset(streams: &mut Streams, session: &mut Session<Op>, now: Instant) {
    streams.reset(now);
    session.forget(|op| matches!(op, Op::Log(_)));
}

/// True once every stream of a finished workload was shipped to its end, or the drain limit
/// passed.
pub(super) fn drained(streams: &Streams, active: &Table, id: &str, now: Instant) -> bool {
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
