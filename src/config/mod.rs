//! Configuration, resolved once into one [`Settings`] value. Precedence, for every setting that
//! has all three: command-line flag > `cyberwave.yml` > environment variable (process env >
//! `./.env` > `<config dir>/.env`) > `credentials.json` > default. Exceptions, each documented in
//! docs/configuration.md: the command-template env vars (`CYBERWAVE_*_CMD`, `CYBERWAVE_INSTALL_SCRIPT`)
//! override the file, so a deployment can swap a command without editing the repository's
//! manifest; and the API token comes from the environment layers, then `credentials.json`.

pub mod broker;
pub mod credentials;
pub mod env;
pub mod manifest;
mod resolve;
pub mod template;
pub mod yaml11;

pub use resolve::resolve;

use std::path::{Path, PathBuf};
use std::time::Duration;

use credentials::Identity;
use env::EnvLayers;
use manifest::{Manifest, Problem};

/// Where a resolved value came from; `config` prints it next to the value.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    Default,
    Flag(String),
    File(PathBuf),
    /// A manifest key, with the section it was read from (`cyberwave`, `cloud_node`, …).
    Manifest(PathBuf, String),
    Env(String),
    DotEnv(PathBuf, String),
    Credentials(PathBuf),
    Identity(PathBuf),
    /// Worked out from another setting (e.g. TLS from the port).
    Derived(String),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Default => write!(f, "default"),
            Source::Flag(s) => write!(f, "flag {s}"),
            Source::File(p) => write!(f, "file {}", p.display()),
            Source::Manifest(p, section) if section == "root" => write!(f, "file {}", p.display()),
            Source::Manifest(p, section) => write!(f, "file {} ({section}:)", p.display()),
            Source::Env(v) => write!(f, "env {v}"),
            Source::DotEnv(p, v) => write!(f, "{v} in {}", p.display()),
            Source::Credentials(p) => write!(f, "{}", p.display()),
            Source::Identity(p) => write!(f, "{}", p.display()),
            Source::Derived(s) => write!(f, "{s}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sourced<T> {
    pub value: T,
    pub source: Source,
}

/// The SDK's placeholder MQTT username: asks for the token-derived one.
pub const MQTT_USERNAME_PLACEHOLDER: &str = "mqttcyb";

/// `cwh_` + lowercase hex SHA-256 of the token's UTF-8 bytes.
pub fn token_username(token: &str) -> String {
    format!(
        "cwh_{}",
        crate::util::hex(&crate::util::sha256(token.as_bytes()))
    )
}

fn sourced<T>(value: T, source: Source) -> Sourced<T> {
    Sourced { value, source }
}

/// Flags from the command line that feed the settings.
#[derive(Debug, Clone, Default)]
pub struct Flags {
    pub config: Option<PathBuf>,
    pub slug: Option<String>,
    pub profile: Option<String>,
    pub environment: Option<String>,
    pub mqtt_host: Option<String>,
    pub mqtt_port: Option<u16>,
    pub mqtt_tls: Option<bool>,
    pub lenient: bool,
    pub standalone: bool,
    pub drain_after_one: bool,
    pub metrics_file: Option<PathBuf>,
}

/// What the console mirror prints per workload stream and second by default
/// (`CYBERWAVE_NODE_MIRROR_BYTES_PER_SECOND`, D69).
pub const MIRROR_BYTES_PER_SECOND: u64 = 1024 * 1024;

/// Timings that production never changes but tests shorten (env `CYBERWAVE_NODE_*`, listed in
/// docs/configuration.md under "Tuning").
#[derive(Debug, Clone, PartialEq)]
pub struct Tuning {
    pub reconnect_base: Duration,
    pub reconnect_max: Duration,
    pub register_retry_max: Duration,
    /// How long a heartbeat or status request waits for its reply (fixed: no variable sets it).
    pub heartbeat_timeout: Duration,
    pub auth_retry_base: Duration,
    /// The MQTT session expiry the node asks for (fixed: no variable sets it).
    pub session_expiry: Duration,
    pub token_check_timeout: Duration,
    pub shutdown_flush: Duration,
    /// How long a request to the backend waits for its reply (registration, workload
    /// statuses, outbox messages).
    pub request_timeout: Duration,
    /// What is left of a workload's process group when its own process exits gets SIGTERM,
    /// then SIGKILL after this long (D25).
    pub cleanup_grace: Duration,
    /// How often `--metrics-file` is rewritten.
    pub metrics_interval: Duration,
    /// How long `start` waits for a state dir another node holds (0: not at all). A node
    /// started with no subcommand (the platform CLI's `compute restart`) waits 30 s (D43).
    pub lock_wait: Duration,
    /// How long one connect attempt waits for the broker's CONNACK (a clustered broker may
    /// take well over 10 s to take a session over from another node).
    pub connect_timeout: Duration,
    /// `CYBERWAVE_NODE_MAX_COMMAND_BYTES`: a larger command is refused before its params are
    /// read (D64).
    pub max_command_bytes: usize,
    /// `CYBERWAVE_NODE_MIRROR_BYTES_PER_SECOND`: what the console mirror prints per workload
    /// stream and second (D69).
    pub mirror_bytes_per_second: u64,
    /// `CYBERWAVE_NODE_INGRESS_QUEUE_BYTES`: the workflow events waiting to be sent, in bytes;
    /// one workload may fill a quarter of it (D67).
    pub ingress_queue_bytes: u64,
    /// `CYBERWAVE_NODE_UPLOAD_DEADLINE_SECONDS`: one workload's result uploads as a whole (D68);
    /// `None`: 30 minutes and a second per MiB of its results.
    pub upload_deadline: Option<Duration>,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            reconnect_base: Duration::from_millis(500),
            reconnect_max: Duration::from_secs(30),
            register_retry_max: Duration::from_secs(30),
            heartbeat_timeout: Duration::from_secs(10),
            auth_retry_base: Duration::from_secs(2),
            session_expiry: Duration::from_secs(3600),
            token_check_timeout: Duration::from_secs(10),
            shutdown_flush: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            cleanup_grace: Duration::from_secs(10),
            metrics_interval: Duration::from_secs(5),
            lock_wait: Duration::ZERO,
            connect_timeout: Duration::from_secs(30),
            max_command_bytes: crate::protocol::commands::MAX_COMMAND_BYTES,
            mirror_bytes_per_second: MIRROR_BYTES_PER_SECOND,
            ingress_queue_bytes: crate::ingress::MAX_QUEUE_BYTES,
            upload_deadline: None,
        }
    }
}

