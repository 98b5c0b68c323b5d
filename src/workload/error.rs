//! Why a workload did not start: one value per cause, each shown as the text the start's
//! failure reports.

use std::fmt;
use std::io;
use std::path::PathBuf;

use super::user::UserError;

#[derive(Debug)]
pub enum SpawnError {
    /// The workload user could not be looked up (D46.3).
    User(UserError),
    /// A folder of the start could not be created.
    CreateDir { path: PathBuf, source: io::Error },
    /// A folder could not be opened to the workload user.
    OpenToUser { path: PathBuf, source: io::Error },
    /// A file of the start could not be handed to the workload user.
    HandOver {
        path: PathBuf,
        user: String,
        source: io::Error,
    },
    /// A module command names a file that is not in the working directory.
    ModuleNotFound { value: String, kind: String },
    /// A file of the start could not be written (`what`: "the params file", …).
    Write {
        what: &'static str,
        source: io::Error,
    },
    /// The params or the record could not be encoded.
    Encode(serde_json::Error),
    /// The supervisor's own log could not be created.
    ShimLog(io::Error),
    /// The supervisor could not be started.
    Fork { exe: PathBuf, source: io::Error },
    /// The supervisor reported why it could not start the workload.
    Shim(String),
    /// The supervisor said nothing in time (it was stopped).
    NoPid,
    /// The start panicked (caught by the spawner).
    Internal,
}

impl fmt::Display for SpawnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpawnError::User(e) => write!(f, "{e}"),
            SpawnError::CreateDir { path, source } => {
                write!(f, "cannot create {}: {source}", path.display())
            }
            SpawnError::OpenToUser { path, source } => write!(
                f,
                "cannot open {} to the workload user: {source}",
                path.display()
            ),
            SpawnError::HandOver { path, user, source } => write!(
                f,
                "cannot hand {} to workload_user {user}: {source}",
                path.display()
            ),
            SpawnError::ModuleNotFound { value, kind } => write!(
                f,
                "Module not found: {value}. Check '{kind}: {value}' in cyberwave.yml."
            ),
            SpawnError::Write { what, source } => write!(f, "cannot write {what}: {source}"),
            SpawnError::Encode(e) => write!(f, "{e}"),
            SpawnError::ShimLog(e) => write!(f, "cannot create the shim log: {e}"),
            SpawnError::Fork { exe, source } => write!(
                f,
                "cannot start the workload supervisor {}: {source}",
                exe.display()
            ),
            SpawnError::Shim(why) => f.write_str(why),
            SpawnError::NoPid => f.write_str("the workload supervisor did not report a pid"),
            SpawnError::Internal => f.write_str("internal error while starting the workload"),
        }
    }
}

impl SpawnError {
    /// The start failed because the disk it writes to is full, of bytes or of inodes (ENOSPC),
    /// or the user's quota is (EDQUOT): a "not now" refusal, not a permanent failure. The
    /// supervisor reports its own errors as text, an I/O error's ending in `(os error N)`.
    pub fn disk_full(&self) -> bool {
        let full = |e: &io::Error| matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT));
        match self {
            SpawnError::CreateDir { source, .. }
            | SpawnError::OpenToUser { source, .. }
            | SpawnError::HandOver { source, .. }
            | SpawnError::Write { source, .. }
            | SpawnError::Fork { source, .. } => full(source),
            SpawnError::ShimLog(e) => full(e),
            SpawnError::Shim(why) => [libc::ENOSPC, libc::EDQUOT]
                .iter()
                .any(|n| why.contains(&format!("(os error {n})"))),
            SpawnError::User(_)
            | SpawnError::Encode(_)
            | SpawnError::ModuleNotFound { .. }
            | SpawnError::NoPid
            | SpawnError::Internal => false,
        }
    }
}

impl std::error::Error for SpawnError {}

impl From<UserError> for SpawnError {
    fn from(e: UserError) -> SpawnError {
        SpawnError::User(e)
    }
}

impl From<serde_json::Error> for SpawnError {
    fn from(e: serde_json::Error) -> SpawnError {
        SpawnError::Encode(e)
    }
}
