//! Workflow execution ingress (docs/protocol.md, "Workflow events"; D18, D19): the three event
//! kinds, their JSON (optional fields left out, never null), validation, and timestamps.

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

/// Why named fields make no event: the flag at fault and what is wrong with it. Each prints as
/// the line `emit` shows (and the socket answers).
#[derive(Debug, Clone, PartialEq)]
pub enum IngressError {
    /// A required field is missing (`--workflow`, `--status`, …).
    Required(&'static str),
    /// An id that is not a uuid-like id; the first 40 characters given.
    NotAnId(&'static str, String),
    /// A `source_type` outside the platform's list.
    SourceType(String),
    /// A `--…-json` field that is not a JSON object.
    NotAnObject(&'static str),
    /// A `--status` outside `allowed`.
    Status(&'static [&'static str], String),
    /// A field that must be a whole number ≥ 0.
    NotWhole(&'static str),
    /// A `--started-at`/`--finished-at` that is no usable time.
    Time(&'static str, TimeError),
    /// A kind other than started, node or finished.
    Kind(String),
    /// The payload is larger than [`MAX_EVENT_BYTES`].
    TooLarge(usize),
}

impl std::fmt::Display for IngressError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IngressError::Required(what) => write!(f, "{what} is required"),
            IngressError::NotAnId(what, got) => write!(
                f,
                "{what} must be a uuid (letters, digits, - and _), got {got:?}"
            ),
            IngressError::SourceType(st) => write!(f, "--source-type must be one of edge, sim, tele, edit (or edge_leader, edge_follower, sim_tele), got {st:?}"),
            IngressError::NotAnObject(what) => write!(f, "{what} must be a JSON object"),
            IngressError::Status(allowed, got) => write!(
                f,
                "--status must be one of {}, got {got:?}",
                allowed.join(", ")
            ),
            IngressError::NotWhole(what) => write!(f, "{what} must be a whole number ≥ 0"),
            IngressError::Time(flag, e) => write!(f, "{flag}: {e}"),
            IngressError::Kind(other) => write!(
                f,
                "the event must be started, node or finished, got {other:?}"
            ),
            IngressError::TooLarge(size) => write!(
                f,
                "the event payload is {size} bytes; the limit is {MAX_EVENT_BYTES}"
            ),
        }
    }
}

impl std::error::Error for IngressError {}

/// Why a value is not a usable time.
#[derive(Debug, Clone, PartialEq)]
pub enum TimeError {
    /// A JSON number serde cannot give as a float.
    NotANumber,
    /// Neither a string nor a number.
    NotATime,
    /// Parsed, but before 1970 or after the year 9999 (as RFC 3339).
    OutOfRange(String),
    /// Epoch seconds out of range.
    Epoch(f64),
    /// Not RFC 3339; the first 64 characters given.
    NotRfc3339(String),
}

impl std::fmt::Display for TimeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TimeError::NotANumber => write!(f, "not a number"),
            TimeError::NotATime => write!(f, "expected RFC 3339 or epoch seconds"),
            TimeError::OutOfRange(ts) => write!(f, "{ts} is not a usable time (1970 to 9999)"),
            TimeError::Epoch(secs) => write!(
                f,
                "{secs} is not a usable time (epoch seconds from 0 to {MAX_EPOCH_SECONDS})"
            ),
            TimeError::NotRfc3339(s) => write!(
                f,
                "{s:?} is not an RFC 3339 time (e.g. 2026-11-29T15:48:12Z) or epoch seconds"
            ),
        }
    }
}

impl std::error::Error for TimeError {}

fn id_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn need_id(what: &'static str, v: Option<&str>) -> Result<String, IngressError> {
    match v {
        Some(s) if id_ok(s) => Ok(s.to_string()),
        Some(s) => Err(IngressError::NotAnId(what, s.chars().take(40).collect())),
        None => Err(IngressError::Required(what)),
    }
}

/// How many bytes of workflow events may wait in the queue by default
/// (`CYBERWAVE_NODE_INGRESS_QUEUE_BYTES`); one workload may fill a quarter of it (D67).
pub const MAX_QUEUE_BYTES: u64 = 16 * 1024 * 1024;

/// Builds and validates an event from named fields (the `emit` flags or a socket request).
/// `fields` keys: kind (started|node|finished), workflow, execution, node, status, trigger,
/// input, output, error_message, execution_time_ms, metadata, started_at, finished_at,
/// activation_index, caller_uuid, source_type.
pub fn build(fields: &Map<String, Value>) -> Result<Event, IngressError> {
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
            return Err(IngressError::SourceType(st.to_string()));
        }
        body.insert("source_type".into(), json!(st));
    }
    let event = match kind {
        "started" => started_event(fields, workflow, body)?,
        "node" => node_event(fields, workflow, body)?,
        "finished" => finished_event(fields, workflow, body)?,
        other => return Err(IngressError::Kind(other.to_string())),
    };
    let size = serde_json::to_vec(&event.body)
        .map(|b| b.len())
        .unwrap_or(0);
    if size > MAX_EVENT_BYTES {
        return Err(IngressError::TooLarge(size));
    }
    Ok(event)
}

