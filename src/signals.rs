//! Signals as messages: the main thread blocks the signals the node handles before it starts
//! any thread (so every thread inherits the mask), and one thread takes them with `sigwait`
//! and forwards them. Children must unblock them again: see [`unblock_all`].

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

/// Restores an empty signal mask; for a child between fork and exec (async-signal-safe).
pub fn unblock_all() -> std::io::Result<()> {
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
