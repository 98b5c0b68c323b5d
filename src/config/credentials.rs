//! `credentials.json` (written by `cyberwave login`, only read here) and the node's own
//! `instance_identity.json` (decision D4).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What the node reads from `<config dir>/credentials.json`. A missing or non-JSON file counts
/// as "no credentials"; a blank token as no token.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    pub path: PathBuf,
    pub token: Option<String>,
    pub workspace_slug: Option<String>,
    json: Value,
}

impl Credentials {
    pub fn load(path: &Path) -> Credentials {
        let json: Value = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
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

impl Identity {
    /// Reads the identity file. Absent → `Ok(None)`; unreadable or corrupt → `Err` with a
    /// message (the caller warns and registers afresh rather than dying).
    pub fn load(path: &Path) -> Result<Option<Identity>, String> {
        match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str::<Identity>(&text)
                .map(|i| Some(i).filter(|i| !i.uuid.trim().is_empty()))
                .map_err(|e| format!("{} is not a valid identity file: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
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
            r#"{"token":" cw_tok ","workspace_slug":"ws","envs":{"CYBERWAVE_MQTT_HOST":"h","CYBERWAVE_MQTT_PORT":" "},"CYBERWAVE_MQTT_PORT":1884}"#,
        )
        .unwrap();
        let c = Credentials::load(&p);
        assert_eq!(c.token.as_deref(), Some("cw_tok"));
        assert_eq!(c.workspace_slug.as_deref(), Some("ws"));
        assert_eq!(c.env_value("CYBERWAVE_MQTT_HOST").as_deref(), Some("h"));
        assert_eq!(c.env_value("CYBERWAVE_MQTT_PORT").as_deref(), Some("1884"));
        std::fs::write(&p, "not json").unwrap();
        assert!(Credentials::load(&p).token.is_none());
        std::fs::remove_dir_all(&dir).unwrap();
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
        assert!(Identity::load(&p).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
