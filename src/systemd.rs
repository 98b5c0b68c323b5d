//! systemd integration: readiness and watchdog notifications (`sd_notify` is one datagram to
//! `$NOTIFY_SOCKET`), and `install-service` / `uninstall-service` for hosts without the package.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The unit shipped in the package, with placeholders for the paths.
pub const UNIT_TEMPLATE: &str = include_str!("../packaging/cyberwave-cloud-node.service");
pub const ENV_TEMPLATE: &str = include_str!("../packaging/cloud-node.env");
pub const UNIT_NAME: &str = "cyberwave-cloud-node.service";

/// Sends a notification to systemd when the node runs under it (no-op otherwise).
pub fn notify(msg: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = UnixDatagram::unbound() else {
        return;
    };
    let bytes = path.as_encoded_bytes();
    let sent = if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(name)
            .and_then(|addr| sock.send_to_addr(msg.as_bytes(), &addr))
    } else {
        sock.send_to(msg.as_bytes(), Path::new(&path))
    };
    if let Err(e) = sent {
        log::debug!("sd_notify {msg:?}: {e}");
    }
}

/// Why `install-service` or `uninstall-service` could not do its part.
#[derive(Debug)]
pub enum ServiceError {
    /// A user unit needs `$HOME`.
    NoHome,
    /// `current_exe` failed.
    NoExe(std::io::Error),
    /// Creating, writing, chmod-ing or removing `path` failed (`doing` is the verb).
    Io {
        doing: &'static str,
        path: PathBuf,
        err: std::io::Error,
    },
}

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServiceError::NoHome => write!(f, "HOME is not set"),
            ServiceError::NoExe(e) => write!(f, "cannot find this program's path: {e}"),
            ServiceError::Io { doing, path, err } => {
                write!(f, "cannot {doing} {}: {err}", path.display())
            }
        }
    }
}

impl std::error::Error for ServiceError {}

/// The `map_err` of a file operation on `path`.
fn io_error(doing: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ServiceError {
    let path = path.to_path_buf();
    move |err| ServiceError::Io { doing, path, err }
}

pub struct Paths {
    pub unit: PathBuf,
    pub env_file: PathBuf,
    pub state_dir: PathBuf,
}

/// Where the unit and its environment file go: system scope (/etc) or user scope (XDG).
pub fn paths(user: bool) -> Result<Paths, ServiceError> {
    if !user {
        return Ok(Paths {
            unit: PathBuf::from("/etc/systemd/system").join(UNIT_NAME),
            env_file: PathBuf::from("/etc/cyberwave/cloud-node.env"),
            state_dir: PathBuf::from("/var/lib/cyberwave-cloud-node"),
        });
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .ok_or(ServiceError::NoHome)?;
    let config = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".config"));
    let data = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".local/share"));
    Ok(Paths {
        unit: config.join("systemd/user").join(UNIT_NAME),
        env_file: config.join("cyberwave/cloud-node.env"),
        state_dir: data.join("cyberwave-cloud-node"),
    })
}

/// The unit for this binary and scope.
pub fn render_unit(bin: &Path, p: &Paths, user: bool) -> String {
    let (user_lines, state_lines, wanted) = if user {
        (String::new(), String::new(), "default.target")
    } else {
        (
            "# A dedicated unprivileged user (created by the package or by you; in groups video/render for GPUs).\nUser=cyberwave\n# Its own group: nothing else can read the node's files.\nGroup=cyberwave\n".to_string(),
            "# systemd creates the state dir, owned by the service user.\nStateDirectory=cyberwave-cloud-node\n# Only the service user can enter it (it holds the identity and workload records).\nStateDirectoryMode=0700\n".to_string(),
            "multi-user.target",
        )
    };
    UNIT_TEMPLATE
        .replace("@BIN@", &bin.display().to_string())
        .replace("@ENV_FILE@", &p.env_file.display().to_string())
        .replace("@STATE_DIR@", &p.state_dir.display().to_string())
        .replace("@USER_LINES@", &user_lines)
        .replace("@STATE_LINES@", &state_lines)
        .replace("@WANTED_BY@", wanted)
}

