//! The file tailer thread: every file operation of log streaming, kept off the event loop. It
//! reads a bounded slice of a workload's log file at an offset, cuts a file down to its newest
//! part (`max_log_bytes`), writes a stream cursor (temp file, rename), and watches files:
//! asked to watch a file that is `len` bytes long, it says once when the file changed.
//! The loop owns every cursor and decides what to do; this thread only does the I/O.
//!
//! **How the node learns that a log grew** (live logs): with inotify. A watch is a
//! one-shot `IN_MODIFY` watch armed only while the loop waits for new bytes of that stream (it
//! asks after a read found nothing more to send), so a workload writing a flood costs one event
//! per send, not one per `write()`, and an idle or finished workload costs nothing. The moment
//! the event arrives is the moment "the first unsent byte was seen" from which the 250 ms batching
//! window runs. Where inotify is unavailable (no instance left, the watch limit reached), the
//! thread falls back to looking at the file's size every [`POLL`], and only for files it was
//! asked to watch (a running workload's); it sleeps without a timeout otherwise.
//!
//! **A log the workload truncates, replaces or makes sparse** (D52). The workload writes its
//! logs itself (they are its stdout and stderr) and can do anything to them. A read is asked
//! for at an offset with [`Mark`]s: the last bytes the node read before some offsets. The file
//! was truncated (or replaced by a new file renamed over it: reads always open the path, so the
//! new file is followed) when it is now shorter than the offset, or when the bytes of the newest
//! mark before the offset are no longer there (it was truncated and grew again before the node
//! looked). Reading then resumes at the newest mark that is still intact (the truncation point
//! is at or after it), else at the start of the file: nothing written after a truncation is
//! missed; at worst a little of what the truncation kept is read again. A rewrite of exactly
//! the same bytes past the node's position cannot be told from no truncation at all.
//! Holes are not output: a read skips them with `SEEK_DATA`/`SEEK_HOLE` (never reading them;
//! a 3 GiB hole costs two `lseek`s) and skips runs of NUL bytes too (the zeros of a block a hole
//! starts or ends in, a filesystem without hole support: a run at the start of a read, one of
//! [`NUL_RUN`] bytes or more, or one up to a hole), and says how many bytes it skipped. A
//! shorter run inside text stays in the chunk (text with a NUL between every character is not
//! shipped a character per chunk); what is shipped and mirrored drops NUL bytes.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{unbounded, Receiver, Sender, TryRecvError};

/// How often a watched file's size is looked at when inotify cannot watch it.
pub const POLL: Duration = Duration::from_millis(250);

/// Which stream of which workload.
#[derive(Debug, Default, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub safe_id: String,
    /// 0 = stdout, 1 = stderr.
    pub stream: usize,
}

/// The last bytes the node read before file offset `end` (at most [`MARK_BYTES`]): if they are
/// no longer there, the file was truncated (or replaced) below `end`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    pub end: u64,
    pub tail: Vec<u8>,
}

/// How many bytes a [`Mark`] keeps.
pub const MARK_BYTES: usize = 32;

/// The most NUL bytes (not a hole: zeros written or a filesystem without holes) one read skips
/// by reading them; the next read goes on from there.
pub const NUL_SCAN: u64 = 64 << 20;

/// A run of NUL bytes this long inside data ends a chunk: it is a gap, not text.
pub const NUL_RUN: usize = 4096;

/// What the loop asks of the tailer.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// Read at most `max` bytes at `offset`, first checking `marks` (newest first) to find out
    /// whether the file was truncated below `offset`.
    Read {
        key: Key,
        path: PathBuf,
        offset: u64,
        max: usize,
        marks: Vec<Mark>,
    },
    /// Cut the file down to its newest `keep` bytes.
    Cut { key: Key, path: PathBuf, keep: u64 },
    /// Say once ([`Event::Grew`]) when the file is no longer `len` bytes long.
    Watch { key: Key, path: PathBuf, len: u64 },
    /// Drop the stream's watch, if one is armed (its workload ended).
    Unwatch(Key),
    /// Write `data` to `path` atomically (a stream cursor).
    Persist {
        key: Key,
        path: PathBuf,
        data: Vec<u8>,
    },
}

