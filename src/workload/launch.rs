//! Starting a workload under the shim, step 1 of 2: its directory, params, record and the shim
//! started ([`super::spawner`] does step 2).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};

use super::environment;
use super::error::SpawnError;
use super::inputs;
use super::procinfo;
use super::record::{unix_now, Layout, Meta};
use super::request::StartRequest;
use super::results;
use super::shim::ShimArgs;
use super::user::{self, WorkloadUser};
use crate::config::Settings;
use crate::protocol::commands::TopicId;
use crate::store;

/// A shim that was started and has not reported the workload's pid yet.
pub struct Launched {
    /// The record as written (not yet synced), no pid.
    pub meta: Meta,
    /// The shim, its stdout our end of its pid line. Not waited for here once it reported: the
    /// reaper thread reaps it when it ends.
    pub child: std::process::Child,
    /// The shim's start time (its identity, read right after the start).
    pub shim_start_ticks: u64,
}

/// Starts a workload under the shim, step 1 of 2 (on the spawner thread): its directory, params
/// and record (`meta.json`, without a pid, written atomically but not yet synced), then the
/// shim started. [`super::settle`] then reads the pid, and [`super::make_durable`] syncs the
/// record once the workload runs (a sync forces a journal commit, which would hold up the files
/// the shim and the workload create as they start). On `Err` nothing was started and the
/// directory is gone.
///
/// Crash safety of the order: a node killed at any point leaves what it wrote in the page cache
/// (a record written is read back by the next node, synced or not); only a host crash loses
/// unsynced files, and it ends the workload too. The start is answered (and recorded in the
/// ledger) only after [`super::make_durable`], so an answered start always has its durable
/// record.
pub fn launch(
    s: &Settings,
    layout: &Layout,
    exe: &Path,
    req: StartRequest,
) -> Result<Launched, SpawnError> {
    let dir = layout.dir(&req.safe_id);
    store::ensure_private_dir(&layout.workloads()).map_err(|source| SpawnError::CreateDir {
        path: layout.workloads(),
        source,
    })?;
    // 0o700 from the start (a workload user's start opens it to 0o711 next).
    std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
        .create(&dir)
        .map_err(|source| SpawnError::CreateDir {
            path: dir.clone(),
            source,
        })?;
    // What the start made outside its directory, removed if it fails (a full disk: nothing
    // half-written is left behind).
    let mut made = Made::default();
    let result = launch_in(s, layout, exe, &dir, req, &mut made);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&dir);
        if let Some(image) = &made.image {
            let _ = std::fs::remove_file(image);
        }
        if let Some(results) = &made.results {
            // Its own folder, new and empty: never a link (rmdir does not follow one).
            let _ = std::fs::remove_dir(results);
        }
    }
    result
}

/// What a start made outside its directory.
#[derive(Default)]
struct Made {
    image: Option<std::path::PathBuf>,
    results: Option<std::path::PathBuf>,
}

fn launch_in(
    s: &Settings,
    layout: &Layout,
    exe: &Path,
    dir: &Path,
    mut req: StartRequest,
    made: &mut Made,
) -> Result<Launched, SpawnError> {
    let user = req.user.clone();
    let user = user.as_ref();
    prepare_dirs(layout, dir, user)?;
    req.results_dir = prepare_results(&req, dir, user, made)?;
    let token = req
        .params
        .remove("cyberwave_workload_token")
        .and_then(|v| v.as_str().map(String::from));
    // As the edge typed it, never read again from the raw params (where `"None"` is text).
    let workload_uuid = req.workload_uuid.clone();
    // Module dispatch: a missing file is refused before anything is written; the platform's
    // own keys are not the function's arguments.
    let module = inputs::module_file(s, &req.template, req.kind.as_str())?;
    if module.is_some() {
        inputs::drop_platform_params(&mut req.params);
    }
    let stem = format!("{}_{}", req.kind.as_str(), req.safe_id);
    made.image = inputs::inline_image(layout, &stem, &req.safe_id, &mut req.params, user)?;
    let params_file = dir.join("params.json");
    let params = std::mem::take(&mut req.params);
    let command = inputs::command_line(s, dir, &req, module.as_ref(), &params_file, user)?;
    let meta = record(layout, &req, workload_uuid, command, &stem);
    // The workload's environment (D2/D3, D45, and the per-workload token the backend mints, D62).
    let env = environment::of(
        s,
        &meta,
        &environment::Context {
            workload_token: token,
            node_token: &req.node_token,
            params_file: &params_file,
            results_dir: req.results_dir.as_deref(),
            user,
            inputs: layout.inputs(),
            socket: &req.socket,
            exe,
            node_uuid: &req.node_uuid,
        },
    );
    inputs::write_params(dir, params, user)?;
    write_record(layout, &meta)?;
    let args = shim_args(s, dir, &meta, user);
    let shim_log =
        store::create_state_file(&dir.join("shim.log"), 0o600).map_err(SpawnError::ShimLog)?;
    start_shim(exe, dir, meta, &args, &env, shim_log)
}

