//! Unit tests' scratch folders (`tempfile`): `/tmp/cw-<tag>-XXXXXX`, new and empty when taken,
//! removed when the test that took it ends (a failing test's stays, to be looked at).

use std::ops::Deref;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

pub struct Scratch {
    dir: tempfile::TempDir,
    path: PathBuf,
}

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        // Searchable by other users, as a folder made with the default umask is: some tests
        // hand a part of it to another uid.
        let dir = tempfile::Builder::new()
            .prefix(&format!("cw-{tag}-"))
            .permissions(std::fs::Permissions::from_mode(0o755))
            .tempdir()
            .unwrap();
        let path = dir.path().to_path_buf();
        Scratch { dir, path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Deref for Scratch {
    type Target = PathBuf;
    fn deref(&self) -> &PathBuf {
        &self.path
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        self.dir.disable_cleanup(std::thread::panicking());
    }
}

/// A thread of this process that named itself `name` (`prctl(PR_SET_NAME)`, at most 15 bytes,
/// any bytes) and waits until this is dropped: its `/proc/<tid>/stat` holds that name.
pub struct NamedThread {
    pub tid: i32,
    done: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl NamedThread {
    pub fn new(name: &'static std::ffi::CStr) -> NamedThread {
        let (tx, rx) = std::sync::mpsc::channel();
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            // SAFETY: prctl(PR_SET_NAME) with a NUL-terminated name (the kernel keeps 15 bytes).
            unsafe {
                libc::prctl(libc::PR_SET_NAME, name.as_ptr(), 0, 0, 0);
            }
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() }).unwrap();
            let _ = wait.recv();
        });
        NamedThread {
            tid: rx.recv().unwrap(),
            done: Some(done),
            thread: Some(thread),
        }
    }
}

impl Drop for NamedThread {
    fn drop(&mut self) {
        drop(self.done.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
