//! Starting a workload under the shim, step 1 of 2: its directory, params, record and the shim
//! forked ([`super::settle`] is step 2).

use std::collections::BTreeMap;
use std::path::Path;

use super::environment;
use super::error::SpawnError;
use super::forkserver::{self, ForkServer};
use super::inputs;
use super::procinfo;
use super::record::{unix_now, Layout, Meta};
use super::request::StartRequest;
use super::results;
use super::settle::Launched;
use super::shim::ShimArgs;
use super::user::{self, WorkloadUser};
use super::vspawn;
use crate::config::Settings;
use crate::protocol::commands::TopicId;
use crate::store;

/// Starts a workload under the shim, step 1 of 2 (on the spawner thread): its directory, params
/// and record (`meta.json`, without a pid, written atomically but not yet synced), then the
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
    fork: &mut Option<ForkServer>,
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
    let result = launch_in(s, layout, exe, fork, &dir, req);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn launch_in(
    s: &Settings,
    layout: &Layout,
    exe: &Path,
    fork: &mut Option<ForkServer>,
    dir: &Path,
    mut req: StartRequest,
) -> Result<Launched, SpawnError> {
    let user = req.user.clone();
    let user = user.as_ref();
    prepare_dirs(layout, dir, user)?;
    req.results_dir = prepare_results(&req, dir, user)?;
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
    inputs::inline_image(layout, &stem, &req.safe_id, &mut req.params, user)?;
    let params_file = dir.join("params.json");
    let params = std::mem::take(&mut req.params);
    let command = inputs::command_line(s, dir, &req, module.as_ref(), &params_file, user)?;
    let meta = record(layout, &req, workload_uuid, command, &stem);
    // The workload's environment (D2/D3 and the per-workload token of ecosystem §5).
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
    let args = shim_args(s, dir, &meta, user);
    let shim_log =
        store::create_state_file(&dir.join("shim.log"), 0o600).map_err(SpawnError::ShimLog)?;
    // Forked by the fork server, without an exec (issue 25 item 5), asked for before the files
    // below are written and its answer read after them: the supervisor is made and makes itself
    // ready meanwhile, and starts the workload only once its gate is opened, after them
    // (dropping the gate calls it off). The answer is read whatever the writes did: each
    // request has one, in turn.
    let asked = ask_fork_server(fork, &args, &env, dir, &shim_log);
    let written = inputs::write_params(dir, params, user).and_then(|_| write_record(layout, &meta));
    let early = asked.and_then(|a| answered(fork, a, dir));
    written?;
    // D53: the loop's note of the start first (it writes it meanwhile). A loop that dropped
    // its end without a word is gone (a panic): no note, so no workload either.
    if let Some(noted) = &req.noted {
        noted.recv().map_err(|_| SpawnError::Stopped)?;
    }
    let Some(early) = early else {
        return exec_shim(exe, dir, meta, &args, &env, shim_log);
    };
    let Forked {
        shim_pid,
        shim_start_ticks,
        stdout,
        gate,
    } = early;
    open_gate(&gate);
    Ok(Launched {
        meta,
        shim_pid,
        shim_start_ticks,
        stdout: Some(stdout),
    })
}

/// Tells a forked supervisor to start its workload ([`super::shim::GATE_GO`]); the gate closes
/// when it is dropped. A supervisor that ended before (it could not open its log files, say) no
/// longer reads it: what it said on its stdout is what settle.rs reports.
fn open_gate(gate: &std::os::fd::OwnedFd) {
    use std::os::fd::AsRawFd;
    let go = [super::shim::GATE_GO];
    // SAFETY: send of a one-byte local buffer on a socket we own; no SIGPIPE.
    let sent = unsafe { libc::send(gate.as_raw_fd(), go.as_ptr().cast(), 1, libc::MSG_NOSIGNAL) };
    if sent != 1 {
        log::debug!(
            "the supervisor did not take its gate's word ({}): it ended before",
            std::io::Error::last_os_error()
        );
    }
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
    let made = match results::make_dir(folder, &req.safe_id, user) {
        Ok(_) => true,
        Err(e) => {
            log::warn!(
                "cannot create the results folder {}: {e}; the workload gets no CYBERWAVE_RESULTS_DIR",
                own.display()
            );
            false
        }
    };
    let claim = results::Claim {
        made,
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
    Ok(made.then(|| own.clone()))
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
        user: user.map(WorkloadUser::ids),
    }
    .to_args()
}

