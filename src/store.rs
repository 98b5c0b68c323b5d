//! The on-disk layout's primitives: atomic writes with fixed modes, and file names that a
//! hostile identifier can never turn into a path outside the state dir.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Writes `data` to `path` atomically: a temp file beside it (created with `mode`), fsync,
/// rename over the target, fsync of the directory. A crash leaves the old or the new file.
pub fn write_atomic(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    write_replace(path, data, mode, true)
}

/// Like [`write_atomic`] without the syncs: readers never see a partial file, but a host crash
/// may lose it (for files that are useless after a crash anyway, such as a params file).
pub fn write_replace_unsynced(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    write_replace(path, data, mode, false)
}

/// Writes `data` to a new file `path` (never an existing one, never through a link), unsynced
/// and without a temp file: for a file in a directory the caller itself just created, that no
/// one reads before this returns (a workload's params file). On error the file is gone.
pub fn write_new(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    let written = exact_mode(&f, mode).and_then(|()| f.write_all(data));
    if written.is_err() {
        let _ = fs::remove_file(path);
    }
    written
}

/// The umask may have narrowed a new file's `mode`; it must never widen it, but make it exact.
/// The node never changes its umask, so the one it started with tells whether there is
/// anything to do (one system call less per file a start writes).
fn exact_mode(f: &fs::File, mode: u32) -> io::Result<()> {
    static UMASK: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let umask = *UMASK.get_or_init(|| {
        let status = fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find_map(|l| l.strip_prefix("Umask:"))?;
        u32::from_str_radix(line.trim(), 8).ok()
    });
    if umask.is_some_and(|u| u & mode & 0o7777 == 0) {
        return Ok(());
    }
    f.set_permissions(fs::Permissions::from_mode(mode))
}

