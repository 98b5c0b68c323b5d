//! The fake Cyberwave backend: an MQTT v5 responder that answers requests on their response
//! topic with their correlation data, plus a small HTTP server for the REST endpoints. Its
//! behaviour is scriptable per test; everything it saw is recorded.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::mqtt5;
use super::wait_for;

#[derive(Clone, Debug)]
pub enum HeartbeatMode {
    Ok,
    /// Answer every heartbeat after this long.
    Delay(Duration),
    /// Refuse with this code and message.
    Code(i64, &'static str),
    /// Never answer.
    Silent,
}

#[derive(Clone, Debug)]
pub struct Behaviour {
    /// Status of `GET /api/v1/cloud-node/instances` (the token check).
    pub token_status: u16,
    pub heartbeat: HeartbeatMode,
    /// Refuse the next N registrations (R2) with this code.
    pub register_refusals: Option<(u32, i64)>,
    /// Delay before acknowledging R5 terminate.
    pub terminate_delay: Duration,
    /// Do not answer any request at all.
    pub mute: bool,
    /// The next N signed-URL PUTs answer 503.
    pub put_failures: u32,
    /// Each PUT takes at least this long.
    pub put_delay: Duration,
    /// E7 answers by workload uuid: (HTTP status, body); `None` = hang for 30 s.
    pub workloads: std::collections::HashMap<String, Option<(u16, Value)>>,
    /// The `upload_method` the R9 answer carries, by requested file name (absent: none sent).
    /// `"multipart"` also makes the URL the platform's form-upload endpoint.
    pub upload_methods: std::collections::HashMap<String, Value>,
    /// Every REST call answers `400 workspace_required` unless it names a workspace uuid.
    pub require_workspace_uuid: bool,
    /// A `multipart` answer names this URL instead of the platform's endpoint.
    pub multipart_url: Option<String>,
    /// Signed URLs point at this origin instead of the fake's own `/upload/` (the upload
    /// benchmark's discard sink).
    pub upload_base: Option<String>,
}

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour {
            token_status: 200,
            heartbeat: HeartbeatMode::Ok,
            register_refusals: None,
            terminate_delay: Duration::ZERO,
            mute: false,
            put_failures: 0,
            put_delay: Duration::ZERO,
            workloads: Default::default(),
            upload_methods: Default::default(),
            require_workspace_uuid: false,
            multipart_url: None,
            upload_base: None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Request {
    /// `request-instance`, `register`, `heartbeat`, `terminate`, `fail`, `logs`,
    /// `workload:update-status`, …
    pub op: String,
    pub topic: String,
    /// The instance uuid (or token) segment of the topic.
    pub id: String,
    pub body: Value,
    pub at: Instant,
    pub wall: std::time::SystemTime,
    pub api_token: Option<String>,
    pub has_correlation: bool,
}

#[derive(Default)]
struct State {
    requests: Vec<Request>,
    replies: Vec<(Instant, String, Value)>,
    http: Vec<(String, Option<String>)>,
    behaviour: Behaviour,
    created: u32,
    http_url: String,
    /// Bytes received through signed URLs, by attachment file name.
    uploads: std::collections::BTreeMap<String, Vec<u8>>,
    /// Files POSTed as `multipart/form-data`, by attachment uuid.
    form_uploads: std::collections::BTreeMap<String, FormUpload>,
    /// Requested file name → the attachment file name R9 answered with.
    attachment_names: std::collections::BTreeMap<String, String>,
    attachments: u32,
    /// Signed-URL PUTs being received now, and the most at once so far.
    puts_in_flight: usize,
    max_puts_in_flight: usize,
}

/// One `multipart/form-data` upload as the fake platform received it.
#[derive(Clone, Debug)]
pub struct FormUpload {
    /// The `name` of the one part.
    pub field: String,
    /// The `filename` of the part, as sent.
    pub filename: String,
    pub bytes: Vec<u8>,
    pub authorization: Option<String>,
    /// How many parts the body had.
    pub parts: usize,
}

/// Splits a `multipart/form-data` body: (headers text, bytes) per part. `None` when malformed.
pub fn parse_multipart(content_type: &str, body: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    let boundary = content_type
        .split(';')
        .map(str::trim)
        .find_map(|p| p.strip_prefix("boundary="))?
        .trim_matches('"');
    let find = |hay: &[u8], needle: &[u8], from: usize| -> Option<usize> {
        hay.get(from..)?
            .windows(needle.len())
            .position(|w| w == needle)
            .map(|i| i + from)
    };
    let delim = format!("--{boundary}").into_bytes();
    let mut at = find(body, &delim, 0)? + delim.len();
    let mut parts = Vec::new();
    loop {
        if body.get(at..at + 2)? == b"--" {
            return Some(parts);
        }
        if body.get(at..at + 2)? != b"\r\n" {
            return None;
        }
        let head_end = find(body, b"\r\n\r\n", at + 2)?;
        let headers = String::from_utf8(body.get(at + 2..head_end)?.to_vec()).ok()?;
        let next = [b"\r\n".as_slice(), &delim].concat();
        let end = find(body, &next, head_end + 4)?;
        parts.push((headers, body.get(head_end + 4..end)?.to_vec()));
        at = end + next.len();
    }
}

pub struct ControlPlane {
    pub prefix: String,
    client: mqtt5::Client,
    state: Arc<Mutex<State>>,
    pub http_url: String,
    _http: Arc<tiny_http::Server>,
}

fn lock(s: &Arc<Mutex<State>>) -> std::sync::MutexGuard<'_, State> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

impl ControlPlane {
    pub fn start(broker_port: u16, prefix: &str) -> ControlPlane {
        Self::start_with(broker_port, prefix, Behaviour::default())
    }

    pub fn start_with(broker_port: u16, prefix: &str, behaviour: Behaviour) -> ControlPlane {
        let state = Arc::new(Mutex::new(State {
            behaviour,
            ..Default::default()
        }));
        let topics: Vec<String> = [
            "cyberwave/cloud-node-token/+/request-instance",
            "cyberwave/cloud-node/+/register",
            "cyberwave/cloud-node/+/heartbeat",
            "cyberwave/cloud-node/+/terminate",
            "cyberwave/cloud-node/+/fail",
            "cyberwave/cloud-node/+/logs",
            "cyberwave/cloud-node/+/response",
            "cyberwave/cloud-workload/#",
            "cyberwave/workflow/#",
        ]
        .iter()
        .map(|t| format!("{prefix}{t}"))
        .collect();
        static CLIENTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let client_id = format!(
            "fake_backend_{}_{}",
            std::process::id(),
            CLIENTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        );
        let st = state.clone();
        let pfx = prefix.to_string();
        let client = mqtt5::Client::connect(broker_port, &client_id, topics, move |cli, msg| {
            handle(cli, &st, &pfx, msg)
        })
        .expect("the fake backend connects and subscribes");

        let http = Arc::new(tiny_http::Server::http("127.0.0.1:0").expect("http server"));
        let port = http.server_addr().to_ip().map(|a| a.port()).unwrap_or(0);
        lock(&state).http_url = format!("http://127.0.0.1:{port}");
        let (srv, st) = (http.clone(), state.clone());
        std::thread::spawn(move || {
            for req in srv.incoming_requests() {
                let st = st.clone();
                std::thread::spawn(move || serve_http(req, &st));
            }
        });
        ControlPlane {
            prefix: prefix.to_string(),
            client,
            state,
            http_url: format!("http://127.0.0.1:{port}"),
            _http: http,
        }
    }

    pub fn set_behaviour(&self, f: impl FnOnce(&mut Behaviour)) {
        f(&mut lock(&self.state).behaviour);
    }

    pub fn requests(&self, op: &str) -> Vec<Request> {
        lock(&self.state)
            .requests
            .iter()
            .filter(|r| r.op == op)
            .cloned()
            .collect()
    }

    pub fn all_requests(&self) -> Vec<Request> {
        lock(&self.state).requests.clone()
    }

    pub fn wait_requests(&self, op: &str, n: usize, timeout: Duration) -> Vec<Request> {
        wait_for(timeout, || {
            let r = self.requests(op);
            (r.len() >= n).then_some(r)
        })
        .unwrap_or_else(|| self.requests(op))
    }

    /// Bodies of every workload status update (R7/R8) for workload `wl`, in arrival order.
    pub fn statuses(&self, wl: &str) -> Vec<Value> {
        lock(&self.state)
            .requests
            .iter()
            .filter(|r| r.op == "workload:update-status" && r.id == wl)
            .map(|r| r.body.clone())
            .collect()
    }

    /// The `completed` status updates of workload `wl` so far.
    pub fn completions(&self, wl: &str) -> Vec<Value> {
        self.statuses(wl)
            .into_iter()
            .filter(|b| b["status"] == "completed")
            .collect()
    }

    /// Waits at most `timeout` for workload `wl`'s first `completed` status update; returns the
    /// completions so far.
    pub fn wait_completions(&self, wl: &str, timeout: Duration) -> Option<Vec<Value>> {
        wait_for(timeout, || {
            Some(self.completions(wl)).filter(|d| !d.is_empty())
        })
    }

    /// Waits until workload `wl` has a status update with `status` = `want`; returns them all.
    pub fn wait_status(&self, wl: &str, want: &str, timeout: Duration) -> Option<Vec<Value>> {
        wait_for(timeout, || {
            let all = self.statuses(wl);
            all.iter().any(|b| b["status"] == want).then_some(all)
        })
    }

    /// Bytes that reached the signed-URL sink, by attachment file name.
    /// The most signed-URL PUTs the fake received at the same time.
    pub fn max_puts_in_flight(&self) -> usize {
        lock(&self.state).max_puts_in_flight
    }

    pub fn uploads(&self) -> std::collections::BTreeMap<String, Vec<u8>> {
        lock(&self.state).uploads.clone()
    }

    /// Files that reached the multipart upload endpoint, by attachment uuid.
    pub fn form_uploads(&self) -> std::collections::BTreeMap<String, FormUpload> {
        lock(&self.state).form_uploads.clone()
    }

    /// The attachment file name R9 gave for a requested file name.
    pub fn attachment_name(&self, requested: &str) -> Option<String> {
        lock(&self.state).attachment_names.get(requested).cloned()
    }

    pub fn http_hits(&self) -> Vec<(String, Option<String>)> {
        lock(&self.state).http.clone()
    }

    /// Waits until the fake backend is subscribed again (after a broker restart): a QoS 1 event
    /// is acknowledged by the broker even when nobody listens, so a test that restarts the broker
    /// must not let the node publish before its backend is back.
    pub fn wait_subscribed(&self) {
        for i in 0..200 {
            let topic = format!("{}cyberwave/workflow/__probe__/{i}", self.prefix);
            self.client
                .publish_acked(&topic, b"{}", Duration::from_millis(500));
            let seen = wait_for(Duration::from_millis(100), || {
                self.requests("ingress")
                    .iter()
                    .any(|r| r.id == format!("__probe__/{i}"))
                    .then_some(())
            });
            if seen.is_some() {
                return;
            }
        }
        panic!("the fake backend did not resubscribe");
    }

    /// Publishes a command (QoS 1) to `…/cloud-node/{id}/command`.
    pub fn command(&self, id: &str, body: Value) {
        super::secrets::register_in(&body);
        self.command_raw(id, serde_json::to_vec(&body).unwrap_or_default());
    }

    pub fn command_raw(&self, id: &str, payload: Vec<u8>) {
        let topic = format!("{}cyberwave/cloud-node/{id}/command", self.prefix);
        // The fake backend may itself be reconnecting (after a broker restart): retry a while.
        let sent = wait_for(Duration::from_secs(10), || {
            self.client
                .publish_acked(&topic, &payload, Duration::from_secs(2))
                .then_some(())
        });
        assert!(
            sent.is_some(),
            "the fake backend could not publish a command"
        );
    }

    /// Every command reply with this request id, in arrival order: when, on which topic, what.
    fn replies_with(&self, request_id: &str) -> Vec<(Instant, String, Value)> {
        lock(&self.state)
            .replies
            .iter()
            .filter(|(_, _, v)| v["request_id"] == json!(request_id))
            .cloned()
            .collect()
    }

    /// Every command reply with this request id, in arrival order.
    pub fn replies_for(&self, request_id: &str) -> Vec<Value> {
        self.replies_with(request_id)
            .into_iter()
            .map(|(_, _, v)| v)
            .collect()
    }

    pub fn reply_time(&self, request_id: &str) -> Option<Instant> {
        self.replies_with(request_id).first().map(|(t, _, _)| *t)
    }

    pub fn reply_topic(&self, request_id: &str) -> Option<String> {
        self.replies_with(request_id)
            .first()
            .map(|(_, t, _)| t.clone())
    }

    pub fn wait_reply(&self, request_id: &str, timeout: Duration) -> Option<Value> {
        wait_for(timeout, || self.replies_for(request_id).into_iter().next())
    }

    /// Asks `id` for `status` again and again (request ids `<tag>-1`, `<tag>-2`, …) until one
    /// is answered or `timeout` passes: after a broker restart a command published before the
    /// node (or this fake backend) subscribed again is lost with the broker's sessions.
    pub fn status_eventually(&self, id: &str, tag: &str, timeout: Duration) -> Option<Value> {
        let mut n = 0;
        wait_for(timeout, || {
            n += 1;
            self.status(id, &format!("{tag}-{n}"), Duration::from_secs(2))
        })
    }

    /// Sends a command to `node` and returns its reply (panics, with the node's log, when none
    /// comes). The request id is the body's, a string or whatever JSON it is.
    pub fn ask(&self, node: &super::NodeProcess, body: Value) -> Value {
        let rid = match &body["request_id"] {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        self.command(&node.uuid(), body);
        self.wait_reply(&rid, super::timeouts::REPLY)
            .unwrap_or_else(|| panic!("no reply to {rid}; log:\n{}", node.log()))
    }

    /// Sends `status` to `id` and waits for the reply.
    pub fn status(&self, id: &str, request_id: &str, timeout: Duration) -> Option<Value> {
        self.command(id, json!({"command": "status", "request_id": request_id}));
        self.wait_reply(request_id, timeout)
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.client.close();
    }
}

fn serve_http(mut req: tiny_http::Request, st: &Arc<Mutex<State>>) {
    fn header(req: &tiny_http::Request, name: &'static str) -> Option<String> {
        req.headers()
            .iter()
            .find(|h| h.field.equiv(name))
            .map(|h| h.value.to_string())
    }
    let auth = header(&req, "Authorization");
    let url = req.url().to_string();
    let path = url.split('?').next().unwrap_or("").to_string();
    lock(st).http.push((url.clone(), auth.clone()));
    let form_upload = {
        let p: Vec<&str> = path.split('/').collect();
        match p.as_slice() {
            ["", "api", "v1", "cloud-node-workloads", _, "attachments", att, "upload"] => {
                Some(att.to_string())
            }
            _ => None,
        }
    };
    let needs_workspace = lock(st).behaviour.require_workspace_uuid
        && path.starts_with("/api/")
        && !url.contains("workspace_uuid=");
    let (status, body): (u16, String) = if needs_workspace {
        (
            400,
            json!({"code": "workspace_required", "detail": "name a workspace"}).to_string(),
        )
    } else if path.starts_with("/api/v1/cloud-node/instances") {
        (lock(st).behaviour.token_status, "[]".into())
    } else if let Some(att) = form_upload {
        let ctype = header(&req, "Content-Type").unwrap_or_default();
        let mut bytes = Vec::new();
        let _ = std::io::Read::read_to_end(req.as_reader(), &mut bytes);
        let post = *req.method() == tiny_http::Method::Post;
        match parse_multipart(&ctype, &bytes).filter(|_| post) {
            Some(parts) => {
                let n = parts.len();
                let (head, data) = parts.into_iter().next().unwrap_or_default();
                let attr = |key: &str| {
                    let k = format!("{key}=\"");
                    head.find(&k).map(|i| {
                        let rest = &head[i + k.len()..];
                        rest[..rest.find('"').unwrap_or(rest.len())].to_string()
                    })
                };
                let up = FormUpload {
                    field: attr(" name").unwrap_or_default(),
                    filename: attr("filename").unwrap_or_default(),
                    bytes: data,
                    authorization: auth,
                    parts: n,
                };
                lock(st).form_uploads.insert(att, up);
                (200, json!({"success": true}).to_string())
            }
            None => (400, "not a multipart/form-data POST".into()),
        }
    } else if let Some(name) = path.strip_prefix("/upload/") {
        {
            let mut s = lock(st);
            s.puts_in_flight += 1;
            s.max_puts_in_flight = s.max_puts_in_flight.max(s.puts_in_flight);
        }
        let mut bytes = Vec::new();
        let _ = std::io::Read::read_to_end(req.as_reader(), &mut bytes);
        let (fail, delay) = {
            let mut s = lock(st);
            let fail = s.behaviour.put_failures > 0;
            if fail {
                s.behaviour.put_failures -= 1;
            }
            (fail, s.behaviour.put_delay)
        };
        std::thread::sleep(delay);
        lock(st).puts_in_flight -= 1;
        if fail {
            (503, "try later".into())
        } else if *req.method() != tiny_http::Method::Put {
            (405, "signed URLs take PUT".into())
        } else {
            lock(st).uploads.insert(name.to_string(), bytes);
            (200, String::new())
        }
    } else if let Some(wl) = path.strip_prefix("/api/v1/cloud-node-workloads/") {
        let answer = lock(st).behaviour.workloads.get(wl).cloned();
        match answer {
            None => (200, json!({"status": "running"}).to_string()),
            Some(Some((code, body))) => (code, body.to_string()),
            Some(None) => {
                std::thread::sleep(Duration::from_secs(30));
                (504, String::new())
            }
        }
    } else {
        (404, String::new())
    };
    let _ = req.respond(tiny_http::Response::from_string(body).with_status_code(status));
}

fn handle(cli: &mqtt5::Client, st: &Arc<Mutex<State>>, prefix: &str, msg: mqtt5::Incoming) {
    let topic = msg.topic;
    let body: Value = serde_json::from_slice(&msg.payload).unwrap_or(Value::Null);
    let rest = topic.strip_prefix(prefix).unwrap_or(&topic);
    let parts: Vec<&str> = rest.split('/').collect();
    let (op, id) = match parts.as_slice() {
        ["cyberwave", "cloud-node-token", t, "request-instance"] => {
            ("request-instance".to_string(), t.to_string())
        }
        ["cyberwave", "cloud-node", id, leaf] => (leaf.to_string(), id.to_string()),
        ["cyberwave", "cloud-workload", wl, leaf] => (format!("workload:{leaf}"), wl.to_string()),
        ["cyberwave", "workflow", rest @ ..] => ("ingress".to_string(), rest.join("/")),
        _ => ("other".to_string(), String::new()),
    };
    if op == "response" {
        lock(st).replies.push((Instant::now(), topic, body));
        return;
    }
    let (response_topic, correlation) = (msg.response_topic, msg.correlation);
    let api_token = msg
        .user
        .into_iter()
        .find(|(k, _)| k == "X-API-Token")
        .map(|(_, v)| v);
    let (reply, delay) = {
        let mut s = lock(st);
        s.requests.push(Request {
            op: op.clone(),
            topic: topic.clone(),
            id: id.clone(),
            body: body.clone(),
            at: Instant::now(),
            wall: std::time::SystemTime::now(),
            api_token,
            has_correlation: correlation.is_some(),
        });
        if s.behaviour.mute {
            return;
        }
        match op.as_str() {
            "request-instance" => {
                s.created += 1;
                let n = s.created;
                let slug = body["slug"]
                    .as_str()
                    .map(String::from)
                    .unwrap_or_else(|| format!("node-{n}"));
                (
                    Some(
                        json!({"success": true, "uuid": format!("00000000-0000-4000-8000-{n:012}"), "slug": slug}),
                    ),
                    Duration::ZERO,
                )
            }
            "register" => match s.behaviour.register_refusals {
                Some((left, code)) if left > 0 => {
                    s.behaviour.register_refusals = Some((left - 1, code));
                    (
                        Some(
                            json!({"success": false, "code": code, "message": "refused by the test"}),
                        ),
                        Duration::ZERO,
                    )
                }
                _ => (
                    Some(
                        json!({"success": true, "uuid": id, "slug": format!("slug-{}", &id[id.len().saturating_sub(4)..])}),
                    ),
                    Duration::ZERO,
                ),
            },
            "heartbeat" => match s.behaviour.heartbeat.clone() {
                HeartbeatMode::Ok => (Some(json!({"success": true})), Duration::ZERO),
                HeartbeatMode::Delay(d) => (Some(json!({"success": true})), d),
                HeartbeatMode::Code(c, m) => (
                    Some(json!({"success": false, "code": c, "message": m})),
                    Duration::ZERO,
                ),
                HeartbeatMode::Silent => (None, Duration::ZERO),
            },
            "terminate" => (Some(json!({"success": true})), s.behaviour.terminate_delay),
            "workload:request-signed-url" => {
                s.attachments += 1;
                let name = body["filename"].as_str().unwrap_or("file");
                let ext = name
                    .rsplit_once('.')
                    .map(|(_, e)| format!(".{e}"))
                    .unwrap_or_default();
                let uuid = format!("att-{:04}", s.attachments);
                let att = format!("{uuid}{ext}");
                s.attachment_names.insert(name.to_string(), att.clone());
                let method = s.behaviour.upload_methods.get(name).cloned();
                let url = if let (Some(u), true) = (
                    s.behaviour.multipart_url.clone(),
                    method == Some(json!("multipart")),
                ) {
                    u
                } else if method == Some(json!("multipart")) {
                    format!(
                        "{}/api/v1/cloud-node-workloads/{id}/attachments/{uuid}/upload",
                        s.http_url
                    )
                } else {
                    let base = s
                        .behaviour
                        .upload_base
                        .clone()
                        .unwrap_or(s.http_url.clone());
                    format!("{base}/upload/{att}")
                };
                let mut reply = json!({"signed_url": url, "filename": att, "expiration_hours": 1});
                if let Some(m) = method {
                    reply["upload_method"] = m;
                }
                (Some(reply), Duration::ZERO)
            }
            _ => (Some(json!({"success": true})), Duration::ZERO),
        }
    };
    let (Some(reply), Some(rt), Some(corr)) = (reply, response_topic, correlation) else {
        return;
    };
    let out = serde_json::to_vec(&reply).unwrap_or_default();
    if delay.is_zero() {
        let _ = cli.publish(&rt, &out, Some(&corr));
    } else {
        let cli = cli.clone();
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            let _ = cli.publish(&rt, &out, Some(&corr));
        });
    }
}
