//! What /proc says about processes: start times (to tell a recycled pid from the original),
//! the boot id (to tell a reboot), and whether a process group still has members.

/// The kernel's boot id; changes on every boot.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// A /proc file's text in one read where it fits in 1 KiB (`/proc/<pid>/stat` does): /proc
/// files say they are empty, so `fs::read_to_string` would grow its buffer from 32 bytes, a read
/// each time (this is on a start's path). Bytes that are not UTF-8 (a process
/// may name itself anything, `prctl(PR_SET_NAME)`) are replaced, not an error: a workload that
/// names itself so must not drop out of the scans that find it (D25, D26).
pub(crate) fn read_proc(path: impl AsRef<std::path::Path>) -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::with_capacity(1024);
    std::fs::File::open(path)?.read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// (state char, start time in clock ticks since boot) from /proc/<pid>/stat.
fn stat(pid: i32) -> Option<(char, u64)> {
    let text = read_proc(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    let rest = text.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    let start = fields.get(19)?.parse().ok()?; // field 22 overall
    Some((state, start))
}

pub fn start_ticks(pid: i32) -> Option<u64> {
    stat(pid).map(|(_, s)| s)
}

/// The process `pid` exists, is not a zombie, and started at `start` (same process, not a
/// recycled pid).
pub fn same_process_alive(pid: i32, start: u64) -> bool {
    matches!(stat(pid), Some((state, s)) if s == start && live(pid, state))
}

/// Whether process `pid`, in `state` (its /proc stat state), still runs code: anything but a
/// dead one or a zombie, and a zombie whose other threads still run. A process whose main
/// thread ends by the raw `exit` system call shows as `Z` while its other threads go on (the
/// kernel reports it to its parent only once they end): it must not pass for gone.
pub(crate) fn live(pid: i32, state: char) -> bool {
    match state {
        'X' => false,
        'Z' => {
            std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|rd| rd.take(2).count() > 1)
        }
        _ => true,
    }
}

/// The process `pid`, started at `start`, is stopped by a signal (state `T`; not a ptrace
/// stop, which SIGCONT does not end).
pub fn stopped(pid: i32, start: u64) -> bool {
    matches!(stat(pid), Some(('T', s)) if s == start)
}

/// Sends `sig` to process `pid` if it is still the one that started at `start`: checked
/// through a pidfd, so the signal cannot reach a process that got the pid after the check
/// (where the kernel has no pidfds, a check right before `kill`).
pub fn signal_process(pid: i32, start: u64, sig: i32) -> std::io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    if pid <= 1 {
        return Err(std::io::Error::other("refusing to signal pid ≤ 1"));
    }
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor that nothing else
    // owns (or -1), which the OwnedFd then closes.
    let fd = unsafe {
        let rc = libc::syscall(libc::SYS_pidfd_open, pid, 0);
        i32::try_from(rc)
            .ok()
            .filter(|fd| *fd >= 0)
            .map(|fd| OwnedFd::from_raw_fd(fd))
    };
    let Some(fd) = fd else {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENOSYS) && same_process_alive(pid, start) {
            // A kernel without pidfds (before 5.3): checked a moment before the kill.
            // SAFETY: kill with a positive pid, checked above.
            return match unsafe { libc::kill(pid, sig) } {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            };
        }
        return Err(err);
    };
    // The pidfd names one process from now on: is it the one that started at `start`?
    if start_ticks(pid) != Some(start) {
        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
    }
    // SAFETY: pidfd_send_signal on a pidfd we own, no siginfo, no flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The state char that follows the command name in a /proc stat text.
fn state_of(stat: &str) -> Option<char> {
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .next()?
        .chars()
        .next()
}

/// (process group, session) of `pid`, from the fields after the command name in
/// /proc/<pid>/stat; None when it cannot be read or parsed.
fn group_and_session(stat: &str) -> Option<(i32, i32)> {
    let rest = stat.get(stat.rfind(')')?.checked_add(1)?..)?;
    let mut fields = rest.split_whitespace();
    // state, ppid, pgrp, session
    let pgrp = fields.nth(2)?.parse().ok()?;
    let session = fields.next()?.parse().ok()?;
    Some((pgrp, session))
}

/// This process's group and session ids.
pub fn own_group_and_session() -> (i32, i32) {
    // SAFETY: getpgrp and getsid(0) have no preconditions and touch no memory.
    unsafe { (libc::getpgrp(), libc::getsid(0)) }
}

