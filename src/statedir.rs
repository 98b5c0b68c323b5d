//! One node per state dir, and the state dir belongs to the node's user (decision D30).
//!
//! The dir holds the API key's derivatives, the workload records and the outbox; a node that
//! followed links planted by another user, or two nodes sharing one dir, could write outside
//! it or report a workload twice. So, before anything is written there:
//! - the dir must be owned by the node's effective user and not writable by group or others
//!   (as sshd's StrictModes checks `~/.ssh`); otherwise the node exits 2 naming the path and
//!   the fix — it never changes the mode of a folder that is not its own;
//! - the node holds an exclusive `flock` on `<dir>/lock` for its lifetime; a second node on the
//!   same dir exits 1 naming the pid that holds it. The lock file is opened close-on-exec, so
//!   workloads (which outlive the node) never inherit it.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

#[derive(Debug)]
pub enum StateDirError {
    /// The dir (or its lock file) is owned by another user.
    NotOwned {
        path: PathBuf,
        owner: u32,
        me: u32,
    },
    /// Group or others may write into it.
    Loose {
        path: PathBuf,
        mode: u32,
    },
    /// Its owner (the node's user) may not write into it.
    NotWritable {
        path: PathBuf,
        mode: u32,
    },
    /// Not a directory (or the lock file is not a regular file).
    NotADir(PathBuf),
    /// Another node holds the lock.
    Locked {
        path: PathBuf,
        holder: Option<u32>,
    },
    Io {
        path: PathBuf,
        err: std::io::Error,
    },
}

impl StateDirError {
    /// 1 for a lock held by another node, 2 for a state dir the operator must fix.
    pub fn exit_code(&self) -> i32 {
        match self {
            StateDirError::Locked { .. } | StateDirError::Io { .. } => 1,
            _ => 2,
        }
    }
}

impl From<StateDirError> for crate::error::StartupError {
    fn from(e: StateDirError) -> Self {
        if e.exit_code() == 2 {
            crate::error::StartupError::Config(e.to_string())
        } else {
            crate::error::StartupError::Runtime(e.to_string())
        }
    }
}

impl fmt::Display for StateDirError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StateDirError::NotOwned { path, owner, me } => write!(
                f,
                "the state dir {} is owned by uid {owner}, not by this node's user (uid {me}); run the node as that user, or give it its own dir (CYBERWAVE_EDGE_CONFIG_DIR), or `chown -R {me} {}`",
                path.display(),
                path.display()
            ),
            StateDirError::Loose { path, mode } => write!(
                f,
                "the state dir {} is writable by group or others (mode {mode:03o}); fix it with `chmod 700 {}`",
                path.display(),
                path.display()
            ),
            StateDirError::NotWritable { path, mode } => write!(
                f,
                "the state dir {} is not writable by this node's user (mode {mode:03o}); fix it with `chmod 700 {}`",
                path.display(),
                path.display()
            ),
            StateDirError::NotADir(path) => {
                write!(f, "{} is not a directory (or not a regular lock file)", path.display())
            }
            StateDirError::Locked { path, holder } => match holder {
                Some(pid) => write!(
                    f,
                    "another node (pid {pid}) is running on the state dir {}; stop it first, or give this one its own dir (CYBERWAVE_EDGE_CONFIG_DIR)",
                    path.display()
                ),
                None => write!(
                    f,
                    "another node is running on the state dir {}; stop it first, or give this one its own dir (CYBERWAVE_EDGE_CONFIG_DIR)",
                    path.display()
                ),
            },
            StateDirError::Io { path, err } => write!(f, "{}: {err}", path.display()),
        }
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StateDirError + '_ {
    move |err| StateDirError::Io {
        path: path.to_path_buf(),
        err,
    }
}

/// Checks an existing state dir, or creates a new one 0700. Never changes the mode or owner of
/// a dir that exists.
pub fn check_or_create(dir: &Path) -> Result<(), StateDirError> {
    match fs::metadata(dir) {
        Ok(m) => check(dir, &m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            fs::create_dir_all(dir).map_err(io(dir))?;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io(dir))
        }
        Err(e) => Err(io(dir)(e)),
    }
}

fn check(path: &Path, m: &fs::Metadata) -> Result<(), StateDirError> {
    if !m.is_dir() {
        return Err(StateDirError::NotADir(path.to_path_buf()));
    }
    let me = crate::util::euid();
    if m.uid() != me {
        return Err(StateDirError::NotOwned {
            path: path.to_path_buf(),
            owner: m.uid(),
            me,
        });
    }
    let mode = m.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(StateDirError::Loose {
            path: path.to_path_buf(),
            mode,
        });
    }
    // Root writes into it whatever its mode says.
    if me != 0 && mode & 0o300 != 0o300 {
        return Err(StateDirError::NotWritable {
            path: path.to_path_buf(),
            mode,
        });
    }
    Ok(())
}