/// The supervisor exec'd (where the fork server cannot take the start), after the start's files
/// are written: by vspawn, without a copy of the node (where the kernel refuses that clone, a
/// seccomp filter say, it forks).
fn exec_shim(
    exe: &Path,
    dir: &Path,
    meta: Meta,
    args: &[std::ffi::OsString],
    env: &BTreeMap<String, String>,
    shim_log: std::fs::File,
) -> Result<Launched, SpawnError> {
    let (shim_pid, stdout) = match vspawn::spawn(exe, args, env, dir, shim_log) {
        Ok(s) => (s.pid, Some(s.stdout)),
        Err(vspawn::Failure::Child(source) | vspawn::Failure::Clone(source)) => {
            return Err(SpawnError::Fork {
                exe: exe.to_path_buf(),
                source,
            })
        }
    };
    Ok(Launched {
        meta,
        shim_pid,
        shim_start_ticks: procinfo::start_ticks(shim_pid).unwrap_or(0),
        stdout,
    })
}

/// A supervisor forked by the fork server, waiting at its gate.
struct Forked {
    shim_pid: i32,
    shim_start_ticks: u64,
    /// The read end of its stdout (its pid line).
    stdout: std::os::fd::OwnedFd,
    /// The write end of its gate.
    gate: std::os::fd::OwnedFd,
}

/// A supervisor asked of the fork server, its answer not read yet.
struct Asked {
    /// The read end of its stdout (its pid line).
    read: std::os::fd::OwnedFd,
    /// The write end of its gate.
    gate: std::os::fd::OwnedFd,
    /// This side's copies of what was sent with the request (its stdout, its stderr, its
    /// gate's read end): closed once it answered, so that only the supervisor holds them.
    sent: [std::os::fd::OwnedFd; 3],
}

/// Asks the fork server for this start's supervisor (it starts the workload only once its
/// gate is opened). `None`: this start goes the exec way (the request cannot be sent that way,
/// or the fork server is broken: then it is dropped, and every later start goes the exec way
/// too, until a new one is started).
fn ask_fork_server(
    fork: &mut Option<ForkServer>,
    args: &[std::ffi::OsString],
    env: &BTreeMap<String, String>,
    dir: &Path,
    shim_log: &std::fs::File,
) -> Option<Asked> {
    let server = fork.as_ref()?;
    // Sockets, not pipes: a same-uid process could open a pipe's end again through the dumpable
    // supervisor's /proc/<pid>/fd/N, and open the gate itself or tell a pid of its choosing. (One
    // allowed to ptrace the supervisor, where Yama's ptrace_scope is 0 or absent, can take any
    // descriptor with pidfd_getfd; a `workload_user` of its own keeps workloads from that.)
    let streams = vspawn::socket_pair().and_then(|(r, w)| {
        let (gate_r, gate_w) = vspawn::socket_pair()?;
        Ok((r, w, shim_log.try_clone()?, gate_r, gate_w))
    });
    let (read, write, log, gate_read, gate) = match streams {
        Ok(s) => s,
        Err(e) => {
            log::debug!("cannot prepare the supervisor's streams ({e}): it is exec'd");
            return None;
        }
    };
    let log = std::os::fd::OwnedFd::from(log);
    match server.request(args, env, dir, [&write, &log, &gate_read]) {
        Ok(()) => Some(Asked {
            read,
            gate,
            sent: [write, log, gate_read],
        }),
        Err(e) => {
            not_forked(fork, e);
            None
        }
    }
}

/// What a fork server's refusal `e` means for this start (the exec way) and the next ones.
fn not_forked(fork: &mut Option<ForkServer>, e: forkserver::Error) {
    let pid = fork.as_ref().map_or(0, ForkServer::pid);
    match e {
        forkserver::Error::Unsendable => log::debug!(
            "the fork server cannot take this start (too big a request, or out of processes or memory for the moment): its supervisor is exec'd"
        ),
        forkserver::Error::Broken(e) => {
            log::warn!(
                "the fork server (pid {pid}) failed ({e}); supervisors are exec'd until a new one is started"
            );
            *fork = None;
        }
        forkserver::Error::Unanswered(e) => {
            log::warn!(
                "the fork server (pid {pid}) did not answer ({e}); supervisors are exec'd until a new one is started"
            );
            if let Some(server) = fork.take() {
                server.stop();
            }
        }
    }
}

