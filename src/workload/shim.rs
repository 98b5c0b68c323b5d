//! `cyberwave-cloud-node __shim`: the supervisor between the node and a workload (conmon-style).
//!
//! 1. Detaches into its own session (`setsid`), so nothing that happens to the node (SIGKILL,
//!    `systemctl restart`, an upgrade) reaches it or the workload.
//! 2. Starts the workload in a process group of its own, with stdout/stderr on the log files.
//!    The shim is *not* in that group: a cancel that SIGKILLs the group cannot kill the shim,
//!    so the exit record is always written.
//! 3. Tells the node the workload's pid on its stdout, records pid and start times in
//!    `started.json` (what a restarted node re-adopts it by), and closes that channel.
//! 4. Waits for the workload, reaping every orphan it adopts (it is their subreaper) as soon as
//!    that one ends, then writes `exit.json` atomically and exits. On a full disk it leaves the
//!    status in `exit.status` instead and exits at once (D54: see [`EXIT_LINK`]).
//!
//! The signals the node handles are caught by a handler that does nothing (blocked until it is
//! set): the shim shrugs off SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2; the workload starts with
//! an empty mask and default dispositions (exec resets a caught signal).

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::{procinfo, services};
use crate::{store, util};

/// Written by the shim once the workload runs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Started {
    pub pid: i32,
    pub start_ticks: u64,
    pub shim_pid: i32,
    pub shim_start_ticks: u64,
    pub boot_id: String,
    pub started_at: String,
}

/// Written by the shim when the workload ended.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Exit {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    pub started_at: String,
    pub ended_at: String,
}

impl Exit {
    /// The exit code as the protocol reports it: a signal N is `-N`.
    pub fn code(&self) -> i32 {
        match (self.exit_code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => s.saturating_neg(),
            (None, None) => -1,
        }
    }
}

/// Where the shim leaves the exit status when `exit.json` cannot be written (D54: the state
/// dir's disk is full, typically filled by the workload's own log): a symbolic link in the
/// workload's directory whose target is the status ([`Exit::link_text`]). A full disk still
/// takes one: a short link target lives in the inode (ext4, xfs) or, on tmpfs, outside the size
/// limit, so it needs no free data block, only a free inode.
pub const EXIT_LINK: &str = "exit.status";

/// The shim's own exit code when it left the status in [`EXIT_LINK`] instead of `exit.json`
/// (0: `exit.json` written; 1: nothing to write to any more, the directory is gone).
pub const EXIT_IN_LINK: i32 = 3;

impl Exit {
    /// The status as [`EXIT_LINK`]'s target: `v1 exit=N`, `v1 signal=N` or `v1 unknown` (at
    /// most a few dozen bytes, so that it fits in an inode; the times are not kept).
    pub fn link_text(&self) -> String {
        match (self.exit_code, self.signal) {
            (Some(c), _) => format!("v1 exit={c}"),
            (None, Some(s)) => format!("v1 signal={s}"),
            (None, None) => "v1 unknown".to_string(),
        }
    }

    /// The status read back from [`EXIT_LINK`]'s target; `None` unless it is exactly what
    /// [`Exit::link_text`] writes, with an exit code 0–255 or a signal 1–64.
    pub fn from_link_text(text: &str) -> Option<Exit> {
        let exit = |exit_code, signal| Exit {
            exit_code,
            signal,
            started_at: String::new(),
            ended_at: String::new(),
        };
        let rest = text.strip_prefix("v1 ")?;
        if rest == "unknown" {
            return Some(exit(None, None));
        }
        let number = |digits: &str, range: std::ops::RangeInclusive<i32>| {
            (!digits.is_empty() && digits.len() <= 3 && digits.bytes().all(|b| b.is_ascii_digit()))
                .then(|| digits.parse::<i32>().ok())
                .flatten()
                .filter(|n| range.contains(n))
        };
        if let Some(c) = rest.strip_prefix("exit=") {
            return number(c, 0..=255).map(|c| exit(Some(c), None));
        }
        let s = rest.strip_prefix("signal=")?;
        number(s, 1..=64).map(|s| exit(None, Some(s)))
    }
}

