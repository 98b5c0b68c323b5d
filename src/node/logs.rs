//! Live log streaming (R4) and console mirroring. Per stream the node keeps the acknowledged
//! cursor (persisted), at most one chunk in flight (so chunks arrive in order, with no gap and
//! no duplicate from the node's side), and a per-interval byte budget (so a workload writing
//! gigabytes cannot starve commands or heartbeats; the file on disk stays complete and the
//! stream catches up over time).

use std::io::Write;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{Node, Op};
use crate::workload::lifecycle::Phase;
use crate::workload::tail::{Chunk, Key, ReadRequest};

/// Largest chunk read and published at once.
pub const CHUNK: usize = 64 * 1024;
/// Bytes a stream may ship per stream interval (a flood is shipped at this pace).
pub const BUDGET_PER_INTERVAL: u64 = 4 * 1024 * 1024;

pub const STREAM_NAMES: [&str; 2] = ["stdout", "stderr"];

/// `stream_name(i)` without a panic (a stream index is 0 or 1).
fn stream_name(i: usize) -> &'static str {
    STREAM_NAMES.get(i).copied().unwrap_or("stdout")
}

#[derive(Debug, Default)]
pub struct Stream {
    /// Bytes the backend acknowledged (persisted in cursor.json).
    pub acked: u64,
    /// (offset, length) of the chunk in flight.
    pub inflight: Option<(u64, u64)>,
    pub reading: bool,
    /// Bytes already mirrored to the console.
    pub mirrored: u64,
    /// The mirrored text after the last newline, held until its line ends.
    pub partial: Vec<u8>,
    pub budget: u64,
    /// More data was seen beyond what was sent.
    pub more: bool,
    /// A read at the end found nothing beyond the cursor.
    pub drained: bool,
    /// Bytes cut from the front of the file by the `max_log_bytes` cap: file offset + base =
    /// stream offset (what the backend sees).
    pub base: u64,
    /// Cut bytes the backend never got, announced with the next chunk.
    pub dropped_unsent: u64,
}

/// `workloads/<id>/cursor.json`.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Cursor {
    pub stdout: u64,
    pub stderr: u64,
    #[serde(default)]
    pub stdout_base: u64,
    #[serde(default)]
    pub stderr_base: u64,
}

/// Largest log offset a cursor may hold (1 PiB): far beyond any log, far from overflow.
pub const MAX_CURSOR: u64 = 1 << 50;

impl crate::store::Validate for Cursor {
    fn validate(&self) -> Result<(), String> {
        let all = [self.stdout, self.stderr, self.stdout_base, self.stderr_base];
        crate::store::check_offsets("log offsets", &all, MAX_CURSOR)
    }
}

impl Node {
    /// Asks the tailer for the next slice of every stream that is due.
    pub(super) fn pump_streams(&mut self, interval_due: bool) {
        let now = self.clock.now();
        let ids: Vec<String> = self.active.keys().cloned().collect();
        for id in ids {
            let Some(a) = self.active.get_mut(&id) else {
                continue;
            };
            let ending = matches!(a.phase, Phase::Draining { .. });
            for (i, s) in a.streams.iter_mut().enumerate() {
                if interval_due {
                    s.budget = BUDGET_PER_INTERVAL;
                }
                if s.reading || s.inflight.is_some() {
                    continue;
                }
                // The max_log_bytes cap: the tailer keeps the newest half when the file outgrows it
                // (a copy of up to half a gigabyte: never on this thread).
                let path = if i == 0 {
                    &a.meta.stdout_log
                } else {
                    &a.meta.stderr_log
                };
                let cap = self.s.max_log_bytes.value;
                if std::fs::metadata(path)
                    .map(|m| m.len() > cap)
                    .unwrap_or(false)
                {
                    s.reading = true;
                    self.tailer.read(ReadRequest {
                        key: Key {
                            safe_id: id.clone(),
                            stream: i,
                        },
                        path: path.clone(),
                        offset: s.acked,
                        max: 0,
                        keep: Some(cap / 2),
                    });
                    continue;
                }
                let wanted = interval_due || ending || (s.more && s.budget > 0);
                if !wanted || (s.budget == 0 && !ending) || (ending && s.drained) {
                    continue;
                }
                s.reading = true;
                let path = if i == 0 {
                    a.meta.stdout_log.clone()
                } else {
                    a.meta.stderr_log.clone()
                };
                self.tailer.read(ReadRequest {
                    key: Key {
                        safe_id: id.clone(),
                        stream: i,
                    },
                    path,
                    offset: s.acked,
                    max: CHUNK,
                    keep: None,
                });
            }
        }
        if interval_due {
            self.next_stream_pass = now
                .checked_add(self.s.log_stream_interval.value)
                .unwrap_or(now);
        }
    }

