//! The install script (D60): run once at start-up, before the node connects, with bash (sh when
//! there is no bash) in the working dir, in a process group of its own, its output to the node's
//! log and to `<state dir>/install_logs/`.
//!
//! - SIGTERM / SIGINT while it runs stop it at once: SIGTERM to its group, SIGKILL after the
//!   cleanup grace; then the node exits 0, as for any stop.
//! - It is over when its own process exits: its output is read until end of file or for at
//!   most [`OUTPUT_AFTER_EXIT`] more; a process that still holds the output then (`server &`
//!   without a redirection) is named in a WARN and start-up goes on.
//! - What it leaves running is a service (D59, started by `install`): the node is a subreaper
//!   while it runs, so everything it left stays below the node to be found.
//! - With `workload_user` it runs as that user (a pool's first), with that user's HOME, so what
//!   it installs in `$HOME` is where workloads look; `cloud_node.install_user: node` keeps it as
//!   the node's user.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, select, Receiver};

use crate::config::Settings;
use crate::error::StartupError;
use crate::signals::Signal;
use crate::store;
use crate::workload::services::{self, Found};
use crate::workload::user::WorkloadUser;
use crate::workload::{procinfo, reaper};

/// How long the install script's output is still read once its own process exited.
pub(super) const OUTPUT_AFTER_EXIT: Duration = Duration::from_secs(2);
/// What a process that kept the install's output after that may still write to its log file;
/// past it the output is read and dropped (never left to fill the pipe and block it).
const LATE_OUTPUT_BYTES: u64 = 1 << 20;

/// What the install script came to.
#[derive(Default)]
pub(super) struct Installed {
    /// Why it failed, when it did (reported to the backend, then the node exits).
    pub(super) failure: Option<String>,
    /// What it left running: services started by `install`.
    pub(super) services: Vec<Found>,
    /// Their processes that are the node's own children (re-parented to it while it was their
    /// subreaper): the node reaps them.
    pub(super) children: Vec<i32>,
}

/// One stream of the install's output, read on a thread of its own.
struct Pump {
    name: &'static str,
    /// The pipe's inode, to find who else holds it.
    inode: u64,
    /// The last lines that were not blank, once it reached end of file.
    done: Receiver<Vec<String>>,
}

/// Runs the install script `script`; `Err` only when a signal stopped it (exit 0).
pub(super) fn run(
    s: &Settings,
    script: &str,
    users: &[WorkloadUser],
    signals: &Receiver<Signal>,
) -> Result<Installed, StartupError> {
    let failed = |msg: String| {
        log::error!("{msg}");
        Ok(Installed {
            failure: Some(msg),
            ..Installed::default()
        })
    };
    let first = script.split_whitespace().next().unwrap_or("");
    if first.starts_with("./") || first.starts_with('/') || first.starts_with("../") {
        let p = s.working_dir.join(first);
        if !p.is_file() {
            return failed(format!(
                "install script {first} not found (looked for {})",
                p.display()
            ));
        }
    }
    let user = run_as(s, users);
    let log_dir = s.config_dir.value.join("install_logs");
    if let Err(e) = store::ensure_private_dir(&log_dir) {
        log::warn!(
            "cannot create {}: {e}; install output goes to the node's log only",
            log_dir.display()
        );
    }
    let shell = if Path::new("/bin/bash").exists() || Path::new("/usr/bin/bash").exists() {
        "bash"
    } else {
        "sh"
    };
    let mut cmd = command(s, shell, script, user);
    let started = procinfo::start_ticks(my_pid()).unwrap_or(0);
    let subreaper = Subreaper::on();
    let mut child = match reaper::spawn(&mut cmd) {
        Ok(c) => c,
        Err(e) => return failed(format!("cannot run the install script with {shell}: {e}")),
    };
    let pid = i32::try_from(child.id()).unwrap_or(0);
    let since = procinfo::start_ticks(pid).unwrap_or(started);
    let quiet = Arc::new(AtomicBool::new(false));
    let out = child
        .stdout
        .take()
        .and_then(|o| pump(o, "stdout", &log_dir, &quiet));
    let err = child
        .stderr
        .take()
        .and_then(|e| pump(e, "stderr", &log_dir, &quiet));
    let (exited_tx, exited) = bounded(1);
    let waiter = std::thread::Builder::new()
        .name("install-wait".into())
        .spawn(move || {
            let status = child.wait();
            reaper::waited(child.id());
            let _ = exited_tx.send(status);
        });
    if let Err(e) = waiter {
        return failed(format!("cannot wait for the install script: {e}"));
    }
    let status = match wait_or_stop(s, pid, &exited, signals) {
        Ok(st) => st,
        Err(stopped) => {
            // What it started in a session of its own outlives the stop: tracked by the next
            // node (its group got the signal, a session of its own did not).
            let (found, _) = left_behind(s, since);
            if !found.is_empty() {
                let now = Instant::now();
                let mut tracked = super::service_watch::Services::load(&s.config_dir.value, now);
                tracked.adopt(
                    found,
                    &super::service_watch::Origin::install(),
                    None,
                    &[],
                    now,
                );
            }
            return Err(stopped);
        }
    };
    let stderr_tail = drain(out, err, &quiet);
    let (found, children) = left_behind(s, since);
    drop(subreaper);
    let installed = Installed {
        failure: outcome(status, &stderr_tail),
        services: found,
        children,
    };
    Ok(installed)
}

