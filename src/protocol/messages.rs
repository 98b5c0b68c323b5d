//! Commands from the backend and the node's replies (protocol §2.7, §4; decision D1).

use serde_json::{json, Map, Value};

use super::commands::{Command, RequestId, TopicId};

/// Commands larger than this are refused (an error reply when a request id can be read).
pub const MAX_COMMAND_BYTES: usize = 4 * 1024 * 1024;

/// A command message after the envelope rules of protocol §4.1, typed (see `commands`).
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    /// A well-formed command with valid params.
    Command {
        request_id: RequestId,
        command: Command,
    },
    /// Echo of a reply (has a `status` key): ignored silently.
    Echo,
    /// Refused; `request_id` is `Some` when one could be read, so an error reply can be sent
    /// (it is echoed as it came, even when it is the field that was refused).
    Invalid {
        request_id: Option<Value>,
        reason: String,
        /// The workload the refused start named, when that much was sound (a `failed` status).
        workload_uuid: Option<TopicId>,
    },
}

pub fn parse_command(payload: &[u8]) -> Incoming {
    let value: Value = match serde_json::from_slice(payload) {
        Ok(v) => v,
        Err(e) => {
            return Incoming::Invalid {
                request_id: None,
                reason: format!("command is not valid JSON: {e}"),
                workload_uuid: None,
            }
        }
    };
    let Value::Object(obj) = value else {
        return Incoming::Invalid {
            request_id: None,
            reason: "command must be a JSON object".into(),
            workload_uuid: None,
        };
    };
    if obj.contains_key("status") {
        return Incoming::Echo;
    }
    let raw_id = obj.get("request_id").cloned().filter(|v| !v.is_null());
    let invalid = |reason: String| Incoming::Invalid {
        request_id: raw_id.clone(),
        reason,
        workload_uuid: None,
    };
    if payload.len() > MAX_COMMAND_BYTES {
        return invalid(format!(
            "command payload is {} bytes; the limit is {MAX_COMMAND_BYTES}",
            payload.len()
        ));
    }
    let request_id = match RequestId::parse(obj.get("request_id")) {
        Ok(r) => r,
        // A request id that is not a string or number cannot be echoed meaningfully.
        Err(e) if !matches!(raw_id, Some(Value::String(_))) => {
            return Incoming::Invalid {
                request_id: None,
                reason: e.to_string(),
                workload_uuid: None,
            }
        }
        Err(e) => return invalid(e.to_string()),
    };
    let name = match obj.get("command") {
        Some(Value::String(s)) if !s.is_empty() => s.as_str(),
        None | Some(Value::Null) => {
            return invalid("command message has no 'command' field".into())
        }
        Some(_) => return invalid("'command' must be a non-empty string".into()),
    };
    match Command::parse(name, obj.get("params")) {
        Ok(command) => Incoming::Command {
            request_id,
            command,
        },
        Err(r) => Incoming::Invalid {
            request_id: raw_id,
            reason: r.error.to_string(),
            workload_uuid: r.workload_uuid,
        },
    }
}

/// The reply envelope of protocol §2.7 with `output` as an object (decision D1).
pub fn reply(ok: bool, request_id: &Value, slug: &str, uuid: &str, body: Value) -> Vec<u8> {
    let mut m = Map::new();
    m.insert("status".into(), json!(if ok { "ok" } else { "error" }));
    m.insert("request_id".into(), request_id.clone());
    m.insert("slug".into(), json!(slug));
    m.insert("instance_uuid".into(), json!(uuid));
    m.insert(if ok { "output" } else { "error" }.into(), body);
    serde_json::to_vec(&Value::Object(m)).unwrap_or_default()
}

/// A request id as text for logs and file names.
pub fn request_id_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_commands_and_defaults_params() {
        let c = parse_command(br#"{"command":"status","request_id":"r1"}"#);
        assert_eq!(
            c,
            Incoming::Command {
                request_id: RequestId::parse(Some(&json!("r1"))).unwrap(),
                command: Command::Status,
            }
        );
    }

    #[test]
    fn ignores_echoes_and_refuses_garbage() {
        assert_eq!(
            parse_command(br#"{"status":"ok","command":"x"}"#),
            Incoming::Echo
        );
        assert!(matches!(
            parse_command(b"not json"),
            Incoming::Invalid {
                request_id: None,
                ..
            }
        ));
        assert!(matches!(
            parse_command(b"[1,2]"),
            Incoming::Invalid {
                request_id: None,
                ..
            }
        ));
        assert!(matches!(
            parse_command(br#"{"request_id":"r"}"#),
            Incoming::Invalid {
                request_id: Some(_),
                ..
            }
        ));
        assert!(matches!(
            parse_command(br#"{"command":5,"request_id":"r"}"#),
            Incoming::Invalid {
                request_id: Some(_),
                ..
            }
        ));
        assert!(matches!(
            parse_command(br#"{"command":"status","request_id":{"a":1}}"#),
            Incoming::Invalid { .. }
        ));
    }

    #[test]
    fn refuses_oversized_payloads_with_the_request_id() {
        let big = format!(
            r#"{{"command":"inference","request_id":"big","params":{{"x":"{}"}}}}"#,
            "a".repeat(MAX_COMMAND_BYTES)
        );
        match parse_command(big.as_bytes()) {
            Incoming::Invalid {
                request_id, reason, ..
            } => {
                assert_eq!(request_id, Some(json!("big")));
                assert!(reason.contains("limit"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn reply_shape() {
        let r: Value =
            serde_json::from_slice(&reply(true, &json!("r"), "s", "u", json!({"a": 1}))).unwrap();
        assert_eq!(
            r,
            json!({"status":"ok","request_id":"r","slug":"s","instance_uuid":"u","output":{"a":1}})
        );
        let r: Value =
            serde_json::from_slice(&reply(false, &Value::Null, "s", "u", json!("bad"))).unwrap();
        assert_eq!(r["error"], "bad");
        assert_eq!(r["request_id"], Value::Null);
    }
}