/// The node's exclusive hold on its state dir, released when dropped (or when the process
/// ends, however it ends).
#[derive(Debug)]
pub struct Lock {
    _file: File,
}

/// Takes the lock on `<dir>/lock` without waiting; writes this process's pid into it.
pub fn lock(dir: &Path) -> Result<Lock, StateDirError> {
    let path = dir.join("lock");
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        // A planted symlink is not followed.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| {
            if matches!(
                e.raw_os_error(),
                Some(libc::ELOOP | libc::EISDIR | libc::ENXIO)
            ) {
                StateDirError::NotADir(path.clone())
            } else {
                io(&path)(e)
            }
        })?;
    let m = file.metadata().map_err(io(&path))?;
    if !m.is_file() {
        return Err(StateDirError::NotADir(path));
    }
    if m.uid() != crate::util::euid() {
        return Err(StateDirError::NotOwned {
            path,
            owner: m.uid(),
            me: crate::util::euid(),
        });
    }
    // SAFETY: a valid open descriptor; LOCK_NB never blocks.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut text = String::new();
            let _ = file.take(32).read_to_string(&mut text);
            return Err(StateDirError::Locked {
                path: dir.to_path_buf(),
                holder: text.trim().parse().ok(),
            });
        }
        return Err(io(&path)(err));
    }
    let pid = std::process::id().to_string();
    let written = file
        .set_len(0)
        .and_then(|()| file.seek(SeekFrom::Start(0)))
        .and_then(|_| file.write_all(pid.as_bytes()));
    if let Err(e) = written {
        // The lock is held all the same; the pid only helps the message of a second node.
        log::warn!("cannot record the pid in {}: {e}", path.display());
    }
    Ok(Lock { _file: file })
}

/// [`lock`], waiting up to `wait` while another node holds it (D43: `cyberwave compute restart`
/// sends the old node SIGTERM and starts the new one at once, before the old one has exited).
pub fn lock_waiting(dir: &Path, wait: std::time::Duration) -> Result<Lock, StateDirError> {
    let deadline = std::time::Instant::now().checked_add(wait);
    let mut said = false;
    loop {
        match lock(dir) {
            Err(StateDirError::Locked { holder, .. })
                if deadline.is_some_and(|d| std::time::Instant::now() < d) =>
            {
                if !said {
                    said = true;
                    log::info!(
                        "another node ({}) holds the state dir {}; waiting up to {:.0} s for it to stop",
                        holder.map_or_else(|| "pid unknown".into(), |p| format!("pid {p}")),
                        dir.display(),
                        wait.as_secs_f64()
                    );
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cw-statedir-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_new_dir_is_created_private_and_an_existing_one_is_never_chmodded() {
        let d = temp("new");
        check_or_create(&d).unwrap();
        assert_eq!(fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        fs::set_permissions(&d, fs::Permissions::from_mode(0o777)).unwrap();
        let e = check_or_create(&d).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("chmod 700"), "{e}");
        assert_eq!(
            fs::metadata(&d).unwrap().mode() & 0o777,
            0o777,
            "left as it was"
        );
        fs::set_permissions(&d, fs::Permissions::from_mode(0o750)).unwrap();
        check_or_create(&d).unwrap();
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_file_is_not_a_state_dir() {
        let d = temp("file");
        fs::write(&d, b"x").unwrap();
        assert!(matches!(
            check_or_create(&d),
            Err(StateDirError::NotADir(_))
        ));
        let _ = fs::remove_file(&d);
    }

    #[test]
    fn the_lock_is_exclusive_and_names_its_holder() {
        let d = temp("lock");
        check_or_create(&d).unwrap();
        let held = lock(&d).unwrap();
        // flock locks belong to the open file description: a second open in the same
        // process conflicts just as another process would.
        match lock(&d) {
            Err(StateDirError::Locked { holder, .. }) => {
                assert_eq!(holder, Some(std::process::id()))
            }
            other => panic!("{other:?}"),
        }
        drop(held);
        let again = lock(&d).unwrap();
        drop(again);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_planted_lock_symlink_is_not_followed() {
        let d = temp("sym");
        check_or_create(&d).unwrap();
        let target = d.join("target");
        fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, d.join("lock")).unwrap();
        assert!(lock(&d).is_err());
        assert_eq!(fs::read(&target).unwrap(), b"keep");
        let _ = fs::remove_dir_all(&d);
    }
}
