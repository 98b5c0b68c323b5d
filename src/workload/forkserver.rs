//! The fork server (issue 25 item 5): supervisors started by a fork of a small process, without
//! an exec.
//!
//! Every start used to exec this binary as `__shim` (the supervisor): 0.5–0.7 ms of the static
//! build's own start-up (relocating itself, its page faults) and ~2 ms of the dynamic one's
//! (the loader binding OpenSSL), on the way to every workload. Now the spawner thread starts one
//! process at the node's start-up, `<exe> __forkserver`: single-threaded, exec'd fresh (none of
//! the node's memory, descriptors or environment), holding one end of a `SOCK_SEQPACKET`
//! socketpair as its stdin. Per start the spawner sends it one message, the supervisor's
//! arguments, environment and directory, with its stdout (the pid channel, a socket) and stderr (`shim.log`)
//! as `SCM_RIGHTS`; the fork server forks, and the child runs the supervisor's `main`
//! ([`super::shim::run`]) directly. What the supervisor is and owes does not change: it outlives
//! the node, holds the workload's pid, writes the exit record.
//!
//! - **Forked before the start comes.** The fork server keeps one child forked ahead, the
//!   standby, which takes the next request itself and becomes its supervisor: no fork on a
//!   start's path (see [`serve`]). The fork server forks the next one after [`REFILL_PAUSE`],
//!   and forks for each request itself while it has none.
//! - **The node's child, as before.** The fork is `clone(CLONE_PARENT | SIGCHLD)`: the
//!   supervisor's parent is the node (the fork server's parent), so the node's reaper
//!   (`waitpid(-1)`) reaps it exactly as it reaped an exec'd one, and a node in a container as
//!   PID 1 (D58) is no exception (`CLONE_PARENT` is refused only to a namespace's init itself).
//! - **What crosses, as before (D46.1).** In the child the fork server's socket (its stdin) is
//!   replaced by `/dev/null`, stdout and stderr by the two received descriptors, and the
//!   supervisor closes every descriptor above 2 first thing ([`crate::fds::close_inherited`]).
//!   Its environment is exactly the one sent; its directory the one sent; its signal mask the
//!   node's, as an exec'd supervisor's was (the fork server is started with it and blocks the
//!   handled signals itself, as `__shim` does).
//! - **The fork server is not dumpable** (a same-uid workload cannot ptrace it to start
//!   processes or read the environments passing through); each supervisor is made dumpable again,
//!   as an exec'd supervisor was, so that the node reads its `/proc` entries as before.
//! - **Found after a restart.** A supervisor forked this way has the fork server's command line
//!   (`<exe> __forkserver`), not `<exe> __shim <dir> …`: a restarted node that looks for the
//!   supervisor of a start in flight (recover.rs) also takes a process whose command line is the
//!   fork server's and whose working directory is the workload's directory.
//! - **Always a way back.** A message too big for one packet ([`MAX_REQUEST`], or the host's
//!   socket buffer) or a fork the kernel refuses for the moment (EAGAIN, ENOMEM) goes the exec
//!   way for that start; a fork server that is gone, silent or refused otherwise is dropped
//!   (killed) and later starts go the exec way ([`super::vspawn`]) until the spawner starts a
//!   new one (`CYBERWAVE_NODE_FORKSERVER_RESTART_SECONDS` later, spawner.rs).
//!   `CYBERWAVE_NO_FORKSERVER=1` turns it off.
//! - **The fork's copy of the C library believes it is the fork server's thread.** A raw
//!   `clone` does not refresh the thread id libc caches (only `fork()` does, and `fork()` has no
//!   `CLONE_PARENT`). Nothing the supervisor runs reads it (Rust's locks, allocation and
//!   `Command` do not); `raise`/`abort` would (musl's `tkill`s that cached id, the fork server's):
//!   a supervisor has no panic path (an unwinding one is caught below and ends the child with
//!   101), and should one abort anyway (out of memory, a stack overflow), the fork server ignores
//!   SIGABRT, so the abort ends the supervisor alone.
//! - **Neither a lost request nor a start run twice.** The fork server holds a request only in
//!   its receive buffer, wipes it before the next fork, and the supervisor decodes its own after
//!   the fork: no supervisor holds another start's environment (its tokens). A fork server
//!   silent after a request is continued (`SIGCONT`: a workload of the same uid may have stopped
//!   it) and waited for up to [`ANSWER_LIMIT`]; if it still does not answer it is killed and, once
//!   it is gone, the pid channel says whether it forked the supervisor before it went (someone
//!   holds or wrote to its other end): then that supervisor is the start's, found by its directory;
//!   else the start goes the exec way.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::vspawn;

/// The mode's word on the fork server's command line (and on its supervisors').
pub const MODE: &str = "__forkserver";
/// The environment variable that turns the fork server off (every supervisor exec'd).
pub const OFF_VAR: &str = "CYBERWAVE_NO_FORKSERVER";
/// The largest request sent to the fork server; a bigger one (a huge command line) goes the exec
/// way. Under the default unix socket send buffer (`net.core.wmem_default`, 208 KiB).
pub const MAX_REQUEST: usize = 128 * 1024;
/// How long the fork server has to say it is ready, and each wait for an answer to a request;
/// past each, a fork server still alive is continued with its standby (`SIGCONT` to their
/// process group: a workload of the node's uid may have stopped them) and waited for again, up
/// to [`ANSWER_LIMIT`].
pub const REPLY_TIMEOUT: Duration = Duration::from_millis(500);
/// The longest a request waits for its answer.
pub const ANSWER_LIMIT: Duration = Duration::from_secs(3);

const MAGIC: &[u8] = b"cw-fork-1\0";
const TAG_ARG: u8 = b'a';
const TAG_ENV: u8 = b'e';
const TAG_DIR: u8 = b'd';

