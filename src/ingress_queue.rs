//! The durable queue of workflow execution events (`<state dir>/ingress/`, D67). An event is
//! written to its own file before `emit` is answered and removed once the broker acknowledged
//! it; its payload waits on disk, never in memory: the queue keeps a few facts per event (its
//! order, owner, size, label and send state) and reads the file back when the event is sent,
//! so the node's memory does not grow with the queue.
//!
//! **Bounds.** The queue holds at most [`MAX_QUEUED_EVENTS`] events and `max_bytes` bytes of
//! them (their files); one workload at most a quarter of each. An event that does not fit is
//! refused ([`Full`]) and nothing is written. The node's own reports of its workloads (two per
//! workload) are not held to the bounds.
//!
//! **Order.** Events are sent in order per execution (a `started` before its node events and
//! its `finished`), one in flight per execution, up to [`MAX_IN_FLIGHT`] executions at once;
//! there is no order across executions. So an event the broker refuses (an ACL deny, retried
//! a few times, then set aside) holds back only the events of its own execution.
//!
//! **Refusals.** A refusal in the PUBACK names its event. A broker that drops the connection
//! instead names nothing: when several events were in flight, each becomes a suspect and is
//! sent alone until it is acknowledged (a suspect that is alone in flight when the connection
//! drops is the one refused), so that another workload's event is never blamed for it.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::outbox::{
    now_nanos, parse_entry, Item, MAX_REFUSALS, MAX_SEQ, REFUSAL_RETRY, REFUSAL_WINDOW,
};

/// How many events may wait in the queue at most (a workload: a quarter of it).
pub const MAX_QUEUED_EVENTS: usize = 4096;
/// Executions with an event in flight at once.
pub const MAX_IN_FLIGHT: usize = 16;
/// Longest label kept in memory for log lines.
const MAX_LABEL: usize = 200;

/// Why an event was not queued.
#[derive(Debug, Clone, PartialEq)]
pub enum Full {
    /// The queue as a whole: `(bytes waiting, the bound)`.
    Bytes(u64, u64),
    /// This workload's share: `(its bytes waiting, its share)`.
    Share(u64, u64),
    /// Too many events: `(events waiting, the bound)`.
    Events(usize, usize),
    /// Too many events of this workload: `(its events, its share)`.
    ShareEvents(usize, usize),
}

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Full::Bytes(q, max) => write!(
                f,
                "the node's workflow event queue is full ({q} bytes wait to be sent, at most {max}: the broker is away or slow)"
            ),
            Full::Share(q, max) => write!(
                f,
                "this workload's events waiting to be sent take {q} bytes, its share of the node's queue is {max} (a quarter; the broker is away or slow)"
            ),
            Full::Events(q, max) => write!(
                f,
                "the node's workflow event queue is full ({q} events wait to be sent, at most {max}: the broker is away or slow)"
            ),
            Full::ShareEvents(q, max) => write!(
                f,
                "this workload has {q} events waiting to be sent, its share of the node's queue is {max} (a quarter; the broker is away or slow)"
            ),
        }
    }
}

/// What the queue keeps of one event (never its payload, unless its file could not be written).
#[derive(Debug)]
struct Entry {
    /// Events of one execution go in order: `<workflow>/<execution>`, or the file's own name
    /// for one that names no execution.
    order: String,
    owner: Option<String>,
    bytes: u64,
    label: String,
    /// The event itself, only while its file cannot be written (a full disk, D28).
    unwritten: Option<Item>,
    in_flight: bool,
    sent_at: Option<Instant>,
    next_try: Option<Instant>,
    attempts: u32,
    refusals: u32,
    /// In flight when the connection dropped beside others: sent alone from now on (see the
    /// module's comment).
    suspect: bool,
}

pub struct EventQueue {
    dir: PathBuf,
    next_seq: u64,
    entries: BTreeMap<u64, Entry>,
    /// Invalid files that could not be moved aside: skipped from then on.
    refused: BTreeSet<u64>,
    bytes: u64,
    max_bytes: u64,
}

/// The order key of an event: its workflow and execution, read from the topic (or, for a
/// `started`, from its body).
fn order_of(item: &Item, seq: u64) -> String {
    let mut parts = item.topic.split('/');
    let workflow = parts.by_ref().skip_while(|p| *p != "workflow").nth(1);
    let execution = match parts.next().and_then(|_| parts.next()) {
        Some("started") => item
            .body
            .get("execution_uuid")
            .and_then(serde_json::Value::as_str),
        other => other,
    };
    match (workflow, execution) {
        (Some(w), Some(e)) => format!("{w}/{e}"),
        _ => format!("#{seq}"),
    }
}

