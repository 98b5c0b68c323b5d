//! The local control socket `<state dir>/control.sock` (0600): one JSON request line in, one JSON
//! reply line out. `emit` (from workloads), `status`, `drain` and `resume` use it. A thread
//! accepts connections and hands each request to the event loop with a reply channel.
//!
//! Bounds (D32): at most [`MAX_CONNECTIONS`] connections are served at once, each by its own
//! short-lived thread; a request line must arrive whole within [`READ_TIMEOUT`] and be at most
//! [`MAX_REQUEST`] bytes. When every slot is taken, the connection that has waited longest for
//! its request line is dropped to make room (idle connections cannot lock out `status`); when
//! every slot is busy with a request the node is answering, the new connection gets a "busy"
//! reply and is closed at once, without a thread.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Sender};
use serde_json::{json, Value};

/// Largest request line accepted.
pub const MAX_REQUEST: u64 = 1024 * 1024;
/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a client may take to send its whole request line.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection waits for the event loop's answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

pub struct Request {
    pub body: Value,
    pub reply: Sender<Value>,
}

/// The bounds of one control socket (the defaults above, shorter in tests).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub read_timeout: Duration,
    pub max_request: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: MAX_CONNECTIONS,
            read_timeout: READ_TIMEOUT,
            max_request: MAX_REQUEST,
        }
    }
}

/// Binds the socket (replacing a stale one) and starts the accept thread.
pub fn serve(path: &Path, tx: Sender<Request>) -> std::io::Result<()> {
    serve_with(path, tx, Limits::default())
}

pub fn serve_with(path: &Path, tx: Sender<Request>, limits: Limits) -> std::io::Result<()> {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    let slots = Arc::new(Mutex::new(Slots::default()));
    let threads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || accept_loop(&listener, &tx, &slots, &threads, limits))?;
    Ok(())
}

/// D46.3: with a workload user, its group may connect (0660), for `emit` only (see [`handle`]).
pub fn share_for_emit(path: &Path, gid: u32) -> std::io::Result<()> {
    std::os::unix::fs::lchown(path, None, Some(gid))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
}

/// The uid of the process at the other end (`SO_PEERCRED`).
fn peer_uid(stream: &UnixStream) -> Option<u32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::ucred>()).ok()?;
    // SAFETY: getsockopt writes at most `len` bytes into the ucred we own.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::addr_of_mut!(cred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred.uid)
}

/// Whether a peer of uid `peer` may make this request: the node's own user and root anything;
/// anyone else (a workload under `workload_user`) only `emit`, which its event token proves.
fn allowed(peer: Option<u32>, body: &Value) -> bool {
    let me = crate::util::euid();
    match peer {
        Some(uid) if uid == me || uid == 0 => true,
        _ => body.get("op").and_then(Value::as_str) == Some("emit"),
    }
}

/// One connection being served: a handle on its socket (to drop it when room is needed) and
/// whether it is still waiting for its request line.
struct Slot {
    id: u64,
    stream: UnixStream,
    since: Instant,
    reading: bool,
}

#[derive(Default)]
struct Slots {
    next_id: u64,
    list: Vec<Slot>,
}

fn lock(slots: &Mutex<Slots>) -> MutexGuard<'_, Slots> {
    slots.lock().unwrap_or_else(|e| e.into_inner())
}

fn accept_loop(
    listener: &UnixListener,
    tx: &Sender<Request>,
    slots: &Arc<Mutex<Slots>>,
    threads: &Arc<std::sync::atomic::AtomicUsize>,
    limits: Limits,
) {
    use std::sync::atomic::Ordering;
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(s) => s,
            Err(_) => {
                // Out of file descriptors or similar: let the other connections finish.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let Some(id) = admit(slots, &stream, limits.max_connections) else {
            refuse(stream, limits.max_connections);
            continue;
        };
        // A connection dropped to make room ends its thread at once (its socket was shut
        // down); wait for that, so there are never more than `max_connections` threads.
        let until = Instant::now().checked_add(Duration::from_secs(2));
        while threads.load(Ordering::SeqCst) >= limits.max_connections
            && until.is_some_and(|u| Instant::now() < u)
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        let tx = tx.clone();
        let conn_slots = Arc::clone(slots);
        let live = Arc::clone(threads);
        live.fetch_add(1, Ordering::SeqCst);
        let spawned = std::thread::Builder::new()
            .name("control-conn".into())
            .spawn(move || {
                handle(stream, &tx, &conn_slots, id, limits);
                release(&conn_slots, id);
                live.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            threads.fetch_sub(1, Ordering::SeqCst);
            release(slots, id);
        }
    }
}

