//! Result files and whose they are (D24, D61, D65).
//!
//! A workload writes its results into its own folder, `<results_folder>/<safe id>/`, which the
//! node makes for it (from a descriptor of `results_folder`, never through a link) and hands to
//! its uid; or straight into `results_folder` ("loose" results). When it starts, the node records
//! which files were there before (by identity: device, inode and birth time) and the names it can
//! be recognised by (its workload uuid, request id and long string params), in its [`Claim`].
//! A loose file is then attributed by [`attribute`]: by name, else by time (the only workload
//! that ran the whole time it could have been written), else to none.
//!
//! Every walk here starts from a descriptor of `results_folder` and opens each folder below it
//! with `O_NOFOLLOW` ([`crate::store::open_dir_at`]): a link a workload planted, or a folder it
//! renamed meanwhile, never leads the node outside.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::user::WorkloadUser;
use crate::store::{self, Beneath, Listed};

/// The most files a walk of `results_folder` records: beyond it a workload's record of what was
/// there before is incomplete, and no loose file is attributed to it (none is then its result
/// for sure; its own folder is not affected).
pub const MAX_FILES: usize = 20_000;

/// A name shorter than this does not attribute a file (`1` is in too many names).
pub const MIN_NAME: usize = 8;

/// At most this many names per workload, each at most this long (a file name holds 255 bytes).
const MAX_NAMES: usize = 64;
const MAX_NAME: usize = 255;

/// The record's file in the workload's directory in the state dir.
pub const CLAIM_FILE: &str = "results.json";

/// Which file it is, whatever its name or times: neither a rename nor a clock step changes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Identity(pub u64, pub u64, pub u64);

impl Identity {
    pub fn of(l: &Listed) -> Identity {
        Identity(l.dev, l.ino, l.born)
    }
}

/// What a walk found: every regular file (its name below the folder walked, and the file
/// itself), and whether that is all of them.
#[derive(Debug, Default)]
pub struct Walked {
    pub files: Vec<(String, Beneath)>,
    pub complete: bool,
}

/// How a walk goes.
pub struct Walk<'a> {
    /// Top-level folders not entered (the workloads' own folders, for a walk of loose files).
    pub skip_top: &'a dyn Fn(&OsStr) -> bool,
    /// At most this many files.
    pub limit: usize,
    /// Say so when a link or a too-deep folder is passed over.
    pub warn: bool,
}

impl Walk<'_> {
    /// Every regular file below `start` (a path below `folder`, or empty), sorted by name, never
    /// following a symlink below `folder` (see [`store::open_root`] for `folder` itself).
    pub fn run(&self, folder: &Path, start: &Path) -> Walked {
        let mut out = Walked {
            files: Vec::new(),
            complete: true,
        };
        // A folder that is not there holds nothing; one that cannot be opened (a link in its
        // place another user could have put there) is not known to hold nothing.
        let mut dir = match store::open_root(folder) {
            Ok(d) => d,
            Err(e) => {
                out.complete = e.kind() == std::io::ErrorKind::NotFound;
                return out;
            }
        };
        for part in start.components() {
            let std::path::Component::Normal(name) = part else {
                return out;
            };
            match store::open_dir_at(Some(&dir), name) {
                Ok(d) => dir = d,
                Err(_) => return out,
            }
        }
        let base = Base { folder, start };
        self.walk(&base, &dir, Path::new(""), 0, &mut out);
        out.files.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    fn walk(&self, base: &Base, dir: &OwnedFd, rel: &Path, depth: usize, out: &mut Walked) {
        let Ok(rd) = store::entries(dir) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name();
            if depth == 0 && (self.skip_top)(&name) {
                continue;
            }
            let rel = rel.join(&name);
            let Ok(t) = e.file_type() else {
                continue;
            };
            if t.is_symlink() {
                if self.warn {
                    log::warn!("result upload: skipping symlink {} (only regular files inside the results folder are uploaded)", base.shown(&rel));
                }
            } else if t.is_dir() {
                if depth >= store::MAX_DEPTH {
                    if self.warn {
                        log::warn!(
                            "result upload: not entering {} (more than {} folders deep)",
                            base.shown(&rel),
                            store::MAX_DEPTH
                        );
                    }
                } else if let Ok(sub) = store::open_dir_at(Some(dir), &name) {
                    self.walk(base, &sub, &rel, depth.saturating_add(1), out);
                }
            } else if t.is_file() {
                if out.files.len() >= self.limit {
                    out.complete = false;
                    return;
                }
                // Its metadata through the folder it is listed in, never through a path.
                if let Ok(md) = e.metadata() {
                    let file =
                        Beneath::new(base.folder, base.start.join(&rel)).listed_as(Listed::of(&md));
                    out.files.push((rel.to_string_lossy().into_owned(), file));
                }
            }
        }
    }
}

