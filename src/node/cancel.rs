//! `cancel`: one ledger replay (a cancel seen before gets its original answer), then a start
//! in flight gets its cancel recorded (carried out once its process runs, `starts.rs`), and
//! anything else goes to the workload table.

use std::time::Duration;

use serde_json::{json, Value};

use super::starts::{PendingCancel, Starts};
use super::table::{Table, DEFAULT_GRACE};
use super::workloads::Work;
use crate::ledger::Ledger;
use crate::logtext::shown;
use crate::protocol::commands::request_id_text;
use crate::protocol::commands::{CancelParams, CancelTarget, RequestId, Seconds};

/// What a cancel comes to before the workload table is asked.
pub(super) enum Step {
    /// A start in flight that is gone already: no answer.
    Nothing,
    /// The answer: `ok` with its output, or the error text (a replay, a cancel recorded while
    /// starting, nothing found).
    Answer(bool, Value),
    /// A tracked workload: the table cancels it, then [`answer`] makes the reply.
    Table {
        safe_id: String,
        sig: i32,
        sig_name: &'static str,
        grace: Duration,
    },
}

/// `cancel`: a start in flight gets its cancel recorded (and carried out once it runs);
/// anything else goes to the workload table.
pub(super) fn decide(
    ledger: &mut Ledger,
    starts: &mut Starts,
    active: &Table,
    request_id: &RequestId,
    params: &CancelParams,
) -> Step {
    let rid = request_id.text();
    // Exactly once: a cancel seen before gets its original answer and nothing else.
    if let Some(e) = (!rid.is_empty()).then(|| ledger.get(&rid)).flatten() {
        log::info!(
            "cancel {} was handled before; repeating its answer",
            shown(&rid)
        );
        return Step::Answer(e.ok, e.body.clone());
    }
    let target = match &params.target {
        CancelTarget::Request(r) => starts.find_request(r),
        CancelTarget::Pid(_) => None,
    };
    let Some(safe_id) = target else {
        return command(ledger, active, params);
    };
    let asked = PendingCancel {
        signal: params.signal.number(),
        name: params.signal.name(),
        grace: params.grace.map_or(DEFAULT_GRACE, Seconds::duration),
    };
    let Some(kept) = starts.cancel(&safe_id, asked.clone()) else {
        return command(ledger, active, params);
    };
    let Some(st) = starts.get_mut(&safe_id) else {
        return Step::Nothing;
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
        ledger.record(&rid, true, out.clone());
    }
    Step::Answer(true, out)
}

/// A cancel of a tracked workload (or of one that finished already, D29).
fn command(ledger: &Ledger, active: &Table, params: &CancelParams) -> Step {
    let sig = params.signal.number();
    let sig_name = params.signal.name();
    let grace = params.grace.map_or(DEFAULT_GRACE, Seconds::duration);
    let found = active
        .iter()
        .find(|(_, a)| match &params.target {
            CancelTarget::Pid(p) => a.meta.pid() == p.get() && a.meta.pid() > 0,
            CancelTarget::Request(r) => &a.meta.request_id_text() == r,
        })
        .map(|(k, _)| k.clone());
    let Some(safe_id) = found else {
        // D29: a workload this node started, reported and forgot already finished.
        if let CancelTarget::Request(r) = &params.target {
            if ledger.get(r).is_some_and(|e| e.ok) {
                return Step::Answer(
                    true,
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
        return Step::Answer(false, json!(msg));
    };
    Step::Table {
        safe_id,
        sig,
        sig_name,
        grace,
    }
}

/// The reply to a cancel the table carried out (`Ok`: its message) or refused.
pub(super) fn answer(
    ledger: &mut Ledger,
    active: &Table,
    request_id: &RequestId,
    safe_id: &str,
    sig_name: &str,
    result: Result<String, String>,
) -> (bool, Value) {
    let rid = request_id.text();
    match result {
        Ok(message) => {
            let Some(a) = active.get(safe_id) else {
                return (true, json!({"message": message}));
            };
            let out = json!({
                "message": message,
                "pid": a.meta.pid(),
                "workload_type": a.meta.kind,
                "workload_request_id": a.meta.request_id,
                "signal": sig_name,
            });
            if !rid.is_empty() {
                ledger.record(&rid, true, out.clone());
            }
            (true, out)
        }
        Err(e) => (false, json!(e)),
    }
}

/// `cancel`: decided on the ledger, the starts and the table ([`decide`]); a tracked workload
/// is cancelled by the table, then answered ([`answer`]).
pub(super) fn cancel(
    ledger: &mut Ledger,
    w: &mut Work<'_>,
    request_id: &RequestId,
    params: CancelParams,
) {
    let (ok, body) = match decide(ledger, w.starts, w.active, request_id, &params) {
        Step::Nothing => return,
        Step::Answer(false, body) => match service(ledger, w, request_id, &params) {
            Some(out) => (true, out),
            None => (false, body),
        },
        Step::Answer(ok, body) => (ok, body),
        Step::Table {
            safe_id,
            sig,
            sig_name,
            grace,
        } => {
            let r = w.with_table(|t, out, now| {
                t.cancel(&safe_id, sig, sig_name, grace, false, now, out)
            });
            answer(ledger, w.active, request_id, &safe_id, sig_name, r)
        }
    };
    w.replies().replay(request_id.value(), ok, body);
}

/// D59: a cancel whose pid is no workload's but a service's stops that service (its session:
/// the signal asked for, SIGKILL after the grace); `None` when no service has that pid, or
/// when the ledger answered this cancel already.
fn service(
    ledger: &mut Ledger,
    w: &mut Work<'_>,
    request_id: &RequestId,
    params: &CancelParams,
) -> Option<Value> {
    let CancelTarget::Pid(pid) = &params.target else {
        return None;
    };
    let rid = request_id.text();
    if !rid.is_empty() && ledger.get(&rid).is_some() {
        return None;
    }
    let grace = params.grace.map_or(DEFAULT_GRACE, Seconds::duration);
    let sig = (params.signal.number(), params.signal.name());
    let now = w.now();
    let out = w.services.cancel(pid.get(), sig, grace, now)?;
    if !rid.is_empty() {
        ledger.record(&rid, true, out.clone());
    }
    Some(out)
}
