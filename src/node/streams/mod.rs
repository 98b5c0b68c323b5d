//! Live log streaming (R4) and console mirroring: a part that owns every workload's stream
//! state and returns what it wants done as [`Effect`]s (a tailer job, a publish, console lines). It never sees the loop's types: the loop tells it which workloads exist
//! ([`Streams::track`], [`Streams::end`], [`Streams::forget`]), whether the node may publish
//! ([`Streams::link`]), what the tailer found ([`Streams::on_tail`]) and how a chunk's request
//! ended ([`Streams::on_ack`]); it asks for its next deadline ([`Streams::next_due`]).
//!
//! Per stream the part keeps the acknowledged cursor (persisted by the tailer thread before the
//! next chunk goes, so a crash re-sends at most the chunk in flight), at most one chunk in
//! flight (chunks arrive in order, with no gap and no duplicate from the node's side), and a
//! [`pace::Pace`]: new bytes go once the oldest of them is 250 ms old, at most 4 messages a
//! second, within a byte budget per stream interval (so a workload writing gigabytes cannot
//! starve commands or heartbeats; the file on disk stays complete and the stream catches up).
//! The part learns that a file grew from the tailer's one-shot watch (see `workload::tail`): the
//! loop sleeps until [`Streams::next_due`] and is never woken by a timer while nothing waits.
//! Once a workload ended, its rest is shipped at once and as fast as the backend acknowledges.
//!
//! **Stream offsets** (what a chunk's `offset` says) are file offsets plus the stream's `base`,
//! and never go back: they count every byte the stream moved past. Three things move it past
//! bytes it did not ship, and the chunk after says which and how many: the `max_log_bytes` cap
//! (`"dropped": n`, bytes cut before they were shipped; the offset jumps by n), a hole or a run
//! of NUL bytes (`"gap": n`, D52: not output, never shipped or mirrored; the offset jumps by n),
//! and a truncation by the workload (`"truncated": true`, D52: the log restarted; `base` grows
//! so that the new data's first byte takes the next stream offset, with no jump). So the backend
//! tells a truncation from a resend: a resend repeats an offset it already has, a chunk after a
//! truncation continues at the next one and says `truncated`. The console gets one warning per
//! stream for the first truncation and the first hole (later ones are logged at debug level).

pub mod mirror;
pub mod pace;
pub mod text;

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::effect::Effect;
use crate::workload::tail::{Chunk, Event, Key, Mark, Request, MARK_BYTES};
use pace::{Pace, Rules, MIN_READ};

/// Largest chunk read and published at once.
pub const MAX_CHUNK: u64 = 512 * 1024;
/// What a log request needs besides its body (topic, properties, the body's other fields),
/// kept free below the broker's Maximum Packet Size.
pub const PACKET_OVERHEAD: u64 = 4096;
/// Longest piece of one line the console gets under one tag: under what log collectors keep as
/// one record (journald's `LineMax` is 48 KiB, Docker's log drivers split at 16 KiB), so that
/// no collector splits a piece and leaves its rest without the tag.
pub const MIRROR_PIECE: usize = 16 * 1024;
/// Install-log chunks (shipped once, after registration).
pub const INSTALL_CHUNK: usize = 64 * 1024;
/// The install script's output shipped, per stream: its last MiB.
pub const INSTALL_TAIL: u64 = 1024 * 1024;

pub use crate::config::MIRROR_BYTES_PER_SECOND;

pub const STREAM_NAMES: [&str; 2] = ["stdout", "stderr"];
/// How many [`Mark`]s a stream keeps (the ends of its last chunks read): a truncation is found
/// to have cut at or after the newest one still intact.
pub const MARKS: usize = 16;

/// `stream_name(i)` without a panic (a stream index is 0 or 1).
fn stream_name(i: usize) -> &'static str {
    STREAM_NAMES.get(i).copied().unwrap_or("stdout")
}

/// `workloads/<id>/cursor.json`.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cursor {
    pub stdout: u64,
    pub stderr: u64,
    #[serde(default)]
    pub stdout_base: u64,
    #[serde(default)]
    pub stderr_base: u64,
    /// The newest mark at or before the acknowledged offset (D52): a truncation while the node
    /// was down is found after its restart too, even when the log grew back past the cursor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_mark: Option<SavedMark>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_mark: Option<SavedMark>,
}

/// A [`Mark`] as cursor.json keeps it: its bytes in hex.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SavedMark {
    pub end: u64,
    pub tail: String,
}

