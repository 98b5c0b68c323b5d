//! A control-socket request line, parsed as the node parses it, and an `emit` request's fields
//! built into an event as the node's loop builds them.
#![no_main]
use cyberwave_cloud_node::{control, ingress};
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
    let Some(body) = control::parse_request(data) else {
        return;
    };
    if body.get("op").and_then(|v| v.as_str()) == Some("emit") {
        if let Some(fields) = body.get("fields").and_then(|v| v.as_object()) {
            if let Ok(ev) = ingress::build(fields) {
                check(&ev);
            }
        }
    }
});
