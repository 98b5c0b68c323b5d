//! The node as a container's main process (D58, D70).
//!
//! As PID 1 of its PID namespace the node's workloads cannot outlive it: when it exits the
//! kernel kills everything in the namespace, and the backend would never hear of them again.
//! The same holds when the node runs behind an init or a wrapper that is PID 1 in its place
//! (`docker run --init`, tini, the Python wrapper, a shell entrypoint): that PID 1 exits when the
//! node does. So in container mode the node says at start that its workloads end with it, and
//! on SIGTERM (`docker stop`: SIGKILL after a grace, 10 s by default) it stops its workloads
//! itself — SIGTERM, SIGKILL halfway through the grace, or at once on a second SIGTERM — and
//! gets each one's completion out (`cancelled`, the container is stopping) before it exits, one
//! second before the grace ends. As PID 1 itself it also reaps every orphan (its reaper waits on
//! any child, and orphans are its children).

use std::time::Duration;

use crate::config::env::EnvLayers;

/// `docker stop`'s default grace.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(10);
/// The longest grace accepted (a day).
const MAX_STOP_GRACE_S: f64 = 86_400.0;
/// Why a workload stopped this way ended: its completion says so.
pub const REASON: &str = "the node's container is stopping";
/// The inode of the host's (initial) PID namespace, fixed by the kernel (`PROC_PID_INIT_INO`).
const INITIAL_PID_NAMESPACE: u64 = 0xEFFF_FFFC;

/// Why the node is in container mode (the start-up log says which).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// PID 1 of its PID namespace: `docker run IMAGE` with the node as entrypoint.
    Pid1,
    /// The child of its PID namespace's PID 1, an init or wrapper that exits when it does.
    Behind(Front),
    /// `CYBERWAVE_NODE_INIT=1`.
    Told,
}

/// PID 1 in front of the node: what it is, and the name it runs under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Front {
    pub kind: FrontKind,
    pub name: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrontKind {
    /// `docker run --init` (docker-init), podman's (catatonit, podman-init), tini, dumb-init.
    Init,
    /// A Python program (the pip package's wrapper, or one of the user's own).
    Python,
    /// A shell entrypoint script that runs the node without `exec`.
    Shell,
}

impl Mode {
    /// Orphans of the container become the node's children: only as PID 1 itself.
    pub fn reaps_orphans(&self) -> bool {
        matches!(self, Mode::Pid1)
    }

    /// For the start-up log: why the node counts as its container's main process.
    pub fn describe(&self) -> String {
        match self {
            Mode::Pid1 => "the node is PID 1 of its PID namespace".into(),
            Mode::Told => "CYBERWAVE_NODE_INIT=1".into(),
            Mode::Behind(f) => {
                let what = match f.kind {
                    FrontKind::Init => "an init in front of it",
                    FrontKind::Python => "a Python wrapper in front of it",
                    FrontKind::Shell => "a shell entrypoint in front of it",
                };
                format!(
                    "its parent {:?} is PID 1 of its PID namespace, {what}, and exits when the node does",
                    f.name
                )
            }
        }
    }
}

/// What PID 1 of the node's PID namespace is, as /proc shows it.
#[derive(Debug, Default, Clone)]
pub struct Pid1 {
    /// `/proc/1/comm` (for a script: the script's name).
    pub comm: String,
    /// The last part of `/proc/1/cmdline`'s first word (for a script: its interpreter).
    pub argv0: String,
    /// The last part of `/proc/1/exe`'s target, when it can be read (the same user, or root).
    pub exe: Option<String>,
}

impl Pid1 {
    fn read() -> Pid1 {
        let base = |p: &str| p.rsplit('/').next().unwrap_or(p).trim().to_string();
        let cmdline = std::fs::read("/proc/1/cmdline").unwrap_or_default();
        let first = cmdline.split(|b| *b == 0).next().unwrap_or_default();
        Pid1 {
            comm: std::fs::read_to_string("/proc/1/comm")
                .unwrap_or_default()
                .trim()
                .to_string(),
            argv0: base(&String::from_utf8_lossy(first)),
            exe: std::fs::read_link("/proc/1/exe")
                .ok()
                .map(|p| base(&p.to_string_lossy())),
        }
    }
}

/// Which kind of front a process of this name is, if it is one.
fn front_kind(name: &str) -> Option<FrontKind> {
    let name = name.trim_end_matches(" (deleted)");
    let python = name
        .strip_prefix("python")
        .is_some_and(|v| v.chars().all(|c| c.is_ascii_digit() || c == '.'));
    match name {
        "docker-init" | "podman-init" | "catatonit" | "tini" | "dumb-init" => Some(FrontKind::Init),
        _ if name.starts_with("tini-") => Some(FrontKind::Init),
        _ if python => Some(FrontKind::Python),
        "sh" | "bash" | "dash" | "ash" | "zsh" | "ksh" | "mksh" | "busybox" => {
            Some(FrontKind::Shell)
        }
        _ => None,
    }
}

