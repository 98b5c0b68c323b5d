//! The typed edge for commands (decisions D8 and D20): a command's params are parsed
//! once, here, into values that validated themselves. Past this module no code sees a raw
//! `workload_uuid`, a raw number of seconds or a raw pid: an id that reaches a topic is
//! topic-safe, seconds are finite and bounded, a pid is in range. What does not validate is an
//! error naming the field and the allowed range, and nothing is spawned, queued or persisted.
//! A command message is read here whole: its envelope (docs/protocol.md, "Commands": JSON
//! object, request id, `command`, size; [`parse_command`]), then its params; the reply's
//! envelope ("Command replies", D1: [`reply`]) is built here too.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::ids::NO_WORKLOAD;
pub use super::ids::{workload_id, FieldError, Kind, TopicId, MAX_ID_BYTES, MAX_REQUEST_ID_BYTES};

/// The longest accepted number of seconds: 30 days (D20).
pub const MAX_SECONDS: f64 = 30.0 * 86_400.0;
/// The largest pid the kernel can hand out (D20).
pub const MAX_PID: i64 = i32::MAX as i64;

/// The JSON type of a value, for error messages (never the value itself).
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A request id: a string or a number of at most [`MAX_REQUEST_ID_BYTES`], or absent. It is
/// echoed in replies; it never reaches a topic or a path as it is (see `store::safe_id`).
#[derive(Debug, Clone, PartialEq)]
pub struct RequestId(Value);

impl RequestId {
    /// Absent (`null` in replies).
    pub fn absent() -> RequestId {
        RequestId(Value::Null)
    }

    pub fn parse(v: Option<&Value>) -> Result<RequestId, FieldError> {
        match v {
            None | Some(Value::Null) => Ok(RequestId::absent()),
            Some(Value::String(s)) if s.len() > MAX_REQUEST_ID_BYTES => Err(FieldError::new(
                "request_id",
                format!(
                    "is {} bytes; at most {MAX_REQUEST_ID_BYTES} bytes are allowed",
                    s.len()
                ),
            )),
            Some(v @ Value::String(_)) | Some(v @ Value::Number(_)) => Ok(RequestId(v.clone())),
            Some(other) => Err(FieldError::new(
                "request_id",
                format!("must be a string or a number, not {}", type_name(other)),
            )),
        }
    }

    /// The id as it came, for echoing in replies.
    pub fn value(&self) -> &Value {
        &self.0
    }

    /// The id as text (numbers in their JSON form); empty when absent.
    pub fn text(&self) -> String {
        match &self.0 {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            other => other.to_string(),
        }
    }

    pub fn is_absent(&self) -> bool {
        self.text().is_empty()
    }
}

impl TopicId {
    /// The `workload_uuid` field of a params object: as [`TopicId::field`], and the text
    /// `"None"` means none too ([`workload_id`]).
    fn workload_field(
        params: &Map<String, Value>,
        path: &str,
    ) -> Result<Option<TopicId>, FieldError> {
        Ok(TopicId::field(params, "workload_uuid", path)?.filter(|u| u.as_str() != NO_WORKLOAD))
    }

    /// An optional id field of a params object: absent, `null` or `""` mean none.
    fn field(
        params: &Map<String, Value>,
        key: &str,
        path: &str,
    ) -> Result<Option<TopicId>, FieldError> {
        match params.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.is_empty() => Ok(None),
            Some(Value::String(s)) => TopicId::new(&format!("{path}{key}"), s).map(Some),
            Some(other) => Err(FieldError::new(
                &format!("{path}{key}"),
                format!("must be a string, not {}", type_name(other)),
            )),
        }
    }
}

/// A workload id read back from a file the node wrote (a workload's record, the note of a
/// start): absent, `null`, `""` or `"None"` (an older version's) mean none ([`workload_id`]);
/// anything else must be a [`TopicId`], or the file does not parse (and is quarantined).
pub fn persisted_workload_id<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<TopicId>, D::Error> {
    let s: Option<String> = Option::deserialize(d)?;
    workload_id(s)
        .map(|s| TopicId::new("workload_uuid", &s))
        .transpose()
        .map_err(serde::de::Error::custom)
}

/// A number of seconds: finite, greater than 0 and at most [`MAX_SECONDS`] (D20), so every
/// `Duration` or `Instant` made from it is in range.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Seconds(f64);

