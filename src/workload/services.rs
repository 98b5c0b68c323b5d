//! Services (D59): long-lived processes a workload, or the install script, leaves running in a
//! session of their own (a model server kept warm between requests, started with `setsid`,
//! Python's `start_new_session=True`, `daemon()`, or a double fork then `setsid`). What else a
//! workload leaves is cleared when it ends (D25); a service is not, unless
//! `cloud_node.services: stop` says so.
//!
//! How one is found: the supervisor is a subreaper, so every process its workload started stays
//! in the supervisor's subtree for as long as it lives (an orphan is re-parented to it, not to
//! init). When the workload ends, each session among the supervisor's descendants other than
//! the supervisor's own is one service: one created by `setsid` somewhere below the workload. A
//! double fork then `setsid` leaves a session whose leader is gone; its oldest member is then the
//! service's main process. For the install script the node itself is the subreaper while the
//! script runs, and everything left under it is a service: one per session, or per process group
//! for a job left in the node's session (`server &`).
//!
//! What cannot be attributed: a process started outside that tree (by systemd through
//! `snap start` or `systemctl start`, by cron, by a container runtime: those have their own
//! manager), and the services of a workload whose supervisor was killed (its orphans go to init,
//! and nothing ties them to the workload any more; they run on, untracked).
//!
//! Identity: a service is its main process (pid and start time) and its scope (its session or
//! group id). The kernel never hands out a pid that is still some process's session or group
//! id, so the scope's members are the service's for as long as it has any; a new scope with the
//! same id has a leader other than the one recorded (`leader_start`), and then the service is
//! over. A signal goes to each member through a pidfd opened before its start time is checked,
//! so a pid recycled meanwhile never gets it.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::procinfo;
use crate::store::{self, Invalid};

/// The record a supervisor leaves beside `exit.json` when its workload left anything: the
/// services it kept and the processes it cleared.
pub const LEFT_FILE: &str = "left.json";
/// The node's list of the services it tracks, in the state dir.
pub const SERVICES_FILE: &str = "services.json";
/// At most this many services or cleared processes are listed per workload (then a count).
pub const MAX_LISTED: usize = 64;
/// At most this many services are tracked by a node.
pub const MAX_TRACKED: usize = 256;
/// Longest command line kept (escaped, in characters).
const CMDLINE_CHARS: usize = 300;

/// One live process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proc {
    pub pid: i32,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
    pub start: u64,
}

/// (process, state) from the text of `/proc/<pid>/stat`.
fn parse_stat(pid: i32, text: &str) -> Option<(Proc, char)> {
    // The command name may hold spaces and parentheses: the fields start after the last ')'.
    let rest = text.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().take(20).collect();
    let state = f.first()?.chars().next()?;
    let num = |i: usize| f.get(i).and_then(|s| s.parse::<i32>().ok());
    let proc = Proc {
        pid,
        ppid: num(1)?,
        pgid: num(2)?,
        sid: num(3)?,
        start: f.get(19)?.parse().ok()?,
    };
    Some((proc, state))
}

/// Every live process (zombies only while threads of theirs still run).
pub fn scan() -> Vec<Proc> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter_map(|pid| {
            let text = procinfo::read_proc(format!("/proc/{pid}/stat")).ok()?;
            let (p, state) = parse_stat(pid, &text)?;
            procinfo::live(pid, state).then_some(p)
        })
        .collect()
}

/// The processes below `root` (its children, theirs, …), by their parent links.
pub fn descendants(procs: &[Proc], root: i32) -> Vec<Proc> {
    let mut children: BTreeMap<i32, Vec<Proc>> = BTreeMap::new();
    for p in procs {
        children.entry(p.ppid).or_default().push(*p);
    }
    let mut out = Vec::new();
    let mut seen = BTreeSet::from([root]);
    let mut todo = vec![root];
    while let Some(parent) = todo.pop() {
        for c in children.get(&parent).into_iter().flatten() {
            if seen.insert(c.pid) {
                out.push(*c);
                todo.push(c.pid);
            }
        }
    }
    out
}

/// What a service is known by: its session, or for a job left in the node's session by an
/// install script, its process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Session,
    Group,
}

/// A service as found when its workload (or the install script) ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Found {
    /// Its main process: the scope's leader while it lives, else its oldest member.
    pub pid: i32,
    pub start_ticks: u64,
    pub scope: Scope,
    /// The session or group id.
    pub scope_id: i32,
    /// Its session (the scope id for a session).
    pub sid: i32,
    /// The start time of the process whose pid is the scope id, when it was alive at discovery.
    #[serde(default)]
    pub leader_start: Option<u64>,
    pub uid: u32,
    pub cmdline: String,
}

