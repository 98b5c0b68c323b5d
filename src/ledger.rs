//! The ledger of handled request ids (guarantee 1): a redelivered start or cancel is answered
//! with its original outcome and never acts twice. Append-only JSON lines in the state dir,
//! bounded to the newest 10 000 entries and 7 days, compacted when loaded.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub const MAX_ENTRIES: usize = 10_000;
pub const MAX_AGE_SECS: f64 = 7.0 * 24.0 * 3600.0;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    pub rid: String,
    pub at: f64,
    pub ok: bool,
    /// The reply's `output` (ok) or `error` (not ok).
    pub body: Value,
}

pub struct Ledger {
    path: PathBuf,
    entries: HashMap<String, Entry>,
    lines: usize,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Ledger {
    pub fn load(path: PathBuf) -> Ledger {
        let mut list: Vec<Entry> = std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let total = list.len();
        let cutoff = now() - MAX_AGE_SECS;
        list.retain(|e| e.at >= cutoff);
        if list.len() > MAX_ENTRIES {
            list.drain(..list.len().saturating_sub(MAX_ENTRIES));
        }
        let mut ledger = Ledger {
            path,
            entries: HashMap::new(),
            lines: list.len(),
        };
        if list.len() != total {
            ledger.rewrite(&list);
        }
        for e in list {
            ledger.entries.insert(e.rid.clone(), e);
        }
        ledger
    }

    fn rewrite(&self, list: &[Entry]) {
        let text: String = list
            .iter()
            .filter_map(|e| serde_json::to_string(e).ok())
            .map(|l| l + "\n")
            .collect();
        if let Err(e) = crate::store::write_atomic(&self.path, text.as_bytes(), 0o600) {
            log::warn!(
                "cannot compact the request ledger {}: {e}",
                self.path.display()
            );
        }
    }

    pub fn get(&self, rid: &str) -> Option<&Entry> {
        self.entries.get(rid)
    }

    /// Records an outcome durably (append + fsync) before the reply goes out.
    pub fn record(&mut self, rid: &str, ok: bool, body: Value) {
        let e = Entry {
            rid: rid.to_string(),
            at: now(),
            ok,
            body,
        };
        let line = serde_json::to_string(&e).unwrap_or_default() + "\n";
        let written = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&self.path)
            .and_then(|mut f| {
                f.write_all(line.as_bytes())?;
                f.sync_data()
            });
        if let Err(err) = written {
            log::error!(
                "cannot record request {rid} in {}: {err}",
                self.path.display()
            );
        }
        self.entries.insert(e.rid.clone(), e);
        self.lines = self.lines.saturating_add(1);
        if self.lines > 2 * MAX_ENTRIES {
            let mut list: Vec<Entry> = self.entries.values().cloned().collect();
            list.sort_by(|a, b| a.at.total_cmp(&b.at));
            if list.len() > MAX_ENTRIES {
                let drop = list.len().saturating_sub(MAX_ENTRIES);
                for e in list.drain(..drop) {
                    self.entries.remove(&e.rid);
                }
            }
            self.rewrite(&list);
            self.lines = list.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn survives_a_reload_and_drops_old_entries() {
        let dir = std::env::temp_dir().join(format!("cw-ledger-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ledger.jsonl");
        let old = Entry {
            rid: "ancient".into(),
            at: 1.0,
            ok: true,
            body: json!(1),
        };
        std::fs::write(&path, serde_json::to_string(&old).unwrap() + "\nnot json\n").unwrap();
        let mut l = Ledger::load(path.clone());
        assert!(l.get("ancient").is_none(), "older than 7 days");
        l.record("r1", true, json!({"pid": 5}));
        let l = Ledger::load(path);
        assert_eq!(l.get("r1").unwrap().body, json!({"pid": 5}));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
