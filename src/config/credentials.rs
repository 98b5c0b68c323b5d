//! `credentials.json` (written by `cyberwave login`, only read here) and the node's own
//! `instance_identity.json` (decision D4).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::store;

/// What the node reads from `<config dir>/credentials.json`. A missing or non-JSON file counts
/// as "no credentials"; a blank token as no token.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    pub path: PathBuf,
    pub token: Option<String>,
    pub workspace_slug: Option<String>,
    /// The workspace the login's token was created for (`cyberwave login` writes it).
    pub workspace_uuid: Option<String>,
    json: Value,
}

impl Credentials {
    pub fn load(path: &Path) -> Credentials {
        // Only a regular file is read (D48): a FIFO in its place is no login, never a hang.
        let json: Value = store::read_state_file(path, store::MAX_ENTRY_BYTES)
            .ok()
            .and_then(|t| serde_json::from_slice(&t).ok())
            .unwrap_or(Value::Null);
        let s = |v: &Value| {
            v.as_str()
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
        };
        Credentials {
            path: path.to_path_buf(),
            token: json.get("token").and_then(s),
            workspace_slug: json.get("workspace_slug").and_then(s),
            workspace_uuid: json.get("workspace_uuid").and_then(s),
            json,
        }
    }

    /// One of the runtime values (`CYBERWAVE_ENVIRONMENT`, `CYBERWAVE_BASE_URL`,
    /// `CYBERWAVE_MQTT_HOST`, `CYBERWAVE_MQTT_PORT`): `envs.KEY` when non-blank, else the flat
    /// top-level key. Numbers are accepted for the port.
    pub fn env_value(&self, key: &str) -> Option<String> {
        let s = |v: &Value| match v {
            Value::String(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        };
        self.json
            .get("envs")
            .and_then(|e| e.get(key))
            .and_then(s)
            .or_else(|| self.json.get(key).and_then(s))
    }
}

/// Prefix of every Cyberwave API token (the SDK's `is_api_token` test).
pub const API_TOKEN_PREFIX: &str = "cw_";

/// The SDK's MQTT username rule (`resolve_mqtt_credentials`, `mqtt_identity.py`), exactly:
/// the password that authenticates is the explicit broker password, else the API key; when the
/// configured username is the placeholder `mqttcyb`, that password exists, and the explicit
/// password is not a legacy broker password (non-empty and not `cw_…`), the username becomes
/// `cwh_` + hex SHA-256 of the authenticating password. `Some` only when the rule replaces the
/// username. Empty strings count as absent, as in Python.
pub fn derived_mqtt_username(
    username: &str,
    password: Option<&str>,
    api_key: Option<&str>,
) -> Option<String> {
    let password = password.filter(|p| !p.is_empty());
    let auth = password.or(api_key.filter(|k| !k.is_empty()))?;
    let legacy = password.is_some_and(|p| !p.starts_with(API_TOKEN_PREFIX));
    (username == super::MQTT_USERNAME_PLACEHOLDER && !legacy).then(|| super::token_username(auth))
}

/// The instance identity the backend assigned, stored after every successful registration.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Identity {
    #[serde(default)]
    pub uuid: String,
    #[serde(default)]
    pub slug: String,
    #[serde(default)]
    pub workspace_slug: Option<String>,
    #[serde(default)]
    pub registered_at: Option<String>,
    /// Set when the node gave itself this identity (`--standalone`), never by a backend.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub standalone: bool,
}

impl store::Validate for Identity {
    fn validate(&self) -> Result<(), store::Invalid> {
        // The uuid and slug reach MQTT topics and paths.
        if !self.uuid.is_empty() {
            store::check_id("uuid", &self.uuid)?;
        }
        if !self.slug.is_empty() {
            store::check_id("slug", &self.slug)?;
        }
        if let Some(w) = &self.workspace_slug {
            store::check_text("workspace_slug", w, 256)?;
        }
        if let Some(r) = &self.registered_at {
            store::check_text("registered_at", r, 64)?;
        }
        Ok(())
    }
}

/// The identity file exists and cannot be read (permissions, I/O).
#[derive(Debug)]
pub struct IdentityError(pub PathBuf, pub store::StoreError);

impl std::fmt::Display for IdentityError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", store::shown(&self.0), self.1)
    }
}

impl std::error::Error for IdentityError {}

