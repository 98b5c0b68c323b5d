//! The reaper thread: one message when a supervisor the node knows ends, whether the node
//! started it (its child, reaped here by its pid) or re-adopted it after a restart (not its
//! child). The loop hands each one over once the workload is in its table ([`Reaper::watch`]),
//! so an end is never reported for a workload the loop does not know yet.
//!
//! Each supervisor is watched through a pidfd (`pidfd_open`, Linux 5.3): the thread sleeps in
//! `poll` until one ends, and an idle node never wakes it. Where the kernel has no pidfds it
//! looks every 250 ms instead. It never waits for "any child" (`waitpid(-1)`): the node's other
//! children (`nvidia-smi`, the install script) are started with `std::process::Command` and
//! waited for by whoever started them ([`spawn`]). Only as a container's PID 1 (D58), where
//! every orphan of the namespace becomes the node's child, does it also reap, once a second, the
//! ended children that nobody else waits for ([`sweep`]).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crossbeam_channel::{unbounded, Receiver, Sender, TryRecvError};

use super::procinfo;

/// The supervisor of workload `id` ended (and, the node's child, was reaped).
#[derive(Debug, Clone)]
pub struct Reaped {
    pub id: String,
}

/// A supervisor to watch.
struct Watch {
    id: String,
    pid: i32,
    /// Its start time, which tells it from a process that got its pid later.
    ticks: u64,
    /// Started by this node: reaped here.
    child: bool,
}

/// How often supervisors are looked at where the kernel gives no pidfd.
const LOOK_EVERY: Duration = Duration::from_millis(250);
/// How often PID 1 reaps the orphans it adopted.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The children started through [`spawn`] that their starter has not waited for yet: PID 1's
/// sweep leaves them alone. Held while a child is started, so the sweep can never take one
/// between its fork and its registration (std's `Command` waits for a child whose exec failed,
/// and panics when someone else reaped it).
static KNOWN: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

/// Starts `cmd`; its starter waits for the child and then says so ([`waited`]). Every child the
/// node starts goes through here.
pub fn spawn(cmd: &mut Command) -> std::io::Result<Child> {
    let mut known = KNOWN.lock().unwrap_or_else(PoisonError::into_inner);
    let child = cmd.spawn()?;
    known.insert(child.id());
    Ok(child)
}

/// The child `pid` of [`spawn`] was waited for.
pub fn waited(pid: u32) {
    KNOWN
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&pid);
}

/// The loop's handle on the reaper thread; the thread ends once every handle is dropped.
#[derive(Clone)]
pub struct Reaper {
    watches: Sender<Watch>,
    wake: Arc<UnixStream>,
}

impl Reaper {
    /// `init`: the node is its container's PID 1 (D58) and reaps the orphans it adopts.
    pub fn start(out: Sender<Reaped>, init: bool) -> std::io::Result<Reaper> {
        let (wake, woken) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        woken.set_nonblocking(true)?;
        let (watches, rx) = unbounded::<Watch>();
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || run(&rx, woken, &out, init))?;
        Ok(Reaper {
            watches,
            wake: Arc::new(wake),
        })
    }

    /// Watches supervisor `pid` (started at `ticks`) of workload `id`; `child`: this node
    /// started it. Its end is reported once.
    pub fn watch(&self, id: &str, pid: i32, ticks: u64, child: bool) {
        let w = Watch {
            id: id.to_string(),
            pid,
            ticks,
            child,
        };
        if self.watches.send(w).is_ok() {
            // Full: it is awake already.
            let _ = (&*self.wake).write(&[1]);
        }
    }
}

/// A supervisor being watched, with its pidfd where the kernel gives one.
struct Watched {
    w: Watch,
    fd: Option<OwnedFd>,
}

