//! The REST side of the backend (ureq, blocking; only ever called from start-up or worker
//! threads, never from the event loop).

use std::time::Duration;

use std::sync::{Arc, OnceLock};

use ureq::tls::{PemItem, RootCerts, TlsConfig, TlsProvider};

/// The trust store for HTTPS: the system bundle (or `SSL_CERT_FILE`), found at the usual paths
/// of Debian, RHEL and Alpine. A static OpenSSL has no usable compiled-in path, and ureq's own
/// default (bundled Mozilla roots) is not built in.
fn roots() -> RootCerts {
    static ROOTS: OnceLock<RootCerts> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let file =
                crate::mqtt::trust_store(None, std::env::var("SSL_CERT_FILE").ok().as_deref())
                    .map_err(|e| e.to_string());
            let pem = file.and_then(|p| std::fs::read(&p).map_err(|e| e.to_string()));
            let certs: Vec<_> = match pem {
                Ok(pem) => ureq::tls::parse_pem(&pem)
                    .filter_map(|item| match item {
                        Ok(PemItem::Certificate(c)) => Some(c),
                        _ => None,
                    })
                    .collect(),
                Err(_) => Vec::new(),
            };
            if certs.is_empty() {
                RootCerts::PlatformVerifier
            } else {
                RootCerts::Specific(Arc::new(certs))
            }
        })
        .clone()
}

/// Outcome of the start-up token check (REST E1).
#[derive(Debug, PartialEq)]
pub enum TokenCheck {
    Accepted,
    /// 401 or 403.
    Rejected(u16),
    /// Anything else: the node warns and goes on.
    Inconclusive(String),
}

pub fn agent(timeout: Duration) -> ureq::Agent {
    agent_with(timeout, None)
}

/// What a result transfer reads and sends at a time: with ureq's 128 KiB default a
/// multi-GB upload spent most of its CPU in the kernel, one small send after another; 1 MiB
/// took the same file from ~1,800 to ~2,500 MiB/s on loopback. REST calls keep the default.
pub const TRANSFER_BUFFER: usize = 1 << 20;

/// The agent of an upload worker: big sends, and its connections kept per host, so the files of
/// a workload (and the next workload's) reuse one connection instead of a handshake each. Each
/// transfer sets its own time limit ([`transfer_timeout`]).
pub fn transfer_agent() -> ureq::Agent {
    agent_with(Duration::from_secs(1800), Some(TRANSFER_BUFFER))
}

fn agent_with(timeout: Duration, buffer: Option<usize>) -> ureq::Agent {
    let mut cfg = ureq::Agent::config_builder();
    if let Some(b) = buffer {
        cfg = cfg.output_buffer_size(b);
    }
    cfg.timeout_global(Some(timeout))
        .timeout_connect(Some(timeout.min(Duration::from_secs(5))))
        .http_status_as_error(false)
        .max_redirects(0)
        // ureq defaults to rustls even when only native-tls is compiled in.
        .tls_config(
            TlsConfig::builder()
                .provider(TlsProvider::NativeTls)
                .root_certs(roots())
                .build(),
        )
        .build()
        .into()
}

/// `GET {base}/api/v1/cloud-node/instances` with `Authorization: Token …`.
pub fn check_token(b: &Backend, timeout: Duration) -> TokenCheck {
    let url = format!("{}/api/v1/cloud-node/instances", b.base_url);
    match b.get("/api/v1/cloud-node/instances", timeout).call() {
        Ok(mut resp) => match resp.status().as_u16() {
            s if s < 300 => TokenCheck::Accepted,
            s @ (401 | 403) => TokenCheck::Rejected(s),
            s => TokenCheck::Inconclusive(format!("{url}: {}", http_error(s, &mut resp))),
        },
        Err(e) => TokenCheck::Inconclusive(format!("{url}: {e}")),
    }
}

