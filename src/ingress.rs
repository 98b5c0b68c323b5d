//! Workflow execution ingress (`execution-ingress.md`, ecosystem §1): the three event kinds,
//! their JSON (optional fields left out, never null), validation, and timestamps.

use serde_json::{json, Map, Value};

pub const NODE_STATUSES: [&str; 5] = ["pending", "running", "success", "error", "skipped"];
pub const FINISHED_STATUSES: [&str; 3] = ["success", "error", "canceled"];
/// The `source_type` of an event that names none (the SDK reporter's default).
pub const DEFAULT_SOURCE_TYPE: &str = "edge";
/// Largest event payload accepted.
pub const MAX_EVENT_BYTES: usize = 256 * 1024;

/// An event ready for the queue: the topic without the environment prefix, and the payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub topic: String,
    pub body: Value,
    /// For `started`: the execution uuid (generated when not given).
    pub execution: String,
    pub workflow: String,
}

fn id_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn need_id(what: &str, v: Option<&str>) -> Result<String, String> {
    match v {
        Some(s) if id_ok(s) => Ok(s.to_string()),
        Some(s) => Err(format!(
            "{what} must be a uuid (letters, digits, - and _), got {:?}",
            s.chars().take(40).collect::<String>()
        )),
        None => Err(format!("{what} is required")),
    }
}

/// Builds and validates an event from named fields (the `emit` flags or a socket request).
/// `fields` keys: kind (started|node|finished), workflow, execution, node, status, trigger,
/// input, output, error_message, execution_time_ms, metadata, started_at, finished_at,
/// activation_index, caller_uuid, source_type.
pub fn build(fields: &Map<String, Value>) -> Result<Event, String> {
    let s = |k: &str| fields.get(k).and_then(Value::as_str);
    let kind = s("kind").unwrap_or("");
    let workflow = need_id("--workflow", s("workflow"))?;
    let mut body = Map::new();
    // The SDK's reporter tags every event `edge` unless told otherwise.
    if let Some(st) = s("source_type").or(Some(DEFAULT_SOURCE_TYPE)) {
        if ![
            "edge",
            "edge_leader",
            "edge_follower",
            "sim",
            "tele",
            "sim_tele",
            "edit",
        ]
        .contains(&st)
        {
            return Err(format!("--source-type must be one of edge, sim, tele, edit (or edge_leader, edge_follower, sim_tele), got {st:?}"));
        }
        body.insert("source_type".into(), json!(st));
    }
    let event = match kind {
        "started" => {
            let execution = match s("execution") {
                Some(e) => need_id("--execution", Some(e))?,
                None => crate::util::uuid_v4(),
            };
            body.insert("execution_uuid".into(), json!(execution));
            match fields.get("trigger") {
                None | Some(Value::Null) => {}
                Some(Value::Object(m)) if m.is_empty() => {}
                Some(Value::Object(m)) => {
                    body.insert("trigger_data".into(), Value::Object(m.clone()));
                }
                Some(_) => return Err("--trigger-json must be a JSON object".into()),
            }
            Event {
                topic: format!("cyberwave/workflow/{workflow}/execution/started"),
                body: Value::Object(body),
                execution,
                workflow,
            }
        }
        "node" => {
            let execution = need_id("--execution", s("execution"))?;
            let node = need_id("--node", s("node"))?;
            let status = s("status").ok_or("--status is required")?;
            if !NODE_STATUSES.contains(&status) {
                return Err(format!(
                    "--status must be one of {}, got {status:?}",
                    NODE_STATUSES.join(", ")
                ));
            }
            body.insert("status".into(), json!(status));
            for (k, key) in [("input", "input_data"), ("output", "output_data")] {
                match fields.get(k) {
                    None | Some(Value::Null) => {}
                    Some(Value::Array(a)) => {
                        body.insert(key.into(), Value::Array(a.clone()));
                    }
                    Some(other) => {
                        body.insert(key.into(), Value::Array(vec![other.clone()]));
                    }
                }
            }
            if let Some(m) = s("error_message") {
                body.insert("error_message".into(), json!(m));
            }
            if let Some(v) = fields.get("execution_time_ms").filter(|v| !v.is_null()) {
                let ms = v
                    .as_i64()
                    .filter(|n| *n >= 0)
                    .ok_or("--execution-time-ms must be a whole number ≥ 0")?;
                body.insert("execution_time_ms".into(), json!(ms));
            }
            match fields.get("metadata") {
                None | Some(Value::Null) => {}
                Some(Value::Object(m)) if m.is_empty() => {}
                Some(Value::Object(m)) => {
                    body.insert("metadata".into(), Value::Object(m.clone()));
                }
                Some(_) => return Err("--metadata-json must be a JSON object".into()),
            }
            for k in ["started_at", "finished_at"] {
                if let Some(v) = fields.get(k).filter(|v| !v.is_null()) {
                    body.insert(
                        k.into(),
                        json!(normalise_time(v)
                            .map_err(|e| format!("--{}: {e}", k.replace('_', "-")))?),
                    );
                }
            }
            if let Some(v) = fields.get("activation_index").filter(|v| !v.is_null()) {
                let n = v
                    .as_u64()
                    .ok_or("--activation-index must be a whole number ≥ 0")?;
                if n > 0 {
                    body.insert("activation_index".into(), json!(n));
                }
            }
            if let Some(c) = s("caller_uuid") {
                body.insert(
                    "caller_uuid".into(),
                    json!(need_id("--caller-uuid", Some(c))?),
                );
            }
            Event {
                topic: format!("cyberwave/workflow/{workflow}/execution/{execution}/node/{node}"),
                body: Value::Object(body),
                execution,
                workflow,
            }
        }
        "finished" => {
            let execution = need_id("--execution", s("execution"))?;
            let status = s("status").ok_or("--status is required")?;
            if !FINISHED_STATUSES.contains(&status) {
                return Err(format!(
                    "--status must be one of {}, got {status:?}",
                    FINISHED_STATUSES.join(", ")
                ));
            }
            body.insert("status".into(), json!(status));
            if let Some(m) = s("error_message") {
                body.insert("error_message".into(), json!(m));
            }
            Event {
                topic: format!("cyberwave/workflow/{workflow}/execution/{execution}/finished"),
                body: Value::Object(body),
                execution,
                workflow,
            }
        }
        other => {
            return Err(format!(
                "the event must be started, node or finished, got {other:?}"
            ))
        }
    };
    let size = serde_json::to_vec(&event.body)
        .map(|b| b.len())
        .unwrap_or(0);
    if size > MAX_EVENT_BYTES {
        return Err(format!(
            "the event payload is {size} bytes; the limit is {MAX_EVENT_BYTES}"
        ));
    }
    Ok(event)
}

