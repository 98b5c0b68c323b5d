//! What /proc says about processes: start times (to tell a recycled pid from the original),
//! the boot id (to tell a reboot), and whether a process group still has members.

/// The kernel's boot id; changes on every boot.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// (state char, start time in clock ticks since boot) from /proc/<pid>/stat.
fn stat(pid: i32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
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
    matches!(stat(pid), Some((state, s)) if s == start && state != 'Z' && state != 'X')
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
}
