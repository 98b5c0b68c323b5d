//! The binary's edge: turns the command line into work and every outcome into an exit code.

use std::io::Write;

use crate::cli::{self, Command, Parsed};
use crate::config::{self, env::EnvLayers, manifest};
use crate::error::{self, CliError, Exit};

/// Exit codes, documented in the README; chosen in `error.rs`.
pub const EXIT_OK: i32 = Exit::Ok.code();
pub const EXIT_RUNTIME: i32 = Exit::Runtime.code();
pub const EXIT_USAGE: i32 = Exit::Usage.code();
pub const EXIT_CREDENTIALS: i32 = Exit::Credentials.code();

/// The hidden modes, started by the node itself or by the packaging, never by a person: the
/// workload supervisor, the packaged unit, the man page and the completions. `None`: not one.
fn hidden_mode(args: &[String]) -> Option<i32> {
    // The workload supervisor mode (started by the node itself, never by a person).
    if args.first().map(String::as_str) == Some("__shim") {
        // Blocked before any thread exists (the shim outlives a stopping node: signals.rs).
        crate::signals::block_in_this_thread();
        return Some(crate::workload::shim::run(
            args.get(1..).unwrap_or_default(),
        ));
    }
    // The packaged unit, for packaging/build-deb.sh: the system unit for /usr/bin.
    if args.first().map(String::as_str) == Some("__print-unit") {
        return Some(match crate::systemd::paths(false) {
            Ok(p) => {
                crate::out!(
                    "{}",
                    crate::systemd::render_unit(
                        std::path::Path::new("/usr/bin/cyberwave-cloud-node"),
                        &p,
                        false
                    )
                );
                EXIT_OK
            }
            Err(e) => error::report(&CliError::Runtime(e.to_string())),
        });
    }
    // The man page and the shell completions, for the packages (hidden from --help).
    match (args.first().map(String::as_str), args.get(1)) {
        (Some("__man"), None) => Some(crate::manpage::print(&crate::manpage::man_page())),
        (Some("__completions"), shell) => {
            Some(match shell.and_then(|s| crate::manpage::completions(s)) {
                Some(script) if args.len() == 2 => crate::manpage::print(&script),
                _ => {
                    let usage = "error: usage: cyberwave-cloud-node __completions bash|zsh|fish";
                    let _ = writeln!(std::io::stderr(), "{usage}");
                    EXIT_USAGE
                }
            })
        }
        _ => None,
    }
}

pub fn run(args: &[String]) -> i32 {
    if let Some(code) = hidden_mode(args) {
        return code;
    }
    let inv = match cli::parse(args) {
        Ok(Parsed::Version) => {
            crate::outln!("cyberwave-cloud-node {}", cli::VERSION);
            return EXIT_OK;
        }
        Ok(Parsed::Help(text)) => {
            crate::out!("{text}");
            return EXIT_OK;
        }
        Ok(Parsed::Run(inv)) => inv,
        Err(e) => {
            return error::report(&CliError::Usage(format!(
                "{}\n(see: cyberwave-cloud-node --help)",
                e.0
            )))
        }
    };
    if inv.command == Command::Start {
        // Blocked before any thread exists, so every thread inherits the mask and only the
        // signal thread ever receives them (see signals.rs).
        crate::signals::block_in_this_thread();
        if !inv.explicit {
            reexec_as_start(args);
        }
    } else {
        crate::signals::end_on_interrupt();
    }
    init_logging(inv.verbosity);
    let cwd = match std::env::current_dir() {
        Ok(d) => d,
        Err(e) => {
            return error::report(&CliError::Runtime(format!(
                "cannot read the current directory: {e}"
            )))
        }
    };
    match inv.command {
        Command::InstallService | Command::UninstallService => {
            let result = if inv.command == Command::InstallService {
                crate::systemd::install(inv.user)
            } else {
                crate::systemd::uninstall(inv.user)
            };
            error::exit_code(result.map_err(|e| CliError::Runtime(e.to_string())))
        }
        Command::Validate => error::exit_code(validate(&inv.flags, &cwd)),
        Command::Emit => error::exit_code(crate::emit::run(&inv.emit_kind, &inv.emit)),
        Command::Status => error::exit_code(crate::ops::status(inv.json)),
        Command::Logs => error::exit_code(crate::ops::logs(
            &inv.emit_kind,
            inv.follow,
            inv.stderr,
            inv.lines,
        )),
        Command::Drain => error::exit_code(crate::ops::drain(true, inv.wait)),
        Command::Resume => error::exit_code(crate::ops::drain(false, false)),
        Command::Doctor => error::exit_code(crate::ops::doctor(&inv.flags, &cwd)),
        Command::Config | Command::Start => {
            let settings = match config::resolve(&inv.flags, EnvLayers::from_process(), &cwd) {
                Ok(s) => s,
                Err(e) => return error::report(&CliError::Config(e.0)),
            };
            if inv.command == Command::Config {
                print_config(&settings, inv.json);
                EXIT_OK
            } else {
                for w in &settings.manifest_warnings {
                    log::warn!("{w}");
                }
                for w in &settings.template_warnings {
                    log::warn!("{w}");
                }
                crate::node::startup::run(settings)
            }
        }
    }
}

