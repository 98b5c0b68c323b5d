//! The local control socket `<state dir>/control.sock` (0600): one JSON request line in, one JSON
//! reply line out. `emit` (from workloads), `status`, `drain` and `resume` use it. A thread
//! accepts connections and hands each request to the event loop with a reply channel.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

use crossbeam_channel::{bounded, Sender};
use serde_json::{json, Value};

/// Largest request line accepted.
pub const MAX_REQUEST: u64 = 1024 * 1024;

pub struct Request {
    pub body: Value,
    pub reply: Sender<Value>,
}

/// Binds the socket (replacing a stale one) and starts the accept thread.
pub fn serve(path: &Path, tx: Sender<Request>) -> std::io::Result<()> {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                let tx = tx.clone();
                // One short-lived thread per connection: a slow client never blocks the others.
                let _ = std::thread::Builder::new()
                    .name("control-conn".into())
                    .spawn(move || handle(stream, &tx));
            }
        })?;
    Ok(())
}

fn handle(stream: UnixStream, tx: &Sender<Request>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    let mut line = String::new();
    let reader = match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    };
    let read = BufReader::new(reader.take(MAX_REQUEST)).read_line(&mut line);
    let reply = match read.ok().and_then(|_| parse_request(line.as_bytes())) {
        None => {
            json!({"ok": false, "error": "the request must be one line of JSON (at most 1 MiB)"})
        }
        Some(body) => {
            let (rtx, rrx) = bounded(1);
            if tx.send(Request { body, reply: rtx }).is_err() {
                json!({"ok": false, "error": "the node is stopping"})
            } else {
                rrx.recv_timeout(Duration::from_secs(30))
                    .unwrap_or_else(|_| json!({"ok": false, "error": "the node did not answer"}))
            }
        }
    };
    let mut stream = stream;
    let _ = writeln!(stream, "{reply}");
}

/// One request line (with or without its newline) as JSON; `None` when it is not UTF-8 JSON.
/// Pure, so the fuzz target `control` can reach it.
pub fn parse_request(line: &[u8]) -> Option<Value> {
    serde_json::from_str(std::str::from_utf8(line).ok()?).ok()
}

/// Why a call did not get an answer.
#[derive(Debug)]
pub enum CallError {
    /// No node listens on that socket.
    NotRunning,
    Failed(String),
}

/// Sends one request and returns the node's reply.
pub fn call(path: &Path, body: &Value, timeout: Duration) -> Result<Value, CallError> {
    let mut stream = UnixStream::connect(path).map_err(|_| CallError::NotRunning)?;
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    writeln!(stream, "{body}").map_err(|e| CallError::Failed(e.to_string()))?;
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .map_err(|e| CallError::Failed(e.to_string()))?;
    serde_json::from_str(&line).map_err(|e| CallError::Failed(format!("unreadable answer: {e}")))
}