fn systemctl(user: bool, args: &[&str]) {
    let mut cmd = Command::new("systemctl");
    if user {
        cmd.arg("--user");
    }
    match crate::fds::harden(cmd.args(args)).status() {
        Ok(s) if s.success() => crate::outln!(
            "systemctl {}{}: ok",
            if user { "--user " } else { "" },
            args.join(" ")
        ),
        Ok(s) => crate::outln!("systemctl {}: {s}", args.join(" ")),
        Err(e) => crate::outln!("systemctl {}: not run ({e})", args.join(" ")),
    }
}

fn have_systemd() -> bool {
    Path::new("/run/systemd/system").is_dir()
}

/// `install-service [--user]`: writes the unit and (if missing) the 0600 environment file, then
/// `daemon-reload` + `enable` when systemd runs. The API key is never written into the unit.
pub fn install(user: bool) -> Result<(), ServiceError> {
    let p = paths(user)?;
    let exe = std::env::current_exe().map_err(ServiceError::NoExe)?;
    let exe = PathBuf::from(exe.to_string_lossy().trim_end_matches(" (deleted)"));
    for dir in [p.unit.parent(), p.env_file.parent()].into_iter().flatten() {
        std::fs::create_dir_all(dir).map_err(io_error("create", dir))?;
    }
    if user {
        crate::store::ensure_private_dir(&p.state_dir).map_err(io_error("create", &p.state_dir))?;
    }
    crate::store::write_atomic(&p.unit, render_unit(&exe, &p, user).as_bytes(), 0o644)
        .map_err(io_error("write", &p.unit))?;
    crate::outln!("wrote {}", p.unit.display());
    if p.env_file.exists() {
        std::fs::set_permissions(&p.env_file, std::fs::Permissions::from_mode(0o600))
            .map_err(io_error("chmod", &p.env_file))?;
        crate::outln!("kept {} (mode 0600)", p.env_file.display());
    } else {
        crate::store::write_atomic(&p.env_file, ENV_TEMPLATE.as_bytes(), 0o600)
            .map_err(io_error("write", &p.env_file))?;
        crate::outln!(
            "wrote {} (mode 0600): put your CYBERWAVE_API_KEY and CYBERWAVE_MANIFEST there",
            p.env_file.display()
        );
    }
    if have_systemd() {
        systemctl(user, &["daemon-reload"]);
        systemctl(user, &["enable", UNIT_NAME]);
        crate::outln!(
            "start it with: systemctl {}start {UNIT_NAME}",
            if user { "--user " } else { "" }
        );
    } else {
        crate::outln!("systemd is not running here: the unit was written but not enabled");
    }
    if user {
        crate::outln!("to keep it running while you are logged out: loginctl enable-linger $USER");
    }
    Ok(())
}

/// `uninstall-service [--user]`: disables and removes the unit; keeps the env file and state.
pub fn uninstall(user: bool) -> Result<(), ServiceError> {
    let p = paths(user)?;
    if have_systemd() {
        systemctl(user, &["disable", "--now", UNIT_NAME]);
    }
    match std::fs::remove_file(&p.unit) {
        Ok(()) => crate::outln!("removed {}", p.unit.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            crate::outln!("{} was not installed", p.unit.display())
        }
        Err(e) => return Err(io_error("remove", &p.unit)(e)),
    }
    if have_systemd() {
        systemctl(user, &["daemon-reload"]);
    }
    crate::outln!(
        "kept {} and {} (remove them by hand if you want)",
        p.env_file.display(),
        p.state_dir.display()
    );
    Ok(())
}

/// The unit directories systemd reads, highest precedence first (D44). Test builds only
/// (`test-hooks`): `CYBERWAVE_NODE_SYSTEMD_DIRS` (colon-separated) replaces them, and the user
/// unit is then not looked at. A directory whose path ends in `lib/systemd/system` holds
/// packaged units.
pub fn unit_dirs() -> (Vec<PathBuf>, bool) {
    match std::env::var_os("CYBERWAVE_NODE_SYSTEMD_DIRS").filter(|_| cfg!(feature = "test-hooks")) {
        Some(v) => (std::env::split_paths(&v).collect(), false),
        None => (
            [
                "/etc/systemd/system",
                "/run/systemd/system",
                "/usr/local/lib/systemd/system",
                "/lib/systemd/system",
                "/usr/lib/systemd/system",
            ]
            .iter()
            .map(PathBuf::from)
            .collect(),
            true,
        ),
    }
}

