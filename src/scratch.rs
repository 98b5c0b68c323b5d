//! Unit tests' scratch folders: `/tmp/cw-<tag>-<pid>`, made empty when taken and removed when
//! the test that took it ends (a failing test's stays, to be looked at).

use std::ops::Deref;
use std::path::{Path, PathBuf};

pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("cw-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Deref for Scratch {
    type Target = PathBuf;
    fn deref(&self) -> &PathBuf {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
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
