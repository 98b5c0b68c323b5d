//! What a failed workload's completion says: the tail of its logs.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use super::record::Meta;
use super::tail as logs;

/// The last `max` bytes of a file as text (invalid UTF-8 replaced).
pub fn tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = logs::open_log(path, false) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::new();
    let _ = f.take(max).read_to_end(&mut buf);
    // No NUL of a hole the workload made in its log is kept (D52).
    buf.retain(|b| *b != 0);
    String::from_utf8_lossy(&buf).into_owned()
}

/// The failure summary of a completion (R8): (`error` ≤ 300 chars, `stderr` tail ≤ 2000 chars).
pub fn failure_summary(meta: &Meta, what: &str) -> (String, Option<String>) {
    let err_text = tail(&meta.stderr_log, 16 * 1024);
    let trimmed = err_text.trim();
    let stderr = (!trimmed.is_empty()).then(|| last_chars(trimmed, 2000));
    let last_line = |t: &str| {
        t.lines()
            .rev()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .map(|l| last_chars(l, 300))
    };
    let error = last_line(trimmed)
        .or_else(|| last_line(tail(&meta.stdout_log, 16 * 1024).trim()))
        .unwrap_or_else(|| what.to_string());
    (error, stderr)
}

fn last_chars(s: &str, n: usize) -> String {
    let count = s.chars().count();
    s.chars().skip(count.saturating_sub(n)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn summarises_failures() {
        let dir = std::env::temp_dir().join(format!("cw-sum-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let meta = Meta {
            safe_id: "x".into(),
            kind: crate::protocol::commands::Kind::Training.into(),
            request_id: Value::Null,
            workload_uuid: None,
            created_unix: 0.0,
            command: String::new(),
            stdout_log: dir.join("o"),
            stderr_log: dir.join("e"),
            max_runtime_s: None,
            started: None,
            cancel: None,
            workflow: None,
            event_token: String::new(),
            gpus: None,
            uid: None,
            salvaged: None,
        };
        assert_eq!(failure_summary(&meta, "fallback").0, "fallback");
        std::fs::write(dir.join("o"), "out line\n").unwrap();
        assert_eq!(failure_summary(&meta, "fallback").0, "out line");
        std::fs::write(
            dir.join("e"),
            format!("first\nTraceback: {}\n\n", "x".repeat(400)),
        )
        .unwrap();
        let (error, stderr) = failure_summary(&meta, "fallback");
        assert_eq!(error.chars().count(), 300);
        assert!(stderr.unwrap().starts_with("first"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