impl SavedMark {
    fn of(m: &Mark) -> SavedMark {
        SavedMark {
            end: m.end,
            tail: m.tail.iter().map(|b| format!("{b:02x}")).collect(),
        }
    }

    /// The mark, or `None` when its text is not hex of at most [`MARK_BYTES`] bytes.
    fn mark(&self) -> Option<Mark> {
        let t = self.tail.as_bytes();
        if t.is_empty() || t.len() % 2 != 0 || t.len() > MARK_BYTES.saturating_mul(2) {
            return None;
        }
        let nibble = |c: u8| {
            char::from(c)
                .to_digit(16)
                .and_then(|d| u8::try_from(d).ok())
        };
        let tail = t
            .chunks(2)
            .map(|p| Some(nibble(*p.first()?)? << 4 | nibble(*p.get(1)?)?))
            .collect::<Option<Vec<u8>>>()?;
        (self.end >= tail.len() as u64).then_some(Mark {
            end: self.end,
            tail,
        })
    }
}

/// Largest log offset a cursor may hold (1 PiB): far beyond any log, far from overflow.
pub const MAX_CURSOR: u64 = 1 << 50;

impl crate::store::Validate for Cursor {
    fn validate(&self) -> Result<(), crate::store::Invalid> {
        let all = [self.stdout, self.stderr, self.stdout_base, self.stderr_base];
        crate::store::check_offsets("log offsets", &all, MAX_CURSOR)?;
        for (m, at) in [
            (&self.stdout_mark, self.stdout),
            (&self.stderr_mark, self.stderr),
        ] {
            if let Some(m) = m {
                if m.end > at || m.mark().is_none() {
                    return Err(crate::store::Invalid::LogMark);
                }
            }
        }
        Ok(())
    }
}

/// The node's settings the part follows.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamSettings {
    /// `CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL`: the longest a byte waits, and the budget's period.
    pub interval: Duration,
    /// `max_log_bytes`: a log file over this keeps its newest half.
    pub max_log_bytes: u64,
    /// No backend acknowledges logs: a published chunk counts as delivered.
    pub standalone: bool,
    /// `CYBERWAVE_NODE_MIRROR_BYTES_PER_SECOND`: the console mirror's budget per stream (D69).
    pub mirror_per_second: u64,
}

/// What the part needs to know of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamSource {
    pub kind: String,
    pub request_id: Value,
    pub workload_uuid: Option<String>,
    /// stdout, stderr.
    pub logs: [PathBuf; 2],
    /// Where its cursor is persisted.
    pub cursor_path: PathBuf,
}

#[derive(Debug, Default)]
struct Stream {
    /// Bytes the backend acknowledged (persisted in cursor.json).
    acked: u64,
    /// (offset, length) of the chunk in flight.
    inflight: Option<(u64, u64)>,
    /// A tailer job (read or cut) is under way.
    reading: bool,
    /// The cursor is being written: the next chunk waits for it.
    persisting: bool,
    /// A watch is armed for this stream's file.
    watching: bool,
    /// Bytes already mirrored to the console.
    mirrored: u64,
    /// The mirrored text after the last line end, held until its line ends.
    partial: Vec<u8>,
    /// What the console may still get this second (D69).
    budget: mirror::Budget,
    /// The workload ended and every byte of this stream was acknowledged.
    drained: bool,
    /// Bytes cut from the front of the file by the `max_log_bytes` cap: file offset + base =
    /// stream offset (what the backend sees).
    base: u64,
    /// Cut bytes the backend never got, announced with the next chunk.
    dropped_unsent: u64,
    /// Bytes of holes and NUL runs skipped since the last chunk, announced with the next one.
    gap_unsent: u64,
    /// The workload truncated the file since the last chunk: the next one says so.
    truncated_unsent: bool,
    /// The console was told of a truncation / of a hole of this stream (once each).
    told_truncated: bool,
    told_gap: bool,
    /// The ends of the last chunks read, oldest first (at most [`MARKS`]).
    marks: VecDeque<Mark>,
    pace: Pace,
}

struct Workload {
    src: StreamSource,
    /// `[workload <tag> <stream>] ` per stream.
    prefix: [Vec<u8>; 2],
    /// Its process ended: the rest goes at once.
    ending: bool,
    streams: [Stream; 2],
}

impl Workload {
    fn request_text(&self) -> String {
        crate::protocol::commands::request_id_text(&self.src.request_id)
    }