/// `started`: the execution (generated when not given) and its trigger.
fn started_event(
    fields: &Map<String, Value>,
    workflow: String,
    mut body: Map<String, Value>,
) -> Result<Event, IngressError> {
    let s = |k: &str| fields.get(k).and_then(Value::as_str);
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
        Some(_) => return Err(IngressError::NotAnObject("--trigger-json")),
    }
    Ok(Event {
        topic: format!("cyberwave/workflow/{workflow}/execution/started"),
        body: Value::Object(body),
        execution,
        workflow,
    })
}

/// `node`: one node's status, data, timing and times.
fn node_event(
    fields: &Map<String, Value>,
    workflow: String,
    mut body: Map<String, Value>,
) -> Result<Event, IngressError> {
    let s = |k: &str| fields.get(k).and_then(Value::as_str);
    let execution = need_id("--execution", s("execution"))?;
    let node = need_id("--node", s("node"))?;
    let status = s("status").ok_or(IngressError::Required("--status"))?;
    if !NODE_STATUSES.contains(&status) {
        return Err(IngressError::Status(&NODE_STATUSES, status.to_string()));
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
            .ok_or(IngressError::NotWhole("--execution-time-ms"))?;
        body.insert("execution_time_ms".into(), json!(ms));
    }
    match fields.get("metadata") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) if m.is_empty() => {}
        Some(Value::Object(m)) => {
            body.insert("metadata".into(), Value::Object(m.clone()));
        }
        Some(_) => return Err(IngressError::NotAnObject("--metadata-json")),
    }
    for (k, flag) in [
        ("started_at", "--started-at"),
        ("finished_at", "--finished-at"),
    ] {
        if let Some(v) = fields.get(k).filter(|v| !v.is_null()) {
            body.insert(
                k.into(),
                json!(normalise_time(v).map_err(|e| IngressError::Time(flag, e))?),
            );
        }
    }
    if let Some(v) = fields.get("activation_index").filter(|v| !v.is_null()) {
        let n = v
            .as_u64()
            .ok_or(IngressError::NotWhole("--activation-index"))?;
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
    Ok(Event {
        topic: format!("cyberwave/workflow/{workflow}/execution/{execution}/node/{node}"),
        body: Value::Object(body),
        execution,
        workflow,
    })
}

/// `finished`: the execution's outcome.
fn finished_event(
    fields: &Map<String, Value>,
    workflow: String,
    mut body: Map<String, Value>,
) -> Result<Event, IngressError> {
    let s = |k: &str| fields.get(k).and_then(Value::as_str);
    let execution = need_id("--execution", s("execution"))?;
    let status = s("status").ok_or(IngressError::Required("--status"))?;
    if !FINISHED_STATUSES.contains(&status) {
        return Err(IngressError::Status(&FINISHED_STATUSES, status.to_string()));
    }
    body.insert("status".into(), json!(status));
    if let Some(m) = s("error_message") {
        body.insert("error_message".into(), json!(m));
    }
    Ok(Event {
        topic: format!("cyberwave/workflow/{workflow}/execution/{execution}/finished"),
        body: Value::Object(body),
        execution,
        workflow,
    })
}

/// The last second accepted, `jiff`'s latest time: 9999-12-30T22:00:00Z.
const MAX_EPOCH_SECONDS: i64 = 253_402_207_200;

/// RFC 3339 (any offset) or epoch seconds → RFC 3339 UTC (`…T15:48:12.123456Z`). Times before
/// 1970 or after the year 9999 are refused.
pub fn normalise_time(v: &Value) -> Result<String, TimeError> {
    let ts = match v {
        Value::Number(n) => from_epoch_seconds(n.as_f64().ok_or(TimeError::NotANumber)?)?,
        Value::String(s) => match s.trim().parse::<f64>() {
            Ok(f) => from_epoch_seconds(f)?,
            Err(_) => parse_rfc3339(s.trim())?,
        },
        _ => return Err(TimeError::NotATime),
    };
    if !(0..=MAX_EPOCH_SECONDS).contains(&ts.as_second()) {
        return Err(TimeError::OutOfRange(ts.to_string()));
    }
    Ok(crate::util::rfc3339_of(ts))
}

fn from_epoch_seconds(secs: f64) -> Result<jiff::Timestamp, TimeError> {
    if !secs.is_finite() || !(0.0..=MAX_EPOCH_SECONDS as f64).contains(&secs) {
        return Err(TimeError::Epoch(secs));
    }
    jiff::SignedDuration::try_from_secs_f64(secs)
        .ok()
        .and_then(|d| jiff::Timestamp::from_duration(d).ok())
        .ok_or(TimeError::Epoch(secs))
}

