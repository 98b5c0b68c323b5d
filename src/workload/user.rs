//! `cloud_node.workload_user` (D46.3): workloads under another uid than the node's.
//!
//! The supervisor starts as the node's user, opens the log files, and drops to the workload
//! user (its supplementary groups, its primary group, then its uid) between fork and exec of the
//! workload. The state dir stays the node's: with a workload user the node leaves it traversable
//! but not listable (0711), every state file stays 0600 of the node's user, and only what the
//! workload must read (its params file, the module runner, a decoded input image) is handed to
//! the workload user, read-only.

use std::ffi::{CStr, CString};
use std::path::PathBuf;

/// Who the workloads run as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (the primary one included).
    pub groups: Vec<u32>,
    pub home: PathBuf,
}

/// Largest passwd/group buffer tried (getpwnam_r reports ERANGE below what it needs).
const MAX_BUF: usize = 1 << 20;

/// Why a workload user cannot be used.
#[derive(Debug)]
pub enum UserError {
    Empty,
    HoldsNul(String),
    Lookup {
        spec: String,
        source: std::io::Error,
    },
    NotFound(String),
    /// A pool that cannot be read (D65).
    BadPool(String),
    /// The node may not become the user (name, uid, the node's effective uid).
    NoPrivilege {
        name: String,
        uid: u32,
        euid: u32,
    },
}

impl std::fmt::Display for UserError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UserError::Empty => f.write_str("workload_user is empty"),
            UserError::HoldsNul(spec) => write!(f, "workload_user {spec:?} holds a NUL"),
            UserError::Lookup { spec, source } => {
                write!(f, "cannot look up workload_user {spec:?}: {source}")
            }
            UserError::NotFound(spec) => write!(
                f,
                "workload_user {spec:?} is not a user of this host (no passwd entry)"
            ),
            UserError::BadPool(why) => write!(f, "workload_user {why}"),
            UserError::NoPrivilege { name, uid, euid } => write!(
                f,
                "workload_user {name} (uid {uid}) needs the node to run as root or with CAP_SETUID, CAP_SETGID, CAP_KILL, CAP_CHOWN and CAP_DAC_OVERRIDE; it runs as uid {euid} without them"
            ),
        }
    }
}

impl std::error::Error for UserError {}

/// The most users a pool may name.
pub const MAX_POOL: usize = 1024;

/// D65: the users a `workload_user` setting names: one user (a name or uid), or a pool, as a
/// list (`cwwork0,cwwork1`) whose items may hold one range of numbers in brackets (`cwwork[0-3]`
/// is cwwork0 … cwwork3; `w[00-11]` keeps the width: w00 … w11).
pub fn pool_names(spec: &str) -> Result<Vec<String>, UserError> {
    let bad = |why: &str| UserError::BadPool(format!("{spec:?}: {why}"));
    let mut names = Vec::new();
    for item in spec.split(',').map(str::trim) {
        if item.is_empty() {
            return Err(bad("an empty name in the list"));
        }
        let Some((head, rest)) = item.split_once('[') else {
            names.push(item.to_string());
            continue;
        };
        let (range, tail) = rest
            .split_once(']')
            .ok_or_else(|| bad("a [ without its ]"))?;
        let (lo, hi) = range
            .split_once('-')
            .ok_or_else(|| bad("a range is [first-last]"))?;
        let digits =
            |t: &str| !t.is_empty() && t.len() <= 6 && t.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) || tail.contains(['[', ']']) {
            return Err(bad("a range is [first-last], of at most 6 digits each"));
        }
        let (a, b): (usize, usize) = (lo.parse().unwrap_or(0), hi.parse().unwrap_or(0));
        if a > b {
            return Err(bad("a range's first number is above its last"));
        }
        let width = if lo.starts_with('0') { lo.len() } else { 0 };
        if b.saturating_sub(a).saturating_add(names.len()) >= MAX_POOL {
            return Err(bad(&format!("more than {MAX_POOL} users")));
        }
        names.extend((a..=b).map(|n| format!("{head}{n:0width$}{tail}")));
    }
    if names.len() > MAX_POOL {
        return Err(bad(&format!("more than {MAX_POOL} users")));
    }
    Ok(names)
}

