//! The scenario builder: the one way a test starts its rig (a broker, the fake backend, a node
//! set up on them), then its workloads, their completions and uploads.
//!
//! ```ignore
//! let rig = Scenario::new("cyberwave:\n  training: sleep 1\n")
//!     .env("CYBERWAVE_HEARTBEAT_INTERVAL", "0.5")   // the node's environment
//!     .backend(|b| b.put_failures = 1)               // how the fake backend behaves
//!     .rig();
//! let node = rig.node();                             // spawned, and ready
//! let w = Start::training("up");                     // request id "up", workload "wl-up"
//! assert_eq!(w.reply(&rig.cp, &node)["status"], "ok");
//! assert_eq!(w.completion(&rig.cp)["exit_code"], 0);
//! assert_eq!(w.uploaded(&rig.cp), vec!["a.bin"]);
//! ```

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};

use super::control_plane::Behaviour;
use super::node::NodeSetup;
use super::timeouts::{DONE, READY, REPLY};
use super::{wait_for, Broker, ControlPlane, NodeProcess};

/// What a test's rig is made of; [`Scenario::rig`] starts it.
#[derive(Default)]
pub struct Scenario {
    manifest: Option<String>,
    env: Vec<(String, Option<String>)>,
    args: Vec<String>,
    behaviour: Behaviour,
    prefix: String,
    broker: Option<Broker>,
    files: Vec<(String, String)>,
    dirs: Vec<String>,
}

impl Scenario {
    /// A node whose working dir holds this `cyberwave.yml` (`Scenario::default()`: none).
    pub fn new(manifest: &str) -> Scenario {
        Scenario {
            manifest: Some(manifest.to_string()),
            ..Scenario::default()
        }
    }

    /// Sets a variable of the node's environment (the rig's own, e.g. the broker's port,
    /// included).
    pub fn env(mut self, key: &str, value: &str) -> Scenario {
        self.env.push((key.to_string(), Some(value.to_string())));
        self
    }

    /// Leaves a variable out of the node's environment.
    pub fn unset(mut self, key: &str) -> Scenario {
        self.env.push((key.to_string(), None));
        self
    }

    /// An argument after `start`.
    pub fn arg(mut self, arg: &str) -> Scenario {
        self.args.push(arg.to_string());
        self
    }

    /// How the fake backend behaves (failures, delays, answers); `cp.set_behaviour` changes it
    /// later.
    pub fn backend(mut self, f: impl FnOnce(&mut Behaviour)) -> Scenario {
        f(&mut self.behaviour);
        self
    }

    /// The topic prefix the fake backend speaks under (the node is told it as its
    /// `CYBERWAVE_ENVIRONMENT`).
    pub fn prefix(mut self, prefix: &str) -> Scenario {
        self.prefix = prefix.to_string();
        self
    }

    /// This broker instead of a plain mosquitto (one with a config of its own: limits, an ACL,
    /// a password, TLS).
    pub fn broker(mut self, broker: Broker) -> Scenario {
        self.broker = Some(broker);
        self
    }

    /// Every sync of the node's state sleeps `ms` first: a slow disk, on which starts stay in
    /// flight long enough to act on them (the node's start-up WARN proves the knob is on).
    pub fn slow_disk(self, ms: u64) -> Scenario {
        self.env("CYBERWAVE_TEST_SLOW_FSYNC_MS", &ms.to_string())
    }

    /// A file in the node's working dir (a script the manifest runs).
    pub fn file(mut self, rel: &str, text: &str) -> Scenario {
        self.files.push((rel.to_string(), text.to_string()));
        self
    }

    /// A folder in the node's working dir (where workloads leave their marks).
    pub fn dir(mut self, rel: &str) -> Scenario {
        self.dirs.push(rel.to_string());
        self
    }

    /// Starts the broker and the fake backend, and sets the node up on them (not started).
    pub fn rig(self) -> Rig {
        let broker = self.broker.unwrap_or_else(Broker::start);
        let cp = ControlPlane::start_with(broker.port, &self.prefix, self.behaviour);
        let mut setup = NodeSetup::new(&broker, &cp);
        for (key, value) in &self.env {
            match value {
                Some(v) => setup.set(key, v),
                None => setup.unset(key),
            };
        }
        for a in &self.args {
            setup.arg(a);
        }
        if let Some(m) = &self.manifest {
            setup.write("cyberwave.yml", m);
        }
        for (rel, text) in &self.files {
            setup.write(rel, text);
        }
        for rel in &self.dirs {
            std::fs::create_dir_all(setup.cwd.join(rel)).expect("a folder in the working dir");
        }
        Rig { broker, cp, setup }
    }

