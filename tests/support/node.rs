//! The real node binary as a child process, with a temporary HOME and config dir; its stdout
//! and stderr are captured for assertions.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{node_bin, secrets, wait_for, Broker, ControlPlane, TempDir};

pub const TOKEN: &str = "cw_test_token_0123456789abcdef";

/// Environment and arguments for a node; `spawn` starts it. A clone is another node on the same
/// home and state dir.
#[derive(Clone)]
pub struct NodeSetup {
    pub home: Arc<TempDir>,
    pub env: BTreeMap<String, String>,
    pub args: Vec<String>,
    pub cwd: PathBuf,
    /// Run the node as this uid (and the same gid, no supplementary groups); needs root.
    pub uid: Option<u32>,
    /// A command the node runs under (e.g. `unshare --pid --fork`): its argv before the binary.
    pub under: Vec<String>,
    /// The binary's path as the node's command line names it (e.g. inside a chroot).
    pub bin: Option<PathBuf>,
}

impl NodeSetup {
    /// A node pointed at `broker` and `cp`, with short timings.
    pub fn new(broker: &Broker, cp: &ControlPlane) -> NodeSetup {
        let mut s = Self::bare();
        s.set("CYBERWAVE_BASE_URL", &cp.http_url);
        s.set("CYBERWAVE_API_KEY", TOKEN);
        s.set("CYBERWAVE_MQTT_HOST", "127.0.0.1");
        s.set("CYBERWAVE_MQTT_PORT", &broker.port.to_string());
        if !cp.prefix.is_empty() {
            s.set("CYBERWAVE_ENVIRONMENT", &cp.prefix);
        }
        s
    }

    /// Only HOME, PATH, the config dir and fast timings.
    pub fn bare() -> NodeSetup {
        let home = Arc::new(TempDir::new("node"));
        let work = home.join("work");
        std::fs::create_dir_all(&work).expect("work dir");
        let mut env = BTreeMap::new();
        env.insert("HOME".into(), home.path().display().to_string());
        env.insert(
            "PATH".into(),
            std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into()),
        );
        env.insert(
            "CYBERWAVE_EDGE_CONFIG_DIR".into(),
            home.join(".cyberwave").display().to_string(),
        );
        env.insert("CYBERWAVE_NODE_RECONNECT_MAX_SECONDS".into(), "0.5".into());
        env.insert("CYBERWAVE_NODE_RECONNECT_BASE_SECONDS".into(), "0.1".into());
        env.insert(
            "CYBERWAVE_NODE_REGISTER_RETRY_MAX_SECONDS".into(),
            "0.5".into(),
        );
        env.insert(
            "CYBERWAVE_NODE_TOKEN_CHECK_TIMEOUT_SECONDS".into(),
            "3".into(),
        );
        env.insert("CYBERWAVE_NODE_REQUEST_TIMEOUT_SECONDS".into(), "2".into());
        // Every test runs at the most verbose level, so every test guards D47 (see `secrets`).
        env.insert("RUST_LOG".into(), "trace".into());
        NodeSetup {
            home,
            env,
            args: vec!["start".into()],
            cwd: work,
            uid: None,
            under: Vec::new(),
            bin: None,
        }
    }

    pub fn set(&mut self, k: &str, v: &str) -> &mut Self {
        self.env.insert(k.into(), v.into());
        self
    }

    pub fn unset(&mut self, k: &str) -> &mut Self {
        self.env.remove(k);
        self
    }

    pub fn arg(&mut self, a: &str) -> &mut Self {
        self.args.push(a.into());
        self
    }

    pub fn config_dir(&self) -> PathBuf {
        self.home.join(".cyberwave")
    }

    /// Writes a file relative to the node's working dir.
    pub fn write(&self, rel: &str, text: &str) -> PathBuf {
        self.home.write(&format!("work/{rel}"), text)
    }

    /// Writes a file of the node's state dir before the node starts (what an earlier run, or a
    /// workload, left there), the state dir private as the node makes it.
    pub fn plant(&self, rel: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
        let dir = self.config_dir();
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap_or(&dir)).expect("a folder of the state dir");
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .expect("the state dir private");
        std::fs::write(&path, bytes).expect("a file of the state dir");
        path
    }

    /// Puts `dir` first on the node's PATH (a stand-in for a program the node or its workloads
    /// run).
    pub fn path_first(&mut self, dir: &std::path::Path) -> &mut Self {
        let path = self.env.get("PATH").cloned().unwrap_or_default();
        self.set("PATH", &format!("{}:{path}", dir.display()))
    }

    /// A standalone node (no backend) on the broker at this loopback port.
    pub fn standalone(port: u16) -> NodeSetup {
        let mut s = Self::bare();
        s.set("CYBERWAVE_MQTT_HOST", "127.0.0.1");
        s.set("CYBERWAVE_MQTT_PORT", &port.to_string());
        s.arg("--standalone");
        s
    }

    pub fn spawn(&self) -> NodeProcess {
        NodeProcess::spawn(self)
    }

    /// A CLI command of the node with this setup's environment and working dir, its stdin
    /// closed (`run` runs one to completion; a test that needs its streams elsewhere takes this).
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(node_bin());
        cmd.args(args)
            .env_clear()
            .envs(&self.env)
            .current_dir(&self.cwd)
            .stdin(Stdio::null());
        cmd
    }

    /// Runs to completion (for short commands like `validate` or `config`).
    pub fn run(&self, args: &[&str]) -> Output {
        let out = Output::from(self.command(args).output().expect("run node"));
        let leaks = secrets::leaks(&format!("{}\n{}", out.stderr, out.stdout), &self.secrets());
        assert!(
            leaks.is_empty(),
            "D47: `{}` printed a secret:\n{}",
            args.join(" "),
            leaks.join("\n")
        );
        out
    }

    /// The secrets this node is given (API key, MQTT password, an event token), and those the
    /// fake backends of this test process sent.
    pub fn secrets(&self) -> Vec<String> {
        let mut v = secrets::registered();
        for (k, val) in &self.env {
            if k.contains("API_KEY") || k.contains("PASSWORD") || k.ends_with("_TOKEN") {
                v.push(val.clone());
            }
        }
        v
    }
}