/// One start, as the fork server reads it.
#[derive(Debug, PartialEq, Eq)]
pub struct Request {
    /// The supervisor's arguments, `__shim` first.
    pub args: Vec<OsString>,
    /// Its whole environment.
    pub env: Vec<(OsString, OsString)>,
    /// Its working directory (the workload's directory).
    pub dir: PathBuf,
}

/// Why a request was not read.
#[derive(Debug, PartialEq, Eq)]
pub enum Malformed {
    Magic,
    Item,
    Tag(u8),
    Env,
    Dir,
    Args,
}

/// A request in its wire form: the magic, then one `tag bytes NUL` item per argument, variable
/// (`KEY=value`) and the directory. `None` when a part holds a NUL or the whole is over
/// [`MAX_REQUEST`].
pub fn encode(args: &[OsString], env: &BTreeMap<String, String>, dir: &Path) -> Option<Vec<u8>> {
    let mut out = MAGIC.to_vec();
    let mut item = |tag: u8, parts: &[&[u8]]| -> Option<()> {
        out.push(tag);
        for p in parts {
            if p.contains(&0) {
                return None;
            }
            out.extend_from_slice(p);
        }
        out.push(0);
        Some(())
    };
    for a in args {
        item(TAG_ARG, &[a.as_bytes()])?;
    }
    for (k, v) in env {
        if k.is_empty() || k.contains('=') {
            return None;
        }
        item(TAG_ENV, &[k.as_bytes(), b"=", v.as_bytes()])?;
    }
    item(TAG_DIR, &[dir.as_os_str().as_bytes()])?;
    (out.len() <= MAX_REQUEST).then_some(out)
}

/// Reads a request back ([`encode`]'s form); anything else is [`Malformed`].
pub fn decode(bytes: &[u8]) -> Result<Request, Malformed> {
    let body = bytes.strip_prefix(MAGIC).ok_or(Malformed::Magic)?;
    let body = body.strip_suffix(&[0]).ok_or(Malformed::Item)?;
    let mut req = Request {
        args: Vec::new(),
        env: Vec::new(),
        dir: PathBuf::new(),
    };
    let mut dir = None;
    for item in body.split(|b| *b == 0) {
        let (&tag, rest) = item.split_first().ok_or(Malformed::Item)?;
        match tag {
            TAG_ARG => req.args.push(OsString::from_vec(rest.to_vec())),
            TAG_ENV => {
                let eq = rest.iter().position(|b| *b == b'=').ok_or(Malformed::Env)?;
                let (k, v) = rest.split_at(eq);
                let v = v.get(1..).unwrap_or_default();
                if k.is_empty() {
                    return Err(Malformed::Env);
                }
                req.env.push((
                    OsString::from_vec(k.to_vec()),
                    OsString::from_vec(v.to_vec()),
                ));
            }
            TAG_DIR if dir.is_none() && !rest.is_empty() => {
                dir = Some(PathBuf::from(OsString::from_vec(rest.to_vec())));
            }
            TAG_DIR => return Err(Malformed::Dir),
            other => return Err(Malformed::Tag(other)),
        }
    }
    req.dir = dir.ok_or(Malformed::Dir)?;
    if req.args.first().map(|a| a.as_bytes()) != Some(b"__shim".as_slice()) {
        return Err(Malformed::Args);
    }
    Ok(req)
}

/// The descriptors that come with a request: the supervisor's stdout (the pid channel), its stderr
/// (`shim.log`) and its gate (one end of a unix socket pair the spawner writes
/// [`super::shim::GATE_GO`] to once the start's files are written: the supervisor's stdin until
/// then).
type Streams = [OwnedFd; 3];

/// The fork server's answer to one message.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub enum Reply {
    /// Its first message: it runs and reads requests.
    Ready,
    /// The supervisor's pid.
    Started(i32),
    /// Nothing was started: the errno of the fork, or EINVAL for a request it could not read.
    Failed(i32),
}

impl Reply {
    fn to_bytes(self) -> [u8; 5] {
        let (tag, n) = match self {
            Reply::Ready => (b'r', 0),
            Reply::Started(pid) => (b'p', pid),
            Reply::Failed(errno) => (b'e', errno),
        };
        let n = n.to_le_bytes();
        [tag, n[0], n[1], n[2], n[3]]
    }

    fn from_bytes(b: &[u8]) -> Option<Reply> {
        let (&tag, n) = b.split_first()?;
        let n = i32::from_le_bytes(<[u8; 4]>::try_from(n).ok()?);
        match tag {
            b'r' if n == 0 => Some(Reply::Ready),
            b'p' if n > 0 => Some(Reply::Started(n)),
            b'e' => Some(Reply::Failed(n)),
            _ => None,
        }
    }
}

/// Why a start did not go through the fork server.
#[derive(Debug)]
pub enum Error {
    /// This request cannot be sent (too big, a NUL): this start goes the exec way; the fork
    /// server stays.
    Unsendable,
    /// The fork server is gone or refused, before it could fork: drop it; this and every later
    /// start go the exec way.
    Broken(std::io::Error),
    /// The request went out and no answer came: it may or may not have forked this start's
    /// supervisor. Drop it ([`ForkServer::stop`]) and find out before anything else is started
    /// for it (launch.rs).
    Unanswered(std::io::Error),
}

/// The node's side: the socket to the fork server and its pid.
pub struct ForkServer {
    sock: OwnedFd,
    pid: i32,
    /// Its start time (`/proc/<pid>/stat`), so that a recycled pid is never killed.
    ticks: u64,
    /// A request was sent and its answer not read yet ([`Self::request`]).
    pending: std::cell::Cell<bool>,
}