    fn cursor(&self) -> Cursor {
        let [o, e] = &self.streams;
        let saved = |s: &Stream| {
            s.marks
                .iter()
                .rev()
                .find(|m| m.end <= s.acked)
                .map(SavedMark::of)
        };
        Cursor {
            stdout: o.acked,
            stderr: e.acked,
            stdout_base: o.base,
            stderr_base: e.base,
            stdout_mark: saved(o),
            stderr_mark: saved(e),
        }
    }
}

pub struct Streams {
    rules: Rules,
    max_log_bytes: u64,
    standalone: bool,
    workloads: BTreeMap<String, Workload>,
    connected: bool,
    uuid: String,
    install_shipped: bool,
    /// The broker's Maximum Packet Size (its CONNACK), when it set one.
    packet_limit: Option<u64>,
    mirror_per_second: u64,
}

impl Default for Streams {
    fn default() -> Self {
        Streams::new(&StreamSettings {
            interval: Duration::from_secs(3),
            max_log_bytes: 1 << 30,
            standalone: false,
            mirror_per_second: MIRROR_BYTES_PER_SECOND,
        })
    }
}

impl Streams {
    pub fn new(s: &StreamSettings) -> Streams {
        Streams {
            rules: Rules::new(s.interval),
            max_log_bytes: s.max_log_bytes.max(1),
            standalone: s.standalone,
            workloads: BTreeMap::new(),
            connected: false,
            uuid: String::new(),
            install_shipped: false,
            packet_limit: None,
            mirror_per_second: s.mirror_per_second,
        }
    }

    /// The broker's Maximum Packet Size: chunks are cut to fit it (a message over it is never
    /// sent, and a chunk that could never go would be skipped).
    pub fn set_packet_limit(&mut self, max_packet: Option<u64>) {
        self.packet_limit = max_packet;
    }

    /// The largest body a chunk may have.
    fn payload_cap(&self) -> u64 {
        self.packet_limit
            .map_or(u64::MAX, |p| p.saturating_sub(PACKET_OVERHEAD).max(1024))
    }

    /// The largest read: a chunk's bytes, before escaping.
    fn read_cap(&self) -> u64 {
        MAX_CHUNK.min(self.payload_cap())
    }

    /// Whether chunks may be published now (connected and registered), and the instance uuid
    /// they carry. A new connection sends again whatever was not acknowledged.
    pub fn link(&mut self, connected: bool, uuid: &str, now: Instant) {
        if connected && !self.connected {
            for w in self.workloads.values_mut() {
                for s in &mut w.streams {
                    s.pace.unsent(now);
                }
            }
        }
        self.connected = connected;
        if self.uuid != uuid {
            self.uuid = uuid.to_string();
        }
    }

    pub fn is_tracked(&self, id: &str) -> bool {
        self.workloads.contains_key(id)
    }

    /// Starts streaming a workload's logs from its persisted cursor (a re-adopted workload
    /// resumes at the first unacknowledged byte). What is in its files already is read after
    /// the batching window; growth is watched from then on.
    pub fn track(&mut self, id: &str, src: StreamSource, cursor: Cursor, now: Instant) {
        let tag = src
            .workload_uuid
            .clone()
            .filter(|w| !w.is_empty())
            .unwrap_or_else(|| {
                let r = crate::protocol::commands::request_id_text(&src.request_id);
                if r.is_empty() {
                    src.kind.clone()
                } else {
                    r
                }
            });
        let shown = crate::logtext::shown(&tag);
        let prefix = STREAM_NAMES.map(|n| format!("[workload {shown} {n}] ").into_bytes());
        let mut streams = [Stream::default(), Stream::default()];
        for (s, (at, base, mark)) in streams.iter_mut().zip([
            (cursor.stdout, cursor.stdout_base, &cursor.stdout_mark),
            (cursor.stderr, cursor.stderr_base, &cursor.stderr_mark),
        ]) {
            s.acked = at;
            s.mirrored = at;
            s.budget = mirror::Budget::new(self.mirror_per_second);
            s.base = base;
            s.marks.extend(mark.as_ref().and_then(SavedMark::mark));
            s.pace.unsent(now);
        }
        self.workloads.insert(
            id.to_string(),
            Workload {
                src,
                prefix,
                ending: false,
                streams,
            },
        );
    }

