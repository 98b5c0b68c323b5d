//! The spawner: starts workloads off the node's loop and reports each start back as one
//! [`Outcome`] on a channel the loop selects on. The loop never waits on a fork, a child's pid
//! line or an fsync.
//!
//! One thread takes every start waiting (a batch, so many starts at once share their syncs),
//! and for each one writes its directory, params and record (unsynced) and starts its supervisor
//! ([`super::launch`]), which starts the workload right away; then it reads their pid lines (all
//! at once, [`settle`]), syncs the records of those that started ([`make_durable`]), appends their ledger entries (one fsync for the batch) and
//! reports them in order.
//!
//! So a start is answered only once its record and its ledger entry are durable (guarantee 1
//! across a host crash), while the workload itself runs before either sync completed.
//!
//! A panic while handling one request is caught and reported as that request's failure (in builds
//! that unwind, debug and test builds; release and packaged builds abort instead, which the node recovers from as from a
//! kill -9: see `panic` in Cargo.toml). If the thread ends anyway, the channel disconnects: the
//! loop notices, fails the starts in flight and refuses new ones with a clear error.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{unbounded, Receiver, Sender};
use serde_json::Value;

use super::launch::Launched;
use super::procinfo;
use super::record::{Layout, Meta};
use super::shim::Started;
use super::{SpawnError, StartRequest};
use crate::config::Settings;
use crate::{ledger, store};

/// The most starts launched and settled together.
const MAX_BATCH: usize = 64;

/// How a start ended, as the loop learns it.
#[derive(Debug)]
pub enum Outcome {
    /// The workload runs; its ledger entry (`ledger`) is durable, the reply is the loop's.
    Spawned {
        safe_id: String,
        meta: Box<Meta>,
        ledger: ledger::Entry,
        /// Request received by the spawner → supervisor started, and → reported (for the log).
        launch: Duration,
        total: Duration,
    },
    /// Nothing runs and nothing is left of it on disk.
    SpawnFailed { safe_id: String, why: SpawnError },
}

/// What the spawner needs for every start, fixed for the node's lifetime.
pub struct Context {
    pub settings: Settings,
    pub layout: Layout,
    pub exe: PathBuf,
    pub ledger: PathBuf,
    /// The reply (and ledger) body of a started workload.
    pub body: fn(&Meta) -> Value,
}

/// The loop's handle: where start requests go.
pub struct Spawner {
    jobs: Sender<(StartRequest, Instant)>,
}

impl Spawner {
    pub fn start(ctx: Context, out: Sender<Outcome>) -> std::io::Result<Spawner> {
        let (jobs, jobs_rx) = unbounded::<(StartRequest, Instant)>();
        std::thread::Builder::new()
            .name("spawner".into())
            .spawn(move || spawn_loop(&ctx, &jobs_rx, &out))?;
        Ok(Spawner { jobs })
    }

    /// A spawner with no thread behind it: what is submitted waits in the returned receiver
    /// (unit tests of the loop's bookkeeping).
    #[cfg(test)]
    pub fn for_tests() -> (Spawner, Receiver<(StartRequest, Instant)>) {
        let (jobs, rx) = unbounded();
        (Spawner { jobs }, rx)
    }

    /// Hands a start to the spawner; false when the spawner is gone.
    pub fn submit(&self, req: StartRequest) -> bool {
        self.jobs.send((req, Instant::now())).is_ok()
    }
}

fn spawn_loop(ctx: &Context, jobs: &Receiver<(StartRequest, Instant)>, out: &Sender<Outcome>) {
    while let Ok(first) = jobs.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match jobs.try_recv() {
                Ok(j) => batch.push(j),
                Err(_) => break,
            }
        }
        let mut launched = Vec::new();
        for (req, received) in batch {
            let safe_id = req.safe_id.clone();
            let run = std::panic::AssertUnwindSafe(|| {
                super::launch(&ctx.settings, &ctx.layout, &ctx.exe, req)
            });
            match std::panic::catch_unwind(run).unwrap_or(Err(SpawnError::Internal)) {
                Ok(l) => launched.push((l, received, received.elapsed())),
                Err(why) => {
                    if out.send(Outcome::SpawnFailed { safe_id, why }).is_err() {
                        return;
                    }
                }
            }
        }
        if launched.is_empty() {
            continue;
        }
        let run = std::panic::AssertUnwindSafe(|| settle_batch(ctx, launched));
        let Ok(outcomes) = std::panic::catch_unwind(run) else {
            // What was in the batch is lost to the loop: it fails them when it notices.
            return;
        };
        for o in outcomes {
            if out.send(o).is_err() {
                return;
            }
        }
    }
}