fn write_replace(path: &Path, data: &[u8], mode: u32, sync: bool) -> io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        crate::util::hex(&crate::util::random_bytes::<4>())
    ));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        exact_mode(&f, mode)?;
        f.write_all(data)?;
        if sync {
            slow_disk_pause();
            f.sync_all()?;
        }
        fs::rename(&tmp, path)?;
        if sync {
            if let Ok(d) = fs::File::open(dir) {
                slow_disk_pause();
                let _ = d.sync_all();
            }
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Removes folders on a thread of its own, so that the loop never waits behind a recursive
/// delete: a reported workload's directory, once renamed out of the way (the rename is what
/// counts; a deletion cut short by an exit is finished by the next start-up, which removes every
/// `.retired-*` folder). On a slow disk a workload's folder takes milliseconds to remove, and a
/// start right after a completion (a queue of jobs) waited for it. Where the thread cannot be
/// made, or is gone, the caller removes the folder itself.
pub struct Sweeper {
    tx: Option<crossbeam_channel::Sender<PathBuf>>,
}

impl Sweeper {
    pub fn start() -> Sweeper {
        let (tx, rx) = crossbeam_channel::unbounded::<PathBuf>();
        let thread = std::thread::Builder::new()
            .name("sweeper".into())
            .spawn(move || {
                for dir in rx {
                    remove_logged(&dir);
                }
            });
        match thread {
            Ok(_) => Sweeper { tx: Some(tx) },
            Err(e) => {
                log::warn!(
                    "cannot start the sweeper thread ({e}): folders are removed on the loop"
                );
                Sweeper { tx: None }
            }
        }
    }

    /// Removes `dir` and everything in it, on the sweeper's thread.
    pub fn sweep(&self, dir: PathBuf) {
        let left = match &self.tx {
            Some(tx) => tx.send(dir).err().map(|e| e.into_inner()),
            None => Some(dir),
        };
        if let Some(dir) = left {
            remove_logged(&dir);
        }
    }
}

fn remove_logged(dir: &Path) {
    if let Err(e) = fs::remove_dir_all(dir) {
        if e.kind() != io::ErrorKind::NotFound {
            log::warn!("cannot remove {}: {e}", shown(dir));
        }
    }
}

/// A slow disk, simulated for the start benchmark and the tests: with
/// `CYBERWAVE_TEST_SLOW_FSYNC_MS` set, every sync of the node's state first sleeps that long. Only
/// builds with the `test-hooks` feature honour it (what `cargo test` and `cargo bench` build, never
/// a release), and the node says so with a WARN at start ([`slow_disk_delay`]).
pub fn slow_disk_pause() {
    if let Some(d) = slow_disk_delay() {
        std::thread::sleep(d);
    }
}

/// The simulated slow disk's delay, when `CYBERWAVE_TEST_SLOW_FSYNC_MS` sets one (read once).
pub fn slow_disk_delay() -> Option<std::time::Duration> {
    static DELAY: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();
    if !cfg!(feature = "test-hooks") {
        return None;
    }
    *DELAY.get_or_init(|| {
        std::env::var("CYBERWAVE_TEST_SLOW_FSYNC_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|ms| *ms > 0)
            .map(std::time::Duration::from_millis)
    })
}

/// Creates `dir` (and parents) and makes it 0700: the state dir holds secrets.
pub fn ensure_private_dir(dir: &Path) -> io::Result<()> {
    // The common case, on every start: one stat, no write.
    if let Ok(m) = fs::metadata(dir) {
        if m.is_dir() && m.permissions().mode() & 0o7777 == 0o700 {
            return Ok(());
        }
    }
    fs::create_dir_all(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
}

/// Like [`ensure_private_dir`], but something else in the directory's place (a file, a
/// dangling link) is quarantined first: a corrupted state dir never stops the node.
pub fn ensure_dir_or_quarantine(dir: &Path) -> io::Result<()> {
    // Something is there (maybe a dangling link) but it is no directory, nor a link to one.
    if fs::symlink_metadata(dir).is_ok() && !dir.is_dir() {
        let _ = quarantine(dir, "expected a directory");
    }
    ensure_private_dir(dir)
}

/// Maps an identifier from the outside world to a file-name-safe id (decision D7): keeps
/// `[A-Za-z0-9._-]`, replaces anything else with `_`, at most 64 characters; an id that was
/// changed or cut (a leading `.` becomes `_`), or that is empty, gets `-<8 hex>` of a stable hash of the
/// original appended, so two different ids never share files.
pub fn safe_id(id: &str) -> String {
    let mut out: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    // No leading dot: no hidden files, no `.`/`..` lookalikes.
    let dots = out.chars().take_while(|c| *c == '.').count();
    out.replace_range(..dots, &"_".repeat(dots));
    // An id that already ends like a mapped one (`-` and 8 hex digits) is hashed too: kept as
    // it is, `x_y-c2cc6993` would share the files of `x/y`, which maps to exactly that.
    let looks_mapped = id
        .rsplit_once('-')
        .is_some_and(|(_, h)| h.len() == 8 && h.bytes().all(|b| b.is_ascii_hexdigit()));
    let changed = out != id || out.is_empty() || looks_mapped;
    if changed {
        out.truncate(55);
        out.push_str(&format!("-{:08x}", fnv1a32(id.as_bytes())));
    }
    out
}

// ---- reading state back: bounded, validated, quarantined -----------------------------------

/// Largest `meta.json`, `started.json`, `exit.json`, `cursor.json`, identity or node id read.
pub const MAX_RECORD_BYTES: u64 = 64 * 1024;
/// Largest outbox / ingress queue entry or `params.json` read (the payload limit, D32).
pub const MAX_ENTRY_BYTES: u64 = 4 * 1024 * 1024;
/// The folder below the state dir where refused files go.
pub const QUARANTINE_DIR: &str = "quarantine";

/// A persisted record that checks its own values after it was parsed: numbers finite and in
/// range, ids of the allowed shape. `Err` says which field and why.
pub trait Validate {
    fn validate(&self) -> Result<(), Invalid>;
}

/// Why a persisted record's value was refused: the field, and the rule it broke. Shown (in the
/// quarantine line and `doctor`) as one sentence naming both.
#[derive(Debug, Clone, PartialEq)]
pub enum Invalid {
    /// Not an id (D20): 1–256 printable ASCII characters without `+ # /`.
    Id { field: &'static str },
    /// Not a pid from 1 to 2^31-1.
    Pid { field: &'static str, got: i32 },
    /// Not a number of seconds from (or above) 0 to [`MAX_SECONDS`].
    Seconds {
        field: &'static str,
        got: f64,
        zero_ok: bool,
    },
    /// Not a Unix time from 0 to [`MAX_UNIX`].
    Unix { field: &'static str, got: f64 },
    /// A byte offset above `max`.
    Offsets { field: &'static str, max: u64 },
    /// Text longer than `max` bytes, or with control characters.
    Text { field: &'static str, max: usize },
    /// An integer outside `low..=high`.
    Range {
        field: &'static str,
        low: i64,
        high: i64,
        got: i64,
    },
    /// Any other rule: "`field` must `must`".
    Rule {
        field: &'static str,
        must: &'static str,
    },
    /// Not one of the allowed names (a workload kind).
    OneOf {
        field: &'static str,
        allowed: &'static [&'static str],
    },
    /// An outbox entry's topic is not a topic the node publishes to.
    Topic { max: usize },
    /// A log cursor's mark is not at one of the log's offsets.
    LogMark,
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Invalid::Id { field } => write!(
                f,
                "{field} must be 1-256 printable ASCII characters without + # / or whitespace"
            ),
            Invalid::Pid { field, got } => {
                write!(f, "{field} must be a pid from 1 to 2147483647, got {got}")
            }
            Invalid::Seconds {
                field,
                got,
                zero_ok,
            } => write!(
                f,
                "{field} must be a number of seconds {} 0 and at most {MAX_SECONDS}, got {got}",
                if *zero_ok { "from" } else { "above" }
            ),
            Invalid::Unix { field, got } => {
                write!(f, "{field} must be a Unix time from 0 to {MAX_UNIX}, got {got}")
            }
            Invalid::Offsets { field, max } => write!(f, "{field} must be at most {max}"),
            Invalid::Text { field, max } => write!(
                f,
                "{field} must be at most {max} bytes without control characters"
            ),
            Invalid::Range {
                field,
                low,
                high,
                got,
            } => write!(f, "{field} must be from {low} to {high}, got {got}"),
            Invalid::Rule { field, must } => write!(f, "{field} must {must}"),
            Invalid::OneOf { field, allowed } => {
                write!(f, "{field} must be one of {}", allowed.join(", "))
            }
            Invalid::Topic { max } => write!(
                f,
                "invalid topic: it must be 1-{max} printable ASCII characters without + or # and without empty levels"
            ),
            Invalid::LogMark => write!(f, "a log mark is not one of the log's offsets"),
        }
    }
}

/// Why a persisted file could not be used.
#[derive(Debug)]
pub enum StoreError {
    /// There is no such file (nothing to quarantine).
    Missing,
    /// The file exists but could not be read (permissions, I/O): left where it is.
    Io(io::Error),
    /// Larger than the cap for its kind.
    TooBig { size: u64, cap: u64 },
    /// Not a regular file (D48): a FIFO, socket, device, symlink or directory in its place.
    NotRegular(&'static str),
    /// Not valid JSON of the expected shape, or a value out of range.
    Invalid(String),
}

impl StoreError {
    /// Whether the file itself is bad (and should be quarantined), not merely absent or
    /// unreadable for now.
    pub fn is_bad_content(&self) -> bool {
        matches!(
            self,
            StoreError::TooBig { .. } | StoreError::Invalid(_) | StoreError::NotRegular(_)
        )
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Missing => write!(f, "missing"),
            StoreError::Io(e) => write!(f, "cannot be read: {e}"),
            StoreError::TooBig { size, cap } => {
                write!(f, "{size} bytes, more than the {cap} bytes allowed")
            }
            StoreError::Invalid(why) => write!(f, "{why}"),
            StoreError::NotRegular(what) => write!(f, "not a regular file ({what})"),
        }
    }
}

/// What a path holds when it is not a regular file (for [`StoreError::NotRegular`]).
fn kind_of(t: fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_symlink() {
        "a symlink"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else {
        "not a plain file"
    }
}

/// Opens a state file for reading (decision D48): never follows a symlink, never blocks (a
/// FIFO, socket or device in its place is refused, most without even being opened), and
/// checks with `fstat` on the open descriptor that it is a regular file. Returns the file and
/// its size. Every reader of a state file goes through here (or [`read_state_file`]).
pub fn open_state_file(path: &Path) -> Result<(fs::File, u64), StoreError> {
    // A look first, so that nothing but a regular file is ever opened (opening a device can
    // have effects); the `fstat` below decides, as the path may be swapped in between.
    match fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_file() => {
            return Err(StoreError::NotRegular(kind_of(m.file_type())))
        }
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(StoreError::Missing),
        Err(e) => return Err(StoreError::Io(e)),
    }
    let f = match OpenOptions::new()
        .read(true)
        // std adds O_CLOEXEC itself.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(StoreError::Missing),
        // Swapped for a symlink (ELOOP) or a socket (ENXIO) since the look above.
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(StoreError::NotRegular("a symlink"))
        }
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
            return Err(StoreError::NotRegular("a socket or device"))
        }
        Err(e) => return Err(StoreError::Io(e)),
    };
    let md = f.metadata().map_err(StoreError::Io)?;
    if !md.file_type().is_file() {
        return Err(StoreError::NotRegular(kind_of(md.file_type())));
    }
    Ok((f, md.len()))
}

/// How deep [`Beneath`] and the walks over a results folder go: a tree deeper than this is not
/// followed (a workload could make one deep enough to exhaust the stack or the descriptors).
pub const MAX_DEPTH: usize = 64;

/// A file named by a folder and its path below it, opened and removed without following a
/// symlink anywhere below that folder: each folder on the way is opened from the one above it
/// with `O_NOFOLLOW` (D24: a workload may swap any of its result folders for a link to the
/// node's state or `/etc` once they were listed, and the node, root with a `workload_user`,
/// would then upload and delete what the link points at).
///
/// A file found by a listing also carries what the listing saw ([`Listed`]): it is opened and
/// removed only while it is still that file, so a folder renamed away and back (a real folder,
/// not a link) cannot put another file in its place between the listing and the upload.
#[derive(Clone, Debug, PartialEq)]
pub struct Beneath {
    root: PathBuf,
    rel: PathBuf,
    listed: Option<Listed>,
    /// D65: opened and removed only while owned by this uid with a single link (a workload
    /// user's result: never a file of the node's or the operator's it renamed or linked in).
    owner: Option<u32>,
}

/// What a listing saw of a file, through the folder it was listed in: which file it is (device,
/// inode and birth time: its identity, which neither a rename nor a clock step changes), its
/// owner, its number of links and its size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Listed {
    pub dev: u64,
    pub ino: u64,
    /// Its birth time in nanoseconds since the epoch, 0 where the file system keeps none: an
    /// inode number freed and given to a new file does not make the new file the old one.
    pub born: u64,
    pub uid: u32,
    pub nlink: u64,
    pub size: u64,
}

impl Listed {
    pub fn of(md: &fs::Metadata) -> Listed {
        use std::os::unix::fs::MetadataExt;
        let born = md
            .created()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .and_then(|d| u64::try_from(d.as_nanos()).ok())
            .unwrap_or(0);
        Listed {
            dev: md.dev(),
            ino: md.ino(),
            born,
            uid: md.uid(),
            nlink: md.nlink(),
            size: md.len(),
        }
    }
}

impl Beneath {
    pub fn new(root: impl Into<PathBuf>, rel: impl Into<PathBuf>) -> Beneath {
        Beneath {
            root: root.into(),
            rel: rel.into(),
            listed: None,
            owner: None,
        }
    }

    /// The same, opened and removed only while owned by `uid` with a single link.
    pub fn owned_by(mut self, uid: Option<u32>) -> Beneath {
        self.owner = uid;
        self
    }

    /// Whether a file of owner `uid` (with a single link or not) may be opened or removed as
    /// this one.
    fn owner_ok(&self, uid: u32, single_link: bool) -> bool {
        self.owner.is_none_or(|o| o == uid && single_link)
    }

    /// The same, known as the file a listing saw.
    pub fn listed_as(mut self, listed: Listed) -> Beneath {
        self.listed = Some(listed);
        self
    }

    /// What the listing saw of it, when it was found by one.
    pub fn listed(&self) -> Option<&Listed> {
        self.listed.as_ref()
    }

    /// The root it is below and its path from there.
    pub fn rel(&self) -> &Path {
        &self.rel
    }

    /// Whether `(dev, ino)` is the file the listing saw (any file, when it was not listed).
    fn is_listed(&self, dev: u64, ino: u64) -> bool {
        self.listed.is_none_or(|l| l.dev == dev && l.ino == ino)
    }

    /// The whole path (for messages and metadata; never opened as such).
    pub fn path(&self) -> PathBuf {
        self.root.join(&self.rel)
    }

    /// The folder that holds the file, reached from `root` without a symlink, and the file's
    /// name in it.
    fn parent(&self) -> io::Result<(std::os::fd::OwnedFd, &std::ffi::OsStr)> {
        use std::path::Component;
        let not_below =
            || io::Error::new(io::ErrorKind::InvalidInput, "not a path below the folder");
        let mut parts = self.rel.components();
        let Some(Component::Normal(leaf)) = parts.next_back() else {
            return Err(not_below());
        };
        let mut dir = open_root(&self.root)?;
        for (depth, part) in parts.enumerate() {
            let Component::Normal(name) = part else {
                return Err(not_below());
            };
            if depth >= MAX_DEPTH {
                return Err(not_below());
            }
            dir = open_dir_at(Some(&dir), name)?;
        }
        Ok((dir, leaf))
    }

    /// Opens the file for reading as [`open_state_file`] does (a regular file only, never
    /// through a link, never blocking), with no link followed below `root` either.
    pub fn open(&self) -> Result<(fs::File, u64), StoreError> {
        use std::os::fd::{AsRawFd, FromRawFd};
        use std::os::unix::ffi::OsStrExt;
        let io_err = |e: io::Error| match e.raw_os_error() {
            Some(libc::ENOENT) => StoreError::Missing,
            // A folder on the way swapped for a link or a file.
            Some(libc::ELOOP | libc::ENOTDIR) => StoreError::NotRegular("behind a symlink"),
            _ => StoreError::Io(e),
        };
        let (dir, leaf) = self.parent().map_err(io_err)?;
        let name = std::ffi::CString::new(leaf.as_bytes())
            .map_err(|_| StoreError::NotRegular("not a plain file"))?;
        // A look first, so that nothing but a regular file is ever opened (opening a device can
        // have effects); the `fstat` below decides, as it may be swapped in between.
        let st = stat_at(&dir, &name).map_err(io_err)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(StoreError::NotRegular(
                if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
                    "a symlink"
                } else {
                    "not a plain file"
                },
            ));
        }
        if !self.is_listed(st.st_dev, st.st_ino) {
            return Err(StoreError::NotRegular("another file than the one listed"));
        }
        if !self.owner_ok(st.st_uid, st.st_nlink == 1) {
            return Err(StoreError::NotRegular(NOT_ITS_OWN));
        }
        // SAFETY: openat relative to a directory descriptor we own, with a NUL-terminated name.
        let fd = unsafe {
            libc::openat(
                dir.as_raw_fd(),
                name.as_ptr(),
                libc::O_RDONLY
                    | libc::O_NOFOLLOW
                    | libc::O_NONBLOCK
                    | libc::O_NOCTTY
                    | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                // Swapped for a symlink (ELOOP) or a socket (ENXIO) since the look above.
                Some(libc::ELOOP) => StoreError::NotRegular("a symlink"),
                Some(libc::ENXIO) => StoreError::NotRegular("a socket or device"),
                _ => io_err(e),
            });
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let f = unsafe { fs::File::from_raw_fd(fd) };
        let md = f.metadata().map_err(StoreError::Io)?;
        if !md.file_type().is_file() {
            return Err(StoreError::NotRegular(kind_of(md.file_type())));
        }
        if !self.is_listed(
            std::os::unix::fs::MetadataExt::dev(&md),
            std::os::unix::fs::MetadataExt::ino(&md),
        ) {
            return Err(StoreError::NotRegular("another file than the one listed"));
        }
        if !self.owner_ok(
            std::os::unix::fs::MetadataExt::uid(&md),
            std::os::unix::fs::MetadataExt::nlink(&md) == 1,
        ) {
            return Err(StoreError::NotRegular(NOT_ITS_OWN));
        }
        Ok((f, md.len()))
    }

    /// Removes the file (never what a link on the way points at, nor another file than the
    /// one listed).
    pub fn remove(&self) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        use std::os::unix::ffi::OsStrExt;
        let (dir, leaf) = self.parent()?;
        let name = std::ffi::CString::new(leaf.as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the name"))?;
        let st = stat_at(&dir, &name)?;
        if !self.is_listed(st.st_dev, st.st_ino) {
            return Err(io::Error::other("another file than the one listed"));
        }
        if !self.owner_ok(st.st_uid, st.st_nlink == 1) {
            return Err(io::Error::other(NOT_ITS_OWN));
        }
        // SAFETY: unlinkat relative to a directory descriptor we own, a NUL-terminated name.
        if unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

/// What `name` in the folder open as `dir` is (`fstatat` with `AT_SYMLINK_NOFOLLOW`: a link in
/// its place is described, not followed).
fn stat_at(dir: &std::os::fd::OwnedFd, name: &std::ffi::CStr) -> io::Result<libc::stat> {
    use std::os::fd::AsRawFd;
    // SAFETY: `stat` is a C struct of integers, for which all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstatat on a directory descriptor we own, a NUL-terminated name and a stat buffer
    // of the right type.
    let rc = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc == 0 {
        Ok(st)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Why a file is not opened or removed as a workload's result (D65).
const NOT_ITS_OWN: &str = "not the workload user's own file with a single link";

/// Opens the folder at `path` as the root of a walk (a results folder): a symlink in its place
/// is followed only where nobody but root or the node's user can have put it there, that is
/// where it is owned by one of them in a folder only they can write (an operator's link to
/// another disk); a link another user could have planted (a workload that can write the folder
/// above) is not followed. The folders above `path` are the operator's and are trusted.
pub fn open_root(path: &Path) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::unix::fs::MetadataExt;
    // A link in its place: ELOOP, or ENOTDIR with O_DIRECTORY.
    let refused = match open_dir_at(None, path.as_os_str()) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => e,
        other => return other,
    };
    let link = fs::symlink_metadata(path)?;
    if !link.file_type().is_symlink() {
        return Err(refused);
    }
    let me = crate::util::euid();
    let trusted = |uid: u32| uid == 0 || uid == me;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let above = fs::metadata(parent)?;
    if !(trusted(link.uid()) && trusted(above.uid()) && above.mode() & 0o022 == 0) {
        return Err(io::Error::other(
            "a symlink that a user other than root and the node's could have put there",
        ));
    }
    // Nobody else can swap the link: follow it, to a folder.
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(path)?;
    Ok(std::os::fd::OwnedFd::from(dir))
}

/// Opens the folder `name` (relative to `at`, or to the working directory) without following a
/// symlink in its place.
pub fn open_dir_at(
    at: Option<&std::os::fd::OwnedFd>,
    name: &std::ffi::OsStr,
) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::os::unix::ffi::OsStrExt;
    let name = std::ffi::CString::new(name.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the name"))?;
    let at = at.map_or(libc::AT_FDCWD, AsRawFd::as_raw_fd);
    // SAFETY: openat with a valid directory descriptor (or AT_FDCWD) and a NUL-terminated name.
    let fd = unsafe {
        libc::openat(
            at,
            name.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// The entries of the folder open as `dir` (through `/proc/self/fd`, which names that very
/// folder, whatever was moved or linked in its path since).
pub fn entries(dir: &std::os::fd::OwnedFd) -> io::Result<fs::ReadDir> {
    use std::os::fd::AsRawFd;
    fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd()))
}

/// Removes the empty folder `name` in the folder open as `dir` (a link in its place is not
/// followed; a folder that still holds anything stays).
pub fn remove_dir_at(dir: &std::os::fd::OwnedFd, name: &std::ffi::OsStr) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::ffi::OsStrExt;
    let name = std::ffi::CString::new(name.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the name"))?;
    // SAFETY: unlinkat relative to a directory descriptor we own, a NUL-terminated name.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), libc::AT_REMOVEDIR) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reads a whole state file of at most `cap` bytes, opened by [`open_state_file`] (only a
/// regular file is read; a larger one is refused and never read into memory).
pub fn read_state_file(path: &Path, cap: u64) -> Result<Vec<u8>, StoreError> {
    use std::io::Read;
    let (f, size) = open_state_file(path)?;
    if size > cap {
        return Err(StoreError::TooBig { size, cap });
    }
    let mut buf = Vec::new();
    // The file may grow between the size check and the read: never read past the cap.
    f.take(cap.saturating_add(1))
        .read_to_end(&mut buf)
        .map_err(StoreError::Io)?;
    let len = u64::try_from(buf.len()).unwrap_or(u64::MAX);
    if len > cap {
        return Err(StoreError::TooBig { size: len, cap });
    }
    Ok(buf)
}

/// Creates (or truncates) a state file for writing with `mode`, with the guards of
/// [`open_state_file`]: a symlink is not followed, and a FIFO or anything else that is not a
/// regular file in its place is refused without blocking (for logs the node writes as it goes,
/// which [`write_atomic`] cannot replace).
pub fn create_state_file(path: &Path, mode: u32) -> io::Result<fs::File> {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)?;
    regular(f)
}

/// `f` when it is a regular file; else an error naming what it is (FIFO, socket, …).
fn regular(f: fs::File) -> io::Result<fs::File> {
    let md = f.metadata()?;
    if md.file_type().is_file() {
        Ok(f)
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("not a regular file ({})", kind_of(md.file_type())),
        ))
    }
}

