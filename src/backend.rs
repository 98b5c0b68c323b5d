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
                crate::mqtt::trust_store(None, std::env::var("SSL_CERT_FILE").ok().as_deref());
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
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
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
pub fn check_token(
    base_url: &str,
    token: &str,
    workspace: Option<&str>,
    timeout: Duration,
) -> TokenCheck {
    let url = format!("{base_url}/api/v1/cloud-node/instances");
    let mut req = agent(timeout)
        .get(&url)
        .header("Authorization", &format!("Token {token}"))
        .header("Accept", "application/json");
    if let Some(ws) = workspace {
        req = req.query("workspace_slug", ws);
    }
    match req.call() {
        Ok(resp) => match resp.status().as_u16() {
            s if s < 300 => TokenCheck::Accepted,
            s @ (401 | 403) => TokenCheck::Rejected(s),
            s => TokenCheck::Inconclusive(format!("{url} answered HTTP {s}")),
        },
        Err(e) => TokenCheck::Inconclusive(format!("{url}: {e}")),
    }
}

/// Where and as whom the REST calls go (a copy lives on each worker thread).
#[derive(Debug, Clone)]
pub struct Backend {
    pub base_url: String,
    pub token: String,
    pub workspace: Option<String>,
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
    fn get(
        &self,
        path: &str,
        timeout: Duration,
    ) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
        let mut req = agent(timeout)
            .get(&format!("{}{path}", self.base_url))
            .header("Authorization", &format!("Token {}", self.token))
            .header("Accept", "application/json");
        if let Some(ws) = &self.workspace {
            req = req.query("workspace_slug", ws);
        }
        req
    }

    fn post(
        &self,
        path: &str,
        timeout: Duration,
    ) -> ureq::RequestBuilder<ureq::typestate::WithBody> {
        let mut req = agent(timeout)
            .post(&format!("{}{path}", self.base_url))
            .header("Authorization", &format!("Token {}", self.token))
            .header("Accept", "application/json");
        if let Some(ws) = &self.workspace {
            req = req.query("workspace_slug", ws);
        }
        req
    }

    /// E7: `GET /api/v1/cloud-node-workloads/{wl}`.
    pub fn check_workload(&self, wl: &str, my_uuid: &str, timeout: Duration) -> WorkloadCheck {
        match self
            .get(&format!("/api/v1/cloud-node-workloads/{wl}"), timeout)
            .call()
        {
            Ok(mut resp) => match resp.status().as_u16() {
                404 => WorkloadCheck::Stale("unknown to the backend (404)".into()),
                200 => {
                    let body: serde_json::Value = resp.body_mut().read_json().unwrap_or_default();
                    let status = body
                        .get("status")
                        .and_then(|v| v.as_str())
                        .unwrap_or("")
                        .to_lowercase();
                    let owner = body
                        .get("instance_uuid")
                        .and_then(|v| v.as_str())
                        .unwrap_or("");
                    if STALE_STATUSES.contains(&status.as_str()) {
                        WorkloadCheck::Stale(format!("the backend says it is {status}"))
                    } else if !owner.is_empty() && !my_uuid.is_empty() && owner != my_uuid {
                        WorkloadCheck::Stale(format!("the backend assigned it to instance {owner}"))
                    } else {
                        WorkloadCheck::Active
                    }
                }
                s => WorkloadCheck::Inconclusive(format!("HTTP {s}")),
            },
            Err(e) => WorkloadCheck::Inconclusive(e.to_string()),
        }
    }

    /// E8: a signed upload URL → (url, attachment uuid).
    pub fn signed_url(&self, wl: &str, filename: &str) -> Result<(String, String), String> {
        let resp = self
            .post(
                &format!("/api/v1/cloud-node-workloads/{wl}/attachments"),
                Duration::from_secs(30),
            )
            .send_json(serde_json::json!({"filename": filename}));
        match resp {
            Ok(mut r) if r.status().as_u16() == 200 => {
                let body: serde_json::Value =
                    r.body_mut().read_json().map_err(|e| e.to_string())?;
                parse_signed_url(&body)
            }
            Ok(r) => Err(format!("HTTP {}", r.status().as_u16())),
            Err(e) => Err(e.to_string()),
        }
    }

    /// E9: the upload-results notification.
    pub fn upload_results(&self, wl: &str, body: &serde_json::Value) -> Result<(), String> {
        match self
            .post(
                &format!("/api/v1/cloud-node-workloads/{wl}/upload-results"),
                Duration::from_secs(30),
            )
            .send_json(body)
        {
            Ok(r) if r.status().as_u16() == 200 => Ok(()),
            Ok(r) => Err(format!("HTTP {}", r.status().as_u16())),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// (signed url, attachment uuid) from an R9/E8 answer: the attachment uuid is the returned
/// `filename` without its extension.
pub fn parse_signed_url(body: &serde_json::Value) -> Result<(String, String), String> {
    let url = body["signed_url"]
        .as_str()
        .filter(|u| !u.is_empty())
        .ok_or_else(|| {
            let msg = body["message"]
                .as_str()
                .unwrap_or("no signed_url in the answer");
            format!("signed URL request failed: {msg}")
        })?;
    let name = body["filename"].as_str().unwrap_or("");
    let base = name.rsplit('/').next().unwrap_or(name);
    let attachment = match base.rfind('.') {
        Some(i) if i > 0 => &base[..i],
        _ => base,
    };
    Ok((url.to_string(), attachment.to_string()))
}

/// E12: streams a file to a signed URL. `Err((retriable, why))`.
pub fn put_file(url: &str, path: &std::path::Path) -> Result<(), (bool, String)> {
    let file = std::fs::File::open(path)
        .map_err(|e| (false, format!("cannot open {}: {e}", path.display())))?;
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mib = size as f64 / 1_048_576.0;
    let timeout = Duration::from_secs_f64((mib * 8.0 + 120.0).clamp(300.0, 1800.0));
    // A signed URL carries its own authorisation: no API headers here.
    match agent(timeout)
        .put(url)
        .header("Content-Type", "application/octet-stream")
        .send(file)
    {
        Ok(r) => match r.status().as_u16() {
            200 | 204 => Ok(()),
            s @ (408 | 409 | 425 | 429 | 500 | 502 | 503 | 504) => Err((true, format!("HTTP {s}"))),
            s => Err((false, format!("HTTP {s}"))),
        },
        Err(e) => Err((true, e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attachment_uuid_is_the_filename_without_extension() {
        let b = serde_json::json!({"signed_url": "http://x/u", "filename": "abc-123.tar.gz"});
        assert_eq!(
            parse_signed_url(&b).unwrap(),
            ("http://x/u".into(), "abc-123.tar".into())
        );
        let b = serde_json::json!({"success": false, "message": "nope"});
        assert!(parse_signed_url(&b).unwrap_err().contains("nope"));
    }
}
