//! The MQTT command parser: every payload the backend (or anyone on the broker) can send. What
//! it accepts must be typed values that hold their own invariants (D8, D20); what it refuses
//! must still make a well-formed error reply. The shallow scan of a command refused before its
//! params are read (D64) runs on every input too, on its own and through a size limit so small
//! that most inputs are over it.
#![no_main]
use cyberwave_cloud_node::protocol::commands::{
    CancelTarget, Command, Received, StartParams, TopicId, MAX_REQUEST_ID_BYTES, MAX_SECONDS,
};
use cyberwave_cloud_node::protocol::commands::{
    parse_command, parse_command_within, reply, Incoming,
};
use cyberwave_cloud_node::protocol::shallow;
use cyberwave_cloud_node::protocol::topics::publishable;
use libfuzzer_sys::fuzz_target;

fn topic_safe(id: &TopicId) {
    let s = id.as_str();
    assert!(!s.is_empty() && s.len() <= 256, "{s:?}");
    assert!(publishable(&format!("cyberwave/cloud-workload/{s}/update-status")), "{s:?}");
    assert!(!s.contains(['/', '+', '#']) && s.bytes().all(|b| b.is_ascii_graphic()));
}

fn start(p: &StartParams) {
    if let Some(w) = &p.workload_uuid {
        topic_safe(w);
    }
    if let Some(e) = &p.environment_uuid {
        topic_safe(e);
    }
    if let Some(s) = p.max_runtime {
        assert!(s.get() > 0.0 && s.get() <= MAX_SECONDS);
        let _ = s.duration();
    }
}

/// What a shallow scan reads is a request id of the protocol's kind and a topic-safe workload.
fn shallow_sound(data: &[u8]) {
    let head = shallow::scan(data);
    match &head.request_id {
        None | Some(serde_json::Value::Number(_)) => {}
        Some(serde_json::Value::String(s)) => assert!(s.len() <= MAX_REQUEST_ID_BYTES),
        Some(other) => panic!("a request id of another type: {other}"),
    }
    if let Some(w) = &head.workload_uuid {
        topic_safe(w);
    }
    if let Incoming::Invalid {
        request_id: Some(rid),
        reason,
        workload_uuid,
    } = parse_command_within(data, 16)
    {
        if let Some(w) = &workload_uuid {
            topic_safe(w);
        }
        let r = reply(false, &rid, "s", "u", serde_json::Value::String(reason));
        assert!(serde_json::from_slice::<serde_json::Value>(&r).is_ok());
    }
}

fuzz_target!(|data: &[u8]| {
    shallow_sound(data);
    match parse_command(data) {
        Incoming::Command {
            request_id,
            command,
        } => {
            assert!(request_id.text().len() <= MAX_REQUEST_ID_BYTES.saturating_mul(2));
            match &command {
                Command::Status => {}
                Command::Start(_, p) | Command::Received(Received::Start(_, p)) => start(p),
                Command::Received(Received::Ack(u)) => {
                    if let Some(u) = u {
                        topic_safe(u);
                    }
                }
                Command::Cancel(c) => {
                    if let CancelTarget::Pid(p) = c.target {
                        assert!(p.get() >= 1);
                    }
                    if let Some(g) = c.grace {
                        assert!(g.get() > 0.0 && g.get() <= MAX_SECONDS);
                    }
                }
            }
            let r = reply(true, request_id.value(), command.name(), "u", serde_json::json!({}));
            assert!(serde_json::from_slice::<serde_json::Value>(&r).is_ok());
        }
        Incoming::Invalid {
            request_id: Some(rid),
            reason,
            workload_uuid,
        } => {
            if let Some(w) = &workload_uuid {
                topic_safe(w);
            }
            let r = reply(false, &rid, "s", "u", serde_json::Value::String(reason));
            assert!(serde_json::from_slice::<serde_json::Value>(&r).is_ok());
        }
        Incoming::Invalid { .. } | Incoming::Echo => {}
    }
});
