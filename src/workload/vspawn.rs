//! The supervisor started without copying the node (issue 25 item 5): `clone(CLONE_VM |
//! CLONE_VFORK)`, as `posix_spawn` starts a child, instead of `fork`.
//!
//! A `fork` of the node copies its page tables (every thread's heap and stack) and leaves every
//! page it writes afterwards to a copy-on-write fault; on the 2-core test machine that was
//! 0.7 ms of a 12 MiB process before the child could even exec, against 0.3 ms to the exec with
//! `posix_spawn`. `std::process::Command` takes the `posix_spawn` path only without a `pre_exec`
//! hook, and D46.1 needs one: Paho opens its broker socket without close-on-exec, and the
//! child must mark every descriptor above 2 close-on-exec before it execs. `posix_spawn` has no
//! portable action for that (glibc's `addclosefrom_np` is not in musl, the shipped build), so
//! this is the same start done by hand: the child runs on a stack of its own in the node's
//! memory while the calling thread waits, makes only async-signal-safe calls (`dup2`, `chdir`,
//! `close_range`, `sigprocmask`, `execve`) and either execs or leaves its `errno` in shared
//! memory and `_exit`s. What the supervisor gets is what the `Command` that forked it before
//! gave it: the three streams, the directory, exactly `env`, the node's blocked signals, and no
//! other descriptor. Where the kernel refuses the clone (a seccomp filter, say), the same child
//! is forked ([`fork_child`]), its errno coming back through a pipe; never by `Command`, whose
//! `spawn` waits for a child whose exec failed and panics when the node's reaper thread
//! (`waitpid(-1)`) collected it first.
//!
//! The supervisor starts a plain word list the same way ([`spawn_workload`], [`Prepare::Workload`]):
//! the child also makes itself a process group (`setpgid`, D25) and, instead of restoring the
//! mask, sets every disposition to the default and then unblocks everything (D51), in that
//! order, so that no handler of the supervisor's ever runs in the memory they share.

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};

/// A started supervisor: its pid and the read end of its stdout (the pid line).
pub struct Started {
    pub pid: i32,
    pub stdout: OwnedFd,
}

/// What the child needs, prepared in the parent (nothing is allocated after the clone).
struct ChildArgs {
    exe: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    dir: *const libc::c_char,
    /// Descriptors (all above 2) for the child's 0, 1 and 2.
    streams: [RawFd; 3],
    /// The calling thread's signal mask, restored in the child just before the exec
    /// ([`Prepare::KeepMask`]).
    mask: libc::sigset_t,
    prepare: Prepare,
    /// 0, or the errno of the step that failed in the child.
    err: AtomicI32,
    /// In a forked child (see [`fork_child`]), where its `err` is its own copy: the write end
    /// of a close-on-exec pipe for that errno; -1 after a clone.
    err_pipe: RawFd,
}

/// What the child sets up before its exec, beyond its streams, its directory and the descriptors
/// it must not pass on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prepare {
    /// The calling thread's signal mask, kept (the supervisor keeps the node's blocked signals).
    KeepMask,
    /// A workload (D25, D51): a process group of its own, every signal's disposition the
    /// default and none blocked.
    Workload,
}

/// The child's stack. `execve` and the few calls before it need little; glibc's `posix_spawn`
/// gives its child 32 KiB plus the argument strings.
const CHILD_STACK: usize = 64 * 1024;

fn cstring(bytes: &[u8]) -> std::io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a NUL byte in the supervisor's arguments or environment",
        )
    })
}

/// A descriptor above 2 for `fd` (the node's own 0–2 may be closed, so a fresh one can be low):
/// `fd` itself, or a close-on-exec duplicate at 3 or above.
fn above_2(fd: OwnedFd) -> std::io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC on a descriptor we own; the result is a new descriptor we own.
    let dup = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if dup < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `dup` was just returned by fcntl and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(dup) })
}

/// Why nothing was started.
#[derive(Debug)]
pub enum Failure {
    /// Before the child existed: its preparation, or both the clone and the fork it falls
    /// back to (out of processes or memory).
    Clone(std::io::Error),
    /// The child's own steps (`chdir`, the exec): a fork would fail the same way. Reaped here.
    Child(std::io::Error),
}