/// RFC 3339 (any offset) or epoch seconds → RFC 3339 UTC.
pub fn normalise_time(v: &Value) -> Result<String, String> {
    let secs = match v {
        Value::Number(n) => n.as_f64().ok_or("not a number")?,
        Value::String(s) => match s.trim().parse::<f64>() {
            Ok(f) => f,
            Err(_) => parse_rfc3339(s.trim())?,
        },
        _ => return Err("expected RFC 3339 or epoch seconds".into()),
    };
    if !secs.is_finite() || !(0.0..=253_402_300_799.0).contains(&secs) {
        return Err(format!("{secs} is not a usable time"));
    }
    let t = std::time::UNIX_EPOCH
        .checked_add(std::time::Duration::from_secs_f64(secs))
        .ok_or_else(|| format!("{secs} is not a usable time"))?;
    Ok(crate::util::rfc3339(t))
}

/// `YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)` → seconds since the epoch.
// Every number is at most 4 characters long (|n| ≤ 9999): the sums stay far inside i64.
#[allow(clippy::arithmetic_side_effects)]
pub fn parse_rfc3339(s: &str) -> Result<f64, String> {
    let bad =
        || format!("{s:?} is not an RFC 3339 time (e.g. 2026-11-29T15:48:12Z) or epoch seconds");
    let b = s.as_bytes();
    if b.len() < 20
        || b.get(4) != Some(&b'-')
        || b.get(7) != Some(&b'-')
        || !matches!(b.get(10), Some(b'T' | b't' | b' '))
        || b.get(13) != Some(&b':')
        || b.get(16) != Some(&b':')
    {
        return Err(bad());
    }
    let num =
        |r: std::ops::Range<usize>| s.get(r).and_then(|t| t.parse::<i64>().ok()).ok_or_else(bad);
    let (y, mo, d, h, mi, se) = (
        num(0..4)?,
        num(5..7)?,
        num(8..10)?,
        num(11..13)?,
        num(14..16)?,
        num(17..19)?,
    );
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || se > 60 {
        return Err(bad());
    }
    let mut rest = s.get(19..).ok_or_else(bad)?;
    let mut frac = 0.0;
    if let Some(r) = rest.strip_prefix('.') {
        let digits: String = r.chars().take_while(char::is_ascii_digit).collect();
        if digits.is_empty() {
            return Err(bad());
        }
        frac = format!("0.{digits}").parse::<f64>().map_err(|_| bad())?;
        rest = r.get(digits.len()..).ok_or_else(bad)?;
    }
    let offset = match rest {
        "Z" | "z" => 0,
        o if o.len() == 6
            && (o.starts_with('+') || o.starts_with('-'))
            && o.get(3..4) == Some(":") =>
        {
            let hh: i64 = o.get(1..3).ok_or_else(bad)?.parse().map_err(|_| bad())?;
            let mm: i64 = o.get(4..6).ok_or_else(bad)?.parse().map_err(|_| bad())?;
            let sign = if o.starts_with('-') { -1 } else { 1 };
            sign * (hh * 3600 + mm * 60)
        }
        _ => return Err(bad()),
    };
    let days = days_from_civil(y, mo, d);
    Ok((days * 86_400 + h * 3600 + mi * 60 + se - offset) as f64 + frac)
}