impl ForkServer {
    /// Starts `<exe> __forkserver` (by [`vspawn::spawn_with`]: nothing of the node crosses but
    /// its socket and two `/dev/null`s) and waits for it to say it is ready. An `exe` that does
    /// not know the mode (an older binary put in its place) exits instead: an error here.
    pub fn start(exe: &Path) -> std::io::Result<ForkServer> {
        let (ours, theirs) = seqpacket_pair()?;
        let null = || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/null")
                .map(OwnedFd::from)
        };
        let streams = [theirs, null()?, null()?];
        let pid = vspawn::spawn_with(
            exe,
            &[MODE.into()],
            &BTreeMap::new(),
            Path::new("/"),
            streams,
        )
        .map_err(|f| match f {
            vspawn::Failure::Clone(e) | vspawn::Failure::Child(e) => e,
        })?;
        // Without its start time it could never be told from a process that took its pid, so
        // it would never be killed: not used. Dropping `ours` closes its socket and it ends.
        let ticks = super::procinfo::start_ticks(pid)
            .filter(|t| *t != 0)
            .ok_or_else(|| {
                std::io::Error::other(format!(
                    "cannot read the start time of the fork server (pid {pid}) in /proc"
                ))
            })?;
        let server = ForkServer {
            sock: ours,
            pid,
            ticks,
            pending: std::cell::Cell::new(false),
        };
        set_timeout(&server.sock, REPLY_TIMEOUT)?;
        match server.reply()? {
            Reply::Ready => Ok(server),
            other => Err(std::io::Error::other(format!(
                "the fork server answered {other:?} instead of saying it is ready"
            ))),
        }
    }

    /// The fork server's pid.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Starts one supervisor: `args` (`__shim` first) in `dir` with exactly `env`, `stdout` and
    /// `stderr`, and `gate` as its stdin until the spawner opens it (it starts the workload only
    /// then); its pid.
    pub fn spawn(
        &self,
        args: &[OsString],
        env: &BTreeMap<String, String>,
        dir: &Path,
        fds: [&OwnedFd; 3],
    ) -> Result<i32, Error> {
        self.request(args, env, dir, fds)?;
        self.started()
    }

    /// The first half of [`Self::spawn`]: sends the request and returns at once, so that the
    /// caller can write the start's files while the supervisor is made (issue 25 item 5). Once
    /// it returned `Ok`, [`Self::started`] is to be called before the next request, whatever
    /// else fails meanwhile: each request has one answer, read in turn. A request while an
    /// answer is still unread (its caller panicked in between) is refused as `Broken`: the next
    /// answer would be the earlier request's.
    pub fn request(
        &self,
        args: &[OsString],
        env: &BTreeMap<String, String>,
        dir: &Path,
        [stdout, stderr, gate]: [&OwnedFd; 3],
    ) -> Result<(), Error> {
        if self.pending.get() {
            return Err(Error::Broken(std::io::Error::other(
                "the answer to an earlier request was never read",
            )));
        }
        let msg = encode(args, env, dir).ok_or(Error::Unsendable)?;
        let fds = [stdout.as_raw_fd(), stderr.as_raw_fd(), gate.as_raw_fd()];
        send_with_fds(&self.sock, &msg, &fds).map_err(|e| match e.raw_os_error() {
            // Over this host's socket buffer (`net.core.wmem_*` set low): this one start.
            Some(libc::EMSGSIZE) => Error::Unsendable,
            _ => Error::Broken(e),
        })?;
        self.pending.set(true);
        Ok(())
    }

    /// The second half of [`Self::spawn`]: the supervisor's pid, once the fork server (or its
    /// standby) answered the request sent last.
    pub fn started(&self) -> Result<i32, Error> {
        self.pending.set(false);
        match self.answer().map_err(Error::Unanswered)? {
            Reply::Started(pid) => Ok(pid),
            // Out of processes or memory for the moment: this start goes the exec way (which
            // then says why it cannot either); the fork server stays for the next one.
            Reply::Failed(errno) if errno == libc::EAGAIN || errno == libc::ENOMEM => {
                Err(Error::Unsendable)
            }
            Reply::Failed(errno) => Err(Error::Broken(std::io::Error::from_raw_os_error(errno))),
            Reply::Ready => Err(Error::Unanswered(std::io::Error::other(
                "the fork server answered out of turn",
            ))),
        }
    }

    /// The answer to the request just sent, waited for up to [`ANSWER_LIMIT`]; a fork server
    /// silent past each [`REPLY_TIMEOUT`] is continued first (it may have been stopped).
    fn answer(&self) -> std::io::Result<Reply> {
        let until = crate::util::later(std::time::Instant::now(), ANSWER_LIMIT);
        loop {
            match self.reply() {
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        && std::time::Instant::now() < until
                        && super::procinfo::same_process_alive(self.pid, self.ticks) =>
                {
                    // The reader may be its standby: the whole group is continued.
                    signal_group(self.pid, libc::SIGCONT);
                }
                other => return other,
            }
        }
    }

    /// Ends the fork server and waits (up to a second) until it is gone, so that it holds no
    /// descriptor any more: then the socket closes, and with it any request still in it.
    pub fn stop(self) {
        if self.ticks != 0 && super::procinfo::same_process_alive(self.pid, self.ticks) {
            // Its standby too, which may hold the request (stopped before it answered).
            signal_group(self.pid, libc::SIGKILL);
            let until = crate::util::later(std::time::Instant::now(), Duration::from_secs(1));
            while super::procinfo::same_process_alive(self.pid, self.ticks)
                && std::time::Instant::now() < until
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            // And until nothing holds its end of the socket any more (the standby, killed with
            // it, may end a moment later).
            let mut p = libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: 0,
                revents: 0,
            };
            let left = until.saturating_duration_since(std::time::Instant::now());
            let ms = libc::c_int::try_from(left.as_millis()).unwrap_or(0);
            // SAFETY: poll of one pollfd we own.
            unsafe {
                libc::poll(&mut p, 1, ms);
            }
        }
    }

    fn reply(&self) -> std::io::Result<Reply> {
        let mut buf = [0u8; 16];
        let n = loop {
            // SAFETY: recv into a local buffer of the given length.
            let n =
                unsafe { libc::recv(self.sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n >= 0 {
                break n;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        let n = usize::try_from(n).unwrap_or(0);
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the fork server is gone",
            ));
        }
        Reply::from_bytes(buf.get(..n).unwrap_or_default())
            .ok_or_else(|| std::io::Error::other("the fork server's answer is unreadable"))
    }
}