/// Set in the environment of the re-executed node (D43); removed again at once, so that
/// workloads do not inherit it.
pub const REEXEC_MARKER: &str = "CYBERWAVE_NODE_REEXECUTED";
const LOCK_WAIT: &str = "CYBERWAVE_NODE_LOCK_WAIT_SECONDS";

/// D43: a node started with no subcommand (the platform CLI's `cyberwave compute start` and
/// `restart` do this) replaces itself, same pid, with `<same executable> start <same
/// arguments>`, so that the CLI's `compute stop` and `restart` (`pgrep -f "cyberwave-cloud-node
/// start"`) find it. The marker prevents a second round; when the exec fails the node carries
/// on as `start` in this process. Call before any thread exists.
fn reexec_as_start(args: &[String]) {
    use std::os::unix::process::CommandExt;
    if std::env::var_os(REEXEC_MARKER).is_some() {
        // The re-executed node: forget the marker (single-threaded still, see above).
        std::env::remove_var(REEXEC_MARKER);
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let arg0 = std::env::args_os()
        .next()
        .unwrap_or_else(|| exe.clone().into_os_string());
    let mut cmd = std::process::Command::new(&exe);
    cmd.arg0(arg0)
        .arg("start")
        .args(args)
        .env(REEXEC_MARKER, "1");
    // `compute restart` starts the new node right after it sent the old one SIGTERM: the new
    // one waits for the state dir instead of dying on its lock.
    if std::env::var_os(LOCK_WAIT).is_none() {
        cmd.env(LOCK_WAIT, "30");
    }
    let err = cmd.exec();
    let _ = writeln!(
        std::io::stderr(),
        "warning: cannot re-execute as `{} start` ({err}); running as start without it",
        exe.display()
    );
}

fn validate(flags: &config::Flags, cwd: &std::path::Path) -> Result<(), CliError> {
    let explicit = flags
        .config
        .clone()
        .or_else(|| Some(cwd.join("cyberwave.yml")));
    let (path, text) = match manifest::locate(explicit.as_deref(), cwd) {
        Ok(Some(found)) => found,
        // `locate` with an explicit path never answers "no manifest": it errors instead.
        Ok(None) => return Err(CliError::Runtime("internal: no manifest located".into())),
        Err(e) => {
            crate::outln!("error: {e}");
            return Err(CliError::Found);
        }
    };
    let (m, problems) = manifest::parse(&path, &text, flags.lenient);
    for p in &problems {
        crate::outln!("{p}");
    }
    let errors = problems.iter().filter(|p| !p.warning).count();
    let warnings = problems.len().saturating_sub(errors);
    match m {
        Some(m) => {
            if m.wrapper.as_deref() == Some(manifest::WRAPPER_LEGACY) {
                crate::outln!(
                    "{}: note: `cyberwave-cloud-node:` is the legacy wrapper; `cyberwave:` is preferred",
                    path.display()
                );
            }
            for (kind, cmd) in [
                ("inference", &m.inference),
                ("simulate", &m.simulate),
                ("training", &m.training),
            ] {
                if let Some(c) = cmd {
                    let mode = match crate::workload::module_of(c) {
                        Some(m) => format!(
                            "module mode: calls {}(**params){}",
                            crate::workload::module_function(kind),
                            match path.parent().map(|d| d.join(m).is_file()) {
                                Some(false) => format!("; {m} does not exist yet"),
                                _ => String::new(),
                            }
                        ),
                        None => "shell mode".into(),
                    };
                    show_template(kind, &mode, c);
                }
            }
            crate::outln!(
                "{}: OK ({warnings} warning{})",
                path.display(),
                if warnings == 1 { "" } else { "s" }
            );
            Ok(())
        }
        None => {
            crate::outln!(
                "{}: {errors} error{}, {warnings} warning{}",
                path.display(),
                plural(errors),
                plural(warnings)
            );
            Err(CliError::Found)
        }
    }
}

/// A template as `validate` shows it: a one-line one beside its mode, every line of a longer
/// one below it (D63), control characters escaped.
fn show_template(kind: &str, mode: &str, template: &str) {
    let shown = |line: &str| crate::logtext::Escaped(line).to_string();
    if template.lines().nth(1).is_none() {
        crate::outln!("  {kind}: [{mode}] {}", shown(template.trim_end()));
        return;
    }
    crate::outln!("  {kind}: [{mode}]");
    for line in template.lines() {
        crate::outln!("    {}", shown(line));
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

fn print_config(settings: &config::Settings, json: bool) {
    let rows = settings.rows();
    if json {
        let obj: serde_json::Map<String, serde_json::Value> = rows
            .into_iter()
            .map(|(k, v, s)| (k.to_string(), serde_json::json!({"value": v, "source": s})))
            .collect();
        crate::outln!("{}", crate::out::json(&serde_json::Value::Object(obj)));
    } else {
        for (k, v, s) in rows {
            crate::outln!("{k:<26} {v:<40} ({s})");
        }
        for w in &settings.manifest_warnings {
            crate::outln!("{w}");
        }
        for w in &settings.template_warnings {
            crate::outln!("{w}");
        }
    }
}

/// Whether a log line of this target may be printed at this level: the MQTT library's only at
/// error, the HTTP client's only up to info, the node's own at any level.
fn library_line_shown(target: &str, level: log::Level) -> bool {
    if target.starts_with("paho_mqtt") {
        level <= log::Level::Error
    } else if target.starts_with("ureq") {
        level <= log::Level::Info
    } else {
        true
    }
}

fn init_logging(verbosity: u8) {
    let level = match verbosity {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    // D47: the MQTT library stays at error whatever RUST_LOG says: at debug and trace it prints
    // its connect options (the password, as a list of bytes), every published message (the
    // registration request carries the API token) and topics. A directive given after the
    // environment's replaces the environment's for the same module.
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(level))
        // (Its warnings repeat what the node says itself, e.g. "Connection lost. Client: 0x…".)
        .filter_module("paho_mqtt", log::LevelFilter::Error)
        // The HTTP client likewise stays at info: at trace it dumps every request's bytes, the
        // `Authorization` header with the token included, as hex rows of 16 characters (its own
        // documentation says "NOT REDACTED"), and at debug its request lines show a signed
        // upload URL whole as soon as any trace directive names its module.
        .filter_module("ureq", log::LevelFilter::Info)
        .filter_module("ureq_proto", log::LevelFilter::Info)
        .format(|buf, record| {
            // The same for a directive naming a submodule (`paho_mqtt::async_client=trace`,
            // `ureq_proto::util=trace`): an empty record prints nothing.
            if !library_line_shown(record.target(), record.level()) {
                return Ok(());
            }
            writeln!(
                buf,
                "{} {:<5} {}",
                crate::util::rfc3339(std::time::SystemTime::now()),
                record.level(),
                // D31 backstop: no log line carries a raw control character.
                crate::logtext::Escaped(&record.args().to_string())
            )
        })
        .target(env_logger::Target::Stderr)
        .try_init();
}
