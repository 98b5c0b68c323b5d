//! The services the node tracks (D59): what its workloads and its install script left running
//! in a session of their own (a model server kept warm between requests). Taken on from the
//! supervisor's record when a workload's completion is made, or from what the install script
//! left; kept in `services.json` across restarts; looked at every few seconds while there are
//! any (the log says once when one ends); listed in `status`, counted in the heartbeat; never
//! counted against `max_concurrent_workloads`. `cancel` with a service's pid stops it (SIGTERM to
//! its session, SIGKILL after the grace), and so does a container's node when it stops (D58).
//! A leaf: it imports nothing else of the node.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::logtext::shown;
use crate::store;
use crate::workload::procinfo;
use crate::workload::services::{self as svc, Found, Left, Service, Tracked};

/// How often the services are looked at while there are any.
const LOOK_EVERY: Duration = Duration::from_secs(5);
/// How often while one is being stopped (its end, and its SIGKILL, are due soon).
const LOOK_STOPPING: Duration = Duration::from_millis(100);
/// Largest `services.json` read back.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// Who started a service.
pub(super) struct Origin {
    /// `install`, or the workload's kind.
    pub(super) started_by: String,
    pub(super) request_id: Option<String>,
    pub(super) workload_uuid: Option<String>,
}

impl Origin {
    pub(super) fn install() -> Origin {
        Origin {
            started_by: "install".into(),
            request_id: None,
            workload_uuid: None,
        }
    }

    fn describe(&self) -> String {
        match &self.request_id {
            Some(r) => format!("{} {}", self.started_by, shown(r)),
            None if self.started_by == "install" => "the install script".into(),
            None => self.started_by.clone(),
        }
    }
}

/// One tracked service.
struct ServiceEntry {
    rec: Service,
    /// The GPUs its processes use (`nvidia-smi`'s compute-apps list).
    gpus: Vec<String>,
    /// Its processes that are this node's own children (an install script's orphans were
    /// re-parented to the node): reaped by their pid when they end.
    children: Vec<i32>,
    stopping: Option<Stopping>,
}

struct Stopping {
    /// When SIGKILL goes to what is left; `None` once sent (or when SIGKILL was the signal).
    kill_at: Option<Instant>,
}

impl ServiceEntry {
    fn describe(&self) -> String {
        let origin = Origin {
            started_by: self.rec.started_by.clone(),
            request_id: self.rec.request_id.clone(),
            workload_uuid: None,
        };
        format!(
            "service pid {} ({}) started by {}",
            self.rec.process.pid,
            self.rec.process.cmdline,
            origin.describe()
        )
    }
}

/// The services the node tracks.
pub(super) struct Services {
    path: PathBuf,
    list: Vec<ServiceEntry>,
    next_look: Instant,
    /// A container's node stopping (D58): when SIGKILL goes to its services, those a workload
    /// stopped meanwhile leaves included.
    closing: Option<Instant>,
}

impl Services {
    /// The services a node before this one tracked (`<state>/services.json`, validated, a bad
    /// file quarantined): those still running in this boot are tracked again, the others are
    /// said to have ended.
    pub(super) fn load(state: &Path, now: Instant) -> Services {
        let path = state.join(svc::SERVICES_FILE);
        let saved: Tracked =
            store::load_record(&path, MAX_FILE_BYTES, "services record").unwrap_or_default();
        let boot = procinfo::boot_id();
        let mut me = Services {
            path,
            list: Vec::new(),
            next_look: now,
            closing: None,
        };
        let before = saved.services.len();
        for rec in saved.services {
            let entry = ServiceEntry {
                rec,
                gpus: Vec::new(),
                children: Vec::new(),
                stopping: None,
            };
            if entry.rec.boot_id == boot && svc::alive(&entry.rec.process) {
                log::info!(
                    "tracking {} (running since {})",
                    entry.describe(),
                    entry.rec.since
                );
                me.list.push(entry);
            } else {
                log::info!("{} ended while the node was down", entry.describe());
            }
        }
        if me.list.len() != before {
            me.save();
        }
        me
    }