    /// The rig and its node, started and ready.
    pub fn node(self) -> (Rig, NodeProcess) {
        let rig = self.rig();
        let node = rig.node();
        (rig, node)
    }
}

/// A started scenario: its broker, its fake backend and its node's setup.
pub struct Rig {
    pub broker: Broker,
    pub cp: ControlPlane,
    pub setup: NodeSetup,
}

impl Rig {
    /// Starts the node; it is not ready yet.
    pub fn spawn(&self) -> NodeProcess {
        self.setup.spawn()
    }

    /// Starts the node and waits until it is ready.
    pub fn node(&self) -> NodeProcess {
        let node = self.setup.spawn();
        node.wait_ready(READY);
        node
    }

    /// A path in the node's working dir.
    pub fn work(&self, rel: &str) -> PathBuf {
        self.setup.cwd.join(rel)
    }

    /// A path in the node's state dir.
    pub fn state(&self, rel: &str) -> PathBuf {
        self.setup.config_dir().join(rel)
    }

    /// The stdout log of workload `rid` of this kind, as it is now.
    pub fn stdout_of(&self, kind: &str, rid: &str) -> String {
        std::fs::read_to_string(self.state(&format!("workload_logs/{kind}_{rid}.stdout.log")))
            .unwrap_or_default()
    }

    /// Writes a file of the node's working dir (making its folders).
    pub fn write(&self, rel: &str, text: &str) -> PathBuf {
        self.setup.write(rel, text)
    }

    /// Touches a file of the node's working dir: what its workloads wait for.
    pub fn touch(&self, rel: &str) {
        std::fs::write(self.work(rel), "").expect("touch a file of the working dir");
    }

    /// How many times workload `rid` ran: the lines its command appended to `t/<rid>.runs`.
    pub fn runs(&self, rid: &str) -> usize {
        std::fs::read_to_string(self.work(&format!("t/{rid}.runs")))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    /// The record the supervisor of workload `safe_id` wrote as it started it (`started.json`).
    pub fn started(&self, safe_id: &str) -> Option<Value> {
        let text = std::fs::read(self.state(&format!("workloads/{safe_id}/started.json"))).ok()?;
        serde_json::from_slice(&text).ok()
    }

    /// Waits for the pid of workload `safe_id`'s supervisor (`started.json`).
    pub fn supervisor_of(&self, safe_id: &str) -> i64 {
        wait_for(REPLY, || self.started(safe_id)?["shim_pid"].as_i64())
            .unwrap_or_else(|| panic!("no started.json for {safe_id}"))
    }

    /// Waits for the pid a workload wrote into this file of the working dir.
    pub fn pid_in(&self, rel: &str) -> i32 {
        let path = self.work(rel);
        wait_for(REPLY, || {
            std::fs::read_to_string(&path).ok()?.trim().parse().ok()
        })
        .unwrap_or_else(|| panic!("no pid in {}", path.display()))
    }

    /// One request line on the node's control socket, its one reply line back.
    pub fn control(&self, line: &[u8]) -> Value {
        use std::io::{BufRead, Write};
        let sock = self.state("control.sock");
        let mut s = std::os::unix::net::UnixStream::connect(&sock)
            .unwrap_or_else(|e| panic!("connect to {}: {e}", sock.display()));
        s.set_read_timeout(Some(REPLY)).expect("timeout");
        s.write_all(line).expect("write request");
        s.write_all(b"\n").expect("write newline");
        let mut reply = String::new();
        std::io::BufReader::new(s)
            .read_line(&mut reply)
            .expect("read the reply");
        serde_json::from_str(&reply).unwrap_or_else(|e| panic!("reply {reply:?}: {e}"))
    }

    /// Another node on the same broker and backend, with a home (and state dir) of its own.
    pub fn another_node(&self) -> NodeSetup {
        NodeSetup::new(&self.broker, &self.cp)
    }
}

/// One start command: its kind (`training`, `inference`, `simulate`, …), request id and params.
/// The params are `{"workload_uuid": "wl-<request id>"}` unless the test says otherwise.
#[derive(Clone, Debug)]
pub struct Start {
    kind: String,
    rid: String,
    params: Value,
}

impl Start {
    pub fn new(kind: &str, rid: &str) -> Start {
        Start {
            kind: kind.to_string(),
            rid: rid.to_string(),
            params: json!({ "workload_uuid": format!("wl-{rid}") }),
        }
    }