/// Who runs the install script (D60): the workload user (a pool's first) unless
/// `install_user: node`.
fn run_as<'a>(s: &Settings, users: &'a [WorkloadUser]) -> Option<&'a WorkloadUser> {
    let as_node = s
        .manifest
        .as_ref()
        .and_then(|m| m.install_as_node)
        .unwrap_or(false);
    let user = users.first().filter(|_| !as_node);
    match (user, users.len()) {
        (Some(u), 1) => log::info!(
            "running the install script in {} as the workload user {} (uid {}, HOME {})",
            s.working_dir.display(),
            u.name,
            u.uid,
            u.home.display()
        ),
        (Some(u), n) => log::info!(
            "running the install script in {} as {} (uid {}, HOME {}), the first user of the workload_user pool of {n}: what it installs under HOME is that user's alone",
            s.working_dir.display(),
            u.name,
            u.uid,
            u.home.display()
        ),
        (None, _) if !users.is_empty() => log::info!(
            "running the install script in {} as the node's user (install_user: node); workloads run as the workload user and find only what it installs outside the node's HOME",
            s.working_dir.display()
        ),
        (None, _) => log::info!("running the install script in {}", s.working_dir.display()),
    }
    user
}

/// The install script's command: its own process group, the node's environment less its
/// secrets (with a user: that user's HOME, USER and LOGNAME, and its ids), no descriptor of the
/// node, an empty signal mask.
fn command(s: &Settings, shell: &str, script: &str, user: Option<&WorkloadUser>) -> Command {
    let mut env = s.env.merged();
    for k in crate::workload::NODE_ONLY_VARS {
        env.remove(*k);
    }
    if let Some(u) = user {
        env.insert("HOME".into(), u.home.display().to_string());
        env.insert("USER".into(), u.name.clone());
        env.insert("LOGNAME".into(), u.name.clone());
    }
    let mut cmd = Command::new(shell);
    cmd.arg("-c")
        .arg(script)
        .current_dir(&s.working_dir)
        .env_clear()
        .envs(&env)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A group of its own: a stop signals it as a whole (D60).
        .process_group(0);
    if let Some(ids) = user.map(WorkloadUser::ids) {
        // SAFETY: setgroups, setresgid and setresuid are async-signal-safe; the ids were made
        // before the fork.
        unsafe {
            cmd.pre_exec(move || crate::workload::user::drop_to(&ids));
        }
    }
    crate::fds::harden(&mut cmd);
    cmd
}

/// Reads one output stream of the install script: each line to the node's log (until `quiet`)
/// and to `install_logs/install.<name>.log`.
fn pump(
    stream: impl std::io::Read + std::os::fd::AsRawFd + Send + 'static,
    name: &'static str,
    log_dir: &Path,
    quiet: &Arc<AtomicBool>,
) -> Option<Pump> {
    let inode = pipe_inode(stream.as_raw_fd());
    let path = log_dir.join(format!("install.{name}.log"));
    let quiet = quiet.clone();
    let (done_tx, done) = bounded(1);
    // Not `std::thread::spawn`, which panics when no thread can be made (a pids limit
    // reached): then the stream is closed, and the script's writes to it fail.
    let spawned = std::thread::Builder::new()
        .name(format!("install-{name}"))
        .spawn(move || {
            let mut file = store::create_state_file(&path, 0o600).ok();
            let mut tail: Vec<String> = Vec::new();
            let mut late = 0u64;
            for line in BufReader::new(stream).split(b'\n').map_while(Result::ok) {
                let text = String::from_utf8_lossy(&line).into_owned();
                if quiet.load(Ordering::Relaxed) {
                    // What kept the output after the install ended: to its file, bounded.
                    late = late.saturating_add(u64::try_from(line.len()).unwrap_or(u64::MAX));
                    if late > LATE_OUTPUT_BYTES {
                        file = None;
                    }
                } else {
                    log::info!("[install {name}] {text}");
                }
                if let Some(f) = file.as_mut() {
                    let _ = writeln!(f, "{text}");
                }
                if !text.trim().is_empty() {
                    tail.push(text);
                    if tail.len() > 5 {
                        tail.remove(0);
                    }
                }
            }
            let _ = done_tx.send(tail);
        });
    spawned
        .map_err(|e| log::warn!("cannot read the install script's {name}: {e}"))
        .ok()
        .map(|_| Pump { name, inode, done })
}