/// The folders the start writes to, open to the workload user (D46.3, chosen by the node's
/// loop among its pool, D65) as far as it needs.
fn prepare_dirs(
    layout: &Layout,
    dir: &Path,
    user: Option<&WorkloadUser>,
) -> Result<(), SpawnError> {
    // With a workload user the record's dir is passed through (to its params file), not listed.
    if user.is_some() {
        let _ = std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o711));
    }
    store::ensure_private_dir(&layout.logs()).map_err(|source| SpawnError::CreateDir {
        path: layout.logs(),
        source,
    })?;
    if user.is_some() {
        user::traversable(&layout.workloads()).map_err(|source| SpawnError::OpenToUser {
            path: layout.workloads(),
            source,
        })?;
    }
    Ok(())
}

/// D24: the workload's own results folder, made new and empty here (not on the node's loop,
/// never through a link, D65), and D61: its record of what `results_folder` held before it
/// runs and of the names its loose results may bear, written before it runs. A folder that
/// cannot be made is not passed on (the workload gets no `CYBERWAVE_RESULTS_DIR`).
fn prepare_results(
    req: &StartRequest,
    dir: &Path,
    user: Option<&WorkloadUser>,
    made: &mut Made,
) -> Result<Option<std::path::PathBuf>, SpawnError> {
    let Some((own, folder)) = req
        .results_dir
        .as_ref()
        .and_then(|d| Some((d, d.parent()?)))
    else {
        return Ok(None);
    };
    let (before, complete) = results::snapshot(folder);
    if !complete {
        log::warn!(
            "the results folder {} holds more than {} files: no file written straight into it is taken for {}'s result (its own folder is)",
            folder.display(),
            results::MAX_FILES,
            crate::logtext::shown(&req.safe_id)
        );
    }
    let made_dir = match results::make_dir(folder, &req.safe_id, user) {
        Ok(_) => {
            made.results = Some(own.clone());
            true
        }
        Err(e) => {
            log::warn!(
                "cannot create the results folder {}: {e}; the workload gets no CYBERWAVE_RESULTS_DIR",
                own.display()
            );
            false
        }
    };
    let claim = results::Claim {
        made: made_dir,
        names: results::names_of(
            req.workload_uuid.as_ref().map(TopicId::as_str),
            &crate::protocol::commands::request_id_text(&req.request_id),
            &req.params,
        ),
        complete,
        before: before.into_iter().collect(),
    };
    claim.save(dir).map_err(|source| SpawnError::Write {
        what: "the record of the results folder",
        source,
    })?;
    Ok(made_dir.then(|| own.clone()))
}

/// The workload's record (no pid yet).
fn record(
    layout: &Layout,
    req: &StartRequest,
    workload_uuid: Option<TopicId>,
    command: String,
    stem: &str,
) -> Meta {
    Meta {
        safe_id: req.safe_id.clone(),
        kind: req.kind.into(),
        request_id: req.request_id.clone(),
        workload_uuid,
        created_unix: unix_now(),
        command,
        stdout_log: layout.logs().join(format!("{stem}.stdout.log")),
        stderr_log: layout.logs().join(format!("{stem}.stderr.log")),
        max_runtime_s: req.max_runtime_s,
        started: None,
        cancel: None,
        workflow: req.workflow.clone(),
        event_token: req.event_token.clone(),
        gpus: req.gpus.clone(),
        uid: req.user.as_ref().map(|u| u.uid),
        salvaged: None,
    }
}

