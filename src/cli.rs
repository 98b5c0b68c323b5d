//! The command line. Flags are accepted before or after the subcommand; `--flag value` and
//! `--flag=value` both work; no subcommand means `start`.

use std::path::PathBuf;

use crate::config::Flags;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Start,
    Validate,
    Config,
    InstallService,
    UninstallService,
    Emit,
    Status,
    Logs,
    Drain,
    Resume,
    Doctor,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Parsed {
    Run(Invocation),
    Help(String),
    Version,
}

#[derive(Debug, Clone)]
pub struct Invocation {
    pub command: Command,
    pub flags: Flags,
    pub verbosity: u8,
    pub json: bool,
    /// `install-service --user`: user scope.
    pub user: bool,
    /// `emit KIND` (or the id of `logs`) and the flags of `emit`.
    pub emit_kind: String,
    pub emit: std::collections::BTreeMap<String, String>,
    /// `logs -f`, `logs --stderr`, `drain --wait`, `logs -n N`.
    pub follow: bool,
    pub stderr: bool,
    pub wait: bool,
    pub lines: Option<usize>,
    /// The command line named the command (false: `start` by default, D43).
    pub explicit: bool,
}

impl PartialEq for Invocation {
    fn eq(&self, other: &Self) -> bool {
        self.command == other.command
            && self.verbosity == other.verbosity
            && format!("{:?}", self.flags) == format!("{:?}", other.flags)
    }
}

/// A usage error: one line, exit code 2.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageError(pub String);

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

const START_FLAGS: &[&str] = &[
    "--config",
    "--slug",
    "--profile",
    "--environment",
    "--mqtt-host",
    "--mqtt-port",
    "--mqtt-tls",
    "--no-mqtt-tls",
    "--standalone",
    "--lenient",
    "--drain-after-one",
    "--metrics-file",
];

/// Every command, in the order of `--help` (the man page and the completions list them).
pub const COMMANDS: &[Command] = &[
    Command::Start,
    Command::Validate,
    Command::Config,
    Command::InstallService,
    Command::UninstallService,
    Command::Emit,
    Command::Status,
    Command::Logs,
    Command::Drain,
    Command::Resume,
    Command::Doctor,
];

/// The flags `cmd` accepts (`config` takes every flag of `start`, plus `--json`).
pub fn flags_of(cmd: Command) -> Vec<&'static str> {
    let list: &[&'static str] = match cmd {
        Command::Start => START_FLAGS,
        Command::Config => return START_FLAGS.iter().copied().chain(["--json"]).collect(),
        Command::Validate => &["--config", "--lenient"],
        Command::InstallService | Command::UninstallService => &["--user"],
        Command::Emit => crate::emit::FLAGS,
        Command::Status => &["--json"],
        Command::Logs => &["--follow", "--stderr", "--lines"],
        Command::Drain => &["--wait"],
        Command::Resume => &[],
        Command::Doctor => &[
            "--config",
            "--standalone",
            "--lenient",
            "--mqtt-host",
            "--mqtt-port",
            "--mqtt-tls",
            "--no-mqtt-tls",
        ],
    };
    list.to_vec()
}

/// Whether `flag` belongs to `cmd`.
fn allowed(cmd: Command, flag: &str) -> bool {
    flags_of(cmd).contains(&flag)
}

pub fn takes_value(flag: &str) -> bool {
    matches!(
        flag,
        "--config"
            | "--slug"
            | "--profile"
            | "--environment"
            | "--mqtt-host"
            | "--mqtt-port"
            | "--metrics-file"
            | "--lines"
    ) || crate::emit::FLAGS.contains(&flag)
}

/// The command line split into its parts, before the flags are checked against the command.
struct Words {
    command: Option<Command>,
    positional: Vec<String>,
    pairs: Vec<(String, Option<String>)>,
    verbosity: u8,
    help: bool,
    /// `-V`/`--version` was seen (the words after it are not read).
    version: bool,
}

