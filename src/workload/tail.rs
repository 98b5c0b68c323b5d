//! The file tailer thread: reads a bounded slice of a workload's log file at an offset and
//! hands it to the event loop. The loop owns every cursor and decides what to read; this thread
//! only keeps file I/O off the loop.

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

use crossbeam_channel::{unbounded, Receiver, Sender};

/// Which stream of which workload.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub safe_id: String,
    /// 0 = stdout, 1 = stderr.
    pub stream: usize,
}

#[derive(Debug)]
pub struct ReadRequest {
    pub key: Key,
    pub path: PathBuf,
    pub offset: u64,
    pub max: usize,
    /// Instead of reading: cut the file down to its newest `keep` bytes.
    pub keep: Option<u64>,
}

#[derive(Debug)]
pub struct Chunk {
    pub key: Key,
    pub offset: u64,
    pub data: Vec<u8>,
    /// The file's length when it was read.
    pub file_len: u64,
    /// For a cap job: the bytes cut from the front of the file (`Err`: why it failed).
    pub cut: Option<Result<u64, String>>,
}

/// Keeps the newest `keep` bytes of a log file in place (the writer appends with O_APPEND, so
/// it carries on at the new end); returns how many bytes were cut.
pub fn cut_front(path: &std::path::Path, keep: u64) -> std::io::Result<u64> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
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
    tx: Sender<ReadRequest>,
}

impl Tailer {
    pub fn start(out: Sender<Chunk>) -> std::io::Result<Tailer> {
        let (tx, rx): (Sender<ReadRequest>, Receiver<ReadRequest>) = unbounded();
        std::thread::Builder::new()
            .name("tailer".into())
            .spawn(move || {
                for req in rx {
                    let chunk = read(req);
                    if out.send(chunk).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Tailer { tx })
    }

    pub fn read(&self, req: ReadRequest) {
        let _ = self.tx.send(req);
    }
}

fn read(req: ReadRequest) -> Chunk {
    if let Some(keep) = req.keep {
        return Chunk {
            cut: Some(cut_front(&req.path, keep).map_err(|e| e.to_string())),
            key: req.key,
            offset: req.offset,
            data: Vec::new(),
            file_len: 0,
        };
    }
    let mut data = Vec::new();
    let mut file_len = 0;
    if let Ok(mut f) = std::fs::File::open(&req.path) {
        file_len = f.metadata().map(|m| m.len()).unwrap_or(0);
        if file_len > req.offset && f.seek(SeekFrom::Start(req.offset)).is_ok() {
            let _ = f.take(req.max as u64).read_to_end(&mut data);
        }
    }
    Chunk {
        key: req.key,
        offset: req.offset,
        data,
        file_len,
        cut: None,
    }
}
