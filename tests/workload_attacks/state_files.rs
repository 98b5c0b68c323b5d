//! Workload attacks: see `mod.rs`. A workload runs with the node's uid and can plant a FIFO (or a
//! socket, a link, a directory) in place of any file of the state dir. D48: only regular files
//! are read back; anything else is quarantined like a corrupt file and never blocks the node or a
//! CLI command. Every wait here is bounded, so on a node that blocks a test fails, never hangs.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::node::{NodeSetup, Output};
use crate::support::timeouts::{EXIT, READY, REPLY};
use crate::support::{wait_for, NodeProcess, Rig, Scenario};

/// No process has this pid (pid_max is at most 2^22).
const DEAD_PID: i64 = 2_147_483_000;

fn mkfifo(p: &Path) {
    use std::os::unix::ffi::OsStrExt;
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    let _ = std::fs::remove_file(p);
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(
        unsafe { libc::mkfifo(c.as_ptr(), 0o600) },
        0,
        "mkfifo {p:?}"
    );
}

fn is_fifo(p: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_fifo())
}

/// Removes every FIFO left in the state dir (a blocked test must not hang its clean-up, which
/// reads `started.json`).
fn unplant(state: &Path) {
    let mut dirs = vec![state.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if is_fifo(&p) {
                let _ = std::fs::remove_file(&p);
            } else if std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) {
                dirs.push(p);
            }
        }
    }
}

/// Runs a CLI command of the node with a deadline: `None` when it had not returned by then
/// (it is killed).
fn run_bounded(setup: &NodeSetup, args: &[&str], timeout: Duration) -> Option<Output> {
    let mut child = setup
        .command(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run node");
    let end = Instant::now() + timeout;
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            return Some(Output::from(child.wait_with_output().expect("output")));
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn write(path: &Path, v: &Value) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, v.to_string()).unwrap();
}

/// A workload record as the node writes it, for `id` (its process is long gone).
fn record(state: &Path, id: &str) {
    let logs = state.join("workload_logs");
    write(
        &state.join(format!("workloads/{id}/meta.json")),
        &json!({
            "safe_id": id, "kind": "inference", "request_id": format!("r-{id}"),
            "workload_uuid": format!("wl-{id}"), "created_unix": now(), "command": "true",
            "stdout_log": logs.join(format!("inference_{id}.stdout.log")),
            "stderr_log": logs.join(format!("inference_{id}.stderr.log")),
            "max_runtime_s": 3600.0, "phase": "starting", "event_token": "ab12"
        }),
    );
    write(
        &state.join(format!("workloads/{id}/started.json")),
        &json!({"pid": DEAD_PID, "start_ticks": 1, "shim_pid": DEAD_PID, "shim_start_ticks": 1,
                "boot_id": "", "started_at": "2026-11-30T00:00:00Z"}),
    );
}

/// Plants a FIFO at `rel` (below the state dir) and checks what D48 promises: the `status` and
/// `logs` commands return while it is there, the node starts, reaches "node ready", quarantines
/// it (naming it in the log), answers a `status` command and the `status` CLI, and exits on
/// SIGTERM.
fn a_fifo_at(rel: &str, prepare: impl FnOnce(&Path)) {
    let rig = Scenario::new("cyberwave:\n  inference: echo hi\n").rig();
    let Rig { cp, setup, .. } = &rig;
    let state = setup.config_dir();
    std::fs::create_dir_all(&state).unwrap();
    prepare(&state);
    let fifo = state.join(rel);
    mkfifo(&fifo);
    let guard = Unplant(state.clone());

    let offline = run_bounded(setup, &["status", "--json"], EXIT);
    assert!(offline.is_some(), "{rel}: `status` hangs on a FIFO");
    let logs = run_bounded(setup, &["logs", "r-wa"], EXIT);
    assert!(logs.is_some(), "{rel}: `logs` hangs on a FIFO");
    assert!(is_fifo(&fifo), "{rel}: the CLI moves nothing");

    let mut node: NodeProcess = setup.spawn();
    node.wait_ready(READY);
    let status = cp
        .status(&node.uuid(), &format!("st-{}", rel.len()), REPLY)
        .unwrap_or_else(|| panic!("{rel}: no status reply; log:\n{}", node.log()));
    assert_eq!(status["status"], "ok", "{rel}: {status}");
    assert!(
        node.wait_log(&format!("quarantined {}", fifo.display()), REPLY),
        "{rel}: the FIFO is not named as quarantined; log:\n{}",
        node.log()
    );
    assert!(
        node.log().contains("not a regular file (a FIFO)"),
        "{rel}: {}",
        node.log()
    );
    assert!(!is_fifo(&fifo), "{rel}: moved away");
    let online = run_bounded(setup, &["status", "--json"], EXIT)
        .unwrap_or_else(|| panic!("{rel}: `status` hangs while the node runs"));
    assert_eq!(online.code, Some(0), "{rel}: {online:?}");
    node.sigterm();
    assert!(
        node.wait_exit(EXIT).is_some(),
        "{rel}: the node ignores SIGTERM; log:\n{}",
        node.log()
    );
    assert!(!node.log().contains("panicked"), "{rel}: {}", node.log());
    drop(guard);
}