/// An RFC 3339 time with an offset (`2026-11-29T15:48:12Z`, `…12.5+01:00`), parsed by `jiff`
/// (which also takes the ISO 8601 forms RFC 3339 leaves out, such as the offset `+01`).
pub fn parse_rfc3339(s: &str) -> Result<jiff::Timestamp, TimeError> {
    s.parse::<jiff::Timestamp>()
        .map_err(|_| TimeError::NotRfc3339(s.chars().take(64).collect()))
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
        let secs = |s: &str| parse_rfc3339(s).map(|t| t.as_duration().as_secs_f64());
        assert_eq!(secs("1970-01-01T00:00:00Z").unwrap(), 0.0);
        assert_eq!(secs("2000-03-01T00:00:00.25Z").unwrap(), 951_868_800.25);
        assert_eq!(secs("2000-03-01T02:00:00+02:00").unwrap(), 951_868_800.0);
        assert_eq!(secs("2000-03-01t02:00:00-00:30").unwrap(), 951_877_800.0);
        assert_eq!(secs("2000-03-01 00:00:00z").unwrap(), 951_868_800.0);
        assert!(parse_rfc3339("2000-13-01T00:00:00Z").is_err());
        assert!(parse_rfc3339("2000-02-30T00:00:00Z").is_err());
        assert!(parse_rfc3339("2000-03-01").is_err());
        assert!(
            parse_rfc3339("2000-03-01T00:00:00").is_err(),
            "a time without an offset is ambiguous"
        );
    }

    #[test]
    fn normalises_times_to_utc_microseconds() {
        for (input, want) in [
            (
                json!("2026-11-29T16:00:00+01:00"),
                "2026-11-29T15:00:00.000000Z",
            ),
            (
                json!("2026-11-29T15:00:00.1234567Z"),
                "2026-11-29T15:00:00.123456Z",
            ),
            (
                json!(" 2026-11-29T15:00:00Z "),
                "2026-11-29T15:00:00.000000Z",
            ),
            (json!(0), "1970-01-01T00:00:00.000000Z"),
            (json!("1764432000.5"), "2025-11-29T16:00:00.500000Z"),
            (json!(253_402_207_200_u64), "9999-12-30T22:00:00.000000Z"),
        ] {
            assert_eq!(normalise_time(&input).as_deref(), Ok(want), "{input}");
        }
        for bad in [
            json!(-1),
            json!(-0.5),
            json!(253_402_207_201_u64),
            json!("9999-12-31T23:59:59Z"),
            json!(1e19),
            json!(u64::MAX),
            json!(i64::MIN),
            json!("NaN"),
            json!("inf"),
            json!("-inf"),
            json!("1e400"),
            json!("1969-12-31T23:59:59Z"),
            json!(""),
            json!(true),
            json!([1]),
            json!({"t": 1}),
        ] {
            assert!(normalise_time(&bad).is_err(), "{bad}");
        }
    }

    /// A multibyte character inside the offset must be an error: a parser that slices bytes
    /// would panic in the middle of `é`, on the node's main thread for `emit`.
    #[test]
    fn a_multibyte_character_in_a_time_is_an_error_not_a_panic() {
        let hostile = [
            "2026-11-30T15:48:12+0é00",
            "2026-11-30T15:48:12+é:00",
            "2026-11-30T15:48:12.é+00:00",
            "2026-11-30T15:48:1é+00:00",
            "2026-11-30T15:48:12+00:0é",
            "2026-11-30T15:48:12+00é0",
            "2026-11-30T15:48:12Zé",
            "é026-11-30T15:48:12+00:00",
            "2026-11-30T15:48:12.999999999999999999999999999+00:00",
            "2026-11-30T15:48:12+99:99",
            "2026-11-30T15:48:12\u{0}+00:00",
            "🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒🕒",
            "\u{202e}2026-11-30T15:48:12Z",
        ];
        for s in hostile {
            let err = normalise_time(&json!(s)).unwrap_err().to_string();
            assert!(err.contains("RFC 3339"), "{s:?}: {err}");
        }
        // Through the `emit` flag parser, as `emit node … --started-at '…+0é00'` runs it.
        let flags = [
            ("--workflow", "wf"),
            ("--execution", "ex"),
            ("--node", "n1"),
            ("--status", "running"),
            ("--started-at", "2026-11-30T15:48:12+0é00"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let fields = crate::emit::fields("node", &flags).unwrap();
        let err = build(&fields).unwrap_err().to_string();
        assert!(err.starts_with("--started-at: "), "{err}");
    }

    #[test]
    fn the_latest_time_is_jiffs() {
        assert_eq!(MAX_EPOCH_SECONDS, jiff::Timestamp::MAX.as_second());
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
