//! [`resolve`]: every setting, one group at a time. A [`Resolver`] holds what every group reads
//! (flags, the merged environment, the manifest, `credentials.json`) and collects the problems;
//! each group is one method, run in the order the problems are reported in.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::credentials::{self, Credentials, Identity};
use super::env::{self, EnvLayers};
use super::manifest::{self, Manifest, Problem};
use super::{
    check_topic_prefix, config_dir, sourced, ConfigError, Flags, Settings, Source, Sourced, Tuning,
    DEFAULT_BASE_URL, DEFAULT_MQTT_HOST, DEFAULT_MQTT_PORT, MQTT_USERNAME_PLACEHOLDER,
};

/// What `resolve` reads for every group, and the problems found so far (one line each).
struct Resolver<'a> {
    flags: &'a Flags,
    env: EnvLayers,
    /// The manifest read, or an empty one (every value unset).
    m: Manifest,
    creds: Credentials,
    working_dir: PathBuf,
    cwd: &'a Path,
    errors: Vec<String>,
}

/// The manifest found (if any), with what `start` can live with (D22).
struct ManifestGroup {
    manifest: Option<Manifest>,
    warnings: Vec<Problem>,
    platform_refusals: usize,
}

/// Where the platform is and who the node is to it.
struct Platform {
    api_token: Option<Sourced<String>>,
    base_url: Sourced<String>,
    workspace_slug: Option<Sourced<String>>,
    topic_prefix: Sourced<String>,
}

/// The instance's identity and profile.
struct Instance {
    identity: Option<Identity>,
    instance_uuid: Option<Sourced<String>>,
    slug_hint: Option<Sourced<String>>,
    profile_slug: Sourced<String>,
    environment_uuid: Option<Sourced<String>>,
}

/// The command templates.
struct Commands {
    install: Option<Sourced<String>>,
    inference: Option<Sourced<String>>,
    simulate: Option<Sourced<String>>,
    training: Option<Sourced<String>>,
}

/// A broker username and password, each when there is one.
type Login = (Option<Sourced<String>>, Option<Sourced<String>>);

/// The broker and how to log in to it.
struct Broker {
    mqtt_host: Sourced<String>,
    mqtt_port: Sourced<u16>,
    mqtt_use_tls: Sourced<bool>,
    mqtt_ca_certs: Option<Sourced<PathBuf>>,
    mqtt_username: Option<Sourced<String>>,
    mqtt_password: Option<Sourced<String>>,
    /// The login as the operator wrote it: the username before the SDK's placeholder is
    /// derived, the password before it falls back to the API token.
    operator_login: Login,
}

/// Where results go.
struct Results {
    upload_results: Sourced<bool>,
    results_folder: Sourced<PathBuf>,
}

/// Capacity, logs and metrics.
struct Limits {
    max_concurrent_workloads: Sourced<u32>,
    log_stream_interval: Sourced<Duration>,
    min_free_disk_mb: Sourced<u64>,
    max_log_bytes: Sourced<u64>,
    log_retention_days: Sourced<u64>,
    metrics_file: Option<Sourced<PathBuf>>,
    hardware_telemetry: bool,
}

const POSITIVE_SECONDS: &str = "a number of seconds greater than 0";
const WHOLE_BYTES: &str = "a whole number of bytes, at least 1";

fn pos_secs(s: &str) -> Option<f64> {
    s.parse::<f64>().ok().filter(|f| f.is_finite() && *f > 0.0)
}
fn port(s: &str) -> Option<f64> {
    s.parse::<u16>().ok().filter(|p| *p >= 1).map(f64::from)
}
fn whole1(s: &str) -> Option<f64> {
    s.parse::<u32>().ok().filter(|n| *n >= 1).map(f64::from)
}
fn whole0(s: &str) -> Option<f64> {
    s.parse::<u64>().ok().map(|n| n as f64)
}
fn whole1_u64(s: &str) -> Option<f64> {
    s.parse::<u64>().ok().filter(|n| *n >= 1).map(|n| n as f64)
}
fn secs(n: Sourced<f64>) -> Sourced<Duration> {
    sourced(crate::util::secs_f64(n.value), n.source)
}
fn trimmed((v, s): (String, Source)) -> Sourced<String> {
    sourced(v.trim().to_string(), s)
}