    /// The workload's process ended: ship the rest now, as fast as it is acknowledged.
    pub fn end(&mut self, id: &str, now: Instant, fx: &mut Vec<Effect>) {
        let Some(w) = self.workloads.get_mut(id) else {
            return;
        };
        if w.ending {
            return;
        }
        w.ending = true;
        for (i, s) in w.streams.iter_mut().enumerate() {
            s.pace.unsent(now);
            if std::mem::take(&mut s.watching) {
                // Its files no longer grow: no watch is left behind (inotify watches are
                // a limited resource, and a finished log stays for days).
                fx.push(Effect::Tail(Request::Unwatch(Key {
                    safe_id: id.to_string(),
                    stream: i,
                })));
            }
        }
        self.pump(now, fx);
    }

    pub fn forget(&mut self, id: &str) {
        self.workloads.remove(id);
    }

    /// Ids of the tracked workloads.
    pub fn ids(&self) -> impl Iterator<Item = &String> {
        self.workloads.keys()
    }

    /// Keeps only the workloads `keep` says yes to.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.workloads.retain(|id, _| keep(id));
    }

    /// The next moment a stream has something due; `None`: nothing waits on a timer (new
    /// output arrives as an event).
    pub fn next_due(&self) -> Option<Instant> {
        let mut due: Option<Instant> = None;
        for w in self.workloads.values() {
            for d in w.streams.iter().filter_map(|s| s.budget.note_due()) {
                due = Some(due.map_or(d, |t| t.min(d)));
            }
            if w.ending {
                continue; // driven by events: reads, acknowledgements, persists
            }
            for s in &w.streams {
                if s.reading || s.inflight.is_some() || s.persisting {
                    continue;
                }
                if let Some(d) = s.pace.due(&self.rules) {
                    due = Some(due.map_or(d, |t| t.min(d)));
                }
            }
        }
        due
    }

    /// Asks the tailer for the next slice of every stream that is due.
    pub fn pump(&mut self, now: Instant, fx: &mut Vec<Effect>) {
        let cap = self.read_cap();
        for (id, w) in &mut self.workloads {
            for (i, s) in w.streams.iter_mut().enumerate() {
                if let Some(held) = s.budget.take_note(now, false) {
                    let prefix = w.prefix.get(i).map(Vec::as_slice).unwrap_or_default();
                    fx.push(Effect::Mirror {
                        stream: i,
                        text: mirror::note(prefix, held),
                    });
                }
                if s.reading || s.inflight.is_some() || s.persisting {
                    continue;
                }
                let max = if w.ending {
                    // Not connected and mirrored all: the rest waits for a connection.
                    let idle = s.drained || (!self.connected && !s.pace.waiting());
                    if idle {
                        continue;
                    }
                    cap
                } else {
                    if s.pace.due(&self.rules).is_none_or(|d| now < d) {
                        continue;
                    }
                    s.pace.allowance(now, &self.rules).min(cap)
                };
                let offset = if self.connected {
                    s.acked
                } else {
                    s.mirrored.max(s.acked)
                };
                s.reading = true;
                fx.push(Effect::Tail(Request::Read {
                    key: Key {
                        safe_id: id.clone(),
                        stream: i,
                    },
                    path: w.src.logs.get(i).cloned().unwrap_or_default(),
                    offset,
                    max: usize::try_from(max).unwrap_or(usize::MAX),
                    marks: s.marks.iter().rev().cloned().collect(),
                }));
            }
        }
    }

    /// What the tailer did. Returns the bytes newly acknowledged (for the metrics): always 0
    /// here except in standalone mode, where a publish counts as delivered.
    pub fn on_tail(&mut self, ev: Event, now: Instant, fx: &mut Vec<Effect>) -> u64 {
        let delivered = match ev {
            Event::Chunk(c) => self.on_chunk(c, now, fx),
            Event::Cut { key, result } => {
                self.on_cut(&key, result, now, fx);
                0
            }
            Event::Grew(key) => {
                if let Some(s) = self.stream_mut(&key) {
                    s.watching = false;
                    s.pace.unsent(now);
                }
                0
            }
            Event::Persisted { key, .. } => {
                if let Some(s) = self.stream_mut(&key) {
                    s.persisting = false;
                }
                0
            }
        };
        self.pump(now, fx);
        delivered
    }

    fn stream_mut(&mut self, key: &Key) -> Option<&mut Stream> {
        self.workloads
            .get_mut(&key.safe_id)
            .and_then(|w| w.streams.get_mut(key.stream))
    }

    fn on_cut(
        &mut self,
        key: &Key,
        result: std::io::Result<u64>,
        now: Instant,
        _: &mut Vec<Effect>,
    ) {
        let cap = self.max_log_bytes;
        let Some(w) = self.workloads.get_mut(&key.safe_id) else {
            return;
        };
        let rid_text = w.request_text();
        let rid = crate::logtext::shown(&rid_text);
        let kind = w.src.kind.clone();
        let Some(s) = w.streams.get_mut(key.stream) else {
            return;
        };
        s.reading = false;
        s.pace.unsent(now);
        match result {
            Ok(cut) if cut > 0 => {
                let unsent = cut.saturating_sub(s.acked);
                log::warn!(
                    "{kind} {rid}: {} log over max_log_bytes ({cap}); dropped its oldest {cut} bytes ({unsent} never shipped)",
                    stream_name(key.stream),
                );
                s.base = s.base.saturating_add(cut);
                s.dropped_unsent = s.dropped_unsent.saturating_add(unsent);
                s.acked = s.acked.saturating_sub(cut);
                s.mirrored = s.mirrored.saturating_sub(cut);
                s.marks
                    .retain(|m| m.end >= cut.saturating_add(m.tail.len() as u64));
                for m in &mut s.marks {
                    m.end = m.end.saturating_sub(cut);
                }
            }
            Ok(_) => {}
            Err(e) => log::warn!("cannot cap a log of {rid}: {e}"),
        }
    }

    fn on_chunk(&mut self, chunk: Chunk, now: Instant, fx: &mut Vec<Effect>) -> u64 {
        let cap = self.max_log_bytes;
        let payload_cap = self.payload_cap();
        let piece = MIN_READ.min(self.read_cap());
        let connected = self.connected;
        let rules = self.rules;
        let Some(w) = self.workloads.get_mut(&chunk.key.safe_id) else {
            return 0;
        };
        let i = chunk.key.stream;
        let ending = w.ending;
        let Some(s) = w.streams.get_mut(i) else {
            return 0;
        };
        s.reading = false;
        let path = w.src.logs.get(i).cloned().unwrap_or_default();
        // The max_log_bytes cap: the tailer keeps the newest half when the file outgrows it (a
        // copy of up to half a gigabyte: never on the loop).
        // What the file holds on disk counts, not the holes of a sparse file (D52: they are
        // skipped, never cut by copying them as zeros).
        if chunk.file_len.min(chunk.disk_len) > cap {
            s.reading = true;
            fx.push(Effect::Tail(Request::Cut {
                key: chunk.key,
                path,
                keep: cap / 2,
            }));
            return 0;
        }
        let publishing = connected && chunk.offset == s.acked && s.inflight.is_none();
        let mirroring = !connected && chunk.offset == s.mirrored.max(s.acked);
        if !publishing && !mirroring {
            s.pace.unsent(now); // overtaken (a reconnect, a cut): read again
            return 0;
        }
        let what = Said {
            kind: &w.src.kind,
            request_id: &w.src.request_id,
            stream: i,
        };
        if chunk.truncated {
            truncated(s, &chunk, &what);
        }
        if chunk.skipped > 0 && skipped(s, &chunk, mirroring, &what) {
            // The line the console holds ends where the hole starts.
            end_partial_line(s, w.prefix.get(i), i, now, fx);
        }
        // From here on the chunk is the bytes at `offset`.
        let offset = chunk.at();
        let mut data = chunk.data;
        let read_end = offset.saturating_add(data.len() as u64);
        // The read saw everything the file held.
        let caught_up = read_end >= chunk.file_len;
        trim_chunk(&mut data, chunk.gap_follows, ending, caught_up, piece);
        // The body, cut to the broker's packet size if it set one (escaping can make the text
        // longer than the bytes read).
        let (body, shrunk) = if publishing && !data.is_empty() {
            let at = offset.saturating_add(s.base);
            let notes = Notes {
                dropped: s.dropped_unsent,
                gap: s.gap_unsent,
                truncated: s.truncated_unsent,
            };
            let (b, cut) = fitted_body(&self.uuid, i, &mut data, &w.src, at, &notes, payload_cap);
            (Some(b), cut)
        } else {
            (None, false)
        };
        let end = offset.saturating_add(data.len() as u64);
        if !data.is_empty() {
            mark(s, end, &data);
        }
        // Mirror what the console has not seen yet.
        if end > s.mirrored {
            let from = usize::try_from(s.mirrored.saturating_sub(offset)).unwrap_or(0);
            let fresh = data.get(from.min(data.len())..).unwrap_or_default();
            let prefix = w.prefix.get(i).map(Vec::as_slice).unwrap_or_default();
            // Text a hole ends is a whole line for the console too.
            let (last, partial) = (chunk.gap_follows, &mut s.partial);
            mirror::mirror(prefix, i, fresh, last, partial, &mut s.budget, now, fx);
            s.mirrored = end;
        }
        // (A chunk cut to fit the broker leaves whole lines behind.)
        let all_sent_or_partial = end >= chunk.file_len || (caught_up && !ending && !shrunk);
        if data.is_empty() || mirroring {
            if ending && data.is_empty() && offset == s.acked {
                // Every byte acknowledged, up to the end of the file (or a file that cannot be
                // read any further: it stays on disk, and the drain does not wait for it
                // forever). Nothing to ship needs no connection.
                s.drained = true;
                s.pace.caught_up();
                end_partial_line(s, w.prefix.get(i), i, now, fx);
                return 0;
            }
            if all_sent_or_partial {
                s.pace.caught_up();
                if !ending {
                    watch(s, chunk.key, path, chunk.file_len, fx);
                }
            } else {
                s.pace.unsent(now);
            }
            return 0;
        }
        let Some(body) = body else {
            return 0;
        };
        s.inflight = Some((offset, data.len() as u64));
        s.pace
            .sent(now, data.len() as u64, !all_sent_or_partial, &rules);
        if all_sent_or_partial && !ending {
            watch(s, chunk.key.clone(), path, chunk.file_len, fx);
        }
        fx.push(Effect::PublishLog {
            key: chunk.key.clone(),
            payload: body,
        });
        if self.standalone {
            // No backend acknowledges logs: published once, counted as delivered.
            return self.ack(&chunk.key, true, now, fx);
        }
        0
    }

    /// The outcome of a chunk's request: `ok` when the backend acknowledged it; a refusal or a
    /// timeout sends it again from the acknowledged cursor. Returns the bytes acknowledged.
    pub fn on_ack(&mut self, key: &Key, ok: bool, now: Instant, fx: &mut Vec<Effect>) -> u64 {
        let n = self.ack(key, ok, now, fx);
        self.pump(now, fx);
        n
    }

    fn ack(&mut self, key: &Key, ok: bool, now: Instant, fx: &mut Vec<Effect>) -> u64 {
        let Some(w) = self.workloads.get_mut(&key.safe_id) else {
            return 0;
        };
        let Some(s) = w.streams.get_mut(key.stream) else {
            return 0;
        };
        let Some((offset, len)) = s.inflight.take() else {
            return 0;
        };
        if !ok || offset != s.acked {
            s.pace.unsent(now);
            return 0;
        }
        s.acked = offset.saturating_add(len);
        // The notes went with it (a chunk sent again carries them again).
        s.dropped_unsent = 0;
        s.gap_unsent = 0;
        s.truncated_unsent = false;
        s.persisting = true;
        let data = serde_json::to_vec(&w.cursor()).unwrap_or_default();
        fx.push(Effect::Tail(Request::Persist {
            key: key.clone(),
            path: w.src.cursor_path.clone(),
            data,
        }));
        len
    }

    /// The connection is gone: chunks in flight are forgotten and sent again from the
    /// acknowledged cursor once the node is connected again.
    pub fn reset(&mut self, now: Instant) {
        self.connected = false;
        for w in self.workloads.values_mut() {
            for s in &mut w.streams {
                if s.inflight.take().is_some() {
                    s.pace.unsent(now);
                }
            }
        }
    }

    /// Every stream of an ended workload reached the end of its file and was acknowledged.
    pub fn drained(&self, id: &str) -> bool {
        self.workloads.get(id).is_none_or(|w| {
            w.ending
                && w.streams
                    .iter()
                    .all(|s| s.drained && s.inflight.is_none() && !s.reading && !s.persisting)
        })
    }

    /// The streams of a workload not yet fully shipped.
    pub fn undrained(&self, id: &str) -> Vec<&'static str> {
        self.workloads
            .get(id)
            .map(|w| {
                w.streams
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| !s.drained)
                    .map(|(i, _)| stream_name(i))
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn install_shipped(&self) -> bool {
        self.install_shipped
    }

    /// Ships the install script's output once: `texts` are the tails of its stdout and stderr,
    /// sent in chunks that end at line ends.
    pub fn ship_install(&mut self, texts: [String; 2], fx: &mut Vec<Effect>) {
        if self.install_shipped {
            return;
        }
        self.install_shipped = true;
        for (name, text) in STREAM_NAMES.iter().zip(texts) {
            let mut offset = 0;
            while offset < text.len() {
                let end = text::install_chunk_end(&text, offset, INSTALL_CHUNK);
                let piece = text.get(offset..end).unwrap_or_default();
                let body = json!({
                    "instance_uuid": self.uuid,
                    "log_type": name,
                    "log_content": piece.strip_suffix('\n').unwrap_or(piece),
                    "source": "install",
                });
                fx.push(Effect::PublishInstall(
                    serde_json::to_vec(&body).unwrap_or_default(),
                ));
                offset = end;
            }
        }
    }
}