/// Writes the workload's record atomically (a reader never sees half of it) but does not sync
/// it here: [`super::make_durable`] syncs it while the shim starts the workload.
fn write_record(layout: &Layout, meta: &Meta) -> Result<(), SpawnError> {
    let json = serde_json::to_vec_pretty(meta)?;
    store::write_replace_unsynced(&layout.meta(&meta.safe_id), &json, 0o600).map_err(|source| {
        SpawnError::Write {
            what: "the workload record",
            source,
        }
    })
}

/// The supervisor's arguments for the workload of `meta`.
fn shim_args(
    s: &Settings,
    dir: &Path,
    meta: &Meta,
    user: Option<&WorkloadUser>,
) -> Vec<std::ffi::OsString> {
    let shell = if Path::new("/bin/bash").exists() || Path::new("/usr/bin/bash").exists() {
        "bash"
    } else {
        "sh"
    };
    ShimArgs {
        dir: dir.to_path_buf(),
        cwd: s.working_dir.clone(),
        stdout: meta.stdout_log.clone(),
        stderr: meta.stderr_log.clone(),
        shell: shell.to_string(),
        command: meta.command.clone(),
        cleanup_grace_ms: u64::try_from(s.tuning.cleanup_grace.as_millis()).unwrap_or(u64::MAX),
        keep_services: s.keep_services(),
        user: user.map(WorkloadUser::ids),
    }
    .to_args()
}

/// Starts the supervisor (`<exe> __shim …`) in the workload's directory with the workload's
/// environment alone: stdin `/dev/null`, stdout a pipe for its pid line, stderr `shim.log`, no
/// other descriptor of the node (D46.1: [`crate::fds::before_spawn`]). It keeps the node's
/// blocked signals (it blocks them itself first thing: a SIGTERM meant for the node never ends
/// it) and makes its own session.
fn start_shim(
    exe: &Path,
    dir: &Path,
    meta: Meta,
    args: &[std::ffi::OsString],
    env: &BTreeMap<String, String>,
    shim_log: std::fs::File,
) -> Result<Launched, SpawnError> {
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .env_clear()
        .envs(env)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(shim_log);
    crate::fds::before_spawn();
    let child = super::reaper::spawn(&mut cmd).map_err(|source| SpawnError::Fork {
        exe: exe.to_path_buf(),
        source,
    })?;
    let shim_start_ticks = i32::try_from(child.id())
        .ok()
        .and_then(procinfo::start_ticks)
        .unwrap_or(0);
    Ok(Launched {
        meta,
        child,
        shim_start_ticks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Settings of a node whose config, working and state folders are under `root` (made
    /// empty), and its state dir's layout.
    fn settings_in(root: &Path) -> (Settings, Layout) {
        let _ = std::fs::remove_dir_all(root);
        std::fs::create_dir_all(root.join("cfg")).unwrap();
        std::fs::create_dir_all(root.join("work")).unwrap();
        let mut vars = BTreeMap::new();
        vars.insert(
            "CYBERWAVE_EDGE_CONFIG_DIR".to_string(),
            root.join("cfg").display().to_string(),
        );
        let s = crate::config::resolve(
            &crate::config::Flags::default(),
            crate::config::env::EnvLayers::new(vars),
            &root.join("work"),
        )
        .unwrap();
        let layout = Layout {
            state: root.join("state"),
        };
        (s, layout)
    }

    /// A supervisor that cannot be started (no such program) fails the start, after its files
    /// were written, and leaves nothing of it.
    #[test]
    fn a_supervisor_that_cannot_start_leaves_nothing() {
        let root = std::env::temp_dir().join(format!("cw-launch-fail-{}", std::process::id()));
        let (s, layout) = settings_in(&root);
        let request = StartRequest {
            kind: crate::protocol::commands::Kind::Inference,
            request_id: serde_json::json!("r1"),
            safe_id: "r1".into(),
            params: serde_json::Map::new(),
            workload_uuid: None,
            template: "true".into(),
            node_token: String::new(),
            max_runtime_s: None,
            workflow: None,
            socket: root.join("control.sock"),
            gpus: None,
            results_dir: None,
            event_token: "tok".into(),
            node_uuid: "node".into(),
            user: None,
        };
        let exe = Path::new("/nonexistent/cyberwave-cloud-node");
        let result = launch(&s, &layout, exe, request).map(|_| ());
        assert!(matches!(result, Err(SpawnError::Fork { .. })), "{result:?}");
        assert!(!layout.dir("r1").exists(), "a failed start leaves nothing");
        let _ = std::fs::remove_dir_all(&root);
    }
}