/// Resolves every setting. `process` is the process environment; `cwd` the current directory.
pub fn resolve(flags: &Flags, process: EnvLayers, cwd: &Path) -> Result<Settings, ConfigError> {
    // The manifest path: --config, else CYBERWAVE_MANIFEST (for services, which take no flags).
    let mut flags = flags.clone();
    if flags.config.is_none() {
        flags.config = process.value("CYBERWAVE_MANIFEST").map(PathBuf::from);
    }
    let flags = &flags;
    let config_dir = config_dir(&process)?;
    let working_dir = working_dir(flags, cwd);
    let mut errors = Vec::new();
    let mut env = process;
    // Every file in it is out of reach: that is the problem to name, not its `.env` or identity.
    if let Some(why) = unsearchable(&config_dir.value) {
        return Err(ConfigError(vec![why]));
    }
    for path in [working_dir.join(".env"), config_dir.value.join(".env")] {
        if let Err(e) = env.add_dotenv(&path) {
            errors.push(e.to_string());
        }
    }
    let found = manifest_group(flags, cwd, &mut errors);
    let mut r = Resolver {
        flags,
        env,
        m: found.manifest.clone().unwrap_or_default(),
        creds: Credentials::load(&config_dir.value.join("credentials.json")),
        working_dir,
        cwd,
        errors,
    };
    let platform = r.platform();
    let instance = r.instance(&config_dir.value.join("instance_identity.json"));
    let commands = r.commands();
    let template_warnings = template_warnings(&commands);
    let heartbeat_interval = secs(r.number(
        r.m.heartbeat_interval,
        "heartbeat_interval",
        "CYBERWAVE_HEARTBEAT_INTERVAL",
        POSITIVE_SECONDS,
        &pos_secs,
        30.0,
    ));
    let broker = r.broker(platform.api_token.as_ref());
    let workload_connection = r.workload_connection(&platform, &broker);
    let results = r.results();
    let limits = r.limits();
    let tuning = r.tuning();
    if !r.errors.is_empty() {
        return Err(ConfigError(r.errors));
    }
    Ok(Settings {
        config_dir,
        working_dir: r.working_dir,
        manifest: found.manifest,
        manifest_warnings: found.warnings,
        manifest_platform_refusals: found.platform_refusals,
        template_warnings,
        api_token: platform.api_token,
        base_url: platform.base_url,
        workspace_slug: platform.workspace_slug,
        topic_prefix: platform.topic_prefix,
        instance_uuid: instance.instance_uuid,
        slug_hint: instance.slug_hint,
        profile_slug: instance.profile_slug,
        install: commands.install,
        inference: commands.inference,
        simulate: commands.simulate,
        training: commands.training,
        heartbeat_interval,
        mqtt_host: broker.mqtt_host,
        mqtt_port: broker.mqtt_port,
        mqtt_use_tls: broker.mqtt_use_tls,
        mqtt_ca_certs: broker.mqtt_ca_certs,
        mqtt_username: broker.mqtt_username,
        mqtt_password: broker.mqtt_password,
        workload_connection,
        upload_results: results.upload_results,
        results_folder: results.results_folder,
        environment_uuid: instance.environment_uuid,
        max_concurrent_workloads: limits.max_concurrent_workloads,
        log_stream_interval: limits.log_stream_interval,
        standalone: flags.standalone,
        drain_after_one: flags.drain_after_one,
        metrics_file: limits.metrics_file,
        min_free_disk_mb: limits.min_free_disk_mb,
        max_log_bytes: limits.max_log_bytes,
        log_retention_days: limits.log_retention_days,
        hardware_telemetry: limits.hardware_telemetry,
        identity: instance.identity,
        tuning,
        env: r.env,
    })
}