/// Who a console note is about.
struct Said<'a> {
    kind: &'a str,
    request_id: &'a Value,
    stream: usize,
}

impl Said<'_> {
    fn who(&self) -> String {
        let rid = crate::protocol::commands::request_id_text(self.request_id);
        format!(
            "{} {}: its {} log",
            self.kind,
            crate::logtext::shown(&rid),
            stream_name(self.stream)
        )
    }
}

/// Remembers the last bytes read before `end` (the chunk's `data` ends there).
fn mark(s: &mut Stream, end: u64, data: &[u8]) {
    let from = data.len().saturating_sub(MARK_BYTES);
    let tail = data.get(from..).unwrap_or_default().to_vec();
    if s.marks.back().is_some_and(|m| m.end >= end) {
        return; // read again (a resend): already marked
    }
    if s.marks.len() >= MARKS {
        s.marks.pop_front();
    }
    s.marks.push_back(Mark { end, tail });
}

/// D52: the workload truncated (or replaced) the file below the position read from; the tailer
/// resumed at `chunk.resume`, at or before the truncation point. Stream offsets stay monotonic:
/// `base` grows so that the byte at `resume` takes the stream offset the acknowledged position
/// had; the console may see what the truncation kept after `resume` once more, nothing is lost.
fn truncated(s: &mut Stream, chunk: &Chunk, what: &Said<'_>) {
    let r = chunk.resume;
    if s.acked > r {
        s.base = s
            .base
            .saturating_add(s.acked.saturating_sub(r))
            .min(MAX_CURSOR);
        s.acked = r;
    }
    if s.mirrored > r {
        // The partial line held for the console: keep only what lies before `resume`.
        let held = s.mirrored.saturating_sub(s.partial.len() as u64);
        s.partial
            .truncate(usize::try_from(r.saturating_sub(held)).unwrap_or(0));
        s.mirrored = r;
    }
    s.marks.retain(|m| m.end <= r);
    s.truncated_unsent = true;
    if std::mem::replace(&mut s.told_truncated, true) {
        log::debug!(
            "{} was truncated again; continuing from byte {r} of the file",
            what.who()
        );
    } else {
        log::warn!(
            "{} was truncated or replaced by the workload (now {} bytes, read up to byte {}); continuing from byte {r} of the file: nothing written after the truncation is lost",
            what.who(),
            chunk.file_len,
            chunk.offset,
        );
    }
}