fn settle_batch(ctx: &Context, batch: Vec<(Launched, Instant, Duration)>) -> Vec<Outcome> {
    let (launched, times): (Vec<Launched>, Vec<(Instant, Duration)>) = batch
        .into_iter()
        .map(|(l, received, took)| (l, (received, took)))
        .unzip();
    let settled = settle(&ctx.layout, launched, PID_TIMEOUT);
    // Synced once the workloads run, and before anything is answered.
    let started: Vec<&str> = settled
        .iter()
        .filter(|(_, _, r)| r.is_ok())
        .map(|(id, _, _)| id.as_str())
        .collect();
    make_durable(&ctx.layout, &started);
    let entries: Vec<ledger::Entry> = settled
        .iter()
        .filter_map(|(_, _, r)| r.as_ref().ok())
        .map(|m| ledger::entry(&m.request_id_text(), true, (ctx.body)(m)))
        .collect();
    record(&ctx.ledger, &entries);
    let mut entries = entries.into_iter();
    settled
        .into_iter()
        .zip(times)
        .map(|((safe_id, _, result), (received, launch))| match result {
            Ok(meta) => Outcome::Spawned {
                safe_id,
                ledger: entries
                    .next()
                    .unwrap_or_else(|| ledger::entry(&meta.request_id_text(), true, Value::Null)),
                meta: Box::new(meta),
                launch,
                total: received.elapsed(),
            },
            Err(why) => Outcome::SpawnFailed { safe_id, why },
        })
        .collect()
}

fn record(path: &Path, entries: &[ledger::Entry]) {
    if entries.is_empty() {
        return;
    }
    if let Err(e) = ledger::append(path, entries) {
        log::error!(
            "cannot record {} started request(s) in {}: {e}",
            entries.len(),
            crate::store::shown(path)
        );
    }
}

/// How long a shim has to report the workload's pid.
pub const PID_TIMEOUT: Duration = Duration::from_secs(10);

/// Syncs the records of freshly launched workloads (each `meta.json` and its directory, and the
/// workloads folder once, which holds their new directories), one after the other on the
/// spawner thread: the first sync's journal commit (ext4, xfs) carries the whole batch, so the
/// others find little left to write. Errors are logged: the record is there for a node restart
/// either way, only a host crash could lose it.
pub fn make_durable(layout: &Layout, safe_ids: &[&str]) {
    let mut paths: Vec<PathBuf> = safe_ids
        .iter()
        .flat_map(|id| [layout.meta(id), layout.dir(id)])
        .collect();
    if !safe_ids.is_empty() {
        paths.push(layout.workloads());
    }
    for path in &paths {
        store::slow_disk_pause();
        // Never blocks on a FIFO planted in place of a record (D48).
        use std::os::unix::fs::OpenOptionsExt;
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path);
        if let Err(e) = opened.and_then(|f| f.sync_all()) {
            log::warn!("cannot sync {}: {e}", store::shown(path));
        }
    }
}

/// Step 2 of a start (on the spawner thread): waits for each shim's pid line, all at once, at
/// most `timeout`. Each gets its record with `started` filled in, or the reason it could not
/// start (then its shim, if still provably ours, is killed and its directory is gone).
pub fn settle(
    layout: &Layout,
    launched: Vec<Launched>,
    timeout: Duration,
) -> Vec<(String, i32, Result<Meta, SpawnError>)> {
    let mut launched = launched;
    let lines = read_lines_timeout(&mut launched, timeout);
    launched
        .into_iter()
        .zip(lines)
        .map(|(l, line)| {
            let id = l.meta.safe_id.clone();
            let shim = i32::try_from(l.child.id()).unwrap_or(0);
            (id, shim, finish(layout, l, &line))
        })
        .collect()
}

fn finish(layout: &Layout, l: Launched, line: &str) -> Result<Meta, SpawnError> {
    let Launched {
        mut meta,
        mut child,
        shim_start_ticks,
    } = l;
    drop(child.stdout.take());
    let shim_pid = i32::try_from(child.id()).unwrap_or(0);
    let pid: i32 = match line
        .strip_prefix("pid ")
        .and_then(|p| p.trim().parse().ok())
    {
        Some(p) => p,
        None => {
            let why = line
                .strip_prefix("error: ")
                .unwrap_or(line)
                .trim()
                .to_string();
            // A shim that said nothing in time is stopped before its directory goes, so it
            // cannot start an untracked workload later (it is the node's unreaped child, so its
            // pid is still its own).
            let _ = child.kill();
            let _ = child.wait();
            super::reaper::waited(child.id());
            let _ = std::fs::remove_dir_all(layout.dir(&meta.safe_id));
            return Err(if why.is_empty() {
                SpawnError::NoPid
            } else {
                SpawnError::Shim(why)
            });
        }
    };
    // The shim reports the pid first and records started.json right after (for recovery); the
    // node reads the same facts from /proc itself rather than wait for that file.
    let started = Started {
        pid,
        start_ticks: procinfo::start_ticks(pid).unwrap_or(0),
        shim_pid,
        shim_start_ticks,
        boot_id: procinfo::boot_id(),
        started_at: crate::util::rfc3339(SystemTime::now()),
    };
    // meta.json on disk stays without the pid: the shim's started.json completes it at
    // recovery, so a second synced write is not needed here.
    meta.started = Some(started);
    Ok(meta)
}

