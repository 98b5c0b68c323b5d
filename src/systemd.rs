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

pub struct Paths {
    pub unit: PathBuf,
    pub env_file: PathBuf,
    pub state_dir: PathBuf,
}

/// Where the unit and its environment file go: system scope (/etc) or user scope (XDG).
pub fn paths(user: bool) -> Result<Paths, String> {
    if !user {
        return Ok(Paths {
            unit: PathBuf::from("/etc/systemd/system").join(UNIT_NAME),
            env_file: PathBuf::from("/etc/cyberwave/cloud-node.env"),
            state_dir: PathBuf::from("/var/lib/cyberwave-cloud-node"),
        });
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .ok_or("HOME is not set")?;
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
pub fn install(user: bool) -> Result<(), String> {
    let p = paths(user)?;
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find this program's path: {e}"))?;
    let exe = PathBuf::from(exe.to_string_lossy().trim_end_matches(" (deleted)"));
    for dir in [p.unit.parent(), p.env_file.parent()].into_iter().flatten() {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    if user {
        crate::store::ensure_private_dir(&p.state_dir)
            .map_err(|e| format!("cannot create {}: {e}", p.state_dir.display()))?;
    }
    crate::store::write_atomic(&p.unit, render_unit(&exe, &p, user).as_bytes(), 0o644)
        .map_err(|e| format!("cannot write {}: {e}", p.unit.display()))?;
    crate::outln!("wrote {}", p.unit.display());
    if p.env_file.exists() {
        std::fs::set_permissions(&p.env_file, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| format!("cannot chmod {}: {e}", p.env_file.display()))?;
        crate::outln!("kept {} (mode 0600)", p.env_file.display());
    } else {
        crate::store::write_atomic(&p.env_file, ENV_TEMPLATE.as_bytes(), 0o600)
            .map_err(|e| format!("cannot write {}: {e}", p.env_file.display()))?;
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
pub fn uninstall(user: bool) -> Result<(), String> {
    let p = paths(user)?;
    if have_systemd() {
        systemctl(user, &["disable", "--now", UNIT_NAME]);
    }
    match std::fs::remove_file(&p.unit) {
        Ok(()) => crate::outln!("removed {}", p.unit.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            crate::outln!("{} was not installed", p.unit.display())
        }
        Err(e) => return Err(format!("cannot remove {}: {e}", p.unit.display())),
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

#[cfg(test)]
mod tests {
    use super::*;

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