/// One service per scope among `members`: a session other than `home_sid`, or a process group
/// of a member still in `home_sid`.
pub fn group(members: &[Proc], home_sid: i32) -> Vec<Found> {
    let mut by: BTreeMap<(Scope, i32), Vec<Proc>> = BTreeMap::new();
    for p in members {
        let key = if p.sid == home_sid {
            (Scope::Group, p.pgid)
        } else {
            (Scope::Session, p.sid)
        };
        by.entry(key).or_default().push(*p);
    }
    by.into_iter()
        .filter_map(|((scope, id), ps)| {
            let leader = ps.iter().find(|p| p.pid == id).copied();
            let main = leader.or_else(|| ps.iter().min_by_key(|p| (p.start, p.pid)).copied())?;
            Some(Found {
                pid: main.pid,
                start_ticks: main.start,
                scope,
                scope_id: id,
                sid: main.sid,
                leader_start: leader.map(|l| l.start),
                uid: uid_of(main.pid).unwrap_or(u32::MAX),
                cmdline: cmdline(main.pid),
            })
        })
        .collect()
}

/// The services below a supervisor `me` (its own session) among `procs`: each session among
/// its descendants other than its own.
pub fn below_supervisor(procs: &[Proc], me: i32) -> Vec<Found> {
    let own: Vec<Proc> = descendants(procs, me)
        .into_iter()
        .filter(|p| p.sid != me)
        .collect();
    group(&own, me)
}

/// The members of `f`'s scope among `procs`; none once the scope is another's (its id taken
/// by a new leader).
pub fn members(f: &Found, procs: &[Proc]) -> Vec<Proc> {
    let inside = |p: &&Proc| match f.scope {
        Scope::Session => p.sid == f.scope_id,
        Scope::Group => p.pgid == f.scope_id && p.sid == f.sid,
    };
    let ms: Vec<Proc> = procs.iter().filter(inside).copied().collect();
    let renewed = ms
        .iter()
        .any(|p| p.pid == f.scope_id && Some(p.start) != f.leader_start);
    if renewed {
        Vec::new()
    } else {
        ms
    }
}

/// The service still runs: its main process, or any member of its scope.
pub fn alive(f: &Found) -> bool {
    procinfo::same_process_alive(f.pid, f.start_ticks) || !members(f, &scan()).is_empty()
}

/// Sends `sig` to every process of the service (its main process and its scope's members),
/// each one proven by its start time; returns how many got it.
pub fn signal(f: &Found, sig: i32) -> usize {
    let mut targets: BTreeMap<i32, u64> = members(f, &scan())
        .into_iter()
        .map(|p| (p.pid, p.start))
        .collect();
    targets.insert(f.pid, f.start_ticks);
    targets
        .into_iter()
        .filter(|(pid, start)| signal_proven(*pid, *start, sig))
        .count()
}

/// Sends `sig` to process `pid` only if it is the one that started at `start`
/// ([`procinfo::signal_process`]), and never to the node itself.
pub fn signal_proven(pid: i32, start: u64, sig: i32) -> bool {
    i64::from(pid) != i64::from(std::process::id())
        && procinfo::signal_process(pid, start, sig).is_ok()
}

/// A process's command line as one line of text: its arguments joined by spaces, escaped and
/// cut (D31); its name in brackets when it has none (a kernel thread, a zombie).
pub fn cmdline(pid: i32) -> String {
    use std::io::Read;
    let mut bytes = Vec::new();
    if let Ok(f) = std::fs::File::open(format!("/proc/{pid}/cmdline")) {
        let _ = f.take(4096).read_to_end(&mut bytes);
    }
    let args: Vec<String> = bytes
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let text = if args.is_empty() {
        let comm = procinfo::read_proc(format!("/proc/{pid}/comm")).unwrap_or_default();
        format!("[{}]", comm.trim_end())
    } else {
        args.join(" ")
    };
    crate::logtext::cut(&text, CMDLINE_CHARS)
}

/// The real uid of process `pid` (`/proc/<pid>/status`).
pub fn uid_of(pid: i32) -> Option<u32> {
    let text = procinfo::read_proc(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A process a supervisor cleared, for the node's log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cleared {
    pub pid: i32,
    pub cmdline: String,
    /// It was in a session of its own: a service, cleared because `services: stop`.
    #[serde(default)]
    pub own_session: bool,
}

/// `left.json`: what a supervisor kept and cleared when its workload ended.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Left {
    #[serde(default)]
    pub services: Vec<Found>,
    #[serde(default)]
    pub cleared: Vec<Cleared>,
    /// Cleared processes past the first [`MAX_LISTED`].
    #[serde(default)]
    pub more_cleared: u64,
}