/// The supervisor `asked` for, at its gate, once the fork server answered. `None`: this start
/// goes the exec way (the fork server refused it, or is broken or silent and made no supervisor
/// of it that can be found: then it is dropped, and every later start goes the exec way too,
/// until a new one is started).
fn answered(fork: &mut Option<ForkServer>, asked: Asked, dir: &Path) -> Option<Forked> {
    let Asked { read, gate, sent } = asked;
    // Its identity, read at once (a supervisor that ends at its gate could leave its pid to
    // another process before the gate is opened).
    let forked = |shim_pid, stdout, gate| {
        Some(Forked {
            shim_pid,
            shim_start_ticks: procinfo::start_ticks(shim_pid).unwrap_or(0),
            stdout,
            gate,
        })
    };
    let e = match fork.as_ref()?.started() {
        Ok(pid) => return forked(pid, read, gate),
        Err(e) => e,
    };
    let silent = matches!(e, forkserver::Error::Unanswered(_));
    not_forked(fork, e);
    if !silent {
        return None;
    }
    drop(sent);
    // Whether it (or its standby) made this start's supervisor before it went: with it gone and
    // its socket closed, only that supervisor, or the request still queued at a standby a
    // workload stopped, can hold (or have written to) the pid channel's other end. A supervisor found
    // by its directory is the start's. One not found within a second never starts the workload
    // (it was stopped before it entered the directory, or never took the request): its gate
    // closes here without a word, so this start goes the exec way.
    if written_or_held(&read) {
        if let Some(pid) = super::recover::supervisor_of(dir, std::time::Duration::from_secs(1)) {
            return forked(pid, read, gate);
        }
    }
    None
}

