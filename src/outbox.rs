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
}

struct Slot {
    item: Item,
    in_flight: Option<Vec<u8>>,
    next_try: Instant,
    attempts: u32,
}

impl Slot {
    fn new(item: Item) -> Slot {
        Slot {
            item,
            in_flight: None,
            next_try: Instant::now(),
            attempts: 0,
        }
    }
}

pub struct Outbox {
    dir: PathBuf,
    next_seq: u64,
    slots: BTreeMap<u64, Slot>,
}

pub const MAX_IN_FLIGHT: usize = 64;

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
    /// Loads what a previous run left; corrupt files are moved aside.
    pub fn load(dir: PathBuf) -> std::io::Result<Outbox> {
        crate::store::ensure_private_dir(&dir)?;
        let mut o = Outbox {
            dir,
            next_seq: 1,
            slots: BTreeMap::new(),
        };
        o.rescan();
        Ok(o)
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Picks up items another process wrote into the folder since the last look (all of them,
    /// at load); an unreadable file is moved aside.
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
            if self.slots.contains_key(&seq) {
                continue;
            }
            match std::fs::read(entry.path())
                .ok()
                .and_then(|b| serde_json::from_slice::<Item>(&b).ok())
            {
                Some(item) => {
                    self.slots.insert(seq, Slot::new(item));
                    self.next_seq = self.next_seq.max(seq.saturating_add(1));
                }
                None => {
                    let aside = entry.path().with_extension("corrupt");
                    log::warn!(
                        "outbox file {} is unreadable; moved to {}",
                        entry.path().display(),
                        aside.display()
                    );
                    let _ = std::fs::rename(entry.path(), aside);
                }
            }
        }
    }

    /// The oldest item, if it is not in flight and is due (for strictly ordered sending).
    pub fn head_due(&self, now: Instant) -> Option<(u64, Item)> {
        let (seq, s) = self.slots.iter().next()?;
        (s.in_flight.is_none() && s.next_try <= now).then(|| (*seq, s.item.clone()))
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
    pub fn push(&mut self, item: Item) -> std::io::Result<u64> {
        let seq = self.next_seq.max(now_nanos());
        self.next_seq = seq.saturating_add(1);
        let json = serde_json::to_vec(&item).map_err(std::io::Error::other)?;
        crate::store::write_atomic(&self.dir.join(format!("{seq:020}.json")), &json, 0o600)?;
        self.slots.insert(seq, Slot::new(item));
        Ok(seq)
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

    pub fn next_try(&self) -> Option<Instant> {
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
        }
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
            let secs = 2f64.powi(s.attempts.min(6) as i32).min(60.0);
            s.next_try = now
                .checked_add(Duration::from_secs_f64(secs))
                .unwrap_or(now);
        }
    }

    /// The connection dropped: everything in flight is sent again after the reconnect.
    pub fn reset_in_flight(&mut self) {
        let now = Instant::now();
        for s in self.slots.values_mut() {
            if s.in_flight.take().is_some() {
                s.next_try = now;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
}
