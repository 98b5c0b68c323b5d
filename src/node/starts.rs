//! The start path: a start command is checked on the loop (exactly once per request id, within
//! capacity, GPUs) and the workload is started under its supervisor.

use std::time::Instant;

use serde_json::{json, Map, Value};

use super::operate::{Busy, BUSY_PREFIX};
use super::workloads::{start_output, Active};
use super::Node;
use crate::logtext::shown;
use crate::protocol::commands::{Kind, Seconds, StartParams};
use crate::protocol::messages::request_id_text;
use crate::store;
use crate::workload::{self, StartRequest};

impl Node {
    // ---- start ------------------------------------------------------------------------------

    pub(super) fn start_workload(&mut self, kind: Kind, request_id: &Value, params: StartParams) {
        self.start_workload_inner(kind, request_id, params, true);
    }

    /// A start after the self-heal pass it waited for: no second wait.
    pub(super) fn start_workload_now(
        &mut self,
        kind: Kind,
        request_id: &Value,
        params: StartParams,
    ) {
        self.start_workload_inner(kind, request_id, params, false);
    }

    fn start_workload_inner(
        &mut self,
        kind_t: Kind,
        request_id: &Value,
        start: StartParams,
        may_wait: bool,
    ) {
        let kind = kind_t.as_str();
        let rid = request_id_text(request_id);
        let rid = if rid.is_empty() {
            format!(
                "auto-{}-{}",
                workload::unix_now() as u64,
                crate::util::hex(&crate::util::random_bytes::<4>())
            )
        } else {
            rid
        };
        let safe_id = store::safe_id(&rid);
        // Exactly once: a request id seen before gets its original answer and nothing else.
        if let Some(e) = self.ledger.get(&rid).cloned() {
            log::info!(
                "request {} was handled before; repeating its answer",
                shown(&rid)
            );
            return if e.ok {
                self.reply_ok(request_id, e.body)
            } else {
                self.reply_error(request_id, e.body.as_str().unwrap_or(""))
            };
        }
        if let Some(a) = self.active.get(&safe_id) {
            let out = start_output(&a.meta);
            return self.reply_ok(request_id, out);
        }
        let workload_uuid = start.workload_uuid.as_ref().map(|u| u.as_str().to_string());
        let ctx = super::ingress::context_of(kind, &start.params);
        let Some(template) = self.s.command_template(kind).map(String::from) else {
            let cap = match kind_t {
                Kind::Inference => "Inference",
                Kind::Simulate => "Simulate",
                Kind::Training => "Training",
            };
            let why = format!("{cap} command not configured in cyberwave.yml");
            return self.reject_start(request_id, workload_uuid.as_deref(), &why, None, ctx);
        };
        if let Some((why, busy)) = self.start_guard() {
            return self.reject_start(request_id, workload_uuid.as_deref(), &why, Some(busy), ctx);
        }
        // GPUs (D36) before capacity: with `auto`, a full node is a node without free GPUs.
        let gpus = match self.assign_gpus(start.gpus) {
            Ok(g) => g,
            Err((why, busy)) => {
                if busy == Some(Busy::GpusBusy)
                    && may_wait
                    && self.defer_start_for_heal(kind_t, request_id, &start)
                {
                    return;
                }
                return self.reject_start(request_id, workload_uuid.as_deref(), &why, busy, ctx);
            }
        };
        let capacity = self.s.max_concurrent_workloads.value as usize;
        if self.active.len() >= capacity
            && may_wait
            && self.defer_start_for_heal(kind_t, request_id, &start)
        {
            return;
        }
        if self.active.len() >= capacity {
            let what = if kind == "inference" {
                "controller"
            } else {
                "workload"
            };
            let uploading = self.uploading();
            let (detail, busy) = if uploading > 0 {
                (format!(" ({uploading} uploading results)"), Busy::Uploading)
            } else {
                (String::new(), Busy::Capacity)
            };
            let why = format!(
                "{BUSY_PREFIX} {} active workload(s){detail}. Stop the existing {what} before starting a new one.",
                self.active.len()
            );
            return self.reject_start(request_id, workload_uuid.as_deref(), &why, Some(busy), ctx);
        }
        // Both limits are bounded (D20): the manifest's by the configuration, the command's
        // by its type; the shorter wins.
        let manifest_limit = self
            .s
            .manifest
            .as_ref()
            .and_then(|m| m.max_runtime_seconds)
            .and_then(Seconds::from_f64);
        let max_runtime_s = match (manifest_limit, start.max_runtime) {
            (Some(m), Some(p)) => Some(m.get().min(p.get())),
            (m, p) => m.or(p).map(Seconds::get),
        };
        let params = start.params;
        let req = StartRequest {
            kind,
            request_id,
            safe_id: &safe_id,
            params,
            template: &template,
            node_token: &self.token,
            max_runtime_s,
            workflow: ctx.clone(),
            socket: self.layout.state.join("control.sock"),
            gpus,
            results_dir: self.results_dir_for(&safe_id),
        };
        let t0 = Instant::now();
        match workload::start(&self.s, &self.layout, &self.exe, req) {
            Ok(meta) => {
                self.reaper.spawned();
                log::info!(
                    "{kind} {} started: pid {} in {:.1} ms; logs {} and {}",
                    shown(&rid),
                    meta.pid(),
                    t0.elapsed().as_secs_f64() * 1e3,
                    meta.stdout_log.display(),
                    meta.stderr_log.display()
                );
                let out = start_output(&meta);
                self.ledger.record(&rid, true, out.clone());
                self.reply_ok(request_id, out);
                if let Some(wl) = &meta.workload_uuid {
                    let body = json!({"status": "running", "message": format!("{kind} started in background"), "pid": meta.pid()});
                    self.workload_status(wl, body);
                }
                self.report_started(&meta);
                self.metrics.starts = self.metrics.starts.saturating_add(1);
                if self.s.drain_after_one {
                    self.one_started = true;
                    self.set_draining(true, "--drain-after-one");
                }
                let now = self.clock.now();
                self.active.insert(safe_id, Active::new(meta, true, now));
                self.gpu_update_sampling();
            }
            Err(e) => {
                let why = format!("Failed to start {kind}: {e}");
                log::error!("{why}");
                self.reject_start(request_id, workload_uuid.as_deref(), &why, None, ctx);
            }
        }
    }

    /// An error reply and, when the backend named the workload, R7 `failed` (protocol §4.3.3).
    /// A `busy` refusal keeps the host-busy contract (D13, D21); any other cannot succeed here.
    fn reject_start(
        &mut self,
        request_id: &Value,
        workload_uuid: Option<&str>,
        why: &str,
        busy: Option<Busy>,
        ctx: Option<workload::WorkflowCtx>,
    ) {
        self.report_rejected(ctx, why);
        self.count_rejection(busy.map_or(
            if why.contains("not configured") {
                "not_configured"
            } else {
                "failed_to_start"
            },
            Busy::reason,
        ));
        log::warn!(
            "refused start {}: {}",
            shown(&request_id_text(request_id)),
            shown(why)
        );
        self.reply_error(request_id, why);
        if let Some(wl) = workload_uuid {
            let mut body = Map::new();
            body.insert("status".into(), json!("failed"));
            body.insert("error".into(), json!(why));
            body.insert("failure_detail".into(), json!(why));
            if let Some(b) = busy {
                body.insert("rejection_reason".into(), json!("host_busy"));
                body.insert("busy_reason".into(), json!(b.reason()));
                body.insert("rejecting_instance_uuid".into(), json!(self.uuid()));
            }
            self.workload_status(wl, Value::Object(body));
        }
    }
}
