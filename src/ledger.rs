//! The ledger of handled request ids (guarantee 1): a redelivered start or cancel is answered
//! with its original outcome and never acts twice. Append-only JSON lines in the state dir,
//! bounded to the newest 10 000 entries and 7 days, compacted when loaded.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::store::{self, Validate};

pub const MAX_ENTRIES: usize = 10_000;
/// Lines the file may grow to between compactions.
const MAX_LINES: usize = 20_000;
pub const MAX_AGE_SECS: f64 = 7.0 * 24.0 * 3600.0;
/// Request ids longer than this are kept as their SHA-256 (D32).
pub const MAX_RAW_ID_BYTES: usize = 256;
/// Longest ledger line read back (a longer one is invalid).
pub const MAX_LINE_BYTES: u64 = store::MAX_ENTRY_BYTES;
const HASH_PREFIX: &str = "sha256:";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    /// The request id, or `sha256:<hex>` of it when it is long (see [`key`]).
    pub rid: String,
    pub at: f64,
    pub ok: bool,
    /// The reply's `output` (ok) or `error` (not ok).
    pub body: Value,
}

impl Validate for Entry {
    fn validate(&self) -> Result<(), store::Invalid> {
        store::check_unix("at", self.at)
    }
}

/// What the ledger keeps for a request id: the id itself, or `sha256:<64 hex>` of it when it
/// is longer than [`MAX_RAW_ID_BYTES`] (or could be mistaken for such a hash).
pub fn key(rid: &str) -> String {
    if rid.len() > MAX_RAW_ID_BYTES || rid.starts_with(HASH_PREFIX) {
        format!(
            "{HASH_PREFIX}{}",
            crate::util::hex(&crate::util::sha256(rid.as_bytes()))
        )
    } else {
        rid.to_string()
    }
}

/// One ledger line parsed and validated (also the entry point for fuzzing).
pub fn parse_line(line: &[u8]) -> Result<Entry, store::StoreError> {
    store::parse_record::<Entry>(line)
}

/// Whether `k` is already a key as [`key`] makes them (a hash, or a short plain id).
fn is_key(k: &str) -> bool {
    match k.strip_prefix(HASH_PREFIX) {
        Some(h) => h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()),
        None => k.len() <= MAX_RAW_ID_BYTES,
    }
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

/// What reading the file found.
struct Scan {
    /// The newest valid entries (oldest first), re-keyed.
    list: VecDeque<Entry>,
    /// Valid lines read.
    valid: usize,
    /// Entries whose id had to be hashed (a ledger from an older version).
    rekeyed: usize,
    /// Invalid lines, and the first one's number and reason.
    bad: usize,
    first_bad: Option<(usize, String)>,
}

/// Reads the ledger line by line, never holding more than one line (at most
/// [`MAX_LINE_BYTES`]) and the newest [`MAX_ENTRIES`] entries in memory. Only a regular file
/// is read (D48: a FIFO in its place never blocks the node).
fn scan(path: &Path, cutoff: f64) -> Result<Scan, store::StoreError> {
    let (file, _) = store::open_state_file(path)?;
    scan_lines(BufReader::new(file), cutoff).map_err(store::StoreError::Io)
}

fn scan_lines(mut reader: BufReader<std::fs::File>, cutoff: f64) -> std::io::Result<Scan> {
    let mut out = Scan {
        list: VecDeque::new(),
        valid: 0,
        rekeyed: 0,
        bad: 0,
        first_bad: None,
    };
    let mut buf = Vec::new();
    let mut number: usize = 0;
    loop {
        buf.clear();
        let n = reader
            .by_ref()
            .take(MAX_LINE_BYTES.saturating_add(1))
            .read_until(b'\n', &mut buf)?;
        if n == 0 {
            break;
        }
        number = number.saturating_add(1);
        let complete = buf.last() == Some(&b'\n');
        let parsed = if !complete && u64::try_from(buf.len()).unwrap_or(u64::MAX) > MAX_LINE_BYTES {
            // Skip the rest of the over-long line without keeping it.
            let mut rest = Vec::new();
            loop {
                rest.clear();
                let m = reader
                    .by_ref()
                    .take(64 * 1024)
                    .read_until(b'\n', &mut rest)?;
                if m == 0 || rest.last() == Some(&b'\n') {
                    break;
                }
            }
            Err(format!("longer than {MAX_LINE_BYTES} bytes"))
        } else if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        } else {
            parse_line(&buf).map_err(|e| e.to_string())
        };
        match parsed {
            Ok(mut e) => {
                out.valid = out.valid.saturating_add(1);
                if !is_key(&e.rid) {
                    e.rid = key(&e.rid);
                    out.rekeyed = out.rekeyed.saturating_add(1);
                }
                if e.at >= cutoff {
                    out.list.push_back(e);
                    if out.list.len() > MAX_ENTRIES {
                        out.list.pop_front();
                    }
                }
            }
            Err(why) => {
                out.bad = out.bad.saturating_add(1);
                if out.first_bad.is_none() {
                    out.first_bad = Some((number, why));
                }
            }
        }
    }
    Ok(out)
}

