//! The durable outbox (guarantee 3): messages the backend must receive — workload completions
//! and terminal statuses — are written to `<state dir>/outbox/` before they are sent, and
//! removed only once the backend acknowledged them. A broker outage or a node restart delays a
//! message; it is never lost. (A message whose acknowledgement was lost is sent again: the
//! backend treats a repeated terminal status as a no-op.)

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Item {
    /// Topic relative to the prefix, e.g. `cyberwave/cloud-workload/{wl}/update-status`.
    pub topic: String,
    pub body: Value,
    /// For log lines: what this is.
    pub label: String,
    /// At most one queued item per key (a workload's completion): queuing it again after a
    /// crash between "queued" and "workload retired" is a no-op.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The workload that queued it (a workflow event from `emit`): its share of the ingress
    /// queue (D67).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// Longest topic an entry may carry (relative to the prefix).
pub const MAX_TOPIC_BYTES: usize = 1024;
/// Longest label kept for log lines (a longer one is cut when read back).
pub const MAX_LABEL_CHARS: usize = 512;
/// Highest sequence number accepted from a file name (far beyond any clock in nanoseconds),
/// so that the next one can always be computed.
pub const MAX_SEQ: u64 = u64::MAX / 2;

impl crate::store::Validate for Item {
    fn validate(&self) -> Result<(), crate::store::Invalid> {
        let t = &self.topic;
        let topic_ok = !t.is_empty()
            && t.len() <= MAX_TOPIC_BYTES
            && t.bytes()
                .all(|b| b.is_ascii_graphic() && b != b'+' && b != b'#')
            && !t.starts_with('/')
            && !t.ends_with('/')
            && !t.contains("//");
        if !topic_ok {
            return Err(crate::store::Invalid::Topic {
                max: MAX_TOPIC_BYTES,
            });
        }
        if !self.body.is_object() {
            return Err(crate::store::Invalid::Rule {
                field: "body",
                must: "be a JSON object",
            });
        }
        if let Some(k) = &self.key {
            crate::store::check_text("key", k, 256)?;
        }
        if let Some(o) = &self.owner {
            crate::store::check_text("owner", o, 256)?;
        }
        Ok(())
    }
}

impl Item {
    /// The label as it may appear in a log line: escaped and cut (it may hold a request id).
    fn tidy_label(&mut self) {
        let escaped: String = self.label.escape_debug().collect();
        self.label = escaped.chars().take(MAX_LABEL_CHARS).collect();
    }
}

/// Reads and validates one entry file.
fn read_entry(path: &std::path::Path) -> Result<Item, crate::store::StoreError> {
    parse_entry(&crate::store::read_state_file(
        path,
        crate::store::MAX_ENTRY_BYTES,
    )?)
}

/// The bytes of one outbox / ingress entry parsed and validated (also the entry point for
/// fuzzing).
pub fn parse_entry(bytes: &[u8]) -> Result<Item, crate::store::StoreError> {
    let mut item: Item = crate::store::parse_record(bytes)?;
    item.tidy_label();
    Ok(item)
}

struct Slot {
    item: Item,
    in_flight: Option<Vec<u8>>,
    next_try: Instant,
    attempts: u32,
    /// When it was last sent: a connection lost right after that counts as a refusal.
    sent_at: Option<Instant>,
    /// Connections lost within [`REFUSAL_WINDOW`] of sending it (D34).
    refusals: u32,
    /// Its file is written. An item that could not be written (a full disk) is kept in memory,
    /// sent all the same, and written as soon as that works (D28).
    durable: bool,
}

impl Slot {
    fn new(item: Item) -> Slot {
        Slot {
            item,
            in_flight: None,
            next_try: Instant::now(),
            attempts: 0,
            sent_at: None,
            refusals: 0,
            durable: true,
        }
    }
}

pub struct Outbox {
    dir: PathBuf,
    next_seq: u64,
    slots: BTreeMap<u64, Slot>,
    /// Invalid entries that could not be moved to the quarantine folder: skipped from then on
    /// (one ERROR line each, not one per rescan).
    refused: std::collections::BTreeSet<u64>,
}

pub const MAX_IN_FLIGHT: usize = 64;
/// A connection lost this soon after an item was sent counts as the broker refusing it.
pub const REFUSAL_WINDOW: Duration = Duration::from_secs(5);
/// An item refused this many times is set aside, never retried forever (D34).
pub const MAX_REFUSALS: u32 = 5;
/// The pause before an item the broker refused in its PUBACK is sent again.
pub const REFUSAL_RETRY: Duration = Duration::from_secs(1);

pub fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Writes an item into an outbox folder from another process (`emit` while the node is down).
pub fn write_item(dir: &std::path::Path, item: &Item) -> std::io::Result<u64> {
    crate::store::ensure_private_dir(dir)?;
    let seq = now_nanos();
    let json = serde_json::to_vec(item).map_err(std::io::Error::other)?;
    crate::store::write_atomic(&dir.join(format!("{seq:020}.json")), &json, 0o600)?;
    Ok(seq)
}

impl Outbox {
    /// Loads what a previous run left; a file that is not a valid entry is quarantined.
    pub fn load(dir: PathBuf) -> std::io::Result<Outbox> {
        crate::store::ensure_dir_or_quarantine(&dir)?;
        let mut o = Outbox {
            dir,
            next_seq: 1,
            slots: BTreeMap::new(),
            refused: std::collections::BTreeSet::new(),
        };
        o.rescan();
        Ok(o)
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// How many items were sent and await their acknowledgement.
    pub fn in_flight_count(&self) -> usize {
        self.slots
            .values()
            .filter(|s| s.in_flight.is_some())
            .count()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Picks up items another process wrote into the folder since the last look (all of them,
    /// at load); a file that is not a valid entry is quarantined (`store::quarantine`).
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
            if self.slots.contains_key(&seq) || self.refused.contains(&seq) {
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
            match read_entry(&path) {
                Ok(item) => {
                    self.slots.insert(seq, Slot::new(item));
                    self.next_seq = self.next_seq.max(seq.saturating_add(1));
                }
                // Removed meanwhile (acknowledged, or picked up by someone else).
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

    /// How often `seq` was sent without an acknowledgement so far.
    pub fn attempts(&self, seq: u64) -> u32 {
        self.slots.get(&seq).map(|s| s.attempts).unwrap_or(0)
    }

    /// The oldest item, if it is not in flight and is due (for strictly ordered sending).
    pub fn head_due(&self, now: Instant) -> Option<(u64, Item)> {
        let (seq, s) = self.slots.iter().next()?;
        (s.in_flight.is_none() && s.next_try <= now).then(|| (*seq, s.item.clone()))
    }

    /// When [`Outbox::head_due`] next returns the head (`None` while it is in flight).
    pub fn head_next_try(&self) -> Option<Instant> {
        let (_, s) = self.slots.iter().next()?;
        s.in_flight.is_none().then_some(s.next_try)
    }

    /// Whether `seq` was sent and awaits its acknowledgement.
    pub fn in_flight(&self, seq: u64) -> bool {
        self.slots.get(&seq).is_some_and(|s| s.in_flight.is_some())
    }

    pub fn has_key(&self, key: &str) -> bool {
        self.slots
            .values()
            .any(|s| s.item.key.as_deref() == Some(key))
    }

    /// Writes the item durably; it is sent by [`Outbox::due`]. Sequence numbers follow the
    /// clock (nanoseconds) so that items written by another process (`emit` while the node is
    /// down) sort in time order with the node's own.
    ///
    /// When the file cannot be written (a full disk) the item is kept in memory all the same
    /// and written later by [`Outbox::persist_pending`]; the error says it is not durable yet.
    pub fn push(&mut self, item: Item) -> Result<u64, (u64, std::io::Error)> {
        let seq = self.next_seq.max(now_nanos());
        self.next_seq = seq.saturating_add(1);
        let written = self.write(seq, &item);
        let mut slot = Slot::new(item);
        slot.durable = written.is_ok();
        self.slots.insert(seq, slot);
        written.map(|()| seq).map_err(|e| (seq, e))
    }

    fn write(&self, seq: u64, item: &Item) -> std::io::Result<()> {
        let json = serde_json::to_vec(item).map_err(std::io::Error::other)?;
        crate::store::write_atomic(&self.dir.join(format!("{seq:020}.json")), &json, 0o600)
    }

    pub fn has_pending_writes(&self) -> bool {
        self.slots.values().any(|s| !s.durable)
    }

    /// Writes the items a full disk kept in memory; returns how many are still not durable.
    pub fn persist_pending(&mut self) -> usize {
        let pending: Vec<u64> = self
            .slots
            .iter()
            .filter(|(_, s)| !s.durable)
            .map(|(k, _)| *k)
            .collect();
        let mut left = 0usize;
        for seq in pending {
            let ok = self
                .slots
                .get(&seq)
                .is_some_and(|s| self.write(seq, &s.item).is_ok());
            match self.slots.get_mut(&seq) {
                Some(s) if ok => s.durable = true,
                _ => left = left.saturating_add(1),
            }
        }
        left
    }

    /// Items to (re)send now, oldest first, at most [`MAX_IN_FLIGHT`] outstanding.
    pub fn due(&self, now: Instant) -> Vec<(u64, Item)> {
        let in_flight = self
            .slots
            .values()
            .filter(|s| s.in_flight.is_some())
            .count();
        self.slots
            .iter()
            .filter(|(_, s)| s.in_flight.is_none() && s.next_try <= now)
            .take(MAX_IN_FLIGHT.saturating_sub(in_flight))
            .map(|(k, s)| (*k, s.item.clone()))
            .collect()
    }

    /// When [`Outbox::due`] next has something to send (`None` while the in-flight limit is
    /// reached: an acknowledgement, an event, frees a place).
    pub fn next_try(&self) -> Option<Instant> {
        let in_flight = self
            .slots
            .values()
            .filter(|s| s.in_flight.is_some())
            .count();
        if in_flight >= MAX_IN_FLIGHT {
            return None;
        }
        self.slots
            .values()
            .filter(|s| s.in_flight.is_none())
            .map(|s| s.next_try)
            .min()
    }

    pub fn sent(&mut self, seq: u64, correlation: Vec<u8>) {
        if let Some(s) = self.slots.get_mut(&seq) {
            s.in_flight = Some(correlation);
            s.attempts = s.attempts.saturating_add(1);
            s.sent_at = Some(Instant::now());
        }
    }

    /// Takes `seq` out of the queue and moves its file into the state dir's quarantine folder
    /// (kept for a person to look at, never sent again). Returns the item and where its file
    /// went; the caller says so in its log line. A file that cannot be moved is deleted.
    pub fn quarantine(&mut self, seq: u64) -> Option<(Item, PathBuf)> {
        let slot = self.slots.remove(&seq)?;
        let from = self.dir.join(format!("{seq:020}.json"));
        let to = crate::store::move_to_quarantine(&from).unwrap_or_else(|_| {
            let _ = std::fs::remove_file(&from);
            crate::store::state_dir_of(&from).join(crate::store::QUARANTINE_DIR)
        });
        Some((slot.item, to))
    }

    /// The backend acknowledged it: gone for good.
    pub fn acknowledged(&mut self, seq: u64) -> Option<Item> {
        let slot = self.slots.remove(&seq)?;
        let _ = std::fs::remove_file(self.dir.join(format!("{seq:020}.json")));
        Some(slot.item)
    }

    /// No answer (or a transient refusal): try again after a backoff.
    pub fn retry_later(&mut self, seq: u64, now: Instant) {
        if let Some(s) = self.slots.get_mut(&seq) {
            s.in_flight = None;
            const BACKOFF_S: [u64; 7] = [1, 2, 4, 8, 16, 32, 60];
            let secs = usize::try_from(s.attempts)
                .ok()
                .and_then(|a| BACKOFF_S.get(a))
                .copied()
                .unwrap_or(60);
            s.next_try = now.checked_add(Duration::from_secs(secs)).unwrap_or(now);
        }
    }

    /// The broker refused `seq` without dropping the connection (a PUBACK reason ≥ 0x80: an
    /// ACL deny, a size limit), or it can never be sent as it is (`permanent`: too big for
    /// the broker). A permanent refusal, or the [`MAX_REFUSALS`]th, quarantines it and returns
    /// it so the caller can say so (D34); otherwise it is tried again after a backoff.
    pub fn refused(&mut self, seq: u64, permanent: bool, now: Instant) -> Option<(Item, PathBuf)> {
        let s = self.slots.get_mut(&seq)?;
        s.refusals = s.refusals.saturating_add(1);
        if permanent || s.refusals >= MAX_REFUSALS {
            return self.quarantine(seq);
        }
        // Not the backend's load: no long backoff, only a pause.
        s.in_flight = None;
        s.next_try = now.checked_add(REFUSAL_RETRY).unwrap_or(now);
        None
    }

    /// The connection dropped: everything in flight is sent again after the reconnect. An item
    /// sent within [`REFUSAL_WINDOW`] of the loss counts a refusal (a broker drops the
    /// connection of a client that publishes what it refuses); one refused [`MAX_REFUSALS`]
    /// times is quarantined and returned, so the caller can say so (D34).
    pub fn reset_in_flight(&mut self) -> Vec<(Item, PathBuf)> {
        let now = Instant::now();
        let mut refused = Vec::new();
        for (seq, s) in self.slots.iter_mut() {
            if s.in_flight.take().is_some() {
                s.next_try = now;
                if s.sent_at
                    .is_some_and(|t| now.saturating_duration_since(t) <= REFUSAL_WINDOW)
                {
                    s.refusals = s.refusals.saturating_add(1);
                    if s.refusals >= MAX_REFUSALS {
                        refused.push(*seq);
                    }
                }
            }
        }
        refused
            .into_iter()
            .filter_map(|seq| self.quarantine(seq))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_item_the_broker_refuses_five_times_is_quarantined_not_retried_forever() {
        let dir = std::env::temp_dir().join(format!("cw-outbox-refused-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let outbox = dir.join("outbox");
        let mut o = Outbox::load(outbox.clone()).unwrap();
        let bad = o
            .push(Item {
                topic: "t/a/#".into(),
                body: json!({}),
                label: "bad".into(),
                key: None,
                owner: None,
            })
            .unwrap();
        for round in 1..=MAX_REFUSALS {
            o.sent(bad, vec![1]);
            let out = o.reset_in_flight();
            if round < MAX_REFUSALS {
                assert!(out.is_empty(), "round {round}");
                assert_eq!(o.len(), 1);
            } else {
                assert_eq!(out.len(), 1);
                assert!(
                    out[0].1.starts_with(dir.join("quarantine")),
                    "{:?}",
                    out[0].1
                );
                assert!(out[0].1.exists());
            }
        }
        assert!(o.is_empty());
        // An item that was not in flight when the connection dropped counts nothing.
        let good = o
            .push(Item {
                topic: "t/ok".into(),
                body: json!({}),
                label: "ok".into(),
                key: None,
                owner: None,
            })
            .unwrap();
        for _ in 0..10 {
            assert!(o.reset_in_flight().is_empty());
        }
        assert!(o.in_flight(good) || o.len() == 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_item_the_broker_refuses_in_its_puback_is_retried_then_set_aside() {
        let dir = std::env::temp_dir().join(format!("cw-outbox-puback-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut o = Outbox::load(dir.join("outbox")).unwrap();
        let item = |t: &str| Item {
            topic: t.into(),
            body: json!({}),
            label: t.into(),
            key: None,
            owner: None,
        };
        let denied = o.push(item("t/denied")).unwrap();
        let other = o.push(item("t/other")).unwrap();
        let t0 = Instant::now();
        let mut now = t0;
        for round in 1..MAX_REFUSALS {
            o.sent(denied, vec![1]);
            assert!(o.refused(denied, false, now).is_none(), "round {round}");
            assert!(!o.in_flight(denied));
            // Backed off: not due at once, due later.
            assert!(o.due(now).iter().all(|(s, _)| *s != denied));
            now += REFUSAL_RETRY;
            assert!(o.due(now).iter().any(|(s, _)| *s == denied));
        }
        o.sent(denied, vec![1]);
        let (gone, aside) = o.refused(denied, false, now).unwrap();
        assert_eq!(gone.topic, "t/denied");
        assert!(aside.starts_with(dir.join("quarantine")) && aside.exists());
        // The other item is untouched, and a refusal of an unknown item is nothing.
        assert_eq!(o.due(now), vec![(other, item("t/other"))]);
        assert!(o.refused(denied, false, now).is_none());
        // Too big for the broker: set aside at the first refusal.
        assert!(o.refused(other, true, now).is_some());
        assert!(o.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn items_survive_a_restart_until_acknowledged() {
        let dir = std::env::temp_dir().join(format!("cw-outbox-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut o = Outbox::load(dir.clone()).unwrap();
        let item = |n: i32| Item {
            topic: format!("t/{n}"),
            body: json!({"n": n}),
            label: "x".into(),
            key: None,
            owner: None,
        };
        let a = o.push(item(1)).unwrap();
        let b = o.push(item(2)).unwrap();
        let now = Instant::now();
        assert_eq!(o.due(now).len(), 2);
        o.sent(a, vec![1]);
        assert_eq!(o.due(now).len(), 1, "in flight is not due");
        o.acknowledged(a);
        let mut o = Outbox::load(dir.clone()).unwrap();
        let due = o.due(Instant::now());
        assert_eq!(
            due,
            vec![(b, item(2))],
            "only the unacknowledged one is left"
        );
        let c = o.push(item(3)).unwrap();
        assert!(c > b, "sequence continues after a reload");
        o.sent(b, vec![2]);
        o.retry_later(b, Instant::now());
        assert!(
            o.due(Instant::now()).iter().all(|(s, _)| *s != b),
            "backs off"
        );
        std::fs::write(dir.join("00000000000000000099.json"), "{").unwrap();
        let o = Outbox::load(dir.clone()).unwrap();
        assert_eq!(o.len(), 2, "corrupt file set aside");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_bad_entry_that_cannot_be_moved_is_skipped_not_retried() {
        let state = std::env::temp_dir().join(format!("cw-outbox-r-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        let dir = state.join("outbox");
        std::fs::create_dir_all(&dir).unwrap();
        // A file where the quarantine folder would go: nothing can be moved there.
        std::fs::write(state.join("quarantine"), "").unwrap();
        std::fs::write(dir.join("00000000000000000007.json"), "{").unwrap();
        let mut o = Outbox::load(dir.clone()).unwrap();
        assert!(o.is_empty());
        assert!(o.refused.contains(&7));
        o.rescan();
        assert!(o.is_empty() && dir.join("00000000000000000007.json").exists());
        std::fs::remove_dir_all(&state).unwrap();
    }

    #[test]
    fn hostile_entries_are_quarantined_and_the_rest_load() {
        let state = std::env::temp_dir().join(format!("cw-outbox-h-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        let dir = state.join("outbox");
        std::fs::create_dir_all(&dir).unwrap();
        let good = |topic: &str| json!({"topic": topic, "body": {"a": 1}, "label": "l"});
        let entry = |n: u64| dir.join(format!("{n:020}.json"));
        let hostile: Vec<(u64, Vec<u8>)> = vec![
            (1, b"".to_vec()),
            (2, b"{\"topic\":\"a/b\",\"bo".to_vec()),
            (3, vec![0, 159, 146, 150, 255, 10]),
            (4, br#"{"topic":42,"body":{},"label":"l"}"#.to_vec()),
            (5, good("a/+/b").to_string().into_bytes()),
            (6, good("a/#").to_string().into_bytes()),
            (7, good("a/b\u{0}").to_string().into_bytes()),
            (8, good("/a").to_string().into_bytes()),
            (9, good("a//b").to_string().into_bytes()),
            (
                10,
                good(&"x".repeat(MAX_TOPIC_BYTES + 1))
                    .to_string()
                    .into_bytes(),
            ),
            (11, br#"{"topic":"a/b","body":[1],"label":"l"}"#.to_vec()),
            (
                12,
                br#"{"topic":"a/b","body":{},"label":"l","key":"k
x"}"#
                    .to_vec(),
            ),
            (13, {
                let mut v = br#"{"topic":"a/b","label":"l","body":{"x":""#.to_vec();
                v.extend(std::iter::repeat_n(
                    b'x',
                    crate::store::MAX_ENTRY_BYTES as usize,
                ));
                v.extend(b"\"}}");
                v
            }),
        ];
        for (n, bytes) in &hostile {
            std::fs::write(entry(*n), bytes).unwrap();
        }
        std::fs::write(entry(u64::MAX), good("a/b").to_string()).unwrap();
        let label = format!("done \u{1b}[31m\nFORGED {}", "y".repeat(5000));
        std::fs::write(
            entry(20),
            json!({"topic": "cyberwave/x/update-status", "body": {"ok": true}, "label": label})
                .to_string(),
        )
        .unwrap();
        let mut o = Outbox::load(dir.clone()).unwrap();
        assert_eq!(o.len(), 1, "only the valid entry is queued");
        let (seq, item) = o.head_due(Instant::now()).unwrap();
        assert_eq!(seq, 20);
        assert!(!item.label.contains('\n') && !item.label.contains('\u{1b}'));
        assert!(item.label.chars().count() <= MAX_LABEL_CHARS);
        let quarantined = std::fs::read_dir(state.join("quarantine")).unwrap().count();
        assert_eq!(quarantined, hostile.len() + 1, "every bad file moved aside");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        let next = o.push(Item {
            topic: "t/1".into(),
            body: json!({}),
            label: "x".into(),
            key: None,
            owner: None,
        });
        assert!(next.unwrap() > 20);
        let (_, aside) = o.quarantine(20).unwrap();
        assert!(aside.starts_with(state.join("quarantine")) && aside.exists());
        assert!(!entry(20).exists());
        assert_eq!(
            std::fs::read_dir(state.join("quarantine")).unwrap().count(),
            hostile.len() + 2
        );
        std::fs::remove_dir_all(&state).unwrap();
    }
}