fn words(args: &[String]) -> Result<Words, UsageError> {
    let mut w = Words {
        command: None,
        positional: Vec::new(),
        pairs: Vec::new(),
        verbosity: 0,
        help: false,
        version: false,
    };
    let expanded: Vec<String> = args
        .iter()
        .map(|a| match a.as_str() {
            "-f" => "--follow".to_string(),
            "-n" => "--lines".to_string(),
            other => other.to_string(),
        })
        .collect();
    let mut it = expanded.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-h" | "--help" => w.help = true,
            "-V" | "--version" => {
                w.version = true;
                return Ok(w);
            }
            "-v" | "--verbose" => w.verbosity = w.verbosity.saturating_add(1),
            "-vv" => w.verbosity = w.verbosity.saturating_add(2),
            a if a.starts_with("--") => {
                let (name, inline) = match a.split_once('=') {
                    Some((n, v)) => (n.to_string(), Some(v.to_string())),
                    None => (a.to_string(), None),
                };
                let value = if takes_value(&name) {
                    match inline {
                        Some(v) => Some(v),
                        None => Some(
                            it.next()
                                .cloned()
                                .ok_or_else(|| UsageError(format!("{name} needs a value")))?,
                        ),
                    }
                } else if inline.is_some() {
                    return Err(UsageError(format!("{name} takes no value")));
                } else {
                    None
                };
                w.pairs.push((name, value));
            }
            a if a.starts_with('-') && a.len() > 1 => {
                return Err(UsageError(format!("unknown option {a}")))
            }
            a if w.command.is_none() && w.positional.is_empty() => {
                w.command = Some(command_named(a, &mut w.help)?);
            }
            a => w.positional.push(a.to_string()),
        }
    }
    Ok(w)
}

/// The command a word names (`help` asks for help on `start`).
fn command_named(a: &str, help: &mut bool) -> Result<Command, UsageError> {
    Ok(match a {
        "start" => Command::Start,
        "validate" => Command::Validate,
        "config" => Command::Config,
        "install-service" => Command::InstallService,
        "uninstall-service" => Command::UninstallService,
        "emit" => Command::Emit,
        "status" => Command::Status,
        "logs" => Command::Logs,
        "drain" => Command::Drain,
        "resume" => Command::Resume,
        "doctor" => Command::Doctor,
        "help" => {
            *help = true;
            Command::Start
        }
        other => {
            return Err(UsageError(format!(
                "unknown command '{other}' (commands: start, validate, config)"
            )))
        }
    })
}

pub fn parse(args: &[String]) -> Result<Parsed, UsageError> {
    let w = words(args)?;
    if w.version {
        return Ok(Parsed::Version);
    }
    let explicit = w.command.is_some();
    let command = w.command.unwrap_or(Command::Start);
    if w.help {
        return Ok(Parsed::Help(help_text(
            if explicit || !w.pairs.is_empty() {
                Some(command)
            } else {
                None
            },
        )));
    }
    let mut inv = Invocation {
        command,
        flags: Flags::default(),
        verbosity: w.verbosity,
        json: false,
        user: false,
        emit_kind: String::new(),
        emit: std::collections::BTreeMap::new(),
        follow: false,
        stderr: false,
        wait: false,
        lines: None,
        explicit,
    };
    // `validate PATH` takes the manifest path as a positional argument too; `emit KIND` its kind.
    match (command, w.positional.as_slice()) {
        (Command::Emit, [k]) if ["started", "node", "finished"].contains(&k.as_str()) => {
            inv.emit_kind = k.clone()
        }
        (Command::Emit, _) => {
            return Err(UsageError(
                "emit needs one of: started, node, finished".into(),
            ))
        }
        (Command::Logs, [id]) => inv.emit_kind = id.clone(),
        (Command::Logs, _) => return Err(UsageError("logs needs one request id or pid".into())),
        (_, []) => {}
        (Command::Validate, [p]) => inv.flags.config = Some(PathBuf::from(p)),
        (_, [p, ..]) => return Err(UsageError(format!("unexpected argument '{p}'"))),
    }
    for (name, value) in w.pairs {
        if !allowed(command, &name) {
            return Err(UsageError(format!(
                "unknown flag {name} for '{}'",
                name_of(command)
            )));
        }
        let v = value.unwrap_or_default();
        if command == Command::Emit {
            inv.emit.insert(name, v);
            continue;
        }
        set_flag(&mut inv, &name, v)?;
    }
    Ok(Parsed::Run(inv))
}