impl Ledger {
    /// Loads the ledger, keeping the newest entries of the last 7 days. Invalid lines (torn,
    /// binary, wrong-typed, over-long) are dropped: the file as it was goes to the quarantine
    /// folder with one ERROR line, and the valid entries are written back.
    pub fn load(path: PathBuf) -> Ledger {
        let cutoff = now() - MAX_AGE_SECS;
        let scan = match scan(&path, cutoff) {
            Ok(s) => s,
            Err(store::StoreError::Missing) => Scan {
                list: VecDeque::new(),
                valid: 0,
                rekeyed: 0,
                bad: 0,
                first_bad: None,
            },
            Err(e) => {
                let _ = store::quarantine(
                    &path,
                    &format!("the request ledger cannot be read ({e}); starting a new one"),
                );
                Scan {
                    list: VecDeque::new(),
                    valid: 0,
                    rekeyed: 0,
                    bad: 1,
                    first_bad: None,
                }
            }
        };
        let list: Vec<Entry> = scan.list.into_iter().collect();
        let mut ledger = Ledger {
            path,
            entries: HashMap::new(),
            lines: list.len(),
        };
        if let Some((line, why)) = &scan.first_bad {
            let _ = store::quarantine(
                &ledger.path,
                &format!(
                    "{} invalid line(s) in the request ledger (line {line}: {why}); the {} valid entries are kept",
                    scan.bad,
                    list.len()
                ),
            );
        }
        if scan.bad > 0 || list.len() != scan.valid || scan.rekeyed > 0 {
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

    /// The recorded outcome for a request id (long ids are looked up by their hash).
    pub fn get(&self, rid: &str) -> Option<&Entry> {
        self.entries.get(&key(rid))
    }

    /// Records an outcome durably (append + fsync) before the reply goes out.
    pub fn record(&mut self, rid: &str, ok: bool, body: Value) {
        let e = entry(rid, ok, body);
        if let Err(err) = append(&self.path, std::slice::from_ref(&e)) {
            log::error!(
                "cannot record request {} in {}: {err}",
                store::clip(&e.rid, 80),
                store::shown(&self.path)
            );
        }
        self.remember(e, true);
    }

    /// Keeps an entry that [`append`] already wrote (on another thread). `may_compact`: false
    /// while another thread may be appending, as a compaction would drop its line.
    pub fn remember(&mut self, e: Entry, may_compact: bool) {
        self.entries.insert(e.rid.clone(), e);
        self.lines = self.lines.saturating_add(1);
        if self.lines > MAX_LINES && may_compact {
            let mut list: Vec<Entry> = self.entries.values().cloned().collect();
            list.sort_by(|a, b| a.at.total_cmp(&b.at));
            let drop = list.len().saturating_sub(MAX_ENTRIES);
            for e in list.drain(..drop) {
                self.entries.remove(&e.rid);
            }
            self.rewrite(&list);
            self.lines = list.len();
        }
    }
}

/// The entry [`Ledger::record`] keeps for an outcome.
pub fn entry(rid: &str, ok: bool, body: Value) -> Entry {
    Entry {
        rid: key(rid),
        at: now(),
        ok,
        body,
    }
}

/// Appends entries to the ledger file durably: one write, one fsync for all of them.
pub fn append(path: &Path, entries: &[Entry]) -> std::io::Result<()> {
    let text: String = entries
        .iter()
        .map(|e| serde_json::to_string(e).unwrap_or_default() + "\n")
        .collect();
    // A FIFO or link planted in its place is quarantined, never written through or blocked on.
    let mut f = store::open_state_append(path, 0o600)?;
    f.write_all(text.as_bytes())?;
    store::slow_disk_pause();
    f.sync_data()
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

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cw-ledger-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn line(rid: &str, at: f64) -> String {
        serde_json::to_string(&Entry {
            rid: rid.into(),
            at,
            ok: true,
            body: json!({"r": rid.len()}),
        })
        .unwrap()
            + "\n"
    }

    #[test]
    fn hostile_lines_are_dropped_the_file_quarantined_and_good_entries_kept() {
        let dir = scratch("hostile");
        let path = dir.join("ledger.jsonl");
        let t = now();
        let mut text = Vec::new();
        text.extend(line("good-1", t).as_bytes());
        text.extend(b"{\"rid\":\"torn\",\"at\":");
        text.extend(b"\n\x00\xff\xfe binary \x1b[31m\n");
        text.extend(br#"{"rid":5,"at":1,"ok":true,"body":null}"#);
        text.extend(b"\n");
        text.extend(br#"{"rid":"nan","at":1e400,"ok":true,"body":null}"#);
        text.extend(b"\n");
        text.extend(br#"{"rid":"neg","at":-1,"ok":true,"body":null}"#);
        text.extend(b"\n");
        text.extend(line("future", 1e15).as_bytes());
        // One line longer than the limit, with no newline until far after it.
        text.extend(std::iter::repeat_n(b'x', MAX_LINE_BYTES as usize + 10));
        text.extend(b"\n");
        text.extend(line("good-2", t).as_bytes());
        std::fs::write(&path, &text).unwrap();
        let l = Ledger::load(path.clone());
        assert!(l.get("good-1").is_some() && l.get("good-2").is_some());
        assert_eq!(l.entries.len(), 2, "{:?}", l.entries.keys());
        let q: Vec<_> = std::fs::read_dir(dir.join("quarantine"))
            .unwrap()
            .flatten()
            .collect();
        assert_eq!(q.len(), 1, "the old file is kept aside");
        assert_eq!(std::fs::read(q[0].path()).unwrap(), text);
        let again = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            again.lines().count(),
            2,
            "only the valid lines written back"
        );
        drop(l);
        let l = Ledger::load(path);
        assert_eq!(l.entries.len(), 2);
        assert_eq!(
            std::fs::read_dir(dir.join("quarantine")).unwrap().count(),
            1,
            "a clean ledger is not quarantined again"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_enormous_line_without_newline_is_skipped_in_bounded_memory() {
        let dir = scratch("huge");
        let path = dir.join("ledger.jsonl");
        let mut text = line("ok", now()).into_bytes();
        text.extend(std::iter::repeat_n(b'{', 3 * MAX_LINE_BYTES as usize));
        std::fs::write(&path, &text).unwrap();
        let l = Ledger::load(path);
        assert_eq!(l.entries.len(), 1);
        assert!(l.get("ok").is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn long_ids_are_kept_as_their_sha256_and_old_ledgers_still_load() {
        let dir = scratch("hash");
        let path = dir.join("ledger.jsonl");
        let long = "é".repeat(1024 * 1024);
        let edge = "x".repeat(MAX_RAW_ID_BYTES);
        let over = "x".repeat(MAX_RAW_ID_BYTES + 1);
        // An old ledger with the raw long id.
        std::fs::write(&path, line(&long, now())).unwrap();
        let mut l = Ledger::load(path.clone());
        assert!(l.get(&long).is_some(), "an old entry is found by its id");
        l.record(&edge, true, json!(1));
        l.record(&over, false, json!("no"));
        l.record("sha256:lookalike", true, json!(2));
        for _ in 0..8 {
            l.record(&long, true, json!({"m": "cancelled"}));
        }
        let size = std::fs::metadata(&path).unwrap().len();
        assert!(size < 8 * 1024, "the ledger holds no long id: {size} bytes");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains(&edge),
            "ids up to 256 bytes are kept as they are"
        );
        assert!(!text.contains(&over) && !text.contains("lookalike"));
        let l = Ledger::load(path);
        assert_eq!(l.get(&edge).unwrap().body, json!(1));
        assert_eq!(l.get(&over).unwrap().body, json!("no"));
        assert_eq!(l.get("sha256:lookalike").unwrap().body, json!(2));
        assert_eq!(l.get(&long).unwrap().body, json!({"m": "cancelled"}));
        assert!(l.get(&"x".repeat(MAX_RAW_ID_BYTES + 2)).is_none());
        assert_eq!(key(&over).len(), HASH_PREFIX.len() + 64);
        assert!(
            !dir.join("quarantine").exists(),
            "an old ledger is not invalid"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