struct Unplant(PathBuf);

impl Drop for Unplant {
    fn drop(&mut self) {
        unplant(&self.0);
    }
}

#[test]
fn g13_d48_a_fifo_for_the_instance_identity_never_wedges_the_node() {
    a_fifo_at("instance_identity.json", |_| {});
}

#[test]
fn g13_d48_a_fifo_for_the_node_id_never_wedges_the_node() {
    a_fifo_at("node_id", |_| {});
}

#[test]
fn g13_d48_a_fifo_for_the_request_ledger_never_wedges_the_node() {
    a_fifo_at("ledger.jsonl", |_| {});
}

#[test]
fn g13_d48_a_fifo_for_an_outbox_entry_never_wedges_the_node() {
    a_fifo_at("outbox/00000000000000000001.json", |_| {});
}

#[test]
fn g13_d48_a_fifo_for_an_ingress_entry_never_wedges_the_node() {
    a_fifo_at("ingress/00000000000000000002.json", |_| {});
}

#[test]
fn g13_d48_a_fifo_for_a_workload_record_never_wedges_the_node() {
    a_fifo_at("workloads/wa/meta.json", |s| record(s, "wa"));
}

#[test]
fn g13_d48_a_fifo_for_a_workload_start_record_never_wedges_the_node() {
    a_fifo_at("workloads/wa/started.json", |s| record(s, "wa"));
}

#[test]
fn g13_d48_a_fifo_for_a_workload_exit_record_never_wedges_the_node() {
    a_fifo_at("workloads/wa/exit.json", |s| record(s, "wa"));
}

#[test]
fn g13_d48_a_fifo_for_a_log_cursor_never_wedges_the_node() {
    a_fifo_at("workloads/wa/cursor.json", |s| record(s, "wa"));
}

#[test]
fn g13_d48_a_fifo_for_the_params_of_a_salvaged_workload_never_wedges_the_node() {
    a_fifo_at("workloads/wa/params.json", |s| {
        record(s, "wa");
        std::fs::write(s.join("workloads/wa/meta.json"), "{torn").unwrap();
    });
}

#[test]
fn g13_d48_a_fifo_for_the_services_record_never_wedges_the_node() {
    a_fifo_at("services.json", |_| {});
}

#[test]
fn g13_d48_a_fifo_for_what_a_workload_left_running_never_wedges_the_node() {
    a_fifo_at("workloads/wa/left.json", |s| record(s, "wa"));
}