impl Left {
    pub fn is_empty(&self) -> bool {
        self.services.is_empty() && self.cleared.is_empty()
    }
}

/// The node's record of one service it tracks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Service {
    pub process: Found,
    /// `install`, or the kind of the workload that started it (`inference`, …).
    pub started_by: String,
    /// That workload's request id, as text (cut).
    #[serde(default)]
    pub request_id: Option<String>,
    #[serde(default)]
    pub workload_uuid: Option<String>,
    /// When the node took it on (RFC 3339, and as a Unix time).
    pub since: String,
    pub since_unix: f64,
    /// The boot it runs in: after a reboot it is gone.
    pub boot_id: String,
}

/// `services.json`: the services a node tracks, kept across its restarts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Tracked {
    pub services: Vec<Service>,
}

fn check_count(field: &'static str, n: usize, max: usize) -> Result<(), Invalid> {
    if n <= max {
        Ok(())
    } else {
        Err(Invalid::Range {
            field,
            low: 0,
            high: i64::try_from(max).unwrap_or(i64::MAX),
            got: i64::try_from(n).unwrap_or(i64::MAX),
        })
    }
}

impl store::Validate for Found {
    fn validate(&self) -> Result<(), Invalid> {
        store::check_pid("pid", self.pid)?;
        store::check_pid("scope_id", self.scope_id)?;
        store::check_pid("sid", self.sid)?;
        if self.pid == 1 || self.scope_id == 1 || self.sid == 1 {
            return Err(Invalid::Rule {
                field: "pid",
                must: "not be 1 (init)",
            });
        }
        if self.scope == Scope::Session && self.scope_id != self.sid {
            return Err(Invalid::Rule {
                field: "scope_id",
                must: "be the session id for a session",
            });
        }
        store::check_text("cmdline", &self.cmdline, 4 * CMDLINE_CHARS)
    }
}

impl store::Validate for Left {
    fn validate(&self) -> Result<(), Invalid> {
        check_count("services", self.services.len(), MAX_LISTED)?;
        check_count("cleared", self.cleared.len(), MAX_LISTED)?;
        self.services
            .iter()
            .try_for_each(store::Validate::validate)?;
        for c in &self.cleared {
            store::check_pid("cleared.pid", c.pid)?;
            store::check_text("cleared.cmdline", &c.cmdline, 4 * CMDLINE_CHARS)?;
        }
        Ok(())
    }
}

impl store::Validate for Service {
    fn validate(&self) -> Result<(), Invalid> {
        self.process.validate()?;
        store::check_text("started_by", &self.started_by, 64)?;
        if let Some(r) = &self.request_id {
            store::check_text("request_id", r, 1024)?;
        }
        if let Some(w) = &self.workload_uuid {
            store::check_id("workload_uuid", w)?;
        }
        store::check_text("since", &self.since, 64)?;
        store::check_unix("since_unix", self.since_unix)?;
        store::check_text("boot_id", &self.boot_id, 64)
    }
}