/// Why this user cannot reach into the state dir (a container's volume owned by root, run with
/// `--user`), when it cannot; `None` when it can, or when the dir does not exist yet.
fn unsearchable(dir: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    // Opening `<dir>/.` needs the search permission of the dir itself.
    let err = std::fs::metadata(dir.join(".")).err()?;
    if err.kind() != std::io::ErrorKind::PermissionDenied {
        return None;
    }
    let me = crate::util::euid();
    let owner = std::fs::metadata(dir).map_or_else(
        |_| String::new(),
        |m| {
            format!(
                " (owned by uid {}, mode {:03o})",
                m.uid(),
                m.mode() & 0o7777
            )
        },
    );
    Some(format!(
        "the state dir {} cannot be read or written by this user (uid {me}){owner}: run the node as its owner, `chown -R {me} {}`, or give it a dir of its own (CYBERWAVE_EDGE_CONFIG_DIR; in a container, a state volume this user owns)",
        dir.display(),
        dir.display()
    ))
}

/// D63 for the templates the environment sets (`CYBERWAVE_*_CMD`): the manifest's own are
/// checked with the manifest. One line each, for the start-up log and `config`.
fn template_warnings(c: &Commands) -> Vec<String> {
    let mut out = Vec::new();
    for (kind, t) in [
        ("inference", &c.inference),
        ("simulate", &c.simulate),
        ("training", &c.training),
    ] {
        let Some(t) = t
            .as_ref()
            .filter(|t| matches!(t.source, Source::Env(_) | Source::DotEnv(..)))
        else {
            continue;
        };
        for w in super::template::warnings(&t.value) {
            out.push(format!("{}: warning: {kind}: {w}", t.source));
        }
    }
    out
}

/// The manifest's directory (relative paths in it are relative to it), else the current one.
fn working_dir(flags: &Flags, cwd: &Path) -> PathBuf {
    match &flags.config {
        Some(p) => {
            let parent = p.parent().filter(|p| !p.as_os_str().is_empty());
            let parent = parent
                .map(|p| cwd.join(p))
                .unwrap_or_else(|| cwd.to_path_buf());
            parent.canonicalize().unwrap_or(parent)
        }
        None => cwd.to_path_buf(),
    }
}

/// Finds and checks the manifest. `start` runs whatever it can use (D22): a problem it can live
/// with is a warning; any other is an error.
fn manifest_group(flags: &Flags, cwd: &Path, errors: &mut Vec<String>) -> ManifestGroup {
    let mut found = ManifestGroup {
        manifest: None,
        warnings: Vec::new(),
        platform_refusals: 0,
    };
    match manifest::locate(flags.config.as_deref(), cwd) {
        Ok(Some((path, text))) => {
            let checked = manifest::check(&path, &text, flags.lenient);
            for mut p in checked.problems {
                if p.start_ok {
                    if !p.warning {
                        found.platform_refusals = found.platform_refusals.saturating_add(1);
                    }
                    p.warning = true;
                    found.warnings.push(p);
                } else {
                    errors.push(p.to_string());
                }
            }
            found.manifest = checked.manifest;
        }
        Ok(None) => {}
        Err(e) => errors.push(e.to_string()),
    }
    found
}

