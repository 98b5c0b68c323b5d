//! Live log streaming (R4) and console mirroring. Per stream the node keeps the acknowledged
//! cursor (persisted), at most one chunk in flight (so chunks arrive in order, with no gap and
//! no duplicate from the node's side), and a per-interval byte budget (so a workload writing
//! gigabytes cannot starve commands or heartbeats; the file on disk stays complete and the
//! stream catches up over time).

use std::io::Write;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{Node, Op};
use crate::workload::tail::{Chunk, Key, ReadRequest};

/// Largest chunk read and published at once.
pub const CHUNK: usize = 64 * 1024;
/// Bytes a stream may ship per stream interval (a flood is shipped at this pace).
pub const BUDGET_PER_INTERVAL: u64 = 4 * 1024 * 1024;
/// How long a finished workload's streams may take to drain before its completion goes out
/// anyway.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(60);

pub const STREAM_NAMES: [&str; 2] = ["stdout", "stderr"];

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
            let ending = a.ending.is_some();
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
            self.next_stream_pass = now + self.s.log_stream_interval.value;
        }
    }

    pub(super) fn on_chunk(&mut self, chunk: Chunk) {
        let connected =
            self.conn == super::Conn::Connected && self.reg == super::Registration::Done;
        let uuid = self.uuid().to_string();
        let standalone = self.s.standalone;
        let Some(a) = self.active.get_mut(&chunk.key.safe_id) else {
            return;
        };
        let ending = a.ending.is_some();
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
        let s = &mut a.streams[i];
        s.reading = false;
        if let Some(result) = chunk.cut {
            match result {
                Ok(cut) if cut > 0 => {
                    let unsent = cut.saturating_sub(s.acked);
                    log::warn!(
                        "{} {}: {} log over max_log_bytes ({}); dropped its oldest {cut} bytes ({unsent} never shipped)",
                        a.meta.kind,
                        a.meta.request_id_text(),
                        STREAM_NAMES[i],
                        self.s.max_log_bytes.value
                    );
                    s.base += cut;
                    s.dropped_unsent += unsent;
                    s.acked = s.acked.saturating_sub(cut);
                    s.mirrored = s.mirrored.saturating_sub(cut);
                }
                Ok(_) => {}
                Err(e) => log::warn!("cannot cap a log of {}: {e}", a.meta.request_id_text()),
            }
            return self.pump_streams(false);
        }
        if chunk.offset != s.acked || s.inflight.is_some() {
            return; // overtaken (e.g. a reconnect reset); the next pass reads again
        }
        // While the workload runs, a chunk ends at a line end (unless one line fills it).
        let mut data = chunk.data;
        if !ending {
            match data.iter().rposition(|b| *b == b'\n') {
                Some(pos) => data.truncate(pos + 1),
                None if data.len() < CHUNK => data.clear(),
                None => {}
            }
        }
        let end = chunk.offset + data.len() as u64;
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
            mirror(&tag, i, &data[from.min(data.len())..], false, &mut partial);
            s.partial = partial;
            s.mirrored = end;
        }
        if !connected {
            return; // read again after the reconnect, from the acknowledged cursor
        }
        let mut body = json!({
            "instance_uuid": uuid,
            "log_type": STREAM_NAMES[i],
            "log_content": String::from_utf8_lossy(&data),
            "workload_request_id": meta_rid,
            "offset": chunk.offset + s.base,
            "length": data.len(),
        });
        if s.dropped_unsent > 0 {
            // The max_log_bytes cap cut these bytes before they were shipped.
            body["dropped"] = json!(std::mem::take(&mut s.dropped_unsent));
        }
        if let Some(wl) = meta_wl {
            body["workload_uuid"] = json!(wl);
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
        let s = &mut a.streams[key.stream];
        let Some((offset, len)) = s.inflight.take() else {
            return;
        };
        if !ok {
            return; // sent again from the acknowledged cursor at the next pass
        }
        if offset == s.acked {
            s.acked = offset + len;
            self.metrics.log_bytes += len;
            let cursor = Cursor {
                stdout: a.streams[0].acked,
                stderr: a.streams[1].acked,
                stdout_base: a.streams[0].base,
                stderr_base: a.streams[1].base,
            };
            if let Ok(json) = serde_json::to_vec(&cursor) {
                let path = self.layout.dir(&key.safe_id).join("cursor.json");
                if let Err(e) = crate::store::write_atomic(&path, &json, 0o600) {
                    log::warn!("cannot persist the log cursor {}: {e}", path.display());
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
        self.pending.retain(|_, p| !matches!(p.op, Op::Log(_)));
    }

    /// True once every stream of a finished workload reached the end of its file, or the drain
    /// limit passed.
    pub(super) fn drained(&self, id: &str, now: Instant) -> bool {
        let Some(a) = self.active.get(id) else {
            return true;
        };
        let Some(e) = &a.ending else { return false };
        if now >= e.drain_deadline {
            let left: Vec<String> = a
                .streams
                .iter()
                .enumerate()
                .filter(|(_, s)| !s.drained)
                .map(|(i, _)| STREAM_NAMES[i].to_string())
                .collect();
            if !left.is_empty() {
                log::warn!(
                    "{} {}: {} not fully shipped before its completion (backend unreachable?)",
                    a.meta.kind,
                    a.meta.request_id_text(),
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
        if self.install_logs_shipped || self.reg != super::Registration::Done {
            return;
        }
        self.install_logs_shipped = true;
        let uuid = self.uuid().to_string();
        let dir = self.s.config_dir.value.join("install_logs");
        for (i, name) in STREAM_NAMES.iter().enumerate() {
            let text = crate::workload::tail(&dir.join(format!("install.{name}.log")), 1024 * 1024);
            let bytes = text.as_bytes();
            let mut offset = 0;
            while offset < bytes.len() {
                let mut end = (offset + CHUNK).min(bytes.len());
                while end < bytes.len() && !text.is_char_boundary(end) {
                    end -= 1;
                }
                let body = json!({
                    "instance_uuid": uuid,
                    "log_type": STREAM_NAMES[i],
                    "log_content": &text[offset..end],
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

/// Writes complete lines as `[workload <tag> <stream>] <line>` to the node's stdout (workload
/// stdout) or stderr (workload stderr); the text after the last newline waits in `partial`
/// unless `last` is set.
fn mirror(tag: &str, stream: usize, data: &[u8], last: bool, partial: &mut Vec<u8>) {
    partial.extend_from_slice(data);
    let cut = if last {
        partial.len()
    } else {
        partial
            .iter()
            .rposition(|b| *b == b'\n')
            .map(|p| p + 1)
            .unwrap_or(0)
    };
    if cut == 0 {
        return;
    }
    let text = &partial[..cut];
    let body = text.strip_suffix(b"\n").unwrap_or(text);
    let mut out = Vec::with_capacity(body.len() + 64);
    for line in body.split(|b| *b == b'\n') {
        out.extend_from_slice(format!("[workload {tag} {}] ", STREAM_NAMES[stream]).as_bytes());
        out.extend_from_slice(String::from_utf8_lossy(line).as_bytes());
        out.push(b'\n');
    }
    partial.drain(..cut);
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