// Called with a 4-character year, month 1..=12 and day 1..=31: no step can overflow.
#[allow(clippy::arithmetic_side_effects)]
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The payload as published: `session_id` is the publishing client's id unless the event
/// carries its own (the SDK's publisher does the same), so the backend can tell sessions apart.
pub fn with_session(body: &Value, client_id: &str) -> Value {
    let mut body = body.clone();
    if let Value::Object(m) = &mut body {
        m.entry("session_id").or_insert_with(|| json!(client_id));
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn started_generates_an_execution_and_omits_empty_fields() {
        let e = build(&f(
            json!({"kind": "started", "workflow": "wf-1", "source_type": "edge"}),
        ))
        .unwrap();
        assert_eq!(e.topic, "cyberwave/workflow/wf-1/execution/started");
        assert_eq!(e.body["source_type"], "edge");
        assert_eq!(e.body["execution_uuid"], json!(e.execution));
        assert!(
            e.body.get("trigger_data").is_none(),
            "optional fields are left out, not null"
        );
    }

    #[test]
    fn events_default_to_edge_and_carry_the_session() {
        for kind in [
            json!({"kind": "started", "workflow": "wf"}),
            json!({"kind": "node", "workflow": "wf", "execution": "ex", "node": "n", "status": "running"}),
            json!({"kind": "finished", "workflow": "wf", "execution": "ex", "status": "success"}),
        ] {
            let e = build(&f(kind.clone())).unwrap();
            assert_eq!(e.body["source_type"], "edge", "{kind}");
            let sent = with_session(&e.body, "cloud_node_ab12cd34");
            assert_eq!(sent["session_id"], "cloud_node_ab12cd34");
        }
        let sim = build(&f(
            json!({"kind": "started", "workflow": "wf", "source_type": "sim"}),
        ));
        assert_eq!(sim.unwrap().body["source_type"], "sim");
        let own = with_session(&json!({"session_id": "mine"}), "cloud_node_x");
        assert_eq!(
            own["session_id"], "mine",
            "an event's own session id is kept"
        );
        assert_eq!(with_session(&json!([1]), "c"), json!([1]));
    }

    #[test]
    fn node_events_are_validated_and_normalised() {
        let e = build(&f(json!({"kind": "node", "workflow": "wf", "execution": "ex", "node": "n1", "status": "success",
            "output": [{"a": 1}], "execution_time_ms": 12, "started_at": "2026-11-29T16:00:00+01:00", "finished_at": 1764432000.5,
            "activation_index": 0}))).unwrap();
        assert_eq!(e.topic, "cyberwave/workflow/wf/execution/ex/node/n1");
        assert_eq!(e.body["started_at"], "2026-11-29T15:00:00.000000Z");
        assert_eq!(e.body["finished_at"], "2025-11-29T16:00:00.500000Z");
        assert!(e.body.get("activation_index").is_none(), "0 is omitted");
        assert!(e.body.get("metadata").is_none());
        for bad in [
            json!({"kind": "node", "workflow": "wf", "execution": "ex", "node": "n", "status": "done"}),
            json!({"kind": "node", "workflow": "wf", "execution": "ex", "node": "n", "status": "running", "started_at": "yesterday"}),
            json!({"kind": "node", "workflow": "wf", "execution": "ex", "status": "running"}),
            json!({"kind": "finished", "workflow": "wf", "execution": "ex", "status": "cancelled"}),
            json!({"kind": "node", "workflow": "../x", "execution": "ex", "node": "n", "status": "running"}),
            json!({"kind": "node", "workflow": "wf", "execution": "ex", "node": "n", "status": "running", "metadata": {"x": "y".repeat(300_000)}}),
        ] {
            assert!(build(&f(bad.clone())).is_err(), "{bad}");
        }
    }

    #[test]
    fn parses_rfc3339() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z").unwrap(), 0.0);
        assert_eq!(
            parse_rfc3339("2000-03-01T00:00:00.25Z").unwrap(),
            951_868_800.25
        );
        assert_eq!(
            parse_rfc3339("2000-03-01T02:00:00+02:00").unwrap(),
            951_868_800.0
        );
        assert!(parse_rfc3339("2000-13-01T00:00:00Z").is_err());
        assert!(parse_rfc3339("2000-03-01").is_err());
    }

    #[test]
    fn rfc3339_with_multibyte_text_is_an_error_not_a_panic() {
        for s in [
            "2026-11-30T15:48:12+0é00",
            "2026-11-30T15:48:12+é:00",
            "2026-11-30T15:48:1éZ",
            "2026-11-30T15:48:12.é",
            "ééééééééééééééééééééé",
            "2026-11-30T15:48:12é",
        ] {
            assert!(parse_rfc3339(s).is_err(), "{s}");
        }
    }
}