/// The text of a failed REST answer. `400 workspace_required` (the token reaches several
/// workspaces and the request named none) gets the fix spelled out.
fn http_error(status: u16, resp: &mut ureq::http::Response<ureq::Body>) -> String {
    let body = resp
        .body_mut()
        .with_config()
        .limit(64 * 1024)
        .read_to_string()
        .unwrap_or_default();
    workspace_required(status, &body).unwrap_or_else(|| format!("HTTP {status}"))
}

/// `Some(explanation)` when a REST answer is the platform's `400 workspace_required`.
pub fn workspace_required(status: u16, body: &str) -> Option<String> {
    (status == 400 && body.contains("workspace_required")).then(|| {
        "HTTP 400 workspace_required: this API token reaches several workspaces and the \
         request named none; set CYBERWAVE_WORKSPACE_ID to the uuid of the workspace this \
         node works for"
            .to_string()
    })
}

/// Why a call to the backend or a result transfer failed, and whether another try may go
/// better ([`BackendError::retriable`]): the upload retry decision reads it, never the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendError {
    /// No answer: the connection, TLS or a time limit failed.
    Transport(String),
    /// An HTTP answer that is not a success; `detail` says it for the log.
    Status { status: u16, detail: String },
    /// The URL or the request cannot even be formed: it fails the same way every time.
    Unusable(String),
    /// An answer came but could not be read, or did not hold what was asked for.
    Answer(String),
    /// The result file cannot be opened as a regular file.
    File(String),
}

impl BackendError {
    /// Another try may succeed: no answer at all, an answer that could not be read, or a
    /// status that says "later" (408, 409, 425, 429, 500, 502, 503, 504).
    pub fn retriable(&self) -> bool {
        match self {
            BackendError::Transport(_) | BackendError::Answer(_) => true,
            BackendError::Status { status, .. } => {
                matches!(status, 408 | 409 | 425 | 429 | 500 | 502 | 503 | 504)
            }
            BackendError::Unusable(_) | BackendError::File(_) => false,
        }
    }

    /// A failed HTTP answer, its text read as [`http_error`] does.
    fn status(status: u16, resp: &mut ureq::http::Response<ureq::Body>) -> BackendError {
        BackendError::Status {
            status,
            detail: http_error(status, resp),
        }
    }
}

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BackendError::Transport(s)
            | BackendError::Unusable(s)
            | BackendError::Answer(s)
            | BackendError::File(s) => f.write_str(s),
            BackendError::Status { detail, .. } => f.write_str(detail),
        }
    }
}

impl std::error::Error for BackendError {}

/// Where and as whom the REST calls go (a copy lives on each worker thread).
#[derive(Debug, Clone)]
pub struct Backend {
    pub base_url: String,
    pub token: String,
    /// `workspace_slug` query parameter (the Python node's scoping).
    pub workspace: Option<String>,
    /// `workspace_uuid` query parameter (the SDK's scoping, from `CYBERWAVE_WORKSPACE_ID`):
    /// needed when the token reaches several workspaces.
    pub workspace_uuid: Option<String>,
}

/// What the backend says about a tracked workload (REST E7), for stale-workload self-healing.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkloadCheck {
    /// Still the backend's active workload on this instance: keep it.
    Active,
    /// Terminal status, unknown to the backend, or owned by another instance.
    Stale(String),
    /// Timeout, 5xx, network error: keep it (a transient problem never kills a workload).
    Inconclusive(String),
}

const STALE_STATUSES: [&str; 4] = ["completed", "failed", "cancelled", "canceled"];

impl Backend {
    /// The REST side as the settings describe it. The workspace uuid is `CYBERWAVE_WORKSPACE_ID`
    /// (process environment or an env file), as the SDK reads it, else the `workspace_uuid`
    /// that `cyberwave login` stored beside the token, when that token is the one in use.
    pub fn of(s: &crate::config::Settings, token: &str) -> Backend {
        let from_login = || {
            let c = crate::config::credentials::Credentials::load(
                &s.config_dir.value.join("credentials.json"),
            );
            c.workspace_uuid
                .filter(|_| c.token.as_deref() == Some(token))
        };
        Backend {
            base_url: s.base_url.value.clone(),
            token: token.to_string(),
            workspace: s.workspace_slug.as_ref().map(|w| w.value.clone()),
            workspace_uuid: s
                .env
                .value("CYBERWAVE_WORKSPACE_ID")
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
                .or_else(from_login),
        }
    }

