//! What a child of the node inherits (D46.1, D51): nothing but its standard streams.
//!
//! Rust opens every descriptor with close-on-exec, but the libraries the node links do not all
//! do so: Paho C opens its broker socket and its wake-up socketpair without `SOCK_CLOEXEC`. A
//! child started while such a descriptor is open would hold the node's live, authenticated broker
//! connection (a workload could publish as the node) or the state-dir lock (keeping a restarted
//! node out). So:
//! - every `Command` the node runs goes through [`harden`]: between fork and exec, every
//!   descriptor above 2 is marked close-on-exec (std's own exec-error pipe already is, so std still
//!   learns of a failed exec), and the child starts with an empty signal mask; before the
//!   supervisor is started, the node marks its own descriptors so ([`before_spawn`]);
//! - the supervisor, first thing, closes every descriptor above 2 it inherited
//!   ([`close_inherited`]), so the workload it starts cannot get one even through it.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// The highest descriptor number the fallbacks walk to when the limit is unknown or huge.
const FALLBACK_MAX_FD: libc::c_int = 65_536;

/// Marks or closes descriptors `3..` with `close_range(2)` (Linux 5.9; the CLOEXEC flag 5.11).
/// False when the kernel lacks it or refused the flag.
fn close_range_from_3(flags: libc::c_uint) -> bool {
    // SAFETY: close_range takes plain integers; it only affects this process's descriptors.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, flags) };
    rc == 0
}

/// The highest descriptor number the fallbacks need to visit (async-signal-safe).
fn max_fd() -> libc::c_int {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into a local struct we own; async-signal-safe.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    if rc != 0 {
        return FALLBACK_MAX_FD;
    }
    libc::c_int::try_from(lim.rlim_cur)
        .unwrap_or(FALLBACK_MAX_FD)
        .min(FALLBACK_MAX_FD)
}

/// Marks every descriptor above 2 close-on-exec. Async-signal-safe (no allocation): for the
/// child between fork and exec.
pub fn cloexec_above_2() {
    if close_range_from_3(libc::CLOSE_RANGE_CLOEXEC) {
        return;
    }
    for fd in 3..max_fd() {
        // SAFETY: fcntl on a descriptor number; EBADF for one that is not open is harmless.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
}

/// Closes every descriptor above 2 (the supervisor, before it opens anything of its own).
pub fn close_inherited() {
    if close_range_from_3(0) {
        return;
    }
    // Without close_range: the open ones, as /proc lists them (collected first, then closed, so
    // the listing's own descriptor is not pulled from under it), else every number to the limit.
    let listed: Option<Vec<libc::c_int>> = std::fs::read_dir("/proc/self/fd").ok().map(|rd| {
        rd.flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
            .filter(|fd| *fd > 2)
            .collect()
    });
    match listed {
        Some(fds) => {
            for fd in fds {
                // SAFETY: closing a descriptor this process inherited and owns no Rust handle of.
                unsafe {
                    libc::close(fd);
                }
            }
        }
        None => {
            for fd in 3..max_fd() {
                // SAFETY: as above; EBADF for a number that is not open is harmless.
                unsafe {
                    libc::close(fd);
                }
            }
        }
    }
}

/// For the supervisor, right before it is started: every descriptor of the node above 2 is
/// marked close-on-exec in the node itself (the node never hands one on through an exec), so
/// the supervisor can be started without a hook between fork and exec, which lets std use
/// `posix_spawn` (no copy of the node's page tables). One that a library opens meanwhile
/// without close-on-exec is closed by the supervisor first thing ([`close_inherited`]). The
/// supervisor keeps the node's blocked signals: it blocks them itself first thing, so a signal
/// meant for the node never ends it in between, and resets them for its workload ([`harden`]).
pub fn before_spawn() {
    cloexec_above_2();
}

/// Resets what a child must not inherit from the node, between fork and exec: the descriptors
/// above 2 (close-on-exec) and the blocked signals (D51).
pub fn harden(cmd: &mut Command) -> &mut Command {
    // SAFETY: the closure only makes async-signal-safe calls (fcntl, close_range, getrlimit,
    // sigprocmask); it allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            cloexec_above_2();
            crate::signals::unblock_all()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// A descriptor opened as Paho C opens its socket: without close-on-exec.
    fn leaky_fd() -> OwnedFd {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: socketpair writes two descriptors into the array we own.
        let rc = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) };
        assert_eq!(rc, 0);
        // SAFETY: both descriptors were just created and are owned here.
        unsafe {
            libc::close(fds[1]);
            OwnedFd::from_raw_fd(fds[0])
        }
    }

    #[test]
    fn g13_a_child_does_not_inherit_a_descriptor_opened_without_cloexec() {
        let leak = leaky_fd();
        let n = leak.as_raw_fd();
        let probe = format!("[ -e /proc/self/fd/{n} ] && echo open || echo closed");
        let plain = Command::new("sh").arg("-c").arg(&probe).output().unwrap();
        assert_eq!(String::from_utf8_lossy(&plain.stdout).trim(), "open");
        let hardened = harden(Command::new("sh").arg("-c").arg(&probe))
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&hardened.stdout).trim(), "closed");
        // The parent's descriptor is untouched.
        // SAFETY: F_GETFD on a descriptor we own.
        assert!(unsafe { libc::fcntl(n, libc::F_GETFD) } >= 0);
    }

    #[test]
    fn g13_a_failed_exec_is_still_reported_through_a_hardened_command() {
        let err = harden(&mut Command::new("/nonexistent/cw-no-such-binary"))
            .status()
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
    }
}
