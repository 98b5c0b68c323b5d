//! A control-socket request line, parsed as the node parses it, and an `emit` request's fields
//! built into an event as the node's loop builds them.
#![no_main]
use cyberwave_cloud_node::{control, ingress};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(body) = control::parse_request(data) else {
        return;
    };
    if body.get("op").and_then(|v| v.as_str()) == Some("emit") {
        if let Some(fields) = body.get("fields").and_then(|v| v.as_object()) {
            let _ = ingress::build(fields);
        }
    }
});