/// The folder a walk started from, for the files' paths and messages.
struct Base<'a> {
    folder: &'a Path,
    start: &'a Path,
}

impl Base<'_> {
    fn shown(&self, rel: &Path) -> String {
        let path = self.folder.join(self.start).join(rel);
        crate::logtext::shown(&path.display().to_string()).to_string()
    }
}

/// The identities of the files below `folder` now (for a workload's record of what was there
/// before it started), and whether that is all of them.
pub fn snapshot(folder: &Path) -> (BTreeSet<Identity>, bool) {
    let walked = Walk {
        skip_top: &|_| false,
        limit: MAX_FILES,
        warn: false,
    }
    .run(folder, Path::new(""));
    let ids = walked
        .files
        .iter()
        .filter_map(|(_, b)| b.listed().map(Identity::of))
        .collect();
    (ids, walked.complete)
}

/// What the node records of a workload's results when it starts (`results.json` in its
/// directory in the state dir, the node's own file): what it may be recognised by, which files
/// were in `results_folder` before it, and whether its own folder was made for it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Claim {
    /// Its own folder `<results_folder>/<safe id>/` was made for it, empty (not found there).
    pub made: bool,
    /// Its workload uuid, request id and string params of at least [`MIN_NAME`] characters.
    pub names: Vec<String>,
    /// `before` holds every file that was there (at most [`MAX_FILES`]).
    pub complete: bool,
    /// The files in `results_folder` before it started, sorted.
    pub before: Vec<Identity>,
}

impl store::Validate for Claim {
    fn validate(&self) -> Result<(), store::Invalid> {
        for n in &self.names {
            store::check_text("names", n, MAX_NAME)?;
        }
        Ok(())
    }
}

impl Claim {
    /// Whether the file `id` was written after the workload started: not among the files there
    /// before (never, when that record is incomplete).
    pub fn is_new(&self, id: Identity) -> bool {
        self.complete && self.before.binary_search(&id).is_err()
    }

    /// The record of the workload whose directory in the state dir is `dir`; `None` for one
    /// started before the node kept it, or one whose record cannot be read.
    pub fn load(dir: &Path) -> Option<Claim> {
        // A sorted list of MAX_FILES identities, and the names.
        const CAP: u64 = 4 * 1024 * 1024;
        store::read_record(&dir.join(CLAIM_FILE), CAP).ok()
    }

    pub fn save(&self, dir: &Path) -> std::io::Result<()> {
        let json = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        store::write_replace_unsynced(&dir.join(CLAIM_FILE), &json, 0o600)
    }
}

/// The names a workload's loose results may be recognised by: its workload uuid, its request
/// id, and its params that are strings, each of at least [`MIN_NAME`] characters (its secret
/// token excepted).
pub fn names_of(
    workload_uuid: Option<&str>,
    request_id: &str,
    params: &serde_json::Map<String, serde_json::Value>,
) -> Vec<String> {
    let strings = params
        .iter()
        .filter(|(k, _)| k.as_str() != "cyberwave_workload_token")
        .filter_map(|(_, v)| v.as_str());
    let mut names: Vec<String> = workload_uuid
        .into_iter()
        .chain(std::iter::once(request_id))
        .chain(strings)
        .filter(|n| n.chars().count() >= MIN_NAME && n.len() <= MAX_NAME && !n.contains('\0'))
        .map(String::from)
        .collect();
    names.sort();
    names.dedup();
    names.truncate(MAX_NAMES);
    names
}

