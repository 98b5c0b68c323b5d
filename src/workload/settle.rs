//! Step 2 of a start: each shim's pid line read, all at once, and the records made durable.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use super::error::SpawnError;
use super::procinfo;
use super::record::{Layout, Meta};
use super::shim::Started;
use crate::store;

/// How long a shim has to report the workload's pid.
pub const PID_TIMEOUT: Duration = Duration::from_secs(10);

/// A shim that was started and has not reported the workload's pid yet.
pub struct Launched {
    /// The record as written (not yet synced), no pid.
    pub meta: Meta,
    /// The shim, its stdout our end of its pid line. Not waited for here once it reported: the
    /// reaper thread reaps it when it ends.
    pub child: std::process::Child,
    /// The shim's start time (its identity, read right after the start).
    pub shim_start_ticks: u64,
}

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