/// One flag of a command other than `emit`, already known to be allowed for it.
fn set_flag(inv: &mut Invocation, name: &str, v: String) -> Result<(), UsageError> {
    let flags = &mut inv.flags;
    match name {
        "--config" => flags.config = Some(PathBuf::from(v)),
        "--slug" => flags.slug = Some(non_empty(name, v)?),
        "--profile" => flags.profile = Some(non_empty(name, v)?),
        "--environment" => flags.environment = Some(non_empty(name, v)?),
        "--mqtt-host" => flags.mqtt_host = Some(non_empty(name, v)?),
        "--mqtt-port" => {
            flags.mqtt_port = Some(v.parse::<u16>().ok().filter(|p| *p >= 1).ok_or_else(|| {
                UsageError(format!(
                    "--mqtt-port: expected a whole number from 1 to 65535, got {v:?}"
                ))
            })?)
        }
        "--mqtt-tls" => flags.mqtt_tls = Some(true),
        "--no-mqtt-tls" => flags.mqtt_tls = Some(false),
        "--standalone" => flags.standalone = true,
        "--drain-after-one" => flags.drain_after_one = true,
        "--metrics-file" => flags.metrics_file = Some(PathBuf::from(v)),
        "--lenient" => flags.lenient = true,
        "--json" => inv.json = true,
        "--user" => inv.user = true,
        "--follow" => inv.follow = true,
        "--stderr" => inv.stderr = true,
        "--wait" => inv.wait = true,
        "--lines" => {
            inv.lines =
                Some(v.parse::<usize>().map_err(|_| {
                    UsageError(format!("-n: expected a number of lines, got {v:?}"))
                })?)
        }
        _ => return Err(UsageError(format!("unknown flag {name}"))),
    }
    Ok(())
}

fn non_empty(name: &str, v: String) -> Result<String, UsageError> {
    if v.trim().is_empty() {
        Err(UsageError(format!("{name} needs a non-empty value")))
    } else {
        Ok(v)
    }
}

pub fn name_of(c: Command) -> &'static str {
    match c {
        Command::Start => "start",
        Command::Validate => "validate",
        Command::Config => "config",
        Command::InstallService => "install-service",
        Command::UninstallService => "uninstall-service",
        Command::Emit => "emit",
        Command::Status => "status",
        Command::Logs => "logs",
        Command::Drain => "drain",
        Command::Resume => "resume",
        Command::Doctor => "doctor",
    }
}