pub const DEFAULT_BASE_URL: &str = "https://api.cyberwave.com";
pub const DEFAULT_MQTT_HOST: &str = "mqtt.cyberwave.com";
pub const DEFAULT_MQTT_PORT: u16 = 8883;

#[derive(Debug, Clone)]
pub struct Settings {
    pub config_dir: Sourced<PathBuf>,
    pub working_dir: PathBuf,
    pub manifest: Option<Manifest>,
    pub manifest_warnings: Vec<Problem>,
    /// How many of those the platform's validator would refuse (`start` runs anyway; D22).
    pub manifest_platform_refusals: usize,
    /// D63 warnings about the command templates set in the environment (`CYBERWAVE_*_CMD`).
    pub template_warnings: Vec<String>,
    pub api_token: Option<Sourced<String>>,
    pub base_url: Sourced<String>,
    pub workspace_slug: Option<Sourced<String>>,
    pub topic_prefix: Sourced<String>,
    pub instance_uuid: Option<Sourced<String>>,
    pub slug_hint: Option<Sourced<String>>,
    pub profile_slug: Sourced<String>,
    pub install: Option<Sourced<String>>,
    pub inference: Option<Sourced<String>>,
    pub simulate: Option<Sourced<String>>,
    pub training: Option<Sourced<String>>,
    pub heartbeat_interval: Sourced<Duration>,
    pub mqtt_host: Sourced<String>,
    pub mqtt_port: Sourced<u16>,
    pub mqtt_use_tls: Sourced<bool>,
    pub mqtt_ca_certs: Option<Sourced<PathBuf>>,
    pub mqtt_username: Option<Sourced<String>>,
    pub mqtt_password: Option<Sourced<String>>,
    /// D62: the connection variables a workload gets (name → value): only those the operator
    /// set, as the node uses them; the broker password is replaced by a per-workload token.
    pub workload_connection: std::collections::BTreeMap<String, String>,
    pub upload_results: Sourced<bool>,
    pub results_folder: Sourced<PathBuf>,
    pub environment_uuid: Option<Sourced<String>>,
    pub max_concurrent_workloads: Sourced<u32>,
    pub log_stream_interval: Sourced<Duration>,
    pub standalone: bool,
    pub drain_after_one: bool,
    pub metrics_file: Option<Sourced<PathBuf>>,
    pub min_free_disk_mb: Sourced<u64>,
    pub max_log_bytes: Sourced<u64>,
    pub log_retention_days: Sourced<u64>,
    pub hardware_telemetry: bool,
    pub identity: Option<Identity>,
    pub tuning: Tuning,
    pub env: EnvLayers,
}

/// A configuration that cannot run: one line each, exit code 2.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError(pub Vec<String>);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0.join("\n"))
    }
}

impl Settings {
    pub fn identity_path(&self) -> PathBuf {
        self.config_dir.value.join("instance_identity.json")
    }

    /// Path of the file that holds the node's MQTT client id (decision D15).
    pub fn node_id_path(&self) -> PathBuf {
        self.config_dir.value.join("node_id")
    }

    /// D59: what a workload puts in a session of its own outlives it (`cloud_node.services`,
    /// `keep` unless the manifest says `stop`).
    pub fn keep_services(&self) -> bool {
        self.manifest
            .as_ref()
            .and_then(|m| m.keep_services)
            .unwrap_or(true)
    }

    pub fn command_template(&self, kind: &str) -> Option<&str> {
        match kind {
            "inference" => self.inference.as_ref(),
            "simulate" => self.simulate.as_ref(),
            "training" => self.training.as_ref(),
            _ => None,
        }
        .map(|s| s.value.as_str())
    }

    /// A node setting only the manifest sets: its value and section, else "(unset)".
    fn manifest_row(
        &self,
        name: &'static str,
        value: impl Fn(&Manifest) -> Option<String>,
    ) -> (&'static str, String, String) {
        match self.manifest.as_ref().and_then(|m| Some((m, value(m)?))) {
            Some((m, v)) => {
                let src = match m.section_of(name) {
                    Some(section) => Source::Manifest(m.path.clone(), section.to_string()),
                    None => Source::File(m.path.clone()),
                };
                (name, v, src.to_string())
            }
            None => (name, "(unset)".to_string(), "-".to_string()),
        }
    }

    /// Every setting as (name, printable value, source), secrets masked.
    pub fn rows(&self) -> Vec<(&'static str, String, String)> {
        fn row<T: std::fmt::Display>(
            name: &'static str,
            s: &Sourced<T>,
        ) -> (&'static str, String, String) {
            (name, s.value.to_string(), s.source.to_string())
        }
        fn opt<T: std::fmt::Display>(
            name: &'static str,
            s: &Option<Sourced<T>>,
        ) -> (&'static str, String, String) {
            match s {
                Some(s) => row(name, s),
                None => (name, "(unset)".to_string(), "-".to_string()),
            }
        }
        fn secret(
            name: &'static str,
            s: &Option<Sourced<String>>,
        ) -> (&'static str, String, String) {
            match s {
                Some(s) => (
                    name,
                    crate::util::mask_secret(&s.value),
                    s.source.to_string(),
                ),
                None => (name, "(unset)".to_string(), "-".to_string()),
            }
        }
        let path = |s: &Sourced<PathBuf>| sourced(s.value.display().to_string(), s.source.clone());
        let secs = |s: &Sourced<Duration>| {
            sourced(format!("{}s", s.value.as_secs_f64()), s.source.clone())
        };
        let mut rows = vec![
            row("config_dir", &path(&self.config_dir)),
            (
                "manifest",
                self.manifest
                    .as_ref()
                    .map(|m| m.path.display().to_string())
                    .unwrap_or_else(|| "(none: environment only)".into()),
                self.manifest
                    .as_ref()
                    .and_then(|m| m.wrapper.clone())
                    .map(|w| format!("`{w}:` wrapper"))
                    .unwrap_or_else(|| "-".into()),
            ),
            (
                "working_dir",
                self.working_dir.display().to_string(),
                "-".to_string(),
            ),
            secret("api_token", &self.api_token),
            row("base_url", &self.base_url),
            opt("workspace_slug", &self.workspace_slug),
            row(
                "topic_prefix",
                &sourced(
                    format!("{:?}", self.topic_prefix.value),
                    self.topic_prefix.source.clone(),
                ),
            ),
            opt("instance_uuid", &self.instance_uuid),
            opt("slug_hint", &self.slug_hint),
            row("profile_slug", &self.profile_slug),
            opt("environment_uuid", &self.environment_uuid),
            opt("install", &self.install),
            opt("inference", &self.inference),
            opt("simulate", &self.simulate),
            opt("training", &self.training),
            row("heartbeat_interval", &secs(&self.heartbeat_interval)),
            row("mqtt_host", &self.mqtt_host),
            row("mqtt_port", &self.mqtt_port),
            row("mqtt_use_tls", &self.mqtt_use_tls),
            opt("mqtt_tls_ca_certs", &self.mqtt_ca_certs.as_ref().map(path)),
            opt("mqtt_username", &self.mqtt_username),
            secret("mqtt_password", &self.mqtt_password),
            row("upload_results", &self.upload_results),
            row("results_folder", &path(&self.results_folder)),
            row("max_concurrent_workloads", &self.max_concurrent_workloads),
            row("log_stream_interval", &secs(&self.log_stream_interval)),
            row("min_free_disk_mb", &self.min_free_disk_mb),
            row("max_log_bytes", &self.max_log_bytes),
            row("log_retention_days", &self.log_retention_days),
        ];
        rows.extend(self.manifest_only_rows());
        rows.push(opt("metrics_file", &self.metrics_file.as_ref().map(path)));
        rows.push((
            "standalone",
            self.standalone.to_string(),
            if self.standalone {
                "flag --standalone"
            } else {
                "default"
            }
            .to_string(),
        ));
        rows
    }