    /// Authorization, Accept and the workspace query parameters of every API call.
    fn scoped<B>(&self, req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        let mut req = req
            .header("Authorization", &format!("Token {}", self.token))
            .header("Accept", "application/json");
        if let Some(ws) = &self.workspace {
            req = req.query("workspace_slug", ws);
        }
        if let Some(ws) = &self.workspace_uuid {
            req = req.query("workspace_uuid", ws);
        }
        req
    }

    fn get(
        &self,
        path: &str,
        timeout: Duration,
    ) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
        self.scoped(agent(timeout).get(&format!("{}{path}", self.base_url)))
    }

    fn post(
        &self,
        path: &str,
        timeout: Duration,
    ) -> ureq::RequestBuilder<ureq::typestate::WithBody> {
        self.scoped(agent(timeout).post(&format!("{}{path}", self.base_url)))
    }

    /// E7: `GET /api/v1/cloud-node-workloads/{wl}`.
    pub fn check_workload(&self, wl: &str, my_uuid: &str, timeout: Duration) -> WorkloadCheck {
        match self
            .get(
                &format!("/api/v1/cloud-node-workloads/{}", path_segment(wl)),
                timeout,
            )
            .call()
        {
            Ok(mut resp) => match resp.status().as_u16() {
                404 => WorkloadCheck::Stale("unknown to the backend (404)".into()),
                200 => {
                    let body: serde_json::Value = resp.body_mut().read_json().unwrap_or_default();
                    let field = |k: &str| body.get(k).and_then(serde_json::Value::as_str);
                    let status = field("status").unwrap_or("").to_lowercase();
                    let owner = field("instance_uuid").unwrap_or("");
                    if STALE_STATUSES.contains(&status.as_str()) {
                        WorkloadCheck::Stale(format!("the backend says it is {status}"))
                    } else if !owner.is_empty() && !my_uuid.is_empty() && owner != my_uuid {
                        WorkloadCheck::Stale(format!("the backend assigned it to instance {owner}"))
                    } else {
                        WorkloadCheck::Active
                    }
                }
                s => WorkloadCheck::Inconclusive(http_error(s, &mut resp)),
            },
            Err(e) => WorkloadCheck::Inconclusive(e.to_string()),
        }
    }

    /// E8: a signed upload URL, its attachment uuid and how to upload to it.
    pub fn signed_url(&self, wl: &str, filename: &str) -> Result<Attachment, BackendError> {
        let resp = self
            .post(
                &format!(
                    "/api/v1/cloud-node-workloads/{}/attachments",
                    path_segment(wl)
                ),
                Duration::from_secs(30),
            )
            .send_json(serde_json::json!({"filename": filename}));
        match resp {
            Ok(mut r) if r.status().as_u16() == 200 => {
                let body: serde_json::Value = r
                    .body_mut()
                    .read_json()
                    .map_err(|e| BackendError::Answer(e.to_string()))?;
                parse_signed_url(&body)
            }
            Ok(mut r) => Err(BackendError::status(r.status().as_u16(), &mut r)),
            Err(e) => Err(BackendError::Transport(e.to_string())),
        }
    }

    /// E9: the upload-results notification.
    pub fn upload_results(&self, wl: &str, body: &serde_json::Value) -> Result<(), BackendError> {
        match self
            .post(
                &format!(
                    "/api/v1/cloud-node-workloads/{}/upload-results",
                    path_segment(wl)
                ),
                Duration::from_secs(30),
            )
            .send_json(body)
        {
            Ok(r) if r.status().as_u16() == 200 => Ok(()),
            Ok(mut r) => Err(BackendError::status(r.status().as_u16(), &mut r)),
            Err(e) => Err(BackendError::Transport(e.to_string())),
        }
    }
}