    pub(super) fn on_chunk(&mut self, chunk: Chunk) {
        let connected = self.session.connected() && self.session.registered();
        let uuid = self.uuid().to_string();
        let standalone = self.s.standalone;
        let Some(a) = self.active.get_mut(&chunk.key.safe_id) else {
            return;
        };
        let ending = matches!(a.phase, Phase::Draining { .. });
        let tag = a
            .meta
            .workload_uuid
            .clone()
            .filter(|w| !w.is_empty())
            .unwrap_or_else(|| {
                let r = a.meta.request_id_text();
                if r.is_empty() {
                    a.meta.kind.clone()
                } else {
                    r
                }
            });
        let meta_rid = a.meta.request_id.clone();
        let meta_wl = a.meta.workload_uuid.clone();
        let i = chunk.key.stream;
        let Some(s) = a.streams.get_mut(i) else {
            return;
        };
        s.reading = false;
        if let Some(result) = chunk.cut {
            match result {
                Ok(cut) if cut > 0 => {
                    let unsent = cut.saturating_sub(s.acked);
                    log::warn!(
                        "{} {}: {} log over max_log_bytes ({}); dropped its oldest {cut} bytes ({unsent} never shipped)",
                        a.meta.kind,
                        crate::logtext::shown(&a.meta.request_id_text()),
                        stream_name(i),
                        self.s.max_log_bytes.value
                    );
                    s.base = s.base.saturating_add(cut);
                    s.dropped_unsent = s.dropped_unsent.saturating_add(unsent);
                    s.acked = s.acked.saturating_sub(cut);
                    s.mirrored = s.mirrored.saturating_sub(cut);
                }
                Ok(_) => {}
                Err(e) => log::warn!(
                    "cannot cap a log of {}: {e}",
                    crate::logtext::shown(&a.meta.request_id_text())
                ),
            }
            return self.pump_streams(false);
        }
        if chunk.offset != s.acked || s.inflight.is_some() {
            return; // overtaken (e.g. a reconnect reset); the next pass reads again
        }
        // While the workload runs, a chunk ends at a line end (unless one line fills it).
        let mut data = chunk.data;
        let read_end = chunk.offset.saturating_add(data.len() as u64);
        if !ending {
            match data.iter().rposition(|b| *b == b'\n') {
                Some(pos) => data.truncate(pos.saturating_add(1)),
                None if data.len() < CHUNK => data.clear(),
                // One line fills the chunk: shipped as a piece of it, ending on a whole
                // character (D32: a line never has to fit in memory).
                None => data.truncate(utf8_cut(&data, CHUNK)),
            }
        } else if chunk.file_len > read_end {
            data.truncate(utf8_cut(&data, CHUNK));
        }
        let end = chunk.offset.saturating_add(data.len() as u64);
        s.more = chunk.file_len > end;
        if data.is_empty() {
            if ending {
                s.drained = true;
                let rest = std::mem::take(&mut s.partial);
                mirror(&tag, i, &rest, true, &mut Vec::new());
            }
            return;
        }
        // Mirror what the console has not seen yet.
        if end > s.mirrored {
            let from = s.mirrored.saturating_sub(chunk.offset) as usize;
            let mut partial = std::mem::take(&mut s.partial);
            let fresh = data.get(from.min(data.len())..).unwrap_or_default();
            mirror(&tag, i, fresh, false, &mut partial);
            s.partial = partial;
            s.mirrored = end;
        }
        if !connected {
            return; // read again after the reconnect, from the acknowledged cursor
        }
        let mut body = json!({
            "instance_uuid": uuid,
            "log_type": stream_name(i),
            "log_content": log_content(&data),
            "workload_request_id": meta_rid,
            "offset": chunk.offset.saturating_add(s.base),
            "length": data.len(),
        });
        if let Some(o) = body.as_object_mut() {
            if s.dropped_unsent > 0 {
                // The max_log_bytes cap cut these bytes before they were shipped.
                o.insert(
                    "dropped".into(),
                    json!(std::mem::take(&mut s.dropped_unsent)),
                );
            }
            if let Some(wl) = meta_wl {
                o.insert("workload_uuid".into(), json!(wl));
            }
        }
        s.inflight = Some((chunk.offset, data.len() as u64));
        s.budget = s.budget.saturating_sub(data.len() as u64);
        let topic = self.topics.logs(&uuid);
        let op = Op::Log(chunk.key.clone());
        if standalone {
            // No backend acknowledges logs: published once, counted as delivered.
            self.request(op, &topic, body, self.s.tuning.request_timeout);
            self.on_log_ack(&chunk.key, true);
        } else {
            self.request(op, &topic, body, self.s.tuning.request_timeout);
        }
    }