/// Waits for the install script's own process to exit, or for SIGTERM / SIGINT, which stop it
/// (its group: SIGTERM, SIGKILL after the cleanup grace) and end start-up (exit 0).
fn wait_or_stop(
    s: &Settings,
    pid: i32,
    exited: &Receiver<std::io::Result<std::process::ExitStatus>>,
    signals: &Receiver<Signal>,
) -> Result<std::io::Result<std::process::ExitStatus>, StartupError> {
    loop {
        select! {
            recv(exited) -> st => {
                return Ok(st.unwrap_or_else(|_| Err(std::io::Error::other("its waiter thread ended"))));
            }
            recv(signals) -> sig => match sig {
                Ok(sig @ (Signal::Term | Signal::Int)) => {
                    stop(pid, s.tuning.cleanup_grace, exited, sig);
                    return Err(StartupError::Stopped(format!(
                        "{sig:?} received while the install script ran: it was stopped; the node exits"
                    )));
                }
                Ok(sig) => log::info!("{sig:?} while the install script runs: ignored"),
                Err(_) => return Ok(exited.recv().unwrap_or_else(|_| Err(std::io::Error::other("its waiter thread ended")))),
            }
        }
    }
}

/// SIGTERM to the install script's group, SIGKILL after `grace` to what is left of it.
fn stop(
    pid: i32,
    grace: Duration,
    exited: &Receiver<std::io::Result<std::process::ExitStatus>>,
    sig: Signal,
) {
    let (_, sid) = procinfo::own_group_and_session();
    // The group is signalled only while it has members in the node's session: its id cannot be
    // another's then.
    let signal = |s: i32| {
        if procinfo::group_members(pid, sid) > 0 {
            let _ = procinfo::signal_group(pid, s);
        }
    };
    log::info!(
        "{sig:?} received: stopping the install script (pid {pid}): SIGTERM to its process group, SIGKILL after {:.1}s",
        grace.as_secs_f64()
    );
    signal(libc::SIGTERM);
    let until = Instant::now().checked_add(grace);
    let mut reaped = until.and_then(|u| exited.recv_deadline(u).ok()).is_some();
    while until.is_some_and(|u| Instant::now() < u) && procinfo::group_members(pid, sid) > 0 {
        std::thread::sleep(Duration::from_millis(20));
    }
    if procinfo::group_members(pid, sid) > 0 {
        log::info!("the install script's group outlived its grace: SIGKILL");
        signal(libc::SIGKILL);
    }
    if !reaped {
        reaped = exited.recv_timeout(Duration::from_secs(1)).is_ok();
    }
    if !reaped {
        log::warn!("the install script (pid {pid}) did not end after SIGKILL");
    }
}

/// The install's output until end of file, or [`OUTPUT_AFTER_EXIT`] after its exit: what still
/// holds it then is named in a WARN, and no longer logged. Returns stderr's last lines.
fn drain(out: Option<Pump>, err: Option<Pump>, quiet: &AtomicBool) -> Vec<String> {
    let until = Instant::now()
        .checked_add(OUTPUT_AFTER_EXIT)
        .unwrap_or_else(Instant::now);
    let mut held = Vec::new();
    let mut stderr_tail = Vec::new();
    for p in [out, err].into_iter().flatten() {
        match p.done.recv_deadline(until) {
            Ok(tail) if p.name == "stderr" => stderr_tail = tail,
            Ok(_) => {}
            Err(_) => held.push(p),
        }
    }
    if held.is_empty() {
        return stderr_tail;
    }
    quiet.store(true, Ordering::Relaxed);
    let inodes: Vec<u64> = held.iter().map(|p| p.inode).collect();
    let holders = holders_of(&inodes);
    let names: Vec<&str> = held.iter().map(|p| p.name).collect();
    let who = if holders.is_empty() {
        "a process that cannot be named".to_string()
    } else {
        holders
            .iter()
            .map(|pid| format!("pid {pid} ({})", services::cmdline(*pid)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    log::warn!(
        "the install script ended, but {who} still holds its {} {}s later; start-up goes on without reading it (its further output goes to install_logs/, up to {} KiB). Redirect the output of what an install script starts in the background (`server > server.log 2>&1 &`)",
        names.join(" and "),
        OUTPUT_AFTER_EXIT.as_secs(),
        LATE_OUTPUT_BYTES / 1024
    );
    stderr_tail
}

/// The processes other than the node that hold a pipe of these inodes open.
fn holders_of(inodes: &[u64]) -> Vec<i32> {
    let me = my_pid();
    let wanted: Vec<String> = inodes.iter().map(|i| format!("pipe:[{i}]")).collect();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter(|pid| *pid != me)
        .filter(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
                fds.flatten().any(|fd| {
                    std::fs::read_link(fd.path())
                        .is_ok_and(|l| wanted.iter().any(|w| l.as_os_str() == w.as_str()))
                })
            })
        })
        .collect()
}

