//! The scenario builder: start a workload, wait for its completion, check its uploads. One
//! place for what every end-to-end test of a workload does, instead of a `start()` helper per
//! test file.
//!
//! ```ignore
//! let w = Start::training("up");                 // request id "up", workload "wl-up"
//! assert_eq!(w.reply(&cp, &node)["status"], "ok");
//! assert_eq!(w.completion(&cp)["exit_code"], 0);
//! assert_eq!(w.uploaded(&cp), vec!["a.bin"]);
//! ```

use serde_json::{json, Value};

use super::timeouts::{DONE, REPLY};
use super::{ControlPlane, NodeProcess};

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