fn file_name(seq: u64) -> String {
    format!("{seq:020}.json")
}

impl EventQueue {
    /// Loads what a previous run (or `emit` while the node was down) left; a file that is not
    /// a valid entry is quarantined.
    pub fn load(dir: PathBuf, max_bytes: u64) -> std::io::Result<EventQueue> {
        crate::store::ensure_dir_or_quarantine(&dir)?;
        let mut q = EventQueue {
            dir,
            next_seq: 1,
            entries: BTreeMap::new(),
            refused: BTreeSet::new(),
            bytes: 0,
            max_bytes: max_bytes.max(1),
        };
        q.rescan();
        Ok(q)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of the events waiting (their files).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn in_flight_count(&self) -> usize {
        self.entries.values().filter(|e| e.in_flight).count()
    }

    /// Whether `seq` was sent and awaits its acknowledgement.
    pub fn in_flight(&self, seq: u64) -> bool {
        self.entries.get(&seq).is_some_and(|e| e.in_flight)
    }

    /// Picks up events another process wrote into the folder since the last look.
    pub fn rescan(&mut self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in rd.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(seq) = name
                .strip_suffix(".json")
                .and_then(|s| s.parse::<u64>().ok())
            else {
                continue;
            };
            if self.entries.contains_key(&seq) || self.refused.contains(&seq) {
                continue;
            }
            let path = entry.path();
            if seq > MAX_SEQ {
                let why =
                    format!("queue sequence number {seq} is out of range (at most {MAX_SEQ})");
                if crate::store::quarantine(&path, &why).is_err() {
                    self.refused.insert(seq);
                }
                continue;
            }
            match crate::store::read_state_file(&path, crate::store::MAX_ENTRY_BYTES)
                .and_then(|b| parse_entry(&b).map(|item| (b.len() as u64, item)))
            {
                Ok((bytes, item)) => {
                    self.insert(seq, &item, bytes, None);
                    self.next_seq = self.next_seq.max(seq.saturating_add(1));
                }
                Err(crate::store::StoreError::Missing) => {}
                Err(e) => {
                    let why = format!("not a valid queue entry: {e}");
                    if crate::store::quarantine(&path, &why).is_err() {
                        self.refused.insert(seq);
                    }
                }
            }
        }
    }

    fn insert(&mut self, seq: u64, item: &Item, bytes: u64, unwritten: Option<Item>) {
        let entry = Entry {
            order: order_of(item, seq),
            owner: item.owner.clone(),
            bytes,
            label: item.label.chars().take(MAX_LABEL).collect(),
            unwritten,
            in_flight: false,
            sent_at: None,
            next_try: None,
            attempts: 0,
            refusals: 0,
            suspect: false,
        };
        self.bytes = self.bytes.saturating_add(bytes);
        self.entries.insert(seq, entry);
    }

    /// Whether an event of `bytes` from workload `owner` fits the bounds (see the module's
    /// comment).
    pub fn room(&self, owner: &str, bytes: u64) -> Result<(), Full> {
        let queued = self.bytes.saturating_add(bytes);
        if queued > self.max_bytes {
            return Err(Full::Bytes(self.bytes, self.max_bytes));
        }
        if self.entries.len() >= MAX_QUEUED_EVENTS {
            return Err(Full::Events(self.entries.len(), MAX_QUEUED_EVENTS));
        }
        let (mut mine, mut count) = (0u64, 0usize);
        for e in self.entries.values() {
            if e.owner.as_deref() == Some(owner) {
                mine = mine.saturating_add(e.bytes);
                count = count.saturating_add(1);
            }
        }
        let share = self.max_bytes / 4;
        if mine.saturating_add(bytes) > share {
            return Err(Full::Share(mine, share));
        }
        if count >= MAX_QUEUED_EVENTS / 4 {
            return Err(Full::ShareEvents(count, MAX_QUEUED_EVENTS / 4));
        }
        Ok(())
    }

    /// The bytes an event takes in the queue (its file).
    pub fn size_of(item: &Item) -> u64 {
        serde_json::to_vec(item).map_or(0, |v| v.len() as u64)
    }