/// Leaves `exit` in `dir`/[`EXIT_LINK`] (replacing whatever is there: a new link under a
/// temporary name, renamed over it), then syncs the directory as far as it can.
fn write_exit_link(dir: &Path, exit: &Exit) -> std::io::Result<()> {
    let tmp = dir.join(format!(
        ".{EXIT_LINK}.tmp-{}",
        util::hex(&util::random_bytes::<4>())
    ));
    std::os::unix::fs::symlink(exit.link_text(), &tmp)?;
    if let Err(e) = std::fs::rename(&tmp, dir.join(EXIT_LINK)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

pub struct ShimArgs {
    pub dir: PathBuf,
    pub cwd: PathBuf,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    pub shell: String,
    pub command: String,
    /// How long what is left of the group after the workload's exit gets between SIGTERM and
    /// SIGKILL (D25).
    pub cleanup_grace_ms: u64,
    /// D59: what the workload put in a session of its own is left running (`services: keep`,
    /// the default); false clears it too. Passed as `MS:stop` in the grace argument.
    pub keep_services: bool,
    /// D46.3: the ids the workload runs as (None: the supervisor's own).
    pub user: Option<super::user::Ids>,
}

/// Without the argument (a node of an older version started this shim): 10 s.
const DEFAULT_CLEANUP_GRACE_MS: u64 = 10_000;

impl ShimArgs {
    pub fn to_args(&self) -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> = vec![
            "__shim".into(),
            self.dir.clone().into(),
            self.cwd.clone().into(),
            self.stdout.clone().into(),
            self.stderr.clone().into(),
            self.shell.clone().into(),
            self.command.clone().into(),
            if self.keep_services {
                self.cleanup_grace_ms.to_string()
            } else {
                format!("{}:stop", self.cleanup_grace_ms)
            }
            .into(),
        ];
        if let Some(ids) = &self.user {
            let groups: Vec<String> = ids.groups.iter().map(u32::to_string).collect();
            v.push(format!("{}:{}:{}", ids.uid, ids.gid, groups.join(",")).into());
        }
        v
    }

    pub fn parse(args: &[String]) -> Option<ShimArgs> {
        let (args, user) = match args {
            [rest @ .., user] if args.len() == 8 => (rest, Some(super::user::parse_arg(user)?)),
            _ => (args, None),
        };
        let (fixed, (grace, keep_services)) = match args {
            [fixed @ .., grace] if args.len() == 7 => (fixed, parse_grace(grace)?),
            fixed => (fixed, (DEFAULT_CLEANUP_GRACE_MS, true)),
        };
        match fixed {
            [dir, cwd, out, err, shell, command] => Some(ShimArgs {
                dir: dir.into(),
                cwd: cwd.into(),
                stdout: out.into(),
                stderr: err.into(),
                shell: shell.clone(),
                command: command.clone(),
                cleanup_grace_ms: grace,
                keep_services,
                user,
            }),
            _ => None,
        }
    }
}

/// The grace argument: `MS` (services kept) or `MS:stop`.
fn parse_grace(arg: &str) -> Option<(u64, bool)> {
    match arg.split_once(':') {
        Some((ms, "stop")) => Some((ms.parse().ok()?, false)),
        Some(_) => None,
        None => Some((arg.parse().ok()?, true)),
    }
}

/// How long a supervisor waits, when its workload left processes in its session, before it
/// looks at them again (a service may still be on its way to a session of its own).
const SETTLE: std::time::Duration = std::time::Duration::from_millis(50);

/// Terminates what is left of the workload (D25): its process group `pgid`, every other
/// process in this shim's session `me` (a job the workload put in a group of its own), and,
/// unless `keep_services`, every child of this shim in another session too. With
/// `services: keep` (D59) an orphan re-parented here that left the session (`setsid`) is a
/// service, and stays. SIGTERM, up to `grace` for them to go, then SIGKILL, again at each look
/// for what is left; re-parented orphans are reaped as it waits. Returns once nothing is left
/// (or 5 s after SIGKILL), with what it cleared (the first [`services::MAX_LISTED`], and how
/// many more) for the node's log, and its last look at the processes.
fn clear_group(
    pgid: i32,
    me: i32,
    grace: std::time::Duration,
    keep_services: bool,
) -> ((Vec<services::Cleared>, u64), Vec<services::Proc>) {
    use std::cell::RefCell;
    use std::time::{Duration, Instant};
    let named = Named::default();
    let reap = || {
        // SAFETY: non-blocking wait for any child; a null status pointer is allowed.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
    };
    // The last look at /proc, kept: where the services are found once nothing else is left.
    let last: RefCell<Vec<services::Proc>> = RefCell::default();
    let left = || -> Vec<services::Proc> {
        let procs = services::scan();
        let out = procs
            .iter()
            .filter(|p| p.pid != me && p.pid > 1)
            .filter(|p| p.sid == me || (!keep_services && p.ppid == me))
            .copied()
            .collect();
        *last.borrow_mut() = procs;
        out
    };
    let note = |p: &services::Proc| named.note(p, me);
    let signal_these = |procs: Vec<services::Proc>, sig: i32| {
        for p in procs {
            note(&p);
            // SAFETY: kill on a pid found a moment ago in this shim's session or among its
            // children (a child's pid cannot be reused before this shim reaps it).
            unsafe {
                libc::kill(p.pid, sig);
            }
        }
    };
    let signal_left = |sig: i32| signal_these(left(), sig);
    let signal_all = |sig: i32| {
        // Named before the group signal ends them.
        let procs = left();
        procs.iter().for_each(note);
        // The group as a whole only while a member of it is still in this session: the
        // workload's leader was reaped already, so once the group is empty its id may be
        // another's (D26). Members are in the session, so `signal_these` reaches them anyway;
        // the group signal also catches what they fork meanwhile.
        if procinfo::group_members(pgid, me) > 0 {
            let _ = procinfo::signal_group(pgid, sig);
        }
        signal_these(procs, sig);
    };
    // `again`: what turns up meanwhile gets that signal too (a process that appears only once
    // another is killed, re-parented here from outside the session, say); by its pid, found in
    // the session or among the children, not by the group, whose id may be free by then.
    let wait_empty = |limit: Duration, again: Option<i32>| {
        let until = Instant::now().checked_add(limit);
        loop {
            reap();
            if left().is_empty() || until.is_none_or(|u| Instant::now() >= u) {
                reap();
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
            if let Some(sig) = again {
                signal_left(sig);
            }
        }
    };
    // A process the workload started just before it ended may not have left the session yet
    // (`setsid server &` as a script's last line: the child runs `setsid` a moment after the
    // fork): with services kept, it is looked at once more before anything is signalled.
    if keep_services && !left().is_empty() {
        std::thread::sleep(SETTLE);
    }
    if !left().is_empty() {
        signal_all(libc::SIGTERM);
        wait_empty(grace, None);
        if !left().is_empty() {
            signal_all(libc::SIGKILL);
            wait_empty(Duration::from_secs(5), Some(libc::SIGKILL));
        }
    }
    reap();
    (named.into_cleared(), last.into_inner())
}

/// What a supervisor cleared, each named once (pid and command line, read before the signal)
/// for the node's log: the first [`services::MAX_LISTED`], then only counted.
#[derive(Default)]
struct Named {
    listed: std::cell::RefCell<std::collections::BTreeMap<i32, services::Cleared>>,
    more: std::cell::RefCell<std::collections::BTreeSet<i32>>,
}

impl Named {
    fn note(&self, p: &services::Proc, me: i32) {
        let mut listed = self.listed.borrow_mut();
        if listed.contains_key(&p.pid) || self.more.borrow().contains(&p.pid) {
            return;
        }
        let cleared = services::Cleared {
            pid: p.pid,
            cmdline: services::cmdline(p.pid),
            own_session: p.sid != me,
        };
        let _ = writeln!(
            std::io::stderr(),
            "clearing pid {} ({}){}",
            cleared.pid,
            cleared.cmdline,
            if cleared.own_session {
                ", a service (services: stop)"
            } else {
                ""
            }
        );
        if listed.len() < services::MAX_LISTED {
            listed.insert(p.pid, cleared);
        } else {
            self.more.borrow_mut().insert(p.pid);
        }
    }

    fn into_cleared(self) -> (Vec<services::Cleared>, u64) {
        let more = u64::try_from(self.more.into_inner().len()).unwrap_or(u64::MAX);
        (self.listed.into_inner().into_values().collect(), more)
    }
}

/// D59: leaves what the workload left (the services kept, the processes cleared) in
/// `left.json` for the node, which logs it and tracks the services; nothing when it left
/// nothing. A record that cannot be written is only noted in `shim.log`.
fn record_left(
    a: &ShimArgs,
    me: i32,
    (cleared, procs): ((Vec<services::Cleared>, u64), Vec<services::Proc>),
) {
    let mut found = if a.keep_services {
        services::below_supervisor(&procs, me)
    } else {
        Vec::new()
    };
    for f in &found {
        let _ = writeln!(
            std::io::stderr(),
            "keeping pid {} ({}): a service, in a session of its own",
            f.pid,
            f.cmdline
        );
    }
    found.truncate(services::MAX_LISTED);
    let left = services::Left {
        services: found,
        cleared: cleared.0,
        more_cleared: cleared.1,
    };
    if left.is_empty() {
        // Nothing to say: and no record planted beforehand speaks for this shim.
        let _ = std::fs::remove_file(a.dir.join(services::LEFT_FILE));
        return;
    }
    let written = serde_json::to_vec(&left)
        .map_err(std::io::Error::other)
        .and_then(|json| store::write_atomic(&a.dir.join(services::LEFT_FILE), &json, 0o600));
    if let Err(e) = written {
        let _ = writeln!(
            std::io::stderr(),
            "cannot write {}: {e}",
            services::LEFT_FILE
        );
    }
}

/// Waits for the workload's own process `pid`, reaping every other child as soon as it ends:
/// as a subreaper this shim adopts the workload's orphans, and one that ends while the workload
/// runs must not stay a zombie until the workload ends. `None` when there is nothing to wait for.
fn wait_workload(pid: i32) -> Option<std::process::ExitStatus> {
    loop {
        let mut status = 0;
        // SAFETY: waitpid on any child with a valid out pointer.
        let got = unsafe { libc::waitpid(-1, &mut status, 0) };
        if got == pid {
            return Some(std::process::ExitStatus::from_raw(status));
        }
        if got > 0 {
            continue; // an adopted orphan, reaped
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return None; // ECHILD: cannot happen while the workload is unreaped
        }
    }
}

fn open_log(path: &Path) -> std::io::Result<std::fs::File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
}

/// The shim's `main`. Its stdout is a pipe to the node: one line, `pid N` or `error: …`.
pub fn run(args: &[String]) -> i32 {
    let Some(a) = ShimArgs::parse(args) else {
        let _ = writeln!(
            std::io::stdout(),
            "error: usage: __shim DIR CWD STDOUT STDERR SHELL COMMAND"
        );
        return 2;
    };
    // D46.1: nothing the node held open (its broker socket, its lock) reaches the workload,
    // whatever the node's libraries forgot to mark close-on-exec.
    crate::fds::close_inherited();
    // D51: the node's signals caught and ignored here, nothing blocked or ignored for the
    // workload, without a hook between fork and exec.
    if let Err(e) = crate::signals::shrug_off_handled() {
        let _ = writeln!(std::io::stdout(), "error: cannot set up signals: {e}");
        return 1;
    }
    // SAFETY: setsid has no memory-safety preconditions.
    unsafe {
        libc::setsid();
        // Orphans of the workload are re-parented to the shim, which reaps them while it
        // clears the group (D25).
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    }
    let (pid, started_at) = match spawn_workload(&a) {
        Ok(started) => started,
        Err(code) => return code,
    };
    let me = std::process::id() as i32;
    report_start(&a, pid, me, &started_at);
    // Reaped here (wait_workload), whatever else exits meanwhile.
    let status = wait_workload(pid);
    // D25: nothing of the workload outlives its report but its services (D59).
    let cleared = clear_group(
        pid,
        me,
        std::time::Duration::from_millis(a.cleanup_grace_ms),
        a.keep_services,
    );
    record_left(&a, me, cleared);
    let exit = Exit {
        exit_code: status.and_then(|s| s.code()),
        signal: status.and_then(|s| s.signal()),
        started_at,
        ended_at: util::rfc3339(SystemTime::now()),
    };
    record_exit(&a, &exit)
}

/// Starts the workload's command (`bash -c COMMAND`: bash execs a lone simple command itself)
/// in its own process group, as its user, its output to its log files; returns it and its
/// start time, or (after an `error:` line to the node) the shim's exit code.
fn spawn_workload(a: &ShimArgs) -> Result<(i32, String), i32> {
    let (out, err) = match (open_log(&a.stdout), open_log(&a.stderr)) {
        (Ok(o), Ok(e)) => (o, e),
        (Err(e), _) | (_, Err(e)) => {
            let _ = writeln!(std::io::stdout(), "error: cannot open the log files: {e}");
            return Err(1);
        }
    };
    let mut cmd = Command::new(&a.shell);
    cmd.arg("-c")
        .arg(&a.command)
        .current_dir(&a.cwd)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        // D25: its own process group, which a cancel signals as a whole.
        .process_group(0);
    // D46.1, D51: the shim holds no descriptor but its own (close-on-exec) and blocks or
    // ignores no signal (`shrug_off_handled`), so std starts the workload with `posix_spawn`
    // and it gets only its three streams, no signal blocked or ignored.
    if let Some(ids) = a.user.clone() {
        // SAFETY: setgroups, setresgid and setresuid are async-signal-safe; nothing is
        // allocated (the ids were parsed before the fork).
        unsafe {
            // D46.3: the workload's own uid and groups; an exec that cannot drop them fails.
            cmd.pre_exec(move || super::user::drop_to(&ids));
        }
        crate::fds::harden(&mut cmd);
    }
    let started_at = util::rfc3339(SystemTime::now());
    // Reaped by wait_workload, not through the `Child` (which would wait for that pid alone);
    // dropping it neither waits nor kills.
    match cmd.spawn().map(|c| i32::try_from(c.id())) {
        Ok(Ok(pid)) => Ok((pid, started_at)),
        Ok(Err(e)) => {
            let _ = writeln!(std::io::stdout(), "error: {e}");
            Err(1)
        }
        Err(e) => {
            let _ = writeln!(
                std::io::stdout(),
                "error: cannot start {} in {}: {e}",
                a.shell,
                a.cwd.display()
            );
            Err(1)
        }
    }
}

/// Tells the node the workload's pid, records its start for a restarted node, and closes the
/// channel to the node.
fn report_start(a: &ShimArgs, pid: i32, me: i32, started_at: &str) {
    {
        // The pid first: the node is waiting for it (it reads the start times from /proc itself).
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "pid {pid}");
        let _ = stdout.flush();
    }
    let started = Started {
        pid,
        start_ticks: procinfo::start_ticks(pid).unwrap_or(0),
        shim_pid: me,
        shim_start_ticks: procinfo::start_ticks(me).unwrap_or(0),
        boot_id: procinfo::boot_id(),
        started_at: started_at.to_string(),
    };
    // The record a restarted node re-adopts the workload by.
    if let Ok(json) = serde_json::to_vec(&started) {
        let _ = store::write_atomic(&a.dir.join("started.json"), &json, 0o600);
    }
    // Close the channel to the node: from here on the shim owes the node nothing.
    if let Ok(null) = OpenOptions::new().write(true).open("/dev/null") {
        use std::os::fd::AsRawFd;
        // SAFETY: dup2 onto fd 1 with a valid open descriptor.
        unsafe {
            libc::dup2(null.as_raw_fd(), 1);
        }
    }
}

