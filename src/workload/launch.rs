//! Starting a workload under the shim, step 1 of 2: its directory, params, record and the shim
//! forked ([`super::settle`] is step 2).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Map, Value};

use super::environment::NODE_ONLY_VARS;
use super::inputs::{
    module_function, module_of, save_image, shell_quote, MODULE_RUNNER, PLATFORM_PARAMS,
};
use super::record::{unix_now, Layout, Meta, Phase, WorkflowCtx};
use super::shim::ShimArgs;
use super::{procinfo, user};
use crate::config::Settings;
use crate::store;

/// What a start needs beyond the settings (owned: it travels to the spawner thread).
#[derive(Debug, Clone)]
pub struct StartRequest {
    pub kind: String,
    pub request_id: Value,
    pub safe_id: String,
    pub params: Map<String, Value>,
    pub template: String,
    /// The node's own API token (empty in standalone mode).
    pub node_token: String,
    pub max_runtime_s: Option<f64>,
    pub workflow: Option<WorkflowCtx>,
    /// The node's control socket, for `emit`.
    pub socket: PathBuf,
    /// Its GPUs (D36): `Some` sets the CUDA/NVIDIA variables (an empty list hides every GPU).
    pub gpus: Option<Vec<String>>,
    /// This workload's own results folder (D24), when result uploads are on.
    pub results_dir: Option<PathBuf>,
    /// Its secret for `emit` (chosen by the node, which must know it before the workload runs).
    pub event_token: String,
    /// The node's instance UUID (`CYBERWAVE_CLOUD_NODE_ID`, D45).
    pub node_uuid: String,
}

/// A shim that was forked and has not reported the workload's pid yet.
pub struct Launched {
    /// The record as written (not yet synced): phase `Starting`, no pid.
    pub meta: Meta,
    pub shim_pid: i32,
    /// The shim's start time (its identity, read right after the fork).
    pub shim_start_ticks: u64,
    pub(super) child: std::process::Child,
}