/// Opens a state file for appending (created with `mode` when absent), with the guards of
/// [`open_state_file`]: a symlink is not followed, a FIFO never blocks the writer, and
/// something that is not a regular file in its place is quarantined (one ERROR line) and a
/// fresh file is made.
pub fn open_state_append(path: &Path, mode: u32) -> io::Result<fs::File> {
    let open = || -> io::Result<fs::File> {
        let f = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
            .open(path)?;
        regular(f)
    };
    match open() {
        Ok(f) => Ok(f),
        Err(e) => {
            let not_regular = matches!(
                fs::symlink_metadata(path),
                Ok(m) if !m.file_type().is_file()
            );
            if !not_regular {
                return Err(e);
            }
            quarantine(path, &format!("not a regular file ({e})"))?;
            open()
        }
    }
}

/// Parses a persisted record (at most `cap` bytes) and validates it.
pub fn parse_record<T>(bytes: &[u8]) -> Result<T, StoreError>
where
    T: serde::de::DeserializeOwned + Validate,
{
    let value: T = serde_json::from_slice(bytes).map_err(|e| StoreError::Invalid(e.to_string()))?;
    value
        .validate()
        .map_err(|e| StoreError::Invalid(e.to_string()))?;
    Ok(value)
}

/// Reads, parses and validates a persisted record of at most `cap` bytes.
pub fn read_record<T>(path: &Path, cap: u64) -> Result<T, StoreError>
where
    T: serde::de::DeserializeOwned + Validate,
{
    parse_record(&read_state_file(path, cap)?)
}