impl store::Validate for Tracked {
    fn validate(&self) -> Result<(), Invalid> {
        check_count("services", self.services.len(), MAX_TRACKED)?;
        self.services.iter().try_for_each(store::Validate::validate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Validate;

    fn p(pid: i32, ppid: i32, pgid: i32, sid: i32, start: u64) -> Proc {
        Proc {
            pid,
            ppid,
            pgid,
            sid,
            start,
        }
    }

    #[test]
    fn a_stat_line_with_parentheses_in_the_name_is_read() {
        let text = "42 (a (b) c) S 7 40 30 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 12345 0 0";
        let (proc, state) = parse_stat(42, text).unwrap();
        assert_eq!(state, 'S');
        assert_eq!(proc, p(42, 7, 40, 30, 12345));
        assert!(parse_stat(1, "1 (x) S 0").is_none());
        assert!(parse_stat(1, "garbage").is_none());
    }

    #[test]
    fn descendants_follow_parent_links_only() {
        let procs = [
            p(10, 1, 10, 10, 1),
            p(11, 10, 11, 10, 2),
            p(12, 11, 12, 12, 3),
            p(13, 12, 12, 12, 4),
            p(20, 1, 20, 20, 5),
        ];
        let mut got: Vec<i32> = descendants(&procs, 10).iter().map(|p| p.pid).collect();
        got.sort_unstable();
        assert_eq!(got, vec![11, 12, 13]);
        assert!(descendants(&procs, 13).is_empty());
    }

    #[test]
    fn a_session_without_its_leader_is_one_service_named_by_its_oldest_member() {
        // A double fork then setsid: the session's leader (pid 50) is gone; 52 started before 53.
        let members = [
            p(53, 1, 50, 50, 9),
            p(52, 1, 50, 50, 8),
            p(60, 1, 60, 60, 7),
        ];
        let found = group(&members, 100);
        assert_eq!(found.len(), 2);
        let s50 = found.iter().find(|f| f.scope_id == 50).unwrap();
        assert_eq!(
            (s50.pid, s50.leader_start, s50.scope),
            (52, None, Scope::Session)
        );
        let s60 = found.iter().find(|f| f.scope_id == 60).unwrap();
        assert_eq!((s60.pid, s60.leader_start), (60, Some(7)));
        // A job left in the home session is known by its group.
        let job = group(&[p(70, 1, 69, 100, 3)], 100);
        assert_eq!((job[0].scope, job[0].scope_id), (Scope::Group, 69));
    }

    #[test]
    fn a_scope_id_taken_by_a_new_leader_is_not_the_service_any_more() {
        let f = Found {
            pid: 52,
            start_ticks: 8,
            scope: Scope::Session,
            scope_id: 50,
            sid: 50,
            leader_start: None,
            uid: 0,
            cmdline: "server".into(),
        };
        assert_eq!(members(&f, &[p(52, 1, 50, 50, 8)]).len(), 1);
        // Pid 50 recycled as the leader of a new session of the same id: not ours.
        let renewed = [p(50, 1, 50, 50, 99), p(52, 1, 50, 50, 8)];
        assert!(members(&f, &renewed).is_empty());
        let led = Found {
            leader_start: Some(5),
            ..f.clone()
        };
        assert_eq!(members(&led, &[p(50, 1, 50, 50, 5)]).len(), 1);
        assert!(members(&led, &[p(50, 1, 50, 50, 6)]).is_empty());
    }

    #[test]
    fn hostile_records_are_refused() {
        let good = Found {
            pid: 4242,
            start_ticks: 1,
            scope: Scope::Session,
            scope_id: 4242,
            sid: 4242,
            leader_start: Some(1),
            uid: 1000,
            cmdline: "python server.py".into(),
        };
        assert!(good.validate().is_ok());
        for bad in [
            Found {
                pid: 0,
                ..good.clone()
            },
            Found {
                pid: 1,
                ..good.clone()
            },
            Found {
                scope_id: -5,
                ..good.clone()
            },
            Found {
                sid: 77,
                ..good.clone()
            },
            Found {
                cmdline: "a\nb".into(),
                ..good.clone()
            },
            Found {
                cmdline: "x".repeat(5000),
                ..good.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let many = Left {
            services: vec![good.clone(); MAX_LISTED + 1],
            ..Left::default()
        };
        assert!(many.validate().is_err());
        for text in [
            "5",
            "{\"services\": 5}",
            "{\"services\": [{\"pid\": \"1\"}]}",
            "{\"services\": [{\"pid\": 2147483648, \"start_ticks\": 1}]}",
        ] {
            assert!(
                store::parse_record::<Left>(text.as_bytes()).is_err(),
                "{text}"
            );
        }
        let svc = Service {
            process: good,
            started_by: "install".into(),
            request_id: None,
            workload_uuid: Some("wl/../x".into()),
            since: "t".into(),
            since_unix: 1.0,
            boot_id: "b".into(),
        };
        assert!(svc.validate().is_err(), "a workload uuid with a slash");
        let svc = Service {
            workload_uuid: None,
            since_unix: f64::NAN,
            ..svc
        };
        assert!(svc.validate().is_err());
    }

    #[test]
    fn this_process_is_found_signalled_only_when_proven_and_named() {
        let me = i32::try_from(std::process::id()).unwrap();
        let procs = scan();
        assert!(procs.iter().any(|p| p.pid == me));
        assert!(!cmdline(me).is_empty());
        assert_eq!(uid_of(me), Some(unsafe { libc::getuid() }));
        // Never itself, never init, never a process whose start time is another.
        assert!(!signal_proven(me, procinfo::start_ticks(me).unwrap(), 0));
        assert!(!signal_proven(1, 0, 0));
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let start = procinfo::start_ticks(pid).unwrap();
        assert!(!signal_proven(pid, start + 1, libc::SIGKILL));
        assert!(
            child.try_wait().unwrap().is_none(),
            "a wrong start time is another process"
        );
        assert!(signal_proven(pid, start, libc::SIGKILL));
        assert!(child.wait().unwrap().code().is_none());
    }
}