fn is_packaged_dir(dir: &Path) -> bool {
    dir.ends_with("lib/systemd/system") && !dir.starts_with("/usr/local")
}

/// The last value of `key=` in unit text (an empty assignment resets it, as in systemd).
fn last_value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let mut value = None;
    for l in text.lines() {
        if let Some((k, v)) = l.trim().split_once('=') {
            if k.trim() == key {
                let v = v.trim();
                value = (!v.is_empty()).then_some(v);
            }
        }
    }
    value
}

/// What a unit lacks that the packaged one gives the node (D44), each with its consequence.
/// A user unit (`systemctl --user`) runs as its user by nature: `system` false skips `User=`.
pub fn unit_lacks(text: &str, system: bool) -> Vec<&'static str> {
    let mut lacks = Vec::new();
    if system && last_value(text, "User").is_none_or(|u| u == "root" || u == "0") {
        lacks.push("User= (the node and its workloads run as root)");
    }
    if last_value(text, "EnvironmentFile").is_none() {
        lacks.push("EnvironmentFile=-/etc/cyberwave/cloud-node.env (where the API key and CYBERWAVE_MANIFEST go)");
    }
    if last_value(text, "Type") != Some("notify") {
        lacks.push("Type=notify (`systemctl start` returns before the node is ready, and there is no watchdog)");
    }
    let state_dir = last_value(text, "StateDirectory").is_some()
        || text.lines().any(|l| {
            l.trim()
                .strip_prefix("Environment=")
                .is_some_and(|v| v.contains("CYBERWAVE_EDGE_CONFIG_DIR="))
        });
    if !state_dir {
        lacks.push("a state dir (StateDirectory= / CYBERWAVE_EDGE_CONFIG_DIR: the node keeps its identity in the passwd home of its user, /root/.cyberwave for root)");
    }
    lacks
}