#[derive(Debug, Default)]
pub struct Chunk {
    pub key: Key,
    /// The offset the read was asked for.
    pub offset: u64,
    /// The file was truncated (or replaced) below `offset`: reading resumed at `resume`.
    pub truncated: bool,
    /// Where reading started: `offset`, or after a truncation the newest intact mark (or 0).
    pub resume: u64,
    /// Bytes of holes and NUL runs skipped from `resume`: `data` starts at `resume + skipped`.
    pub skipped: u64,
    /// Holds no NUL run of a gap (shorter runs inside text may be there).
    pub data: Vec<u8>,
    /// `data` stops where a hole or a NUL run starts (not at the end of the file or of `max`).
    pub gap_follows: bool,
    /// The file's length when it was read.
    pub file_len: u64,
    /// What it takes on disk (its holes take nothing).
    pub disk_len: u64,
}

impl Chunk {
    /// The file offset `data` starts at.
    pub fn at(&self) -> u64 {
        self.resume.saturating_add(self.skipped)
    }
}

/// What the tailer tells the loop.
#[derive(Debug)]
pub enum Event {
    Chunk(Chunk),
    /// A cut: the bytes cut from the front of the file (`Err`: why it failed).
    Cut {
        key: Key,
        result: std::io::Result<u64>,
    },
    /// A watched file changed.
    Grew(Key),
    /// A cursor was written (`Err`: why not).
    Persisted {
        key: Key,
        path: PathBuf,
        result: std::io::Result<()>,
    },
}

/// Keeps the newest `keep` bytes of a log file in place (the writer appends with O_APPEND, so
/// it carries on at the new end); returns how many bytes were cut. A hole stays a hole: it is
/// punched into the kept part, never read or written as zeros (a sparse 3 GiB log is cut without
/// writing a gigabyte of NUL bytes to disk).
pub fn cut_front(path: &std::path::Path, keep: u64) -> std::io::Result<u64> {
    let f = open_log(path, true)?;
    let len = f.metadata()?.len();
    if len <= keep {
        return Ok(0);
    }
    let cut = len.saturating_sub(keep);
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    while done < keep {
        let src = cut.saturating_add(done);
        let (data, data_end) = extent(&f, src, len);
        let left = keep.saturating_sub(done);
        if data > src {
            // A hole: the kept part gets one where it was.
            let n = data.saturating_sub(src).min(left);
            punch(&f, done, n, &mut buf)?;
            done = done.saturating_add(n);
            continue;
        }
        let want = data_end.saturating_sub(src).min(left).min(buf.len() as u64);
        let piece = buf
            .get_mut(..usize::try_from(want).unwrap_or(0))
            .unwrap_or_default();
        let n = f.read_at(piece, src)?;
        if n == 0 {
            break;
        }
        f.write_all_at(piece.get(..n).unwrap_or_default(), done)?;
        done = done.saturating_add(n as u64);
    }
    f.set_len(done)?;
    Ok(cut)
}

/// Makes `[at, at + n)` of the file read as zeros without writing them where the filesystem can
/// punch holes (zeros are written where it cannot).
fn punch(f: &std::fs::File, at: u64, n: u64, buf: &mut [u8]) -> std::io::Result<()> {
    if let (Ok(off), Ok(len)) = (libc::off_t::try_from(at), libc::off_t::try_from(n)) {
        // SAFETY: fallocate on a descriptor this function borrows; no memory is involved.
        let r = unsafe {
            libc::fallocate(
                f.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                len,
            )
        };
        if r == 0 {
            return Ok(());
        }
    }
    buf.fill(0);
    let mut done = 0u64;
    while done < n {
        let piece = n.saturating_sub(done).min(buf.len() as u64);
        let zeros = buf
            .get(..usize::try_from(piece).unwrap_or(0))
            .unwrap_or_default();
        f.write_all_at(zeros, at.saturating_add(done))?;
        done = done.saturating_add(piece);
    }
    Ok(())
}

/// The data extent at or after `pos`: (where it starts, where the hole after it starts), both
/// at most `len`; `(len, len)` when only a hole is left. A filesystem that cannot say is taken
/// to hold data everywhere (NUL runs are then skipped by reading them).
fn extent(f: &std::fs::File, pos: u64, len: u64) -> (u64, u64) {
    if pos >= len {
        return (len, len);
    }
    let Ok(at) = libc::off_t::try_from(pos) else {
        return (pos, len);
    };
    // SAFETY: lseek on a descriptor this function borrows; no memory is involved. Reads use
    // positioned I/O, so the descriptor's offset that lseek moves is never relied on.
    let d = unsafe { libc::lseek(f.as_raw_fd(), at, libc::SEEK_DATA) };
    if d < 0 {
        return if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
            (len, len)
        } else {
            (pos, len)
        };
    }
    // SAFETY: as above.
    let h = unsafe { libc::lseek(f.as_raw_fd(), d, libc::SEEK_HOLE) };
    let d = u64::try_from(d).unwrap_or(pos).clamp(pos, len);
    let h = u64::try_from(h).map_or(len, |h| h.clamp(d, len));
    (d, h)
}

