//! The file tailer thread: every file operation of log streaming, kept off the event loop. It
//! reads a bounded slice of a workload's log file at an offset, cuts a file down to its newest
//! part (`max_log_bytes`), writes a stream cursor (temp file, rename), and watches files:
//! asked to watch a file that is `len` bytes long, it says once when the file changed.
//! The loop owns every cursor and decides what to do; this thread only does the I/O.
//!
//! **How the node learns that a log grew** (issue 15, live logs): with inotify. A watch is a
//! one-shot `IN_MODIFY` watch armed only while the loop waits for new bytes of that stream (it
//! asks after a read found nothing more to send), so a workload writing a flood costs one event
//! per send, not one per `write()`, and an idle or finished workload costs nothing. The moment
//! the event arrives is the moment "the first unsent byte was seen" from which the 250 ms batching
//! window runs. Where inotify is unavailable (no instance left, the watch limit reached), the
//! thread falls back to looking at the file's size every [`POLL`], and only for files it was
//! asked to watch (a running workload's); it sleeps without a timeout otherwise.

use std::collections::HashMap;
use std::ffi::CString;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{unbounded, Receiver, Sender, TryRecvError};

/// How often a watched file's size is looked at when inotify cannot watch it.
pub const POLL: Duration = Duration::from_millis(250);

/// Which stream of which workload.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub safe_id: String,
    /// 0 = stdout, 1 = stderr.
    pub stream: usize,
}

/// What the loop asks of the tailer.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// Read at most `max` bytes at `offset`.
    Read {
        key: Key,
        path: PathBuf,
        offset: u64,
        max: usize,
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

#[derive(Debug)]
pub struct Chunk {
    pub key: Key,
    pub offset: u64,
    pub data: Vec<u8>,
    /// The file's length when it was read.
    pub file_len: u64,
}

/// What the tailer tells the loop.
#[derive(Debug)]
pub enum Event {
    Chunk(Chunk),
    /// A cut: the bytes cut from the front of the file (`Err`: why it failed).
    Cut {
        key: Key,
        result: Result<u64, String>,
    },
    /// A watched file changed.
    Grew(Key),
    /// A cursor was written (`Err`: why not).
    Persisted {
        key: Key,
        path: PathBuf,
        result: Result<(), String>,
    },
}

/// Keeps the newest `keep` bytes of a log file in place (the writer appends with O_APPEND, so
/// it carries on at the new end); returns how many bytes were cut.
pub fn cut_front(path: &std::path::Path, keep: u64) -> std::io::Result<u64> {
    let mut f = open_log(path, true)?;
    let len = f.metadata()?.len();
    if len <= keep {
        return Ok(0);
    }
    let cut = len.saturating_sub(keep);
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    while done < keep {
        f.seek(SeekFrom::Start(cut.saturating_add(done)))?;
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        f.seek(SeekFrom::Start(done))?;
        std::io::Write::write_all(&mut f, buf.get(..n).unwrap_or_default())?;
        done = done.saturating_add(n as u64);
    }
    f.set_len(done)?;
    Ok(cut)
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
    polled: Vec<(Key, PathBuf, u64)>,
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
            } => Event::Chunk(read(key, &path, offset, max)),
            Request::Cut { key, path, keep } => Event::Cut {
                key,
                result: cut_front(&path, keep).map_err(|e| e.to_string()),
            },
            // Atomic (temp file, rename) but not fsynced: a cursor must survive the node's
            // crash, which the page cache does; after a host crash the log file it counts
            // bytes of was not synced either (the workload's writes never are), so a synced
            // cursor could only point past what survived. Two fsyncs per chunk were most of
            // this thread's CPU under a flood.
            Request::Persist { key, path, data } => Event::Persisted {
                result: crate::store::write_replace_unsynced(&path, &data, 0o600)
                    .map_err(|e| e.to_string()),
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
                    libc::IN_MODIFY | libc::IN_ONESHOT | libc::IN_DONT_FOLLOW,
                )
            };
            if wd >= 0 {
                self.watches.insert(wd, key.clone());
                armed = Some(wd);
            }
        }
        let now_len = std::fs::metadata(&path).map(|m| m.len()).ok();
        if now_len.is_some_and(|l| l != len) {
            if let (Some(wd), Some(fd)) = (armed, &self.inotify) {
                self.watches.remove(&wd);
                // SAFETY: removes a watch of a descriptor this worker owns; no memory involved.
                unsafe { libc::inotify_rm_watch(fd.as_raw_fd(), wd) };
            }
            return Some(Event::Grew(key));
        }
        if armed.is_none() {
            self.polled.retain(|(k, ..)| *k != key);
            self.polled.push((key, path, len));
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
                if mask & libc::IN_MODIFY != 0 {
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
        while let Some((_, path, len)) = self.polled.get(i) {
            let now_len = std::fs::metadata(path).map(|m| m.len()).ok();
            if now_len.is_some_and(|l| l != *len) {
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

fn read(key: Key, path: &std::path::Path, offset: u64, max: usize) -> Chunk {
    let mut data = Vec::new();
    let mut file_len = 0;
    if let Ok(mut f) = open_log(path, false) {
        file_len = f.metadata().map(|m| m.len()).unwrap_or(0);
        if file_len > offset && f.seek(SeekFrom::Start(offset)).is_ok() {
            let want = file_len.saturating_sub(offset).min(max as u64);
            data.reserve_exact(usize::try_from(want).unwrap_or(0));
            let _ = f.take(want).read_to_end(&mut data);
        }
    }
    Chunk {
        key,
        offset,
        data,
        file_len,
    }
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
                1024
            )
            .data,
            b"line\n"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cw-tail-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
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
    }
}