impl Identity {
    /// Reads the identity file. Absent → `Ok(None)`; one that does not validate (torn,
    /// binary, wrong-typed, over 64 KiB, a uuid that is not topic-safe) is quarantined with
    /// one ERROR line and counts as absent: the node registers afresh rather than dying.
    /// Unreadable → `Err` with a message (the caller warns and carries on).
    pub fn load(path: &Path) -> Result<Option<Identity>, IdentityError> {
        match store::read_record::<Identity>(path, store::MAX_RECORD_BYTES) {
            Ok(i) => Ok(Some(i).filter(|i| !i.uuid.trim().is_empty())),
            Err(store::StoreError::Missing) => Ok(None),
            Err(e) if e.is_bad_content() => {
                let _ = store::quarantine(
                    path,
                    &format!(
                        "not a valid instance identity ({e}); the node registers a new instance"
                    ),
                );
                Ok(None)
            }
            Err(e) => Err(IdentityError(path.to_path_buf(), e)),
        }
    }

    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let text = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        crate::store::write_atomic(path, &text, 0o600)
    }
}

/// Longest MQTT client id the node keeps (MQTT 3.1.1's portable limit).
const MAX_NODE_ID: usize = 23;

/// The MQTT client id kept in `<state dir>/node_id` (decision D15): `cloud_node_` and letters
/// or digits, at most 23 characters. `None` when absent or unreadable; a file that holds
/// anything else (or is over 64 KiB) is quarantined with one ERROR line, and the caller makes
/// a new id.
pub fn load_node_id(path: &Path) -> Option<String> {
    let why = match store::read_state_file(path, store::MAX_RECORD_BYTES) {
        Ok(bytes) => match std::str::from_utf8(&bytes).map(str::trim) {
            Ok(id)
                if id.starts_with("cloud_node_")
                    && id.len() <= MAX_NODE_ID
                    && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
            {
                return Some(id.to_string());
            }
            _ => format!(
                "not a valid MQTT client id (cloud_node_ and at most {MAX_NODE_ID} letters, digits or _); a new one is made"
            ),
        },
        Err(store::StoreError::Missing) => return None,
        Err(e) if e.is_bad_content() => format!("not a valid MQTT client id ({e}); a new one is made"),
        Err(e) => {
            log::error!("{} {e}; a new client id is made", store::shown(path));
            return None;
        }
    };
    let _ = store::quarantine(path, &why);
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_read_envs_then_flat_keys() {
        let dir = std::env::temp_dir().join(format!("cw-cred-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("credentials.json");
        std::fs::write(
            &p,
            r#"{"token":" cw_tok ","workspace_slug":"ws","workspace_uuid":"ws-u","envs":{"CYBERWAVE_MQTT_HOST":"h","CYBERWAVE_MQTT_PORT":" "},"CYBERWAVE_MQTT_PORT":1884}"#,
        )
        .unwrap();
        let c = Credentials::load(&p);
        assert_eq!(c.token.as_deref(), Some("cw_tok"));
        assert_eq!(c.workspace_slug.as_deref(), Some("ws"));
        assert_eq!(c.workspace_uuid.as_deref(), Some("ws-u"));
        assert_eq!(c.env_value("CYBERWAVE_MQTT_HOST").as_deref(), Some("h"));
        assert_eq!(c.env_value("CYBERWAVE_MQTT_PORT").as_deref(), Some("1884"));
        std::fs::write(&p, "not json").unwrap();
        assert!(Credentials::load(&p).token.is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Expected values computed with the SDK itself (cyberwave 0.7.4,
    /// `cyberwave.config.resolve_mqtt_credentials(username, password, api_key)[0]`).
    #[test]
    fn mqtt_username_matches_the_sdk() {
        let cases: [(&str, Option<&str>, Option<&str>, &str); 14] = [
            (
                "mqttcyb",
                None,
                Some("cw_tokentokentoken"),
                "cwh_5f0210fac11469ef6520bff249761f7581bf5e63aab3017d43f95617d3a47b98",
            ),
            (
                "mqttcyb",
                Some("legacy"),
                Some("cw_tokentokentoken"),
                "mqttcyb",
            ),
            (
                "mqttcyb",
                Some("cw_workload"),
                Some("cw_node"),
                "cwh_6268bdb03b8102bc293155fb27f03748f500bf37ff79691dd74f95d9fdddf948",
            ),
            (
                "mqttcyb",
                None,
                Some("not_a_cw_key"),
                "cwh_f6190af963a9603f39a5e6aac942d31879b3386815cba87e98839bf6a753c96b",
            ),
            ("mqttcyb", Some("legacy"), Some("not_a_cw_key"), "mqttcyb"),
            (
                "mqttcyb",
                Some("cw_workload"),
                None,
                "cwh_6268bdb03b8102bc293155fb27f03748f500bf37ff79691dd74f95d9fdddf948",
            ),
            ("mqttcyb", Some("legacy"), None, "mqttcyb"),
            ("mqttcyb", None, None, "mqttcyb"),
            (
                "mqttcyb",
                Some(""),
                Some("cw_tokentokentoken"),
                "cwh_5f0210fac11469ef6520bff249761f7581bf5e63aab3017d43f95617d3a47b98",
            ),
            ("me", None, Some("cw_tokentokentoken"), "me"),
            ("MQTTCYB", None, Some("cw_tokentokentoken"), "MQTTCYB"),
            ("mqttcyb", Some("CW_upper"), Some("cw_node"), "mqttcyb"),
            (
                "mqttcyb",
                Some("cw_"),
                None,
                "cwh_bfbeacbf306c2f6d000475128c21a563bd5ac2a0252cf6e6bde619bb67f7d6a2",
            ),
            (
                "mqttcyb",
                None,
                Some("cw_t\u{e9}st\u{2603}"),
                "cwh_7e8c23e5bd8240f5d87f2745fc332e359d63b8d93552893c090ef13c041d8633",
            ),
        ];
        for (user, password, key, want) in cases {
            let got =
                derived_mqtt_username(user, password, key).unwrap_or_else(|| user.to_string());
            assert_eq!(got, want, "{user:?} {password:?} {key:?}");
        }
    }

    #[test]
    fn identity_round_trips_with_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("cw-ident-{}", std::process::id()));
        let p = dir.join("instance_identity.json");
        assert_eq!(Identity::load(&p).unwrap(), None);
        let id = Identity {
            uuid: "u-1".into(),
            slug: "s".into(),
            ..Default::default()
        };
        id.save(&p).unwrap();
        assert_eq!(Identity::load(&p).unwrap(), Some(id));
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        std::fs::write(&p, "{").unwrap();
        assert_eq!(Identity::load(&p).unwrap(), None, "quarantined");
        assert!(!p.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hostile_identity_files_are_quarantined() {
        let dir = std::env::temp_dir().join(format!("cw-ident-h-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("instance_identity.json");
        let cases: Vec<Vec<u8>> = vec![
            b"".to_vec(),
            br#"{"uuid":"u-1","sl"#.to_vec(),
            vec![0, 0xff, 0xfe, 0x1b],
            br#"{"uuid":42}"#.to_vec(),
            br#"{"uuid":"a/#"}"#.to_vec(),
            br#"{"uuid":"u","slug":"s l"}"#.to_vec(),
            br#"{"uuid":"u","registered_at":"x
y"}"#
                .to_vec(),
            format!(r#"{{"uuid":"u","slug":"{}"}}"#, "x".repeat(70_000)).into_bytes(),
        ];
        for (n, bytes) in cases.iter().enumerate() {
            std::fs::write(&p, bytes).unwrap();
            assert_eq!(Identity::load(&p).unwrap(), None, "case {n}");
            assert!(!p.exists(), "case {n} moved aside");
        }
        assert_eq!(
            std::fs::read_dir(dir.join("quarantine")).unwrap().count(),
            cases.len()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hostile_node_ids_are_quarantined_and_good_ones_kept() {
        let dir = std::env::temp_dir().join(format!("cw-nodeid-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("node_id");
        assert_eq!(load_node_id(&p), None);
        std::fs::write(&p, "cloud_node_ab12\n").unwrap();
        assert_eq!(load_node_id(&p).as_deref(), Some("cloud_node_ab12"));
        let huge = "cloud_node_".to_string() + &"a".repeat(100_000);
        for bad in [
            "",
            "x",
            "cloud_node_a/b",
            "cloud_node_#",
            "cloud_node_0123456789abc",
            "cloud_node_é",
            huge.as_str(),
        ] {
            std::fs::write(&p, bad).unwrap();
            assert_eq!(load_node_id(&p), None, "{bad:.40}");
            assert!(!p.exists(), "{bad:.40} moved aside");
        }
        std::fs::write(&p, [0xffu8, 0xfe]).unwrap();
        assert_eq!(load_node_id(&p), None);
        assert_eq!(
            std::fs::read_dir(dir.join("quarantine")).unwrap().count(),
            8
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