/// D65: every user of the pool `spec` names ([`pool_names`]), looked up; one named twice (by
/// two names of one uid, say) is refused.
pub fn lookup_pool(spec: &str) -> Result<Vec<WorkloadUser>, UserError> {
    let mut pool: Vec<WorkloadUser> = Vec::new();
    for name in pool_names(spec)? {
        let u = lookup(&name)?;
        if pool.iter().any(|p| p.uid == u.uid) {
            return Err(UserError::BadPool(format!(
                "{spec:?}: uid {} is named twice (as {})",
                u.uid, u.name
            )));
        }
        pool.push(u);
    }
    Ok(pool)
}

/// The passwd entry for a name or a numeric uid.
pub fn lookup(spec: &str) -> Result<WorkloadUser, UserError> {
    let spec = spec.trim();
    if spec.is_empty() {
        return Err(UserError::Empty);
    }
    let by_uid = spec.parse::<u32>().ok();
    let name = CString::new(spec).map_err(|_| UserError::HoldsNul(spec.to_string()))?;
    let mut size = 1024usize;
    loop {
        let mut buf = vec![0 as libc::c_char; size];
        // SAFETY: all-zero is a valid `passwd` (null pointers, zero ids); it is only read after
        // getpw*_r filled it.
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: the buffer, the passwd struct and the result pointer are ours and valid for
        // the call; the name is a NUL-terminated C string.
        let rc = unsafe {
            match by_uid {
                Some(uid) => {
                    libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), buf.len(), &mut found)
                }
                None => libc::getpwnam_r(
                    name.as_ptr(),
                    &mut pw,
                    buf.as_mut_ptr(),
                    buf.len(),
                    &mut found,
                ),
            }
        };
        if rc == libc::ERANGE && size < MAX_BUF {
            size = size.saturating_mul(4);
            continue;
        }
        if rc != 0 {
            return Err(UserError::Lookup {
                spec: spec.to_string(),
                source: std::io::Error::from_raw_os_error(rc),
            });
        }
        if found.is_null() {
            return Err(UserError::NotFound(spec.to_string()));
        }
        // SAFETY: getpw*_r succeeded: pw_name and pw_dir point into `buf`, NUL-terminated (or
        // are null, which is checked).
        let text = |p: *const libc::c_char| {
            if p.is_null() {
                String::new()
            } else {
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        let (uid, gid) = (pw.pw_uid, pw.pw_gid);
        let user_name = text(pw.pw_name);
        let home = PathBuf::from(text(pw.pw_dir));
        let groups = groups_of(&user_name, gid);
        return Ok(WorkloadUser {
            name: user_name,
            uid,
            gid,
            groups,
            home,
        });
    }
}

/// The user's groups as `getgrouplist` gives them (its primary group at least).
fn groups_of(name: &str, gid: u32) -> Vec<u32> {
    let Ok(cname) = CString::new(name) else {
        return vec![gid];
    };
    let mut n: libc::c_int = 64;
    for _ in 0..4 {
        let len = usize::try_from(n).unwrap_or(64);
        let mut list = vec![0 as libc::gid_t; len];
        let mut count = n;
        // SAFETY: `list` holds `count` entries; getgrouplist writes at most that many and sets
        // `count` to what it needs.
        let rc = unsafe { libc::getgrouplist(cname.as_ptr(), gid, list.as_mut_ptr(), &mut count) };
        if rc >= 0 {
            list.truncate(usize::try_from(count).unwrap_or(0));
            return list;
        }
        n = count.max(n.saturating_mul(2));
    }
    vec![gid]
}

/// Whether this process may run workloads as `u`: root, or already `u`, or holding
/// CAP_SETUID, CAP_SETGID (to become it), CAP_KILL (to cancel it), CAP_CHOWN (to hand it its
/// params file) and CAP_DAC_OVERRIDE (to upload and clear the results it wrote): a unit's
/// `AmbientCapabilities=`.
pub fn check_privilege(u: &WorkloadUser) -> Result<(), UserError> {
    // SAFETY: geteuid/getegid have no preconditions.
    let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
    if euid == 0 || (euid == u.uid && egid == u.gid) || has_setid_caps() {
        return Ok(());
    }
    Err(UserError::NoPrivilege {
        name: u.name.clone(),
        uid: u.uid,
        euid,
    })
}