    pub(super) fn on_log_ack(&mut self, key: &Key, ok: bool) {
        let Some(a) = self.active.get_mut(&key.safe_id) else {
            return;
        };
        let Some(s) = a.streams.get_mut(key.stream) else {
            return;
        };
        let Some((offset, len)) = s.inflight.take() else {
            return;
        };
        if !ok {
            return; // sent again from the acknowledged cursor at the next pass
        }
        if offset == s.acked {
            s.acked = offset.saturating_add(len);
            self.metrics.log_bytes = self.metrics.log_bytes.saturating_add(len);
            let cursor = Cursor {
                stdout: a.streams[0].acked,
                stderr: a.streams[1].acked,
                stdout_base: a.streams[0].base,
                stderr_base: a.streams[1].base,
            };
            if let Ok(json) = serde_json::to_vec(&cursor) {
                let path = self.layout.dir(&key.safe_id).join("cursor.json");
                if let Err(e) = crate::store::write_atomic(&path, &json, 0o600) {
                    // A full disk: once a minute, not once per chunk (D28).
                    if let Some(held) = self.disk_errors.ready(self.clock.now()) {
                        log::warn!(
                            "cannot persist the log cursor {}: {e}{}",
                            crate::logtext::shown(&path.display().to_string()),
                            super::workloads::held_note(held)
                        );
                    }
                }
            }
        }
        self.pump_streams(false);
    }

    /// Forgets chunks in flight (after a lost connection): they are read and sent again.
    pub(super) fn reset_streams(&mut self) {
        for a in self.active.values_mut() {
            for s in a.streams.iter_mut() {
                s.inflight = None;
            }
        }
        self.session.forget(|op| matches!(op, Op::Log(_)));
    }

