//! Configuration, resolved once into one [`Settings`] value. Precedence, for every setting that
//! has all three: command-line flag > `cyberwave.yml` > environment variable (process env >
//! `./.env` > `<config dir>/.env`) > `credentials.json` > default. Exceptions, each documented in
//! the README: the command-template env vars (`CYBERWAVE_*_CMD`, `CYBERWAVE_INSTALL_SCRIPT`)
//! override the file, so a deployment can swap a command without editing the repository's
//! manifest; and the API token comes from the environment layers, then `credentials.json`.

pub mod broker;
pub mod credentials;
pub mod env;
pub mod manifest;
pub mod yaml11;

use std::path::{Path, PathBuf};
use std::time::Duration;

use credentials::{Credentials, Identity};
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

/// Timings that production never changes but tests shorten (env `CYBERWAVE_NODE_*`, listed in
/// the README under "Tuning").
#[derive(Debug, Clone, PartialEq)]
pub struct Tuning {
    pub reconnect_base: Duration,
    pub reconnect_max: Duration,
    pub register_retry_max: Duration,
    pub heartbeat_timeout: Duration,
    pub auth_retry_base: Duration,
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
        vec![
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
            opt("metrics_file", &self.metrics_file.as_ref().map(path)),
            (
                "standalone",
                self.standalone.to_string(),
                if self.standalone {
                    "flag --standalone"
                } else {
                    "default"
                }
                .to_string(),
            ),
        ]
    }
}

/// Longest topic prefix (D50, as a D20 id).
pub const MAX_TOPIC_PREFIX_BYTES: usize = 256;

/// A topic prefix is glued in front of every topic the node subscribes to and publishes on
/// (D50): a wildcard would leave the node deaf, whitespace or a control character is a typo.
/// Like a D20 id it is printable ASCII without `+` or `#` (a `/` is allowed), at most 256 bytes;
/// empty means none.
pub fn check_topic_prefix(prefix: &str) -> Result<(), String> {
    if prefix.len() > MAX_TOPIC_PREFIX_BYTES {
        return Err(format!(
            "is {} bytes long; a topic prefix may be at most {MAX_TOPIC_PREFIX_BYTES}",
            prefix.len()
        ));
    }
    match prefix
        .chars()
        .find(|c| !c.is_ascii_graphic() || matches!(c, '+' | '#'))
    {
        Some(c) => Err(format!(
            "{prefix:?} cannot be a topic prefix: it may hold only printable ASCII without '+', '#' (MQTT wildcards), whitespace or control characters (found '{}')",
            c.escape_default()
        )),
        None => Ok(()),
    }
}

/// The config dir (resolved from the process environment only, before any `.env` is read,
/// D42): `CYBERWAVE_EDGE_CONFIG_DIR`, else `$HOME/.cyberwave`, else the home of the effective
/// uid's passwd entry + `/.cyberwave` (a systemd unit without `User=`, `env -i`, cron set no
/// `HOME`; the Python original falls back to the passwd entry too). The source says which.
pub fn config_dir(process: &EnvLayers) -> Result<Sourced<PathBuf>, ConfigError> {
    // SAFETY: geteuid cannot fail and touches no memory.
    let euid = unsafe { libc::geteuid() };
    config_dir_with(process, euid, passwd_home)
}

/// [`config_dir`] with the passwd lookup given (for tests).
fn config_dir_with(
    process: &EnvLayers,
    euid: u32,
    home_of: impl Fn(u32) -> Result<PathBuf, String>,
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
        Err(e) => e,
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
fn passwd_home(uid: u32) -> Result<PathBuf, String> {
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
            return Err(format!(
                "the passwd entry of uid {uid} cannot be read: {}",
                std::io::Error::from_raw_os_error(rc)
            ));
        }
        if found.is_null() || pw.pw_dir.is_null() {
            return Err(format!("uid {uid} has no passwd entry"));
        }
        // SAFETY: getpwuid_r succeeded: pw_dir points into `buf`, NUL-terminated, non-null.
        let dir = unsafe { std::ffi::CStr::from_ptr(pw.pw_dir) };
        return Ok(PathBuf::from(std::ffi::OsStr::from_bytes(dir.to_bytes())));
    }
}

