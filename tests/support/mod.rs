//! The test rig: a real mosquitto per test, a fake Cyberwave control plane, and the real node
//! binary as a child process. Shared with the benchmarks (`benches/node.rs`).

#![allow(dead_code, unused_imports)] // the benchmarks use only part of the rig

pub mod broker;
pub mod control_plane;
pub mod mqtt5;
pub mod node;
pub mod preview;
pub mod rumqttd;
pub mod scenario;
pub mod secrets;
pub mod timeouts;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use broker::Broker;
pub use control_plane::{ControlPlane, HeartbeatMode};
pub use node::NodeProcess;

/// A broker, the fake backend and a node set up on them with this manifest.
pub fn rig(manifest: &str) -> (Broker, ControlPlane, node::NodeSetup) {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = node::NodeSetup::new(&broker, &cp);
    setup.write("cyberwave.yml", manifest);
    (broker, cp, setup)
}

/// A broker and a fake backend whose behaviour `f` adjusts (for tests of failure paths).
pub fn backend_with(f: impl FnOnce(&mut control_plane::Behaviour)) -> (Broker, ControlPlane) {
    let broker = Broker::start();
    let mut behaviour = control_plane::Behaviour::default();
    f(&mut behaviour);
    let cp = ControlPlane::start_with(broker.port, "", behaviour);
    (broker, cp)
}

/// A directory removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "cwtest-{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
    pub fn join(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }
    pub fn write(&self, rel: &str, text: &str) -> PathBuf {
        let p = self.0.join(rel);
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).expect("mkdir");
        }
        std::fs::write(&p, text).expect("write");
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("CW_KEEP_TEST_DIRS").is_none() {
            // A process of the test that is still ending may write into it meanwhile (the
            // removal then fails with ENOTEMPTY): tried again a few times.
            for _ in 0..20 {
                if std::fs::remove_dir_all(&self.0).is_ok() || !self.0.exists() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
}

static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

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
