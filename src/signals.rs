//! Signals as messages: in `start` (and the supervisor) the main thread blocks the signals the
//! node handles before it starts any thread (so every thread inherits the mask), and one thread
//! takes them with `sigwait` and forwards them. Children must unblock them again: see
//! [`unblock_all`]. Every other command ends on SIGINT / SIGTERM: see [`end_on_interrupt`].

use crossbeam_channel::Sender;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Term,
    Int,
    Hup,
    Usr1,
    Usr2,
}

const HANDLED: [libc::c_int; 5] = [
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

fn handled_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and fill a plain sigset_t we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in HANDLED {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Blocks the handled signals in the calling thread (call first thing in `main`).
pub fn block_in_this_thread() {
    let set = handled_set();
    // SAFETY: pthread_sigmask with a valid set; no old mask wanted.
    unsafe {
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Makes the process non-dumpable (D46.2): no core dump, and `/proc/<pid>/environ`, `mem` and
/// ptrace are closed to processes of the same uid that lack `CAP_SYS_PTRACE`. Inherited by
/// threads and forks, reset by exec (so the workloads the node starts are unaffected).
pub fn not_dumpable() {
    // SAFETY: prctl(PR_SET_DUMPABLE, 0) takes plain integers and cannot fail for value 0.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
    }
}

/// Restores an empty signal mask and the default disposition of every signal; for a child
/// between fork and exec (async-signal-safe: sigemptyset, sigprocmask, sigaction). A signal
/// the node's own parent had ignored (`nohup`, a background job of a script) is not ignored by
/// the node's children either (D51).
pub fn unblock_all() -> std::io::Result<()> {
    empty_mask()?;
    default_dispositions(1..=31);
    Ok(())
}

/// No signal blocked in the calling thread (async-signal-safe).
fn empty_mask() -> std::io::Result<()> {
    // SAFETY: sigprocmask with an empty set we own; async-signal-safe.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        if libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Does nothing: the supervisor's handler of the signals the node handles.
extern "C" fn shrug(_: libc::c_int) {}

/// For the supervisor, which outlives a stopping node: every signal back to its default
/// disposition (D51: none of what its parent ignored), then the signals the node handles caught
/// by a handler that does nothing (a SIGTERM meant for the node never ends the supervisor), and
/// SIGPIPE ignored again, as std has it (a node gone before it read the pid line must not end
/// its supervisor), then an empty mask. Exec resets a caught signal to its default, and std
/// resets SIGPIPE, so a child it starts gets an empty mask and default dispositions with no
/// hook between fork and exec: std starts it with `posix_spawn`. Call first thing, while the
/// handled signals are still blocked.
pub fn shrug_off_handled() -> std::io::Result<()> {
    default_dispositions(1..=31);
    let shrug_at = shrug as extern "C" fn(libc::c_int) as libc::sighandler_t;
    let actions = HANDLED
        .iter()
        .map(|s| (*s, shrug_at))
        .chain([(libc::SIGPIPE, libc::SIG_IGN)]);
    for (sig, handler) in actions {
        // SAFETY: a zeroed sigaction with SIG_IGN or a handler that touches nothing, an empty
        // mask and SA_RESTART (interrupted calls go on) is valid; the struct is ours.
        let rc = unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = handler;
            act.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(sig, &act, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    empty_mask()
}

/// Sets the disposition of each signal in `range` to the default (async-signal-safe). Caught
/// signals are reset by exec anyway; this undoes ignored ones. SIGKILL, SIGSTOP and numbers the
/// C library reserves answer EINVAL, which is harmless.
fn default_dispositions(range: std::ops::RangeInclusive<libc::c_int>) {
    for sig in range {
        // SAFETY: a zeroed sigaction with SIG_DFL (0) and an empty mask is valid; sigaction is
        // async-signal-safe and the struct is ours.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = libc::SIG_DFL;
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(sig, &act, std::ptr::null_mut());
        }
    }
}

/// For the CLI commands (`logs -f`, `drain --wait`, `status`, `doctor`, `config`, …, D51):
/// SIGINT and SIGTERM end the process at once, whatever mask or disposition it inherited (the
/// shell then reports 130 / 143). Only `start` and the supervisor block them.
pub fn end_on_interrupt() {
    // SAFETY: sigemptyset/sigaddset fill a plain sigset_t we own; then the calling (only)
    // thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
    }
    default_dispositions(libc::SIGINT..=libc::SIGINT);
    default_dispositions(libc::SIGTERM..=libc::SIGTERM);
}

/// Starts the signal thread.
pub fn spawn(tx: Sender<Signal>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let set = handled_set();
            loop {
                let mut sig: libc::c_int = 0;
                // SAFETY: sigwait on a valid set with a valid out pointer.
                let rc = unsafe { libc::sigwait(&set, &mut sig) };
                if rc != 0 {
                    continue;
                }
                let s = match sig {
                    libc::SIGTERM => Signal::Term,
                    libc::SIGINT => Signal::Int,
                    libc::SIGHUP => Signal::Hup,
                    libc::SIGUSR1 => Signal::Usr1,
                    libc::SIGUSR2 => Signal::Usr2,
                    _ => continue,
                };
                if tx.send(s).is_err() {
                    return;
                }
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    /// `SigBlk` and `SigIgn` of a child, as its /proc status shows them.
    fn child_masks(cmd: &mut Command) -> (u64, u64) {
        let out = cmd
            .args(["-E", "^Sig(Blk|Ign):", "/proc/self/status"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
                .unwrap()
        };
        (field("SigBlk:"), field("SigIgn:"))
    }

    #[test]
    fn a_hardened_child_starts_with_an_empty_mask_and_default_dispositions() {
        // D51: a child of the node (which blocks SIGTERM & co. for its signal thread, and may
        // have been started with signals ignored) must not keep either.
        let bit = |sig: libc::c_int| 1u64 << (sig - 1);
        let handled: u64 = super::HANDLED.iter().map(|s| bit(*s)).sum();
        std::thread::spawn(move || {
            // This thread only: its mask is what a fork from it inherits.
            super::block_in_this_thread();
            // SAFETY: SIGURG's default is to ignore it; making that explicit changes nothing
            // for this test process, and it is set back below.
            unsafe {
                libc::signal(libc::SIGURG, libc::SIG_IGN);
            }
            let (blk, ign) = child_masks(&mut Command::new("grep"));
            assert_eq!(blk & handled, handled, "std passes the mask on: {blk:x}");
            assert_ne!(
                ign & bit(libc::SIGURG),
                0,
                "an ignored signal stays ignored: {ign:x}"
            );
            let (blk, ign) = child_masks(crate::fds::harden(&mut Command::new("grep")));
            // SAFETY: as above.
            unsafe {
                libc::signal(libc::SIGURG, libc::SIG_DFL);
            }
            assert_eq!(blk, 0, "{blk:x}");
            assert_eq!(ign & bit(libc::SIGURG), 0, "{ign:x}");
        })
        .join()
        .unwrap();
    }
}
