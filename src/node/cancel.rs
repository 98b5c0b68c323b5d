//! `cancel`: one ledger replay (a cancel seen before gets its original answer), then a start
//! in flight gets its cancel recorded (carried out once its process runs, `starts.rs`), and
//! anything else goes to the workload table.

use serde_json::{json, Value};

use super::starts::PendingCancel;
use super::table::DEFAULT_GRACE;
use super::Node;
use crate::logtext::shown;
use crate::protocol::commands::{CancelParams, CancelTarget, RequestId, Seconds};
use crate::protocol::messages::request_id_text;

impl Node {
    /// `cancel`: a start in flight gets its cancel recorded (and carried out once it runs);
    /// anything else goes to the workload table.
    pub(super) fn cancel(&mut self, request_id: &RequestId, params: CancelParams) {
        let rid = request_id.text();
        // Exactly once: a cancel seen before gets its original answer and nothing else.
        if let Some(e) = (!rid.is_empty())
            .then(|| self.durable.ledger.get(&rid))
            .flatten()
        {
            log::info!(
                "cancel {} was handled before; repeating its answer",
                shown(&rid)
            );
            let (ok, body) = (e.ok, e.body.clone());
            return self.replay(request_id.value(), ok, body);
        }
        let target = match &params.target {
            CancelTarget::Request(r) => self.starts.find_request(r),
            CancelTarget::Pid(_) => None,
        };
        let Some(safe_id) = target else {
            return self.cancel_command(request_id, params);
        };
        let asked = PendingCancel {
            signal: params.signal.number(),
            name: params.signal.name(),
            grace: params.grace.map_or(DEFAULT_GRACE, Seconds::duration),
        };
        let Some(kept) = self.starts.cancel(&safe_id, asked.clone()) else {
            return self.cancel_command(request_id, params);
        };
        let Some(st) = self.starts.get_mut(&safe_id) else {
            return;
        };
        let message = if kept == asked {
            format!(
                "Workload is starting; the cancel is recorded and {} goes to it as soon as its process runs",
                kept.name
            )
        } else {
            format!(
                "Workload is starting and a cancel with {} is recorded already",
                kept.name
            )
        };
        let out = json!({
            "message": message,
            "pid": 0,
            "workload_type": st.kind.as_str(),
            "workload_request_id": st.request_id,
            "signal": kept.name,
            "state": "starting",
        });
        log::info!(
            "cancel of {} recorded while it starts",
            shown(&request_id_text(&st.request_id))
        );
        if !rid.is_empty() {
            self.durable.ledger.record(&rid, true, out.clone());
        }
        self.reply_ok(request_id.value(), out);
    }

    /// A cancel of a tracked workload (or of one that finished already, D29).
    fn cancel_command(&mut self, request_id: &RequestId, params: CancelParams) {
        let rid = request_id.text();
        let request_id = request_id.value();
        let sig = params.signal.number();
        let sig_name = params.signal.name();
        let grace = params.grace.map_or(DEFAULT_GRACE, Seconds::duration);
        let found = self
            .active
            .iter()
            .find(|(_, a)| match &params.target {
                CancelTarget::Pid(p) => a.meta.pid() == p.get() && a.meta.pid() > 0,
                CancelTarget::Request(r) => &a.meta.request_id_text() == r,
            })
            .map(|(k, _)| k.clone());
        let Some(safe_id) = found else {
            // D29: a workload this node started, reported and forgot already finished.
            if let CancelTarget::Request(r) = &params.target {
                if self.durable.ledger.get(r).is_some_and(|e| e.ok) {
                    return self.reply_ok(
                        request_id,
                        json!({"message": "Workload already finished; its completion reports how it ended", "workload_request_id": r}),
                    );
                }
            }
            let msg = match &params.target {
                CancelTarget::Pid(p) => format!("No active workload found with PID {}", p.get()),
                CancelTarget::Request(r) => {
                    format!("No active workload found with request_id {r}")
                }
            };
            return self.reply_error(request_id, &msg);
        };
        match self
            .with_table(|t, out, now| t.cancel(&safe_id, sig, sig_name, grace, false, now, out))
        {
            Ok(message) => {
                let Some(a) = self.active.get(&safe_id) else {
                    return self.reply_ok(request_id, json!({"message": message}));
                };
                let out = json!({
                    "message": message,
                    "pid": a.meta.pid(),
                    "workload_type": a.meta.kind,
                    "workload_request_id": a.meta.request_id,
                    "signal": sig_name,
                });
                if !rid.is_empty() {
                    self.durable.ledger.record(&rid, true, out.clone());
                }
                self.reply_ok(request_id, out);
            }
            Err(e) => self.reply_error(request_id, &e),
        }
    }

    /// The answer a request had before, again (the ledger's `ok` output or `error` text).
    pub(super) fn replay(&mut self, request_id: &Value, ok: bool, body: Value) {
        if ok {
            self.reply_ok(request_id, body)
        } else {
            self.reply_error(request_id, body.as_str().unwrap_or(""))
        }
    }
}