/// Takes a slot for a new connection: a free one, else the one that has waited longest for its
/// request line (that connection is shut down). `None` when every slot is busy with a request.
fn admit(slots: &Mutex<Slots>, stream: &UnixStream, max: usize) -> Option<u64> {
    let handle = stream.try_clone().ok()?;
    let mut s = lock(slots);
    let id = s.next_id;
    s.next_id = s.next_id.wrapping_add(1);
    let slot = Slot {
        id,
        stream: handle,
        since: Instant::now(),
        reading: true,
    };
    if s.list.len() < max {
        s.list.push(slot);
        return Some(id);
    }
    let oldest = s
        .list
        .iter_mut()
        .filter(|x| x.reading)
        .min_by_key(|x| x.since)?;
    let _ = oldest.stream.shutdown(Shutdown::Both);
    *oldest = slot;
    Some(id)
}

fn release(slots: &Mutex<Slots>, id: u64) {
    lock(slots).list.retain(|x| x.id != id);
}

/// Marks a connection as answered by the node (it can no longer be dropped to make room);
/// false if it was dropped meanwhile.
fn mark_read(slots: &Mutex<Slots>, id: u64) -> bool {
    match lock(slots).list.iter_mut().find(|x| x.id == id) {
        Some(x) => {
            x.reading = false;
            true
        }
        None => false,
    }
}

/// Answers "busy" without blocking and closes the connection.
fn refuse(mut stream: UnixStream, max: usize) {
    let _ = stream.set_nonblocking(true);
    let reply = json!({"ok": false, "busy": true, "error": format!("the node's control socket is busy ({max} requests in progress); try again")});
    let _ = writeln!(stream, "{reply}");
}

/// Why no request line was read.
#[derive(Debug, PartialEq, Eq)]
enum ReadError {
    /// The client went away (or the connection was dropped to make room) before a whole line.
    Closed,
    TimedOut,
    TooLarge,
}

/// Reads one request line (without its newline; end of file also ends it) within `timeout`
/// altogether, however slowly the bytes trickle in.
fn read_request(
    stream: &mut UnixStream,
    timeout: Duration,
    max: u64,
) -> Result<Vec<u8>, ReadError> {
    let deadline = Instant::now().checked_add(timeout);
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    let mut line = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let left = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()),
            None => timeout,
        };
        if left.is_zero() {
            return Err(ReadError::TimedOut);
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|_| ReadError::Closed)?;
        let n = match stream.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(ReadError::TimedOut)
            }
            Err(_) => return Err(ReadError::Closed),
        };
        let part = buf.get(..n).unwrap_or_default();
        if n == 0 {
            return if line.is_empty() {
                Err(ReadError::Closed)
            } else {
                Ok(line)
            };
        }
        let end = part.iter().position(|b| *b == b'\n');
        line.extend_from_slice(part.get(..end.unwrap_or(n)).unwrap_or_default());
        if line.len() > max {
            return Err(ReadError::TooLarge);
        }
        if end.is_some() {
            return Ok(line);
        }
    }
}

fn handle(
    mut stream: UnixStream,
    tx: &Sender<Request>,
    slots: &Mutex<Slots>,
    id: u64,
    limits: Limits,
) {
    let _ = stream.set_write_timeout(Some(limits.read_timeout));
    let line = read_request(&mut stream, limits.read_timeout, limits.max_request);
    if !mark_read(slots, id) {
        return; // dropped to make room for a newer connection
    }
    let reply = match line {
        Err(ReadError::Closed) => return,
        Err(ReadError::TimedOut) => json!({"ok": false, "error": format!(
            "no complete request line within {} s", limits.read_timeout.as_secs_f64()
        )}),
        Err(ReadError::TooLarge) => json!({"ok": false, "error": format!(
            "the request is too large (at most {} bytes)", limits.max_request
        )}),
        Ok(line) => match parse_request(&line) {
            None => json!({"ok": false, "error": "the request must be one line of JSON"}),
            Some(body) if !allowed(peer_uid(&stream), &body) => json!({"ok": false, "error":
                "only `emit` is open to workloads on this socket; other requests need the node's own user"}),
            Some(body) => {
                let (rtx, rrx) = bounded(1);
                if tx.send(Request { body, reply: rtx }).is_err() {
                    json!({"ok": false, "error": "the node is stopping"})
                } else {
                    rrx.recv_timeout(ANSWER_TIMEOUT).unwrap_or_else(
                        |_| json!({"ok": false, "error": "the node did not answer"}),
                    )
                }
            }
        },
    };
    // The slot is free before the client can see the answer: a client that connects again as soon
    // as it has read it must not find its own finished request still counted as busy.
    release(slots, id);
    // One write: a client reading once gets the whole line (Display writes JSON in pieces).
    let _ = stream.write_all(format!("{reply}\n").as_bytes());
}