/// PID 1 as an init or wrapper in front of the node, judged by its name, its command's first
/// word (a script's interpreter) and its executable.
pub fn classify(p: &Pid1) -> Option<Front> {
    [Some(&p.comm), Some(&p.argv0), p.exe.as_ref()]
        .into_iter()
        .flatten()
        .find_map(|n| {
            front_kind(n).map(|kind| Front {
                kind,
                name: n.clone(),
            })
        })
}

/// What the node sees of its place: its pid, its parent's, whether its PID namespace is not
/// the host's, and PID 1 when /proc is its own namespace's.
#[derive(Debug, Default, Clone)]
pub struct Place {
    pub pid: u32,
    pub ppid: u32,
    pub own_namespace: bool,
    pub pid1: Option<Pid1>,
}

impl Place {
    fn read() -> Place {
        use std::os::unix::fs::MetadataExt;
        let pid = std::process::id();
        let ppid = std::os::unix::process::parent_id();
        let own_namespace =
            std::fs::metadata("/proc/self/ns/pid").is_ok_and(|m| m.ino() != INITIAL_PID_NAMESPACE);
        // /proc/1 is this namespace's PID 1 only when /proc is this namespace's (it names this
        // process by its own pid), not the host's left mounted in a namespace of its own.
        let own_proc =
            std::fs::read_link("/proc/self").is_ok_and(|p| p.to_string_lossy() == pid.to_string());
        Place {
            pid,
            ppid,
            own_namespace,
            pid1: own_proc.then(Pid1::read),
        }
    }
}

/// What `CYBERWAVE_NODE_INIT` says: on, off, or nothing (unset or not a yes or a no).
fn init_flag(v: Option<&str>) -> Option<bool> {
    match v.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
        Some("1" | "true" | "yes" | "on") => Some(true),
        Some("0" | "false" | "no" | "off") => Some(false),
        _ => None,
    }
}

/// Container mode (D70): PID 1; else `CYBERWAVE_NODE_INIT` when it says yes or no; else an
/// init or wrapper as the parent that is PID 1 of a PID namespace not the host's.
pub fn decide(place: &Place, flag: Option<&str>) -> Option<Mode> {
    if place.pid == 1 {
        return Some(Mode::Pid1);
    }
    match init_flag(flag) {
        Some(true) => return Some(Mode::Told),
        Some(false) => return None,
        None => {}
    }
    if place.ppid != 1 || !place.own_namespace {
        return None;
    }
    place.pid1.as_ref().and_then(classify).map(Mode::Behind)
}

/// The node's container mode, from /proc and `CYBERWAVE_NODE_INIT`.
pub fn detect(env: &EnvLayers) -> Option<Mode> {
    decide(&Place::read(), env.value("CYBERWAVE_NODE_INIT").as_deref())
}

/// When the node is not in container mode but runs as the child of PID 1 of a PID namespace of
/// its own that it does not know (nor said no to): that PID 1's name, for a hint at start.
pub fn unknown_front(env: &EnvLayers) -> Option<String> {
    let place = Place::read();
    let flag = env.value("CYBERWAVE_NODE_INIT");
    if decide(&place, flag.as_deref()).is_some() || init_flag(flag.as_deref()).is_some() {
        return None;
    }
    if place.ppid != 1 || !place.own_namespace {
        return None;
    }
    let p = place.pid1?;
    (!matches!(p.comm.as_str(), "systemd" | "init" | "")).then_some(p.comm)
}

/// `CYBERWAVE_NODE_STOP_GRACE_SECONDS` (default 10 s, like `docker stop`); a value that is not a
/// number of seconds from 1 to a day is ignored with the default.
pub fn stop_grace(env: &EnvLayers) -> Duration {
    grace_of(env.value("CYBERWAVE_NODE_STOP_GRACE_SECONDS").as_deref())
}

fn grace_of(v: Option<&str>) -> Duration {
    v.and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|g| g.is_finite() && (1.0..=MAX_STOP_GRACE_S).contains(g))
        .map_or(DEFAULT_STOP_GRACE, Duration::from_secs_f64)
}

/// When the stop must be over: one second before the grace ends (at least half of it).
pub fn deadline_after(grace: Duration) -> Duration {
    grace
        .saturating_sub(Duration::from_secs(1))
        .max(kill_after(grace))
}