/// Starts `exe args…` in `dir` with exactly `env`, stdin `/dev/null`, stdout a new socket (the
/// other end returned) and stderr `stderr`, by `clone(CLONE_VM | CLONE_VFORK)` (or a fork where
/// the kernel refuses that clone).
pub fn spawn(
    exe: &Path,
    args: &[OsString],
    env: &BTreeMap<String, String>,
    dir: &Path,
    stderr: File,
) -> Result<Started, Failure> {
    let setup = Failure::Clone;
    let stdin = std::fs::OpenOptions::new()
        .read(true)
        .open("/dev/null")
        .map_err(setup)?;
    // A socket, not a pipe: a same-uid process could open a pipe's end again through the
    // supervisor's /proc/<pid>/fd/1 and tell the node a pid of its choosing.
    let (read, write) = socket_pair().map_err(setup)?;
    let streams = [OwnedFd::from(stdin), write, OwnedFd::from(stderr)];
    let pid = spawn_with(exe, args, env, dir, streams)?;
    Ok(Started { pid, stdout: read })
}

/// A new connected pair of unix stream sockets, both close-on-exec. Unlike a pipe's, a socket's
/// `/proc/<pid>/fd/N` cannot be opened again (ENXIO), so a process of the same uid cannot get a
/// second end of it from a dumpable holder (a supervisor's gate, launch.rs).
pub fn socket_pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    unix_pair(libc::SOCK_STREAM)
}

/// A new connected pair of unix sockets of `kind`, both close-on-exec.
pub fn unix_pair(kind: libc::c_int) -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: socketpair writes two new descriptors into the array we own.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            kind | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created by socketpair and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A new pipe, both ends close-on-exec: (read, write).
pub fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut pipe = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two new descriptors into the array we own.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created by pipe2 and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) })
}

/// Starts `exe args…` in `dir` with exactly `env` and `streams` as its 0, 1 and 2 (nothing else
/// crosses), by `clone(CLONE_VM | CLONE_VFORK)` (or a fork where the kernel refuses that
/// clone), keeping this thread's signal mask; its pid.
pub fn spawn_with(
    exe: &Path,
    args: &[OsString],
    env: &BTreeMap<String, String>,
    dir: &Path,
    streams: [OwnedFd; 3],
) -> Result<i32, Failure> {
    let env = env.iter().map(|(k, v)| (OsStr::new(k), OsStr::new(v)));
    let command = Exec {
        exe,
        arg0: exe.as_os_str(),
        args,
        dir,
        prepare: Prepare::KeepMask,
    };
    prepare_and_clone(&command, env, streams)?
}

/// A workload started as `posix_spawn` would start it (no copy of the supervisor's memory to
/// make and tear down again): `exe` with `arg0` and `args`, in `dir`, with exactly `env` and
/// `streams`, in a process group of its own, every signal default and unblocked; its pid.
pub fn spawn_workload<'a>(
    exe: &Path,
    arg0: &OsStr,
    args: &[OsString],
    env: impl Iterator<Item = (&'a OsStr, &'a OsStr)>,
    dir: &Path,
    streams: [OwnedFd; 3],
) -> Result<i32, Failure> {
    prepare_workload(exe, arg0, args, env, dir, streams)?.start_workload()
}

/// What is exec'd, where, and how the child prepares.
struct Exec<'a> {
    exe: &'a Path,
    arg0: &'a OsStr,
    args: &'a [OsString],
    dir: &'a Path,
    prepare: Prepare,
}

fn prepare_and_clone<'a>(
    command: &Exec<'_>,
    env: impl Iterator<Item = (&'a OsStr, &'a OsStr)>,
    streams: [OwnedFd; 3],
) -> Result<Result<i32, Failure>, Failure> {
    prepare(command, env, streams)?.start()
}

/// Everything a clone and its exec need, made beforehand: the child itself allocates nothing,
/// and a supervisor makes it before its gate, so that once the gate opens only the clone is left
/// (and the child's first touches of its stack; issue 25 item 5). Dropped unstarted (a start
/// called off), it starts nothing and closes its descriptors. The pointer arrays point into the `CString`s held beside them, whose
/// buffers stay where they are when this value moves.
pub struct Prepared {
    exe: std::path::PathBuf,
    exe_c: CString,
    _argv_c: Vec<CString>,
    _envp_c: Vec<CString>,
    dir_c: CString,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    /// Above 2 each, so that no dup2 onto 0–2 in the child overwrites another of them.
    streams: [OwnedFd; 3],
    prepare: Prepare,
    stack: Vec<u8>,
}