/// Whether the file still holds the mark's bytes before its end.
fn intact(f: &std::fs::File, m: &Mark, len: u64) -> bool {
    let n = m.tail.len() as u64;
    if m.tail.is_empty() || m.end > len || m.end < n {
        return false;
    }
    let mut buf = vec![0u8; m.tail.len()];
    f.read_exact_at(&mut buf, m.end.saturating_sub(n)).is_ok() && buf == m.tail
}

pub struct Tailer {
    tx: Sender<Request>,
    /// An eventfd that wakes the thread from `poll` when a request is queued.
    bell: Arc<OwnedFd>,
}

impl Tailer {
    pub fn start(out: Sender<Event>) -> std::io::Result<Tailer> {
        let (tx, rx): (Sender<Request>, Receiver<Request>) = unbounded();
        // SAFETY: eventfd has no memory-safety preconditions; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let bell = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let thread_bell = bell.clone();
        std::thread::Builder::new()
            .name("tailer".into())
            .spawn(move || Worker::new(out).run(&rx, &thread_bell))?;
        Ok(Tailer { tx, bell })
    }

    pub fn request(&self, req: Request) {
        if self.tx.send(req).is_ok() {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to a descriptor this struct keeps open.
            let _ = unsafe {
                libc::write(
                    self.bell.as_raw_fd(),
                    (&one as *const u64).cast::<libc::c_void>(),
                    8,
                )
            };
        }
    }
}

struct Worker {
    out: Sender<Event>,
    /// The inotify instance, when the kernel gave one.
    inotify: Option<OwnedFd>,
    /// Armed one-shot watches: watch descriptor → stream.
    watches: HashMap<i32, Key>,
    /// Files watched by looking at their size (inotify could not watch them).
    /// (stream, path, length, inode: a file renamed over the log is a change too).
    polled: Vec<(Key, PathBuf, u64, u64)>,
}