    pub fn training(rid: &str) -> Start {
        Start::new("training", rid)
    }

    /// Names the workload `wl` instead of `wl-<request id>`.
    pub fn workload(mut self, wl: &str) -> Start {
        self.params["workload_uuid"] = json!(wl);
        self
    }

    /// Replaces the params whole (no default workload uuid: the test's own, hostile or not).
    pub fn params(mut self, params: Value) -> Start {
        self.params = params;
        self
    }

    /// Adds (or overrides) these keys of a JSON object in the params.
    pub fn with(mut self, extra: Value) -> Start {
        if let (Some(p), Some(e)) = (self.params.as_object_mut(), extra.as_object()) {
            p.extend(e.clone());
        }
        self
    }

    pub fn rid(&self) -> &str {
        &self.rid
    }

    /// The workload uuid the params name (empty when they name none).
    pub fn wl(&self) -> &str {
        self.params["workload_uuid"].as_str().unwrap_or_default()
    }

    /// Publishes the command and does not wait (sent again, it is a QoS 1 redelivery).
    pub fn send(&self, cp: &ControlPlane, node: &NodeProcess) {
        cp.command(
            &node.uuid(),
            json!({"command": self.kind, "request_id": self.rid, "params": self.params}),
        );
    }

    /// Sends the command and returns its reply.
    pub fn reply(&self, cp: &ControlPlane, node: &NodeProcess) -> Value {
        self.send(cp, node);
        cp.wait_reply(&self.rid, REPLY)
            .unwrap_or_else(|| panic!("no reply to {}; log:\n{}", self.rid, node.log()))
    }

    /// Sends the command; its reply must be `ok`.
    pub fn ok(&self, cp: &ControlPlane, node: &NodeProcess) -> Value {
        let r = self.reply(cp, node);
        assert_eq!(r["status"], "ok", "{}: {r}; log:\n{}", self.rid, node.log());
        r
    }

    /// Sends the command; its reply must be `ok`; returns the workload's pid.
    pub fn pid(&self, cp: &ControlPlane, node: &NodeProcess) -> i64 {
        self.ok(cp, node)["output"]["pid"].as_i64().unwrap_or(0)
    }

    /// Waits for this workload's completion; see [`completion`].
    pub fn completion(&self, cp: &ControlPlane) -> Value {
        completion(cp, self.wl())
    }

    /// The file names this workload reported as uploaded; see [`uploaded`].
    pub fn uploaded(&self, cp: &ControlPlane) -> Vec<String> {
        uploaded(cp, self.wl())
    }
}

/// The `error` text of a reply or a status update (empty when it has none).
pub fn error_of(v: &Value) -> &str {
    v["error"].as_str().unwrap_or_default()
}

/// Asserts that a `failed` status is the host-busy refusal (D21: retryable on another host or
/// later) for `reason`.
pub fn assert_host_busy(failed: &Value, reason: &str) {
    assert_eq!(failed["rejection_reason"], "host_busy", "{failed}");
    assert_eq!(failed["busy_reason"], reason, "{failed}");
    assert!(
        error_of(failed).starts_with("Controller host is busy with"),
        "{failed}"
    );
}

/// Waits for workload `wl`'s `completed` status update and returns it; there must be exactly one
/// so far (completions are sent exactly once).
pub fn completion(cp: &ControlPlane, wl: &str) -> Value {
    let all = cp
        .wait_status(wl, "completed", DONE)
        .unwrap_or_else(|| panic!("no completion for {wl}: {:?}", cp.statuses(wl)));
    let done: Vec<&Value> = all.iter().filter(|b| b["status"] == "completed").collect();
    assert_eq!(done.len(), 1, "exactly one completion for {wl}: {all:?}");
    done.first().map(|v| (*v).clone()).unwrap_or_default()
}

/// The file names workload `wl` reported as uploaded (R10), in the order sent.
pub fn uploaded(cp: &ControlPlane, wl: &str) -> Vec<String> {
    cp.requests("workload:upload-results")
        .iter()
        .filter(|r| r.id == wl)
        .flat_map(|r| {
            r.body["filenames"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter_map(|v| v.as_str().map(String::from))
        })
        .collect()
}