/// CAP_CHOWN (0), CAP_DAC_OVERRIDE (1), CAP_KILL (5), CAP_SETGID (6) and CAP_SETUID (7) in the
/// effective set.
fn has_setid_caps() -> bool {
    const NEEDED: u64 = 1 | (1 << 1) | (1 << 5) | (1 << 6) | (1 << 7);
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & NEEDED == NEEDED)
}

/// Gives `path` to the workload user: a file read-only (0400), a directory to write in (0700).
/// Done on a descriptor of `path` itself, opened without following a link in its place.
pub fn hand_over(path: &std::path::Path, u: &WorkloadUser) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let dir = f.metadata()?.is_dir();
    hand_over_fd(&std::os::fd::OwnedFd::from(f), u, dir)
}

/// Gives the file or directory open as `fd` to the workload user (`fchown`, `fchmod`: whatever
/// its path has become meanwhile, nothing else changes): a file read-only (0400), a directory
/// to write in (0700).
pub fn hand_over_fd(fd: &std::os::fd::OwnedFd, u: &WorkloadUser, dir: bool) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mode = if dir { 0o700 } else { 0o400 };
    // SAFETY: fchown and fchmod on a descriptor we own, plain integers.
    let rc = unsafe {
        if libc::fchown(fd.as_raw_fd(), u.uid, u.gid) != 0 {
            -1
        } else {
            libc::fchmod(fd.as_raw_fd(), mode)
        }
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Hands `path` to the workload user, when there is one.
pub fn give(user: Option<&WorkloadUser>, path: &std::path::Path) -> Result<(), super::SpawnError> {
    match user {
        Some(u) => hand_over(path, u).map_err(|source| super::SpawnError::HandOver {
            path: path.to_path_buf(),
            user: u.name.clone(),
            source,
        }),
        None => Ok(()),
    }
}

/// A directory of the node's that a workload user must pass through but not list (0711).
pub fn traversable(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
}

/// D65: what `status`, `doctor` and the start-up log say of one workload user for several slots.
pub fn shared_uid_note(name: &str, uid: u32, slots: u32) -> String {
    format!(
        "up to {slots} workloads at once share workload_user {name} (uid {uid}): each can read the others' environment (their tokens), params and results, and change their files; name a pool of users (workload_user: {name}[0-{}]) to keep them apart",
        slots.saturating_sub(1)
    )
}

/// The supervisor's argument for the user: `uid:gid:g1,g2,…`.
pub fn to_arg(u: &WorkloadUser) -> String {
    let groups: Vec<String> = u.groups.iter().map(u32::to_string).collect();
    format!("{}:{}:{}", u.uid, u.gid, groups.join(","))
}

impl WorkloadUser {
    pub fn ids(&self) -> Ids {
        Ids {
            uid: self.uid,
            gid: self.gid,
            groups: self.groups.clone(),
        }
    }
}

/// The ids the supervisor drops to, from [`to_arg`]'s text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ids {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<libc::gid_t>,
}