impl Worker {
    fn new(out: Sender<Event>) -> Worker {
        // SAFETY: inotify_init1 has no memory-safety preconditions; the result is checked.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        let inotify = if fd >= 0 {
            // SAFETY: `fd` is a new descriptor that nothing else owns.
            Some(unsafe { OwnedFd::from_raw_fd(fd) })
        } else {
            log::debug!(
                "inotify is unavailable ({}); watching log files by polling",
                std::io::Error::last_os_error()
            );
            None
        };
        Worker {
            out,
            inotify,
            watches: HashMap::new(),
            polled: Vec::new(),
        }
    }

    fn run(mut self, rx: &Receiver<Request>, bell: &OwnedFd) {
        loop {
            let mut fds = [
                libc::pollfd {
                    fd: bell.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.inotify.as_ref().map_or(-1, |f| f.as_raw_fd()),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            let timeout = if self.polled.is_empty() {
                -1
            } else {
                i32::try_from(POLL.as_millis()).unwrap_or(250)
            };
            // SAFETY: `fds` is a live array of two pollfd structs; a negative fd is ignored.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
            if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                std::thread::sleep(POLL); // never spin on a broken poll
            }
            let mut counter = [0u8; 8];
            // SAFETY: reads at most 8 bytes into a live 8-byte buffer (non-blocking eventfd).
            let _ = unsafe {
                libc::read(
                    bell.as_raw_fd(),
                    counter.as_mut_ptr().cast::<libc::c_void>(),
                    8,
                )
            };
            loop {
                match rx.try_recv() {
                    Ok(req) => {
                        if !self.handle(req) {
                            return;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            if !self.read_inotify() || !self.poll_sizes() {
                return;
            }
        }
    }

    /// False once the loop is gone.
    fn handle(&mut self, req: Request) -> bool {
        let ev = match req {
            Request::Read {
                key,
                path,
                offset,
                max,
                marks,
            } => Event::Chunk(read(key, &path, offset, max, &marks)),
            Request::Cut { key, path, keep } => Event::Cut {
                key,
                result: cut_front(&path, keep),
            },
            // Atomic (temp file, rename) but not fsynced: a cursor must survive the node's
            // crash, which the page cache does; after a host crash the log file it counts
            // bytes of was not synced either (the workload's writes never are), so a synced
            // cursor could only point past what survived. Two fsyncs per chunk were most of
            // this thread's CPU under a flood.
            Request::Persist { key, path, data } => Event::Persisted {
                result: crate::store::write_replace_unsynced(&path, &data, 0o600),
                key,
                path,
            },
            Request::Watch { key, path, len } => match self.watch(key, path, len) {
                Some(ev) => ev,
                None => return true,
            },
            Request::Unwatch(key) => {
                self.unwatch(&key);
                return true;
            }
        };
        self.out.send(ev).is_ok()
    }

    /// Arms a one-shot watch on the file, then looks at its size: a change that came before
    /// the watch was armed is reported at once (no write can fall between the two).
    fn watch(&mut self, key: Key, path: PathBuf, len: u64) -> Option<Event> {
        let mut armed = None;
        if let (Some(fd), Ok(c)) = (
            &self.inotify,
            CString::new(path.as_os_str().as_bytes().to_vec()),
        ) {
            // SAFETY: `c` is a NUL-terminated path that outlives the call.
            let wd = unsafe {
                libc::inotify_add_watch(
                    fd.as_raw_fd(),
                    c.as_ptr(),
                    // IN_ATTRIB: the file was renamed over (its link count fell) and the
                    // workload may write to the new one.
                    libc::IN_MODIFY | libc::IN_ATTRIB | libc::IN_ONESHOT | libc::IN_DONT_FOLLOW,
                )
            };
            if wd >= 0 {
                self.watches.insert(wd, key.clone());
                armed = Some(wd);
            }
        }
        let now = std::fs::metadata(&path).ok();
        if now.as_ref().is_some_and(|m| m.len() != len) {
            if let (Some(wd), Some(fd)) = (armed, &self.inotify) {
                self.watches.remove(&wd);
                // SAFETY: removes a watch of a descriptor this worker owns; no memory involved.
                unsafe { libc::inotify_rm_watch(fd.as_raw_fd(), wd) };
            }
            return Some(Event::Grew(key));
        }
        if armed.is_none() {
            self.polled.retain(|(k, ..)| *k != key);
            let ino = now.map_or(0, |m| std::os::unix::fs::MetadataExt::ino(&m));
            self.polled.push((key, path, len, ino));
        }
        None
    }

    fn unwatch(&mut self, key: &Key) {
        self.polled.retain(|(k, ..)| k != key);
        let wds: Vec<i32> = self
            .watches
            .iter()
            .filter(|(_, k)| *k == key)
            .map(|(wd, _)| *wd)
            .collect();
        for wd in wds {
            self.watches.remove(&wd);
            if let Some(fd) = &self.inotify {
                // SAFETY: removes a watch of a descriptor this worker owns; no memory involved.
                unsafe { libc::inotify_rm_watch(fd.as_raw_fd(), wd) };
            }
        }
    }

    /// Forwards the events of armed watches; false once the loop is gone.
    fn read_inotify(&mut self) -> bool {
        let Some(fd) = &self.inotify else {
            return true;
        };
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: reads into a live buffer of the given length (non-blocking descriptor).
            let n = unsafe {
                libc::read(
                    fd.as_raw_fd(),
                    buf.as_mut_ptr().cast::<libc::c_void>(),
                    buf.len(),
                )
            };
            let Ok(n) = usize::try_from(n) else {
                return true; // EAGAIN: nothing more
            };
            if n == 0 {
                return true;
            }
            let mut at = 0usize;
            let head = std::mem::size_of::<libc::inotify_event>();
            while let Some(ev) = buf.get(at..at.saturating_add(head)) {
                // struct inotify_event { int wd; uint32_t mask, cookie, len; char name[]; }
                let word = |i: usize| {
                    let b = ev.get(i..i.saturating_add(4)).unwrap_or(&[0, 0, 0, 0]);
                    [
                        b.first().copied().unwrap_or(0),
                        b.get(1).copied().unwrap_or(0),
                        b.get(2).copied().unwrap_or(0),
                        b.get(3).copied().unwrap_or(0),
                    ]
                };
                let wd = i32::from_ne_bytes(word(0));
                let mask = u32::from_ne_bytes(word(4));
                let name_len = u32::from_ne_bytes(word(12)) as usize;
                at = at.saturating_add(head).saturating_add(name_len);
                if mask & (libc::IN_MODIFY | libc::IN_ATTRIB) != 0 {
                    if let Some(key) = self.watches.remove(&wd) {
                        if self.out.send(Event::Grew(key)).is_err() {
                            return false;
                        }
                    }
                } else if mask & libc::IN_IGNORED != 0 {
                    self.watches.remove(&wd);
                }
            }
        }
    }

    /// The polling fallback: reports files whose size changed; false once the loop is gone.
    fn poll_sizes(&mut self) -> bool {
        let mut i = 0;
        while let Some((_, path, len, ino)) = self.polled.get(i) {
            let now = std::fs::metadata(path).ok();
            let changed = now.is_some_and(|m| {
                m.len() != *len || std::os::unix::fs::MetadataExt::ino(&m) != *ino
            });
            if changed {
                let (key, ..) = self.polled.swap_remove(i);
                if self.out.send(Event::Grew(key)).is_err() {
                    return false;
                }
            } else {
                i = i.saturating_add(1);
            }
        }
        true
    }
}

/// Opens a workload's log file, which the workload (running as the node's user) could have
/// replaced: a symlink is not followed (the node would ship, or cut, a file the link names), a
/// FIFO or device is refused without blocking, and a file with a second hard link is refused
/// (a link to the node's credentials is still a regular file). What is refused is not read.
pub fn open_log(path: &std::path::Path, write: bool) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let m = f.metadata()?;
    if !m.is_file() || m.nlink() > 1 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a log file of the node's own (a link, or not a regular file)",
        ));
    }
    Ok(f)
}