/// After how long a stopped workload that ignored SIGTERM gets SIGKILL: half the grace.
pub fn kill_after(grace: Duration) -> Duration {
    grace.checked_div(2).unwrap_or(grace)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn d58_the_grace_is_docker_stops_unless_told_and_hostile_values_fall_back() {
        assert_eq!(grace_of(None), DEFAULT_STOP_GRACE);
        assert_eq!(grace_of(Some("30")), Duration::from_secs(30));
        assert_eq!(grace_of(Some(" 2.5 ")), Duration::from_millis(2500));
        for bad in [
            "", "0", "0.5", "-3", "nan", "inf", "1e300", "86401", "ten", "5s",
        ] {
            assert_eq!(grace_of(Some(bad)), DEFAULT_STOP_GRACE, "{bad:?}");
        }
        assert_eq!(
            deadline_after(Duration::from_secs(10)),
            Duration::from_secs(9)
        );
        assert_eq!(
            deadline_after(Duration::from_secs(1)),
            Duration::from_millis(500)
        );
        assert_eq!(kill_after(Duration::from_secs(10)), Duration::from_secs(5));
    }

    fn pid1(comm: &str, argv0: &str, exe: Option<&str>) -> Pid1 {
        Pid1 {
            comm: comm.into(),
            argv0: argv0.into(),
            exe: exe.map(String::from),
        }
    }

    fn behind(p: Pid1) -> Place {
        Place {
            pid: 6,
            ppid: 1,
            own_namespace: true,
            pid1: Some(p),
        }
    }

    #[test]
    fn d58_init_mode_is_pid_1_or_an_explicit_yes() {
        let host = Place {
            pid: 4242,
            ppid: 1,
            own_namespace: false,
            pid1: Some(pid1("systemd", "systemd", None)),
        };
        for yes in ["1", "true", "YES", " on "] {
            assert_eq!(decide(&host, Some(yes)), Some(Mode::Told), "{yes:?}");
        }
        for no in [
            None,
            Some(""),
            Some("0"),
            Some("false"),
            Some("2"),
            Some("init"),
        ] {
            assert_eq!(decide(&host, no), None, "{no:?}");
        }
        let pid_1 = Place {
            pid: 1,
            ppid: 0,
            own_namespace: true,
            pid1: None,
        };
        assert_eq!(decide(&pid_1, None), Some(Mode::Pid1));
        assert_eq!(
            decide(&pid_1, Some("0")),
            Some(Mode::Pid1),
            "PID 1 is PID 1"
        );
        assert!(Mode::Pid1.reaps_orphans());
        assert!(!Mode::Told.reaps_orphans());
    }

    #[test]
    fn d70_an_init_or_wrapper_as_pid_1_in_front_of_the_node_is_container_mode() {
        let cases = [
            (pid1("docker-init", "docker-init", None), FrontKind::Init),
            (
                pid1("podman-init", "podman-init", Some("catatonit")),
                FrontKind::Init,
            ),
            (pid1("catatonit", "catatonit", None), FrontKind::Init),
            (pid1("tini", "tini", Some("tini")), FrontKind::Init),
            (pid1("tini-static", "tini-static", None), FrontKind::Init),
            (pid1("dumb-init", "dumb-init", None), FrontKind::Init),
            (
                pid1("python3", "python3", Some("python3.11")),
                FrontKind::Python,
            ),
            (pid1("python", "python", None), FrontKind::Python),
            // A script: its name as comm, its interpreter as the command's first word.
            (pid1("entrypoint.sh", "sh", Some("dash")), FrontKind::Shell),
            (pid1("start", "bash", None), FrontKind::Shell),
            (
                pid1("run-node", "run-node", Some("busybox")),
                FrontKind::Shell,
            ),
        ];
        for (p, kind) in cases {
            let mode = decide(&behind(p.clone()), None);
            assert!(
                matches!(&mode, Some(Mode::Behind(f)) if f.kind == kind),
                "{p:?}: {mode:?}"
            );
            let said = mode.map(|m| m.describe()).unwrap_or_default();
            assert!(said.contains("PID 1 of its PID namespace"), "{said}");
            assert!(!Mode::Behind(Front {
                kind,
                name: p.comm.clone()
            })
            .reaps_orphans());
        }
        // Not a front: a service manager, an unknown program, a look-alike name.
        for p in [
            pid1("systemd", "systemd", Some("systemd")),
            pid1("my-supervisor", "my-supervisor", None),
            pid1("pythonista", "pythonista", None),
            pid1("shell", "shell", None),
            pid1("", "", None),
        ] {
            assert_eq!(decide(&behind(p.clone()), None), None, "{p:?}");
        }
        let tini = pid1("tini", "tini", None);
        // Told no; not the child of PID 1; the host's namespace; /proc not its namespace's.
        assert_eq!(decide(&behind(tini.clone()), Some("0")), None);
        let mut p = behind(tini.clone());
        p.ppid = 7;
        assert_eq!(decide(&p, None), None);
        let mut p = behind(tini.clone());
        p.own_namespace = false;
        assert_eq!(decide(&p, None), None);
        let mut p = behind(tini);
        p.pid1 = None;
        assert_eq!(decide(&p, None), None);
    }
}