/// Resolves every setting. `process` is the process environment; `cwd` the current directory.
pub fn resolve(flags: &Flags, process: EnvLayers, cwd: &Path) -> Result<Settings, ConfigError> {
    let mut errors = Vec::new();
    // The manifest path: --config, else CYBERWAVE_MANIFEST (for services, which take no flags).
    let mut flags = flags.clone();
    if flags.config.is_none() {
        flags.config = process.value("CYBERWAVE_MANIFEST").map(PathBuf::from);
    }
    let flags = &flags;
    let config_dir = config_dir(&process)?;
    let working_dir = match &flags.config {
        Some(p) => {
            let parent = p.parent().filter(|p| !p.as_os_str().is_empty());
            let parent = parent
                .map(|p| cwd.join(p))
                .unwrap_or_else(|| cwd.to_path_buf());
            parent.canonicalize().unwrap_or(parent)
        }
        None => cwd.to_path_buf(),
    };

    let mut env = process;
    for path in [working_dir.join(".env"), config_dir.value.join(".env")] {
        if let Err(e) = env.add_dotenv(&path) {
            errors.push(e);
        }
    }

    // The manifest.
    let mut manifest = None;
    let mut manifest_warnings = Vec::new();
    let mut manifest_platform_refusals = 0usize;
    match manifest::locate(flags.config.as_deref(), cwd) {
        Ok(Some((path, text))) => {
            // `start` runs whatever it can use (D22): a problem it can live with is a warning.
            let checked = manifest::check(&path, &text, flags.lenient);
            for mut p in checked.problems {
                if p.start_ok {
                    if !p.warning {
                        manifest_platform_refusals = manifest_platform_refusals.saturating_add(1);
                    }
                    p.warning = true;
                    manifest_warnings.push(p);
                } else {
                    errors.push(p.to_string());
                }
            }
            manifest = checked.manifest;
        }
        Ok(None) => {}
        Err(e) => errors.push(e),
    }
    let m = manifest.clone().unwrap_or_default();
    // Each manifest value's source names the section it came from (D23: `cloud_node:` or the
    // wrapper; `cloud_node:` wins when both set a node setting).
    let file_of = |key: &str| match m.section_of(key) {
        Some(section) => Source::Manifest(m.path.clone(), section.to_string()),
        None => Source::File(m.path.clone()),
    };
    let creds = Credentials::load(&config_dir.value.join("credentials.json"));
    let cred_src = || Source::Credentials(creds.path.clone());

    // Helpers for the common chains.
    let env_str = |name: &str| env.get(name);
    let parse_env = |name: &str,
                     expected: &str,
                     errors: &mut Vec<String>,
                     parse: &dyn Fn(&str) -> Option<f64>|
     -> Option<Sourced<f64>> {
        let (v, src) = env.get(name)?;
        match parse(v.trim()) {
            Some(n) => Some(sourced(n, src)),
            None => {
                errors.push(format!("{name} ({src}): expected {expected}, got {v:?}"));
                None
            }
        }
    };
    let pos_secs = |s: &str| s.parse::<f64>().ok().filter(|f| f.is_finite() && *f > 0.0);
    let port = |s: &str| s.parse::<u16>().ok().filter(|p| *p >= 1).map(f64::from);
    let whole1 = |s: &str| s.parse::<u32>().ok().filter(|n| *n >= 1).map(f64::from);

    let api_token = env_str("CYBERWAVE_API_KEY")
        .map(|(v, s)| sourced(v.trim().to_string(), s))
        .or_else(|| creds.token.clone().map(|t| sourced(t, cred_src())));
    let base_url = env_str("CYBERWAVE_BASE_URL")
        .map(|(v, s)| sourced(v.trim().trim_end_matches('/').to_string(), s))
        .or_else(|| {
            creds
                .env_value("CYBERWAVE_BASE_URL")
                .map(|v| sourced(v.trim_end_matches('/').to_string(), cred_src()))
        })
        .unwrap_or_else(|| sourced(DEFAULT_BASE_URL.to_string(), Source::Default));
    let workspace_slug = env_str("CYBERWAVE_WORKSPACE_SLUG")
        .map(|(v, s)| sourced(v.trim().to_string(), s))
        .or_else(|| creds.workspace_slug.clone().map(|w| sourced(w, cred_src())));
    // As the SDK: CYBERWAVE_MQTT_TOPIC_PREFIX, else CYBERWAVE_TOPIC_PREFIX (a blank one counts as
    // unset), else derived from CYBERWAVE_ENVIRONMENT.
    let explicit_prefix = |name: &str| env_str(name).filter(|(v, _)| !v.trim().is_empty());
    let explicit = ["CYBERWAVE_MQTT_TOPIC_PREFIX", "CYBERWAVE_TOPIC_PREFIX"]
        .into_iter()
        .find_map(|name| explicit_prefix(name).map(|found| (name, found)));
    let prefix_var = explicit
        .as_ref()
        .map_or("CYBERWAVE_ENVIRONMENT", |(n, _)| *n);
    let topic_prefix = match explicit {
        Some((_, (v, s))) => sourced(v.trim().to_string(), s),
        None => {
            let (v, s) = env_str("CYBERWAVE_ENVIRONMENT")
                .or_else(|| {
                    creds
                        .env_value("CYBERWAVE_ENVIRONMENT")
                        .map(|v| (v, cred_src()))
                })
                .unwrap_or_default_with(Source::Default);
            let v = v.trim();
            let prefix = if v.eq_ignore_ascii_case("production") {
                ""
            } else {
                v
            };
            sourced(prefix.to_string(), s)
        }
    };
    if let Err(e) = check_topic_prefix(&topic_prefix.value) {
        errors.push(format!("{prefix_var} ({}) {e}", topic_prefix.source));
    }

    let identity_path = config_dir.value.join("instance_identity.json");
    let identity = match Identity::load(&identity_path) {
        Ok(i) => i,
        Err(e) => {
            log::warn!("{e}; the node will register a new instance");
            None
        }
    };
    let instance_uuid = env_str("CYBERWAVE_CLOUD_NODE_INSTANCE_UUID")
        .map(|(v, s)| sourced(v.trim().to_string(), s))
        .or_else(|| {
            identity
                .as_ref()
                .map(|i| sourced(i.uuid.clone(), Source::Identity(identity_path.clone())))
        });
    let slug_hint = flags
        .slug
        .clone()
        .map(|s| sourced(s, Source::Flag("--slug".into())))
        .or_else(|| {
            env_str("CYBERWAVE_INSTANCE_SLUG").map(|(v, s)| sourced(v.trim().to_string(), s))
        })
        .or_else(|| {
            identity
                .as_ref()
                .filter(|i| !i.slug.is_empty())
                .map(|i| sourced(i.slug.clone(), Source::Identity(identity_path.clone())))
        });
    let profile_slug = flags
        .profile
        .clone()
        .map(|s| sourced(s, Source::Flag("--profile".into())))
        .or_else(|| {
            m.profile_slug
                .clone()
                .map(|s| sourced(s, file_of("profile_slug")))
        })
        .or_else(|| {
            env_str("CYBERWAVE_PROFILE_SLUG").map(|(v, s)| sourced(v.trim().to_string(), s))
        })
        .unwrap_or_else(|| sourced("default".into(), Source::Default));

    // Command templates: the env vars override the file (see the module docs).
    let command = |var: &str, from_file: &Option<String>, key: &str| {
        env_str(var)
            .map(|(v, s)| sourced(v, s))
            .or_else(|| from_file.clone().map(|v| sourced(v, file_of(key))))
    };
    let install_key = if m.section_of("install").is_some() {
        "install"
    } else {
        "install_script"
    };
    let install = command("CYBERWAVE_INSTALL_SCRIPT", &m.install, install_key);
    let inference = command("CYBERWAVE_INFERENCE_CMD", &m.inference, "inference");
    let simulate = command("CYBERWAVE_SIMULATE_CMD", &m.simulate, "simulate");
    let training = command("CYBERWAVE_TRAINING_CMD", &m.training, "training");

    // A number from the manifest, else from its environment variable, else the default.
    let number = |from_file: Option<f64>,
                  key: &str,
                  var: &str,
                  expected: &str,
                  parse: &dyn Fn(&str) -> Option<f64>,
                  default: f64,
                  errors: &mut Vec<String>| match from_file {
        Some(v) => sourced(v, file_of(key)),
        None => parse_env(var, expected, errors, parse)
            .unwrap_or_else(|| sourced(default, Source::Default)),
    };
    let secs = |n: Sourced<f64>| sourced(crate::util::secs_f64(n.value), n.source);
    let heartbeat_interval = secs(number(
        m.heartbeat_interval,
        "heartbeat_interval",
        "CYBERWAVE_HEARTBEAT_INTERVAL",
        "a number of seconds greater than 0",
        &pos_secs,
        30.0,
        &mut errors,
    ));

    let mqtt_host = flags
        .mqtt_host
        .clone()
        .map(|h| sourced(h, Source::Flag("--mqtt-host".into())))
        .or_else(|| {
            m.mqtt_host
                .clone()
                .map(|h| sourced(h, file_of("mqtt_host")))
        })
        .or_else(|| env_str("CYBERWAVE_MQTT_HOST").map(|(v, s)| sourced(v.trim().to_string(), s)))
        .or_else(|| {
            creds
                .env_value("CYBERWAVE_MQTT_HOST")
                .map(|v| sourced(v, cred_src()))
        })
        .unwrap_or_else(|| sourced(DEFAULT_MQTT_HOST.into(), Source::Default));
    let mqtt_port = match (flags.mqtt_port, m.mqtt_port) {
        (Some(p), _) => sourced(p, Source::Flag("--mqtt-port".into())),
        (None, Some(p)) => sourced(p, file_of("mqtt_port")),
        (None, None) => match parse_env(
            "CYBERWAVE_MQTT_PORT",
            "a whole number from 1 to 65535",
            &mut errors,
            &port,
        ) {
            Some(p) => sourced(p.value as u16, p.source),
            None => match creds.env_value("CYBERWAVE_MQTT_PORT") {
                Some(v) => match v.trim().parse::<u16>() {
                    Ok(p) if p >= 1 => sourced(p, cred_src()),
                    _ => {
                        errors.push(format!(
                            "CYBERWAVE_MQTT_PORT in {}: expected a whole number from 1 to 65535, got {v:?}",
                            creds.path.display()
                        ));
                        sourced(DEFAULT_MQTT_PORT, Source::Default)
                    }
                },
                None => sourced(DEFAULT_MQTT_PORT, Source::Default),
            },
        },
    };
    // Several broker addresses may be listed (host[:port], comma-separated).
    if let Err(e) = crate::mqtt::parse_endpoints(&mqtt_host.value, mqtt_port.value) {
        errors.push(format!("mqtt_host ({}) {e}", mqtt_host.source));
    }
    // Decision D11: an explicit switch decides; otherwise the effective port does.
    let mqtt_use_tls = match (flags.mqtt_tls, m.mqtt_use_tls) {
        (Some(t), _) => sourced(
            t,
            Source::Flag(if t { "--mqtt-tls" } else { "--no-mqtt-tls" }.into()),
        ),
        (None, Some(t)) => sourced(t, file_of("mqtt_use_tls")),
        (None, None) => match env_str("CYBERWAVE_MQTT_USE_TLS") {
            Some((v, s)) => match env::parse_bool(&v) {
                Some(b) => sourced(b, s),
                None => {
                    errors.push(format!(
                        "CYBERWAVE_MQTT_USE_TLS ({s}): expected one of 1,true,yes,on / 0,false,no,off, got {v:?}"
                    ));
                    sourced(false, s)
                }
            },
            None => sourced(
                mqtt_port.value == 8883,
                Source::Derived(format!(
                    "port {} {} 8883",
                    mqtt_port.value,
                    if mqtt_port.value == 8883 {
                        "is"
                    } else {
                        "is not"
                    }
                )),
            ),
        },
    };
    let mqtt_ca_certs = m
        .mqtt_tls_ca_certs
        .clone()
        .map(|p| sourced(p, file_of("mqtt_tls_ca_certs")))
        .or_else(|| {
            env_str("CYBERWAVE_MQTT_TLS_CA_CERTS").map(|(v, s)| sourced(v.trim().to_string(), s))
        })
        .map(|s| sourced(working_dir.join(s.value), s.source));
    let mqtt_username = m
        .mqtt_username
        .clone()
        .filter(|s| !s.is_empty())
        .map(|v| sourced(v, file_of("mqtt_username")))
        .or_else(|| env_str("CYBERWAVE_MQTT_USERNAME").map(|(v, s)| sourced(v, s)));
    let broker_password = m
        .mqtt_password
        .clone()
        .filter(|s| !s.is_empty())
        .map(|v| sourced(v, file_of("mqtt_password")))
        .or_else(|| env_str("CYBERWAVE_MQTT_PASSWORD").map(|(v, s)| sourced(v, s)));
    // The newest SDK's rule (ecosystem §2.2, credentials::derived_mqtt_username): its placeholder
    // username becomes `cwh_` + hex SHA-256 of the token, which the broker checks at CONNECT.
    // Opt-in: only the placeholder triggers it; any other username is used as it is.
    let mqtt_username = mqtt_username.map(|u| {
        match credentials::derived_mqtt_username(
            &u.value,
            broker_password.as_ref().map(|p| p.value.as_str()),
            api_token.as_ref().map(|t| t.value.as_str()),
        ) {
            Some(derived) => sourced(
                derived,
                Source::Derived(format!(
                    "{MQTT_USERNAME_PLACEHOLDER} ({}) + token",
                    u.source
                )),
            ),
            None => u,
        }
    });
    let mqtt_password = broker_password.or_else(|| api_token.clone());

    let upload_results = match m.upload_results {
        Some(b) => sourced(b, file_of("upload_results")),
        None => match env_str("CYBERWAVE_UPLOAD_RESULTS") {
            Some((v, s)) => match env::parse_bool(&v) {
                Some(b) => sourced(b, s),
                None => {
                    errors.push(format!(
                        "CYBERWAVE_UPLOAD_RESULTS ({s}): expected true or false, got {v:?}"
                    ));
                    sourced(true, s)
                }
            },
            None => sourced(true, Source::Default),
        },
    };
    let results_folder = m
        .results_folder
        .clone()
        .map(|f| sourced(f, file_of("results_folder")))
        .or_else(|| {
            env_str("CYBERWAVE_RESULTS_FOLDER").map(|(v, s)| sourced(v.trim().to_string(), s))
        })
        .unwrap_or_else(|| sourced("/results".into(), Source::Default));
    let results_folder = sourced(
        working_dir.join(&results_folder.value),
        results_folder.source,
    );

    let environment_uuid = flags
        .environment
        .clone()
        .filter(|s| !s.trim().is_empty())
        .map(|e| sourced(e, Source::Flag("--environment".into())))
        .or_else(|| {
            m.environment_uuid
                .clone()
                .map(|e| sourced(e, file_of("environment_uuid")))
        })
        .or_else(|| {
            env_str("CYBERWAVE_NODE_ENVIRONMENT_UUID")
                .map(|(v, s)| sourced(v.trim().to_string(), s))
        });

    let n = number(
        m.max_concurrent_workloads.map(f64::from),
        "max_concurrent_workloads",
        "CYBERWAVE_MAX_CONCURRENT_WORKLOADS",
        "a whole number ≥ 1",
        &whole1,
        1.0,
        &mut errors,
    );
    let max_concurrent_workloads = sourced(n.value as u32, n.source);
    let log_stream_interval = parse_env(
        "CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL",
        "a number of seconds greater than 0",
        &mut errors,
        &pos_secs,
    )
    .map(|s| sourced(crate::util::secs_f64(s.value), s.source))
    .unwrap_or_else(|| sourced(Duration::from_secs(3), Source::Default));

    let whole0 = |s: &str| s.parse::<u64>().ok().map(|n| n as f64);
    let n = number(
        m.min_free_disk_mb.map(|v| v as f64),
        "min_free_disk_mb",
        "CYBERWAVE_MIN_FREE_DISK_MB",
        "a whole number ≥ 0",
        &whole0,
        1024.0,
        &mut errors,
    );
    let min_free_disk_mb = sourced(n.value as u64, n.source);
    let whole1_u64 = |s: &str| s.parse::<u64>().ok().filter(|n| *n >= 1).map(|n| n as f64);
    let n = number(
        m.max_log_bytes.map(|v| v as f64),
        "max_log_bytes",
        "CYBERWAVE_MAX_LOG_BYTES",
        "a whole number ≥ 1",
        &whole1_u64,
        (1u64 << 30) as f64,
        &mut errors,
    );
    let max_log_bytes = sourced(n.value as u64, n.source);
    let n = number(
        m.log_retention_days.map(|v| v as f64),
        "log_retention_days",
        "CYBERWAVE_LOG_RETENTION_DAYS",
        "a whole number of days ≥ 0 (0 keeps logs forever)",
        &whole0,
        14.0,
        &mut errors,
    );
    let log_retention_days = sourced(n.value as u64, n.source);
    let metrics_file = flags
        .metrics_file
        .clone()
        .map(|p| sourced(p, Source::Flag("--metrics-file".into())))
        .or_else(|| {
            env_str("CYBERWAVE_METRICS_FILE").map(|(v, s)| sourced(PathBuf::from(v.trim()), s))
        })
        .map(|s| sourced(cwd.join(s.value), s.source));
    let hardware_telemetry = match env_str("CYBERWAVE_HARDWARE_TELEMETRY") {
        Some((v, src)) => match env::parse_bool(&v) {
            Some(b) => b,
            None => {
                errors.push(format!("CYBERWAVE_HARDWARE_TELEMETRY ({src}): expected 1/true/on or 0/false/off, got {v:?}"));
                false
            }
        },
        None => false,
    };

    let mut tuning = Tuning::default();
    {
        let mut knob = |name: &str, slot: &mut Duration| {
            if let Some(s) = parse_env(
                name,
                "a number of seconds greater than 0",
                &mut errors,
                &pos_secs,
            ) {
                *slot = crate::util::secs_f64(s.value);
            }
        };
        knob(
            "CYBERWAVE_NODE_RECONNECT_BASE_SECONDS",
            &mut tuning.reconnect_base,
        );
        knob(
            "CYBERWAVE_NODE_RECONNECT_MAX_SECONDS",
            &mut tuning.reconnect_max,
        );
        knob(
            "CYBERWAVE_NODE_REGISTER_RETRY_MAX_SECONDS",
            &mut tuning.register_retry_max,
        );
        knob(
            "CYBERWAVE_NODE_HEARTBEAT_TIMEOUT_SECONDS",
            &mut tuning.heartbeat_timeout,
        );
        knob(
            "CYBERWAVE_NODE_AUTH_RETRY_BASE_SECONDS",
            &mut tuning.auth_retry_base,
        );
        knob(
            "CYBERWAVE_NODE_SESSION_EXPIRY_SECONDS",
            &mut tuning.session_expiry,
        );
        knob(
            "CYBERWAVE_NODE_CONNECT_TIMEOUT_SECONDS",
            &mut tuning.connect_timeout,
        );
        knob(
            "CYBERWAVE_NODE_TOKEN_CHECK_TIMEOUT_SECONDS",
            &mut tuning.token_check_timeout,
        );
        knob(
            "CYBERWAVE_NODE_SHUTDOWN_FLUSH_SECONDS",
            &mut tuning.shutdown_flush,
        );
        knob(
            "CYBERWAVE_NODE_REQUEST_TIMEOUT_SECONDS",
            &mut tuning.request_timeout,
        );
        knob(
            "CYBERWAVE_NODE_CLEANUP_GRACE_SECONDS",
            &mut tuning.cleanup_grace,
        );
        knob(
            "CYBERWAVE_NODE_METRICS_INTERVAL_SECONDS",
            &mut tuning.metrics_interval,
        );
        knob("CYBERWAVE_NODE_LOCK_WAIT_SECONDS", &mut tuning.lock_wait);
    }

    if !errors.is_empty() {
        return Err(ConfigError(errors));
    }
    Ok(Settings {
        config_dir,
        working_dir,
        manifest,
        manifest_warnings,
        manifest_platform_refusals,
        api_token,
        base_url,
        workspace_slug,
        topic_prefix,
        instance_uuid,
        slug_hint,
        profile_slug,
        install,
        inference,
        simulate,
        training,
        heartbeat_interval,
        mqtt_host,
        mqtt_port,
        mqtt_use_tls,
        mqtt_ca_certs,
        mqtt_username,
        mqtt_password,
        upload_results,
        results_folder,
        environment_uuid,
        max_concurrent_workloads,
        log_stream_interval,
        standalone: flags.standalone,
        drain_after_one: flags.drain_after_one,
        metrics_file,
        min_free_disk_mb,
        max_log_bytes,
        log_retention_days,
        hardware_telemetry,
        identity,
        tuning,
        env,
    })
}

trait OrDefaultWith {
    fn unwrap_or_default_with(self, s: Source) -> (String, Source);
}

impl OrDefaultWith for Option<(String, Source)> {
    fn unwrap_or_default_with(self, s: Source) -> (String, Source) {
        self.unwrap_or((String::new(), s))
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
            _ => Err(format!("uid {uid} has no passwd entry")),
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