    /// Writes the event durably and queues it. When its file cannot be written, `Err`; with
    /// `keep`, it is queued all the same, kept in memory until the disk takes it (D28).
    pub fn push(&mut self, item: Item, keep: bool) -> Result<u64, std::io::Error> {
        let seq = self.next_seq.max(now_nanos());
        let json = serde_json::to_vec(&item).map_err(std::io::Error::other)?;
        let written = crate::store::write_atomic(&self.dir.join(file_name(seq)), &json, 0o600);
        if written.is_ok() || keep {
            self.next_seq = seq.saturating_add(1);
            let unwritten = written.is_err().then(|| item.clone());
            self.insert(seq, &item, json.len() as u64, unwritten);
        }
        written.map(|()| seq)
    }

    pub fn has_pending_writes(&self) -> bool {
        self.entries.values().any(|e| e.unwritten.is_some())
    }

    /// Writes the events a full disk kept in memory; returns how many are still not written.
    pub fn persist_pending(&mut self) -> usize {
        let mut left = 0usize;
        for (seq, e) in &mut self.entries {
            let Some(item) = &e.unwritten else {
                continue;
            };
            let written = serde_json::to_vec(item)
                .map_err(std::io::Error::other)
                .and_then(|json| {
                    crate::store::write_atomic(&self.dir.join(file_name(*seq)), &json, 0o600)
                });
            if written.is_ok() {
                e.unwritten = None;
            } else {
                left = left.saturating_add(1);
            }
        }
        left
    }

    /// The event as it was queued: read back from its file.
    pub fn item(&self, seq: u64) -> Result<Item, crate::store::StoreError> {
        let e = self
            .entries
            .get(&seq)
            .ok_or(crate::store::StoreError::Missing)?;
        if let Some(item) = &e.unwritten {
            return Ok(item.clone());
        }
        let bytes = crate::store::read_state_file(
            &self.dir.join(file_name(seq)),
            crate::store::MAX_ENTRY_BYTES,
        )?;
        parse_entry(&bytes)
    }

    pub fn label(&self, seq: u64) -> Option<&str> {
        self.entries.get(&seq).map(|e| e.label.as_str())
    }

    /// The events to send now: the oldest event of each execution with none in flight, when
    /// due, up to [`MAX_IN_FLIGHT`] in flight; a suspect goes alone.
    pub fn due(&self, now: Instant) -> Vec<u64> {
        let in_flight: Vec<&Entry> = self.entries.values().filter(|e| e.in_flight).collect();
        if in_flight.iter().any(|e| e.suspect) {
            return Vec::new();
        }
        let room = MAX_IN_FLIGHT.saturating_sub(in_flight.len());
        let mut seen: HashSet<&str> = HashSet::new();
        let mut out = Vec::new();
        for (seq, e) in &self.entries {
            if out.len() >= room {
                break;
            }
            if !seen.insert(e.order.as_str()) || e.in_flight {
                continue; // an older event of its execution comes first
            }
            if e.next_try.is_some_and(|t| t > now) {
                continue;
            }
            if e.suspect {
                // Alone, or not yet: nothing else goes while it waits for the others.
                return if in_flight.is_empty() && out.is_empty() {
                    vec![*seq]
                } else {
                    out
                };
            }
            out.push(*seq);
        }
        out
    }

    /// When [`EventQueue::due`] next has something that waits for its time (`None`: nothing
    /// waits on a timer).
    pub fn next_try(&self) -> Option<Instant> {
        let mut seen: HashSet<&str> = HashSet::new();
        self.entries
            .values()
            .filter(|e| seen.insert(e.order.as_str()) && !e.in_flight)
            .filter_map(|e| e.next_try)
            .min()
    }

    pub fn sent(&mut self, seq: u64, now: Instant) {
        if let Some(e) = self.entries.get_mut(&seq) {
            e.in_flight = true;
            e.attempts = e.attempts.saturating_add(1);
            e.sent_at = Some(now);
        }
    }

    /// Takes `seq` out of the queue and moves its file into the state dir's quarantine folder
    /// (never sent again). Returns its label and where its file went.
    pub fn quarantine(&mut self, seq: u64) -> Option<(String, PathBuf)> {
        let e = self.entries.remove(&seq)?;
        self.bytes = self.bytes.saturating_sub(e.bytes);
        let from = self.dir.join(file_name(seq));
        let to = crate::store::move_to_quarantine(&from).unwrap_or_else(|_| {
            let _ = std::fs::remove_file(&from);
            crate::store::state_dir_of(&from).join(crate::store::QUARANTINE_DIR)
        });
        Some((e.label, to))
    }