/// Starts a workload under the shim, step 1 of 2 (on the spawner thread): its directory, params
/// and record (`meta.json`, phase `starting`, written atomically but not yet synced), then the
/// shim forked. [`settle`] then reads the pid, and [`make_durable`] syncs the record once the
/// workload runs (a sync forces a journal commit, which would hold up the files the shim and
/// the workload create as they start). On `Err` nothing was forked and the directory is gone.
///
/// Crash safety of the order: a node killed at any point leaves what it wrote in the page cache
/// (a record written is read back by the next node, synced or not); only a host crash loses
/// unsynced files, and it ends the workload too. The start is answered (and recorded in the
/// ledger) only after [`make_durable`], so an answered start always has its durable record.
pub fn launch(
    s: &Settings,
    layout: &Layout,
    exe: &Path,
    req: StartRequest,
) -> Result<Launched, String> {
    let dir = layout.dir(&req.safe_id);
    store::ensure_private_dir(&layout.workloads())
        .map_err(|e| format!("cannot create {}: {e}", layout.workloads().display()))?;
    std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let result = launch_in(s, layout, exe, &dir, req);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn launch_in(
    s: &Settings,
    layout: &Layout,
    exe: &Path,
    dir: &Path,
    mut req: StartRequest,
) -> Result<Launched, String> {
    // D46.3: looked up at each start (the node checked it at its own start, exit 2 if wrong).
    let user = match s.manifest.as_ref().and_then(|m| m.workload_user.as_deref()) {
        Some(spec) => Some(user::lookup(spec)?),
        None => None,
    };
    // With a workload user the record's dir is passed through (to its params file), not listed.
    let mode = if user.is_some() { 0o711 } else { 0o700 };
    let _ = std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(mode));
    store::ensure_private_dir(&layout.logs())
        .map_err(|e| format!("cannot create {}: {e}", layout.logs().display()))?;
    let give = |path: &Path| -> Result<(), String> {
        match &user {
            Some(u) => user::hand_over(path, u).map_err(|e| {
                format!(
                    "cannot hand {} to workload_user {}: {e}",
                    path.display(),
                    u.name
                )
            }),
            None => Ok(()),
        }
    };
    if user.is_some() {
        user::traversable(&layout.workloads()).map_err(|e| {
            format!(
                "cannot open {} to the workload user: {e}",
                layout.workloads().display()
            )
        })?;
    }
    let token = req
        .params
        .remove("cyberwave_workload_token")
        .and_then(|v| v.as_str().map(String::from));
    let workload_uuid = req
        .params
        .get("workload_uuid")
        .and_then(Value::as_str)
        .map(String::from);
    // Module dispatch: a missing file is refused before anything is written; the platform's
    // own keys are not the function's arguments.
    let module = module_of(&req.template).map(|m| (m, s.working_dir.join(m)));
    if let Some((value, path)) = &module {
        if !path.is_file() {
            return Err(format!(
                "Module not found: {value}. Check '{}: {value}' in cyberwave.yml.",
                req.kind
            ));
        }
        req.params
            .retain(|k, _| !PLATFORM_PARAMS.contains(&k.as_str()) && !k.starts_with("workflow_"));
    }
    let stem = format!("{}_{}", req.kind, req.safe_id);
    if let Some(b64) = req
        .params
        .get("image_bytes_base64")
        .and_then(Value::as_str)
        .filter(|b| !b.is_empty())
    {
        match save_image(layout, &stem, b64) {
            Ok(name) => {
                if user.is_some() {
                    let _ = user::traversable(&layout.inputs());
                    give(&layout.inputs().join(&name))?;
                }
                req.params.remove("image_bytes_base64");
                req.params.insert("image".into(), Value::String(name));
            }
            Err(e) => log::warn!(
                "workload {}: image_bytes_base64 not decoded ({e}); params passed on unchanged",
                req.safe_id
            ),
        }
    }
    let params_file = dir.join("params.json");
    let params_json = serde_json::to_vec(&Value::Object(req.params)).map_err(|e| e.to_string())?;
    // Not synced: the workload needs it complete, not durable (after a host crash the workload
    // is reported lost anyway).
    store::write_replace_unsynced(&params_file, &params_json, 0o600)
        .map_err(|e| format!("cannot write the params file: {e}"))?;
    give(&params_file)?;
    let command = match &module {
        None => req
            .template
            .replace("{body}", &shell_quote(&params_file.display().to_string())),
        Some((value, path)) => {
            let runner = dir.join("module_runner.py");
            store::write_replace_unsynced(&runner, MODULE_RUNNER.as_bytes(), 0o600)
                .map_err(|e| format!("cannot write the module runner: {e}"))?;
            give(&runner)?;
            let python = s
                .env
                .value("CYBERWAVE_PYTHON")
                .filter(|p| !p.trim().is_empty())
                .unwrap_or_else(|| "python3".into());
            format!(
                "exec {} {} {} {} {} {}",
                shell_quote(python.trim()),
                shell_quote(&runner.display().to_string()),
                shell_quote(&path.display().to_string()),
                module_function(&req.kind),
                shell_quote(&params_file.display().to_string()),
                shell_quote(value)
            )
        }
    };
    let stdout_log = layout.logs().join(format!("{stem}.stdout.log"));
    let stderr_log = layout.logs().join(format!("{stem}.stderr.log"));
    let meta = Meta {
        safe_id: req.safe_id.clone(),
        kind: req.kind.clone(),
        request_id: req.request_id.clone(),
        workload_uuid: workload_uuid.clone(),
        created_unix: unix_now(),
        command: command.clone(),
        stdout_log: stdout_log.clone(),
        stderr_log: stderr_log.clone(),
        max_runtime_s: req.max_runtime_s,
        phase: Phase::Starting,
        started: None,
        cancel: None,
        workflow: req.workflow.clone(),
        event_token: req.event_token.clone(),
        gpus: req.gpus.clone(),
        salvaged: None,
    };
    // Atomic (a reader never sees half of it) but not synced here: [`make_durable`] syncs it
    // while the shim starts the workload.
    let json = serde_json::to_vec_pretty(&meta).map_err(|e| e.to_string())?;
    store::write_replace_unsynced(&layout.meta(&meta.safe_id), &json, 0o600)
        .map_err(|e| format!("cannot write the workload record: {e}"))?;

    // The workload's environment (D2/D3 and the per-workload token of ecosystem §5).
    let mut env: BTreeMap<String, String> = s.env.merged();
    for k in NODE_ONLY_VARS {
        env.remove(*k);
    }
    // The simulated slow disk (`store::slow_disk_pause`) is the node's own, not its workloads'.
    env.remove("CYBERWAVE_TEST_SLOW_FSYNC_MS");
    let credential = token.unwrap_or_else(|| req.node_token.clone());
    if !credential.is_empty() {
        env.insert("CYBERWAVE_API_KEY".into(), credential.clone());
        env.insert("CYBERWAVE_MQTT_PASSWORD".into(), credential);
    }
    env.insert(
        "CYBERWAVE_PARAMS_FILE".into(),
        params_file.display().to_string(),
    );
    // An environment value cannot hold NUL; such an id is passed with NUL as U+FFFD.
    env.insert(
        "CYBERWAVE_REQUEST_ID".into(),
        meta.request_id_text().replace('\0', "\u{FFFD}"),
    );
    env.insert("CYBERWAVE_WORKLOAD_TYPE".into(), req.kind.clone());
    if let Some(d) = &req.results_dir {
        give(d)?;
        env.insert("CYBERWAVE_RESULTS_DIR".into(), d.display().to_string());
    }
    if let Some(u) = &user {
        env.insert("HOME".into(), u.home.display().to_string());
        env.insert("USER".into(), u.name.clone());
        env.insert("LOGNAME".into(), u.name.clone());
    }
    env.insert(
        "CYBERWAVE_INPUTS_DIR".into(),
        layout.inputs().display().to_string(),
    );
    env.insert(
        "CYBERWAVE_NODE_SOCKET".into(),
        req.socket.display().to_string(),
    );
    env.insert("CYBERWAVE_NODE_BIN".into(), exe.display().to_string());
    env.insert(
        "CYBERWAVE_NODE_EVENT_TOKEN".into(),
        meta.event_token.clone(),
    );
    if let Some(wl) = &workload_uuid {
        env.insert("CYBERWAVE_WORKLOAD_UUID".into(), wl.clone());
    }
    env.insert("CYBERWAVE_BASE_URL".into(), s.base_url.value.clone());
    env.insert("CYBERWAVE_MQTT_HOST".into(), s.mqtt_host.value.clone());
    env.insert("CYBERWAVE_MQTT_PORT".into(), s.mqtt_port.value.to_string());
    env.insert(
        "CYBERWAVE_MQTT_USE_TLS".into(),
        s.mqtt_use_tls.value.to_string(),
    );
    env.insert(
        "CYBERWAVE_MQTT_TOPIC_PREFIX".into(),
        s.topic_prefix.value.clone(),
    );
    // D45: what the platform SDK and edge-core read. Edge-core labels the containers a
    // workload starts with this node and workload (`container_spec.workload_labels`); the SDK
    // takes the broker's CA under its own name.
    env.insert("CYBERWAVE_CLOUD_NODE_ID".into(), req.node_uuid.clone());
    if let Some(ca) = s.mqtt_ca_certs.as_ref().filter(|_| s.mqtt_use_tls.value) {
        for name in ["CYBERWAVE_MQTT_TLS_CA_CERTS", "CYBERWAVE_MQTT_TLS_CA_CERT"] {
            env.insert(name.into(), ca.value.display().to_string());
        }
    }
    if let Some(gpus) = &req.gpus {
        // D36: exactly its GPUs, by UUID; none at all when it needs none.
        let list = gpus.join(",");
        env.insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
        env.insert("CUDA_VISIBLE_DEVICES".into(), list.clone());
        let nvidia = if list.is_empty() { "none".into() } else { list };
        env.insert("NVIDIA_VISIBLE_DEVICES".into(), nvidia);
    }

    let shell = if Path::new("/bin/bash").exists() || Path::new("/usr/bin/bash").exists() {
        "bash"
    } else {
        "sh"
    };
    let args = ShimArgs {
        dir: dir.to_path_buf(),
        cwd: s.working_dir.clone(),
        stdout: stdout_log,
        stderr: stderr_log,
        shell: shell.to_string(),
        command,
        cleanup_grace_ms: u64::try_from(s.tuning.cleanup_grace.as_millis()).unwrap_or(u64::MAX),
        user: user.as_ref().map(user::WorkloadUser::ids),
    };
    let shim_log = store::create_state_file(&dir.join("shim.log"), 0o600)
        .map_err(|e| format!("cannot create the shim log: {e}"))?;
    let mut cmd = Command::new(exe);
    crate::fds::no_inherited_fds(&mut cmd);
    let child = cmd
        .args(args.to_args())
        .env_clear()
        .envs(&env)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(shim_log)
        .spawn()
        .map_err(|e| {
            format!(
                "cannot start the workload supervisor {}: {e}",
                exe.display()
            )
        })?;
    let shim_pid = i32::try_from(child.id()).unwrap_or(0);
    Ok(Launched {
        meta,
        shim_pid,
        shim_start_ticks: procinfo::start_ticks(shim_pid).unwrap_or(0),
        child,
    })
}