/// [`spawn_workload`] in two steps: what it needs, made now; [`Prepared::start_workload`]
/// starts it.
pub fn prepare_workload<'a>(
    exe: &Path,
    arg0: &OsStr,
    args: &[OsString],
    env: impl Iterator<Item = (&'a OsStr, &'a OsStr)>,
    dir: &Path,
    streams: [OwnedFd; 3],
) -> Result<Prepared, Failure> {
    let command = Exec {
        exe,
        arg0,
        args,
        dir,
        prepare: Prepare::Workload,
    };
    prepare(&command, env, streams)
}

fn prepare<'a>(
    command: &Exec<'_>,
    env: impl Iterator<Item = (&'a OsStr, &'a OsStr)>,
    streams: [OwnedFd; 3],
) -> Result<Prepared, Failure> {
    let setup = Failure::Clone;
    let Exec {
        exe,
        arg0,
        args,
        dir,
        prepare,
    } = *command;
    let exe_c = cstring(exe.as_os_str().as_bytes()).map_err(setup)?;
    let argv_c: Vec<CString> = std::iter::once(arg0)
        .chain(args.iter().map(OsString::as_os_str))
        .map(|a| cstring(a.as_bytes()))
        .collect::<std::io::Result<_>>()
        .map_err(setup)?;
    let envp_c: Vec<CString> = env
        .map(|(k, v)| cstring(&[k.as_bytes(), b"=", v.as_bytes()].concat()))
        .collect::<std::io::Result<_>>()
        .map_err(setup)?;
    let dir_c = cstring(dir.as_os_str().as_bytes()).map_err(setup)?;
    let argv: Vec<*const libc::c_char> = argv_c
        .iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let envp: Vec<*const libc::c_char> = envp_c
        .iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let [stdin, stdout, stderr] = streams;
    let streams = [
        above_2(stdin).map_err(setup)?,
        above_2(stdout).map_err(setup)?,
        above_2(stderr).map_err(setup)?,
    ];
    Ok(Prepared {
        exe: exe.to_path_buf(),
        exe_c,
        _argv_c: argv_c,
        _envp_c: envp_c,
        dir_c,
        argv,
        envp,
        streams,
        prepare,
        stack: vec![0u8; CHILD_STACK],
    })
}

impl Prepared {
    /// Starts what was prepared as [`spawn_workload`] would; its pid.
    pub fn start_workload(self) -> Result<i32, Failure> {
        self.start()?
    }

    fn start(mut self) -> Result<Result<i32, Failure>, Failure> {
        let setup = Failure::Clone;
        let exe = self.exe.as_path();
        let [stdin, stdout, stderr] = &self.streams;
        let mut all: libc::sigset_t = unsafe_zeroed_sigset();
        let mut mask: libc::sigset_t = unsafe_zeroed_sigset();
        // SAFETY: sigfillset on a local set we own.
        unsafe {
            libc::sigfillset(&mut all);
        }
        // The child runs in this memory: no signal handler may run in it before the exec. Every
        // signal is blocked in this thread around the clone (the child inherits that) and the
        // thread's own mask is restored in the child right before the exec (the supervisor keeps
        // the node's blocked signals, as it always did).
        // SAFETY: pthread_sigmask with valid set pointers.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut mask) };
        if rc != 0 {
            return Err(setup(std::io::Error::from_raw_os_error(rc)));
        }
        let args = ChildArgs {
            exe: self.exe_c.as_ptr(),
            argv: self.argv.as_ptr(),
            envp: self.envp.as_ptr(),
            dir: self.dir_c.as_ptr(),
            streams: [stdin.as_raw_fd(), stdout.as_raw_fd(), stderr.as_raw_fd()],
            mask,
            prepare: self.prepare,
            err: AtomicI32::new(0),
            err_pipe: -1,
        };
        // The stack grows down: its top, aligned to 16 bytes as the ABI wants.
        let end = self.stack.as_mut_ptr().wrapping_add(CHILD_STACK);
        let top = end.wrapping_sub(end as usize & 15);
        let pid = if forced_fork() {
            -1
        } else {
            // SAFETY: `child` only reads `args` (alive until clone returns: CLONE_VFORK suspends
            // this thread until the child execs or exits) and makes async-signal-safe calls on its
            // own stack `top` (inside `stack`, alive as long). SIGCHLD makes it an ordinary child
            // for the reaper.
            unsafe {
                libc::clone(
                    child,
                    top.cast(),
                    libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                    std::ptr::from_ref(&args).cast_mut().cast(),
                )
            }
        };
        // The kernel refused the clone (a seccomp filter, say): the same child, by a fork. Not by
        // `std::process::Command`, whose `spawn` waits for a child whose exec failed and panics
        // when the node's reaper thread collected it first.
        let refused = (pid < 0).then(std::io::Error::last_os_error);
        let forked = refused.is_some().then(|| fork_child(&args));
        // SAFETY: restoring this thread's own mask, saved above.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &mask, std::ptr::null_mut());
        }
        if let Some(forked) = forked {
            if let Some(e) = refused.filter(|_| !forced_fork()) {
                log::debug!(
                    "the kernel refused the clone of {} ({e}): forked instead",
                    exe.display()
                );
            }
            return Ok(forked);
        }
        let err = args.err.load(Ordering::SeqCst);
        if err != 0 {
            // It has exited already (CLONE_VFORK): reaped here unless the reaper thread was first.
            let mut status = 0;
            // SAFETY: waitpid on our own child with a valid out pointer.
            unsafe {
                libc::waitpid(pid, &mut status, 0);
            }
            return Ok(Err(Failure::Child(std::io::Error::from_raw_os_error(err))));
        }
        Ok(Ok(pid))
    }
}