    pub(super) fn len(&self) -> usize {
        self.list.len()
    }

    /// Takes on the services `found` that `origin` left: each still running (its start time
    /// proven), run as `uid` (the workload's; `None`: any), and not tracked yet. `children`:
    /// processes of theirs that are this node's own children, reaped by the node.
    pub(super) fn adopt(
        &mut self,
        found: Vec<Found>,
        origin: &Origin,
        uid: Option<u32>,
        children: &[i32],
        now: Instant,
    ) {
        let before = self.list.len();
        for f in found {
            if let Some(why) = self.refusal(&f, uid) {
                log::warn!(
                    "pid {} ({}), left running by {}, is not tracked as a service: {why}",
                    f.pid,
                    f.cmdline,
                    origin.describe()
                );
                continue;
            }
            let rec = Service {
                started_by: origin.started_by.clone(),
                request_id: origin.request_id.clone(),
                workload_uuid: origin.workload_uuid.clone(),
                since: crate::util::rfc3339(std::time::SystemTime::now()),
                since_unix: crate::workload::unix_now(),
                boot_id: procinfo::boot_id(),
                process: f,
            };
            let entry = ServiceEntry {
                gpus: Vec::new(),
                children: children.to_vec(),
                stopping: None,
                rec,
            };
            log::info!(
                "{}: kept running as a service (in a session of its own; `cancel` with pid {} stops it)",
                entry.describe(),
                entry.rec.process.pid
            );
            self.list.push(entry);
        }
        if let Some(kill_at) = self.closing {
            let kill_after = kill_at.saturating_duration_since(now);
            self.stop_all("the node's container is stopping", kill_after, now);
        }
        if self.list.len() != before {
            self.next_look = self.next_look.min(crate::util::later(now, LOOK_EVERY));
            self.save();
        }
    }

    /// Why `f` is not taken on as a service, if it is not.
    fn refusal(&self, f: &Found, uid: Option<u32>) -> Option<String> {
        let me = i32::try_from(std::process::id()).unwrap_or(0);
        let (pgrp, sid) = procinfo::own_group_and_session();
        if f.pid == me || [me, pgrp, sid].contains(&f.scope_id) {
            return Some("it is the node's own process, group or session".into());
        }
        if self
            .list
            .iter()
            .any(|e| e.rec.process.pid == f.pid && e.rec.process.start_ticks == f.start_ticks)
        {
            return Some("tracked already".into());
        }
        if self.list.len() >= svc::MAX_TRACKED {
            return Some(format!("{} services are tracked already", svc::MAX_TRACKED));
        }
        if let Some(u) = uid.filter(|u| *u != f.uid) {
            return Some(format!(
                "it runs as uid {}, not as its workload's uid {u}",
                f.uid
            ));
        }
        if !svc::alive(f) {
            return Some("it ended already".into());
        }
        None
    }

    /// A workload's supervisor record of what it left (`left.json` in its directory `dir`),
    /// once: the processes it cleared are logged, the services it kept are taken on (run as
    /// `uid`, the workload's), and the record goes.
    pub(super) fn adopt_left(&mut self, dir: &Path, origin: &Origin, uid: u32, now: Instant) {
        let path = dir.join(svc::LEFT_FILE);
        let left: Option<Left> = store::load_record(
            &path,
            store::MAX_RECORD_BYTES,
            "record of what a workload left",
        );
        let Some(left) = left else {
            return;
        };
        let who = origin.describe();
        for c in &left.cleared {
            log::info!(
                "{who}: cleared pid {} ({}) it left running{}",
                c.pid,
                c.cmdline,
                if c.own_session {
                    ", in a session of its own (cloud_node.services is stop)"
                } else {
                    ""
                }
            );
        }
        if left.more_cleared > 0 {
            log::info!("{who}: cleared {} more process(es)", left.more_cleared);
        }
        self.adopt(left.services, origin, Some(uid), &[], now);
        let _ = std::fs::remove_file(&path);
    }