/// Like [`read_record`], but a file that is there and bad is quarantined (with its one ERROR
/// line); `None` for a missing, unreadable or bad file.
pub fn load_record<T>(path: &Path, cap: u64, what: &str) -> Option<T>
where
    T: serde::de::DeserializeOwned + Validate,
{
    match read_record(path, cap) {
        Ok(v) => Some(v),
        Err(StoreError::Missing) => None,
        Err(e) if e.is_bad_content() => {
            let _ = quarantine(path, &format!("not a valid {what}: {e}"));
            None
        }
        Err(e) => {
            log::error!("{} {e}; ignored", shown(path));
            None
        }
    }
}

/// The state dir a persisted file belongs to, by the state dir's layout: `<state>/<file>`,
/// `<state>/outbox|ingress/<file>`, `<state>/workloads/<id>[/<file>]`.
pub fn state_dir_of(path: &Path) -> PathBuf {
    let name = |p: Option<&Path>| {
        p.and_then(Path::file_name)
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let parent = path.parent();
    let grandparent = parent.and_then(Path::parent);
    let up = |p: Option<&Path>| {
        p.map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."))
    };
    if name(parent) == "workloads" {
        up(grandparent)
    } else if name(grandparent) == "workloads" {
        up(grandparent.and_then(Path::parent))
    } else if matches!(name(parent).as_str(), "outbox" | "ingress") {
        up(grandparent)
    } else {
        up(parent)
    }
}

/// A path as it may appear in a log line (a file name is outside text: D31).
pub fn shown(path: &Path) -> String {
    crate::logtext::cut(&path.display().to_string(), 512)
}

/// Text from outside for a log line: escaped, at most `max` characters (D31).
pub fn clip(text: &str, max: usize) -> String {
    crate::logtext::cut(text, max)
}

/// Moves a persisted file (or a workload directory) that does not validate out of the way,
/// into `<state dir>/quarantine/<UTC time>-<where it was>`, and says so in ONE ERROR line
/// (what, why, where it went). The node carries on without it. Returns the new path; if the
/// move fails the file is left in place (and the ERROR line says that instead).
pub fn quarantine(path: &Path, why: &str) -> io::Result<PathBuf> {
    let result = move_to_quarantine(path);
    match &result {
        Ok(dest) => log::error!(
            "quarantined {}: {}; moved to {}",
            shown(path),
            clip(why, 400),
            shown(dest)
        ),
        Err(e) => log::error!(
            "{} is invalid ({}) but cannot be moved to {}: {e}; ignoring it",
            shown(path),
            clip(why, 400),
            shown(&state_dir_of(path).join(QUARANTINE_DIR))
        ),
    }
    result
}

/// What [`quarantine`] does without its log line (for callers that say it themselves).
pub fn move_to_quarantine(path: &Path) -> io::Result<PathBuf> {
    let state = state_dir_of(path);
    // A command run as another user (`sudo … status` on the service's dir) never moves the
    // service's files, nor leaves it a quarantine folder it cannot write (D30).
    {
        use std::os::unix::fs::MetadataExt;
        let me = crate::util::euid();
        if fs::metadata(&state)?.uid() != me {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the state dir belongs to another user",
            ));
        }
    }
    let qdir = state.join(QUARANTINE_DIR);
    let rel = path.strip_prefix(&state).unwrap_or(path);
    let flat: String = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .filter(|c| c != "/")
        .collect::<Vec<_>>()
        .join("-");
    // File-name safe and bounded (the name came from the state dir, which anyone with access
    // may have filled with anything).
    let flat: String = flat
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(160)
        .collect();
    let stamp: String = crate::util::rfc3339(std::time::SystemTime::now())
        .chars()
        .take_while(|c| *c != '.')
        .filter(|c| *c != '-' && *c != ':')
        .collect();
    ensure_private_dir(&qdir).and_then(|()| {
        let mut n: u32 = 0;
        loop {
            let name = if n == 0 {
                format!("{stamp}Z-{flat}")
            } else {
                format!("{stamp}Z-{n}-{flat}")
            };
            let dest = qdir.join(name);
            if fs::symlink_metadata(&dest).is_err() {
                fs::rename(path, &dest)?;
                return Ok(dest);
            }
            n = n.checked_add(1).ok_or_else(|| {
                io::Error::new(io::ErrorKind::AlreadyExists, "no free quarantine name")
            })?;
        }
    })
}

