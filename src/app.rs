//! The binary's edge: turns the command line into work and every outcome into an exit code.

use std::io::Write;

use crate::cli::{self, Command, Parsed};
use crate::config::{self, env::EnvLayers, manifest};

/// Exit codes, documented in the README.
pub const EXIT_OK: i32 = 0;
pub const EXIT_RUNTIME: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_CREDENTIALS: i32 = 3;

pub fn run(args: &[String]) -> i32 {
    // The workload supervisor mode (started by the node itself, never by a person).
    if args.first().map(String::as_str) == Some("__shim") {
        return crate::workload::shim::run(&args[1..]);
    }
    // The packaged unit, for packaging/build-deb.sh: the system unit for /usr/bin.
    if args.first().map(String::as_str) == Some("__print-unit") {
        return match crate::systemd::paths(false) {
            Ok(p) => {
                print!(
                    "{}",
                    crate::systemd::render_unit(
                        std::path::Path::new("/usr/bin/cyberwave-cloud-node"),
                        &p,
                        false
                    )
                );
                EXIT_OK
            }
            Err(e) => {
                eprintln!("error: {e}");
                EXIT_RUNTIME
            }
        };
    }
    // The man page and the shell completions, for the packages (hidden from --help).
    match (args.first().map(String::as_str), args.get(1)) {
        (Some("__man"), None) => return crate::manpage::print(&crate::manpage::man_page()),
        (Some("__completions"), shell) => {
            return match shell.and_then(|s| crate::manpage::completions(s)) {
                Some(script) if args.len() == 2 => crate::manpage::print(&script),
                _ => {
                    let usage = "error: usage: cyberwave-cloud-node __completions bash|zsh|fish";
                    let _ = writeln!(std::io::stderr(), "{usage}");
                    EXIT_USAGE
                }
            };
        }
        _ => {}
    }
    let inv = match cli::parse(args) {
        Ok(Parsed::Version) => {
            println!("cyberwave-cloud-node {}", cli::VERSION);
            return EXIT_OK;
        }
        Ok(Parsed::Help(text)) => {
            print!("{text}");
            return EXIT_OK;
        }
        Ok(Parsed::Run(inv)) => inv,
        Err(e) => {
            eprintln!("error: {}\n(see: cyberwave-cloud-node --help)", e.0);
            return EXIT_USAGE;
        }
    };
    init_logging(inv.verbosity);
    let cwd = match std::env::current_dir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: cannot read the current directory: {e}");
            return EXIT_RUNTIME;
        }
    };
    match inv.command {
        Command::InstallService | Command::UninstallService => {
            let result = if inv.command == Command::InstallService {
                crate::systemd::install(inv.user)
            } else {
                crate::systemd::uninstall(inv.user)
            };
            match result {
                Ok(()) => EXIT_OK,
                Err(e) => {
                    eprintln!("error: {e}");
                    EXIT_RUNTIME
                }
            }
        }
        Command::Validate => validate(&inv.flags, &cwd),
        Command::Emit => crate::emit::run(&inv.emit_kind, &inv.emit),
        Command::Status => crate::ops::status(inv.json),
        Command::Logs => crate::ops::logs(&inv.emit_kind, inv.follow, inv.stderr, inv.lines),
        Command::Drain => crate::ops::drain(true, inv.wait),
        Command::Resume => crate::ops::drain(false, false),
        Command::Doctor => crate::ops::doctor(&inv.flags, &cwd),
        Command::Config | Command::Start => {
            let settings = match config::resolve(&inv.flags, EnvLayers::from_process(), &cwd) {
                Ok(s) => s,
                Err(e) => {
                    for line in &e.0 {
                        eprintln!("error: {line}");
                    }
                    return EXIT_USAGE;
                }
            };
            if inv.command == Command::Config {
                print_config(&settings, inv.json)
            } else {
                for w in &settings.manifest_warnings {
                    log::warn!("{w}");
                }
                crate::node::run(settings)
            }
        }
    }
}

fn validate(flags: &config::Flags, cwd: &std::path::Path) -> i32 {
    let explicit = flags
        .config
        .clone()
        .or_else(|| Some(cwd.join("cyberwave.yml")));
    let (path, text) = match manifest::locate(explicit.as_deref(), cwd) {
        Ok(Some(found)) => found,
        Ok(None) => unreachable_none(),
        Err(e) => {
            println!("error: {e}");
            return EXIT_RUNTIME;
        }
    };
    let (m, problems) = manifest::parse(&path, &text, flags.lenient);
    for p in &problems {
        println!("{p}");
    }
    let errors = problems.iter().filter(|p| !p.warning).count();
    let warnings = problems.len() - errors;
    match m {
        Some(m) => {
            if m.wrapper.as_deref() == Some(manifest::WRAPPER_LEGACY) {
                println!(
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
                    println!("  {kind}: [{mode}] {}", c.lines().next().unwrap_or(""));
                }
            }
            println!(
                "{}: OK ({warnings} warning{})",
                path.display(),
                if warnings == 1 { "" } else { "s" }
            );
            EXIT_OK
        }
        None => {
            println!(
                "{}: {errors} error{}, {warnings} warning{}",
                path.display(),
                plural(errors),
                plural(warnings)
            );
            EXIT_RUNTIME
        }
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// `locate` with an explicit path never answers "no manifest": it errors instead.
fn unreachable_none() -> ! {
    eprintln!("error: internal: no manifest located");
    std::process::exit(EXIT_RUNTIME)
}

fn print_config(settings: &config::Settings, json: bool) -> i32 {
    let rows = settings.rows();
    let mut out = std::io::stdout().lock();
    if json {
        let obj: serde_json::Map<String, serde_json::Value> = rows
            .into_iter()
            .map(|(k, v, s)| (k.to_string(), serde_json::json!({"value": v, "source": s})))
            .collect();
        let _ = writeln!(out, "{}", serde_json::Value::Object(obj));
    } else {
        for (k, v, s) in rows {
            let _ = writeln!(out, "{k:<26} {v:<40} ({s})");
        }
        for w in &settings.manifest_warnings {
            let _ = writeln!(out, "{w}");
        }
    }
    EXIT_OK
}

fn init_logging(verbosity: u8) {
    let level = match verbosity {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    // The MQTT library stays at warn: at debug and trace it prints topics, and the instance
    // request topic carries the API token (an explicit RUST_LOG is the operator's choice).
    let default = format!("{level},paho_mqtt=warn");
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(default))
        .format(|buf, record| {
            writeln!(
                buf,
                "{} {:<5} {}",
                crate::util::rfc3339(std::time::SystemTime::now()),
                record.level(),
                record.args()
            )
        })
        .target(env_logger::Target::Stderr)
        .try_init();
}