    /// When the services are next looked at (none: no service).
    pub(super) fn next_due(&self) -> Option<Instant> {
        (!self.list.is_empty()).then_some(self.next_look)
    }

    /// Looks at the services when due: a stopping one past its grace gets SIGKILL, one that
    /// ended is said to have ended (once) and forgotten, ended children of the node are reaped.
    pub(super) fn tick(&mut self, now: Instant) {
        if self.list.is_empty() || now < self.next_look {
            return;
        }
        let before = self.list.len();
        for e in &mut self.list {
            reap(&mut e.children);
            if let Some(st) = &mut e.stopping {
                if st.kill_at.is_some_and(|k| now >= k) {
                    st.kill_at = None;
                    let n = svc::signal(&e.rec.process, libc::SIGKILL);
                    if n > 0 {
                        log::info!(
                            "{}: still running after its grace; SIGKILL to its {n} process(es)",
                            e.describe()
                        );
                    }
                }
            }
        }
        self.list.retain(|e| {
            let alive = svc::alive(&e.rec.process);
            if !alive {
                log::info!(
                    "{} {}",
                    e.describe(),
                    if e.stopping.is_some() {
                        "stopped"
                    } else {
                        "ended"
                    }
                );
            }
            alive
        });
        if self.list.len() != before {
            self.save();
        }
        let every = if self.list.iter().any(|e| e.stopping.is_some()) {
            LOOK_STOPPING
        } else {
            LOOK_EVERY
        };
        self.next_look = crate::util::later(now, every);
    }