/// Makes the workload's own results folder `<folder>/<safe_id>/` (D24): new and empty, from a
/// descriptor of `folder`, and hands it to the workload user on its descriptor (D65). A link,
/// or any entry already there under that name (a folder a workload prepared, a link to `/etc`)
/// is refused, never followed, changed or handed over.
pub fn make_dir(
    folder: &Path,
    safe_id: &str,
    user: Option<&WorkloadUser>,
) -> std::io::Result<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    // `folder` itself is the operator's: made if missing, opened without following a link
    // another user could have put in its place.
    std::fs::create_dir_all(folder)?;
    let top = store::open_root(folder)?;
    let name = std::ffi::CString::new(safe_id.as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL in the name"))?;
    let mode = if user.is_some() { 0o700 } else { 0o777 };
    // SAFETY: mkdirat relative to a directory descriptor we own, a NUL-terminated name.
    if unsafe { libc::mkdirat(top.as_raw_fd(), name.as_ptr(), mode) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EEXIST) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "something of that name is there already (it is neither used nor changed)",
            ));
        }
        return Err(e);
    }
    let dir = store::open_dir_at(Some(&top), OsStr::from_bytes(safe_id.as_bytes()))?;
    // The folder just made, not another one renamed into its place meanwhile: that would be
    // another user's (one of the node's own is never handed over twice, see below).
    let md = std::fs::File::from(dir.try_clone()?).metadata()?;
    let me = crate::util::euid();
    if std::os::unix::fs::MetadataExt::uid(&md) != me {
        return Err(std::io::Error::other(
            "the folder was replaced by another user's as it was made",
        ));
    }
    if let Some(u) = user {
        super::user::hand_over_fd(&dir, u, true)?;
    }
    Ok(folder.join(safe_id))
}

/// A running workload, as [`attribute`] sees it.
pub struct Runner<'a> {
    pub id: &'a str,
    /// The uid it runs as (with `workload_user`).
    pub uid: Option<u32>,
    pub claim: &'a Claim,
}

/// A loose file, as [`attribute`] sees it.
pub struct Loose<'a> {
    /// Its path below `results_folder`.
    pub name: &'a str,
    pub listed: &'a Listed,
}

/// To whom a loose file goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The workload of this safe id.
    To(String),
    /// Several could have written it: it stays on disk, and each of these hears of it.
    Unattributed(Vec<String>),
    /// No running workload could have written it (it was there before each of them, or it is
    /// not any of theirs).
    Nobody,
}