/// The quarantine keeps at most this many bytes: past it the oldest entries go (D67).
pub const MAX_QUARANTINE_BYTES: u64 = 64 * 1024 * 1024;
/// … and nothing older than this.
pub const MAX_QUARANTINE_AGE: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);
/// Files of one quarantined folder counted at most (its size is then taken as it stands).
const MAX_COUNTED_FILES: usize = 10_000;

/// What [`prune_quarantine`] deleted.
#[derive(Debug, Default, PartialEq)]
pub struct Pruned {
    /// Entries older than [`MAX_QUARANTINE_AGE`].
    pub old: Vec<String>,
    /// The oldest entries, deleted to bring the quarantine under its bound.
    pub over: Vec<String>,
    /// The bytes they held, all together.
    pub bytes: u64,
    /// What the quarantine held before.
    pub held: u64,
}

/// The bytes of a quarantined file or folder (a folder walked without following links, at
/// most [`MAX_COUNTED_FILES`] files).
fn quarantined_bytes(path: &Path) -> u64 {
    let Ok(m) = fs::symlink_metadata(path) else {
        return 0;
    };
    if !m.is_dir() {
        return m.len();
    }
    let (mut total, mut seen) = (0u64, 0usize);
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).into_iter().flatten().flatten() {
            seen = seen.saturating_add(1);
            if seen > MAX_COUNTED_FILES {
                return total;
            }
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                _ => total = total.saturating_add(e.metadata().map_or(0, |m| m.len())),
            }
        }
    }
    total
}

/// Holds `<state>/quarantine/` to its bounds (D67): entries set aside more than `max_age`
/// before `now` are deleted, then the oldest until it holds at most `max_bytes` (the newest
/// entry always stays, for a person to look at). When an entry was set aside is when it was
/// moved there (its inode change time).
pub fn prune_quarantine(
    state: &Path,
    max_bytes: u64,
    max_age: std::time::Duration,
    now: std::time::SystemTime,
) -> Pruned {
    use std::os::unix::fs::MetadataExt;
    let qdir = state.join(QUARANTINE_DIR);
    let now_s = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let max_age_s = i64::try_from(max_age.as_secs()).unwrap_or(i64::MAX);
    let mut entries: Vec<(i64, String, u64)> = fs::read_dir(&qdir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let m = fs::symlink_metadata(e.path()).ok()?;
            let name = e.file_name().to_string_lossy().into_owned();
            Some((m.ctime(), name, quarantined_bytes(&e.path())))
        })
        .collect();
    entries.sort();
    let mut pruned = Pruned {
        held: entries.iter().map(|e| e.2).fold(0u64, u64::saturating_add),
        ..Pruned::default()
    };
    let mut held = pruned.held;
    let mut left = entries.len();
    for (at, name, bytes) in entries {
        let old = now_s.saturating_sub(at) > max_age_s;
        if !old && (held <= max_bytes || left <= 1) {
            break;
        }
        let path = qdir.join(&name);
        let gone = if fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        if gone.is_err() {
            continue;
        }
        held = held.saturating_sub(bytes);
        left = left.saturating_sub(1);
        pruned.bytes = pruned.bytes.saturating_add(bytes);
        if old {
            pruned.old.push(name);
        } else {
            pruned.over.push(name);
        }
    }
    pruned
}

/// [`prune_quarantine`] with its bounds on a thread of its own, and one log line for what it
/// deleted.
pub fn prune_quarantine_in_background(state: PathBuf) {
    let spawned = std::thread::Builder::new()
        .name("quarantine".into())
        .spawn(move || {
            let p = prune_quarantine(
                &state,
                MAX_QUARANTINE_BYTES,
                MAX_QUARANTINE_AGE,
                std::time::SystemTime::now(),
            );
            log_pruned(&p, &state.join(QUARANTINE_DIR));
        });
    if let Err(e) = spawned {
        log::warn!("the quarantine was not pruned: {e}");
    }
}

fn log_pruned(p: &Pruned, qdir: &Path) {
    let names = |v: &[String]| {
        let mut s: Vec<String> = v.iter().take(5).map(|n| clip(n, 80)).collect();
        if v.len() > 5 {
            s.push(format!("and {} more", v.len().saturating_sub(5)));
        }
        s.join(", ")
    };
    if !p.old.is_empty() {
        log::info!(
            "{}: deleted {} entries set aside more than {} days ago: {}",
            shown(qdir),
            p.old.len(),
            MAX_QUARANTINE_AGE.as_secs() / 86_400,
            names(&p.old)
        );
    }
    if !p.over.is_empty() {
        log::warn!(
            "{} held {} bytes, over its {} bytes: deleted its {} oldest entries: {}",
            shown(qdir),
            p.held,
            MAX_QUARANTINE_BYTES,
            p.over.len(),
            names(&p.over)
        );
    }
}