    /// The node settings only the manifest sets.
    fn manifest_only_rows(&self) -> Vec<(&'static str, String, String)> {
        vec![
            self.manifest_row("max_runtime_seconds", |m| {
                m.max_runtime_seconds.map(|s| format!("{s}s"))
            }),
            match self.manifest_row("workflow_reporting", |m| {
                m.workflow_reporting
                    .map(|on| if on { "on" } else { "off" }.to_string())
            }) {
                (name, _, src) if src == "-" => (name, "on".to_string(), "default".to_string()),
                row => row,
            },
            self.manifest_row("gpus_per_workload", |m| {
                m.gpus_per_workload.map(|n| n.to_string())
            }),
            self.manifest_row("max_result_bytes", |m| {
                m.max_result_bytes.map(|n| n.to_string())
            }),
            match self.manifest_row("services", |m| {
                m.keep_services
                    .map(|keep| if keep { "keep" } else { "stop" }.to_string())
            }) {
                (name, _, src) if src == "-" => (name, "keep".to_string(), "default".to_string()),
                row => row,
            },
            match self.manifest_row("install_user", |m| {
                m.install_as_node
                    .map(|node| if node { "node" } else { "workload_user" }.to_string())
            }) {
                (name, _, src) if src == "-" => {
                    (name, "workload_user".to_string(), "default".to_string())
                }
                row => row,
            },
        ]
    }
}

/// Longest topic prefix (D50, as a D20 id).
pub const MAX_TOPIC_PREFIX_BYTES: usize = 256;

/// A topic prefix is glued in front of every topic the node subscribes to and publishes on
/// (D50): a wildcard would leave the node deaf, whitespace or a control character is a typo.
/// Like a D20 id it is printable ASCII without `+` or `#` (a `/` is allowed), at most 256 bytes;
/// empty means none.
pub fn check_topic_prefix(prefix: &str) -> Result<(), TopicPrefixError> {
    if prefix.len() > MAX_TOPIC_PREFIX_BYTES {
        return Err(TopicPrefixError::TooLong(prefix.len()));
    }
    match prefix
        .chars()
        .find(|c| !c.is_ascii_graphic() || matches!(c, '+' | '#'))
    {
        Some(c) => Err(TopicPrefixError::Char(prefix.to_string(), c)),
        None => Ok(()),
    }
}

/// Why a topic prefix cannot be one (printed after the setting's name and source).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopicPrefixError {
    /// Its length in bytes.
    TooLong(usize),
    /// The prefix, and the first character it may not hold.
    Char(String, char),
}

impl std::fmt::Display for TopicPrefixError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TopicPrefixError::TooLong(len) => write!(
                f,
                "is {len} bytes long; a topic prefix may be at most {MAX_TOPIC_PREFIX_BYTES}"
            ),
            TopicPrefixError::Char(prefix, c) => write!(
                f,
                "{prefix:?} cannot be a topic prefix: it may hold only printable ASCII without '+', '#' (MQTT wildcards), whitespace or control characters (found '{}')",
                c.escape_default()
            ),
        }
    }
}

/// Why the passwd database gave no home directory for a uid.
#[derive(Debug)]
pub enum PasswdError {
    /// `getpwuid_r` failed.
    Unreadable(u32, std::io::Error),
    /// The uid has no entry (or the entry no home).
    NoEntry(u32),
}

impl std::fmt::Display for PasswdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PasswdError::Unreadable(uid, e) => {
                write!(f, "the passwd entry of uid {uid} cannot be read: {e}")
            }
            PasswdError::NoEntry(uid) => write!(f, "uid {uid} has no passwd entry"),
        }
    }
}

/// The config dir (resolved from the process environment only, before any `.env` is read,
/// D42): `CYBERWAVE_EDGE_CONFIG_DIR`, else `$HOME/.cyberwave`, else the home of the effective
/// uid's passwd entry + `/.cyberwave` (a systemd unit without `User=`, `env -i`, cron set no
/// `HOME`; the Python original falls back to the passwd entry too). The source says which.
pub fn config_dir(process: &EnvLayers) -> Result<Sourced<PathBuf>, ConfigError> {
    let euid = crate::util::euid();
    config_dir_with(process, euid, passwd_home)
}

/// [`config_dir`] with the passwd lookup given (for tests).
fn config_dir_with(
    process: &EnvLayers,
    euid: u32,
    home_of: impl Fn(u32) -> Result<PathBuf, PasswdError>,
) -> Result<Sourced<PathBuf>, ConfigError> {
    let mut tried = Vec::new();
    // (A blank variable counts as unset.)
    match process.get("CYBERWAVE_EDGE_CONFIG_DIR") {
        Some((v, src)) => return Ok(sourced(PathBuf::from(v), src)),
        None => tried.push("CYBERWAVE_EDGE_CONFIG_DIR is not set"),
    }
    match process.value("HOME") {
        Some(home) if Path::new(&home).is_absolute() => {
            return Ok(sourced(
                Path::new(&home).join(".cyberwave"),
                Source::Derived("$HOME/.cyberwave".into()),
            ))
        }
        Some(_) => tried.push("HOME is not an absolute path"),
        None => tried.push("HOME is not set"),
    }
    let passwd = match home_of(euid) {
        Ok(home) if home.is_absolute() => {
            return Ok(sourced(
                home.join(".cyberwave"),
                Source::Derived(format!(
                    "HOME unset: the home of uid {euid} in the passwd database + /.cyberwave"
                )),
            ))
        }
        Ok(home) => format!(
            "the passwd entry of uid {euid} has no absolute home ({:?})",
            home.display().to_string()
        ),
        Err(e) => e.to_string(),
    };
    Err(ConfigError(vec![format!(
        "cannot find a config dir: {}, {} and {passwd}; set CYBERWAVE_EDGE_CONFIG_DIR (or HOME)",
        tried.first().copied().unwrap_or_default(),
        tried.get(1).copied().unwrap_or_default(),
    )]))
}

