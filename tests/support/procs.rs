//! Processes seen from outside, through `/proc`: whether a pid still runs, and what a test
//! sends to the processes it made.

/// The state letter of `/proc/<pid>/stat` (`R`, `S`, `Z`, …); `None` when no process has the
/// pid. Read as bytes: a process may name itself in bytes that are not UTF-8.
pub fn state(pid: impl Into<i64>) -> Option<char> {
    let stat = std::fs::read(format!("/proc/{}/stat", pid.into())).ok()?;
    let stat = String::from_utf8_lossy(&stat);
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().next()?.chars().next()
}

/// The process still runs: it exists and has not ended. A zombie has ended (it only waits to
/// be reaped), unless another thread of it still runs: its main thread ended by the raw `exit`
/// system call, so `/proc` says `Z` though its code goes on.
pub fn alive(pid: impl Into<i64>) -> bool {
    let pid = pid.into();
    match state(pid) {
        None | Some('X') => false,
        Some('Z') => {
            std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |rd| rd.take(2).count()) > 1
        }
        Some(_) => true,
    }
}

/// Some process holds the pid, a zombie included (`kill(pid, 0)` succeeds): what a node that
/// signals by pid could still reach.
pub fn exists(pid: impl Into<i64>) -> bool {
    let Ok(pid) = i32::try_from(pid.into()) else {
        return false;
    };
    // SAFETY: signal 0 only probes.
    pid > 0 && unsafe { libc::kill(pid, 0) } == 0
}

/// Sends `sig` to `pid` (a process the test made, or its workload's).
pub fn signal(pid: impl Into<i64>, sig: i32) {
    if let Ok(pid) = i32::try_from(pid.into()) {
        if pid > 1 {
            // SAFETY: a signal to a process of the test's own.
            unsafe {
                libc::kill(pid, sig);
            }
        }
    }
}

/// SIGKILL to the process group `pid` leads (a workload the test leaves behind).
pub fn kill_group(pid: impl Into<i64>) {
    if let Ok(pid) = i32::try_from(pid.into()) {
        if pid > 1 {
            // SAFETY: the test's own workload group.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
    }
}

/// The parent pid in `/proc/<pid>/stat` (0 when the process is gone).
pub fn parent(pid: impl Into<i64>) -> i32 {
    let stat = std::fs::read(format!("/proc/{}/stat", pid.into())).unwrap_or_default();
    let stat = String::from_utf8_lossy(&stat);
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// The children of `pid`'s main thread (`/proc/<pid>/task/<pid>/children`; a child another
/// thread started is listed under that thread).
pub fn children(pid: impl Into<i64>) -> Vec<i32> {
    let pid = pid.into();
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Every pid in `/proc` now.
pub fn all() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// A number of `/proc/<pid>/status` (`Threads:`, or `VmHWM:` in kB); 0 when it cannot be read.
pub fn status_number(pid: impl Into<i64>, key: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{}/status", pid.into())).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}