impl Seconds {
    pub fn new(field: &str, v: &Value) -> Result<Seconds, FieldError> {
        let range = format!(
            "must be a number of seconds greater than 0 and at most {MAX_SECONDS} (30 days)"
        );
        match v.as_f64() {
            Some(s) if s.is_finite() && s > 0.0 && s <= MAX_SECONDS => Ok(Seconds(s)),
            _ => Err(FieldError::new(field, range)),
        }
    }

    /// From a number already known to the node (configuration): out-of-range values are None.
    pub fn from_f64(s: f64) -> Option<Seconds> {
        (s.is_finite() && s > 0.0 && s <= MAX_SECONDS).then_some(Seconds(s))
    }

    pub fn get(self) -> f64 {
        self.0
    }

    pub fn duration(self) -> Duration {
        // In range by construction: 0 < s <= 30 days.
        Duration::try_from_secs_f64(self.0).unwrap_or(Duration::ZERO)
    }
}

/// A process id in 1..=2^31-1 (D20).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pid(i32);

impl Pid {
    pub fn get(self) -> i32 {
        self.0
    }
}

/// The signals a cancel may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sig {
    Term,
    Int,
    Kill,
}

impl Sig {
    pub fn number(self) -> i32 {
        match self {
            Sig::Term => libc::SIGTERM,
            Sig::Int => libc::SIGINT,
            Sig::Kill => libc::SIGKILL,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Sig::Term => "SIGTERM",
            Sig::Int => "SIGINT",
            Sig::Kill => "SIGKILL",
        }
    }
}

/// Params keys holding ids that reach a topic or the backend as ids (D18, D20).
const ID_KEYS: &[&str] = &[
    "workflow_uuid",
    "workflow_execution_uuid",
    "execution_uuid",
    "workflow_node_uuid",
    "node_uuid",
    "caller_uuid",
    "workflow_source_type",
];

/// The workflow a start belongs to (D18): what the node's own events about its workload name.
/// Persisted in the workload's record (`meta.json`, field `workflow`) in this shape.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WorkflowCtx {
    pub workflow: String,
    pub execution: String,
    pub node: String,
    pub source_type: String,
    #[serde(default)]
    pub activation_index: Option<u64>,
    #[serde(default)]
    pub caller_uuid: Option<String>,
}

impl WorkflowCtx {
    /// The workflow context a start's params carry, if complete: `workflow_uuid`, the
    /// execution (`workflow_execution_uuid`, else `execution_uuid`) and the node
    /// (`workflow_node_uuid`, else `node_uuid`), each a non-empty string. `source_type` is
    /// `workflow_source_type`, else `sim` for a simulation and `edge` for anything else.
    fn of(kind: Kind, params: &Map<String, Value>) -> Option<WorkflowCtx> {
        let s = |k: &str| {
            params
                .get(k)
                .and_then(Value::as_str)
                .filter(|v| !v.is_empty())
                .map(String::from)
        };
        let workflow = s("workflow_uuid")?;
        let execution = s("workflow_execution_uuid").or_else(|| s("execution_uuid"))?;
        let node = s("workflow_node_uuid").or_else(|| s("node_uuid"))?;
        Some(WorkflowCtx {
            workflow,
            execution,
            node,
            source_type: s("workflow_source_type").unwrap_or_else(|| {
                if kind == Kind::Simulate {
                    "sim".into()
                } else {
                    "edge".into()
                }
            }),
            activation_index: params.get("activation_index").and_then(Value::as_u64),
            caller_uuid: s("caller_uuid"),
        })
    }
}

/// The params of `inference`, `simulate` and `training`.
#[derive(Debug, Clone, PartialEq)]
pub struct StartParams {
    /// The params as sent: what the workload reads from its params file.
    pub params: Map<String, Value>,
    pub workload_uuid: Option<TopicId>,
    pub environment_uuid: Option<TopicId>,
    pub max_runtime: Option<Seconds>,
    /// `gpus`: how many GPUs the workload needs (D36); `None` when absent, null or `"auto"`.
    pub gpus: Option<u32>,
    /// The workflow the start belongs to, when its params name one completely (D18).
    pub workflow: Option<WorkflowCtx>,
}

/// The most GPUs one workload may ask for (no host has more).
pub const MAX_GPUS: u64 = 1024;