/// Reads at most `max` bytes at `offset` (see the module's notes on truncation and holes).
pub fn read(key: Key, path: &std::path::Path, offset: u64, max: usize, marks: &[Mark]) -> Chunk {
    let mut c = Chunk {
        key,
        offset,
        resume: offset,
        ..Chunk::default()
    };
    let Ok(f) = open_log(path, false) else {
        return c;
    };
    let (len, disk) = f.metadata().map_or((0, 0), |m| {
        use std::os::unix::fs::MetadataExt;
        (m.len(), m.blocks().saturating_mul(512))
    });
    c.file_len = len;
    c.disk_len = disk;
    let check = marks.iter().find(|m| m.end <= offset);
    c.truncated = len < offset || check.is_some_and(|m| !intact(&f, m, len));
    if c.truncated {
        c.resume = marks
            .iter()
            .filter(|m| m.end <= offset.min(len))
            .find(|m| intact(&f, m, len))
            .map_or(0, |m| m.end);
    }
    let max = (max as u64).max(1);
    let mut pos = c.resume;
    let mut scanned = 0u64;
    while pos < len {
        let (data, hole) = extent(&f, pos, len);
        pos = data;
        if data >= len {
            break;
        }
        let want = hole.saturating_sub(data).min(max);
        let mut buf = vec![0u8; usize::try_from(want).unwrap_or(0)];
        let n = read_full(&f, &mut buf, data);
        buf.truncate(n);
        if buf.is_empty() {
            break;
        }
        let zeros = buf.iter().take_while(|b| **b == 0).count();
        pos = pos.saturating_add(zeros as u64);
        if zeros == buf.len() {
            scanned = scanned.saturating_add(zeros as u64);
            if scanned >= NUL_SCAN {
                break; // the next read goes on from here
            }
            continue;
        }
        buf.drain(..zeros);
        let to_hole = data.saturating_add(n as u64) == hole && hole < len;
        if let Some(z) = gap_in(&buf, to_hole) {
            buf.truncate(z);
            c.gap_follows = true;
        } else if to_hole {
            c.gap_follows = true;
        }
        c.data = buf;
        break;
    }
    c.skipped = pos.saturating_sub(c.resume);
    c
}

/// Where the first NUL run of a gap starts in `buf`: one of [`NUL_RUN`] bytes or more, or one
/// that reaches its end when a hole follows.
fn gap_in(buf: &[u8], to_hole: bool) -> Option<usize> {
    let mut i = 0usize;
    while let Some(z) = memchr::memchr(0, buf.get(i..)?) {
        let start = i.saturating_add(z);
        let run = buf.get(start..)?.iter().take_while(|b| **b == 0).count();
        let end = start.saturating_add(run);
        if run >= NUL_RUN || (to_hole && end == buf.len()) {
            return Some(start);
        }
        i = end;
    }
    None
}