fn run(rx: &Receiver<Watch>, mut woken: UnixStream, out: &Sender<Reaped>, init: bool) {
    let mut watched: Vec<Watched> = Vec::new();
    let mut ready: Vec<bool> = Vec::new();
    loop {
        loop {
            match rx.try_recv() {
                Ok(w) => match open(w) {
                    Ok(w) => {
                        watched.push(w);
                        ready.push(false);
                    }
                    Err(id) => {
                        if out.send(Reaped { id }).is_err() {
                            return;
                        }
                    }
                },
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
        let mut flags = ready.iter();
        let mut ended = Vec::new();
        watched.retain(|w| {
            let gone = ended_now(w, flags.next().copied().unwrap_or(false));
            if gone {
                ended.push(w.w.id.clone());
            }
            !gone
        });
        for id in ended {
            if out.send(Reaped { id }).is_err() {
                return;
            }
        }
        if init {
            sweep();
        }
        let timeout = if watched.iter().any(|w| w.fd.is_none()) {
            Some(LOOK_EVERY)
        } else if init {
            Some(SWEEP_EVERY)
        } else {
            None
        };
        ready = wait(&woken, &watched, timeout);
        let mut sink = [0u8; 64];
        while matches!(woken.read(&mut sink), Ok(n) if n > 0) {}
    }
}

/// Opens the pidfd of `w`; `Err(id)` when it has ended already (or its pid is another
/// process's now).
fn open(w: Watch) -> Result<Watched, String> {
    if w.pid <= 1 {
        return Err(w.id);
    }
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor that nothing else
    // owns (or -1), which the OwnedFd then closes.
    let fd = unsafe {
        let rc = libc::syscall(libc::SYS_pidfd_open, w.pid, 0);
        i32::try_from(rc)
            .ok()
            .filter(|fd| *fd >= 0)
            .map(|fd| OwnedFd::from_raw_fd(fd))
    };
    let gone = fd.is_none()
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
        && !w.child;
    // Not its child: the pidfd names whatever has the pid now, so its start time must match.
    if gone || (!w.child && !procinfo::same_process_alive(w.pid, w.ticks)) {
        return Err(w.id);
    }
    Ok(Watched { w, fd })
}

/// Whether the watched supervisor has ended (`readable`: its pidfd said so); a child of the
/// node is reaped here.
fn ended_now(w: &Watched, readable: bool) -> bool {
    if w.fd.is_some() && !readable {
        return false;
    }
    if w.w.child {
        return reap(w.w.pid);
    }
    readable || !procinfo::same_process_alive(w.w.pid, w.w.ticks)
}

/// Reaps the node's child `pid` if it has ended; true once it is reaped (or is no child of the
/// node any more).
fn reap(pid: i32) -> bool {
    loop {
        let mut status = 0;
        // SAFETY: waitpid on one pid with a valid out pointer, without blocking.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if rc == 0 {
            return false;
        }
        if rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        if let Ok(p) = u32::try_from(pid) {
            waited(p);
        }
        return true;
    }
}

/// Sleeps until a pidfd is readable, `woken` is, or `timeout` passes; which pidfds were ready.
fn wait(woken: &UnixStream, watched: &[Watched], timeout: Option<Duration>) -> Vec<bool> {
    let mut fds: Vec<libc::pollfd> = std::iter::once(woken.as_raw_fd())
        .chain(
            watched
                .iter()
                .map(|w| w.fd.as_ref().map_or(-1, AsRawFd::as_raw_fd)),
        )
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.map_or(-1, |t| i32::try_from(t.as_millis()).unwrap_or(i32::MAX));
    let n = libc::nfds_t::try_from(fds.len()).unwrap_or(0);
    // SAFETY: `fds` is a valid array of `n` pollfds (negative fds are ignored) that outlives the
    // call.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), n, ms) };
    if rc <= 0 {
        return vec![false; watched.len()];
    }
    fds.iter().skip(1).map(|p| p.revents != 0).collect()
}

/// PID 1 only: reaps every ended child that was not started through [`spawn`] (an orphan the
/// kernel handed to the node), never one whose starter will wait for it.
fn sweep() {
    let known = KNOWN.lock().unwrap_or_else(PoisonError::into_inner);
    loop {
        // SAFETY: waitid with a zeroed siginfo_t (a valid out value) that it fills; WNOWAIT
        // leaves the child to be waited for; si_pid is set by a successful waitid (0 when no
        // child had ended).
        let pid = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            let flags = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT;
            match libc::waitid(libc::P_ALL, 0, &mut info, flags) {
                0 => info.si_pid(),
                _ => 0,
            }
        };
        // None ended, or one whose starter waits for it: the others wait for the next sweep.
        if pid <= 0 || u32::try_from(pid).is_ok_and(|p| known.contains(&p)) {
            return;
        }
        // SAFETY: waitpid on the ended child just seen; a null status pointer is allowed.
        unsafe {
            libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn next(rx: &Receiver<Reaped>, within: Duration) -> Option<String> {
        rx.recv_timeout(within).ok().map(|r| r.id)
    }

    /// A supervisor the node started is reported once it ends, and reaped (no zombie left);
    /// a child the reaper was not given keeps its status for whoever waits for it.
    #[test]
    fn a_child_supervisor_is_reported_and_reaped_and_other_children_are_left_to_their_waiter() {
        let (tx, rx) = unbounded();
        let reaper = Reaper::start(tx, false).unwrap();
        let mut other = spawn(Command::new("sh").args(["-c", "exit 7"])).unwrap();
        // Waited for by the reaper, as the node's supervisors are.
        #[allow(clippy::zombie_processes)]
        let sup = spawn(Command::new("sleep").arg("0.3")).unwrap();
        let pid = i32::try_from(sup.id()).unwrap();
        reaper.watch("w", pid, procinfo::start_ticks(pid).unwrap(), true);
        assert_eq!(next(&rx, Duration::from_millis(100)), None, "it runs");
        assert_eq!(next(&rx, Duration::from_secs(5)).as_deref(), Some("w"));
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(!state.contains(") Z "), "left a zombie: {state}");
        assert!(!KNOWN.lock().unwrap().contains(&sup.id()));
        assert_eq!(other.wait().unwrap().code(), Some(7), "another's child");
        waited(other.id());
        assert_eq!(next(&rx, Duration::from_millis(100)), None, "reported once");
    }

    /// A re-adopted supervisor (not the node's child) is reported when it ends; one whose pid
    /// is now another process's (its start time differs), or no pid at all, at once.
    #[test]
    fn an_adopted_supervisor_is_reported_when_it_ends_and_a_recycled_one_at_once() {
        let (tx, rx) = unbounded();
        let reaper = Reaper::start(tx, false).unwrap();
        // Not this process's child: the background job of a shell that has exited.
        let out = Command::new("sh")
            .args(["-c", "sleep 0.4 >/dev/null 2>&1 & echo $!"])
            .output()
            .unwrap();
        let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        reaper.watch("a", pid, procinfo::start_ticks(pid).unwrap(), false);
        assert_eq!(next(&rx, Duration::from_millis(100)), None, "it runs");
        assert_eq!(next(&rx, Duration::from_secs(5)).as_deref(), Some("a"));
        let me = i32::try_from(std::process::id()).unwrap();
        let ticks = procinfo::start_ticks(me).unwrap();
        reaper.watch("b", me, ticks.wrapping_add(1), false);
        assert_eq!(next(&rx, Duration::from_secs(1)).as_deref(), Some("b"));
        reaper.watch("c", 0, 0, false);
        assert_eq!(next(&rx, Duration::from_secs(1)).as_deref(), Some("c"));
    }
}