pub fn parse_arg(s: &str) -> Option<Ids> {
    let mut parts = s.splitn(3, ':');
    let uid = parts.next()?.parse().ok()?;
    let gid = parts.next()?.parse().ok()?;
    let groups = match parts.next()? {
        "" => Vec::new(),
        list => list
            .split(',')
            .map(|g| g.parse().ok())
            .collect::<Option<Vec<_>>>()?,
    };
    if groups.len() > 65_536 {
        return None;
    }
    Some(Ids { uid, gid, groups })
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Drops to `ids` (groups, gid, uid, in that order) and proves it cannot go back. For the child
/// between fork and exec: only async-signal-safe calls, nothing allocated.
pub fn drop_to(ids: &Ids) -> std::io::Result<()> {
    let last = || Err(std::io::Error::last_os_error());
    // SAFETY: setgroups reads `groups.len()` gids from the vector we own; setresgid/setresuid
    // take plain integers.
    unsafe {
        if libc::setgroups(ids.groups.len(), ids.groups.as_ptr()) != 0 {
            return last();
        }
        if libc::setresgid(ids.gid, ids.gid, ids.gid) != 0 {
            return last();
        }
        // A node that holds capabilities without being root (a unit's AmbientCapabilities)
        // would pass them on: changing between two non-zero uids keeps them. None reach the
        // workload: the ambient set is cleared, and after the uid change every other set too.
        if libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        ) != 0
        {
            return last();
        }
        if libc::setresuid(ids.uid, ids.uid, ids.uid) != 0 {
            return last();
        }
        if ids.uid != 0 {
            let header = CapHeader {
                version: LINUX_CAPABILITY_VERSION_3,
                pid: 0,
            };
            let data = [CapData::default(); 2];
            if libc::syscall(libc::SYS_capset, &header, data.as_ptr()) != 0 {
                return last();
            }
        }
        // A target that is not root must not be able to regain it.
        if ids.uid != 0 && libc::setuid(0) == 0 {
            return Err(std::io::Error::from_raw_os_error(libc::EPERM));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_are_found_by_name_and_uid_and_strangers_are_refused() {
        let root = lookup("root").unwrap();
        assert_eq!((root.uid, root.gid), (0, 0));
        assert_eq!(lookup("0").unwrap().name, "root");
        for bad in ["", "  ", "no-such-user-cw", "4294967295", "a\0b"] {
            assert!(lookup(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_supervisor_argument_round_trips_and_hostile_text_is_refused() {
        let u = WorkloadUser {
            name: "w".into(),
            uid: 1000,
            gid: 1001,
            groups: vec![1001, 27],
            home: "/home/w".into(),
        };
        assert_eq!(
            parse_arg(&to_arg(&u)),
            Some(Ids {
                uid: 1000,
                gid: 1001,
                groups: vec![1001, 27]
            })
        );
        assert_eq!(parse_arg("5:6:").map(|i| i.groups), Some(vec![]));
        for bad in [
            "",
            "1",
            "1:2",
            "x:2:",
            "1:2:a",
            "1:2:3,,4",
            "-1:2:",
            "1:2:99999999999",
        ] {
            assert_eq!(parse_arg(bad), None, "{bad:?}");
        }
    }

    /// D65: a pool as a list or a range; anything else is refused, and so is a pool too large.
    #[test]
    fn d65_a_pool_is_a_list_or_a_range_of_users() {
        assert_eq!(pool_names("w").unwrap(), ["w"]);
        assert_eq!(pool_names(" a , b ").unwrap(), ["a", "b"]);
        assert_eq!(
            pool_names("cwwork[0-3]").unwrap(),
            ["cwwork0", "cwwork1", "cwwork2", "cwwork3"]
        );
        assert_eq!(
            pool_names("w[08-10]x,z").unwrap(),
            ["w08x", "w09x", "w10x", "z"]
        );
        for bad in [
            "a,,b",
            "a,",
            "w[1-",
            "w[3-1]",
            "w[a-b]",
            "w[1]",
            "w[0-1][0-1]",
            "w[0-9999999]",
            "w[0-2000]",
        ] {
            assert!(pool_names(bad).is_err(), "{bad:?}");
        }
        // One uid named twice.
        assert!(lookup_pool("root,0").is_err());
        assert_eq!(lookup_pool("root").unwrap().len(), 1);
    }

    /// D65: a hand-over never goes through a link in the path's place.
    #[test]
    fn d65_a_hand_over_does_not_follow_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let s = crate::scratch::Scratch::new("handover");
        let target = s.path().join("target");
        std::fs::create_dir(&target).unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755)).unwrap();
        let link = s.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let me = lookup(&unsafe { libc::geteuid() }.to_string()).unwrap();
        assert!(hand_over(&link, &me).is_err());
        let mode = std::fs::metadata(&target).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o755);
        let file = s.path().join("params.json");
        std::fs::write(&file, "{}").unwrap();
        hand_over(&file, &me).unwrap();
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o400);
    }
}