// ---- value checks shared by the persisted records (the ranges of D20) ---------------------

/// Longest number of seconds a record may hold (30 days, D20).
pub const MAX_SECONDS: f64 = 30.0 * 24.0 * 3600.0;
/// Latest Unix time a record may hold (year 9999): later is corruption, and it keeps every
/// difference of two times far from overflow.
pub const MAX_UNIX: f64 = 253_402_300_799.0;

/// A workload uuid or similar id (D20): 1–256 bytes of printable ASCII without `+`, `#`, `/`.
pub fn check_id(field: &'static str, v: &str) -> Result<(), Invalid> {
    let ok = !v.is_empty()
        && v.len() <= 256
        && v.bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'+' | b'#' | b'/'));
    if ok {
        Ok(())
    } else {
        Err(Invalid::Id { field })
    }
}

/// A request id as the sender gave it: a string, a number or none (`null`).
pub fn check_request_id(v: &serde_json::Value) -> Result<(), Invalid> {
    use serde_json::Value;
    if matches!(v, Value::Null | Value::String(_) | Value::Number(_)) {
        Ok(())
    } else {
        Err(Invalid::Rule {
            field: "request_id",
            must: "be a string or a number",
        })
    }
}

/// A process id: 1..=2^31-1.
pub fn check_pid(field: &'static str, v: i32) -> Result<(), Invalid> {
    if v >= 1 {
        Ok(())
    } else {
        Err(Invalid::Pid { field, got: v })
    }
}

/// A number of seconds: finite, from `min` (exclusive when `min` is 0 and `zero_ok` is false)
/// to 30 days.
pub fn check_seconds(field: &'static str, v: f64, zero_ok: bool) -> Result<(), Invalid> {
    let low_ok = if zero_ok { v >= 0.0 } else { v > 0.0 };
    if v.is_finite() && low_ok && v <= MAX_SECONDS {
        Ok(())
    } else {
        Err(Invalid::Seconds {
            field,
            got: v,
            zero_ok,
        })
    }
}

/// A Unix time in seconds: finite, from 0 to the year 9999.
pub fn check_unix(field: &'static str, v: f64) -> Result<(), Invalid> {
    if v.is_finite() && (0.0..=MAX_UNIX).contains(&v) {
        Ok(())
    } else {
        Err(Invalid::Unix { field, got: v })
    }
}

/// Byte offsets (log cursors): each at most `max`, so that sums of them cannot overflow.
pub fn check_offsets(field: &'static str, values: &[u64], max: u64) -> Result<(), Invalid> {
    if values.iter().all(|v| *v <= max) {
        Ok(())
    } else {
        Err(Invalid::Offsets { field, max })
    }
}

/// Short printable text (a timestamp, a boot id, a label): at most `max` bytes, no control
/// characters.
pub fn check_text(field: &'static str, v: &str, max: usize) -> Result<(), Invalid> {
    if v.len() <= max && !v.chars().any(char::is_control) {
        Ok(())
    } else {
        Err(Invalid::Text { field, max })
    }
}

/// FNV-1a, 32 bit: stable across builds and platforms (unlike std's hasher).
fn fnv1a32(data: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in data {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// Free space (MiB) on the filesystem holding `dir` (or, before it exists, its nearest parent).
pub fn free_mb(dir: &Path) -> Option<u64> {
    let dir = dir.ancestors().find(|a| a.exists())?;
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs into a zeroed struct we own, with a valid C string.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return None;
        }
        Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64) / (1024 * 1024))
    }
}

/// The marker a node writes in its state dir when the broker said another client took its id
/// (D33); `doctor` reads it.
pub const CLIENT_ID_CONFLICT: &str = "client_id_conflict";

#[cfg(test)]
mod tests {