impl StartParams {
    /// The params of a start of `kind` (its workflow's default source type depends on it).
    /// `path` prefixes field names in errors (`params.` or `params.command_params.`).
    pub fn parse(
        kind: Kind,
        params: Option<&Value>,
        path: &str,
    ) -> Result<StartParams, FieldError> {
        let map = object(params, path)?;
        let field = |k: &str| format!("{path}{k}");
        let workload_uuid = TopicId::workload_field(map, path)?;
        let environment_uuid = TopicId::field(map, "environment_uuid", path)?;
        for k in ID_KEYS {
            TopicId::field(map, k, path)?;
        }
        let max_runtime = match map.get("max_runtime_seconds") {
            None | Some(Value::Null) => None,
            Some(v) => Some(Seconds::new(&field("max_runtime_seconds"), v)?),
        };
        if let Some(v) = map.get("activation_index") {
            if !v.is_null() && v.as_u64().is_none() {
                return Err(FieldError::new(
                    &field("activation_index"),
                    "must be a whole number from 0",
                ));
            }
        }
        let gpus = match map.get("gpus") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s == "auto" => None,
            Some(v) => match v.as_u64().filter(|n| *n <= MAX_GPUS) {
                Some(n) => u32::try_from(n).ok(),
                None => {
                    return Err(FieldError::new(
                        &field("gpus"),
                        format!("must be a whole number from 0 to {MAX_GPUS}, or \"auto\""),
                    ))
                }
            },
        };
        Ok(StartParams {
            params: map.clone(),
            workload_uuid,
            environment_uuid,
            max_runtime,
            gpus,
            workflow: WorkflowCtx::of(kind, map),
        })
    }
}

/// Which workload a cancel means.
#[derive(Debug, Clone, PartialEq)]
pub enum CancelTarget {
    Pid(Pid),
    Request(String),
}

/// The params of `cancel`.
#[derive(Debug, Clone, PartialEq)]
pub struct CancelParams {
    pub target: CancelTarget,
    pub signal: Sig,
    /// None: the default grace period.
    pub grace: Option<Seconds>,
}

impl CancelParams {
    pub fn parse(params: Option<&Value>) -> Result<CancelParams, FieldError> {
        let map = object(params, "params.")?;
        let signal = match map.get("signal") {
            None | Some(Value::Null) => Sig::Term,
            Some(Value::String(s)) => match s.as_str() {
                "SIGTERM" => Sig::Term,
                "SIGINT" => Sig::Int,
                "SIGKILL" => Sig::Kill,
                other => {
                    return Err(FieldError::sentence(
                        "params.signal",
                        format!(
                            "Invalid signal: {}. Must be SIGTERM, SIGKILL, or SIGINT",
                            cut(&other.escape_debug().to_string(), 64)
                        ),
                    ))
                }
            },
            Some(other) => {
                return Err(FieldError::new(
                    "params.signal",
                    format!(
                        "must be SIGTERM, SIGKILL, or SIGINT, not {}",
                        type_name(other)
                    ),
                ))
            }
        };
        let grace = match map.get("grace_seconds") {
            None | Some(Value::Null) => None,
            Some(v) => Some(Seconds::new("params.grace_seconds", v)?),
        };
        let pid = match map.get("pid") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_i64() {
                // The Python original's backend sends 0 for "no pid".
                Some(0) => None,
                Some(p @ 1..=MAX_PID) => i32::try_from(p).ok().map(Pid),
                _ => {
                    return Err(FieldError::new(
                        "params.pid",
                        format!("must be a whole number from 1 to {MAX_PID}"),
                    ))
                }
            },
        };
        let request = match map.get("workload_request_id") {
            None | Some(Value::Null) => None,
            Some(v) => {
                let rid = RequestId::parse(Some(v)).map_err(|e| FieldError {
                    field: "params.workload_request_id".into(),
                    ..e
                })?;
                Some(rid.text()).filter(|t| !t.is_empty())
            }
        };
        let target = match (pid, request) {
            (Some(p), _) => CancelTarget::Pid(p),
            (None, Some(r)) => CancelTarget::Request(r),
            (None, None) => {
                return Err(FieldError::new(
                    "params",
                    "must name the workload: pid or workload_request_id",
                ))
            }
        };
        Ok(CancelParams {
            target,
            signal,
            grace,
        })
    }
}

/// The params of `workload_received` (docs/protocol.md, "Commands"): a start wrapped with its workload uuid,
/// or a bare acknowledgement.
// One value per command, moved once into its handler: boxing the start would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Received {
    Start(Kind, StartParams),
    Ack(Option<TopicId>),
}