/// The fallback of the clone: `fork`, the child running [`child`] with `a`'s arguments (all
/// prepared before, so it allocates nothing), its errno coming back through a close-on-exec
/// pipe (end of file: the exec happened). Called with every signal blocked in this thread.
fn fork_child(a: &ChildArgs) -> Result<i32, Failure> {
    let (read, write) = pipe().map_err(Failure::Clone)?;
    // Above 2, so that the child's dup2 onto 0–2 cannot overwrite it.
    let write = above_2(write).map_err(Failure::Clone)?;
    let forked = ChildArgs {
        exe: a.exe,
        argv: a.argv,
        envp: a.envp,
        dir: a.dir,
        streams: a.streams,
        mask: a.mask,
        prepare: a.prepare,
        err: AtomicI32::new(0),
        err_pipe: write.as_raw_fd(),
    };
    // SAFETY: fork; the child only runs `child` (async-signal-safe calls on memory prepared
    // before the fork) and then execs or `_exit`s.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        child(std::ptr::from_ref(&forked).cast_mut().cast());
        // SAFETY: _exit is async-signal-safe and never returns (`child` does not return).
        unsafe { libc::_exit(127) }
    }
    if pid < 0 {
        return Err(Failure::Clone(std::io::Error::last_os_error()));
    }
    drop(write);
    let mut errno = [0u8; 4];
    let mut got = 0usize;
    while got < errno.len() {
        let rest = errno.get_mut(got..).unwrap_or_default();
        // SAFETY: read into the rest of a local buffer of the given length.
        let n = unsafe { libc::read(read.as_raw_fd(), rest.as_mut_ptr().cast(), rest.len()) };
        match usize::try_from(n) {
            Ok(0) => break,
            Ok(n) => got = got.saturating_add(n),
            Err(_) if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {
            }
            Err(_) => break,
        }
    }
    if got == 0 {
        return Ok(pid);
    }
    // It has exited (or is about to): reaped here unless the reaper thread is first.
    let mut status = 0;
    // SAFETY: waitpid on our own child with a valid out pointer.
    unsafe {
        libc::waitpid(pid, &mut status, 0);
    }
    let e = i32::from_ne_bytes(errno);
    let e = if got < errno.len() || e == 0 {
        libc::EINVAL
    } else {
        e
    };
    Err(Failure::Child(std::io::Error::from_raw_os_error(e)))
}

#[cfg(not(test))]
fn forced_fork() -> bool {
    false
}