/// How the attachment reply says the bytes go up (`upload_method`, decision D40).
#[derive(Debug, Clone, PartialEq)]
pub enum UploadMethod {
    /// Absent, null or `signed_url`: PUT the bytes to the signed URL.
    SignedUrl,
    /// `multipart`: POST them as `multipart/form-data` to the URL, with the node's token.
    Multipart,
    /// Anything else, as the backend wrote it: the file fails.
    Other(String),
}

/// An R9/E8 answer: where the file goes, its attachment uuid, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct Attachment {
    pub url: String,
    /// The returned `filename` without its extension.
    pub uuid: String,
    pub method: UploadMethod,
}

/// Reads an R9/E8 answer. A missing URL is an error; an unknown `upload_method` is not (the
/// caller fails that one file, naming the method, rather than asking again).
pub fn parse_signed_url(body: &serde_json::Value) -> Result<Attachment, BackendError> {
    let url = body["signed_url"]
        .as_str()
        .filter(|u| !u.is_empty())
        .ok_or_else(|| {
            let msg = body["message"]
                .as_str()
                .unwrap_or("no signed_url in the answer");
            BackendError::Answer(format!("signed URL request failed: {msg}"))
        })?;
    let name = body["filename"].as_str().unwrap_or("");
    let base = name.rsplit('/').next().unwrap_or(name);
    let attachment = match base.rsplit_once('.') {
        Some((stem, _)) if !stem.is_empty() => stem,
        _ => base,
    };
    let method = match body.get("upload_method") {
        None | Some(serde_json::Value::Null) => UploadMethod::SignedUrl,
        Some(serde_json::Value::String(m)) if m == "signed_url" => UploadMethod::SignedUrl,
        Some(serde_json::Value::String(m)) if m == "multipart" => UploadMethod::Multipart,
        Some(serde_json::Value::String(m)) => UploadMethod::Other(m.clone()),
        Some(other) => UploadMethod::Other(other.to_string()),
    };
    Ok(Attachment {
        url: url.to_string(),
        uuid: attachment.to_string(),
        method,
    })
}

/// The timeout of one file transfer: `max(300, min(1800, MiB × 8 + 120))` seconds.
fn transfer_timeout(size: u64) -> Duration {
    #[allow(clippy::cast_precision_loss)] // a file size needs no more than f64's 52 bits here
    let mib = size as f64 / 1_048_576.0;
    Duration::from_secs_f64((mib * 8.0 + 120.0).clamp(300.0, 1800.0))
}

/// The verdict on a transfer's HTTP answer.
fn transfer_verdict(
    answer: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ok: &[u16],
) -> Result<(), BackendError> {
    match answer {
        Ok(r) => match r.status().as_u16() {
            s if ok.contains(&s) => Ok(()),
            status => Err(BackendError::Status {
                status,
                detail: format!("HTTP {status}"),
            }),
        },
        // A URL or request the library cannot even form fails the same way every time.
        Err(
            e @ (ureq::Error::BadUri(_)
            | ureq::Error::Http(_)
            | ureq::Error::RequireHttpsOnly(_)
            | ureq::Error::InvalidProxyUrl),
        ) => Err(BackendError::Unusable(e.to_string())),
        Err(e) => Err(BackendError::Transport(e.to_string())),
    }
}

/// A transfer URL must be an absolute http(s) URL with a host; anything else fails at once and
/// for good (it is not a transient problem to retry).
fn checked_url(url: &str) -> Result<(), BackendError> {
    // Not the URL itself: a signed URL's query is its credential.
    let bad = |why: &str| {
        Err(BackendError::Unusable(format!(
            "the upload URL the backend gave cannot be used: {}",
            crate::logtext::shown(why)
        )))
    };
    match url.parse::<ureq::http::Uri>() {
        Err(e) => bad(&e.to_string()),
        Ok(u) => match (u.scheme_str(), u.host()) {
            (Some("http" | "https"), Some(h)) if !h.is_empty() => Ok(()),
            (Some("http" | "https"), _) => bad("it names no host"),
            _ => bad("it is not an http(s) URL"),
        },
    }
}