/// D52: the tailer skipped a hole (or NUL run) of `chunk.skipped` bytes from `chunk.resume`:
/// the position moves past it with nothing shipped or mirrored; the next chunk says `gap`.
/// True when the partial line held for the console ends at the hole (to be written now).
fn skipped(s: &mut Stream, chunk: &Chunk, mirroring: bool, what: &Said<'_>) -> bool {
    let to = chunk.at();
    if !mirroring && s.acked == chunk.resume {
        s.gap_unsent = s.gap_unsent.saturating_add(chunk.skipped);
        s.acked = to;
    }
    let mut flush = false;
    if s.mirrored < to {
        flush = !s.partial.is_empty() && s.mirrored == chunk.resume;
        s.mirrored = to;
        if std::mem::replace(&mut s.told_gap, true) {
            log::debug!(
                "{}: another {} bytes of hole skipped",
                what.who(),
                chunk.skipped
            );
        } else {
            log::warn!(
                "{} has a hole (or NUL bytes) of {} bytes from byte {}: skipped, not shipped or mirrored",
                what.who(),
                chunk.skipped,
                chunk.resume,
            );
        }
    }
    flush
}

fn watch(s: &mut Stream, key: Key, path: PathBuf, len: u64, fx: &mut Vec<Effect>) {
    if !s.watching {
        s.watching = true;
        fx.push(Effect::Tail(Request::Watch { key, path, len }));
    }
}