/// What a CLI command of the node printed, and its exit code.
#[derive(Debug)]
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl From<std::process::Output> for Output {
    fn from(out: std::process::Output) -> Output {
        Output {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

impl Output {
    /// Asserts that stdout holds `needle`; shows stdout if not.
    pub fn assert_stdout(&self, needle: &str) {
        assert!(
            self.stdout.contains(needle),
            "stdout lacks {needle:?}:\n{}",
            self.stdout
        );
    }
}

pub struct NodeProcess {
    child: Child,
    out: Arc<Mutex<String>>,
    err: Arc<Mutex<String>>,
    /// The threads copying the node's stdout and stderr; they end at EOF.
    pumps: Vec<std::thread::JoinHandle<()>>,
    pub home: Arc<TempDir>,
    pub started: Instant,
    exit: Option<Option<i32>>,
    /// What must not reach the node's log (D47), checked when the wrapper is dropped.
    secrets: Vec<String>,
    /// The test simulates a slow disk: `wait_ready` proves the node has it on.
    slow_disk: bool,
}

impl NodeProcess {
    fn spawn(setup: &NodeSetup) -> NodeProcess {
        let bin = setup.bin.clone().unwrap_or_else(node_bin);
        let mut cmd = match setup.under.split_first() {
            Some((prog, rest)) => {
                let mut c = Command::new(prog);
                c.args(rest).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        if let Some(uid) = setup.uid {
            use std::os::unix::process::CommandExt;
            // std drops the supplementary groups too when root sets a uid.
            cmd.uid(uid).gid(uid);
        }
        let mut child = cmd
            .args(&setup.args)
            .env_clear()
            .envs(&setup.env)
            .current_dir(&setup.cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn node");
        let pump = |mut r: Box<dyn Read + Send>, buf: Arc<Mutex<String>>| {
            std::thread::spawn(move || {
                let mut chunk = [0u8; 8192];
                // A character split across two reads is kept whole (held until its rest comes).
                let mut held: Vec<u8> = Vec::new();
                while let Ok(n) = r.read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    held.extend_from_slice(&chunk[..n]);
                    let keep = match std::str::from_utf8(&held) {
                        Err(e) if e.error_len().is_none() => held.len() - e.valid_up_to(),
                        _ => 0,
                    };
                    let ready: Vec<u8> = held.drain(..held.len() - keep).collect();
                    buf.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push_str(&String::from_utf8_lossy(&ready));
                }
                buf.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push_str(&String::from_utf8_lossy(&held));
            })
        };
        let out = Arc::new(Mutex::new(String::new()));
        let err = Arc::new(Mutex::new(String::new()));
        let mut pumps = Vec::new();
        if let Some(o) = child.stdout.take() {
            pumps.push(pump(Box::new(o), out.clone()));
        }
        if let Some(e) = child.stderr.take() {
            pumps.push(pump(Box::new(e), err.clone()));
        }
        NodeProcess {
            child,
            out,
            err,
            pumps,
            home: setup.home.clone(),
            started: Instant::now(),
            exit: None,
            secrets: setup.secrets(),
            slow_disk: setup
                .env
                .get("CYBERWAVE_TEST_SLOW_FSYNC_MS")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .is_some_and(|ms| ms > 0),
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn stdout(&self) -> String {
        self.out.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The node's log (stderr).
    pub fn log(&self) -> String {
        self.err.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits until the node's stdout holds `needle` (what the node wrote reaches the test
    /// through a pipe and a copying thread: never assert on it without waiting).
    pub fn wait_stdout(&self, needle: &str, timeout: Duration) -> bool {
        wait_for(timeout, || self.stdout().contains(needle).then_some(())).is_some()
    }

    pub fn wait_log(&self, needle: &str, timeout: Duration) -> bool {
        wait_for(timeout, || self.log().contains(needle).then_some(())).is_some()
    }

    /// Asserts that the node's log holds `needle`, waiting for it a while (what the node writes
    /// reaches the test through a pipe); shows the log if it never comes.
    pub fn assert_logged(&self, needle: &str) {
        assert!(
            self.wait_log(needle, super::timeouts::REPLY),
            "the node's log lacks {needle:?}:\n{}",
            self.log()
        );
    }

    /// Asserts that the node exits with `code` within `timeout`; shows the log if not.
    pub fn assert_exit(&mut self, code: i32, timeout: Duration) {
        let got = self.wait_exit(timeout);
        assert_eq!(got, Some(Some(code)), "{}", self.log());
    }

    /// Waits for the "node ready" line; panics with the log if it does not come.
    pub fn wait_ready(&self, timeout: Duration) {
        assert!(
            self.wait_log("node ready", timeout),
            "node not ready in {timeout:?}; log:\n{}",
            self.log()
        );
        // A slow-disk test tests nothing unless the node simulates the slow disk.
        assert!(
            !self.slow_disk || self.log().contains("simulated slow disk"),
            "CYBERWAVE_TEST_SLOW_FSYNC_MS is set but the node does not simulate a slow disk; log:\n{}",
            self.log()
        );
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill on our own child's pid.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    pub fn sigterm(&self) {
        self.signal(libc::SIGTERM);
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The exit code once the process ended, waiting at most `timeout`; `None` if it still runs.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<Option<i32>> {
        if let Some(e) = self.exit {
            return Some(e);
        }
        let end = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.exit = Some(st.code());
                // Everything the node wrote is in `out`/`err` once the pumps saw EOF (its
                // workloads do not hold its stdout or stderr).
                wait_for(Duration::from_secs(5), || {
                    self.pumps.iter().all(|p| p.is_finished()).then_some(())
                });
                return self.exit;
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn identity(&self) -> Option<Value> {
        let text =
            std::fs::read_to_string(self.home.join(".cyberwave/instance_identity.json")).ok()?;
        serde_json::from_str(&text).ok()
    }

    pub fn uuid(&self) -> String {
        self.identity()
            .and_then(|i| i["uuid"].as_str().map(String::from))
            .unwrap_or_default()
    }

    pub fn slug(&self) -> String {
        self.identity()
            .and_then(|i| i["slug"].as_str().map(String::from))
            .unwrap_or_default()
    }
}

impl NodeProcess {
    /// D47: no secret of the test in the node's log, nor in its stdout outside the lines that
    /// mirror workload output (a workload may print what it likes). The event tokens it minted
    /// are read from its workload records.
    fn assert_no_secret_reached_the_log(&self) {
        if self.exit.is_some() || self.pumps.iter().all(|p| p.is_finished()) {
            // Everything is in.
        } else {
            wait_for(Duration::from_secs(2), || {
                self.pumps.iter().all(|p| p.is_finished()).then_some(())
            });
        }
        let mut secrets = self.secrets.clone();
        secrets.extend(secrets::registered());
        if let Ok(rd) = std::fs::read_dir(self.home.join(".cyberwave/workloads")) {
            for e in rd.flatten() {
                let meta = std::fs::read_to_string(e.path().join("meta.json")).unwrap_or_default();
                if let Ok(v) = serde_json::from_str::<Value>(&meta) {
                    if let Some(t) = v["event_token"].as_str() {
                        secrets.push(t.to_string());
                    }
                }
            }
        }
        let stdout: String = self
            .stdout()
            .lines()
            .filter(|l| !l.starts_with("[workload "))
            .collect::<Vec<_>>()
            .join("\n");
        let leaks = secrets::leaks(&format!("{}\n{stdout}", self.log()), &secrets);
        assert!(
            leaks.is_empty(),
            "D47: a secret reached the node's output:\n{}",
            leaks.join("\n")
        );
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        if self.exit.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // Workloads outlive the node by design; a test's must not outlive the test.
        if let Ok(rd) = std::fs::read_dir(self.home.join(".cyberwave/workloads")) {
            for e in rd.flatten() {
                // Never blocks on a FIFO a test planted there.
                let path = e.path().join("started.json");
                let started = if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_file()) {
                    std::fs::read_to_string(&path).unwrap_or_default()
                } else {
                    String::new()
                };
                let v = serde_json::from_str::<Value>(&started).unwrap_or_default();
                let pid_of = |k: &str| v[k].as_i64().filter(|p| *p > 1).map(|p| p as i32);
                // The supervisor first: one left alive writes its exit record into the
                // state dir while the test's TempDir is being removed, and the removal fails.
                if let Some(shim) = pid_of("shim_pid") {
                    // SAFETY: the test's own workload's supervisor.
                    unsafe {
                        libc::kill(shim, libc::SIGKILL);
                    }
                }
                if let Some(pid) = pid_of("pid") {
                    // SAFETY: the test's own workload group.
                    unsafe {
                        libc::kill(-pid, libc::SIGKILL);
                    }
                }
            }
        }
        // Services (what workloads left in a session of their own) neither.
        let path = self.home.join(".cyberwave/services.json");
        // Never blocks on a FIFO a test planted there.
        let services = std::fs::symlink_metadata(&path)
            .ok()
            .filter(std::fs::Metadata::is_file)
            .and_then(|_| std::fs::read_to_string(&path).ok())
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .unwrap_or_default();
        for s in services["services"].as_array().into_iter().flatten() {
            let pid = |k: &str| {
                s["process"][k]
                    .as_i64()
                    .filter(|p| *p > 1)
                    .map(|p| p as i32)
            };
            for (key, group) in [("pid", false), ("scope_id", true)] {
                if let Some(p) = pid(key) {
                    // SAFETY: what the test's own workloads left running.
                    unsafe {
                        libc::kill(if group { -p } else { p }, libc::SIGKILL);
                    }
                }
            }
        }
        if !std::thread::panicking() {
            self.assert_no_secret_reached_the_log();
        }
        if std::thread::panicking() {
            eprintln!(
                "---- node log ----\n{}\n---- node stdout ----\n{}",
                self.log(),
                self.stdout()
            );
        }
    }
}