#[cfg(test)]
thread_local! {
    /// Tests take the fork path on this thread (`tests::forked`).
    static FORCE_FORK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
fn forced_fork() -> bool {
    FORCE_FORK.with(std::cell::Cell::get)
}

fn unsafe_zeroed_sigset() -> libc::sigset_t {
    // SAFETY: sigset_t is a plain array of integers; all zeroes is the empty set.
    unsafe { std::mem::zeroed() }
}

/// The child, between the clone (or fork) and the exec: async-signal-safe calls only, no
/// allocation, no panic (after the clone it shares the node's memory and runs on the stack of
/// its [`Prepared`]; after a fork, on its own copy of the forking thread's stack).
extern "C" fn child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is a `ChildArgs` alive while this runs: the parent's (CLONE_VFORK suspends
    // it until the exec or exit), or the child's own copy of `fork_child`'s.
    let a = unsafe { &*arg.cast::<ChildArgs>() };
    let fail = |a: &ChildArgs| -> libc::c_int {
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .filter(|e| *e != 0)
            .unwrap_or(libc::EINVAL);
        a.err.store(errno, Ordering::SeqCst);
        if a.err_pipe >= 0 {
            let bytes = errno.to_ne_bytes();
            // SAFETY: write of a local 4-byte buffer to the pipe of `fork_child`.
            unsafe {
                libc::write(a.err_pipe, bytes.as_ptr().cast(), bytes.len());
            }
        }
        // SAFETY: _exit is async-signal-safe and never returns.
        unsafe { libc::_exit(127) }
    };
    let [stdin, stdout, stderr] = a.streams;
    // SAFETY: dup2 of descriptors above 2 onto 0, 1 and 2 (the copies lose close-on-exec);
    // chdir to a NUL-terminated path.
    unsafe {
        if libc::dup2(stdin, 0) < 0 || libc::dup2(stdout, 1) < 0 || libc::dup2(stderr, 2) < 0 {
            return fail(a);
        }
        if libc::chdir(a.dir) != 0 {
            return fail(a);
        }
    }
    // D25: a workload leads a process group of its own.
    // SAFETY: setpgid takes plain integers.
    if a.prepare == Prepare::Workload && unsafe { libc::setpgid(0, 0) } != 0 {
        return fail(a);
    }
    // D46.1: no descriptor of the node but these three crosses the exec.
    crate::fds::cloexec_above_2();
    match a.prepare {
        // SAFETY: sigprocmask restoring the parent thread's mask (a valid set).
        Prepare::KeepMask => unsafe {
            libc::sigprocmask(libc::SIG_SETMASK, &a.mask, std::ptr::null_mut());
        },
        // D51: every disposition the default first (so no handler of the parent's can run in
        // this shared memory), then nothing blocked.
        Prepare::Workload => crate::signals::default_then_unblock(),
    }
    // SAFETY: execve with NUL-terminated strings and NULL-terminated arrays prepared before the
    // clone.
    unsafe {
        libc::execve(a.exe, a.argv, a.envp);
    }
    fail(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn scratch(tag: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("cw-vspawn-{tag}-{}", std::process::id()))
    }

    fn run(tag: &str, exe: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
        let dir = scratch(tag);
        std::fs::create_dir_all(&dir).unwrap();
        let err_path = dir.join("stderr");
        let err = File::create(&err_path).unwrap();
        let env: BTreeMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        let s = spawn(Path::new(exe), &args, &env, &dir, err).expect("started");
        let mut out = String::new();
        File::from(s.stdout).read_to_string(&mut out).unwrap();
        let mut status = 0;
        // SAFETY: waitpid on the child just started, valid out pointer.
        assert_eq!(unsafe { libc::waitpid(s.pid, &mut status, 0) }, s.pid);
        let stderr = std::fs::read_to_string(&err_path).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        (libc::WEXITSTATUS(status), out, stderr)
    }

    /// `f` with the clone refused on this thread: the fork path.
    fn forked<T>(f: impl FnOnce() -> T) -> T {
        super::FORCE_FORK.with(|c| c.set(true));
        let r = f();
        super::FORCE_FORK.with(|c| c.set(false));
        r
    }

    #[test]
    fn g13_the_supervisor_started_without_a_fork_holds_only_its_three_streams() {
        supervisor_holds_only_its_three_streams("streams");
    }

    /// Where the kernel refuses the clone: the same child, forked.
    #[test]
    fn g13_the_supervisor_forked_where_the_clone_is_refused_holds_only_its_three_streams() {
        forked(|| supervisor_holds_only_its_three_streams("streams-forked"));
    }

    fn supervisor_holds_only_its_three_streams(tag: &str) {
        // A descriptor opened as Paho opens its socket: without close-on-exec.
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: socketpair writes two descriptors into the array we own.
        assert_eq!(
            unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) },
            0
        );
        // SAFETY: both descriptors were just created and are owned here.
        let (_a, _b) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let (code, out, err) = run(
            tag,
            "/bin/sh",
            &[
                "-c",
                "pwd; env | sort; ls /proc/self/fd | sort -n | tr '\\n' ' '; echo; \
                 read x && echo stdin:$x; echo to-stderr >&2; exit 7",
            ],
            &[("A", "1"), ("PATH", "/usr/bin:/bin")],
        );
        assert_eq!(code, 7);
        let lines: Vec<&str> = out.lines().collect();
        let name = scratch(tag)
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        assert!(lines[0].ends_with(&format!("/{name}")), "{out}");
        let env: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| l.starts_with("A=") || l.starts_with("PATH="))
            .collect();
        assert_eq!(env, ["A=1", "PATH=/usr/bin:/bin"]);
        assert!(
            !out.contains("stdin:"),
            "stdin is /dev/null, so read fails: {out}"
        );
        // sh's own listing descriptor (3) is the only one above 2.
        let listed = lines
            .iter()
            .find(|l| l.starts_with("0 "))
            .unwrap_or_else(|| panic!("{out}"));
        assert_eq!(listed.trim(), "0 1 2 3", "{out}");
        assert_eq!(err, "to-stderr\n");
    }

    #[test]
    fn the_child_keeps_the_blocked_signals_of_the_calling_thread() {
        // The supervisor keeps the node's blocked signals: SIGUSR1 blocked here must stay so
        // (read by grep itself: a shell may clear its mask).
        let mut usr1: libc::sigset_t = unsafe_zeroed_sigset();
        let mut before: libc::sigset_t = unsafe_zeroed_sigset();
        // SAFETY: signal-set calls on local sets; pthread_sigmask on this test thread only.
        unsafe {
            libc::sigaddset(&mut usr1, libc::SIGUSR1);
            libc::pthread_sigmask(libc::SIG_BLOCK, &usr1, &mut before);
        }
        let ran = run("mask", "/bin/grep", &["^SigBlk", "/proc/self/status"], &[]);
        // SAFETY: restoring this test thread's mask.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut());
        }
        assert_eq!(ran.1, "SigBlk:\t0000000000000200\n");
    }

    /// A start called off between its preparation and its clone: nothing runs, and the
    /// descriptors it held are closed (the stdout pipe reads its end at once).
    #[test]
    fn a_prepared_start_dropped_unstarted_runs_nothing_and_holds_nothing() {
        let dir = scratch("unstarted");
        std::fs::create_dir_all(&dir).unwrap();
        let marker = dir.join("ran");
        let null = File::open("/dev/null").unwrap();
        let (read, write) = pipe().unwrap();
        let err = File::create(dir.join("stderr")).unwrap();
        let args = [OsString::from(marker.as_os_str())];
        let ready = prepare_workload(
            Path::new("/usr/bin/touch"),
            OsStr::new("touch"),
            &args,
            std::iter::empty(),
            &dir,
            [null.into(), write, err.into()],
        )
        .expect("prepared");
        drop(ready);
        let mut out = String::new();
        File::from(read).read_to_string(&mut out).unwrap();
        assert_eq!(out, "");
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!marker.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A workload started by [`spawn_workload`] in a scratch directory: its stdout.
    fn run_workload(tag: &str, exe: &str, arg0: &str, args: &[&str]) -> String {
        let dir = scratch(tag);
        std::fs::create_dir_all(&dir).unwrap();
        let null = File::open("/dev/null").unwrap();
        let (read, write) = pipe().unwrap();
        let err = File::create(dir.join("stderr")).unwrap();
        let env = [(OsStr::new("A"), OsStr::new("1"))];
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        let pid = spawn_workload(
            Path::new(exe),
            OsStr::new(arg0),
            &args,
            env.into_iter(),
            &dir,
            [null.into(), write, err.into()],
        )
        .expect("started");
        let mut out = String::new();
        File::from(read).read_to_string(&mut out).unwrap();
        let mut status = 0;
        // SAFETY: waitpid on the child just started, valid out pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        let _ = std::fs::remove_dir_all(&dir);
        out
    }

    /// D25 / D51 / D46.1 for a workload started this way: it leads a process group of its own,
    /// has no signal blocked or ignored (SIGUSR1 blocked and SIGURG ignored here), holds only
    /// its three streams (a descriptor opened without close-on-exec does not cross), gets `arg0`
    /// and exactly `env`. Each read by the exec'd program itself, of `/proc/self`.
    #[test]
    fn g13_a_workload_started_without_a_fork_leads_its_group_with_no_signal_blocked_or_ignored() {
        workload_leads_its_group_with_no_signal_blocked_or_ignored("wl");
    }

    /// Where the kernel refuses the clone: the same child, forked.
    #[test]
    fn g13_a_workload_forked_where_the_clone_is_refused_leads_its_group_with_nothing_blocked() {
        forked(|| workload_leads_its_group_with_no_signal_blocked_or_ignored("wl-forked"));
    }

    fn workload_leads_its_group_with_no_signal_blocked_or_ignored(tag: &str) {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: socketpair writes two descriptors into the array we own.
        assert_eq!(
            unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) },
            0
        );
        // SAFETY: both descriptors were just created and are owned here.
        let (_a, _b) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let mut usr1: libc::sigset_t = unsafe_zeroed_sigset();
        let mut before: libc::sigset_t = unsafe_zeroed_sigset();
        // SAFETY: signal-set calls on local sets; this test thread's mask; SIGURG ignored for
        // the moment of the start (no test uses it).
        let old = unsafe {
            libc::sigaddset(&mut usr1, libc::SIGUSR1);
            libc::pthread_sigmask(libc::SIG_BLOCK, &usr1, &mut before);
            libc::signal(libc::SIGURG, libc::SIG_IGN)
        };
        let status = run_workload(
            &format!("{tag}-status"),
            "/bin/grep",
            "grep",
            &["-E", "^(Pid|NSpgid|SigBlk|SigIgn):", "/proc/self/status"],
        );
        let listing = run_workload(
            &format!("{tag}-fds"),
            "/bin/ls",
            "ls",
            &["-l", "/proc/self/fd"],
        );
        // SAFETY: restoring this test thread's mask and SIGURG's disposition.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut());
            libc::signal(libc::SIGURG, old);
        }
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
                .unwrap_or_else(|| panic!("{status}"))
                .to_string()
        };
        assert_eq!(
            field("Pid:"),
            field("NSpgid:"),
            "its own process group: {status}"
        );
        assert_eq!(field("SigBlk:"), "0000000000000000", "{status}");
        // Signals 1–31 (what D51 resets; a real-time one the test's own parent ignored may stay,
        // as it did with std's fork).
        let ignored = u64::from_str_radix(&field("SigIgn:"), 16).unwrap();
        assert_eq!(ignored & 0x7fff_ffff, 0, "{status}");
        let numbers: Vec<&str> = listing
            .lines()
            .filter_map(|l| l.split_once(" -> ")?.0.split_whitespace().last())
            .collect();
        // ls's own directory descriptor (3) is the only one above 2.
        assert_eq!(numbers, ["0", "1", "2", "3"], "{listing}");
        assert!(!listing.contains("socket:"), "{listing}");
        let shell = run_workload(
            &format!("{tag}-env"),
            "/bin/sh",
            "custom0",
            &["-c", "echo $0; env | sort"],
        );
        let lines: Vec<&str> = shell
            .lines()
            .filter(|l| {
                !["PWD=", "SHLVL=", "_=", "OLDPWD="]
                    .iter()
                    .any(|p| l.starts_with(p))
            })
            .collect();
        assert_eq!(lines, ["custom0", "A=1"], "{shell}");
    }

    #[test]
    fn a_failed_exec_is_an_error_and_leaves_nothing() {
        failed_exec_is_an_error("err");
    }

    /// Forked, the child's errno comes back through its pipe; the child is reaped (or left
    /// to the reaper) without a panic whoever collects it.
    #[test]
    fn a_failed_exec_of_a_forked_child_is_the_same_error() {
        forked(|| failed_exec_is_an_error("err-forked"));
    }

    fn failed_exec_is_an_error(tag: &str) {
        let dir = std::env::temp_dir();
        let file = dir.join(format!("cw-vspawn-{tag}-{}", std::process::id()));
        let err = File::create(&file).unwrap();
        let r = spawn(
            Path::new("/nonexistent/cw-no-such-binary"),
            &[],
            &BTreeMap::new(),
            &dir,
            err,
        );
        match r {
            Err(Failure::Child(e)) => assert_eq!(e.kind(), std::io::ErrorKind::NotFound),
            other => panic!("{:?}", other.map(|s| s.pid)),
        }
        let _ = std::fs::remove_file(&file);
    }
}
