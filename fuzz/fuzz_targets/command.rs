//! The MQTT command parser: every payload the backend (or anyone on the broker) can send.
#![no_main]
use cyberwave_cloud_node::protocol::messages::{parse_command, reply, request_id_text, Incoming};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match parse_command(data) {
        Incoming::Command {
            command,
            request_id,
            params,
        } => {
            assert!(!command.is_empty());
            assert!(request_id.is_string() || request_id.is_number() || request_id.is_null());
            let _ = request_id_text(&request_id);
            let r = reply(true, &request_id, &command, "u", params);
            assert!(serde_json::from_slice::<serde_json::Value>(&r).is_ok());
        }
        Incoming::Invalid {
            request_id: Some(rid),
            reason,
        } => {
            let _ = reply(false, &rid, "s", "u", serde_json::Value::String(reason));
        }
        Incoming::Invalid { .. } | Incoming::Echo => {}
    }
});