/// How many live processes are in process group `pgid` AND session `sid` (a scan of /proc).
///
/// This is how the node proves a workload's group is still its own (D26, D27): the workload's
/// group lives in the session its supervisor created, and the kernel never hands out a pid
/// that is still some process's group or session id. A recycled pid that became a new group
/// (`setsid`) has its own session, so it never matches; an emptied group matches nothing.
///
/// `sid` may be 1 or 0: the node's own session when it runs as a container's first process
/// (session 1), or when its session leader is outside its pid namespace (`/proc` shows 0, as
/// for a command started by `docker exec`). The install script's group lives there.
pub fn group_members(pgid: i32, sid: i32) -> usize {
    if pgid <= 1 || sid < 0 {
        return 0;
    }
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return 0;
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter_map(|pid| {
            read_proc(format!("/proc/{pid}/stat"))
                .ok()
                .map(|t| (pid, t))
        })
        .filter(|(pid, text)| {
            group_and_session(text) == Some((pgid, sid))
                && state_of(text).is_some_and(|st| live(*pid, st))
        })
        .count()
}

/// Live processes (not zombies, unless threads of theirs still run) other than `me` that are in
/// session `me` or are children of `me`: what a supervisor (session leader and subreaper) must
/// clear when its workload ends.
pub fn leftovers(me: i32) -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter(|pid| *pid != me && *pid > 1)
        .filter(|pid| {
            let Ok(text) = read_proc(format!("/proc/{pid}/stat")) else {
                return false;
            };
            let Some(rest) = text
                .rfind(')')
                .and_then(|i| text.get(i.saturating_add(1)..))
            else {
                return false;
            };
            let f: Vec<&str> = rest.split_whitespace().take(4).collect();
            let (Some(state), Some(ppid), Some(session)) = (f.first(), f.get(1), f.get(3)) else {
                return false;
            };
            let ours = ppid.parse() == Ok(me) || session.parse() == Ok(me);
            ours && state.chars().next().is_some_and(|st| live(*pid, st))
        })
        .collect()
}

/// Some process is still in process group `pgid`.
pub fn group_alive(pgid: i32) -> bool {
    if pgid <= 1 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pgid.saturating_neg(), 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Sends `sig` to process group `pgid`.
pub fn signal_group(pgid: i32, sig: i32) -> std::io::Result<()> {
    if pgid <= 1 {
        return Err(std::io::Error::other(
            "refusing to signal process group ≤ 1",
        ));
    }
    // SAFETY: kill with a negative pid targets exactly that group.
    if unsafe { libc::kill(pgid.saturating_neg(), sig) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGHUP => "SIGHUP",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        _ => "signal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_named_in_bytes_that_are_not_utf8_is_still_read() {
        let named = crate::scratch::NamedThread::new(c"\xff\xfe)x");
        let tid = named.tid;
        assert!(
            std::fs::read_to_string(format!("/proc/{tid}/stat")).is_err(),
            "not text"
        );
        assert!(start_ticks(tid).is_some_and(|t| t > 0));
        assert!(same_process_alive(tid, start_ticks(tid).unwrap()));
    }

    #[test]
    fn a_proc_file_over_its_first_read_is_read_whole() {
        // /proc/self/status is over 1 KiB, its context switches near its end (kernels with
        // user shadow stacks add lines after them).
        let text = read_proc("/proc/self/status").unwrap();
        assert!(text.len() > 1024, "{}", text.len());
        assert!(text.starts_with("Name:") && text.ends_with('\n'), "{text}");
        assert!(text.contains("\nnonvoluntary_ctxt_switches:"), "{text}");
        assert!(read_proc("/proc/no-such-file").is_err());
    }

    #[test]
    fn knows_itself() {
        let me = std::process::id() as i32;
        let start = start_ticks(me).unwrap();
        assert!(same_process_alive(me, start));
        assert!(
            !same_process_alive(me, start + 1),
            "another start time is another process"
        );
        assert!(!boot_id().is_empty());
        assert!(!group_alive(0) && !group_alive(1));
    }

    #[test]
    fn group_members_match_group_and_session_together() {
        // SAFETY: getpgrp/getsid have no preconditions.
        let (pgrp, sid) = unsafe { (libc::getpgrp(), libc::getsid(0)) };
        if pgrp > 1 && sid > 1 {
            assert!(group_members(pgrp, sid) >= 1);
            if pgrp != sid {
                assert_eq!(
                    group_members(pgrp, pgrp),
                    0,
                    "another session is another group"
                );
            }
        }
        assert_eq!(group_members(0, 5), 0);
        assert_eq!(group_members(1, 1), 0);
        assert_eq!(group_members(pgrp, -1), 0);
        assert_eq!(group_and_session("12 (a) b) c) S 1 7 9 0"), Some((7, 9)));
        assert_eq!(group_and_session("12 (x) S 1"), None);
        assert_eq!(group_and_session("garbage"), None);
    }
}