/// Largest passwd buffer tried (getpwuid_r reports ERANGE below what it needs).
const MAX_PASSWD_BUF: usize = 1 << 20;

/// The home directory of `uid`'s passwd entry (`getpwuid_r`).
fn passwd_home(uid: u32) -> Result<PathBuf, PasswdError> {
    use std::os::unix::ffi::OsStrExt;
    let mut size = 1024usize;
    loop {
        let mut buf = vec![0 as libc::c_char; size];
        // SAFETY: all-zero is a valid `passwd` (null pointers, zero ids); it is only read after
        // getpwuid_r filled it.
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: the buffer, the passwd struct and the result pointer are ours and valid for
        // the call, and the length given is the buffer's.
        let rc = unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), buf.len(), &mut found) };
        if rc == libc::ERANGE && size < MAX_PASSWD_BUF {
            size = size.saturating_mul(4);
            continue;
        }
        if rc != 0 {
            return Err(PasswdError::Unreadable(
                uid,
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        if found.is_null() || pw.pw_dir.is_null() {
            return Err(PasswdError::NoEntry(uid));
        }
        // SAFETY: getpwuid_r succeeded: pw_dir points into `buf`, NUL-terminated, non-null.
        let dir = unsafe { std::ffi::CStr::from_ptr(pw.pw_dir) };
        return Ok(PathBuf::from(std::ffi::OsStr::from_bytes(dir.to_bytes())));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    struct Dir(PathBuf);
    impl Dir {
        fn new(tag: &str) -> Dir {
            let p = std::env::temp_dir().join(format!("cw-cfg-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(p.join("cfg")).unwrap();
            std::fs::create_dir_all(p.join("work")).unwrap();
            Dir(p)
        }
        fn write(&self, rel: &str, text: &str) {
            std::fs::write(self.0.join(rel), text).unwrap();
        }
        fn env(&self, vars: &[(&str, &str)]) -> EnvLayers {
            let mut m: BTreeMap<String, String> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            m.insert(
                "CYBERWAVE_EDGE_CONFIG_DIR".into(),
                self.0.join("cfg").display().to_string(),
            );
            EnvLayers::new(m)
        }
        fn resolve(&self, flags: &Flags, vars: &[(&str, &str)]) -> Result<Settings, ConfigError> {
            resolve(flags, self.env(vars), &self.0.join("work"))
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn without_home_the_config_dir_is_the_passwd_home_and_only_all_three_failing_is_an_error() {
        // D42: a systemd unit without `User=` (what `cyberwave compute install` writes), `env -i`.
        let env = |vars: &[(&str, &str)]| {
            EnvLayers::new(
                vars.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        let passwd = |uid: u32| match uid {
            0 => Ok(PathBuf::from("/root")),
            7 => Ok(PathBuf::from("")),
            _ => Err(PasswdError::NoEntry(uid)),
        };
        for vars in [
            &[][..],
            &[("HOME", "")][..],
            &[("HOME", "relative")][..],
            &[("CYBERWAVE_EDGE_CONFIG_DIR", "")][..],
        ] {
            let d = config_dir_with(&env(vars), 0, passwd).unwrap();
            assert_eq!(d.value, PathBuf::from("/root/.cyberwave"), "{vars:?}");
            assert!(
                d.source
                    .to_string()
                    .contains("home of uid 0 in the passwd database"),
                "{}",
                d.source
            );
        }
        // The override and HOME still come first.
        let d = config_dir_with(&env(&[("HOME", "/home/u")]), 0, passwd).unwrap();
        assert_eq!(d.value, PathBuf::from("/home/u/.cyberwave"));
        // All three fail: one error naming each.
        let e = config_dir_with(&env(&[]), 4242, passwd)
            .unwrap_err()
            .0
            .join("\n");
        for needle in [
            "CYBERWAVE_EDGE_CONFIG_DIR is not set",
            "HOME is not set",
            "uid 4242 has no passwd entry",
        ] {
            assert!(e.contains(needle), "{e}");
        }
        let e = config_dir_with(&env(&[("HOME", "")]), 7, passwd)
            .unwrap_err()
            .0
            .join("\n");
        assert!(e.contains("no absolute home"), "{e}");
        // The real lookup: this process's uid has an entry on any sane test host.
        // SAFETY: geteuid cannot fail.
        let me = unsafe { libc::geteuid() };
        assert!(passwd_home(me).unwrap().is_absolute());
        assert!(passwd_home(u32::MAX - 7).is_err());
    }

    #[test]
    fn config_dir_is_the_override_else_home_dot_cyberwave() {
        let env = |vars: &[(&str, &str)]| {
            EnvLayers::new(
                vars.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        let d = config_dir(&env(&[
            ("CYBERWAVE_EDGE_CONFIG_DIR", "/srv/cw"),
            ("HOME", "/home/u"),
        ]))
        .unwrap();
        assert_eq!(d.value, PathBuf::from("/srv/cw"));
        assert_eq!(d.source, Source::Env("CYBERWAVE_EDGE_CONFIG_DIR".into()));
        let d = config_dir(&env(&[("HOME", "/home/u")])).unwrap();
        assert_eq!(d.value, PathBuf::from("/home/u/.cyberwave"));
        assert_eq!(d.source, Source::Derived("$HOME/.cyberwave".into()));
        // A .env file cannot move the config dir (it is read from that dir).
        let dir = Dir::new("cfgdir");
        dir.write("work/.env", "CYBERWAVE_EDGE_CONFIG_DIR=/elsewhere\n");
        let s = dir.resolve(&Flags::default(), &[]).unwrap();
        assert!(s.config_dir.value.ends_with("cfg"), "{:?}", s.config_dir);
    }

    #[test]
    fn token_order_is_env_then_local_dotenv_then_shared_dotenv_then_credentials() {
        let d = Dir::new("tok");
        d.write("cfg/credentials.json", r#"{"token":"cw_from_credentials"}"#);
        let s = d.resolve(&Flags::default(), &[]).unwrap();
        assert_eq!(s.api_token.unwrap().value, "cw_from_credentials");
        d.write("cfg/.env", "CYBERWAVE_API_KEY=cw_shared\n");
        assert_eq!(
            d.resolve(&Flags::default(), &[])
                .unwrap()
                .api_token
                .unwrap()
                .value,
            "cw_shared"
        );
        d.write("work/.env", "CYBERWAVE_API_KEY=cw_local\n");
        let s = d.resolve(&Flags::default(), &[]).unwrap();
        assert_eq!(s.api_token.as_ref().unwrap().value, "cw_local");
        assert!(
            matches!(s.api_token.unwrap().source, Source::DotEnv(p, _) if p.ends_with("work/.env"))
        );
        let s = d
            .resolve(&Flags::default(), &[("CYBERWAVE_API_KEY", "cw_env")])
            .unwrap();
        assert_eq!(
            s.api_token.unwrap().source,
            Source::Env("CYBERWAVE_API_KEY".into())
        );
    }

    #[test]
    fn flag_beats_file_beats_env() {
        let d = Dir::new("prec");
        let env = [
            ("CYBERWAVE_MQTT_HOST", "env-host"),
            ("CYBERWAVE_PROFILE_SLUG", "env-prof"),
        ];
        let s = d.resolve(&Flags::default(), &env).unwrap();
        assert_eq!(s.mqtt_host.value, "env-host");
        assert_eq!(s.profile_slug.value, "env-prof");
        d.write(
            "work/cyberwave.yml",
            "cyberwave:\n  mqtt_host: file-host\n  profile_slug: file-prof\n",
        );
        let s = d.resolve(&Flags::default(), &env).unwrap();
        assert_eq!(s.mqtt_host.value, "file-host");
        assert_eq!(s.profile_slug.value, "file-prof");
        let flags = Flags {
            mqtt_host: Some("flag-host".into()),
            profile: Some("flag-prof".into()),
            ..Default::default()
        };
        let s = d.resolve(&flags, &env).unwrap();
        assert_eq!(s.mqtt_host.value, "flag-host");
        assert_eq!(s.profile_slug.value, "flag-prof");
    }

    #[test]
    fn credentials_fill_mqtt_and_base_url_last() {
        let d = Dir::new("credfill");
        d.write(
            "cfg/credentials.json",
            r#"{"token":"t","envs":{"CYBERWAVE_MQTT_HOST":"ch","CYBERWAVE_MQTT_PORT":"1884","CYBERWAVE_BASE_URL":"http://c/","CYBERWAVE_ENVIRONMENT":"dev"}}"#,
        );
        let s = d.resolve(&Flags::default(), &[]).unwrap();
        assert_eq!(s.mqtt_host.value, "ch");
        assert_eq!(s.mqtt_port.value, 1884);
        assert_eq!(s.base_url.value, "http://c");
        assert_eq!(s.topic_prefix.value, "dev");
        let s = d
            .resolve(&Flags::default(), &[("CYBERWAVE_MQTT_PORT", "1885")])
            .unwrap();
        assert_eq!(s.mqtt_port.value, 1885);
    }

    #[test]
    fn tls_follows_the_effective_port_unless_switched() {
        let d = Dir::new("tls");
        assert!(
            d.resolve(&Flags::default(), &[])
                .unwrap()
                .mqtt_use_tls
                .value
        );
        let flags = Flags {
            mqtt_port: Some(1883),
            ..Default::default()
        };
        assert!(
            !d.resolve(&flags, &[]).unwrap().mqtt_use_tls.value,
            "--mqtt-port 1883 ⇒ no TLS"
        );
        assert!(
            d.resolve(&flags, &[("CYBERWAVE_MQTT_USE_TLS", "yes")])
                .unwrap()
                .mqtt_use_tls
                .value
        );
        d.write("work/cyberwave.yml", "mqtt_use_tls: false\n");
        let s = d
            .resolve(&Flags::default(), &[("CYBERWAVE_MQTT_USE_TLS", "1")])
            .unwrap();
        assert!(!s.mqtt_use_tls.value, "file beats env");
        let flags = Flags {
            mqtt_tls: Some(true),
            ..Default::default()
        };
        assert!(
            d.resolve(&flags, &[]).unwrap().mqtt_use_tls.value,
            "flag beats file"
        );
    }

    #[test]
    fn a_prefix_with_a_wildcard_whitespace_or_a_control_character_is_refused_naming_its_variable() {
        // D50: a `#` or `+` would leave the node deaf (every subscription a wildcard).
        let d = Dir::new("prefix-bad");
        let err = |vars: &[(&str, &str)]| match d.resolve(&Flags::default(), vars) {
            Ok(s) => panic!("accepted {vars:?}: prefix {:?}", s.topic_prefix.value),
            Err(e) => e.0.join("\n"),
        };
        for (var, value, found) in [
            ("CYBERWAVE_ENVIRONMENT", "dev#", "#"),
            ("CYBERWAVE_ENVIRONMENT", "+", "+"),
            ("CYBERWAVE_TOPIC_PREFIX", "a b/", " "),
            ("CYBERWAVE_MQTT_TOPIC_PREFIX", "x\u{0}y", "\\u{0}"),
            ("CYBERWAVE_MQTT_TOPIC_PREFIX", "x\ty", "\\t"),
            ("CYBERWAVE_TOPIC_PREFIX", "x\u{1b}[2J", "\\u{1b}"),
            ("CYBERWAVE_ENVIRONMENT", "d\u{e9}v", "\\u{e9}"),
            ("CYBERWAVE_ENVIRONMENT", "d\u{a0}v", "\\u{a0}"),
        ] {
            let e = err(&[(var, value)]);
            assert!(e.contains(&format!("{var} (env {var})")), "{e}");
            assert!(e.contains(&format!("(found '{found}')")), "{e}");
            assert!(e.contains("cannot be a topic prefix"), "{e}");
            assert!(!e.contains('\u{0}') && !e.contains('\u{1b}'), "{e}");
        }
        // The explicit variable that wins is the one named.
        let e = err(&[
            ("CYBERWAVE_ENVIRONMENT", "dev"),
            ("CYBERWAVE_TOPIC_PREFIX", "dev/#"),
        ]);
        assert!(e.contains("CYBERWAVE_TOPIC_PREFIX (env"), "{e}");
        let e = err(&[("CYBERWAVE_TOPIC_PREFIX", &"p".repeat(257))]);
        assert!(
            e.contains("257 bytes long; a topic prefix may be at most 256"),
            "{e}"
        );
        // Allowed: slashes, dots, dashes; 256 bytes; empty; surrounding blanks are trimmed.
        for ok in ["dev/", "a.b-c_d/e", &"p".repeat(256), " local\n"] {
            assert!(
                d.resolve(&Flags::default(), &[("CYBERWAVE_TOPIC_PREFIX", ok)])
                    .is_ok(),
                "{ok:?}"
            );
        }
    }

    #[test]
    fn a_wildcard_prefix_from_credentials_json_is_refused_naming_the_file() {
        let d = Dir::new("prefix-creds");
        d.write(
            "cfg/credentials.json",
            r#"{"token":"t","envs":{"CYBERWAVE_ENVIRONMENT":"dev+"}}"#,
        );
        let e = d.resolve(&Flags::default(), &[]).unwrap_err().0.join("\n");
        assert!(e.contains("CYBERWAVE_ENVIRONMENT ("), "{e}");
        assert!(e.contains("credentials.json)"), "{e}");
    }

    #[test]
    fn prefix_rule() {
        let d = Dir::new("prefix");
        let p = |vars: &[(&str, &str)]| {
            d.resolve(&Flags::default(), vars)
                .unwrap()
                .topic_prefix
                .value
        };
        assert_eq!(p(&[]), "");
        assert_eq!(p(&[("CYBERWAVE_ENVIRONMENT", " Production ")]), "");
        assert_eq!(p(&[("CYBERWAVE_ENVIRONMENT", "local")]), "local");
        assert_eq!(
            p(&[
                ("CYBERWAVE_ENVIRONMENT", "local"),
                ("CYBERWAVE_MQTT_TOPIC_PREFIX", "x/")
            ]),
            "x/"
        );
        // The SDK's second name, and its order: the MQTT one wins, a blank one is unset.
        assert_eq!(
            p(&[
                ("CYBERWAVE_ENVIRONMENT", "local"),
                ("CYBERWAVE_TOPIC_PREFIX", "sim/")
            ]),
            "sim/"
        );
        assert_eq!(
            p(&[
                ("CYBERWAVE_TOPIC_PREFIX", "sim/"),
                ("CYBERWAVE_MQTT_TOPIC_PREFIX", "x/")
            ]),
            "x/"
        );
        assert_eq!(
            p(&[
                ("CYBERWAVE_TOPIC_PREFIX", "sim/"),
                ("CYBERWAVE_MQTT_TOPIC_PREFIX", " ")
            ]),
            "sim/"
        );
        assert_eq!(
            p(&[
                ("CYBERWAVE_ENVIRONMENT", "dev"),
                ("CYBERWAVE_TOPIC_PREFIX", "")
            ]),
            "dev"
        );
    }

    #[test]
    fn command_env_vars_work_alone_and_override_the_file() {
        let d = Dir::new("cmd");
        let s = d
            .resolve(
                &Flags::default(),
                &[("CYBERWAVE_INFERENCE_CMD", "env-inf {body}")],
            )
            .unwrap();
        assert_eq!(s.inference.unwrap().value, "env-inf {body}");
        d.write(
            "work/cyberwave.yml",
            "inference: file-inf\ntraining: file-train\n",
        );
        let s = d
            .resolve(&Flags::default(), &[("CYBERWAVE_INFERENCE_CMD", "env-inf")])
            .unwrap();
        assert_eq!(s.inference.unwrap().value, "env-inf");
        assert_eq!(s.training.unwrap().value, "file-train");
    }

    #[test]
    fn environment_reservation_precedence() {
        let d = Dir::new("envres");
        let env = [("CYBERWAVE_NODE_ENVIRONMENT_UUID", "env-e")];
        assert_eq!(
            d.resolve(&Flags::default(), &env)
                .unwrap()
                .environment_uuid
                .unwrap()
                .value,
            "env-e"
        );
        d.write("work/cyberwave.yml", "environment_uuid: file-e\n");
        assert_eq!(
            d.resolve(&Flags::default(), &env)
                .unwrap()
                .environment_uuid
                .unwrap()
                .value,
            "file-e"
        );
        let flags = Flags {
            environment: Some("flag-e".into()),
            ..Default::default()
        };
        assert_eq!(
            d.resolve(&flags, &env)
                .unwrap()
                .environment_uuid
                .unwrap()
                .value,
            "flag-e"
        );
    }

    #[test]
    fn heartbeat_and_capacity_from_file_or_env() {
        let d = Dir::new("hb");
        let s = d
            .resolve(
                &Flags::default(),
                &[
                    ("CYBERWAVE_HEARTBEAT_INTERVAL", "0.5"),
                    ("CYBERWAVE_MAX_CONCURRENT_WORKLOADS", "3"),
                ],
            )
            .unwrap();
        assert_eq!(s.heartbeat_interval.value, Duration::from_millis(500));
        assert_eq!(s.max_concurrent_workloads.value, 3);
        d.write(
            "work/cyberwave.yml",
            "heartbeat_interval: 7\nmax_concurrent_workloads: 2\n",
        );
        let s = d
            .resolve(
                &Flags::default(),
                &[("CYBERWAVE_HEARTBEAT_INTERVAL", "0.5")],
            )
            .unwrap();
        assert_eq!(s.heartbeat_interval.value, Duration::from_secs(7));
        assert_eq!(s.max_concurrent_workloads.value, 2);
    }

    #[test]
    fn bad_env_values_are_errors_naming_the_variable() {
        let d = Dir::new("badenv");
        for (var, val) in [
            ("CYBERWAVE_MQTT_PORT", "abc"),
            ("CYBERWAVE_MQTT_PORT", "70000"),
            ("CYBERWAVE_HEARTBEAT_INTERVAL", "soon"),
            ("CYBERWAVE_HEARTBEAT_INTERVAL", "-1"),
            ("CYBERWAVE_MQTT_USE_TLS", "perhaps"),
            ("CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL", "0"),
            ("CYBERWAVE_MAX_CONCURRENT_WORKLOADS", "0"),
            ("CYBERWAVE_UPLOAD_RESULTS", "sometimes"),
        ] {
            let e = d.resolve(&Flags::default(), &[(var, val)]).unwrap_err();
            assert_eq!(e.0.len(), 1, "{e}");
            assert!(
                e.0[0].starts_with(var) && e.0[0].contains("expected"),
                "{e}"
            );
        }
    }

    #[test]
    fn start_warns_on_what_it_can_use_and_fails_on_what_it_cannot() {
        let d = Dir::new("badman");
        // D22: unknown keys and platform-refused but usable values are warnings for `start`.
        d.write(
            "work/cyberwave.yml",
            "cyberwave:\n  inference: x\n  provider: aws\n  version: 1\n  heartbeat_interval: 2.5\n",
        );
        for lenient in [false, true] {
            let flags = Flags {
                lenient,
                ..Default::default()
            };
            let s = d.resolve(&flags, &[]).unwrap();
            assert_eq!(s.manifest_warnings.len(), 3, "{:?}", s.manifest_warnings);
            assert!(s.manifest_warnings.iter().all(|w| w.warning));
            let first = s.manifest_warnings[0].to_string();
            assert!(
                first.contains("cyberwave.yml:3: warning: provider: unknown field"),
                "{first}"
            );
            assert_eq!(s.inference.unwrap().value, "x");
            assert_eq!(s.heartbeat_interval.value, Duration::from_millis(2500));
        }
        // A value the node needs and cannot use stops it, naming file, line and key.
        d.write(
            "work/cyberwave.yml",
            "cyberwave:\n  inference: x\n  mqtt_port: 99999\n",
        );
        let e = d.resolve(&Flags::default(), &[]).unwrap_err();
        assert!(
            e.0[0].contains(
                "cyberwave.yml:3: error: mqtt_port: expected a whole number from 1 to 65535"
            ),
            "{e}"
        );
    }

    #[test]
    fn cloud_node_section_wins_and_sources_name_the_section() {
        let d = Dir::new("cloudnode");
        d.write(
            "work/cyberwave.yml",
            "cyberwave:\n  inference: x\n  max_concurrent_workloads: 2\n  min_free_disk_mb: 10\ncloud_node:\n  max_concurrent_workloads: 4\n  log_retention_days: \"3\"\n",
        );
        let s = d
            .resolve(
                &Flags::default(),
                &[("CYBERWAVE_MAX_CONCURRENT_WORKLOADS", "9")],
            )
            .unwrap();
        assert_eq!(s.max_concurrent_workloads.value, 4);
        assert!(
            s.max_concurrent_workloads
                .source
                .to_string()
                .ends_with("cyberwave.yml (cloud_node:)"),
            "{:?}",
            s.max_concurrent_workloads.source
        );
        assert_eq!(s.min_free_disk_mb.value, 10);
        assert!(s
            .min_free_disk_mb
            .source
            .to_string()
            .ends_with("(cyberwave:)"));
        assert_eq!(s.log_retention_days.value, 3);
        assert!(s
            .manifest_warnings
            .iter()
            .any(|w| w.field == "max_concurrent_workloads"
                && w.message.contains("`cloud_node:` sets it too")));
        // The environment comes after the file, whichever section the file used.
        d.write("work/cyberwave.yml", "cyberwave:\n  inference: x\n");
        let s = d
            .resolve(
                &Flags::default(),
                &[("CYBERWAVE_MAX_CONCURRENT_WORKLOADS", "9")],
            )
            .unwrap();
        assert_eq!(s.max_concurrent_workloads.value, 9);
    }

    #[test]
    fn explicit_config_sets_working_dir_and_falls_back_to_readme() {
        let d = Dir::new("explicit");
        std::fs::create_dir_all(d.0.join("repo")).unwrap();
        d.write(
            "repo/README.md",
            "# x\n---\ncyberwave:\n  simulate: sim {body}\n  results_folder: out\n---\n",
        );
        d.write("repo/.env", "CYBERWAVE_API_KEY=cw_repo_local_token\n");
        let flags = Flags {
            config: Some(d.0.join("repo/cyberwave.yml")),
            ..Default::default()
        };
        let s = d.resolve(&flags, &[]).unwrap();
        assert_eq!(s.simulate.unwrap().value, "sim {body}");
        assert!(s.working_dir.ends_with("repo"));
        assert!(s.results_folder.value.ends_with("repo/out"));
        assert_eq!(s.api_token.unwrap().value, "cw_repo_local_token");
        let missing = Flags {
            config: Some(d.0.join("nowhere/cyberwave.yml")),
            ..Default::default()
        };
        assert!(d.resolve(&missing, &[]).unwrap_err().0[0].contains("does not exist"));
    }

    #[test]
    fn password_falls_back_to_token_and_identity_feeds_uuid_and_slug() {
        let d = Dir::new("pw");
        d.write(
            "cfg/instance_identity.json",
            r#"{"uuid":"u-1","slug":"s-1"}"#,
        );
        let s = d
            .resolve(
                &Flags::default(),
                &[("CYBERWAVE_API_KEY", "cw_tokentokentoken")],
            )
            .unwrap();
        assert_eq!(s.mqtt_password.unwrap().value, "cw_tokentokentoken");
        assert_eq!(s.instance_uuid.unwrap().value, "u-1");
        assert_eq!(s.slug_hint.unwrap().value, "s-1");
        let s = d
            .resolve(
                &Flags::default(),
                &[
                    ("CYBERWAVE_CLOUD_NODE_INSTANCE_UUID", "u-env"),
                    ("CYBERWAVE_MQTT_PASSWORD", "p"),
                ],
            )
            .unwrap();
        assert_eq!(s.instance_uuid.unwrap().value, "u-env");
        assert_eq!(s.mqtt_password.unwrap().value, "p");
    }

    #[test]
    fn the_sdk_placeholder_username_becomes_the_token_hash() {
        assert_eq!(
            token_username("api_key_secret"),
            "cwh_789e45bf946d654ae0e4764dfc1677bbc2aeb7fb609059ae97f216d5420b2f29"
        );
        let d = Dir::new("cwh");
        let user = |env: &[(&str, &str)]| {
            d.resolve(&Flags::default(), env)
                .unwrap()
                .mqtt_username
                .map(|u| u.value)
        };
        let token = ("CYBERWAVE_API_KEY", "cw_tokentokentoken");
        assert_eq!(
            user(&[token, ("CYBERWAVE_MQTT_USERNAME", "mqttcyb")]),
            Some(token_username("cw_tokentokentoken"))
        );
        // A legacy broker password keeps the placeholder; any other username is kept as it is.
        assert_eq!(
            user(&[
                token,
                ("CYBERWAVE_MQTT_USERNAME", "mqttcyb"),
                ("CYBERWAVE_MQTT_PASSWORD", "legacy")
            ]),
            Some("mqttcyb".into())
        );
        assert_eq!(
            user(&[token, ("CYBERWAVE_MQTT_USERNAME", "me")]),
            Some("me".into())
        );
        assert_eq!(user(&[token]), None);
        // The SDK derives from an API key that is not `cw_…` too (no explicit password).
        assert_eq!(
            user(&[
                ("CYBERWAVE_API_KEY", "not_a_cw_key"),
                ("CYBERWAVE_MQTT_USERNAME", "mqttcyb")
            ]),
            Some("cwh_f6190af963a9603f39a5e6aac942d31879b3386815cba87e98839bf6a753c96b".into())
        );
        // A `cw_…` broker password wins over the API key.
        assert_eq!(
            user(&[
                token,
                ("CYBERWAVE_MQTT_USERNAME", "mqttcyb"),
                ("CYBERWAVE_MQTT_PASSWORD", "cw_workload")
            ]),
            Some(token_username("cw_workload"))
        );
    }

    fn conn(s: &Settings) -> Vec<(&str, &str)> {
        s.workload_connection
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }

    #[test]
    fn d62_the_nodes_defaults_and_derivations_are_not_passed_on() {
        let d = Dir::new("d62-none");
        let s = d
            .resolve(
                &Flags::default(),
                &[("CYBERWAVE_ENVIRONMENT", "development")],
            )
            .unwrap();
        // The node itself uses the defaults …
        assert_eq!(s.base_url.value, DEFAULT_BASE_URL);
        assert!(s.mqtt_use_tls.value);
        // … and the workload works out its own from CYBERWAVE_ENVIRONMENT.
        assert_eq!(conn(&s), vec![("CYBERWAVE_ENVIRONMENT", "development")]);
        // A blank value counts as unset, here too.
        let s = d
            .resolve(&Flags::default(), &[("CYBERWAVE_BASE_URL", " ")])
            .unwrap();
        assert!(conn(&s).is_empty(), "{:?}", conn(&s));
    }

    #[test]
    fn d62_what_the_operator_set_is_passed_on_as_the_node_uses_it() {
        let d = Dir::new("d62-set");
        d.write(
            "work/cyberwave.yml",
            "cyberwave:\n  mqtt_host: site-broker.lan\n  mqtt_password: from-manifest\n",
        );
        d.write("work/.env", "CYBERWAVE_MQTT_USERNAME=site-user\n");
        let flags = Flags {
            mqtt_port: Some(1884),
            ..Flags::default()
        };
        let s = d
            .resolve(
                &flags,
                &[
                    ("CYBERWAVE_BASE_URL", "https://api.site.lan/"),
                    ("CYBERWAVE_MQTT_HOST", "ignored-the-manifest-wins"),
                    ("CYBERWAVE_MQTT_PASSWORD", "ignored-too"),
                    ("CYBERWAVE_API_KEY", "cw_node_token"),
                ],
            )
            .unwrap();
        assert_eq!(
            conn(&s),
            vec![
                ("CYBERWAVE_BASE_URL", "https://api.site.lan"),
                ("CYBERWAVE_MQTT_HOST", "site-broker.lan"),
                ("CYBERWAVE_MQTT_PASSWORD", "from-manifest"),
                ("CYBERWAVE_MQTT_PORT", "1884"),
                ("CYBERWAVE_MQTT_USERNAME", "site-user"),
            ]
        );
    }

    #[test]
    fn d62_the_placeholder_username_is_passed_on_as_written_and_no_token_as_a_password() {
        let d = Dir::new("d62-placeholder");
        let s = d
            .resolve(
                &Flags::default(),
                &[
                    ("CYBERWAVE_MQTT_USERNAME", MQTT_USERNAME_PLACEHOLDER),
                    ("CYBERWAVE_API_KEY", "cw_node_token"),
                ],
            )
            .unwrap();
        // The node connects as `cwh_…` with its token; the workload's SDK derives its own.
        assert!(s.mqtt_username.clone().unwrap().value.starts_with("cwh_"));
        assert_eq!(s.mqtt_password.clone().unwrap().value, "cw_node_token");
        assert_eq!(
            conn(&s),
            vec![("CYBERWAVE_MQTT_USERNAME", MQTT_USERNAME_PLACEHOLDER)]
        );
    }

    #[test]
    fn d62_what_cyberwave_login_stored_is_passed_on() {
        let d = Dir::new("d62-creds");
        d.write(
            "cfg/credentials.json",
            r#"{"token": "cw_t", "envs": {"CYBERWAVE_ENVIRONMENT": "dev", "CYBERWAVE_BASE_URL": "https://api-dev.cyberwave.com", "CYBERWAVE_MQTT_HOST": "dev.mqtt.cyberwave.com"}}"#,
        );
        let s = d.resolve(&Flags::default(), &[]).unwrap();
        assert_eq!(
            conn(&s),
            vec![
                ("CYBERWAVE_BASE_URL", "https://api-dev.cyberwave.com"),
                ("CYBERWAVE_ENVIRONMENT", "dev"),
                ("CYBERWAVE_MQTT_HOST", "dev.mqtt.cyberwave.com"),
            ]
        );
        // The environment wins over the file, as it does for the node.
        let s = d
            .resolve(&Flags::default(), &[("CYBERWAVE_ENVIRONMENT", "staging")])
            .unwrap();
        assert_eq!(
            s.workload_connection
                .get("CYBERWAVE_ENVIRONMENT")
                .map(String::as_str),
            Some("staging")
        );
    }

    #[test]
    fn d63_a_template_from_the_environment_is_checked_too() {
        let d = Dir::new("d63-env");
        d.write("work/cyberwave.yml", "cyberwave:\n  training: t '{body}'\n");
        let s = d
            .resolve(
                &Flags::default(),
                &[("CYBERWAVE_INFERENCE_CMD", "curl -d \"{body}\" http://h")],
            )
            .unwrap();
        assert_eq!(s.template_warnings.len(), 1, "{:?}", s.template_warnings);
        let w = &s.template_warnings[0];
        assert!(
            w.starts_with(
                "env CYBERWAVE_INFERENCE_CMD: warning: inference: `{body}` inside double quotes"
            ),
            "{w}"
        );
        // The manifest's own is one of the manifest's warnings.
        assert!(
            s.manifest_warnings
                .iter()
                .any(|p| p.field == "training" && p.message.contains("single quotes")),
            "{:?}",
            s.manifest_warnings
        );
    }

    #[test]
    fn rows_mask_secrets() {
        let d = Dir::new("rows");
        let s = d
            .resolve(
                &Flags::default(),
                &[("CYBERWAVE_API_KEY", "cw_supersecretvalue9876")],
            )
            .unwrap();
        let text = format!("{:?}", s.rows());
        assert!(!text.contains("supersecret"), "{text}");
        assert!(text.contains("cw_…9876"));
    }
}