/// One request line (with or without its newline) as JSON; `None` when it is not UTF-8 JSON.
/// Pure, so the fuzz target `control` can reach it.
pub fn parse_request(line: &[u8]) -> Option<Value> {
    serde_json::from_slice(line).ok()
}

/// Why a call did not get an answer.
#[derive(Debug)]
pub enum CallError {
    /// No node listens on that socket.
    NotRunning,
    Failed(String),
}

/// Sends one request and returns the node's reply; while the node answers "busy" (every
/// connection slot taken by a request in progress), asks again until `timeout` has passed.
pub fn call(path: &Path, body: &Value, timeout: Duration) -> Result<Value, CallError> {
    let deadline = Instant::now().checked_add(timeout);
    loop {
        let reply = call_once(path, body, timeout)?;
        let retry = reply.get("busy") == Some(&Value::Bool(true))
            && deadline.is_some_and(|d| {
                Instant::now()
                    .checked_add(BUSY_PAUSE)
                    .is_some_and(|t| t < d)
            });
        if !retry {
            return Ok(reply);
        }
        std::thread::sleep(BUSY_PAUSE);
    }
}

/// How long `call` waits before asking a busy node again.
const BUSY_PAUSE: Duration = Duration::from_millis(50);

fn call_once(path: &Path, body: &Value, timeout: Duration) -> Result<Value, CallError> {
    let mut stream = UnixStream::connect(path).map_err(|_| CallError::NotRunning)?;
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    // A node that turned the connection away ("busy") may have closed it before the request
    // was written: its answer is still there to read.
    let sent = writeln!(stream, "{body}").map_err(|e| CallError::Failed(e.to_string()));
    let mut line = String::new();
    let read = BufReader::new(stream)
        .read_line(&mut line)
        .map_err(|e| CallError::Failed(e.to_string()));
    match (sent, serde_json::from_str::<Value>(&line)) {
        (Ok(()), Ok(v)) => Ok(v),
        (Err(_), Ok(v)) if v.get("busy").is_some() => Ok(v),
        (Err(e), _) => Err(e),
        (Ok(()), Err(e)) => {
            read?;
            Err(CallError::Failed(format!("unreadable answer: {e}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crossbeam_channel::{unbounded, Receiver};

    /// Thread counts are per process: these tests run one at a time.
    static SERIAL: Mutex<()> = Mutex::new(());

    /// The socket's path in a scratch folder (removed with the returned guard).
    fn socket(tag: &str) -> (crate::scratch::Scratch, std::path::PathBuf) {
        let dir = crate::scratch::Scratch::new(&format!("control-{tag}"));
        let sock = dir.join("control.sock");
        (dir, sock)
    }

    /// A node that answers every request with `{"ok": true, "echo": <request>}`.
    fn answering(rx: Receiver<Request>) {
        std::thread::spawn(move || {
            for r in rx {
                let _ = r.reply.send(json!({"ok": true, "echo": r.body}));
            }
        });
    }

    fn conn_threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.trim_end() == "control-conn")
            })
            .count()
    }

    fn wait_until(mut f: impl FnMut() -> bool) -> bool {
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        f()
    }

    fn raw(path: &Path, bytes: &[u8]) -> String {
        let mut s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(bytes);
        let _ = s.shutdown(Shutdown::Write);
        let mut out = String::new();
        let _ = BufReader::new(s).read_line(&mut out);
        out
    }

    #[test]
    fn g13_other_users_may_only_emit() {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let other = me.wrapping_add(1).max(1);
        assert!(allowed(Some(me), &json!({"op": "drain"})));
        assert!(allowed(Some(0), &json!({"op": "status"})));
        assert!(allowed(Some(other), &json!({"op": "emit", "token": "t"})));
        for body in [
            json!({"op": "drain"}),
            json!({"op": "resume"}),
            json!({"op": "status"}),
            json!({}),
            json!({"op": 7}),
            json!([]),
        ] {
            assert!(!allowed(Some(other), &body), "{body}");
            assert!(!allowed(None, &body), "{body}");
        }
    }

    #[test]
    fn idle_connections_cannot_exhaust_threads_or_lock_out_a_request() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (_dir, path) = socket("idle");
        let (tx, rx) = unbounded();
        let limits = Limits {
            max_connections: 4,
            read_timeout: Duration::from_secs(60),
            max_request: MAX_REQUEST,
        };
        serve_with(&path, tx, limits).unwrap();
        answering(rx);
        let idle: Vec<UnixStream> = (0..50)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        let reply = call(&path, &json!({"op": "status"}), Duration::from_secs(10)).unwrap();
        assert_eq!(reply["echo"]["op"], "status", "{reply}");
        // Every connection was accepted by now (in order): at most 4 are served at once.
        assert!(
            wait_until(|| conn_threads() <= 4),
            "{} threads",
            conn_threads()
        );
        // The oldest idle connections were dropped to make room: they see the end of file.
        for mut s in idle.into_iter().take(40) {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut b = [0u8; 1];
            assert_eq!(s.read(&mut b).unwrap(), 0);
        }
    }

    #[test]
    fn when_every_slot_is_answering_a_new_connection_is_told_busy() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (_dir, path) = socket("busy");
        let (tx, rx) = unbounded();
        let limits = Limits {
            max_connections: 2,
            read_timeout: Duration::from_secs(60),
            max_request: MAX_REQUEST,
        };
        serve_with(&path, tx, limits).unwrap();
        let waiting: Vec<std::thread::JoinHandle<Value>> = (0..2)
            .map(|_| {
                let p = path.clone();
                std::thread::spawn(move || {
                    call(&p, &json!({"op": "slow"}), Duration::from_secs(20)).unwrap()
                })
            })
            .collect();
        // The node holds both requests unanswered.
        let held: Vec<Request> = (0..2)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        let busy = raw(&path, b"{\"op\":\"status\"}\n");
        assert!(busy.contains("busy"), "{busy}");
        // `call` asks again while the node is busy: it gets its answer once a slot frees.
        let p = path.clone();
        let patient = std::thread::spawn(move || {
            call(&p, &json!({"op": "patient"}), Duration::from_secs(20)).unwrap()
        });
        std::thread::sleep(Duration::from_millis(200));
        for r in held {
            r.reply.send(json!({"ok": true})).unwrap();
        }
        let r = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(r.body["op"], "patient");
        r.reply.send(json!({"ok": true, "patient": true})).unwrap();
        assert_eq!(patient.join().unwrap()["patient"], true);
        for w in waiting {
            assert_eq!(w.join().unwrap()["ok"], true);
        }
        answering(rx);
        let again = call(&path, &json!({"op": "status"}), Duration::from_secs(10)).unwrap();
        assert_eq!(again["ok"], true, "slots are freed after the answers");
    }

    #[test]
    fn a_trickling_client_gets_the_whole_read_timeout_not_more() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (_dir, path) = socket("slow");
        let (tx, rx) = unbounded();
        let limits = Limits {
            max_connections: 4,
            read_timeout: Duration::from_millis(300),
            max_request: MAX_REQUEST,
        };
        serve_with(&path, tx, limits).unwrap();
        answering(rx);
        let mut s = UnixStream::connect(&path).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut got = Vec::new();
        // One byte every 50 ms keeps every single read short; the line never ends.
        for _ in 0..400 {
            if s.write_all(b" ").is_err() {
                break;
            }
            let mut b = [0u8; 256];
            match s.read(&mut b) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&b[..n]),
                Err(_) => {}
            }
            if got.ends_with(b"\n") {
                break;
            }
        }
        let text = String::from_utf8_lossy(&got);
        assert!(text.contains("no complete request line"), "{text:?}");
    }

    #[test]
    fn oversized_garbage_and_odd_requests_get_a_clear_error() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (_dir, path) = socket("odd");
        let (tx, rx) = unbounded();
        let limits = Limits {
            max_connections: 4,
            read_timeout: Duration::from_secs(10),
            max_request: 1000,
        };
        serve_with(&path, tx, limits).unwrap();
        answering(rx);
        let big = vec![b'x'; 5000];
        assert!(raw(&path, &big).contains("too large"));
        let mut big_json = b"{\"op\":\"".to_vec();
        big_json.extend(std::iter::repeat_n(b'a', 1001));
        big_json.extend_from_slice(b"\"}\n");
        assert!(raw(&path, &big_json).contains("too large"));
        for bad in [
            &b"\xff\xfe\n"[..],
            b"\0\n",
            b"not json\n",
            b"\n",
            b"{\"op\":",
        ] {
            let r = raw(&path, bad);
            assert!(r.contains("one line of JSON"), "{bad:?}: {r}");
        }
        // Unicode and control characters inside JSON strings reach the node intact; bytes
        // after the newline are ignored.
        let r = raw(&path, "{\"op\":\"é\\u001b\\n✓\"}\ntrailing".as_bytes());
        let v: Value = serde_json::from_str(&r).unwrap();
        assert_eq!(v["echo"]["op"], "é\u{1b}\n✓");
        // End of file also ends the line.
        let r = raw(&path, b"{\"op\":\"eof\"}");
        assert!(r.contains("\"eof\""), "{r}");
    }
}