/// The inode of the pipe on descriptor `fd`.
fn pipe_inode(fd: i32) -> u64 {
    // SAFETY: fstat writes into a stat buffer we own.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &mut st) == 0 {
            st.st_ino
        } else {
            0
        }
    }
}

/// What the install script left running: the processes below the node (its subreaper) that
/// started after it did, one service per session, or per group for a job left in the node's
/// session (D59). With `services: stop` they are stopped now instead, and logged.
fn left_behind(s: &Settings, since: u64) -> (Vec<Found>, Vec<i32>) {
    let me = my_pid();
    let (_, sid) = procinfo::own_group_and_session();
    let procs = services::scan();
    let members: Vec<services::Proc> = services::descendants(&procs, me)
        .into_iter()
        .filter(|p| p.start >= since)
        .collect();
    let children: Vec<i32> = members
        .iter()
        .filter(|p| p.ppid == me)
        .map(|p| p.pid)
        .collect();
    let found = services::group(&members, sid);
    if s.keep_services() || found.is_empty() {
        return (found, children);
    }
    for f in &found {
        log::info!(
            "cleared pid {} ({}) the install script left running (cloud_node.services is stop)",
            f.pid,
            f.cmdline
        );
        services::signal(f, libc::SIGTERM);
    }
    let until = Instant::now().checked_add(s.tuning.cleanup_grace);
    while until.is_some_and(|u| Instant::now() < u) && found.iter().any(services::alive) {
        std::thread::sleep(Duration::from_millis(20));
    }
    for f in found.iter().filter(|f| services::alive(f)) {
        services::signal(f, libc::SIGKILL);
    }
    // The node's own children among them are reaped (they got SIGKILL at the latest).
    let mut left = children;
    for _ in 0..50 {
        left.retain(|pid| {
            // SAFETY: waitpid on one of this node's children, non-blocking.
            unsafe { libc::waitpid(*pid, std::ptr::null_mut(), libc::WNOHANG) == 0 }
        });
        if left.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (Vec::new(), left)
}

/// The failure the install script's exit status means, if any (with stderr's last lines).
fn outcome(
    status: std::io::Result<std::process::ExitStatus>,
    stderr_tail: &[String],
) -> Option<String> {
    match status {
        Ok(st) if st.success() => {
            log::info!("install script completed");
            None
        }
        Ok(st) => {
            let code = st
                .code()
                .map(|c| format!("exit code {c}"))
                .unwrap_or_else(|| format!("{st}"));
            let mut msg = format!("install script failed with {code}");
            if !stderr_tail.is_empty() {
                let tail = stderr_tail.join("\n");
                let chars: Vec<char> = tail.chars().collect();
                let from = chars.len().saturating_sub(1000);
                let tail: String = chars.into_iter().skip(from).collect();
                msg.push_str(&format!(": {tail}"));
            }
            log::error!("{msg}");
            Some(msg)
        }
        Err(e) => {
            let msg = format!("install script: cannot wait for it: {e}");
            log::error!("{msg}");
            Some(msg)
        }
    }
}

fn my_pid() -> i32 {
    i32::try_from(std::process::id()).unwrap_or(0)
}

/// The node is the subreaper of what the install script starts, while it runs (D60): an orphan
/// of the script is re-parented to the node, so what it left running can be found. Not when the
/// node is PID 1, which adopts every orphan anyway.
struct Subreaper(bool);

impl Subreaper {
    fn on() -> Subreaper {
        if my_pid() == 1 {
            return Subreaper(false);
        }
        // SAFETY: prctl with plain integer arguments.
        Subreaper(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } == 0)
    }
}

impl Drop for Subreaper {
    fn drop(&mut self) {
        if self.0 {
            // SAFETY: prctl with plain integer arguments.
            unsafe {
                libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0);
            }
        }
    }
}