/// Writes the exit record (D54: left in [`EXIT_LINK`] when the disk is full); returns the
/// shim's exit code.
fn record_exit(a: &ShimArgs, exit: &Exit) -> i32 {
    let Ok(json) = serde_json::to_vec(exit) else {
        return 1;
    };
    let path = a.dir.join("exit.json");
    match store::write_atomic(&path, &json, 0o600) {
        Ok(()) => return 0,
        Err(_) if !a.dir.is_dir() => return 1,
        Err(_) => {}
    }
    // D54: the disk is full (most likely the workload's own log filled it, and only the
    // workload's completion makes the node free that). Waiting here for space would hold back
    // the completion for ever, so the status is handed over now: left in `exit.status`, which
    // needs no free data block, and the shim exits with EXIT_IN_LINK. The node (which reaps
    // this shim, or, restarted, finds the workload's group and supervisor gone) reads it from
    // there, reports from memory, and writes `exit.json` from it once it can; the link stays
    // until then, so a node restart while the disk is still full does not lose the status.
    if write_exit_link(&a.dir, exit).is_ok() {
        let _ = writeln!(
            std::io::stderr(),
            "cannot write {}: status left in {EXIT_LINK}",
            path.display()
        );
        return EXIT_IN_LINK;
    }
    // Not even an inode left: the status is never lost (D28). Until a record is written the
    // shim stays, so the node keeps the workload and learns its end once space comes back.
    loop {
        std::thread::sleep(std::time::Duration::from_secs(1));
        match store::write_atomic(&path, &json, 0o600) {
            Ok(()) => return 0,
            Err(_) if !a.dir.is_dir() => return 1,
            Err(_) if write_exit_link(&a.dir, exit).is_ok() => return EXIT_IN_LINK,
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(keep_services: bool, user: bool) -> ShimArgs {
        ShimArgs {
            dir: "/d".into(),
            cwd: "/c".into(),
            stdout: "/o".into(),
            stderr: "/e".into(),
            shell: "bash".into(),
            command: "python3 preview.py".into(),
            cleanup_grace_ms: 1500,
            keep_services,
            user: user.then(|| super::super::user::Ids {
                uid: 7,
                gid: 8,
                groups: vec![8, 9],
            }),
        }
    }

    fn round_trip(a: &ShimArgs) -> ShimArgs {
        let text: Vec<String> = a
            .to_args()
            .iter()
            .skip(1)
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        ShimArgs::parse(&text).unwrap()
    }

    #[test]
    fn whether_services_are_kept_travels_with_the_grace() {
        for (keep, user) in [(true, false), (false, false), (true, true), (false, true)] {
            let back = round_trip(&args(keep, user));
            assert_eq!(back.keep_services, keep);
            assert_eq!(back.cleanup_grace_ms, 1500);
            assert_eq!(back.user.is_some(), user);
        }
        assert_eq!(parse_grace("10"), Some((10, true)));
        assert_eq!(parse_grace("10:stop"), Some((10, false)));
        assert_eq!(parse_grace("10:keep"), None);
        assert_eq!(parse_grace(":stop"), None);
        // Without the argument (an older node's shim): 10 s, services kept.
        let six: Vec<String> = ["/d", "/c", "/o", "/e", "bash", "true"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let a = ShimArgs::parse(&six).unwrap();
        assert_eq!((a.cleanup_grace_ms, a.keep_services), (10_000, true));
    }
}