pub fn help_text(cmd: Option<Command>) -> String {
    let start_flags = "\
  --config PATH        manifest (default ./cyberwave.yml, else ./README.md front matter);
                       its folder is the working dir of workloads and of ./.env
  --slug SLUG          slug hint for registration (the backend may assign another)
  --profile SLUG       node profile (overrides profile_slug)
  --environment UUID   reserve this node for one Cyberwave environment
  --mqtt-host HOST     broker host (overrides mqtt_host / CYBERWAVE_MQTT_HOST)
  --mqtt-port N        broker port; 8883 means TLS unless --mqtt-tls/--no-mqtt-tls says otherwise
  --mqtt-tls, --no-mqtt-tls
                       force TLS on or off
  --standalone         no Cyberwave backend: give itself a UUID, skip token check,
                       registration and heartbeats (air-gapped sites, local testing)
    --lenient            unknown manifest keys are warnings, not errors
  --drain-after-one    one-shot: exit 0 once the first workload completed
  --metrics-file PATH  write Prometheus metrics there (for node_exporter's textfile collector)
  -v, -vv              more logging (or RUST_LOG)";
    match cmd {
        Some(Command::Start) => format!(
            "Run the node: connect to the broker, register, take commands.\n\nUsage: cyberwave-cloud-node [start] [FLAGS]\n\n{start_flags}\n"
        ),
        Some(Command::Validate) => "Check a manifest and print every problem with its line.\n\n\
Usage: cyberwave-cloud-node validate [PATH | --config PATH] [--lenient]\n\n\
Exit 0 when the manifest can run (warnings allowed), 1 when it has errors, 2 on usage errors.\n"
            .to_string(),
        Some(Command::Config) => format!(
            "Print the resolved settings and where each came from (secrets masked).\n\n\
Usage: cyberwave-cloud-node config [FLAGS] [--json]\n\nAccepts every flag of 'start':\n{start_flags}\n  --json               machine-readable output\n"
        ),
                Some(Command::InstallService) => "Install the systemd unit for this binary (for hosts without the package).\n\n\
Usage: cyberwave-cloud-node install-service [--user]\n\n\
Writes cyberwave-cloud-node.service (/etc/systemd/system, or ~/.config/systemd/user with --user)\n\
and a commented environment file (mode 0600) for the API key and the manifest path, then runs\n\
`systemctl daemon-reload` and `enable` when systemd is running. The API key is never put in the unit.\n\
Without systemd (cron): @reboot CYBERWAVE_EDGE_CONFIG_DIR=$HOME/.cyberwave /usr/bin/cyberwave-cloud-node start\n"
            .to_string(),
                Some(Command::Emit) => "Report a workflow execution event from inside a workload, through the node.\n\n\
Usage:\n  cyberwave-cloud-node emit started --workflow W [--execution E] [--trigger-json J]\n\
  cyberwave-cloud-node emit node --workflow W --execution E --node N --status S [--input-json J]\n\
      [--output-json J] [--error-message M] [--execution-time-ms N] [--metadata-json J]\n\
      [--started-at T] [--finished-at T] [--activation-index N] [--caller-uuid U]\n\
  cyberwave-cloud-node emit finished --workflow W --execution E --status S [--error-message M]\n\
  (all three: [--source-type edge|sim|tele|edit])\n\n\
Node statuses: pending, running, success, error, skipped. Finished: success, error, canceled.\n\
Times: RFC 3339 or epoch seconds (sent as RFC 3339 UTC). Payloads up to 256 KiB.\n\
`started` prints the execution uuid (generated when --execution is not given).\n\
Returns once the event is queued durably (also while the node is down). Uses the workload's\n\
CYBERWAVE_NODE_SOCKET and CYBERWAVE_NODE_EVENT_TOKEN.\n\
Exit: 0 queued, 2 invalid input (nothing queued), 3 token or workflow refused, 1 other failure.\n"
            .to_string(),
                Some(Command::Status) => "Show the node, its connection and its workloads (works whether or not the node runs).\n\n\
Usage: cyberwave-cloud-node status [--json]\n".to_string(),
        Some(Command::Logs) => "Print a workload's log.\n\n\
Usage: cyberwave-cloud-node logs REQUEST_ID|PID [-f] [--stderr] [-n N]\n\n\
  -f         follow until the workload ends\n  --stderr   the stderr log (default stdout)\n  -n N       only the last N lines\n".to_string(),
        Some(Command::Drain) => "Stop accepting workloads; running ones finish. Heartbeats say draining.\n\n\
Usage: cyberwave-cloud-node drain [--wait]     (--wait: return once no workload runs)\n\
Scripts can also send SIGUSR1 (drain) and SIGUSR2 (resume) to the node.\n".to_string(),
        Some(Command::Resume) => "Accept workloads again after a drain.\n\nUsage: cyberwave-cloud-node resume\n".to_string(),
        Some(Command::Doctor) => "Check this host: configuration, token, broker (a real connect), bash, state dir,\n\
results folder, free disk, the systemd unit, GPUs. One line per check; exit 1 on any FAIL.\n\n\
Usage: cyberwave-cloud-node doctor [--config P] [--standalone] [--mqtt-host H] [--mqtt-port N]\n".to_string(),
        Some(Command::UninstallService) => "Disable and remove the unit written by install-service (the environment file and state stay).\n\n\
Usage: cyberwave-cloud-node uninstall-service [--user]\n"
            .to_string(),
        None => format!(
            "cyberwave-cloud-node {VERSION}: turns this host into a Cyberwave cloud node.\n\n\
Usage: cyberwave-cloud-node [COMMAND] [FLAGS]\n\n\
Commands:\n  start              run the node (the default)\n  validate           check a manifest (cyberwave.yml)\n  config             print the resolved settings and their sources\n  install-service    install the systemd unit (--user for user scope)\n    uninstall-service  remove it\n    emit               report a workflow execution event (inside a workload)\n  status             the node and its workloads (--json)\n  logs               a workload's log (-f, --stderr, -n N)\n  drain, resume      stop / restart accepting workloads (drain --wait)\n  doctor             check this host\n\n\
Flags: --version, --help (also per command: cyberwave-cloud-node COMMAND --help)\n\n\
Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error, 3 credentials rejected\n"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Parsed, UsageError> {
        parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    fn run(args: &[&str]) -> Invocation {
        match p(args) {
            Ok(Parsed::Run(i)) => i,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn no_subcommand_means_start() {
        assert_eq!(run(&[]).command, Command::Start);
        assert!(!run(&[]).explicit && !run(&["--config", "x"]).explicit);
        assert!(run(&["start"]).explicit && run(&["--config", "x", "start"]).explicit);
        assert_eq!(run(&["--slug", "x"]).flags.slug.as_deref(), Some("x"));
    }

    #[test]
    fn flags_before_or_after_subcommand() {
        let a = run(&["-v", "start", "--mqtt-port", "1883"]);
        let b = run(&["start", "-v", "--mqtt-port=1883"]);
        let c = run(&["--mqtt-port", "1883", "-v", "start"]);
        assert_eq!(a, b);
        assert_eq!(b, c);
        assert_eq!(a.verbosity, 1);
        assert_eq!(a.flags.mqtt_port, Some(1883));
        assert_eq!(run(&["start", "-vv"]).verbosity, 2);
        assert_eq!(run(&["-v", "-v"]).verbosity, 2);
    }

    #[test]
    fn usage_errors() {
        for args in [
            &["--mqtt-port", "abc"][..],
            &["--mqtt-port", "0"],
            &["--mqtt-port", "70000"],
            &["--bogus"],
            &["start", "--json"],
            &["validate", "--slug", "x"],
            &["frobnicate"],
            &["--config"],
            &["--standalone=yes"],
            &["-x"],
            &["start", "extra"],
        ] {
            assert!(p(args).is_err(), "{args:?}");
        }
    }

    #[test]
    fn validate_takes_a_path() {
        let i = run(&["validate", "m.yml", "--lenient"]);
        assert_eq!(i.command, Command::Validate);
        assert_eq!(i.flags.config, Some(PathBuf::from("m.yml")));
        assert!(i.flags.lenient);
    }

    #[test]
    fn help_and_version() {
        assert_eq!(p(&["--version"]).unwrap(), Parsed::Version);
        assert!(
            matches!(p(&["validate", "--help"]).unwrap(), Parsed::Help(t) if t.contains("validate [PATH"))
        );
        assert!(matches!(p(&["--help"]).unwrap(), Parsed::Help(t) if t.contains("Exit codes")));
        assert!(matches!(p(&["config", "-h"]).unwrap(), Parsed::Help(t) if t.contains("--json")));
    }

    #[test]
    fn config_takes_every_start_flag() {
        let i = run(&[
            "config",
            "--drain-after-one",
            "--metrics-file",
            "m.prom",
            "--json",
            "--standalone",
        ]);
        assert_eq!(i.command, Command::Config);
        assert!(i.flags.drain_after_one && i.json && i.flags.standalone);
        assert!(p(&["start", "--json"]).is_err());
        assert!(p(&["status", "--drain-after-one"]).is_err());
    }

    #[test]
    fn short_flags_of_logs() {
        let i = run(&["logs", "req-1", "-f", "-n", "5", "--stderr"]);
        assert_eq!(i.command, Command::Logs);
        assert_eq!(i.emit_kind, "req-1");
        assert!(i.follow && i.stderr);
        assert_eq!(i.lines, Some(5));
        assert!(p(&["logs"]).is_err());
        assert!(p(&["logs", "a", "-n", "x"]).is_err());
    }

    #[test]
    fn tls_switches() {
        assert_eq!(run(&["--no-mqtt-tls"]).flags.mqtt_tls, Some(false));
        assert_eq!(run(&["--mqtt-tls"]).flags.mqtt_tls, Some(true));
    }
}