    /// True once every stream of a finished workload reached the end of its file, or the drain
    /// limit passed.
    pub(super) fn drained(&self, id: &str, now: Instant) -> bool {
        let Some(a) = self.active.get(id) else {
            return true;
        };
        let Phase::Draining { until, .. } = &a.phase else {
            return false;
        };
        if now >= *until {
            let left: Vec<String> = a
                .streams
                .iter()
                .enumerate()
                .filter(|(_, s)| !s.drained)
                .map(|(i, _)| stream_name(i).to_string())
                .collect();
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
        a.streams
            .iter()
            .all(|s| s.drained && s.inflight.is_none() && !s.reading)
    }
}

impl Node {
    /// Ships the install script's output (captured in `install_logs/`) once, after the first
    /// registration: the last 1 MiB of each stream at most, in 64 KiB chunks.
    pub(super) fn ship_install_logs(&mut self) {
        if self.install_logs_shipped || !self.session.registered() {
            return;
        }
        self.install_logs_shipped = true;
        let uuid = self.uuid().to_string();
        let dir = self.s.config_dir.value.join("install_logs");
        for name in STREAM_NAMES {
            let text = crate::workload::tail(&dir.join(format!("install.{name}.log")), 1024 * 1024);
            let bytes = text.as_bytes();
            let mut offset = 0;
            while offset < bytes.len() {
                let end = install_chunk_end(&text, offset);
                let piece = text.get(offset..end).unwrap_or_default();
                let body = json!({
                    "instance_uuid": uuid,
                    "log_type": name,
                    "log_content": piece.strip_suffix('\n').unwrap_or(piece),
                    "source": "install",
                });
                let topic = self.topics.logs(&uuid);
                self.request(
                    Op::WorkloadStatus,
                    &topic,
                    body,
                    self.s.tuning.request_timeout,
                );
                offset = end;
            }
        }
    }
}

/// The `log_content` of a chunk: its lines joined with `\n`, with no trailing newline
/// (protocol §2.6.4), so the one line end a chunk stops at is left out. `offset` and `length`
/// still count the bytes of the file, that line end included, so the next chunk starts at
/// `offset + length`; a backend rebuilding the file by offset adds a `\n` wherever `length`
/// exceeds the content's bytes by one. Invalid UTF-8 becomes U+FFFD.
pub fn log_content(data: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(data.strip_suffix(b"\n").unwrap_or(data))
}

/// Where an install-log chunk that starts at `from` ends: after the last line end within
/// `CHUNK` bytes, else at `CHUNK` bytes back to a character boundary, else at the text's end.
fn install_chunk_end(text: &str, from: usize) -> usize {
    let limit = from.saturating_add(CHUNK).min(text.len());
    if limit >= text.len() {
        return text.len();
    }
    let window = text.get(from..limit).unwrap_or_default();
    if let Some(p) = window.rfind('\n') {
        return from.saturating_add(p).saturating_add(1);
    }
    let mut end = limit;
    while end > from && !text.is_char_boundary(end) {
        end = end.saturating_sub(1);
    }
    if end == from {
        text.len()
    } else {
        end
    }
}

/// Writes the workload's output as tagged lines, `[workload <tag> <stream>] <line>`, to the
/// node's stdout (workload stdout) or stderr (workload stderr). A line ends at `\n`, at `\r\n`
/// or at a lone `\r` (a progress bar's redraw: each gets its own tag, so no text can appear on
/// the console without one); a line longer than [`CHUNK`] is written in pieces of at most that
/// size, each tagged. What follows the last line end waits in `partial` (at most [`CHUNK`]
/// bytes) unless `last` is set.
fn mirror(tag: &str, stream: usize, data: &[u8], last: bool, partial: &mut Vec<u8>) {
    partial.extend_from_slice(data);
    let name = STREAM_NAMES.get(stream).copied().unwrap_or("stdout");
    let prefix = format!("[workload {} {name}] ", crate::logtext::shown(tag));
    let mut out = Vec::new();
    let used = tag_lines(prefix.as_bytes(), partial, last, CHUNK, &mut out);
    partial.drain(..used.min(partial.len()));
    if out.is_empty() {
        return;
    }
    if stream == 0 {
        let mut o = std::io::stdout().lock();
        let _ = o.write_all(&out);
        let _ = o.flush();
    } else {
        let mut e = std::io::stderr().lock();
        let _ = e.write_all(&out);
        let _ = e.flush();
    }
}

/// Appends the lines of `buf` to `out`, each as `prefix`, the line (invalid UTF-8 replaced) and
/// its line end (`\n`, or `\r\n` for a `\r`); returns how many bytes of `buf` were used. A line
/// over `piece` bytes is cut (on a character boundary) into tagged pieces ending in `\n`. Without
/// `last`, an unfinished line (or a `\r` that may yet be followed by `\n`) is left unused.
fn tag_lines(prefix: &[u8], buf: &[u8], last: bool, piece: usize, out: &mut Vec<u8>) -> usize {
    let mut start = 0;
    loop {
        let rest = buf.get(start..).unwrap_or_default();
        if rest.is_empty() {
            return start;
        }
        let term = rest.iter().position(|b| *b == b'\n' || *b == b'\r');
        let line_len = term.unwrap_or(rest.len());
        let (len, used, end): (usize, usize, &[u8]) = if line_len > piece {
            let cut = utf8_cut(rest, piece);
            (cut, cut, b"\n")
        } else {
            match term.map(|p| (p, rest.get(p), rest.get(p.saturating_add(1)))) {
                Some((p, Some(b'\n'), _)) => (p, p.saturating_add(1), b"\n"),
                Some((p, _, Some(b'\n'))) => (p, p.saturating_add(2), b"\r\n"),
                Some((p, _, Some(_))) => (p, p.saturating_add(1), b"\r\n"),
                Some((p, _, None)) if last => (p, p.saturating_add(1), b"\r\n"),
                None if last => (rest.len(), rest.len(), b"\n"),
                _ => return start, // wait for the rest of the line
            }
        };
        out.extend_from_slice(prefix);
        out.extend_from_slice(
            String::from_utf8_lossy(rest.get(..len).unwrap_or_default()).as_bytes(),
        );
        out.extend_from_slice(end);
        start = start.saturating_add(used).min(buf.len());
    }
}

/// The longest prefix of `bytes`, at most `max` long, that does not end inside a UTF-8
/// character (so a piece of text cut there reads back unchanged); never 0 for a non-empty
/// input.
fn utf8_cut(bytes: &[u8], max: usize) -> usize {
    let n = max.min(bytes.len());
    for back in 1..=3usize {
        let Some(idx) = n.checked_sub(back) else {
            return n;
        };
        let b = bytes.get(idx).copied().unwrap_or(0);
        if b & 0b1100_0000 == 0b1000_0000 {
            continue; // a continuation byte: look further back for the lead
        }
        let width: usize = match b {
            0xc0..=0xdf => 2,
            0xe0..=0xef => 3,
            0xf0..=0xf7 => 4,
            _ => 1,
        };
        return if idx > 0 && idx.saturating_add(width) > n {
            idx
        } else {
            n
        };
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_content_has_no_trailing_newline() {
        assert_eq!(log_content(b"a\nb\n"), "a\nb");
        assert_eq!(log_content(b"a\n\n"), "a\n", "an empty last line stays");
        assert_eq!(log_content(b"partial"), "partial");
        assert_eq!(log_content(b"\n"), "");
        assert_eq!(log_content(b"crlf\r\n"), "crlf\r");
        assert_eq!(log_content(b"bad \xff\n"), "bad \u{FFFD}");
        assert_eq!(log_content(b""), "");
    }

    #[test]
    fn install_chunks_end_at_line_ends_and_char_boundaries() {
        assert_eq!(install_chunk_end("short\ntext", 0), 10);
        let lines = "x".repeat(100) + "\n";
        let text = lines.repeat(1000); // 101 000 bytes
        let end = install_chunk_end(&text, 0);
        assert!(end <= CHUNK && text[..end].ends_with('\n'), "{end}");
        assert_eq!(install_chunk_end(&text, end), text.len());
        // One huge line of 3-byte characters: cut on a boundary, never mid-character.
        let wide = "\u{20ac}".repeat(30_000);
        let end = install_chunk_end(&wide, 0);
        assert!(end <= CHUNK && wide.is_char_boundary(end) && end > 0);
        assert_eq!(install_chunk_end(&wide, end), wide.len());
    }

    fn tagged(buf: &[u8], last: bool, piece: usize) -> (String, usize) {
        let mut out = Vec::new();
        let used = tag_lines(b"[T] ", buf, last, piece, &mut out);
        (String::from_utf8(out).unwrap(), used)
    }

    #[test]
    fn every_line_of_a_chunk_is_tagged_and_an_unfinished_one_waits() {
        assert_eq!(
            tagged(b"a\nb\n\nc", false, 100),
            ("[T] a\n[T] b\n[T] \n".into(), 5)
        );
        assert_eq!(tagged(b"c", true, 100), ("[T] c\n".into(), 1));
        assert_eq!(tagged(b"", true, 100), (String::new(), 0));
    }

    #[test]
    fn a_carriage_return_cannot_hide_the_tag() {
        // A lone \r (a progress bar) ends a line of its own; \r\n is one line end.
        assert_eq!(
            tagged(b"10%\r20%\rforged\r\nx\n", false, 100),
            ("[T] 10%\r\n[T] 20%\r\n[T] forged\r\n[T] x\n".into(), 18)
        );
        // A \r at the end of what was read may yet be followed by \n: it waits.
        assert_eq!(tagged(b"a\r", false, 100), (String::new(), 0));
        assert_eq!(tagged(b"a\r", true, 100), ("[T] a\r\n".into(), 2));
    }

    #[test]
    fn a_line_split_across_chunks_is_written_once_with_one_tag() {
        let mut partial = Vec::new();
        let mut out = Vec::new();
        for part in [&b"hel"[..], b"lo wo", b"rld\nnext"] {
            partial.extend_from_slice(part);
            let used = tag_lines(b"[T] ", &partial, false, 100, &mut out);
            partial.drain(..used);
        }
        assert_eq!(String::from_utf8(out).unwrap(), "[T] hello world\n");
        assert_eq!(partial, b"next");
    }

    #[test]
    fn a_line_without_end_is_written_in_tagged_pieces_on_character_boundaries() {
        let text = "é".repeat(10); // 20 bytes
        let (out, used) = tagged(text.as_bytes(), false, 7);
        // 7 bytes would cut an é: pieces of 6; the last 2 bytes (under the piece size) wait.
        assert_eq!(out, "[T] ééé\n[T] ééé\n[T] ééé\n");
        assert_eq!(used, 18);
        let mut out = Vec::new();
        let mut partial = Vec::new();
        let big = vec![b'x'; 10 * CHUNK + 5];
        for c in big.chunks(CHUNK) {
            partial.extend_from_slice(c);
            let used = tag_lines(b"[T] ", &partial, false, CHUNK, &mut out);
            partial.drain(..used);
            assert!(partial.len() <= CHUNK, "what waits stays bounded");
        }
        let used = tag_lines(b"[T] ", &partial, true, CHUNK, &mut out);
        assert_eq!(used, partial.len());
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().count(), 11);
        assert!(text
            .lines()
            .all(|l| l.starts_with("[T] ") && l.len() <= CHUNK + 4));
        let joined: String = text.lines().map(|l| &l[4..]).collect();
        assert_eq!(joined.len(), big.len());
    }

    #[test]
    fn utf8_cut_never_splits_a_character_and_never_returns_zero() {
        let s = "aé✓😀".as_bytes(); // 1 + 2 + 3 + 4 bytes
        let cuts: Vec<usize> = (0..=s.len()).map(|m| utf8_cut(s, m)).collect();
        assert_eq!(cuts, vec![0, 1, 1, 3, 3, 3, 6, 6, 6, 6, 10]);
        assert_eq!(
            utf8_cut("😀".as_bytes(), 2),
            2,
            "never 0: invalid text is cut anyway"
        );
        assert_eq!(utf8_cut(b"\xff\xfe\xfd", 2), 2);
        assert_eq!(utf8_cut(b"ab", 100), 2);
        assert_eq!(utf8_cut(b"", 5), 0);
    }
}