    #[test]
    fn a_swept_folder_goes_off_the_callers_thread_or_on_it_when_there_is_no_sweeper() {
        let root = crate::scratch::Scratch::new("sweep");
        let tree = |name: &str| {
            let d = root.join(name);
            fs::create_dir_all(d.join("a/b")).unwrap();
            fs::write(d.join("a/b/f"), b"x").unwrap();
            fs::write(d.join("g"), b"y").unwrap();
            d
        };
        let d = tree(".retired-one");
        let sweeper = Sweeper::start();
        sweeper.sweep(d.clone());
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while d.exists() && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!d.exists(), "swept by the sweeper's thread");
        // One already gone is no error; without a thread the caller removes it at once.
        sweeper.sweep(d.clone());
        let d = tree(".retired-two");
        Sweeper { tx: None }.sweep(d.clone());
        assert!(!d.exists(), "removed by the caller");
    }

    #[test]
    fn a_new_file_is_written_with_its_exact_mode_and_never_over_a_file_or_through_a_link() {
        let root = std::env::temp_dir().join(format!("cw-new-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        let p = root.join("params.json");
        write_new(&p, b"{}", 0o600).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"{}");
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o7777,
            0o600
        );
        // Already there: refused, and left as it was.
        let again = write_new(&p, b"{\"x\":1}", 0o600).unwrap_err();
        assert_eq!(again.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(fs::read(&p).unwrap(), b"{}");
        // A link in its place (dangling or not) is never followed.
        let target = root.join("elsewhere");
        let link = root.join("link.json");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(write_new(&link, b"x", 0o600).is_err());
        assert!(!target.exists());
        // A mode wider than the umask allows is still exact.
        let q = root.join("wide");
        write_new(&q, b"", 0o644).unwrap();
        assert_eq!(
            fs::metadata(&q).unwrap().permissions().mode() & 0o7777,
            0o644
        );
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn a_private_dir_is_made_private_whatever_was_there_and_left_alone_when_it_is() {
        let root = std::env::temp_dir().join(format!("cw-private-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let dir = root.join("a/b");
        ensure_private_dir(&dir).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&dir), 0o700);
        for wrong in [0o755, 0o1700, 0o000, 0o2700] {
            fs::set_permissions(&dir, fs::Permissions::from_mode(wrong)).unwrap();
            ensure_private_dir(&dir).unwrap();
            assert_eq!(mode(&dir), 0o700, "from {wrong:o}");
        }
        ensure_private_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        // A file in its place is an error, not a directory.
        let file = root.join("file");
        fs::write(&file, b"x").unwrap();
        assert!(ensure_private_dir(&file).is_err());
        let _ = fs::remove_dir_all(&root);
    }
    #[test]
    fn an_invalid_value_is_told_as_one_sentence_naming_its_field() {
        let cases = [
            (
                check_id("uuid", "a/b").unwrap_err(),
                "uuid must be 1-256 printable ASCII characters without + # / or whitespace",
            ),
            (
                check_pid("pid", 0).unwrap_err(),
                "pid must be a pid from 1 to 2147483647, got 0",
            ),
            (
                check_seconds("grace_s", -1.0, true).unwrap_err(),
                "grace_s must be a number of seconds from 0 and at most 2592000, got -1",
            ),
            (
                check_seconds("max_runtime_s", 0.0, false).unwrap_err(),
                "max_runtime_s must be a number of seconds above 0 and at most 2592000, got 0",
            ),
            (
                check_unix("at", f64::NAN).unwrap_err(),
                "at must be a Unix time from 0 to 253402300799, got NaN",
            ),
            (
                check_offsets("log offsets", &[5], 4).unwrap_err(),
                "log offsets must be at most 4",
            ),
            (
                check_text("boot_id", "a\nb", 64).unwrap_err(),
                "boot_id must be at most 64 bytes without control characters",
            ),
            (
                Invalid::OneOf {
                    field: "kind",
                    allowed: &["inference", "training"],
                },
                "kind must be one of inference, training",
            ),
        ];
        for (e, text) in cases {
            assert_eq!(e.to_string(), text);
        }
        assert!(check_id("uuid", "wl-1").is_ok() && check_pid("pid", 1).is_ok());
    }
    use super::*;

    #[test]
    fn safe_id_keeps_plain_ids() {
        assert_eq!(safe_id("req-123_A.b"), "req-123_A.b");
    }

    #[test]
    fn safe_id_neutralises_hostile_ids() {
        for hostile in [
            "../../x",
            "/etc/x",
            "..",
            ".",
            "",
            "a\0b",
            "ü",
            &"x".repeat(10_000),
        ] {
            let s = safe_id(hostile);
            assert!(!s.contains('/') && !s.contains('\0'), "{s}");
            assert!(s != "." && s != ".." && !s.is_empty(), "{s}");
            assert!(s.len() <= 64, "{}", s.len());
            assert!(!s.starts_with(".."), "{s}");
        }
        assert_ne!(safe_id("a/b"), safe_id("a_b"));
        assert_ne!(safe_id("a/b"), safe_id("a?b"));
        assert_eq!(safe_id("a/b"), safe_id("a/b"));
    }

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cw-store-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        ensure_private_dir(&dir).unwrap();
        dir
    }

    #[derive(serde::Deserialize, Debug)]
    struct Rec {
        n: f64,
    }
    impl Validate for Rec {
        fn validate(&self) -> Result<(), Invalid> {
            check_seconds("n", self.n, false)
        }
    }

    #[test]
    fn hostile_records_are_refused_with_a_reason() {
        let dir = scratch("rec");
        let p = dir.join("r.json");
        for (text, want) in [
            ("", "EOF"),
            ("{\"n\":", "EOF"),
            ("\u{0}\u{1}\u{ff}binary", "expected value"),
            ("{\"n\":\"5\"}", "invalid type"),
            ("{\"n\":1e19}", "at most"),
            ("{\"n\":-1}", "above 0"),
            ("{\"n\":0}", "above 0"),
            ("[]", "invalid length"),
        ] {
            fs::write(&p, text).unwrap();
            let e = read_record::<Rec>(&p, 100).unwrap_err();
            assert!(e.is_bad_content(), "{text:?}");
            assert!(e.to_string().contains(want), "{text:?}: {e}");
        }
        fs::write(&p, format!("{{\"n\":1{}}}", " ".repeat(200))).unwrap();
        let e = read_record::<Rec>(&p, 100).unwrap_err();
        assert!(matches!(e, StoreError::TooBig { cap: 100, .. }), "{e}");
        fs::write(&p, "{\"n\":2.5}").unwrap();
        assert_eq!(read_record::<Rec>(&p, 100).unwrap().n, 2.5);
        assert!(matches!(
            read_record::<Rec>(&dir.join("absent"), 100),
            Err(StoreError::Missing)
        ));
        let e = read_record::<Rec>(&dir, 100).unwrap_err();
        assert!(e.is_bad_content(), "a directory is not a record: {e}");
        fs::remove_dir_all(&dir).unwrap();
    }

    fn mkfifo(p: &Path) {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    }

    /// Runs `f` on a thread and fails (instead of hanging the test run) when it blocks.
    fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(3))
            .unwrap_or_else(|_| panic!("{what}: blocked"))
    }

    #[test]
    fn d48_only_regular_files_are_read_back_and_nothing_blocks() {
        let dir = scratch("kinds");
        let target = dir.join("target.json");
        fs::write(&target, "{\"n\":1}").unwrap();
        let fifo = dir.join("fifo.json");
        mkfifo(&fifo);
        let link = dir.join("link.json");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let dangling = dir.join("dangling.json");
        std::os::unix::fs::symlink(dir.join("nothing"), &dangling).unwrap();
        let sub = dir.join("dir.json");
        fs::create_dir(&sub).unwrap();
        let sock = dir.join("sock.json");
        let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        for (path, kind) in [
            (fifo, "a FIFO"),
            (link, "a symlink"),
            (dangling, "a symlink"),
            (sub, "a directory"),
            (sock, "a socket"),
        ] {
            let p = path.clone();
            let e = bounded(kind, move || read_state_file(&p, 100)).unwrap_err();
            assert!(e.is_bad_content(), "{kind}: {e}");
            assert!(
                e.to_string() == format!("not a regular file ({kind})"),
                "{kind}: {e}"
            );
            let p = path.clone();
            let e = bounded(kind, move || read_record::<Rec>(&p, 100)).unwrap_err();
            assert!(matches!(e, StoreError::NotRegular(_)), "{kind}: {e}");
            // Quarantined like a corrupt file, without blocking.
            let p = path.clone();
            let got = bounded(kind, move || load_record::<Rec>(&p, 100, "record"));
            assert!(got.is_none(), "{kind}");
            assert!(fs::symlink_metadata(&path).is_err(), "{kind} moved away");
        }
        // A link's target is untouched; a device is refused (opening one may have effects).
        assert_eq!(fs::read_to_string(&target).unwrap(), "{\"n\":1}");
        let e = read_state_file(Path::new("/dev/null"), 100).unwrap_err();
        assert_eq!(e.to_string(), "not a regular file (a device)");
        let e = read_state_file(Path::new("/dev/zero"), 100).unwrap_err();
        assert!(matches!(e, StoreError::NotRegular(_)), "{e}");
        assert_eq!(fs::read_dir(dir.join(QUARANTINE_DIR)).unwrap().count(), 5);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn d48_an_over_size_state_file_is_refused_unread_and_a_regular_one_is_read() {
        let dir = scratch("size");
        let p = dir.join("big.json");
        fs::write(&p, vec![b' '; 101]).unwrap();
        let e = read_state_file(&p, 100).unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::TooBig {
                    size: 101,
                    cap: 100
                }
            ),
            "{e}"
        );
        assert!(e.is_bad_content());
        fs::write(&p, vec![b' '; 100]).unwrap();
        assert_eq!(read_state_file(&p, 100).unwrap().len(), 100);
        assert!(matches!(
            read_state_file(&dir.join("absent"), 100),
            Err(StoreError::Missing)
        ));
        // A file in place of a directory on the way is not missing: it is an I/O error.
        assert!(matches!(
            read_state_file(&p.join("x"), 100),
            Err(StoreError::Io(_))
        ));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn d48_appends_and_logs_never_block_on_a_fifo_nor_write_through_a_link() {
        let dir = scratch("append");
        let victim = dir.join("victim");
        fs::write(&victim, "keep").unwrap();
        let ledger = dir.join("ledger.jsonl");
        mkfifo(&ledger);
        let l = ledger.clone();
        let mut f = bounded("append to a FIFO", move || open_state_append(&l, 0o600)).unwrap();
        f.write_all(b"line\n").unwrap();
        assert!(fs::symlink_metadata(&ledger).unwrap().is_file());
        assert_eq!(fs::read(&ledger).unwrap(), b"line\n");
        fs::remove_file(&ledger).unwrap();
        std::os::unix::fs::symlink(&victim, &ledger).unwrap();
        let mut f = open_state_append(&ledger, 0o600).unwrap();
        f.write_all(b"x").unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "keep");
        assert_eq!(fs::read_dir(dir.join(QUARANTINE_DIR)).unwrap().count(), 2);
        let log = dir.join("install.stdout.log");
        mkfifo(&log);
        let l = log.clone();
        assert!(bounded("create over a FIFO", move || create_state_file(&l, 0o600)).is_err());
        fs::remove_file(&log).unwrap();
        std::os::unix::fs::symlink(&victim, &log).unwrap();
        assert!(create_state_file(&log, 0o600).is_err());
        assert_eq!(fs::read_to_string(&victim).unwrap(), "keep");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// D67: the quarantine keeps at most its bytes (the oldest go, the newest stays) and
    /// nothing older than its age.
    #[test]
    fn d67_the_quarantine_is_capped_in_bytes_and_age() {
        let scratch = crate::scratch::Scratch::new("quarantine-cap");
        let state = scratch.path();
        let q = state.join(QUARANTINE_DIR);
        // Made in this order: set aside in this order (a tie in the second goes by name).
        fs::create_dir_all(&q).unwrap();
        fs::write(q.join("a"), vec![0u8; 400]).unwrap();
        fs::write(q.join("b"), vec![0u8; 400]).unwrap();
        fs::create_dir_all(q.join("c-dir/sub")).unwrap();
        fs::write(q.join("c-dir/sub/f"), vec![0u8; 300]).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", q.join("d-link")).unwrap();
        let now = std::time::SystemTime::now();
        let day = std::time::Duration::from_secs(86_400);
        // Under both bounds: nothing goes.
        assert_eq!(
            prune_quarantine(state, 10_000, day, now),
            Pruned {
                held: 1100 + fs::symlink_metadata(q.join("d-link")).unwrap().len(),
                ..Pruned::default()
            }
        );
        // Over the bytes: the oldest go (same second: by name), until it fits.
        let p = prune_quarantine(state, 600, day, now);
        assert_eq!(p.over, vec!["a".to_string(), "b".to_string()]);
        assert!(q.join("c-dir/sub/f").exists() && !q.join("b").exists());
        // The newest entry stays even when it alone is over.
        let p = prune_quarantine(state, 1, day, now);
        assert_eq!(p.over, vec!["c-dir".to_string()]);
        assert!(
            fs::symlink_metadata(q.join("d-link")).is_ok(),
            "the newest stays"
        );
        assert!(
            Path::new("/etc/passwd").exists(),
            "a link is removed, not followed"
        );
        // Older than the age: deleted, whatever the size.
        let p = prune_quarantine(state, 1 << 30, day, now + 2 * day);
        assert_eq!(p.old, vec!["d-link".to_string()]);
        assert_eq!(fs::read_dir(&q).unwrap().count(), 0);
        assert_eq!(
            prune_quarantine(&state.join("absent"), 1, day, now),
            Pruned::default()
        );
    }

    #[test]
    fn quarantine_moves_the_file_into_the_state_dirs_quarantine_folder() {
        let state = scratch("q");
        for rel in [
            "ledger.jsonl",
            "outbox/00000000000000000001.json",
            "ingress/00000000000000000002.json",
            "workloads/w\n1/meta.json",
            "workloads/w2",
        ] {
            let p = state.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            if rel == "workloads/w2" {
                fs::create_dir_all(&p).unwrap();
            } else {
                fs::write(&p, "x").unwrap();
            }
            let dest = quarantine(&p, "bad").unwrap();
            assert!(!p.exists(), "{rel} moved away");
            assert!(dest.exists());
            assert_eq!(dest.parent().unwrap(), state.join(QUARANTINE_DIR), "{rel}");
            let name = dest.file_name().unwrap().to_string_lossy().into_owned();
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)),
                "{name}"
            );
            let flat = rel.replace('/', "-").replace('\n', "_");
            assert!(name.ends_with(&format!("Z-{flat}")), "{name} for {rel:?}");
        }
        // The same name twice: both kept.
        fs::write(state.join("ledger.jsonl"), "y").unwrap();
        let second = quarantine(&state.join("ledger.jsonl"), "again").unwrap();
        assert!(second.exists());
        assert_eq!(fs::read_dir(state.join(QUARANTINE_DIR)).unwrap().count(), 6);
        assert!(quarantine(&state.join("absent"), "x").is_err());
        fs::remove_dir_all(&state).unwrap();
    }

    #[test]
    fn a_file_where_a_directory_belongs_is_quarantined() {
        let state = scratch("dir");
        let outbox = state.join("outbox");
        fs::write(&outbox, "not a dir").unwrap();
        ensure_dir_or_quarantine(&outbox).unwrap();
        assert!(outbox.is_dir());
        assert_eq!(fs::read_dir(state.join(QUARANTINE_DIR)).unwrap().count(), 1);
        ensure_dir_or_quarantine(&outbox).unwrap();
        assert_eq!(fs::read_dir(state.join(QUARANTINE_DIR)).unwrap().count(), 1);
        fs::remove_dir_all(&state).unwrap();
    }

    #[test]
    fn value_checks_hold_the_d20_ranges() {
        for bad in ["", "a/b", "a#", "+", "a b", "\u{7f}", "é", &"x".repeat(257)] {
            assert!(check_id("f", bad).is_err(), "{bad:?}");
        }
        assert!(check_id("f", &"x".repeat(256)).is_ok());
        assert!(check_pid("p", 0).is_err() && check_pid("p", -5).is_err());
        assert!(check_pid("p", i32::MAX).is_ok() && check_pid("p", 1).is_ok());
        for bad in [f64::NAN, f64::INFINITY, -0.5, 1e19, MAX_SECONDS + 1.0] {
            assert!(check_seconds("s", bad, true).is_err(), "{bad}");
        }
        assert!(check_seconds("s", 0.0, true).is_ok() && check_seconds("s", 0.0, false).is_err());
        assert!(check_unix("t", 1e12).is_err() && check_unix("t", f64::NAN).is_err());
        assert!(check_text("t", "a\nb", 10).is_err() && check_text("t", "abc", 2).is_err());
        assert!(check_offsets("o", &[0, u64::MAX], 1 << 50).is_err());
        assert!(check_offsets("o", &[1 << 50, 0], 1 << 50).is_ok());
    }

    #[test]
    fn write_atomic_sets_mode_and_replaces() {
        let dir = std::env::temp_dir().join(format!("cw-store-{}", std::process::id()));
        ensure_private_dir(&dir).unwrap();
        let p = dir.join("f.json");
        write_atomic(&p, b"one", 0o600).unwrap();
        write_atomic(&p, b"two", 0o600).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            fs::read_dir(&dir).unwrap().count(),
            1,
            "no temp file left behind"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