/// The real thing: a running workload, the node killed with SIGKILL, its start record and log
/// cursor replaced by FIFOs (what the workload itself could do), the node started again.
#[test]
fn g13_d48_fifos_planted_in_a_running_workloads_record_never_wedge_the_restarted_node() {
    let rig = Scenario::new("cyberwave:\n  inference: sleep 30\n").rig();
    let Rig { cp, setup, .. } = &rig;
    let state = setup.config_dir();
    let _guard = Unplant(state.clone());
    let mut node = setup.spawn();
    node.wait_ready(READY);
    cp.command(
        &node.uuid(),
        json!({"command": "inference", "request_id": "r-fifo", "params": {"workload_uuid": "wl-fifo"}}),
    );
    let r = cp.wait_reply("r-fifo", REPLY).expect("reply");
    assert_eq!(r["status"], "ok", "{r}; log:\n{}", node.log());
    node.kill9();
    let dirs: Vec<PathBuf> = std::fs::read_dir(state.join("workloads"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    let started = dirs[0].join("started.json");
    // The supervisor writes started.json right after it reports the pid, so under load the
    // reply can come first: wait for it rather than race it.
    let text = wait_for(REPLY, || std::fs::read_to_string(&started).ok())
        .expect("the supervisor wrote no started.json");
    let pid = serde_json::from_str::<Value>(&text).unwrap()["pid"]
        .as_i64()
        .unwrap();
    for f in ["started.json", "cursor.json"] {
        mkfifo(&dirs[0].join(f));
    }
    assert!(
        run_bounded(setup, &["status"], EXIT).is_some(),
        "`status` hangs on a FIFO"
    );
    assert!(
        run_bounded(setup, &["logs", "r-fifo"], EXIT).is_some(),
        "`logs` hangs on a FIFO"
    );
    let mut again = setup.spawn();
    again.wait_ready(READY);
    assert!(
        cp.status(&again.uuid(), "st-fifo", REPLY).is_some(),
        "no status reply; log:\n{}",
        again.log()
    );
    assert!(
        again.wait_log(&format!("quarantined {}", started.display()), REPLY),
        "{}",
        again.log()
    );
    let online = run_bounded(setup, &["status", "--json"], EXIT).expect("`status` hangs");
    assert_eq!(online.code, Some(0), "{online:?}");
    again.sigterm();
    assert!(again.wait_exit(EXIT).is_some(), "{}", again.log());
    // SAFETY: the test's own workload group.
    unsafe {
        libc::kill(-(pid as i32), libc::SIGKILL);
    }
}

/// Files of the state dir that are not records: the login, an env file, the doctor's marker.
#[test]
fn g13_d48_fifos_for_the_login_env_file_and_conflict_marker_never_hang_the_node_or_doctor() {
    let rig = Scenario::new("cyberwave:\n  inference: echo hi\n").rig();
    let Rig { setup, .. } = &rig;
    let state = setup.config_dir();
    std::fs::create_dir_all(&state).unwrap();
    let _guard = Unplant(state.clone());
    mkfifo(&state.join("credentials.json"));
    mkfifo(&state.join("client_id_conflict"));
    let doctor = run_bounded(setup, &["doctor"], Duration::from_secs(20));
    assert!(doctor.is_some(), "`doctor` hangs on a FIFO");
    // A FIFO login is no login: the API key from the environment is used.
    let node = setup.spawn();
    node.wait_ready(READY);
    drop(node);
    // An env file that is a FIFO is a clear configuration error, not a hang.
    mkfifo(&state.join(".env"));
    let mut node = setup.spawn();
    let code = node.wait_exit(EXIT);
    assert_eq!(code, Some(Some(2)), "{}", node.log());
    let env = state.join(".env");
    assert!(
        node.log().contains(&format!(
            "cannot read {}: not a regular file (a FIFO)",
            env.display()
        )),
        "{}",
        node.log()
    );
}

/// A directory where the control socket belongs cannot be replaced: exit 2 (no restart loop
/// under systemd) naming the path.
#[test]
fn g13_a_directory_in_place_of_the_control_socket_is_exit_2_naming_it() {
    let rig = Scenario::new("cyberwave:\n  inference: echo hi\n").rig();
    let Rig { setup, .. } = &rig;
    let sock = setup.config_dir().join("control.sock");
    std::fs::create_dir_all(sock.join("inner")).unwrap();
    let mut node = setup.spawn();
    node.assert_exit(2, READY);
    assert!(
        node.log()
            .contains(&format!("{} is a directory", sock.display())),
        "{}",
        node.log()
    );
    assert!(!node.log().contains("node ready"), "{}", node.log());
    assert!(sock.join("inner").is_dir(), "left as it is");
}