impl Drop for ForkServer {
    /// Closing the socket ends it (it reads end-of-file); killed too, should it be stuck (only
    /// while its pid is still the same process). The reaper thread reaps it.
    fn drop(&mut self) {
        if self.ticks != 0 && super::procinfo::same_process_alive(self.pid, self.ticks) {
            // SAFETY: kill with the pid of the fork server this node started, still alive.
            unsafe {
                libc::kill(self.pid, libc::SIGKILL);
            }
        }
    }
}

/// Sends `sig` to the process group of the fork server `pid` (its standby and any supervisor
/// not yet in a session of its own); to `pid` alone where that group is not there (an older
/// fork server that made none). Only while `pid` is known to be the fork server this node
/// started, alive (its own child: the pid, and the group, are not recycled before it is reaped).
fn signal_group(pid: i32, sig: libc::c_int) {
    // SAFETY: kill with the group (then the pid) of the fork server this node started.
    unsafe {
        if pid
            .checked_neg()
            .is_none_or(|group| libc::kill(group, sig) != 0)
        {
            libc::kill(pid, sig);
        }
    }
}

#[cfg(test)]
impl ForkServer {
    /// A fork server whose other end is the returned socket (a test's stand-in).
    pub(super) fn for_tests() -> (OwnedFd, ForkServer) {
        let (ours, theirs) = seqpacket_pair().unwrap();
        let server = ForkServer {
            sock: ours,
            pid: 0,
            ticks: 0,
            pending: std::cell::Cell::new(false),
        };
        (theirs, server)
    }
}

/// A test's stand-in for the fork server: reads one request from `peer`, calls `before`, answers
/// `pid`, and returns the descriptors that came with it (the supervisor's stdout, stderr and
/// gate).
#[cfg(test)]
pub(super) fn answer_for_tests(peer: &OwnedFd, pid: i32, before: impl FnOnce()) -> Streams {
    let mut buf = vec![0u8; MAX_REQUEST + 1];
    let got = recv_with_fds(peer.as_raw_fd(), &mut buf, 3).unwrap();
    assert!(well_formed(&buf[..got.len]));
    before();
    send_reply(peer.as_raw_fd(), Reply::Started(pid)).unwrap();
    Streams::try_from(got.fds).unwrap()
}

fn seqpacket_pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    vspawn::unix_pair(libc::SOCK_SEQPACKET)
}