/// Reads into `buf` at `at` until it is full or the file ends; returns the bytes read.
fn read_full(f: &std::fs::File, buf: &mut [u8], at: u64) -> usize {
    let mut done = 0usize;
    while let Some(rest) = buf.get_mut(done..) {
        if rest.is_empty() {
            break;
        }
        match f.read_at(rest, at.saturating_add(done as u64)) {
            Ok(0) | Err(_) => break,
            Ok(n) => done = done.saturating_add(n),
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        Key {
            safe_id: "w".into(),
            stream: 0,
        }
    }

    /// A fresh folder of this test's own.
    #[test]
    fn a_log_file_the_workload_replaced_is_not_read_or_cut() {
        let d = scratch("replaced");
        let secret = d.join("secret");
        std::fs::write(&secret, "the node's token").unwrap();
        let log = d.join("w.stdout.log");
        // A symlink to another file.
        std::os::unix::fs::symlink(&secret, &log).unwrap();
        assert!(open_log(&log, false).is_err());
        let c = read(
            Key {
                safe_id: "w".into(),
                stream: 0,
            },
            &log,
            0,
            1024,
            &[],
        );
        assert!(c.data.is_empty(), "nothing read through a symlink");
        assert!(cut_front(&log, 1).is_err());
        assert_eq!(
            std::fs::read_to_string(&secret).unwrap(),
            "the node's token"
        );
        // A second hard link to another file of the node's.
        std::fs::remove_file(&log).unwrap();
        std::fs::hard_link(&secret, &log).unwrap();
        assert!(open_log(&log, false).is_err());
        assert!(cut_front(&log, 1).is_err());
        assert_eq!(
            std::fs::read_to_string(&secret).unwrap(),
            "the node's token"
        );
        // A FIFO: refused at once, not waited on for a writer.
        std::fs::remove_file(&log).unwrap();
        let c_path = std::ffi::CString::new(log.as_os_str().as_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        assert!(open_log(&log, false).is_err());
        // The node's own file is read.
        std::fs::remove_file(&log).unwrap();
        std::fs::write(&log, "line\n").unwrap();
        assert_eq!(
            read(
                Key {
                    safe_id: "w".into(),
                    stream: 0
                },
                &log,
                0,
                1024,
                &[]
            )
            .data,
            b"line\n"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    fn scratch(name: &str) -> crate::scratch::Scratch {
        crate::scratch::Scratch::new(&format!("tail-{name}"))
    }

    fn next(rx: &Receiver<Event>) -> Event {
        rx.recv_timeout(Duration::from_secs(10)).expect("an event")
    }

    #[test]
    fn reads_cuts_and_persists_off_the_loop() {
        let dir = scratch("reads");
        let path = dir.join("out.log");
        std::fs::write(&path, b"hello world\n").unwrap();
        let (tx, rx) = unbounded();
        let t = Tailer::start(tx).unwrap();
        t.request(Request::Read {
            key: key(),
            path: path.clone(),
            offset: 6,
            max: 3,
            marks: Vec::new(),
        });
        match next(&rx) {
            Event::Chunk(c) => {
                assert_eq!(
                    (c.offset, c.data.as_slice(), c.file_len),
                    (6, &b"wor"[..], 12)
                );
            }
            other => panic!("{other:?}"),
        }
        t.request(Request::Cut {
            key: key(),
            path: path.clone(),
            keep: 6,
        });
        assert!(matches!(next(&rx), Event::Cut { result: Ok(6), .. }));
        assert_eq!(std::fs::read(&path).unwrap(), b"world\n");
        let cursor = dir.join("cursor.json");
        t.request(Request::Persist {
            key: key(),
            path: cursor.clone(),
            data: b"{}".to_vec(),
        });
        assert!(matches!(next(&rx), Event::Persisted { result: Ok(()), .. }));
        assert_eq!(std::fs::read(&cursor).unwrap(), b"{}");
    }

    #[test]
    fn a_watch_fires_once_when_the_file_grows_and_at_once_when_it_already_did() {
        let dir = scratch("watch");
        let path = dir.join("out.log");
        std::fs::write(&path, b"ab").unwrap();
        let (tx, rx) = unbounded();
        let t = Tailer::start(tx).unwrap();
        // Already longer than the loop knows: reported at once.
        t.request(Request::Watch {
            key: key(),
            path: path.clone(),
            len: 1,
        });
        assert!(matches!(next(&rx), Event::Grew(k) if k == key()));
        // Unchanged: nothing until a write, then exactly one event for many writes.
        t.request(Request::Watch {
            key: key(),
            path: path.clone(),
            len: 2,
        });
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        for _ in 0..100 {
            std::io::Write::write_all(&mut f, b"more\n").unwrap();
        }
        assert!(matches!(next(&rx), Event::Grew(k) if k == key()));
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "one event per watch, not one per write"
        );
        // A dropped watch says nothing.
        t.request(Request::Watch {
            key: key(),
            path: path.clone(),
            len: 502,
        });
        t.request(Request::Unwatch(key()));
        // Requests are handled in order: once this read is answered, both were.
        t.request(Request::Read {
            key: key(),
            path: path.clone(),
            offset: 0,
            max: 1,
            marks: Vec::new(),
        });
        assert!(matches!(next(&rx), Event::Chunk(_)));
        std::io::Write::write_all(&mut f, b"more\n").unwrap();
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
    }

    #[test]
    fn without_inotify_a_watched_file_is_polled() {
        let dir = scratch("poll");
        let path = dir.join("out.log");
        std::fs::write(&path, b"ab").unwrap();
        let (tx, rx) = unbounded();
        let mut w = Worker::new(tx);
        w.inotify = None;
        assert!(w.watch(key(), path.clone(), 2).is_none());
        assert!(w.poll_sizes());
        assert!(rx.try_recv().is_err(), "unchanged: nothing");
        std::fs::write(&path, b"abc").unwrap();
        assert!(w.poll_sizes());
        assert!(matches!(rx.try_recv(), Ok(Event::Grew(_))));
        assert!(w.polled.is_empty(), "once");
        // A file of the same length renamed over it.
        assert!(w.watch(key(), path.clone(), 3).is_none());
        let new = dir.join("new");
        std::fs::write(&new, b"xyz").unwrap();
        std::fs::rename(&new, &path).unwrap();
        assert!(w.poll_sizes());
        assert!(matches!(rx.try_recv(), Ok(Event::Grew(_))));
    }

    fn append(path: &std::path::Path, bytes: &[u8]) {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        std::io::Write::write_all(&mut f, bytes).unwrap();
    }

    fn set_len(path: &std::path::Path, len: u64) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .unwrap()
            .set_len(len)
            .unwrap();
    }

    /// A mark of what the node read: the bytes of `file` before `end`.
    fn mark_at(file: &[u8], end: usize) -> Mark {
        Mark {
            end: end as u64,
            tail: file[end.saturating_sub(MARK_BYTES)..end].to_vec(),
        }
    }

    #[test]
    fn a_log_truncated_to_zero_is_read_from_its_start_whether_or_not_it_grew_back() {
        let d = scratch("trunc0");
        let log = d.join("w.stdout.log");
        append(&log, b"old 1\nold 2\n");
        let marks = [mark_at(b"old 1\nold 2\n", 12)];
        // Untouched: no truncation.
        let c = read(key(), &log, 12, 1024, &marks);
        assert!(!c.truncated && c.data.is_empty() && c.at() == 12);
        // Shorter than what was read.
        set_len(&log, 0);
        append(&log, b"new\n");
        let c = read(key(), &log, 12, 1024, &marks);
        assert!(c.truncated);
        assert_eq!(
            (c.resume, c.skipped, c.data.as_slice()),
            (0, 0, &b"new\n"[..])
        );
        // Truncated and longer again before the node looked: the mark tells.
        set_len(&log, 0);
        append(&log, b"a new line, longer than the old\n");
        let c = read(key(), &log, 12, 1024, &marks);
        assert!(c.truncated);
        assert_eq!(c.resume, 0);
        assert_eq!(c.data, b"a new line, longer than the old\n");
    }

    #[test]
    fn a_log_truncated_to_a_middle_offset_resumes_at_the_newest_intact_mark() {
        let d = scratch("truncmid");
        let log = d.join("w.stdout.log");
        let old = b"a1\na2\na3\na4\n";
        append(&log, old);
        let marks: Vec<Mark> = [12, 9, 6, 3].iter().map(|e| mark_at(old, *e)).collect();
        set_len(&log, 6);
        append(&log, b"b1\nb2\nb3\n");
        let c = read(key(), &log, 12, 1024, &marks);
        assert!(c.truncated);
        assert_eq!(c.resume, 6, "a1 and a2 are intact");
        assert_eq!(c.data, b"b1\nb2\nb3\n");
        // Cut below every mark: from the start.
        set_len(&log, 1);
        let c = read(key(), &log, 12, 1024, &marks);
        assert!(c.truncated);
        assert_eq!((c.resume, c.data.as_slice()), (0, &b"a"[..]));
    }

    #[test]
    fn a_log_replaced_by_a_new_file_is_followed() {
        let d = scratch("renamed");
        let log = d.join("w.stdout.log");
        let old = b"the first file, long enough\n";
        append(&log, old);
        let marks = [mark_at(old, old.len())];
        let new = d.join("new");
        append(&new, b"second file, as long as the first\n");
        std::fs::rename(&new, &log).unwrap();
        let c = read(key(), &log, old.len() as u64, 1024, &marks);
        assert!(c.truncated);
        assert_eq!(c.resume, 0);
        assert_eq!(c.data, b"second file, as long as the first\n");
    }

    #[test]
    fn a_hole_in_the_middle_is_skipped_not_read_and_no_nul_is_returned() {
        let d = scratch("hole");
        let log = d.join("w.stdout.log");
        append(&log, b"before\n");
        set_len(&log, 8 << 20);
        append(&log, b"after\n");
        let c = read(key(), &log, 0, 1 << 20, &[]);
        assert_eq!(c.data, b"before\n");
        assert!(c.gap_follows, "the zeros after it are not text");
        let c = read(key(), &log, 7, 1 << 20, &[mark_at(b"before\n", 7)]);
        assert!(!c.truncated);
        assert_eq!((c.at(), c.skipped), (8 << 20, (8 << 20) - 7));
        assert_eq!(c.data, b"after\n");
        // NUL bytes written as data (no hole) are skipped the same way when they are many;
        // a few inside text stay (dropped from what is shown, not a chunk per character).
        let log2 = d.join("w.stderr.log");
        append(&log2, b"a\n");
        append(&log2, &[0u8; NUL_RUN]);
        append(&log2, b"b\0c\n");
        let c = read(key(), &log2, 0, 1 << 20, &[]);
        assert_eq!((c.data.as_slice(), c.gap_follows), (&b"a\n"[..], true));
        let c = read(key(), &log2, 2, 1 << 20, &[]);
        assert_eq!(
            (c.skipped, c.data.as_slice()),
            (NUL_RUN as u64, &b"b\0c\n"[..])
        );
    }

    #[test]
    fn a_hole_at_the_end_is_skipped_to_the_end() {
        let d = scratch("holeend");
        let log = d.join("w.stdout.log");
        append(&log, b"line\n");
        set_len(&log, 1 << 20);
        let c = read(key(), &log, 5, 1 << 20, &[mark_at(b"line\n", 5)]);
        assert!(!c.truncated && c.data.is_empty());
        assert_eq!((c.at(), c.file_len), (1 << 20, 1 << 20));
    }

    #[test]
    fn a_huge_sparse_log_is_neither_read_nor_written_as_zeros() {
        use std::os::unix::fs::MetadataExt;
        let d = scratch("huge");
        let log = d.join("w.stdout.log");
        append(&log, b"x\n");
        set_len(&log, 3 << 30);
        append(&log, b"y\n");
        let t = std::time::Instant::now();
        let c = read(key(), &log, 2, 512 << 10, &[mark_at(b"x\n", 2)]);
        assert_eq!(c.data, b"y\n");
        assert_eq!(c.at(), 3 << 30);
        // The max_log_bytes cut keeps its hole a hole.
        assert_eq!(
            cut_front(&log, 512 << 20).unwrap(),
            (3 << 30) + 2 - (512 << 20)
        );
        let m = std::fs::metadata(&log).unwrap();
        assert_eq!(m.len(), 512 << 20);
        assert!(
            m.blocks() * 512 < 1 << 20,
            "{} bytes on disk",
            m.blocks() * 512
        );
        let c = read(key(), &log, 0, 512 << 10, &[]);
        assert_eq!((c.data.as_slice(), c.at()), (&b"y\n"[..], (512 << 20) - 2));
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_watch_fires_when_a_file_is_renamed_over_the_log() {
        let dir = scratch("watchrename");
        let path = dir.join("out.log");
        std::fs::write(&path, b"ab").unwrap();
        let (tx, rx) = unbounded();
        let t = Tailer::start(tx).unwrap();
        t.request(Request::Watch {
            key: key(),
            path: path.clone(),
            len: 2,
        });
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        // The workload keeps writing to the old file through its descriptor: the watch must
        // not wait for that file to change.
        let new = dir.join("new");
        std::fs::write(&new, b"cd").unwrap();
        std::fs::rename(&new, &path).unwrap();
        assert!(matches!(next(&rx), Event::Grew(k) if k == key()));
    }
}
