//! `emit`'s argument parser and the event builder the node runs for it: the first byte picks the
//! event kind; the rest is flag/value pairs separated by 0xFF bytes (never in UTF-8), the first
//! byte of each flag token picking one of `emit::FLAGS` (or, past their count, the token itself).
#![no_main]
use std::collections::BTreeMap;

use cyberwave_cloud_node::{emit, ingress};
use libfuzzer_sys::fuzz_target;

/// What every accepted event must satisfy, whatever the input.
fn check(ev: &ingress::Event) {
    assert!(!ev.topic.contains(['+', '#', '\0']), "{}", ev.topic);
    let size = serde_json::to_vec(&ev.body).map(|b| b.len()).unwrap_or(0);
    assert!(size <= ingress::MAX_EVENT_BYTES);
    for k in ["started_at", "finished_at"] {
        if let Some(t) = ev.body.get(k) {
            let t = t.as_str().expect("a time is text");
            assert!(t.ends_with('Z') && ingress::parse_rfc3339(t).is_ok(), "{t}");
            let again = ingress::normalise_time(&serde_json::Value::from(t));
            assert_eq!(again.as_deref(), Ok(t), "normalising is idempotent");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&k, rest)) = data.split_first() else {
        return;
    };
    let kind = ["started", "node", "finished", "restarted"][usize::from(k % 4)];
    let mut flags = BTreeMap::new();
    let mut tokens = rest.split(|b| *b == 0xFF);
    while let (Some(flag), Some(value)) = (tokens.next(), tokens.next()) {
        let name = match flag.split_first() {
            Some((&i, _)) if usize::from(i) < emit::FLAGS.len() => {
                emit::FLAGS[usize::from(i)].to_string()
            }
            _ => String::from_utf8_lossy(flag).into_owned(),
        };
        flags.insert(name, String::from_utf8_lossy(value).into_owned());
    }
    if let Ok(fields) = emit::fields(kind, &flags) {
        if let Ok(ev) = ingress::build(&fields) {
            check(&ev);
        }
    }
});