impl Received {
    fn parse(params: Option<&Value>) -> Result<Received, FieldError> {
        let map = object(params, "params.")?;
        let uuid = TopicId::workload_field(map, "params.")?;
        let kind = match map.get("command_type") {
            Some(Value::String(s)) => Kind::parse(s),
            _ => None,
        };
        let Some(kind) = kind else {
            return Ok(Received::Ack(uuid));
        };
        let mut start =
            StartParams::parse(kind, map.get("command_params"), "params.command_params.")?;
        if let Some(u) = &uuid {
            start
                .params
                .insert("workload_uuid".into(), Value::String(u.as_str().into()));
            start.workload_uuid = Some(u.clone());
        }
        Ok(Received::Start(kind, start))
    }

    /// The workload uuid beside the params, read without validating the rest: a refused
    /// `workload_received` still gets its `failed` status (D8) when this much is sound.
    fn uuid_of(params: Option<&Value>) -> Option<TopicId> {
        let map = params?.as_object()?;
        TopicId::workload_field(map, "params.").ok().flatten()
    }
}

/// A command, typed.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    Status,
    Start(Kind, StartParams),
    Cancel(CancelParams),
    Received(Received),
}

/// A command that was refused at the edge, with what the error reply and status need.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub error: FieldError,
    /// The workload the refusal concerns, when it could be read soundly (for a `failed` status).
    pub workload_uuid: Option<TopicId>,
}

impl Command {
    /// The command's name, for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Status => "status",
            Command::Start(k, _) => k.as_str(),
            Command::Cancel(_) => "cancel",
            Command::Received(_) => "workload_received",
        }
    }

    /// Types a command whose envelope was read: `name` is the `command` field.
    pub fn parse(name: &str, params: Option<&Value>) -> Result<Command, Refused> {
        let plain = |error: FieldError| Refused {
            error,
            workload_uuid: None,
        };
        if let Some(kind) = Kind::parse(name) {
            return StartParams::parse(kind, params, "params.")
                .map(|p| Command::Start(kind, p))
                .map_err(|error| Refused {
                    workload_uuid: params
                        .and_then(Value::as_object)
                        .and_then(|m| TopicId::workload_field(m, "params.").ok().flatten()),
                    error,
                });
        }
        match name {
            "status" => Ok(Command::Status),
            "cancel" => CancelParams::parse(params)
                .map(Command::Cancel)
                .map_err(plain),
            "workload_received" => {
                Received::parse(params)
                    .map(Command::Received)
                    .map_err(|error| Refused {
                        error,
                        workload_uuid: Received::uuid_of(params),
                    })
            }
            other => Err(plain(FieldError::sentence(
                "command",
                format!(
                    "Unknown command: {}",
                    cut(&other.escape_debug().to_string(), 200)
                ),
            ))),
        }
    }
}

/// At most `max` characters of `s`, with `…` when cut (char-boundary safe).
fn cut(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", s.get(..i).unwrap_or("")),
        None => s.to_string(),
    }
}

/// `params` must be a JSON object (D8); absent counts as `null`.
fn object<'a>(params: Option<&'a Value>, path: &str) -> Result<&'a Map<String, Value>, FieldError> {
    let field = path.trim_end_matches('.');
    match params {
        Some(Value::Object(m)) => Ok(m),
        None => Err(FieldError::new(
            field,
            "is missing; a JSON object is expected",
        )),
        Some(other) => Err(FieldError::new(
            field,
            format!("must be a JSON object, not {}", type_name(other)),
        )),
    }
}

// The command message's envelope and the reply envelope (docs/protocol.md, "Commands" and
// "Command replies"; D1).

/// Commands larger than this are refused, by default (`CYBERWAVE_NODE_MAX_COMMAND_BYTES`): a
/// preview sends its image inline, base64 in the params (D64).
pub const MAX_COMMAND_BYTES: usize = 32 * 1024 * 1024;

/// A command message after the envelope rules (JSON object, request id, `command`, size),
/// typed ([`Command`]).
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

/// [`parse_command_within`] the default size limit.
pub fn parse_command(payload: &[u8]) -> Incoming {
    parse_command_within(payload, MAX_COMMAND_BYTES)
}

