//! The test rig: a real mosquitto per test, a fake Cyberwave control plane, and the real node
//! binary as a child process. Shared with the benchmarks (`benches/node.rs`).

#![allow(dead_code, unused_imports)] // the benchmarks use only part of the rig

pub mod broker;
pub mod control_plane;
pub mod disk;
pub mod mqtt5;
pub mod node;
pub mod preview;
pub mod procs;
pub mod rumqttd;
pub mod scenario;
pub mod secrets;
pub mod timeouts;
pub mod tls;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use broker::Broker;
pub use control_plane::{ControlPlane, HeartbeatMode};
pub use node::NodeProcess;
pub use scenario::{Rig, Scenario, Start};

/// `Scenario::new(manifest).rig()` as a tuple, for tests written before the builder (the
/// tests in this tree use the builder).
pub fn rig(manifest: &str) -> (Broker, ControlPlane, node::NodeSetup) {
    let scenario::Rig { broker, cp, setup } = scenario::Scenario::new(manifest).rig();
    (broker, cp, setup)
}

/// A test's scratch folder (`tempfile`: `/tmp/cwtest-<tag>-XXXXXX`), removed when it is dropped
/// at the end of the test, pass or fail; kept when `CW_KEEP_TEST_DIRS` is set, to be looked at.
pub struct TempDir(tempfile::TempDir);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        // Searchable by other users, as a folder made with the default umask is: a node or a
        // workload run as another uid works below it.
        let dir = tempfile::Builder::new()
            .prefix(&format!("cwtest-{tag}-"))
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .disable_cleanup(std::env::var_os("CW_KEEP_TEST_DIRS").is_some())
            .tempdir()
            .expect("create a scratch folder");
        TempDir(dir)
    }
    pub fn path(&self) -> &Path {
        self.0.path()
    }
    pub fn join(&self, rel: &str) -> PathBuf {
        self.path().join(rel)
    }
    pub fn write(&self, rel: &str, text: &str) -> PathBuf {
        let p = self.join(rel);
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).expect("mkdir");
        }
        std::fs::write(&p, text).expect("write");
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("CW_KEEP_TEST_DIRS").is_some() {
            return;
        }
        // A process of the test that is still ending may write into it meanwhile (the removal
        // then fails with ENOTEMPTY): tried a few times before `tempfile`'s own last try.
        for _ in 0..20 {
            if std::fs::remove_dir_all(self.path()).is_ok() || !self.path().exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A free TCP port on loopback (there is a small window before the user binds it; callers
/// that bind retry on a clash).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Polls `f` every 2 ms until it returns `Some` or `timeout` passes.
pub fn wait_for<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The node binary under test: `CYBERWAVE_NODE_BIN` (e.g. the static release build), else the
/// one cargo built for this test run.
pub fn node_bin() -> PathBuf {
    match std::env::var_os("CYBERWAVE_NODE_BIN") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_BIN_EXE_cyberwave-cloud-node")),
    }
}

/// Root's home in the passwd database (`/root` on most hosts).
pub fn passwd_home_of_root() -> String {
    // SAFETY: getpwuid returns null or a pointer to a static entry, read at once.
    unsafe {
        let pw = libc::getpwuid(0);
        assert!(
            !pw.is_null() && !(*pw).pw_dir.is_null(),
            "no passwd entry for root"
        );
        std::ffi::CStr::from_ptr((*pw).pw_dir)
            .to_string_lossy()
            .into_owned()
    }
}

/// The first line of a test that needs root, which carries
/// `#[cfg_attr(not_root, ignore = "needs root")]` (CONTRIBUTING.md, "Tests that need root"):
/// run without root all the same (a build as root, `--include-ignored`), it fails loudly
/// instead of passing.
pub fn assert_root(why: &str) {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "needs root: {why} (CI runs as root)");
}
