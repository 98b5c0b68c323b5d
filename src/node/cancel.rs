//! `cancel`: one ledger replay (a cancel seen before gets its original answer), then a start
//! in flight gets its cancel recorded (carried out once its process runs, `starts.rs`), and
//! anything else goes to the workload table.
//!
//! A cancel answered while its workload started (its stored answer says `starting`) is no plain
//! replay: that answer only promised the cancel. Asked again, it is decided again, so a
//! workload that runs (re-adopted after a restart, say) is cancelled, not told about; it gets
//! its original answer only when nothing it names is left to act on.

use std::time::Duration;

use serde_json::{json, Value};

use super::starts::{PendingCancel, Starts};
use super::table::{Table, DEFAULT_GRACE};
use super::workloads::Work;
use crate::ledger::{Entry, Ledger};
use crate::logtext::shown;
use crate::protocol::commands::request_id_text;
use crate::protocol::commands::{CancelParams, CancelTarget, RequestId, Seconds};
use crate::workload::Layout;

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
    layout: &Layout,
    request_id: &RequestId,
    params: &CancelParams,
) -> Step {
    let rid = request_id.text();
    // Exactly once: a cancel seen before gets its original answer and nothing else, unless
    // that answer was only a promise (recorded while its workload started).
    let stored = (!rid.is_empty())
        .then(|| ledger.get(&rid))
        .flatten()
        .cloned();
    if let Some(e) = &stored {
        if !promised(e) {
            log::info!(
                "cancel {} was handled before; repeating its answer",
                shown(&rid)
            );
            return Step::Answer(e.ok, e.body.clone());
        }
        log::info!(
            "cancel {} was recorded while its workload started; carrying it out if it runs",
            shown(&rid)
        );
    }
    let target = match &params.target {
        CancelTarget::Request(r) => starts.find_request(r),
        CancelTarget::Pid(_) => None,
    };
    let Some(safe_id) = target else {
        return command(ledger, active, params, stored.as_ref());
    };
    let asked = PendingCancel {
        signal: params.signal.number(),
        name: params.signal.name(),
        grace: params.grace.map_or(DEFAULT_GRACE, Seconds::duration),
    };
    let Some(kept) = starts.cancel(layout, &safe_id, asked.clone()) else {
        return command(ledger, active, params, stored.as_ref());
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

/// Whether a cancel's stored answer only promised it: recorded while its workload started.
fn promised(e: &Entry) -> bool {
    e.ok && e.body.get("state").and_then(Value::as_str) == Some("starting")
}

/// A cancel of a tracked workload (or of one that finished already, D29). `stored`: the
/// answer this cancel had (a promise), repeated when there is nothing to act on.
fn command(ledger: &Ledger, active: &Table, params: &CancelParams, stored: Option<&Entry>) -> Step {
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
        if let Some(e) = stored {
            return Step::Answer(e.ok, e.body.clone());
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

/// What a cancel's answer says of its workload, read before the table acts (a finalizing
/// workload whose uploads it abandons is reported, and no longer tracked, once it returns).
pub(super) fn named(active: &Table, safe_id: &str) -> Option<(i32, Value, Value)> {
    active
        .get(safe_id)
        .map(|a| (a.meta.pid(), json!(a.meta.kind), a.meta.request_id.clone()))
}

/// The reply to a cancel the table carried out (`Ok`: its message) or refused.
pub(super) fn answer(
    ledger: &mut Ledger,
    named: Option<(i32, Value, Value)>,
    request_id: &RequestId,
    sig_name: &str,
    result: Result<String, String>,
) -> (bool, Value) {
    let rid = request_id.text();
    match result {
        Ok(message) => {
            let Some((pid, kind, workload_rid)) = named else {
                return (true, json!({"message": message}));
            };
            let out = json!({
                "message": message,
                "pid": pid,
                "workload_type": kind,
                "workload_request_id": workload_rid,
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
    let layout = &w.io.layout;
    let (ok, body) = match decide(ledger, w.starts, w.active, layout, request_id, &params) {
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
            let named = named(w.active, &safe_id);
            let r = w.with_table(|t, w, fx, now| {
                t.cancel(&safe_id, sig, sig_name, grace, false, now, w, fx)
            });
            answer(ledger, named, request_id, sig_name, r)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::table::{Active, UploadCfg};
    use crate::workload::testkit::{good_meta, scratch};

    fn ask(rid: &str, params: Value) -> (RequestId, CancelParams) {
        (
            RequestId::parse(Some(&json!(rid))).unwrap(),
            CancelParams::parse(Some(&params)).unwrap(),
        )
    }

    /// A cancel answered "recorded" while its workload started (then lost with a killed node)
    /// acts when it is asked again and the workload runs; with nothing to act on it gets its
    /// answer again; any other answer is repeated without looking further.
    #[test]
    fn a_cancel_answered_while_its_workload_started_is_decided_again_when_asked_again() {
        let layout = scratch("cancel-promise");
        let mut ledger = Ledger::load(layout.state.join("requests.jsonl"));
        let mut starts = Starts::new(Err("no spawner".into()), crossbeam_channel::never());
        let mut table = Table::new(UploadCfg {
            enabled: false,
            folder: layout.state.join("results"),
            max_bytes: 1,
            workers: 1,
            records: layout.workloads(),
            ledger: layout.state.join("loose.json"),
            checked: None,
            deadline: None,
        });
        let (c1, params) = ask("c1", json!({"workload_request_id": "r1"}));
        let promise = json!({"message": "Workload is starting; …", "pid": 0, "state": "starting"});
        ledger.record("c1", true, promise.clone());
        let step = decide(&mut ledger, &mut starts, &table, &layout, &c1, &params);
        assert!(
            matches!(&step, Step::Answer(true, b) if *b == promise),
            "nothing to act on: the promise again"
        );
        let meta = serde_json::from_value(good_meta(&layout)).unwrap();
        table.insert("w1".into(), Active::new(meta, std::time::Instant::now()));
        let step = decide(&mut ledger, &mut starts, &table, &layout, &c1, &params);
        assert!(
            matches!(&step, Step::Table { safe_id, sig, .. } if safe_id == "w1" && *sig == libc::SIGTERM),
            "the running workload is cancelled"
        );
        // An answer that was no promise is repeated, whatever runs now.
        let (c2, params) = ask("c2", json!({"workload_request_id": "r1"}));
        let done = json!({"message": "Workload cancelled with SIGTERM", "pid": 5});
        ledger.record("c2", true, done.clone());
        let step = decide(&mut ledger, &mut starts, &table, &layout, &c2, &params);
        assert!(matches!(&step, Step::Answer(true, b) if *b == done));
        std::fs::remove_dir_all(&layout.state).unwrap();
    }
}