/// A command message typed, or refused. One over `max` bytes, or that is not JSON (nested
/// deeper than serde_json goes, cut short, …), is refused before its params are read; what a
/// shallow scan reads of it ([`super::shallow`]) still gives its error reply and, for a start
/// that names its workload, a `failed` status (D64).
pub fn parse_command_within(payload: &[u8], max: usize) -> Incoming {
    if payload.len() > max {
        return unread(
            payload,
            format!(
                "command payload is {} bytes; the limit is {max} (CYBERWAVE_NODE_MAX_COMMAND_BYTES)",
                payload.len()
            ),
        );
    }
    let value: Value = match serde_json::from_slice(payload) {
        Ok(v) => v,
        Err(e) => return unread(payload, format!("command is not valid JSON: {e}")),
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

/// A command refused before its params were read: what the shallow scan finds of it.
fn unread(payload: &[u8], reason: String) -> Incoming {
    let head = super::shallow::scan(payload);
    if head.echo {
        return Incoming::Echo;
    }
    Incoming::Invalid {
        request_id: head.request_id,
        reason,
        workload_uuid: head.workload_uuid,
    }
}

/// The reply envelope (docs/protocol.md, "Command replies") with `output` as an object (D1).
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
    use serde_json::json;

    fn start(p: Value) -> Result<Command, Refused> {
        Command::parse("inference", Some(&p))
    }

    fn refused_field(r: Result<Command, Refused>) -> String {
        match r {
            Err(r) => r.error.field,
            Ok(c) => panic!("accepted: {c:?}"),
        }
    }

    #[test]
    fn gpus_is_a_whole_number_up_to_the_limit_or_auto() {
        for bad in [
            json!(-1),
            json!(1.5),
            json!("1"),
            json!("AUTO"),
            json!(""),
            json!(true),
            json!([1]),
            json!({"n": 1}),
            json!(MAX_GPUS + 1),
            json!(u64::MAX),
            json!(1e300),
            json!("\u{0}auto"),
        ] {
            let r = start(json!({"workload_uuid": "w1", "gpus": bad}));
            assert_eq!(refused_field(r), "params.gpus", "{bad}");
        }
        for (v, want) in [
            (json!(0), Some(0)),
            (json!(2), Some(2)),
            (json!(MAX_GPUS), Some(1024)),
            (json!("auto"), None),
            (Value::Null, None),
        ] {
            let Ok(Command::Start(_, p)) = start(json!({"gpus": v})) else {
                panic!("{v} refused")
            };
            assert_eq!(p.gpus, want, "{v}");
            assert_eq!(p.params["gpus"], v, "passed on unchanged");
        }
        let Ok(Command::Start(_, p)) = start(json!({})) else {
            panic!()
        };
        assert_eq!(p.gpus, None);
    }

    #[test]
    fn max_runtime_seconds_out_of_range_is_refused_naming_the_field() {
        for bad in [
            json!(1e19),
            json!(-1),
            json!(0),
            json!("10"),
            json!(f64::MAX),
            json!(MAX_SECONDS + 1.0),
        ] {
            let r = start(json!({"workload_uuid": "w1", "max_runtime_seconds": bad}));
            assert_eq!(refused_field(r), "params.max_runtime_seconds", "{bad}");
        }
        let ok = start(json!({"max_runtime_seconds": MAX_SECONDS})).unwrap();
        let Command::Start(_, p) = ok else { panic!() };
        assert_eq!(
            p.max_runtime.unwrap().duration(),
            Duration::from_secs(30 * 86_400)
        );
    }

    #[test]
    fn params_that_are_not_an_object_are_refused() {
        for bad in [json!(null), json!("x"), json!(5), json!([1])] {
            assert_eq!(refused_field(start(bad.clone())), "params", "{bad}");
        }
        assert_eq!(refused_field(Command::parse("training", None)), "params");
        assert!(Command::parse("status", None).is_ok());
    }

    #[test]
    fn topic_ids_refuse_wildcards_separators_whitespace_and_control_characters() {
        for bad in [
            "a/#",
            "+",
            "#",
            "a b",
            "a\nb",
            "\u{1b}[31m",
            "é",
            "a\0",
            &"x".repeat(257),
        ] {
            let r = start(json!({"workload_uuid": bad}));
            assert_eq!(refused_field(r), "params.workload_uuid", "{bad:?}");
        }
        assert!(TopicId::new("f", &"x".repeat(256)).is_ok());
        assert!(TopicId::new("f", "3f1c-AB_9.x:y").is_ok());
        // A refused start still names its workload when that part was sound.
        let r = start(json!({"workload_uuid": "w-ok", "max_runtime_seconds": -5})).unwrap_err();
        assert_eq!(r.workload_uuid.unwrap().as_str(), "w-ok");
    }

    #[test]
    fn a_workload_uuid_of_none_text_or_empty_is_no_workload() {
        for none in ["None", ""] {
            let Ok(Command::Start(_, p)) = start(json!({"workload_uuid": none})) else {
                panic!("refused {none:?}")
            };
            assert_eq!(p.workload_uuid, None, "{none:?}");
        }
        let Ok(Command::Start(_, p)) = start(json!({"workload_uuid": "w1"})) else {
            panic!()
        };
        assert_eq!(
            p.workload_uuid.map(|u| u.as_str().to_string()).as_deref(),
            Some("w1")
        );
        assert_eq!(workload_id(Some("None".into())), None);
        assert_eq!(workload_id(Some(String::new())), None);
        assert_eq!(workload_id(Some("none".into())).as_deref(), Some("none"));
    }

    #[test]
    fn environment_uuid_must_be_a_string() {
        for bad in [json!(42), json!(["env-B"]), json!({}), json!(true)] {
            let r = start(json!({"environment_uuid": bad}));
            assert_eq!(refused_field(r), "params.environment_uuid", "{bad}");
        }
        let Command::Start(_, p) = start(json!({"environment_uuid": "env-A"})).unwrap() else {
            panic!()
        };
        assert_eq!(p.environment_uuid.unwrap().as_str(), "env-A");
    }

    #[test]
    fn workflow_ids_are_topic_safe() {
        for k in ID_KEYS {
            let r = start(json!({ *k: "a/b" }));
            assert_eq!(refused_field(r), format!("params.{k}"));
            let r = start(json!({ *k: 7 }));
            assert_eq!(refused_field(r), format!("params.{k}"));
        }
        assert_eq!(
            refused_field(start(json!({"activation_index": -1}))),
            "params.activation_index"
        );
    }

    fn workflow_of(kind: &str, p: Value) -> Option<WorkflowCtx> {
        match Command::parse(kind, Some(&p)) {
            Ok(Command::Start(_, p)) => p.workflow,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_start_carries_its_workflow_context_when_its_params_name_it_completely() {
        let full = json!({
            "workflow_uuid": "wf", "workflow_execution_uuid": "ex", "workflow_node_uuid": "nd",
            "workflow_source_type": "cloud", "activation_index": 3, "caller_uuid": "c"
        });
        assert_eq!(
            workflow_of("training", full),
            Some(WorkflowCtx {
                workflow: "wf".into(),
                execution: "ex".into(),
                node: "nd".into(),
                source_type: "cloud".into(),
                activation_index: Some(3),
                caller_uuid: Some("c".into()),
            })
        );
        // The short names stand in for the long ones; the long ones win.
        let short = json!({"workflow_uuid": "wf", "execution_uuid": "ex", "node_uuid": "nd"});
        let ctx = workflow_of("inference", short).unwrap();
        assert_eq!((ctx.execution.as_str(), ctx.node.as_str()), ("ex", "nd"));
        let both = json!({"workflow_uuid": "wf", "execution_uuid": "ex-short",
            "workflow_execution_uuid": "ex-long", "node_uuid": "nd-short",
            "workflow_node_uuid": "nd-long"});
        let ctx = workflow_of("inference", both).unwrap();
        assert_eq!(
            (ctx.execution.as_str(), ctx.node.as_str()),
            ("ex-long", "nd-long")
        );
        // The default source type depends on the kind of the start.
        let bare = json!({"workflow_uuid": "wf", "execution_uuid": "ex", "node_uuid": "nd"});
        for (kind, want) in [
            ("simulate", "sim"),
            ("inference", "edge"),
            ("training", "edge"),
        ] {
            let ctx = workflow_of(kind, bare.clone()).unwrap();
            assert_eq!(ctx.source_type, want, "{kind}");
            assert_eq!((ctx.activation_index, ctx.caller_uuid), (None, None));
        }
        // So does that of a start inside `workload_received`.
        let Ok(Command::Received(Received::Start(_, p))) = Command::parse(
            "workload_received",
            Some(&json!({"workload_uuid": "wl", "command_type": "simulate",
                "command_params": bare})),
        ) else {
            panic!()
        };
        assert_eq!(p.workflow.unwrap().source_type, "sim");
        // Incomplete: no context.
        for partial in [
            json!({}),
            json!({"execution_uuid": "ex", "node_uuid": "nd"}),
            json!({"workflow_uuid": "wf", "node_uuid": "nd"}),
            json!({"workflow_uuid": "wf", "execution_uuid": "ex"}),
        ] {
            assert_eq!(workflow_of("inference", partial.clone()), None, "{partial}");
        }
    }

    #[test]
    fn hostile_workflow_params_give_no_context_or_are_refused() {
        let with = |k: &str, v: Value| {
            let mut p = json!({"workflow_uuid": "wf", "execution_uuid": "ex", "node_uuid": "nd"});
            p[k] = v;
            p
        };
        // Empty strings and nulls count as absent: no context, or the default.
        for k in ["workflow_uuid", "execution_uuid", "node_uuid"] {
            assert_eq!(workflow_of("inference", with(k, json!(""))), None, "{k}");
            assert_eq!(workflow_of("inference", with(k, Value::Null)), None, "{k}");
        }
        let empty_long = with("workflow_execution_uuid", json!(""));
        assert_eq!(
            workflow_of("inference", empty_long).unwrap().execution,
            "ex"
        );
        let empty_type = with("workflow_source_type", json!(""));
        assert_eq!(
            workflow_of("simulate", empty_type).unwrap().source_type,
            "sim"
        );
        let empty_caller = with("caller_uuid", json!(""));
        assert_eq!(
            workflow_of("inference", empty_caller).unwrap().caller_uuid,
            None
        );
        // Ids of another type than a string are refused at the edge, naming the field.
        for k in [
            "workflow_uuid",
            "execution_uuid",
            "caller_uuid",
            "workflow_source_type",
        ] {
            for bad in [json!(7), json!(true), json!(["wf"]), json!({"a": "wf"})] {
                let r = start(with(k, bad.clone()));
                assert_eq!(refused_field(r), format!("params.{k}"), "{k}: {bad}");
            }
        }
        // Unicode is no topic-safe id: refused, never cut or mangled.
        for k in ["workflow_uuid", "node_uuid", "workflow_source_type"] {
            for bad in ["é", "wf\u{200b}", "\u{1F600}", "ω/ω"] {
                let r = start(with(k, json!(bad)));
                assert_eq!(refused_field(r), format!("params.{k}"), "{k}: {bad:?}");
            }
        }
        // activation_index: any whole number from 0 that JSON carries; anything else is refused.
        let max = with("activation_index", json!(u64::MAX));
        assert_eq!(
            workflow_of("inference", max).unwrap().activation_index,
            Some(u64::MAX)
        );
        let none = with("activation_index", Value::Null);
        assert_eq!(
            workflow_of("inference", none).unwrap().activation_index,
            None
        );
        for bad in [
            json!(-1),
            json!(1.5),
            json!(1e300),
            json!("3"),
            json!([3]),
            json!(true),
        ] {
            let r = start(with("activation_index", bad.clone()));
            assert_eq!(refused_field(r), "params.activation_index", "{bad}");
        }
        // Keys the context does not read change nothing.
        let extra = with("workflow", json!({"nested": "x"}));
        assert!(workflow_of("inference", extra).is_some());
    }

    #[test]
    fn the_workflow_context_keeps_its_persisted_shape() {
        let ctx = WorkflowCtx {
            workflow: "wf".into(),
            execution: "ex".into(),
            node: "nd".into(),
            source_type: "edge".into(),
            activation_index: None,
            caller_uuid: None,
        };
        // What meta.json holds (field names and order, the nulls), byte for byte.
        assert_eq!(
            serde_json::to_string(&ctx).unwrap(),
            r#"{"workflow":"wf","execution":"ex","node":"nd","source_type":"edge","activation_index":null,"caller_uuid":null}"#
        );
        // And records that omit the optional fields still read.
        let old: WorkflowCtx = serde_json::from_str(
            r#"{"workflow":"wf","execution":"ex","node":"nd","source_type":"edge"}"#,
        )
        .unwrap();
        assert_eq!(old, ctx);
    }

    #[test]
    fn request_ids_are_bounded_and_typed() {
        assert!(RequestId::parse(Some(&json!("x".repeat(MAX_REQUEST_ID_BYTES)))).is_ok());
        let e = RequestId::parse(Some(&json!("x".repeat(MAX_REQUEST_ID_BYTES + 1)))).unwrap_err();
        assert_eq!(e.field, "request_id");
        assert!(RequestId::parse(Some(&json!({"a": 1}))).is_err());
        assert_eq!(RequestId::parse(Some(&json!(12))).unwrap().text(), "12");
        assert!(RequestId::parse(None).unwrap().is_absent());
    }

    #[test]
    fn cancel_params_are_checked() {
        let c = |p: Value| Command::parse("cancel", Some(&p));
        assert_eq!(refused_field(c(json!({"pid": -1}))), "params.pid");
        assert_eq!(refused_field(c(json!({"pid": 1u64 << 31}))), "params.pid");
        assert_eq!(refused_field(c(json!({"pid": 1.5}))), "params.pid");
        assert_eq!(
            refused_field(c(json!({"pid": 3, "grace_seconds": 1e19}))),
            "params.grace_seconds"
        );
        assert_eq!(
            refused_field(c(json!({"pid": 3, "grace_seconds": 0}))),
            "params.grace_seconds"
        );
        assert_eq!(
            refused_field(c(json!({"pid": 3, "signal": "SIGSTOP"}))),
            "params.signal"
        );
        assert_eq!(
            refused_field(c(json!({"pid": 3, "signal": 9}))),
            "params.signal"
        );
        assert_eq!(refused_field(c(json!({}))), "params");
        assert_eq!(refused_field(c(json!({"pid": 0}))), "params");
        assert_eq!(refused_field(c(json!(null))), "params");
        let Command::Cancel(p) =
            c(json!({"pid": i32::MAX, "signal": "SIGKILL", "grace_seconds": 2.5})).unwrap()
        else {
            panic!()
        };
        assert_eq!(p.target, CancelTarget::Pid(Pid(i32::MAX)));
        assert_eq!(p.signal, Sig::Kill);
        assert_eq!(p.grace.unwrap().duration(), Duration::from_millis(2500));
        let Command::Cancel(p) = c(json!({"workload_request_id": 17})).unwrap() else {
            panic!()
        };
        assert_eq!(p.target, CancelTarget::Request("17".into()));
    }

    #[test]
    fn workload_received_types_its_inner_start() {
        let r = |p: Value| Command::parse("workload_received", Some(&p));
        let Command::Received(Received::Start(k, p)) = r(
            json!({"workload_uuid": "wl", "command_type": "simulate", "command_params": {"a": 1}}),
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(k, Kind::Simulate);
        assert_eq!(p.workload_uuid.unwrap().as_str(), "wl");
        assert_eq!(p.params["workload_uuid"], "wl");
        let e =
            r(json!({"workload_uuid": "wl", "command_type": "training", "command_params": null}))
                .unwrap_err();
        assert_eq!(e.error.field, "params.command_params");
        assert_eq!(e.workload_uuid.unwrap().as_str(), "wl");
        assert!(matches!(
            r(json!({"command_type": "other"})).unwrap(),
            Command::Received(Received::Ack(None))
        ));
        assert_eq!(
            refused_field(r(json!({"workload_uuid": "a/#"}))),
            "params.workload_uuid"
        );
    }

    #[test]
    fn unknown_commands_are_named_and_cut() {
        let e = Command::parse(&"z".repeat(10_000), None).unwrap_err();
        assert!(e.error.reason.starts_with("Unknown command: zzz"));
        assert!(e.error.reason.len() < 300);
    }

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

    /// D64: refused before its params are read, a start still names its request and workload.
    #[test]
    fn d64_a_command_refused_unread_keeps_its_request_id_and_workload() {
        let start = br#"{"command":"training","request_id":"r","params":{"workload_uuid":"wl-1"}}"#;
        match parse_command_within(start, 20) {
            Incoming::Invalid {
                request_id,
                reason,
                workload_uuid,
            } => {
                assert_eq!(request_id, Some(json!("r")));
                assert!(reason.contains("the limit is 20"), "{reason}");
                assert_eq!(
                    workload_uuid.map(|w| w.as_str().to_string()),
                    Some("wl-1".into())
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(parse_command(start), Incoming::Command { .. }));
        assert_eq!(
            parse_command_within(br#"{"status":"ok","request_id":"r","x":1}"#, 5),
            Incoming::Echo
        );
        let deep = format!(
            r#"{{"request_id":"d","command":"inference","params":{{"workload_uuid":"w","x":{}}}}}"#,
            "[".repeat(129) + &"]".repeat(129)
        );
        match parse_command(deep.as_bytes()) {
            Incoming::Invalid {
                request_id,
                workload_uuid,
                ..
            } => {
                assert_eq!(request_id, Some(json!("d")));
                assert!(workload_uuid.is_some());
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