    /// `cancel` with a service's pid: `sig` to every process of its session, SIGKILL after
    /// `grace` to what is left. `None` when no service has that pid.
    pub(super) fn cancel(
        &mut self,
        pid: i32,
        sig: (i32, &'static str),
        grace: Duration,
        now: Instant,
    ) -> Option<Value> {
        let e = self.list.iter_mut().find(|e| e.rec.process.pid == pid)?;
        let n = svc::signal(&e.rec.process, sig.0);
        let kill_at = (sig.0 != libc::SIGKILL).then(|| crate::util::later(now, grace));
        if e.stopping.is_none() || sig.0 == libc::SIGKILL {
            e.stopping = Some(Stopping { kill_at });
        }
        let message = match kill_at {
            Some(_) => format!(
                "Service pid {pid} stopped with {} to its {n} process(es); SIGKILL after {}s to what is left",
                sig.1,
                grace.as_secs_f64()
            ),
            None => format!("Service pid {pid} killed with SIGKILL ({n} process(es))"),
        };
        log::info!("cancel: {}: {message}", e.describe());
        self.next_look = now;
        let out = json!({
            "message": message,
            "pid": pid,
            "signal": sig.1,
            "service": entry_json(e, crate::workload::unix_now()),
        });
        Some(out)
    }

    /// Stops every service (a container's node stopping, D58): SIGTERM, SIGKILL after
    /// `kill_after`; returns how many.
    pub(super) fn stop_all(&mut self, why: &str, kill_after: Duration, now: Instant) -> usize {
        self.closing = Some(crate::util::later(now, kill_after));
        for e in self.list.iter_mut().filter(|e| e.stopping.is_none()) {
            let n = svc::signal(&e.rec.process, libc::SIGTERM);
            log::info!(
                "{}: SIGTERM to its {n} process(es) ({why}); SIGKILL after {:.1}s",
                e.describe(),
                kill_after.as_secs_f64()
            );
            e.stopping = Some(Stopping {
                kill_at: Some(crate::util::later(now, kill_after)),
            });
        }
        self.next_look = now;
        self.list.len()
    }

    /// A second SIGTERM in a container: SIGKILL to every service being stopped.
    pub(super) fn kill_now(&mut self, now: Instant) {
        self.closing = Some(now);
        for e in &mut self.list {
            if let Some(st) = &mut e.stopping {
                st.kill_at = Some(now);
            }
        }
        self.next_look = now;
    }

    /// At a shutdown that leaves them running: one line each.
    pub(super) fn log_running(&self) {
        for e in &self.list {
            log::info!("left running: {}", e.describe());
        }
    }

    /// The `services` list of `status`.
    pub(super) fn status(&self) -> Value {
        let now = crate::workload::unix_now();
        Value::Array(self.list.iter().map(|e| entry_json(e, now)).collect())
    }

    /// Which GPUs the services use, from `apps` (pid → the GPUs it has a context on).
    pub(super) fn on_apps(&mut self, apps: &BTreeMap<i32, Vec<String>>) {
        if self.list.is_empty() {
            return;
        }
        let procs = svc::scan();
        for e in &mut self.list {
            let mut pids: BTreeSet<i32> = svc::members(&e.rec.process, &procs)
                .iter()
                .map(|p| p.pid)
                .collect();
            pids.insert(e.rec.process.pid);
            let gpus: BTreeSet<String> = pids
                .iter()
                .filter_map(|p| apps.get(p))
                .flatten()
                .cloned()
                .collect();
            e.gpus = gpus.into_iter().collect();
        }
    }

    /// The GPUs some service uses (a new workload gets others where it can).
    pub(super) fn gpus(&self) -> BTreeSet<String> {
        self.list.iter().flat_map(|e| e.gpus.clone()).collect()
    }

    fn save(&self) {
        let tracked = Tracked {
            services: self.list.iter().map(|e| e.rec.clone()).collect(),
        };
        let written = serde_json::to_vec_pretty(&tracked)
            .map_err(std::io::Error::other)
            .and_then(|json| store::write_atomic(&self.path, &json, 0o600));
        if let Err(e) = written {
            log::warn!(
                "cannot write {}: {e}; a restarted node will not know the services it lists",
                store::shown(&self.path)
            );
        }
    }
}

/// Reaps those of `children` that ended (the node's own children, by their pid only).
fn reap(children: &mut Vec<i32>) {
    children.retain(|pid| {
        // SAFETY: waitpid on one pid, non-blocking, no status wanted.
        let rc = unsafe { libc::waitpid(*pid, std::ptr::null_mut(), libc::WNOHANG) };
        rc == 0
    });
}

fn entry_json(e: &ServiceEntry, now_unix: f64) -> Value {
    let p = &e.rec.process;
    // What it runs now: a daemon found the moment after its fork may not have run `exec` yet,
    // and the command line recorded then is its parent shell's.
    let command = if procinfo::same_process_alive(p.pid, p.start_ticks) {
        svc::cmdline(p.pid)
    } else {
        p.cmdline.clone()
    };
    json!({
        "pid": p.pid,
        "command": command,
        "started_by": e.rec.started_by,
        "request_id": e.rec.request_id,
        "workload_uuid": e.rec.workload_uuid,
        "uid": p.uid,
        "scope": p.scope,
        "gpus": e.gpus,
        "since": e.rec.since,
        "running_for_seconds": (now_unix - e.rec.since_unix).max(0.0) as u64,
        "state": if e.stopping.is_some() { "stopping" } else { "running" },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::services::Scope;

    /// A service as a workload leaves one: `sleep` in a session of its own (`setsid` execs it
    /// in place, so the pid is the child's). Its own session also keeps the record valid where
    /// the test runner's session id is 0 or 1 (a container's `exec`), which a record refuses.
    fn sleeper() -> std::process::Child {
        let child = std::process::Command::new("setsid")
            .args(["sleep", "30"])
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        // SAFETY: getsid takes any pid.
        while unsafe { libc::getsid(pid) } != pid || svc::cmdline(pid) != "sleep 30" {
            assert!(
                Instant::now() < deadline,
                "setsid did not run sleep in a session"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        child
    }

    fn found_of(child: &std::process::Child) -> Found {
        let pid = i32::try_from(child.id()).unwrap();
        Found {
            pid,
            start_ticks: procinfo::start_ticks(pid).unwrap(),
            scope: Scope::Session,
            scope_id: pid,
            sid: pid,
            leader_start: procinfo::start_ticks(pid),
            uid: unsafe { libc::getuid() },
            cmdline: svc::cmdline(pid),
        }
    }

    #[test]
    fn a_service_is_kept_across_a_restart_cancelled_by_its_pid_and_forgotten_once_ended() {
        let dir = crate::scratch::Scratch::new("services-node");
        let t0 = Instant::now();
        let mut child = sleeper();
        let f = found_of(&child);
        let pid = f.pid;
        let mut s = Services::load(&dir, t0);
        assert_eq!(s.len(), 0);
        let wrong_uid = f.uid.wrapping_add(1);
        s.adopt(
            vec![f.clone()],
            &Origin::install(),
            Some(wrong_uid),
            &[],
            t0,
        );
        assert_eq!(
            s.len(),
            0,
            "another uid than its workload's is not taken on"
        );
        s.adopt(vec![f.clone()], &Origin::install(), None, &[pid], t0);
        s.adopt(vec![f], &Origin::install(), None, &[pid], t0);
        assert_eq!(s.len(), 1, "once");
        assert_eq!(s.status()[0]["pid"], pid);
        // A restarted node tracks it again.
        let mut s = Services::load(&dir, t0);
        assert_eq!(s.len(), 1);
        s.list[0].children = vec![pid];
        assert!(s
            .cancel(
                pid + 1,
                (libc::SIGTERM, "SIGTERM"),
                Duration::from_secs(5),
                t0
            )
            .is_none());
        let out = s
            .cancel(pid, (libc::SIGTERM, "SIGTERM"), Duration::from_secs(5), t0)
            .unwrap();
        assert_eq!(out["pid"], pid);
        assert_eq!(s.status()[0]["state"], "stopping");
        // The node reaps its own child; then it is gone and forgotten.
        for _ in 0..100 {
            s.tick(Instant::now() + Duration::from_secs(10));
            if s.len() == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(s.len(), 0);
        assert!(child.try_wait().is_err() || child.try_wait().unwrap().is_some());
        assert_eq!(Services::load(&dir, t0).len(), 0);
    }

    #[test]
    fn a_hostile_services_file_is_quarantined_and_nothing_is_tracked() {
        let dir = crate::scratch::Scratch::new("services-hostile");
        let path = dir.join(svc::SERVICES_FILE);
        for text in [
            "not json",
            "{\"services\": [{\"process\": {\"pid\": 1, \"start_ticks\": 0, \"scope\": \"session\", \"scope_id\": 1, \"sid\": 1, \"uid\": 0, \"cmdline\": \"init\"}, \"started_by\": \"install\", \"since\": \"t\", \"since_unix\": 1, \"boot_id\": \"b\"}]}",
            "{\"services\": [{\"process\": {\"pid\": -3}}]}",
        ] {
            std::fs::write(&path, text).unwrap();
            assert_eq!(Services::load(&dir, Instant::now()).len(), 0, "{text}");
            assert!(!path.exists(), "quarantined: {text}");
        }
        // A symbolic link in its place is not followed.
        std::os::unix::fs::symlink("/etc/passwd", &path).unwrap();
        assert_eq!(Services::load(&dir, Instant::now()).len(), 0);
    }

    #[test]
    fn a_process_that_is_not_the_one_recorded_is_never_taken_on() {
        let dir = crate::scratch::Scratch::new("services-recycled");
        let mut child = sleeper();
        let mut f = found_of(&child);
        f.start_ticks += 1;
        f.leader_start = Some(f.start_ticks);
        let mut s = Services::load(&dir, Instant::now());
        s.adopt(vec![f], &Origin::install(), None, &[], Instant::now());
        assert_eq!(s.len(), 0);
        let _ = child.kill();
        let _ = child.wait();
    }
}