/// Reads the first line from each shim's pid channel (a pipe), all at once, waiting at most
/// `timeout` in all.
fn read_lines_timeout(launched: &mut [Launched], timeout: Duration) -> Vec<String> {
    let begun = std::time::Instant::now();
    let fds: Vec<i32> = launched
        .iter()
        .map(|l| l.child.stdout.as_ref().map_or(-1, AsRawFd::as_raw_fd))
        .collect();
    let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); launched.len()];
    let mut open: Vec<bool> = fds.iter().map(|fd| *fd >= 0).collect();
    let mut chunk = [0u8; 256];
    while open.iter().any(|o| *o) {
        let left = timeout.saturating_sub(begun.elapsed());
        if left.is_zero() {
            break;
        }
        let mut pfds: Vec<libc::pollfd> = fds
            .iter()
            .zip(&open)
            .map(|(fd, o)| libc::pollfd {
                fd: if *o { *fd } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
        let n = libc::nfds_t::try_from(pfds.len()).unwrap_or(0);
        // SAFETY: `pfds` is a valid array of `n` pollfds (negative fds are ignored by poll).
        let rc = unsafe { libc::poll(pfds.as_mut_ptr(), n, ms) };
        if rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        if rc <= 0 {
            break;
        }
        let ready = pfds.iter().zip(launched.iter_mut());
        for ((p, l), (buf, o)) in ready.zip(bufs.iter_mut().zip(open.iter_mut())) {
            if !*o || p.revents == 0 {
                continue;
            }
            let got = l.child.stdout.as_mut().map(|s| s.read(&mut chunk));
            match got {
                Some(Ok(0) | Err(_)) | None => *o = false,
                Some(Ok(k)) => buf.extend_from_slice(chunk.get(..k).unwrap_or_default()),
            }
            if memchr::memchr(b'\n', buf).is_some() {
                *o = false;
            }
        }
    }
    bufs.iter()
        .map(|b| {
            String::from_utf8_lossy(b)
                .lines()
                .next()
                .unwrap_or("")
                .to_string()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::record::parse_meta_bytes;
    use crate::workload::testkit::{good_meta, scratch};
    use std::process::{Command, Stdio};

    fn fake_shim(layout: &Layout, id: &str, script: &str) -> Launched {
        std::fs::create_dir_all(layout.dir(id)).unwrap();
        let child = Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let shim_pid = child.id() as i32;
        let mut meta =
            parse_meta_bytes(good_meta(layout).to_string().as_bytes(), &layout.logs()).unwrap();
        meta.safe_id = id.into();
        meta.started = None;
        Launched {
            meta,
            child,
            shim_start_ticks: procinfo::start_ticks(shim_pid).unwrap(),
        }
    }

    /// The spawner reads every shim's pid line at once: a slow shim does not hold up the
    /// others, one that reports an error is refused with it, and one that says nothing in time
    /// is killed (it must not start an untracked workload later) and its directory removed.
    #[test]
    fn pid_lines_are_read_all_at_once_and_a_silent_shim_is_stopped() {
        let layout = scratch("settle");
        let launched = vec![
            fake_shim(&layout, "slow", "sleep 0.3; echo pid 4242; sleep 1"),
            fake_shim(&layout, "err", "echo 'error: cannot open the log files'"),
            fake_shim(&layout, "mute", "exec sleep 30"),
            fake_shim(&layout, "fast", "echo pid 4343"),
        ];
        let mute = (launched[2].child.id() as i32, launched[2].shim_start_ticks);
        let out = settle(&layout, launched, Duration::from_secs(2));
        make_durable(&layout, &["slow", "fast"]);
        let ids: Vec<&str> = out.iter().map(|(id, _, _)| id.as_str()).collect();
        assert_eq!(ids, ["slow", "err", "mute", "fast"], "in order");
        let pid = |i: usize| out[i].2.as_ref().map(|m| m.pid()).ok();
        assert_eq!(pid(0), Some(4242));
        assert_eq!(pid(3), Some(4343));
        assert_eq!(
            out[1].2.as_ref().unwrap_err().to_string(),
            "cannot open the log files"
        );
        assert_eq!(
            out[2].2.as_ref().unwrap_err().to_string(),
            "the workload supervisor did not report a pid"
        );
        assert!(
            !procinfo::same_process_alive(mute.0, mute.1),
            "the silent shim was killed"
        );
        assert!(!layout.dir("mute").exists() && !layout.dir("err").exists());
        assert!(layout.dir("slow").exists() && layout.dir("fast").exists());
        std::fs::remove_dir_all(&layout.state).unwrap();
    }
}