/// Mirrors the partial line the console holds as a whole line: no more of it will come.
fn end_partial_line(
    s: &mut Stream,
    prefix: Option<&Vec<u8>>,
    i: usize,
    now: Instant,
    fx: &mut Vec<Effect>,
) {
    let rest = std::mem::take(&mut s.partial);
    let prefix = prefix.map(Vec::as_slice).unwrap_or_default();
    mirror::mirror(
        prefix,
        i,
        &rest,
        true,
        &mut Vec::new(),
        &mut s.budget,
        now,
        fx,
    );
}

/// Where a chunk ends. Text that a hole or NUL run ends (`gap_follows`) goes as it is: no line
/// end will come. While the workload runs, a chunk ends at a line end (unless one line fills a
/// whole read of `piece` bytes: then it goes in pieces ending on a whole character; D32, a line
/// never has to fit in memory). Once it ended, a read that did not reach the end of the file
/// ends on a whole character.
fn trim_chunk(data: &mut Vec<u8>, gap_follows: bool, ending: bool, caught_up: bool, piece: u64) {
    if gap_follows {
        return;
    }
    if !ending {
        match data.iter().rposition(|b| *b == b'\n') {
            Some(pos) => data.truncate(pos.saturating_add(1)),
            None if (data.len() as u64) < piece => data.clear(),
            None => data.truncate(text::utf8_cut(data, data.len())),
        }
    } else if !caught_up {
        data.truncate(text::utf8_cut(data, data.len()));
    }
}