/// `doctor`'s lines about the unit in effect: the first one found in `dirs` (or the user unit),
/// with the drop-ins of every dir applied; `(level, detail)`.
pub fn doctor_lines(dirs: &[PathBuf], user_unit: Option<PathBuf>) -> Vec<(&'static str, String)> {
    let found: Vec<PathBuf> = dirs
        .iter()
        .map(|d| d.join(UNIT_NAME))
        .chain(user_unit)
        .filter(|p| p.symlink_metadata().is_ok())
        .collect();
    let Some(unit) = found.first() else {
        return vec![(
            "PASS",
            "not installed (fine when you run the node another way)".into(),
        )];
    };
    if std::fs::canonicalize(unit).is_ok_and(|p| p == Path::new("/dev/null")) {
        return vec![(
            "WARN",
            format!(
                "{} is masked (a link to /dev/null): `sudo systemctl unmask {UNIT_NAME}`",
                unit.display()
            ),
        )];
    }
    let mut text = std::fs::read_to_string(unit).unwrap_or_default();
    for dir in dirs {
        let dropins = dir.join(format!("{UNIT_NAME}.d"));
        let mut confs: Vec<PathBuf> = std::fs::read_dir(&dropins)
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        confs.retain(|p| p.extension().is_some_and(|e| e == "conf"));
        confs.sort();
        for c in confs {
            text.push('\n');
            text.push_str(&std::fs::read_to_string(&c).unwrap_or_default());
        }
    }
    let mut lines = Vec::new();
    let in_dir = |d: &PathBuf| unit.parent() == Some(d.as_path());
    let packaged = dirs
        .iter()
        .filter(|d| is_packaged_dir(d))
        .map(|d| d.join(UNIT_NAME))
        .find(|p| p.is_file());
    let is_packaged = dirs.iter().any(|d| in_dir(d) && is_packaged_dir(d));
    let lacks = unit_lacks(&text, dirs.iter().any(in_dir));
    if !is_packaged && (packaged.is_some() || !lacks.is_empty()) {
        let what = match &packaged {
            Some(p) => format!(
                "{} is not the packaged unit: it masks {}",
                unit.display(),
                p.display()
            ),
            None => format!("{} is not the node's own unit", unit.display()),
        };
        let missing = if lacks.is_empty() {
            String::new()
        } else {
            format!("; it lacks {}", lacks.join(", "))
        };
        let back = match &packaged {
            Some(_) => format!(
                "go back with `sudo systemctl revert {}` (or remove {} and `sudo systemctl daemon-reload`), then `sudo systemctl restart {UNIT_NAME}`",
                UNIT_NAME.trim_end_matches(".service"),
                unit.display()
            ),
            None => "replace it with `sudo cyberwave-cloud-node install-service` (or install the package)".into(),
        };
        lines.push(("WARN", format!("{what}{missing} — {back}")));
    }
    if last_value(&text, "KillMode") == Some("process") {
        lines.push((
            "PASS",
            format!(
                "{} keeps workloads alive (KillMode=process)",
                unit.display()
            ),
        ));
    } else {
        lines.push((
            "FAIL",
            format!(
                "{} lacks KillMode=process: a restart would kill running workloads — reinstall it",
                unit.display()
            ),
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The unit `cyberwave compute install` (cyberwave-cli 0.12.7) writes: `Type=simple`,
    /// root, no environment file.
    const CLI_UNIT: &str = "[Unit]\nDescription=Cyberwave Cloud Node\nAfter=network-online.target\n\n[Service]\nType=simple\nExecStart=/usr/bin/cyberwave-cloud-node start\nRestart=on-failure\nRestartSec=5\n\n[Install]\nWantedBy=multi-user.target\n";

    struct Dirs(PathBuf);
    impl Dirs {
        fn new(tag: &str) -> Dirs {
            let root = std::env::temp_dir().join(format!("cw-units-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            for d in ["etc/systemd/system", "lib/systemd/system"] {
                std::fs::create_dir_all(root.join(d)).unwrap();
            }
            Dirs(root)
        }
        fn list(&self) -> Vec<PathBuf> {
            vec![
                self.0.join("etc/systemd/system"),
                self.0.join("lib/systemd/system"),
            ]
        }
        fn write(&self, rel: &str, text: &str) {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
    }
    impl Drop for Dirs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn packaged() -> String {
        render_unit(
            Path::new("/usr/bin/cyberwave-cloud-node"),
            &paths(false).unwrap(),
            false,
        )
    }

    #[test]
    fn doctor_warns_about_a_unit_that_masks_the_packaged_one_and_says_how_to_go_back() {
        // D44.
        let d = Dirs::new("mask");
        d.write(
            "lib/systemd/system/cyberwave-cloud-node.service",
            &packaged(),
        );
        // The packaged unit alone: nothing to say but that workloads survive restarts.
        let lines = doctor_lines(&d.list(), None);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!(lines[0].0, "PASS", "{lines:?}");
        // The CLI's unit beside it, with the CLI's drop-in for --config.
        d.write("etc/systemd/system/cyberwave-cloud-node.service", CLI_UNIT);
        d.write(
            "etc/systemd/system/cyberwave-cloud-node.service.d/override.conf",
            "[Service]\nExecStart=\nExecStart=/usr/bin/cyberwave-cloud-node start --config /srv/cyberwave.yml\n",
        );
        let lines = doctor_lines(&d.list(), None);
        let warn = &lines.iter().find(|(l, _)| *l == "WARN").expect("a WARN").1;
        for needle in [
            "etc/systemd/system/cyberwave-cloud-node.service is not the packaged unit: it masks",
            "lib/systemd/system/cyberwave-cloud-node.service",
            "User=",
            "EnvironmentFile=",
            "Type=notify",
            "a state dir",
            "`sudo systemctl revert cyberwave-cloud-node`",
            "daemon-reload",
        ] {
            assert!(warn.contains(needle), "no {needle:?} in {warn}");
        }
        assert!(lines
            .iter()
            .any(|(l, t)| *l == "FAIL" && t.contains("KillMode=process")));
        // A drop-in that gives what the unit lacks is taken into account.
        d.write(
            "etc/systemd/system/cyberwave-cloud-node.service.d/fix.conf",
            "[Service]\nUser=cyberwave\nType=notify\n",
        );
        let warn = doctor_lines(&d.list(), None)
            .into_iter()
            .find(|(l, _)| *l == "WARN")
            .unwrap()
            .1;
        assert!(
            !warn.contains("User=") && !warn.contains("Type=notify"),
            "{warn}"
        );
        assert!(warn.contains("EnvironmentFile="), "{warn}");
    }

    #[test]
    fn without_a_package_the_cli_unit_is_named_and_the_nodes_own_unit_passes() {
        let d = Dirs::new("nopkg");
        d.write("etc/systemd/system/cyberwave-cloud-node.service", CLI_UNIT);
        let lines = doctor_lines(&d.list(), None);
        let warn = &lines.iter().find(|(l, _)| *l == "WARN").unwrap().1;
        assert!(warn.contains("is not the node's own unit"), "{warn}");
        assert!(warn.contains("install-service"), "{warn}");
        // What `install-service` writes (the packaged unit in /etc) passes.
        d.write(
            "etc/systemd/system/cyberwave-cloud-node.service",
            &packaged(),
        );
        let lines = doctor_lines(&d.list(), None);
        assert!(lines.iter().all(|(l, _)| *l == "PASS"), "{lines:?}");
        // A user unit from `install-service --user` has no User= by nature.
        let user = d.0.join("user/cyberwave-cloud-node.service");
        let p = paths(false).unwrap();
        d.write(
            "user/cyberwave-cloud-node.service",
            &render_unit(Path::new("/usr/bin/cyberwave-cloud-node"), &p, true),
        );
        std::fs::remove_file(d.0.join("etc/systemd/system/cyberwave-cloud-node.service")).unwrap();
        let lines = doctor_lines(&d.list(), Some(user));
        assert!(lines.iter().all(|(l, _)| *l == "PASS"), "{lines:?}");
        // A masked unit.
        std::os::unix::fs::symlink(
            "/dev/null",
            d.0.join("etc/systemd/system/cyberwave-cloud-node.service"),
        )
        .unwrap();
        let lines = doctor_lines(&d.list(), None);
        assert!(lines[0].1.contains("systemctl unmask"), "{lines:?}");
        // None at all.
        std::fs::remove_file(d.0.join("etc/systemd/system/cyberwave-cloud-node.service")).unwrap();
        assert!(doctor_lines(&d.list(), None)[0].1.contains("not installed"));
    }

    #[test]
    fn the_unit_keeps_workloads_alive_and_holds_no_secret() {
        let p = paths(false).unwrap();
        let unit = render_unit(Path::new("/usr/bin/cyberwave-cloud-node"), &p, false);
        assert!(unit.contains("\nKillMode=process\n"));
        assert!(unit.contains("\nType=notify\n"));
        assert!(unit.contains("ExecStart=/usr/bin/cyberwave-cloud-node start\n"));
        assert!(unit.contains("User=cyberwave\n"));
        assert!(!unit.contains("PrivateDevices=yes"));
        assert!(!unit.contains('@'), "every placeholder replaced:\n{unit}");
        assert!(!unit.contains("CYBERWAVE_API_KEY="));
        // One comment line above every directive of [Service].
        let service = unit
            .split("[Service]")
            .nth(1)
            .unwrap()
            .split("[Install]")
            .next()
            .unwrap();
        let lines: Vec<&str> = service.lines().filter(|l| !l.trim().is_empty()).collect();
        for (i, l) in lines.iter().enumerate() {
            if !l.starts_with('#') {
                assert!(
                    i > 0 && lines[i - 1].starts_with('#'),
                    "no reason given for {l}"
                );
            }
        }
    }
}