impl Resolver<'_> {
    /// A manifest value's source names the section it came from (D23: `cloud_node:` or the
    /// wrapper; `cloud_node:` wins when both set a node setting).
    fn file_of(&self, key: &str) -> Source {
        match self.m.section_of(key) {
            Some(section) => Source::Manifest(self.m.path.clone(), section.to_string()),
            None => Source::File(self.m.path.clone()),
        }
    }

    fn cred_src(&self) -> Source {
        Source::Credentials(self.creds.path.clone())
    }

    fn env_str(&self, name: &str) -> Option<(String, Source)> {
        self.env.get(name)
    }

    /// A number from an environment variable; a value `parse` refuses is a problem.
    fn parse_env(
        &mut self,
        name: &str,
        expected: &str,
        parse: &dyn Fn(&str) -> Option<f64>,
    ) -> Option<Sourced<f64>> {
        let (v, src) = self.env.get(name)?;
        match parse(v.trim()) {
            Some(n) => Some(sourced(n, src)),
            None => {
                self.errors
                    .push(format!("{name} ({src}): expected {expected}, got {v:?}"));
                None
            }
        }
    }

    /// A number from the manifest, else from its environment variable, else the default.
    fn number(
        &mut self,
        from_file: Option<f64>,
        key: &str,
        var: &str,
        expected: &str,
        parse: &dyn Fn(&str) -> Option<f64>,
        default: f64,
    ) -> Sourced<f64> {
        match from_file {
            Some(v) => sourced(v, self.file_of(key)),
            None => self
                .parse_env(var, expected, parse)
                .unwrap_or_else(|| sourced(default, Source::Default)),
        }
    }

    /// A switch from an environment variable; a value that is no switch is a problem.
    fn env_bool(&mut self, var: &str, expected: &str) -> Option<Result<Sourced<bool>, Source>> {
        let (v, s) = self.env_str(var)?;
        Some(match env::parse_bool(&v) {
            Some(b) => Ok(sourced(b, s)),
            None => {
                self.errors
                    .push(format!("{var} ({s}): expected {expected}, got {v:?}"));
                Err(s)
            }
        })
    }

    fn platform(&mut self) -> Platform {
        let api_token = self.env_str("CYBERWAVE_API_KEY").map(trimmed).or_else(|| {
            self.creds
                .token
                .clone()
                .map(|t| sourced(t, self.cred_src()))
        });
        let base_url = self
            .env_str("CYBERWAVE_BASE_URL")
            .map(|(v, s)| sourced(v.trim().trim_end_matches('/').to_string(), s))
            .or_else(|| {
                self.creds
                    .env_value("CYBERWAVE_BASE_URL")
                    .map(|v| sourced(v.trim_end_matches('/').to_string(), self.cred_src()))
            })
            .unwrap_or_else(|| sourced(DEFAULT_BASE_URL.to_string(), Source::Default));
        let workspace_slug = self
            .env_str("CYBERWAVE_WORKSPACE_SLUG")
            .map(trimmed)
            .or_else(|| {
                self.creds
                    .workspace_slug
                    .clone()
                    .map(|w| sourced(w, self.cred_src()))
            });
        Platform {
            api_token,
            base_url,
            workspace_slug,
            topic_prefix: self.topic_prefix(),
        }
    }

    /// As the SDK: CYBERWAVE_MQTT_TOPIC_PREFIX, else CYBERWAVE_TOPIC_PREFIX (a blank one counts
    /// as unset), else derived from CYBERWAVE_ENVIRONMENT.
    fn topic_prefix(&mut self) -> Sourced<String> {
        let explicit = ["CYBERWAVE_MQTT_TOPIC_PREFIX", "CYBERWAVE_TOPIC_PREFIX"]
            .into_iter()
            .find_map(|name| {
                self.env_str(name)
                    .filter(|(v, _)| !v.trim().is_empty())
                    .map(|found| (name, found))
            });
        let prefix_var = explicit
            .as_ref()
            .map_or("CYBERWAVE_ENVIRONMENT", |(n, _)| *n);
        let topic_prefix = match explicit {
            Some((_, found)) => trimmed(found),
            None => {
                let (v, s) = self
                    .env_str("CYBERWAVE_ENVIRONMENT")
                    .or_else(|| {
                        self.creds
                            .env_value("CYBERWAVE_ENVIRONMENT")
                            .map(|v| (v, self.cred_src()))
                    })
                    .unwrap_or((String::new(), Source::Default));
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
            self.errors
                .push(format!("{prefix_var} ({}) {e}", topic_prefix.source));
        }
        topic_prefix
    }

    fn instance(&mut self, identity_path: &Path) -> Instance {
        let identity = match Identity::load(identity_path) {
            Ok(i) => i,
            Err(e) => {
                log::warn!("{e}; the node will register a new instance");
                None
            }
        };
        let from_identity =
            |v: &str| sourced(v.to_string(), Source::Identity(identity_path.into()));
        let instance_uuid = self
            .env_str("CYBERWAVE_CLOUD_NODE_INSTANCE_UUID")
            .map(trimmed)
            .or_else(|| identity.as_ref().map(|i| from_identity(&i.uuid)));
        let slug_hint = self
            .flags
            .slug
            .clone()
            .map(|s| sourced(s, Source::Flag("--slug".into())))
            .or_else(|| self.env_str("CYBERWAVE_INSTANCE_SLUG").map(trimmed))
            .or_else(|| {
                identity
                    .as_ref()
                    .filter(|i| !i.slug.is_empty())
                    .map(|i| from_identity(&i.slug))
            });
        let profile_slug = self
            .flags
            .profile
            .clone()
            .map(|s| sourced(s, Source::Flag("--profile".into())))
            .or_else(|| {
                self.m
                    .profile_slug
                    .clone()
                    .map(|s| sourced(s, self.file_of("profile_slug")))
            })
            .or_else(|| self.env_str("CYBERWAVE_PROFILE_SLUG").map(trimmed))
            .unwrap_or_else(|| sourced("default".into(), Source::Default));
        let environment_uuid = self
            .flags
            .environment
            .clone()
            .filter(|s| !s.trim().is_empty())
            .map(|e| sourced(e, Source::Flag("--environment".into())))
            .or_else(|| {
                self.m
                    .environment_uuid
                    .clone()
                    .map(|e| sourced(e, self.file_of("environment_uuid")))
            })
            .or_else(|| self.env_str("CYBERWAVE_NODE_ENVIRONMENT_UUID").map(trimmed));
        Instance {
            identity,
            instance_uuid,
            slug_hint,
            profile_slug,
            environment_uuid,
        }
    }

    /// Command templates: the env vars override the file (see the module docs).
    fn commands(&self) -> Commands {
        let command = |var: &str, from_file: &Option<String>, key: &str| {
            self.env_str(var)
                .map(|(v, s)| sourced(v, s))
                .or_else(|| from_file.clone().map(|v| sourced(v, self.file_of(key))))
        };
        let install_key = if self.m.section_of("install").is_some() {
            "install"
        } else {
            "install_script"
        };
        Commands {
            install: command("CYBERWAVE_INSTALL_SCRIPT", &self.m.install, install_key),
            inference: command("CYBERWAVE_INFERENCE_CMD", &self.m.inference, "inference"),
            simulate: command("CYBERWAVE_SIMULATE_CMD", &self.m.simulate, "simulate"),
            training: command("CYBERWAVE_TRAINING_CMD", &self.m.training, "training"),
        }
    }

    fn broker(&mut self, api_token: Option<&Sourced<String>>) -> Broker {
        let mqtt_host = self.mqtt_host();
        let mqtt_port = self.mqtt_port();
        // Several broker addresses may be listed (host[:port], comma-separated).
        if let Err(e) = crate::mqtt::parse_endpoints(&mqtt_host.value, mqtt_port.value) {
            self.errors
                .push(format!("mqtt_host ({}) {e}", mqtt_host.source));
        }
        let mqtt_use_tls = self.mqtt_use_tls(mqtt_port.value);
        let mqtt_ca_certs = self
            .m
            .mqtt_tls_ca_certs
            .clone()
            .map(|p| sourced(p, self.file_of("mqtt_tls_ca_certs")))
            .or_else(|| self.env_str("CYBERWAVE_MQTT_TLS_CA_CERTS").map(trimmed))
            .map(|s| sourced(self.working_dir.join(s.value), s.source));
        let ((mqtt_username, mqtt_password), operator_login) = self.mqtt_login(api_token);
        Broker {
            mqtt_host,
            mqtt_port,
            mqtt_use_tls,
            mqtt_ca_certs,
            mqtt_username,
            mqtt_password,
            operator_login,
        }
    }

    fn mqtt_host(&self) -> Sourced<String> {
        self.flags
            .mqtt_host
            .clone()
            .map(|h| sourced(h, Source::Flag("--mqtt-host".into())))
            .or_else(|| {
                self.m
                    .mqtt_host
                    .clone()
                    .map(|h| sourced(h, self.file_of("mqtt_host")))
            })
            .or_else(|| self.env_str("CYBERWAVE_MQTT_HOST").map(trimmed))
            .or_else(|| {
                self.creds
                    .env_value("CYBERWAVE_MQTT_HOST")
                    .map(|v| sourced(v, self.cred_src()))
            })
            .unwrap_or_else(|| sourced(DEFAULT_MQTT_HOST.into(), Source::Default))
    }

    fn mqtt_port(&mut self) -> Sourced<u16> {
        const EXPECTED: &str = "a whole number from 1 to 65535";
        if let Some(p) = self.flags.mqtt_port {
            return sourced(p, Source::Flag("--mqtt-port".into()));
        }
        if let Some(p) = self.m.mqtt_port {
            return sourced(p, self.file_of("mqtt_port"));
        }
        if let Some(p) = self.parse_env("CYBERWAVE_MQTT_PORT", EXPECTED, &port) {
            return sourced(p.value as u16, p.source);
        }
        match self.creds.env_value("CYBERWAVE_MQTT_PORT") {
            Some(v) => match v.trim().parse::<u16>() {
                Ok(p) if p >= 1 => sourced(p, self.cred_src()),
                _ => {
                    self.errors.push(format!(
                        "CYBERWAVE_MQTT_PORT in {}: expected {EXPECTED}, got {v:?}",
                        self.creds.path.display()
                    ));
                    sourced(DEFAULT_MQTT_PORT, Source::Default)
                }
            },
            None => sourced(DEFAULT_MQTT_PORT, Source::Default),
        }
    }

    /// Decision D11: an explicit switch decides; otherwise the effective port does.
    fn mqtt_use_tls(&mut self, port: u16) -> Sourced<bool> {
        if let Some(t) = self.flags.mqtt_tls {
            let flag = if t { "--mqtt-tls" } else { "--no-mqtt-tls" };
            return sourced(t, Source::Flag(flag.into()));
        }
        if let Some(t) = self.m.mqtt_use_tls {
            return sourced(t, self.file_of("mqtt_use_tls"));
        }
        match self.env_bool(
            "CYBERWAVE_MQTT_USE_TLS",
            "one of 1,true,yes,on / 0,false,no,off",
        ) {
            Some(Ok(b)) => b,
            Some(Err(s)) => sourced(false, s),
            None => sourced(
                port == 8883,
                Source::Derived(format!(
                    "port {port} {} 8883",
                    if port == 8883 { "is" } else { "is not" }
                )),
            ),
        }
    }

    /// The broker's username and password, and both as the operator wrote them.
    fn mqtt_login(&self, api_token: Option<&Sourced<String>>) -> (Login, Login) {
        let mqtt_username = self
            .m
            .mqtt_username
            .clone()
            .filter(|s| !s.is_empty())
            .map(|v| sourced(v, self.file_of("mqtt_username")))
            .or_else(|| {
                self.env_str("CYBERWAVE_MQTT_USERNAME")
                    .map(|(v, s)| sourced(v, s))
            });
        let broker_password = self
            .m
            .mqtt_password
            .clone()
            .filter(|s| !s.is_empty())
            .map(|v| sourced(v, self.file_of("mqtt_password")))
            .or_else(|| {
                self.env_str("CYBERWAVE_MQTT_PASSWORD")
                    .map(|(v, s)| sourced(v, s))
            });
        // The newest SDK's rule (its `credentials::derived_mqtt_username`): its
        // placeholder username becomes `cwh_` + hex SHA-256 of the token, which the broker
        // checks at CONNECT. Opt-in: only the placeholder triggers it; any other username is
        // used as it is.
        let operator_login = (mqtt_username.clone(), broker_password.clone());
        let mqtt_username = mqtt_username.map(|u| {
            match credentials::derived_mqtt_username(
                &u.value,
                broker_password.as_ref().map(|p| p.value.as_str()),
                api_token.map(|t| t.value.as_str()),
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
        let mqtt_password = broker_password.or_else(|| api_token.cloned());
        ((mqtt_username, mqtt_password), operator_login)
    }

    /// D62: the connection variables a workload gets, each only when the operator set it (a
    /// flag, the manifest, the environment or a `.env`, or `credentials.json`, which `cyberwave
    /// login` wrote for the operator), with the value the node uses. The node's built-in
    /// defaults and what it derives (TLS from the port) are left out: the workload's SDK or
    /// code works them out itself, and a workload that derives its API from
    /// `CYBERWAVE_ENVIRONMENT` (as the platform's repositories do) is not overruled by the
    /// production URL. The broker login is the operator's own, unchanged (a site broker's login
    /// must keep working); the per-workload token replaces the password at start.
    fn workload_connection(&self, p: &Platform, b: &Broker) -> BTreeMap<String, String> {
        let mut vars = BTreeMap::new();
        let mut put = |name: &str, value: String, source: &Source| {
            if !matches!(source, Source::Default | Source::Derived(_)) {
                vars.insert(name.to_string(), value);
            }
        };
        put(
            "CYBERWAVE_BASE_URL",
            p.base_url.value.clone(),
            &p.base_url.source,
        );
        put(
            "CYBERWAVE_MQTT_HOST",
            b.mqtt_host.value.clone(),
            &b.mqtt_host.source,
        );
        let port = &b.mqtt_port;
        put("CYBERWAVE_MQTT_PORT", port.value.to_string(), &port.source);
        let tls = &b.mqtt_use_tls;
        put("CYBERWAVE_MQTT_USE_TLS", tls.value.to_string(), &tls.source);
        let (user, password) = &b.operator_login;
        for (name, v) in [
            ("CYBERWAVE_MQTT_USERNAME", user),
            ("CYBERWAVE_MQTT_PASSWORD", password),
        ] {
            if let Some(v) = v {
                put(name, v.value.clone(), &v.source);
            }
        }
        let environment = self.env_str("CYBERWAVE_ENVIRONMENT").or_else(|| {
            self.creds
                .env_value("CYBERWAVE_ENVIRONMENT")
                .map(|v| (v, self.cred_src()))
        });
        if let Some((v, source)) = environment {
            put("CYBERWAVE_ENVIRONMENT", v, &source);
        }
        // D45: the broker's CA, under the node's name and the SDK's.
        if let Some(ca) = b.mqtt_ca_certs.as_ref().filter(|_| tls.value) {
            for name in ["CYBERWAVE_MQTT_TLS_CA_CERTS", "CYBERWAVE_MQTT_TLS_CA_CERT"] {
                put(name, ca.value.display().to_string(), &ca.source);
            }
        }
        vars
    }

    fn results(&mut self) -> Results {
        let upload_results = match self.m.upload_results {
            Some(b) => sourced(b, self.file_of("upload_results")),
            None => match self.env_bool("CYBERWAVE_UPLOAD_RESULTS", "true or false") {
                Some(Ok(b)) => b,
                Some(Err(s)) => sourced(true, s),
                None => sourced(true, Source::Default),
            },
        };
        let results_folder = self
            .m
            .results_folder
            .clone()
            .map(|f| sourced(f, self.file_of("results_folder")))
            .or_else(|| self.env_str("CYBERWAVE_RESULTS_FOLDER").map(trimmed))
            .unwrap_or_else(|| sourced("/results".into(), Source::Default));
        Results {
            upload_results,
            results_folder: sourced(
                self.working_dir.join(&results_folder.value),
                results_folder.source,
            ),
        }
    }

    fn limits(&mut self) -> Limits {
        let n = self.number(
            self.m.max_concurrent_workloads.map(f64::from),
            "max_concurrent_workloads",
            "CYBERWAVE_MAX_CONCURRENT_WORKLOADS",
            "a whole number ≥ 1",
            &whole1,
            1.0,
        );
        let max_concurrent_workloads = sourced(n.value as u32, n.source);
        let log_stream_interval = self
            .parse_env(
                "CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL",
                POSITIVE_SECONDS,
                &pos_secs,
            )
            .map(secs)
            .unwrap_or_else(|| sourced(Duration::from_secs(3), Source::Default));
        let min_free_disk_mb = self.whole(
            self.m.min_free_disk_mb,
            "min_free_disk_mb",
            "CYBERWAVE_MIN_FREE_DISK_MB",
            "a whole number ≥ 0",
            &whole0,
            1024.0,
        );
        let max_log_bytes = self.whole(
            self.m.max_log_bytes,
            "max_log_bytes",
            "CYBERWAVE_MAX_LOG_BYTES",
            "a whole number ≥ 1",
            &whole1_u64,
            (1u64 << 30) as f64,
        );
        let log_retention_days = self.whole(
            self.m.log_retention_days,
            "log_retention_days",
            "CYBERWAVE_LOG_RETENTION_DAYS",
            "a whole number of days ≥ 0 (0 keeps logs forever)",
            &whole0,
            14.0,
        );
        let metrics_file = self
            .flags
            .metrics_file
            .clone()
            .map(|p| sourced(p, Source::Flag("--metrics-file".into())))
            .or_else(|| {
                self.env_str("CYBERWAVE_METRICS_FILE")
                    .map(|(v, s)| sourced(PathBuf::from(v.trim()), s))
            })
            .map(|s| sourced(self.cwd.join(s.value), s.source));
        let hardware_telemetry =
            match self.env_bool("CYBERWAVE_HARDWARE_TELEMETRY", "1/true/on or 0/false/off") {
                Some(Ok(b)) => b.value,
                Some(Err(_)) | None => false,
            };
        Limits {
            max_concurrent_workloads,
            log_stream_interval,
            min_free_disk_mb,
            max_log_bytes,
            log_retention_days,
            metrics_file,
            hardware_telemetry,
        }
    }

    /// [`Resolver::number`] for a whole number.
    fn whole(
        &mut self,
        from_file: Option<u64>,
        key: &str,
        var: &str,
        expected: &str,
        parse: &dyn Fn(&str) -> Option<f64>,
        default: f64,
    ) -> Sourced<u64> {
        let n = self.number(
            from_file.map(|v| v as f64),
            key,
            var,
            expected,
            parse,
            default,
        );
        sourced(n.value as u64, n.source)
    }

    /// The timings tests shorten (env `CYBERWAVE_NODE_*_SECONDS`).
    fn tuning(&mut self) -> Tuning {
        let mut tuning = Tuning::default();
        let knobs: [(&str, &mut Duration); 11] = [
            (
                "CYBERWAVE_NODE_RECONNECT_BASE_SECONDS",
                &mut tuning.reconnect_base,
            ),
            (
                "CYBERWAVE_NODE_RECONNECT_MAX_SECONDS",
                &mut tuning.reconnect_max,
            ),
            (
                "CYBERWAVE_NODE_REGISTER_RETRY_MAX_SECONDS",
                &mut tuning.register_retry_max,
            ),
            (
                "CYBERWAVE_NODE_AUTH_RETRY_BASE_SECONDS",
                &mut tuning.auth_retry_base,
            ),
            (
                "CYBERWAVE_NODE_CONNECT_TIMEOUT_SECONDS",
                &mut tuning.connect_timeout,
            ),
            (
                "CYBERWAVE_NODE_TOKEN_CHECK_TIMEOUT_SECONDS",
                &mut tuning.token_check_timeout,
            ),
            (
                "CYBERWAVE_NODE_SHUTDOWN_FLUSH_SECONDS",
                &mut tuning.shutdown_flush,
            ),
            (
                "CYBERWAVE_NODE_REQUEST_TIMEOUT_SECONDS",
                &mut tuning.request_timeout,
            ),
            (
                "CYBERWAVE_NODE_CLEANUP_GRACE_SECONDS",
                &mut tuning.cleanup_grace,
            ),
            (
                "CYBERWAVE_NODE_METRICS_INTERVAL_SECONDS",
                &mut tuning.metrics_interval,
            ),
            ("CYBERWAVE_NODE_LOCK_WAIT_SECONDS", &mut tuning.lock_wait),
        ];
        for (name, slot) in knobs {
            if let Some(s) = self.parse_env(name, POSITIVE_SECONDS, &pos_secs) {
                *slot = crate::util::secs_f64(s.value);
            }
        }
        if let Some(s) = self.parse_env(
            "CYBERWAVE_NODE_UPLOAD_DEADLINE_SECONDS",
            POSITIVE_SECONDS,
            &pos_secs,
        ) {
            tuning.upload_deadline = Some(crate::util::secs_f64(s.value));
        }
        let bytes: [(&str, &mut u64); 2] = [
            (
                "CYBERWAVE_NODE_MIRROR_BYTES_PER_SECOND",
                &mut tuning.mirror_bytes_per_second,
            ),
            (
                "CYBERWAVE_NODE_INGRESS_QUEUE_BYTES",
                &mut tuning.ingress_queue_bytes,
            ),
        ];
        for (name, slot) in bytes {
            if let Some(n) = self.parse_env(name, WHOLE_BYTES, &whole1_u64) {
                *slot = n.value as u64;
            }
        }
        if let Some(n) =
            self.parse_env("CYBERWAVE_NODE_MAX_COMMAND_BYTES", WHOLE_BYTES, &whole1_u64)
        {
            tuning.max_command_bytes = usize::try_from(n.value as u64).unwrap_or(usize::MAX);
        }
        tuning
    }
}