/// The chunk's body, with `data` cut until it fits the broker's packet size if it set one
/// (escaping can make the text longer than the bytes read); `true` when it was cut.
fn fitted_body(
    uuid: &str,
    i: usize,
    data: &mut Vec<u8>,
    src: &StreamSource,
    at: u64,
    notes: &Notes,
    payload_cap: u64,
) -> (Vec<u8>, bool) {
    let mut shrunk = false;
    let mut b = chunk_body(uuid, i, data, src, at, notes);
    let mut tries: u32 = 0;
    while b.len() as u64 > payload_cap && data.len() > 1 && tries < 16 {
        let keep = (data.len() as u128)
            .saturating_mul(u128::from(payload_cap))
            .checked_div(b.len() as u128)
            .unwrap_or(0);
        let keep = usize::try_from(keep).unwrap_or(0);
        let keep = keep.min(data.len().saturating_sub(1)).max(1);
        data.truncate(text::utf8_cut(data, keep));
        shrunk = true;
        b = chunk_body(uuid, i, data, src, at, notes);
        tries = tries.saturating_add(1);
    }
    (b, shrunk)
}

/// What a chunk says of the bytes the stream moved past before it (see the module's notes).
#[derive(Debug, Default)]
struct Notes {
    dropped: u64,
    gap: u64,
    truncated: bool,
}

/// The R4 body of a chunk: `{"instance_uuid", "log_type", "log_content", "workload_request_id",
/// "offset", "length", "dropped"?, "gap"?, "truncated"?, "workload_uuid"?}`, written straight
/// into one buffer.
fn chunk_body(
    uuid: &str,
    stream: usize,
    data: &[u8],
    src: &StreamSource,
    offset: u64,
    notes: &Notes,
) -> Vec<u8> {
    let content = text::log_content(data);
    let mut b = Vec::with_capacity(
        content
            .len()
            .saturating_add(content.len() / 16)
            .saturating_add(256),
    );
    b.extend_from_slice(b"{\"instance_uuid\":");
    text::push_json_str(&mut b, uuid);
    b.extend_from_slice(b",\"log_type\":\"");
    b.extend_from_slice(stream_name(stream).as_bytes());
    b.extend_from_slice(b"\",\"log_content\":");
    text::push_json_str(&mut b, &content);
    b.extend_from_slice(b",\"workload_request_id\":");
    if serde_json::to_writer(&mut b, &src.request_id).is_err() {
        b.extend_from_slice(b"null");
    }
    b.extend_from_slice(format!(",\"offset\":{offset},\"length\":{}", data.len()).as_bytes());
    if notes.dropped > 0 {
        // The max_log_bytes cap cut these bytes before they were shipped.
        b.extend_from_slice(format!(",\"dropped\":{}", notes.dropped).as_bytes());
    }
    if notes.gap > 0 {
        // Holes and NUL runs just before this chunk (D52): not output.
        b.extend_from_slice(format!(",\"gap\":{}", notes.gap).as_bytes());
    }
    if notes.truncated {
        // The workload truncated (or replaced) the log; this chunk is of its new data (D52).
        b.extend_from_slice(b",\"truncated\":true");
    }
    if let Some(wl) = &src.workload_uuid {
        b.extend_from_slice(b",\"workload_uuid\":");
        text::push_json_str(&mut b, wl);
    }
    b.push(b'}');
    b
}

#[cfg(test)]
mod tests;