fn set_timeout(sock: &OwnedFd, d: Duration) -> std::io::Result<()> {
    // The field types, not their aliases (deprecated in the musl build): timeouts here are
    // under a second or a few, far inside either width.
    let tv = libc::timeval {
        tv_sec: d.as_secs().try_into().unwrap_or(1),
        tv_usec: d.subsec_micros().into(),
    };
    for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: setsockopt with a timeval we own and its exact size.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                std::ptr::from_ref(&tv).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Room for the control message of `n` descriptors.
fn cmsg_space(n: usize) -> usize {
    let bytes = u32::try_from(n.saturating_mul(std::mem::size_of::<RawFd>())).unwrap_or(0);
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    usize::try_from(unsafe { libc::CMSG_SPACE(bytes) }).unwrap_or(0)
}

/// A message header over one buffer (`iov`) and a control buffer; both must outlive its use.
fn header(iov: &mut libc::iovec, control: &mut [u8]) -> libc::msghdr {
    // SAFETY: msghdr is a plain struct; all zeroes is a valid empty header, filled in below.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = iov;
    hdr.msg_iovlen = 1;
    hdr.msg_control = control.as_mut_ptr().cast();
    hdr.msg_controllen = control.len() as _;
    hdr
}

fn send_with_fds(sock: &OwnedFd, msg: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    let mut control = vec![0u8; cmsg_space(fds.len())];
    let mut iov = libc::iovec {
        iov_base: msg.as_ptr().cast_mut().cast(),
        iov_len: msg.len(),
    };
    let hdr = header(&mut iov, &mut control);
    let fd_bytes = u32::try_from(std::mem::size_of_val(fds)).unwrap_or(0);
    // SAFETY: the control buffer has room for one header and `fds` (cmsg_space); CMSG_FIRSTHDR
    // and CMSG_DATA point inside it; sendmsg reads the header, the iovec and the buffer, all
    // alive for the call.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&hdr);
        if c.is_null() {
            return Err(std::io::Error::other("no room for the descriptors"));
        }
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
        std::ptr::copy_nonoverlapping(
            fds.as_ptr().cast::<u8>(),
            libc::CMSG_DATA(c),
            std::mem::size_of_val(fds),
        );
        loop {
            let n = libc::sendmsg(sock.as_raw_fd(), &hdr, libc::MSG_NOSIGNAL);
            if n >= 0 {
                return if usize::try_from(n).ok() == Some(msg.len()) {
                    Ok(())
                } else {
                    Err(std::io::Error::other("the request was cut short"))
                };
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// One message and the descriptors that came with it (each owned, close-on-exec); `truncated`
/// when the message or its descriptors did not fit.
struct Received {
    len: usize,
    fds: Vec<OwnedFd>,
    truncated: bool,
}

fn recv_with_fds(sock: RawFd, buf: &mut [u8], max_fds: usize) -> std::io::Result<Received> {
    let mut control = vec![0u8; cmsg_space(max_fds)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut hdr = header(&mut iov, &mut control);
    // SAFETY: recvmsg writes into the buffer and the control buffer it is given, within their
    // lengths.
    let n = unsafe { libc::recvmsg(sock, &mut hdr, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: CMSG_FIRSTHDR/NXTHDR walk the control buffer recvmsg filled, within
    // msg_controllen; each SCM_RIGHTS payload is a run of descriptors now owned by this process.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&hdr);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let header = usize::try_from(data.offset_from(c.cast::<u8>())).unwrap_or(0);
                // usize in glibc, u32 in musl.
                #[allow(clippy::useless_conversion)]
                let total = usize::try_from((*c).cmsg_len).unwrap_or(0);
                let size = std::mem::size_of::<RawFd>();
                let count = total.saturating_sub(header).checked_div(size).unwrap_or(0);
                for i in 0..count {
                    let fd =
                        std::ptr::read_unaligned(data.add(i.saturating_mul(size)).cast::<RawFd>());
                    if fd >= 0 {
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&hdr, c);
        }
    }
    let truncated = hdr.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0;
    Ok(Received {
        len: usize::try_from(n).unwrap_or(0),
        fds,
        truncated,
    })
}

fn send_reply(sock: RawFd, reply: Reply) -> std::io::Result<()> {
    let b = reply.to_bytes();
    // SAFETY: send of a local buffer of the given length.
    let n = unsafe { libc::send(sock, b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// How long the fork server waits after its standby took a request before it forks the next
/// one: the fork (~0.15 ms of a core) then does not compete with the start just made, whose
/// workload is starting on this host's cores. A request that comes meanwhile is forked for as
/// before.
pub const REFILL_PAUSE: Duration = Duration::from_millis(20);
/// How long the fork server waits before it tries again to fork a standby the kernel refused
/// (out of processes or memory); it reads requests itself meanwhile.
pub const REFILL_RETRY: Duration = Duration::from_secs(1);

/// `<exe> __forkserver`: the fork server's `main`. Its stdin is the socket to the node; it
/// serves requests until the node closes it (the node is gone), then exits 0.
///
/// **The standby.** A fork on a start's path costs ~0.15 ms, so the fork is made before the
/// start comes: the fork server keeps one child forked ahead, the *standby*, which waits for the
/// next request on the same socket, takes it, answers with its own pid and becomes that start's
/// supervisor ([`stand_by`]). Then (after [`REFILL_PAUSE`]) the fork server forks the next one.
/// Exactly one process reads the socket at a time: the standby while there is one, else the
/// fork server, which then forks for each request as before ([`fork_supervisor`]). The standby
/// is forked from a fork server that holds no request (each is wiped), so it holds nothing but
/// its own. It is in the fork server's process group, which the node continues when an answer
/// is late and kills with the fork server ([`ForkServer::stop`]); and it never takes a request
/// once the fork server is gone (a pipe tells it), since the node may have given up on that
/// request by then.
pub fn serve() -> i32 {
    const SOCK: RawFd = 0;
    crate::signals::not_dumpable();
    // A supervisor forked from here that aborts would, through the C library's stale thread id
    // (see the module's doc), signal this process: SIGABRT is ignored here (and set back to the
    // default in each supervisor).
    // SAFETY: signal() with SIG_IGN for a valid signal number; setpgid takes plain integers (a
    // group of its own, shared with its standby: the node signals both at once).
    unsafe {
        libc::signal(libc::SIGABRT, libc::SIG_IGN);
        libc::setpgid(0, 0);
    }
    // The standby's way to know this process is gone: it holds the read end, this process the
    // write end alone (the standby closes its copy).
    let Ok((alive_read, alive_write)) = vspawn::pipe() else {
        return 1;
    };
    if send_reply(SOCK, Reply::Ready).is_err() {
        return 1;
    }
    let mut buf = vec![0u8; MAX_REQUEST.saturating_add(1)];
    // The read end of the pipe the standby holds the write end of: it hangs up when the standby
    // took a request, or ended.
    let mut standby: Option<OwnedFd> = None;
    let mut refill_at = Some(std::time::Instant::now());
    loop {
        let now = std::time::Instant::now();
        if standby.is_none() && refill_at.is_some_and(|at| at <= now) {
            standby = fork_standby(alive_read.as_raw_fd(), alive_write.as_raw_fd());
            refill_at = match standby {
                Some(_) => None,
                None => Some(crate::util::later(now, REFILL_RETRY)),
            };
        }
        let wait = match (&standby, refill_at) {
            (None, Some(at)) => {
                let ms = at
                    .saturating_duration_since(now)
                    .as_millis()
                    .saturating_add(1);
                libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
            }
            _ => -1,
        };
        // The socket is read here only while there is no standby; its hang-up is seen either way.
        let mut fds = [
            libc::pollfd {
                fd: SOCK,
                events: if standby.is_none() { libc::POLLIN } else { 0 },
                revents: 0,
            },
            libc::pollfd {
                fd: standby.as_ref().map_or(-1, AsRawFd::as_raw_fd),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: poll of two pollfds we own (a negative fd is skipped).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, wait) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return 1;
        }
        let [sock, taken] = fds;
        if taken.revents != 0 {
            // Taken (or gone): the next one after the pause.
            standby = None;
            refill_at = Some(crate::util::later(std::time::Instant::now(), REFILL_PAUSE));
        }
        if standby.is_none() && sock.revents & libc::POLLIN != 0 {
            if serve_one(SOCK, &mut buf).is_none() {
                return 0;
            }
        } else if sock.revents & (libc::POLLHUP | libc::POLLERR) != 0 {
            // The node is gone (a standby reads the end of file and ends too).
            return 0;
        }
    }
}

/// Reads one request from `sock` and forks its supervisor; `None` when the node is gone or
/// the socket failed.
fn serve_one(sock: RawFd, buf: &mut [u8]) -> Option<()> {
    let got = loop {
        match recv_with_fds(sock, buf, 3) {
            Ok(g) => break g,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return None,
        }
    };
    if got.len == 0 && got.fds.is_empty() {
        return None;
    }
    let msg = buf.get(..got.len).unwrap_or_default();
    let reply = match (got.truncated, Streams::try_from(got.fds)) {
        (false, Ok(fds)) if well_formed(msg) => fork_supervisor(msg, fds),
        _ => Reply::Failed(libc::EINVAL),
    };
    // The request (its environment holds the workload's tokens) is only ever in `buf`, and
    // is wiped before the next fork: a supervisor forked later, whose memory a workload of
    // the same uid can read, holds no earlier start's secrets.
    wipe(buf.get_mut(..got.len).unwrap_or_default());
    send_reply(sock, reply).ok()
}

/// Forks the standby (see [`serve`]); the read end of the pipe it hangs up when it took a
/// request or ended. `None` when the kernel refused the fork (or the pipe).
fn fork_standby(alive_read: RawFd, alive_write: RawFd) -> Option<OwnedFd> {
    let (taken_read, taken_write) = vspawn::pipe().ok()?;
    let pid = fork_for_the_node();
    if pid == 0 {
        // SAFETY: close of this child's copies of descriptors it must not hold: the write end
        // of the fork server's pipe (else it would never hang up) and the read end of its own.
        unsafe {
            libc::close(alive_write);
            libc::close(taken_read.as_raw_fd());
        }
        stand_by(alive_read, taken_write.as_raw_fd());
    }
    drop(taken_write);
    (pid > 0).then_some(taken_read)
}

/// The standby (a child of [`fork_standby`]): waits for one request on the socket (fd 0) and
/// becomes its supervisor; ends, without taking one, once the fork server is gone (`alive`
/// hangs up) or the node is (end of file).
fn stand_by(alive: RawFd, taken: RawFd) -> ! {
    const SOCK: RawFd = 0;
    let gone = |code: i32| -> ! {
        // SAFETY: _exit never returns.
        unsafe { libc::_exit(code) }
    };
    let alive_gone = |wait: libc::c_int| -> Option<bool> {
        let mut fds = [
            libc::pollfd {
                fd: alive,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: if wait == 0 { -1 } else { SOCK },
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: poll of two pollfds we own (a negative fd is skipped).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, wait) };
        if n < 0 {
            return (std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted)
                .then_some(true);
        }
        let [a, s] = fds;
        if a.revents != 0 {
            return Some(true);
        }
        (s.revents != 0).then_some(false)
    };
    loop {
        match alive_gone(-1) {
            Some(true) => gone(0),
            Some(false) => break,
            None => continue,
        }
    }
    let mut buf = vec![0u8; MAX_REQUEST.saturating_add(1)];
    let got = loop {
        match recv_with_fds(SOCK, &mut buf, 3) {
            Ok(g) => break g,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => gone(1),
        }
    };
    if got.len == 0 && got.fds.is_empty() {
        gone(0);
    }
    // The fork server gone meanwhile: the node may have given up on this request (it kills a
    // fork server whose answer does not come), so it is never started here.
    if alive_gone(0) == Some(true) {
        wipe(buf.get_mut(..got.len).unwrap_or_default());
        gone(0);
    }
    let msg = buf.get(..got.len).unwrap_or_default();
    let fds = match (got.truncated, Streams::try_from(got.fds)) {
        (false, Ok(fds)) if well_formed(msg) => Some(fds),
        _ => None,
    };
    // SAFETY: getpid takes nothing (the raw syscall: a raw clone leaves no cached pid to trust).
    let me = unsafe { libc::syscall(libc::SYS_getpid) };
    let reply = match (&fds, i32::try_from(me)) {
        (Some(_), Ok(pid)) => Reply::Started(pid),
        _ => Reply::Failed(libc::EINVAL),
    };
    let sent = send_reply(SOCK, reply);
    // SAFETY: close of this process's two pipe ends: the fork server sees the hang-up and forks
    // the next standby; nothing of its own crosses into the supervisor.
    unsafe {
        libc::close(taken);
        libc::close(alive);
    }
    match fds {
        Some(fds) if sent.is_ok() => supervise(msg, fds),
        _ => gone(1),
    }
}

/// Zeroes `bytes` (not elided: the buffer is read again by the next `recvmsg`, and
/// `black_box` keeps the stores).
fn wipe(bytes: &mut [u8]) {
    bytes.fill(0);
    std::hint::black_box(&bytes);
}

/// Whether [`decode`] reads `bytes` (the same checks, without allocating: the fork server keeps
/// no copy of a request; the supervisor decodes its own after the fork).
pub fn well_formed(bytes: &[u8]) -> bool {
    let Some(body) = bytes.strip_prefix(MAGIC).and_then(|b| b.strip_suffix(&[0])) else {
        return false;
    };
    let (mut dirs, mut first) = (0usize, None);
    for item in body.split(|b| *b == 0) {
        match item.split_first() {
            Some((&TAG_ARG, rest)) => {
                first.get_or_insert(rest);
            }
            Some((&TAG_ENV, rest)) => {
                if rest
                    .iter()
                    .position(|b| *b == b'=')
                    .is_none_or(|eq| eq == 0)
                {
                    return false;
                }
            }
            Some((&TAG_DIR, rest)) if !rest.is_empty() => dirs = dirs.saturating_add(1),
            _ => return false,
        }
    }
    dirs == 1 && first == Some(b"__shim".as_slice())
}

/// Forks this process as the node's child (`clone(CLONE_PARENT | SIGCHLD)`): 0 in the child,
/// its pid in this process, negative (errno set) when the kernel refused.
fn fork_for_the_node() -> libc::c_long {
    // SAFETY: a raw clone without CLONE_VM is a fork (the child has a copy of this
    // single-threaded process and returns 0 here); CLONE_PARENT makes the node its parent, and
    // SIGCHLD the signal the node gets at its end. No stack or thread pointer is passed (zeroes).
    unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    }
}

/// Forks the supervisor of the request `msg` as the node's child; in the parent the
/// descriptors are closed (dropped) on return.
fn fork_supervisor(msg: &[u8], fds: Streams) -> Reply {
    let pid = fork_for_the_node();
    if pid == 0 {
        supervise(msg, fds);
    }
    if pid < 0 {
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL);
        return Reply::Failed(errno);
    }
    i32::try_from(pid).map_or(Reply::Failed(libc::EINVAL), Reply::Started)
}

/// The child: becomes the supervisor (its streams, directory and environment) of the request
/// `msg` and runs it.
fn supervise(msg: &[u8], [stdout, stderr, gate]: Streams) -> ! {
    // fd 0 is the socket to the node: stdin becomes the gate (the supervisor replaces it with
    // `/dev/null` once it opened), stdout and stderr the two received (all three numbered above
    // 2: 0–2 were taken when they came).
    // SAFETY: dup2 onto 0, 1 and 2 of descriptors this process holds.
    let ok = unsafe {
        libc::dup2(gate.as_raw_fd(), 0) == 0
            && libc::dup2(stdout.as_raw_fd(), 1) == 1
            && libc::dup2(stderr.as_raw_fd(), 2) == 2
    };
    drop(stdout);
    drop(stderr);
    drop(gate);
    if !ok {
        // SAFETY: _exit never returns.
        unsafe { libc::_exit(127) }
    }
    // SAFETY: signal() with SIG_DFL for a valid signal number: the supervisor's SIGABRT as an
    // exec'd one has it.
    unsafe {
        libc::signal(libc::SIGABRT, libc::SIG_DFL);
    }
    let Ok(req) = decode(msg) else {
        let _ = writeln!(
            std::io::stdout(),
            "error: the fork server's request is unreadable"
        );
        std::process::exit(2);
    };
    // SAFETY: prctl(PR_SET_DUMPABLE, 1) takes plain integers: dumpable again, as an exec'd
    // supervisor was (its parent's /proc reads of it keep working).
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0);
    }
    if let Err(e) = std::env::set_current_dir(&req.dir) {
        let _ = writeln!(
            std::io::stdout(),
            "error: cannot enter {}: {e}",
            req.dir.display()
        );
        std::process::exit(1);
    }
    // This process is single-threaded: the environment can be replaced.
    for (k, _) in std::env::vars_os() {
        std::env::remove_var(k);
    }
    for (k, v) in &req.env {
        std::env::set_var(k, v);
    }
    let args: Option<Vec<String>> = req
        .args
        .into_iter()
        .skip(1)
        .map(|a| a.into_string().ok())
        .collect();
    let Some(args) = args else {
        let _ = writeln!(
            std::io::stdout(),
            "error: the supervisor's arguments are not text"
        );
        std::process::exit(2);
    };
    let code = std::panic::catch_unwind(|| super::shim::run_gated(&args, true)).unwrap_or(101);
    std::process::exit(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn shim_args(extra: &[&str]) -> Vec<OsString> {
        std::iter::once("__shim")
            .chain(extra.iter().copied())
            .map(OsString::from)
            .collect()
    }

    #[test]
    fn a_request_reads_back_as_it_was_sent() {
        let args = shim_args(&[
            "/s/w/a",
            "/work",
            "",
            "bash",
            "echo 'a b' \u{1F600} =x",
            "10",
        ]);
        let e = env(&[("A", "1"), ("B", "x=y=z"), ("EMPTY", ""), ("U", "ünï")]);
        let msg = encode(&args, &e, Path::new("/s/w/a")).unwrap();
        let req = decode(&msg).unwrap();
        assert_eq!(req.args, args);
        assert_eq!(req.dir, PathBuf::from("/s/w/a"));
        let back: Vec<(String, String)> = req
            .env
            .into_iter()
            .map(|(k, v)| (k.into_string().unwrap(), v.into_string().unwrap()))
            .collect();
        assert_eq!(back, e.into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn what_cannot_be_sent_is_refused_before_it_is_sent() {
        let dir = Path::new("/d");
        let nul = vec![OsString::from("__shim"), OsString::from("a\0b")];
        assert_eq!(encode(&nul, &env(&[]), dir), None);
        assert_eq!(encode(&shim_args(&[]), &env(&[("K=", "v")]), dir), None);
        assert_eq!(encode(&shim_args(&[]), &env(&[("", "v")]), dir), None);
        assert_eq!(encode(&shim_args(&[]), &env(&[("K", "a\0")]), dir), None);
        assert_eq!(encode(&shim_args(&[]), &env(&[]), Path::new("/a\0")), None);
        let huge = "x".repeat(MAX_REQUEST);
        assert_eq!(encode(&shim_args(&[&huge]), &env(&[]), dir), None);
        let fits = "x".repeat(MAX_REQUEST - 200);
        assert!(encode(&shim_args(&[&fits]), &env(&[]), dir).is_some());
    }

    #[test]
    fn a_hostile_request_is_malformed_not_a_panic() {
        let good = encode(&shim_args(&["x"]), &env(&[("A", "1")]), Path::new("/d")).unwrap();
        assert!(decode(&good).is_ok());
        let cases: Vec<(Vec<u8>, Malformed)> = vec![
            (Vec::new(), Malformed::Magic),
            (b"cw-fork-2\0ad\0".to_vec(), Malformed::Magic),
            (MAGIC.to_vec(), Malformed::Item),
            ([MAGIC, b"a__shim"].concat(), Malformed::Item),
            ([MAGIC, b"a__shim\0\0d/d\0"].concat(), Malformed::Item),
            (
                [MAGIC, b"a__shim\0x1\0d/d\0"].concat(),
                Malformed::Tag(b'x'),
            ),
            (
                [MAGIC, b"a__shim\0eNOEQUALS\0d/d\0"].concat(),
                Malformed::Env,
            ),
            ([MAGIC, b"a__shim\0e=v\0d/d\0"].concat(), Malformed::Env),
            ([MAGIC, b"a__shim\0"].concat(), Malformed::Dir),
            ([MAGIC, b"a__shim\0d\0"].concat(), Malformed::Dir),
            ([MAGIC, b"a__shim\0d/a\0d/b\0"].concat(), Malformed::Dir),
            ([MAGIC, b"d/d\0"].concat(), Malformed::Args),
            ([MAGIC, b"ash\0d/d\0"].concat(), Malformed::Args),
        ];
        for (bytes, want) in cases {
            assert!(
                !well_formed(&bytes),
                "{:?}",
                String::from_utf8_lossy(&bytes)
            );
            assert_eq!(
                decode(&bytes),
                Err(want),
                "{:?}",
                String::from_utf8_lossy(&bytes)
            );
        }
        // Not text is carried as bytes (the supervisor refuses it itself).
        let raw = [MAGIC, b"a__shim\0a\xff\xfe\0e\xffK=\x80\0d/\xc3\0"].concat();
        let req = decode(&raw).unwrap();
        assert_eq!(req.args[1].as_bytes(), b"\xff\xfe");
        // Every prefix of a good request, and every single byte flipped: an answer, no panic,
        // and the fork server's own check (no allocation) agrees with it.
        for n in 0..good.len() {
            assert_eq!(well_formed(&good[..n]), decode(&good[..n]).is_ok());
            let mut flipped = good.clone();
            flipped[n] ^= 0xff;
            assert_eq!(well_formed(&flipped), decode(&flipped).is_ok(), "{n}");
        }
        assert!(well_formed(&good));
        assert!(well_formed(&raw));
    }

    #[test]
    fn a_reply_reads_back_and_nothing_else_does() {
        for r in [
            Reply::Ready,
            Reply::Started(1),
            Reply::Started(i32::MAX),
            Reply::Failed(libc::EAGAIN),
        ] {
            assert_eq!(Reply::from_bytes(&r.to_bytes()), Some(r));
        }
        for bad in [
            &b""[..],
            b"p",
            b"p\0\0\0",
            b"p\0\0\0\0\0",
            b"p\0\0\0\0",
            b"p\xff\xff\xff\xff",
            b"r\x01\0\0\0",
            b"z\0\0\0\0",
        ] {
            assert_eq!(Reply::from_bytes(bad), None, "{bad:?}");
        }
    }

    /// A host with a small socket send buffer (`net.core.wmem_*` set low): a request over it
    /// goes the exec way for that start alone; the fork server stays and takes the next one.
    #[test]
    fn a_request_over_the_socket_buffer_goes_the_exec_way_and_keeps_the_fork_server() {
        let (ours, theirs) = seqpacket_pair().unwrap();
        let small: libc::c_int = 4096;
        // SAFETY: setsockopt with an int we own and its exact size.
        let rc = unsafe {
            libc::setsockopt(
                ours.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                std::ptr::from_ref(&small).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0);
        let server = ForkServer {
            sock: ours,
            pid: 0,
            ticks: 0,
            pending: std::cell::Cell::new(false),
        };
        let (_r, w) = vspawn::pipe().unwrap();
        let big = "x".repeat(64 * 1024);
        let r = server.spawn(
            &shim_args(&[&big]),
            &env(&[]),
            Path::new("/d"),
            [&w, &w, &w],
        );
        assert!(matches!(r, Err(Error::Unsendable)), "{r:?}");
        // Stands in for the fork server: reads the next request and answers it.
        let peer = std::thread::spawn(move || {
            let mut buf = vec![0u8; MAX_REQUEST + 1];
            let got = recv_with_fds(theirs.as_raw_fd(), &mut buf, 3).unwrap();
            assert_eq!(got.fds.len(), 3);
            assert!(decode(&buf[..got.len]).is_ok());
            send_reply(theirs.as_raw_fd(), Reply::Started(4242)).unwrap();
        });
        let r = server.spawn(&shim_args(&["x"]), &env(&[]), Path::new("/d"), [&w, &w, &w]);
        assert_eq!(r.ok(), Some(4242));
        peer.join().unwrap();
    }

    #[test]
    fn a_request_whose_answer_was_never_read_refuses_the_next_one() {
        let (peer, server) = ForkServer::for_tests();
        let (_r, w) = vspawn::pipe().unwrap();
        let ask = || server.request(&shim_args(&["x"]), &env(&[]), Path::new("/d"), [&w, &w, &w]);
        assert!(ask().is_ok());
        // Its caller went (a panic) before it read the answer: the next answer is not the
        // next request's.
        assert!(matches!(ask(), Err(Error::Broken(_))), "refused");
        let mut buf = vec![0u8; MAX_REQUEST + 1];
        let got = recv_with_fds(peer.as_raw_fd(), &mut buf, 3).unwrap();
        assert!(decode(&buf[..got.len]).is_ok());
        send_reply(peer.as_raw_fd(), Reply::Started(7)).unwrap();
        assert_eq!(server.started().ok(), Some(7));
        // Answered in turn: the next one goes.
        assert!(ask().is_ok());
    }

    #[test]
    fn descriptors_cross_the_socket_with_the_message() {
        let (a, b) = seqpacket_pair().unwrap();
        let (r, w) = vspawn::pipe().unwrap();
        send_with_fds(&a, b"hello", &[w.as_raw_fd()]).unwrap();
        drop(w);
        let mut buf = [0u8; 16];
        let got = recv_with_fds(b.as_raw_fd(), &mut buf, 2).unwrap();
        assert_eq!(&buf[..got.len], b"hello");
        assert!(!got.truncated);
        assert_eq!(got.fds.len(), 1);
        // The received write end is the pipe's: what is written there comes out of `r`.
        let mut f = std::fs::File::from(got.fds.into_iter().next().unwrap());
        f.write_all(b"x").unwrap();
        drop(f);
        let mut out = String::new();
        std::io::Read::read_to_string(&mut std::fs::File::from(r), &mut out).unwrap();
        assert_eq!(out, "x");
        // A message bigger than the buffer is marked truncated.
        send_with_fds(&a, &[7u8; 64], &[]).unwrap();
        let got = recv_with_fds(b.as_raw_fd(), &mut buf, 2).unwrap();
        assert!(got.truncated);
        // The peer gone: end of file.
        drop(a);
        let got = recv_with_fds(b.as_raw_fd(), &mut buf, 2).unwrap();
        assert_eq!((got.len, got.fds.len()), (0, 0));
    }
}