/// Opens a workload's result file for upload: only a regular file, never through a link, and
/// never blocking (the workload may have swapped it for a FIFO after the folder was listed).
fn open_result(path: &crate::store::Beneath) -> Result<(std::fs::File, u64), BackendError> {
    path.open()
        .map_err(|e| BackendError::File(format!("cannot open {}: {e}", path.path().display())))
}

/// E12: streams a file to a signed URL, giving up after `limit` at the latest (what is left of
/// the workload's upload deadline, D68).
pub fn put_file(
    agent: &ureq::Agent,
    url: &str,
    path: &crate::store::Beneath,
    limit: Duration,
) -> Result<(), BackendError> {
    checked_url(url)?;
    let (file, size) = open_result(path)?;
    // A signed URL carries its own authorisation: no API headers here.
    let answer = agent
        .put(url)
        .config()
        .timeout_global(Some(transfer_timeout(size).min(limit)))
        .build()
        .header("Content-Type", "application/octet-stream")
        .send(file);
    transfer_verdict(answer, &[200, 204])
}

/// A workload id as one segment of a REST path (RFC 3986 §3.3): every byte but the unreserved
/// ones percent-encoded, and a segment of only dots (`.`, `..`) too, so that an id the backend
/// (or anyone who may publish commands) chose can neither leave the workload's path (`..`,
/// `?`, `%2F`) nor reach another endpoint with the node's token. A platform uuid is unchanged.
pub fn path_segment(id: &str) -> String {
    let dots = !id.is_empty() && id.bytes().all(|b| b == b'.');
    let mut out = String::with_capacity(id.len());
    for b in id.bytes() {
        if !dots && (b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The `filename` of a form-data part as browsers write it (WHATWG HTML, multipart/form-data
/// encoding): the final path component, with `"`, CR and LF percent-encoded so the header
/// cannot be broken out of. Other text, unicode included, goes as UTF-8.
pub fn form_filename(name: &str) -> String {
    let base = name.rsplit('/').next().unwrap_or(name);
    let mut out = String::with_capacity(base.len());
    for c in base.chars() {
        match c {
            '"' => out.push_str("%22"),
            '\r' => out.push_str("%0D"),
            '\n' => out.push_str("%0A"),
            c => out.push(c),
        }
    }
    out
}

/// Whether `url`'s query already names `name`.
fn has_query_param(url: &str, name: &str) -> bool {
    url.split_once('?')
        .map(|(_, q)| q.split('#').next().unwrap_or(q))
        .is_some_and(|q| q.split('&').any(|kv| kv.split('=').next() == Some(name)))
}

/// The bytes around the file in a one-part `multipart/form-data` body: (head, tail).
pub fn multipart_frame(boundary: &str, filename: &str) -> (Vec<u8>, Vec<u8>) {
    let head = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{}\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n",
        form_filename(filename)
    );
    let tail = format!("\r\n--{boundary}--\r\n");
    (head.into_bytes(), tail.into_bytes())
}

impl Backend {
    /// D40 `multipart`: POSTs the file as the one part `file` of a `multipart/form-data` body
    /// to `url` (the platform's `…/attachments/{attachment_uuid}/upload`), with the node's
    /// Authorization header. The file is streamed, never read whole into memory.
    pub fn post_multipart(
        &self,
        agent: &ureq::Agent,
        url: &str,
        path: &crate::store::Beneath,
        filename: &str,
        limit: Duration,
    ) -> Result<(), BackendError> {
        let (file, size) = open_result(path)?;
        // A random boundary: a file that happens to contain it would end the part early.
        let boundary = format!(
            "cyberwave-node-{}",
            crate::util::hex(&crate::util::random_bytes::<16>())
        );
        let (head, tail) = multipart_frame(&boundary, filename);
        let len = u64::try_from(head.len().saturating_add(tail.len()))
            .unwrap_or(u64::MAX)
            .saturating_add(size);
        // A relative URL is taken to be on the API host.
        let url = if url.starts_with('/') {
            format!("{}{url}", self.base_url)
        } else {
            url.to_string()
        };
        checked_url(&url)?;
        let body = std::io::Read::chain(
            std::io::Read::chain(std::io::Cursor::new(head), file),
            std::io::Cursor::new(tail),
        );
        let mut req = agent
            .post(&url)
            .config()
            .timeout_global(Some(transfer_timeout(size).min(limit)))
            .build();
        // The SDK scopes every API call, this one included; a workspace_uuid already on the URL
        // is the backend's own choice and wins.
        if let Some(ws) = &self.workspace_uuid {
            if !has_query_param(&url, "workspace_uuid") {
                req = req.query("workspace_uuid", ws);
            }
        }
        // The API token goes only to the API's own origin (D40 names the platform's endpoint):
        // a reply that names another host gets the file without the node's credentials.
        if same_origin(&url, &self.base_url) {
            req = req.header("Authorization", &format!("Token {}", self.token));
        } else {
            log::warn!(
                "multipart upload URL {} is not on the API host {}: sent without the node's token",
                crate::logtext::shown(&origin_of(&url).unwrap_or_default()),
                crate::logtext::shown(&origin_of(&self.base_url).unwrap_or_default())
            );
        }
        let answer = req
            .header("Accept", "application/json")
            .header(
                "Content-Type",
                &format!("multipart/form-data; boundary={boundary}"),
            )
            .header("Content-Length", &len.to_string())
            .send(ureq::SendBody::from_owned_reader(body));
        transfer_verdict(answer, &[200, 201, 204])
    }
}

/// `scheme://host:port` of a URL (the default port made explicit), lower-cased; None when
/// it is not an absolute http(s) URL.
fn origin_of(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    let scheme = scheme.to_ascii_lowercase();
    let default = match scheme.as_str() {
        "http" => "80",
        "https" => "443",
        _ => return None,
    };
    let authority = rest.split(['/', '?', '#']).next()?;
    // Credentials in the URL are not part of the origin.
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (host, port) = match host_port.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && !p.contains(']') => (h, p),
        _ => (host_port, default),
    };
    if host.is_empty() {
        return None;
    }
    Some(format!("{scheme}://{}:{port}", host.to_ascii_lowercase()))
}

fn same_origin(a: &str, b: &str) -> bool {
    matches!((origin_of(a), origin_of(b)), (Some(x), Some(y)) if x == y)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// D20 ids may hold `.`, `?`, `%`, `\` and quotes: in a REST path each stays one segment of
    /// the workload's own path, whatever it is (a platform uuid is unchanged).
    #[test]
    fn d20_a_workload_id_stays_one_segment_of_its_rest_path() {
        let uuid = "3f2b8c1e-9a4d-4e6f-b1c2-7d8e9f0a1b2c";
        assert_eq!(path_segment(uuid), uuid);
        for (id, want) in [
            ("..", "%2E%2E"),
            (".", "%2E"),
            ("a..b", "a..b"),
            ("x?y=1", "x%3Fy%3D1"),
            ("a%2Fb", "a%252Fb"),
            ("a\\b", "a%5Cb"),
            ("\"q\"", "%22q%22"),
            ("w;x&y", "w%3Bx%26y"),
        ] {
            assert_eq!(path_segment(id), want, "{id:?}");
        }
        for id in ["..", "x?y", "a%2Fb", "%2E%2E", "...", "a@b:c"] {
            let path = format!(
                "/api/v1/cloud-node-workloads/{}/attachments",
                path_segment(id)
            );
            let uri: ureq::http::Uri = path.parse().unwrap();
            let segs: Vec<&str> = uri.path().split('/').collect();
            assert_eq!(segs.len(), 6, "{id:?} -> {path}");
            assert_eq!(segs[5], "attachments", "{id:?}");
            assert!(uri.query().is_none(), "{id:?}");
            assert!(!segs[4].chars().all(|c| c == '.'), "{id:?}: a dot segment");
        }
    }

    #[test]
    fn g13_an_upload_url_that_cannot_be_parsed_fails_at_once_and_for_good() {
        let file = std::env::temp_dir().join(format!("cw-url-{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        for url in [
            "ht tp://example.com/x",
            "http://[::1/x",
            "http:///nohost",
            "ftp://example.com/x",
            "/relative/only",
            "",
            "http://exa mple.com/x",
        ] {
            match put_file(
                &transfer_agent(),
                url,
                &crate::store::Beneath::new(file.parent().unwrap(), file.file_name().unwrap()),
                Duration::from_secs(5),
            ) {
                Err(e @ BackendError::Unusable(_)) => {
                    assert!(
                        !e.retriable() && e.to_string().contains("upload URL"),
                        "{url}: {e}"
                    )
                }
                other => panic!("{url:?}: {other:?}"),
            }
        }
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn a_result_file_swapped_for_a_fifo_or_a_link_is_refused_without_blocking() {
        use std::os::unix::ffi::OsStrExt;
        let dir = std::env::temp_dir().join(format!("cw-backend-fifo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("result.bin");
        let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let link = dir.join("link.bin");
        std::os::unix::fs::symlink("/etc/passwd", &link).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (f, l) = (
            crate::store::Beneath::new(&dir, "result.bin"),
            crate::store::Beneath::new(&dir, "link.bin"),
        );
        std::thread::spawn(move || {
            // Nothing listens there: only the open is tried.
            let _ = tx.send((
                put_file(
                    &transfer_agent(),
                    "http://127.0.0.1:9/x",
                    &f,
                    Duration::from_secs(5),
                ),
                put_file(
                    &transfer_agent(),
                    "http://127.0.0.1:9/x",
                    &l,
                    Duration::from_secs(5),
                ),
            ));
        });
        let (a, b) = rx
            .recv_timeout(std::time::Duration::from_secs(3))
            .expect("the upload blocks on a FIFO");
        for r in [a, b] {
            let e = r.unwrap_err();
            assert!(
                !e.retriable() && e.to_string().contains("not a regular file"),
                "{e}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_token_goes_only_to_the_api_origin() {
        let api = "https://api.cyberwave.com";
        assert!(same_origin(
            "https://api.cyberwave.com/api/v1/x/upload",
            api
        ));
        assert!(same_origin("https://API.cyberwave.com:443/x", api));
        assert!(!same_origin("https://api.cyberwave.com.evil.io/x", api));
        assert!(!same_origin(
            "https://evil.io/?https://api.cyberwave.com",
            api
        ));
        assert!(!same_origin("https://api.cyberwave.com@evil.io/x", api));
        assert!(!same_origin("http://api.cyberwave.com/x", api));
        assert!(!same_origin("https://api.cyberwave.com:8443/x", api));
        assert!(same_origin("http://127.0.0.1:9/x", "http://127.0.0.1:9"));
        assert!(!same_origin("http://127.0.0.1:10/x", "http://127.0.0.1:9"));
        assert!(!same_origin("ftp://api.cyberwave.com/x", api));
        assert!(!same_origin("", api));
    }

    #[test]
    fn only_a_missing_answer_or_a_later_status_is_worth_another_try() {
        let status = |status| BackendError::Status {
            status,
            detail: format!("HTTP {status}"),
        };
        for s in [408, 409, 425, 429, 500, 502, 503, 504] {
            assert!(status(s).retriable(), "{s}");
        }
        for s in [400, 401, 403, 404, 413, 501] {
            assert!(!status(s).retriable(), "{s}");
        }
        assert!(BackendError::Transport("reset".into()).retriable());
        assert!(!BackendError::Unusable("bad uri".into()).retriable());
        assert!(!BackendError::File("a fifo".into()).retriable());
        assert_eq!(status(503).to_string(), "HTTP 503");
    }

    #[test]
    fn attachment_uuid_is_the_filename_without_extension() {
        let b = serde_json::json!({"signed_url": "http://x/u", "filename": "abc-123.tar.gz"});
        let a = parse_signed_url(&b).unwrap();
        assert_eq!(
            (a.url.as_str(), a.uuid.as_str()),
            ("http://x/u", "abc-123.tar")
        );
        assert_eq!(a.method, UploadMethod::SignedUrl);
        let b = serde_json::json!({"success": false, "message": "nope"});
        assert!(parse_signed_url(&b)
            .unwrap_err()
            .to_string()
            .contains("nope"));
    }

    #[test]
    fn upload_method_decides_the_route() {
        let m = |v: serde_json::Value| {
            let mut b = serde_json::json!({"signed_url": "http://x/u", "filename": "a.txt"});
            b["upload_method"] = v;
            parse_signed_url(&b).unwrap().method
        };
        assert_eq!(m(serde_json::Value::Null), UploadMethod::SignedUrl);
        assert_eq!(m("signed_url".into()), UploadMethod::SignedUrl);
        assert_eq!(m("multipart".into()), UploadMethod::Multipart);
        assert_eq!(
            m("Multipart".into()),
            UploadMethod::Other("Multipart".into())
        );
        assert_eq!(m("".into()), UploadMethod::Other(String::new()));
        assert_eq!(
            m(serde_json::json!(["multipart"])),
            UploadMethod::Other("[\"multipart\"]".into())
        );
        let b = serde_json::json!({"signed_url": "http://x/u", "filename": ".hidden"});
        assert_eq!(parse_signed_url(&b).unwrap().uuid, ".hidden");
        let b =
            serde_json::json!({"signed_url": "http://x/u", "filename": "d/\u{e9}t\u{e9}.\u{e9}"});
        assert_eq!(parse_signed_url(&b).unwrap().uuid, "\u{e9}t\u{e9}");
    }

    #[test]
    fn form_file_names_cannot_break_the_part_header() {
        assert_eq!(form_filename("sub/dir/a b.txt"), "a b.txt");
        assert_eq!(
            form_filename("q\"\r\nX-Evil: 1.txt"),
            "q%22%0D%0AX-Evil: 1.txt"
        );
        assert_eq!(form_filename("\u{1f600}.bin"), "\u{1f600}.bin");
        let (head, tail) = multipart_frame("BND", "x/y.bin");
        assert_eq!(
            String::from_utf8(head).unwrap(),
            "--BND\r\nContent-Disposition: form-data; name=\"file\"; filename=\"y.bin\"\r\nContent-Type: application/octet-stream\r\n\r\n"
        );
        assert_eq!(tail, b"\r\n--BND--\r\n");
    }

    #[test]
    fn an_existing_query_parameter_is_found() {
        assert!(has_query_param(
            "http://h/p?a=1&workspace_uuid=x",
            "workspace_uuid"
        ));
        assert!(!has_query_param(
            "http://h/p?my_workspace_uuid=x",
            "workspace_uuid"
        ));
        assert!(!has_query_param(
            "http://h/p#workspace_uuid=x",
            "workspace_uuid"
        ));
        assert!(!has_query_param("http://h/p", "workspace_uuid"));
    }

    #[test]
    fn workspace_required_is_explained() {
        let why = workspace_required(400, r#"{"code":"workspace_required"}"#).unwrap();
        assert!(why.contains("CYBERWAVE_WORKSPACE_ID"), "{why}");
        assert_eq!(workspace_required(400, "bad request"), None);
        assert_eq!(workspace_required(403, "workspace_required"), None);
    }
}