    /// The broker acknowledged it: gone for good. Returns its label.
    pub fn acknowledged(&mut self, seq: u64) -> Option<String> {
        let e = self.entries.remove(&seq)?;
        self.bytes = self.bytes.saturating_sub(e.bytes);
        let _ = std::fs::remove_file(self.dir.join(file_name(seq)));
        Some(e.label)
    }

    /// No answer (or a transient refusal): try again after a backoff.
    pub fn retry_later(&mut self, seq: u64, now: Instant) {
        if let Some(e) = self.entries.get_mut(&seq) {
            e.in_flight = false;
            const BACKOFF_S: [u64; 7] = [1, 2, 4, 8, 16, 32, 60];
            let secs = usize::try_from(e.attempts)
                .ok()
                .and_then(|a| BACKOFF_S.get(a))
                .copied()
                .unwrap_or(60);
            e.next_try = now.checked_add(Duration::from_secs(secs));
        }
    }

    /// The broker refused `seq` in its PUBACK, or it can never be sent (`permanent`): set
    /// aside at once when permanent or at the [`MAX_REFUSALS`]th refusal (returned, for the
    /// caller's log line), else tried again after [`REFUSAL_RETRY`].
    pub fn refused(
        &mut self,
        seq: u64,
        permanent: bool,
        now: Instant,
    ) -> Option<(String, PathBuf)> {
        let e = self.entries.get_mut(&seq)?;
        e.refusals = e.refusals.saturating_add(1);
        if permanent || e.refusals >= MAX_REFUSALS {
            return self.quarantine(seq);
        }
        e.in_flight = false;
        e.next_try = now.checked_add(REFUSAL_RETRY);
        None
    }

    /// The connection dropped: everything in flight goes again after the reconnect. When one
    /// event alone was in flight within [`REFUSAL_WINDOW`] of the loss, the loss counts as its
    /// refusal ([`MAX_REFUSALS`] of them set it aside: returned); when several were, none is
    /// blamed and each becomes a suspect, sent alone (see the module's comment).
    pub fn reset_in_flight(&mut self, now: Instant) -> Vec<(String, PathBuf)> {
        let recent: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                e.in_flight
                    && e.sent_at
                        .is_some_and(|t| now.saturating_duration_since(t) <= REFUSAL_WINDOW)
            })
            .map(|(s, _)| *s)
            .collect();
        for e in self.entries.values_mut() {
            if std::mem::take(&mut e.in_flight) {
                e.next_try = None;
            }
        }
        let mut aside = Vec::new();
        match recent.as_slice() {
            [one] => {
                let refused = self.entries.get_mut(one).is_some_and(|e| {
                    e.refusals = e.refusals.saturating_add(1);
                    e.suspect = true;
                    e.refusals >= MAX_REFUSALS
                });
                if refused {
                    aside.extend(self.quarantine(*one));
                }
            }
            several => {
                for seq in several {
                    if let Some(e) = self.entries.get_mut(seq) {
                        e.suspect = true;
                    }
                }
            }
        }
        aside
    }
}

/// The room left in the queue folder for an event that `emit` writes itself while the node is
/// down: the node cannot share the queue out then, so all such events together get one
/// workload's share (a quarter of [`crate::ingress::MAX_QUEUE_BYTES`] and of the events).
pub fn room_while_down(dir: &Path, bytes: u64) -> Result<(), Full> {
    let share = crate::ingress::MAX_QUEUE_BYTES / 4;
    let (mut queued, mut count) = (0u64, 0usize);
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let name = e.file_name();
            let is_entry = name
                .to_str()
                .and_then(|n| n.strip_suffix(".json"))
                .is_some_and(|seq| !seq.is_empty() && seq.bytes().all(|b| b.is_ascii_digit()));
            if is_entry {
                queued = queued.saturating_add(e.metadata().map_or(0, |m| m.len()));
                count = count.saturating_add(1);
            }
        }
    }
    if queued.saturating_add(bytes) > share {
        return Err(Full::Share(queued, share));
    }
    if count >= MAX_QUEUED_EVENTS / 4 {
        return Err(Full::ShareEvents(count, MAX_QUEUED_EVENTS / 4));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
