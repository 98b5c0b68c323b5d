//! The REST side of the backend (ureq, blocking; only ever called from start-up or worker
//! threads, never from the event loop).

use std::time::Duration;

use ureq::tls::{TlsConfig, TlsProvider};

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