/// Whether anything was written to the pid channel `read` (a socket) or anyone still holds its
/// other end.
fn written_or_held(read: &std::os::fd::OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    let mut b = [0u8; 1];
    // SAFETY: a peek of one byte into a local buffer, without waiting, on a socket we own: 0 is
    // the end of file (nothing written, and no other end is left), EAGAIN an end still held.
    let n = unsafe {
        libc::recv(
            read.as_raw_fd(),
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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

    /// D53 with the note written beside the spawner's files (issue 25 item 5): the spawner
    /// writes the workload's files meanwhile, but starts no supervisor (its `shim.log` is the
    /// first thing of it) before the loop's word that the note is written.
    #[test]
    fn d53_no_supervisor_is_started_before_the_loop_noted_the_start() {
        let root = std::env::temp_dir().join(format!("cw-launch-noted-{}", std::process::id()));
        let (s, layout) = settings_in(&root);
        let (noted, noted_rx) = crossbeam_channel::bounded(1);
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
            noted: None,
            user: None,
        };
        let req = StartRequest {
            noted: Some(noted_rx),
            ..request.clone()
        };
        let dir = layout.dir("r1");
        let (s2, l2) = (s.clone(), layout.clone());
        let launching = std::thread::spawn(move || {
            // No such program: the supervisor's start fails, after its shim.log was created.
            let exe = Path::new("/nonexistent/cyberwave-cloud-node");
            launch(&s2, &l2, exe, &mut None, req).map(|_| ())
        });
        let written = dir.join("meta.json");
        for _ in 0..200 {
            if written.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(written.exists(), "the spawner writes the record meanwhile");
        std::thread::sleep(Duration::from_millis(200));
        // The exec of the (missing) supervisor would have failed at once.
        assert!(
            !launching.is_finished(),
            "a supervisor was started before the start was noted"
        );
        noted.send(()).unwrap();
        let result = launching.join().unwrap();
        assert!(matches!(result, Err(SpawnError::Fork { .. })), "{result:?}");
        assert!(!dir.exists(), "a failed start leaves nothing");
        // The loop dropped its end without a word: no supervisor, nothing left.
        let (gone, gone_rx) = crossbeam_channel::bounded::<()>(1);
        drop(gone);
        let req = StartRequest {
            noted: Some(gone_rx),
            safe_id: "r2".into(),
            ..request
        };
        let result = launch(&s, &layout, Path::new("/bin/true"), &mut None, req).map(|_| ());
        assert!(matches!(result, Err(SpawnError::Stopped)), "{result:?}");
        assert!(
            !layout.dir("r2").exists(),
            "an unnoted start leaves nothing"
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    /// The fork server's way (issue 25 item 5): the supervisor is forked before the start's
    /// files are written and waits at its gate; the spawner opens the gate only once the params,
    /// the record and the loop's note (D53) are there, and a start called off meanwhile closes
    /// it without a word. A peer stands in for the fork server.
    #[test]
    fn d53_a_forked_supervisor_starts_its_workload_only_once_the_start_is_written_and_noted() {
        let root = std::env::temp_dir().join(format!("cw-launch-gate-{}", std::process::id()));
        let (s, layout) = settings_in(&root);
        let request = |id: &str, noted| StartRequest {
            kind: crate::protocol::commands::Kind::Inference,
            request_id: serde_json::json!(id),
            safe_id: id.into(),
            params: serde_json::Map::new(),
            workload_uuid: None,
            template: "true {body}".into(),
            node_token: String::new(),
            max_runtime_s: None,
            workflow: None,
            socket: root.join("control.sock"),
            gpus: None,
            results_dir: None,
            event_token: "tok".into(),
            node_uuid: "node".into(),
            noted: Some(noted),
            user: None,
        };
        for (id, word) in [("g1", true), ("g2", false)] {
            let (peer, fork) = forkserver::ForkServer::for_tests();
            let (noted, noted_rx) = crossbeam_channel::bounded(1);
            let (s2, l2, req) = (s.clone(), layout.clone(), request(id, noted_rx));
            let launching = std::thread::spawn(move || {
                let mut fork = Some(fork);
                launch(&s2, &l2, Path::new("/nonexistent"), &mut fork, req).map(|l| l.shim_pid)
            });
            let dir = layout.dir(id);
            // The start's files are written while its supervisor is asked for, not after the
            // answer (issue 25 item 5).
            let written = || dir.join("meta.json").exists() && dir.join("params.json").exists();
            let [pid_line, _, gate] = forkserver::answer_for_tests(&peer, 4242, || {
                let until = std::time::Instant::now() + Duration::from_secs(5);
                while !written() && std::time::Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(2));
                }
                assert!(
                    written(),
                    "{id}: the files wait for the supervisor's answer"
                );
            });
            // Sockets, whose /proc/<pid>/fd entries a same-uid process cannot open again.
            for (what, fd) in [("the pid channel", &pid_line), ("the gate", &gate)] {
                let kind = std::fs::File::from(fd.try_clone().unwrap())
                    .metadata()
                    .map(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()));
                assert_eq!(kind.ok(), Some(true), "{id}: {what} is a socket");
            }
            drop(pid_line);
            let readable = |fd: &std::os::fd::OwnedFd| {
                use std::os::fd::AsRawFd;
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: poll of one pollfd we own.
                unsafe { libc::poll(&mut p, 1, 200) == 1 }
            };
            assert!(
                !readable(&gate),
                "{id}: the gate opened before the start was noted"
            );
            assert!(dir.join("meta.json").exists() && dir.join("params.json").exists());
            if word {
                noted.send(()).unwrap();
            } else {
                drop(noted);
            }
            let result = launching.join().unwrap();
            let mut got = Vec::new();
            std::io::Read::read_to_end(&mut std::fs::File::from(gate), &mut got).unwrap();
            if word {
                assert_eq!(result.ok(), Some(4242), "{id}");
                assert_eq!(got, [crate::workload::shim::GATE_GO], "{id}: opened once");
            } else {
                assert!(
                    matches!(result, Err(SpawnError::Stopped)),
                    "{id}: {result:?}"
                );
                assert!(got.is_empty(), "{id}: called off without a word: {got:?}");
                assert!(!dir.exists(), "{id}: a start called off leaves nothing");
            }
        }
        let _ = std::fs::remove_dir_all(&root);
    }
}