/// D61: whose the loose file `f` is, among the workloads `running` (each from its start to the
/// end of its run, the file being seen now). A workload is a candidate only where the file is
/// new to it (not there when it started, by identity) and, with `checked` (a `workload_user`),
/// owned by its uid with a single link. Then, in order: (1) the one candidate whose name (its
/// workload uuid, request id, or a string param of at least [`MIN_NAME`] characters) is in the
/// file's name and is no other running workload's; (2) else the only candidate; (3) else none
/// of them.
pub fn attribute(f: &Loose, running: &[Runner], checked: bool) -> Verdict {
    let id = Identity::of(f.listed);
    let candidates: Vec<&Runner> = running
        .iter()
        .filter(|r| r.claim.is_new(id))
        .filter(|r| !checked || (r.uid == Some(f.listed.uid) && f.listed.nlink == 1))
        .collect();
    let named: Vec<&&Runner> = candidates
        .iter()
        .filter(|r| {
            r.claim.names.iter().any(|n| {
                f.name.contains(n.as_str())
                    && !running
                        .iter()
                        .any(|o| o.id != r.id && o.claim.names.contains(n))
            })
        })
        .collect();
    if let [one] = named.as_slice() {
        return Verdict::To(one.id.to_string());
    }
    match candidates.as_slice() {
        [] => Verdict::Nobody,
        [one] => Verdict::To(one.id.to_string()),
        _ => Verdict::Unattributed(candidates.iter().map(|r| r.id.to_string()).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(ino: u64, uid: u32, nlink: u64) -> Listed {
        Listed {
            dev: 1,
            ino,
            born: 7,
            uid,
            nlink,
            size: 1,
        }
    }

    fn claim(names: &[&str], before: &[u64]) -> Claim {
        let mut before: Vec<Identity> = before.iter().map(|i| Identity(1, *i, 7)).collect();
        before.sort();
        Claim {
            made: true,
            names: names.iter().map(|s| s.to_string()).collect(),
            complete: true,
            before,
        }
    }

    fn verdict(name: &str, l: &Listed, running: &[(&str, u32, &Claim)], checked: bool) -> Verdict {
        let runners: Vec<Runner> = running
            .iter()
            .map(|(id, uid, c)| Runner {
                id,
                uid: Some(*uid),
                claim: c,
            })
            .collect();
        attribute(&Loose { name, listed: l }, &runners, checked)
    }

    fn to(id: &str) -> Verdict {
        Verdict::To(id.into())
    }

    /// D61 (1): by name — the trainer's `<training uuid>.tar.gz` goes to the workload whose
    /// param that uuid is, while another runs beside it; a name two workloads share decides
    /// nothing, and a short one (`r1`) never does.
    #[test]
    fn d61_a_loose_file_goes_to_the_one_workload_whose_name_it_bears() {
        let a = claim(&["0f8e2c1a-training-uuid", "wl-aaaaaaaa"], &[]);
        let b = claim(&["wl-bbbbbbbb"], &[]);
        let f = listed(10, 1000, 1);
        let both = [("a", 1000, &a), ("b", 1000, &b)];
        assert_eq!(
            verdict("0f8e2c1a-training-uuid.tar.gz", &f, &both, true),
            to("a")
        );
        assert_eq!(verdict("out-wl-bbbbbbbb.bin", &f, &both, true), to("b"));
        // A name both bear is not the file's proof.
        let shared = claim(&["0f8e2c1a-training-uuid", "wl-cccccccc"], &[]);
        let with_shared = [("a", 1000, &a), ("c", 1000, &shared)];
        assert_eq!(
            verdict("0f8e2c1a-training-uuid.tar.gz", &f, &with_shared, true),
            Verdict::Unattributed(vec!["a".into(), "c".into()])
        );
        // Both names in it: neither.
        assert_eq!(
            verdict("wl-aaaaaaaa+wl-bbbbbbbb", &f, &both, true),
            Verdict::Unattributed(vec!["a".into(), "b".into()])
        );
        // Short names are not kept.
        let params = serde_json::json!({"epochs": "10", "run": "run-name-long", "t": 5, "cyberwave_workload_token": "secret-token-123"});
        assert_eq!(
            names_of(Some("wl-uuid-0001"), "r1", params.as_object().unwrap()),
            ["run-name-long", "wl-uuid-0001"]
        );
    }

    /// D61 (2) and (3): by time, else none — and "there before" is by identity: a file that
    /// was there when a workload started (renamed since, its times changed, the clock stepped)
    /// is never its result.
    #[test]
    fn d61_a_loose_file_goes_to_the_only_workload_it_is_new_to_else_to_none() {
        let old = listed(10, 1000, 1);
        let new = listed(11, 1000, 1);
        let a = claim(&[], &[]);
        let b = claim(&[], &[10]);
        let running = [("a", 1000, &a), ("b", 1000, &b)];
        // `old` was there when b started: only a could have written it.
        assert_eq!(verdict("renamed.bin", &old, &running, true), to("a"));
        assert_eq!(
            verdict("x.bin", &new, &running, true),
            Verdict::Unattributed(vec!["a".into(), "b".into()])
        );
        // There before both: nobody's.
        let c = claim(&[], &[10]);
        assert_eq!(
            verdict(
                "renamed.bin",
                &old,
                &[("b", 1000, &b), ("c", 1000, &c)],
                true
            ),
            Verdict::Nobody
        );
        // Same device and inode, another birth: a new file in a freed inode.
        let reborn = Listed { born: 8, ..old };
        assert_eq!(verdict("x", &reborn, &[("b", 1000, &b)], true), to("b"));
        // A record that could not hold every file: nothing is new to it.
        let partial = Claim {
            complete: false,
            ..claim(&[], &[])
        };
        assert_eq!(
            verdict("x", &new, &[("p", 1000, &partial)], true),
            Verdict::Nobody
        );
    }

    /// D65: with a workload user a loose file is a candidate's only when its uid owns it with
    /// one link: an operator's file renamed in, or a hard link to it, is nobody's; in a pool the
    /// owner tells the workloads apart.
    #[test]
    fn d65_a_loose_file_is_only_a_workload_users_own_with_one_link() {
        let a = claim(&[], &[]);
        let b = claim(&[], &[]);
        let running = [("a", 1001, &a), ("b", 1002, &b)];
        assert_eq!(
            verdict("x", &listed(1, 0, 1), &running, true),
            Verdict::Nobody
        );
        assert_eq!(
            verdict("x", &listed(1, 1001, 2), &running, true),
            Verdict::Nobody
        );
        assert_eq!(verdict("x", &listed(1, 1002, 1), &running, true), to("b"));
        // Without a workload user the owner is not asked.
        assert_eq!(
            verdict("x", &listed(1, 0, 1), &[("a", 0, &a)], false),
            to("a")
        );
    }

    /// D65: the results folder of a workload is made new: anything there under its name (a
    /// link, a folder, a file) is refused and left as it was; the folder made is empty.
    #[test]
    fn d65_a_results_folder_is_made_new_and_nothing_there_is_used() {
        use std::os::unix::fs::PermissionsExt;
        let s = crate::scratch::Scratch::new("makedir");
        let folder = s.path().join("out");
        let outside = s.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(make_dir(&folder, "w", None).unwrap(), folder.join("w"));
        assert!(folder.join("w").is_dir());
        std::os::unix::fs::symlink(&outside, folder.join("link")).unwrap();
        std::fs::create_dir(folder.join("there")).unwrap();
        std::fs::write(folder.join("file"), "x").unwrap();
        for name in ["w", "link", "there", "file"] {
            let e = make_dir(&folder, name, None).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists, "{name}");
        }
        let mode = std::fs::metadata(&outside).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o755);
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
    }

    /// D65: `results_folder` itself as a link: followed only where nobody but root or the
    /// node's user can have put it (owned by one of them, in a folder only they can write);
    /// a link in a folder others can write is not, and a walk of it finds nothing (and does
    /// not claim to have seen everything).
    #[test]
    fn d65_a_results_folder_link_is_followed_only_where_no_other_user_can_have_made_it() {
        use std::os::unix::fs::PermissionsExt;
        let s = crate::scratch::Scratch::new("openroot");
        let real = s.path().join("real");
        std::fs::create_dir(&real).unwrap();
        std::fs::write(real.join("a.bin"), "a").unwrap();
        let safe = s.path().join("safe");
        std::fs::create_dir(&safe).unwrap();
        std::fs::set_permissions(&safe, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::symlink(&real, safe.join("out")).unwrap();
        let open = Walk {
            skip_top: &|_| false,
            limit: 10,
            warn: false,
        };
        let walked = open.run(&safe.join("out"), Path::new(""));
        assert_eq!(walked.files.len(), 1);
        // The same link in a folder every user can write.
        std::fs::set_permissions(&safe, std::fs::Permissions::from_mode(0o777)).unwrap();
        let walked = open.run(&safe.join("out"), Path::new(""));
        assert!(walked.files.is_empty() && !walked.complete);
        assert!(make_dir(&safe.join("out"), "w", None).is_err());
        assert!(!real.join("w").exists());
        // A folder that is not there yet holds nothing, for sure.
        let walked = open.run(&s.path().join("missing"), Path::new(""));
        assert!(walked.files.is_empty() && walked.complete);
    }
}
