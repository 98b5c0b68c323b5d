//! Signals only to what is provably the workload's (D26), cancel after the exit (D29), and
//! repeated cancels (issue 12; guarantee 9).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::node::NodeSetup;
use crate::support::scenario::{completion, uploaded};
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{Broker, ControlPlane, NodeProcess};

fn command(cp: &ControlPlane, node: &NodeProcess, body: Value) -> Value {
    let rid = body["request_id"].as_str().unwrap_or_default().to_string();
    cp.command(&node.uuid(), body);
    cp.wait_reply(&rid, REPLY)
        .unwrap_or_else(|| panic!("no reply to {rid}; log:\n{}", node.log()))
}

/// A node whose result uploads take `put_delay`, so an exited workload stays tracked.
fn uploading_node(
    put_delay: Duration,
    training: &str,
) -> (Broker, ControlPlane, NodeSetup, NodeProcess) {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    cp.set_behaviour(|b| b.put_delay = put_delay);
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        &format!("cyberwave:\n  training: {training}\n  results_folder: out\n"),
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    (broker, cp, setup, node)
}

/// Exists and is not a zombie (a zombie has ended; it only waits for its parent).
fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or("X");
    state != "Z" && state != "X"
}

#[test]
fn g9_cancel_of_a_workload_that_already_succeeded_answers_already_finished() {
    let (_b, cp, _setup, node) = uploading_node(
        Duration::from_secs(3),
        "mkdir -p out && echo result > out/r.txt",
    );
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "ok1", "params": {"workload_uuid": "wl-ok1"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    assert!(cp.wait_status("wl-ok1", "finalizing", DONE).is_some());
    let c = command(
        &cp,
        &node,
        json!({"command": "cancel", "request_id": "c1", "params": {"workload_request_id": "ok1"}}),
    );
    assert_eq!(c["status"], "ok", "{c}");
    assert!(
        c["output"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("already finished"),
        "{c}"
    );
    let done = completion(&cp, "wl-ok1");
    assert_eq!(
        done["success"], true,
        "its real outcome is reported: {done}"
    );
    assert!(!done.to_string().contains("cancelled"), "{done}");
}

#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g9_a_recycled_pid_of_an_exited_workload_is_never_signalled() {
    crate::support::assert_root("to recycle a pid through ns_last_pid");
    assert!(
        std::fs::OpenOptions::new()
            .write(true)
            .open("/proc/sys/kernel/ns_last_pid")
            .is_ok(),
        "recycling a pid needs a writable /proc/sys/kernel/ns_last_pid"
    );
    let (_b, cp, _setup, node) = uploading_node(
        Duration::from_secs(4),
        "mkdir -p out && echo result > out/r.txt",
    );
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "rp", "params": {"workload_uuid": "wl-rp", "max_runtime_seconds": 1}}),
    );
    let pid = r["output"]["pid"].as_u64().unwrap_or(0) as u32;
    assert!(pid > 1, "{r}");
    assert!(cp.wait_status("wl-rp", "finalizing", DONE).is_some());
    // A stranger gets the workload's pid, as its own session and group leader.
    let mut stranger = None;
    // Another process may take the pid between the write and the fork; on a busy machine that
    // takes more than one try, never hundreds.
    for _ in 0..500 {
        let _ = std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string());
        let child = std::process::Command::new("setsid")
            .args(["sleep", "30"])
            .spawn()
            .expect("setsid");
        if child.id() == pid {
            stranger = Some(child);
            break;
        }
        let mut child = child;
        let _ = child.kill();
        let _ = child.wait();
    }
    // No silent pass: a run that could not recycle the pid proved nothing.
    let mut stranger =
        stranger.unwrap_or_else(|| panic!("could not recycle pid {pid} in 500 tries"));
    // Cancel by that pid while the exited workload is still tracked; and its max runtime
    // (1 s) passes meanwhile.
    let c = command(
        &cp,
        &node,
        json!({"command": "cancel", "request_id": "rp-c", "params": {"pid": pid, "signal": "SIGKILL"}}),
    );
    assert_eq!(c["status"], "ok", "{c}");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        alive(pid),
        "the stranger holding a recycled pid was signalled"
    );
    let done = completion(&cp, "wl-rp");
    assert_eq!(done["success"], true, "{done}");
    assert!(
        alive(pid),
        "the stranger was signalled after the completion"
    );
    let _ = stranger.kill();
    let _ = stranger.wait();
}

#[test]
fn g9_a_second_cancel_keeps_the_first_deadline() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  simulate: |\n    trap '' TERM\n    (trap '' TERM; sleep 60) &\n    sleep 60\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let r = command(
        &cp,
        &node,
        json!({"command": "simulate", "request_id": "st", "params": {"workload_uuid": "wl-st"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    let t0 = Instant::now();
    let first = command(
        &cp,
        &node,
        json!({"command": "cancel", "request_id": "st-c1", "params": {"workload_request_id": "st", "grace_seconds": 2}}),
    );
    assert_eq!(first["status"], "ok", "{first}");
    let second = command(
        &cp,
        &node,
        json!({"command": "cancel", "request_id": "st-c2", "params": {"workload_request_id": "st", "grace_seconds": 60, "signal": "SIGINT"}}),
    );
    assert_eq!(second["status"], "ok", "{second}");
    let msg = second["output"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("already being cancelled with SIGTERM"),
        "{second}"
    );
    // SIGKILL at the first deadline (2 s), not 60 s after the second cancel.
    let all = cp
        .wait_status("wl-st", "cancelled", DONE)
        .unwrap_or_else(|| panic!("no cancelled status; log:\n{}", node.log()));
    let done = all
        .into_iter()
        .find(|b| b["status"] == "cancelled")
        .unwrap_or_default();
    assert!(
        t0.elapsed() < Duration::from_secs(25),
        "the second cancel pushed the escalation out: {done}"
    );
    assert_eq!(
        done["signal"], "SIGTERM",
        "the first cancel's signal is reported: {done}"
    );
}

fn node_with(
    manifest: &str,
    env: &[(&str, &str)],
) -> (Broker, ControlPlane, NodeSetup, NodeProcess) {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    for (k, v) in env {
        setup.set(k, v);
    }
    setup.write("cyberwave.yml", manifest);
    let node = setup.spawn();
    node.wait_ready(READY);
    (broker, cp, setup, node)
}

fn pids_in(path: &std::path::Path) -> Vec<u32> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

#[test]
fn g9_processes_a_workload_leaves_behind_are_ended_before_it_is_reported() {
    let (_b, cp, setup, node) = node_with(
        "cyberwave:\n  training: |\n    for i in $(seq 1 20); do sleep 40 & echo $! >> kids; done\n    (trap '' TERM; exec sleep 40) & echo $! >> kids\n    exit 0\n",
        &[("CYBERWAVE_NODE_CLEANUP_GRACE_SECONDS", "1")],
    );
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "lb", "params": {"workload_uuid": "wl-lb"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    let done = completion(&cp, "wl-lb");
    assert_eq!(done["success"], true, "{done}");
    let kids = pids_in(&setup.cwd.join("kids"));
    assert_eq!(kids.len(), 21, "{kids:?}");
    let left: Vec<u32> = kids.into_iter().filter(|p| alive(*p)).collect();
    assert!(left.is_empty(), "left running after the report: {left:?}");
    let st = cp.status(&node.uuid(), "idle", REPLY).expect("status");
    assert_eq!(st["output"]["is_busy"], false, "{st}");
}

#[test]
fn g2_a_killed_supervisor_leaves_its_workload_tracked_counted_and_cancellable() {
    let (_b, cp, setup, node) = node_with(
        "cyberwave:\n  simulate: sleep 60\n",
        &[("CYBERWAVE_NODE_CLEANUP_GRACE_SECONDS", "1")],
    );
    let r = command(
        &cp,
        &node,
        json!({"command": "simulate", "request_id": "sv", "params": {"workload_uuid": "wl-sv"}}),
    );
    let pid = r["output"]["pid"].as_u64().unwrap_or(0) as u32;
    let started = setup.config_dir().join("workloads/sv/started.json");
    let shim: u32 = crate::support::wait_for(REPLY, || {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&started).ok()?).ok()?;
        v["shim_pid"].as_u64().map(|p| p as u32)
    })
    .expect("started.json");
    // SAFETY: the shim is this test's node's child's child; SIGKILL it as an operator would.
    unsafe { libc::kill(shim as i32, libc::SIGKILL) };
    assert!(
        node.wait_log("supervisor of simulate sv", REPLY),
        "{}",
        node.log()
    );
    assert!(alive(pid), "the workload itself runs on");
    // Still counted: a second start is refused at capacity 1 …
    let busy = command(
        &cp,
        &node,
        json!({"command": "simulate", "request_id": "sv2", "params": {"workload_uuid": "wl-sv2"}}),
    );
    assert_eq!(busy["status"], "error", "{busy}");
    // … still listed …
    let st = cp.status(&node.uuid(), "sv-st", REPLY).expect("status");
    assert_eq!(st["output"]["active_workloads"][0]["pid"], pid, "{st}");
    // … still cancellable, and reported once its group is empty.
    let c = command(
        &cp,
        &node,
        json!({"command": "cancel", "request_id": "sv-c", "params": {"pid": pid, "grace_seconds": 1}}),
    );
    assert_eq!(c["status"], "ok", "{c}");
    let all = cp
        .wait_status("wl-sv", "cancelled", DONE)
        .or_else(|| cp.wait_status("wl-sv", "completed", DONE))
        .unwrap_or_else(|| panic!("no report; log:\n{}", node.log()));
    assert!(
        crate::support::wait_for(REPLY, || (!alive(pid)).then_some(())).is_some(),
        "the workload was ended"
    );
    assert!(!all.is_empty());
}

#[test]
fn g3_a_workload_whose_supervisor_was_killed_is_reported_when_it_ends() {
    let (_b, cp, setup, node) = node_with("cyberwave:\n  simulate: sleep 60\n", &[]);
    let r = command(
        &cp,
        &node,
        json!({"command": "simulate", "request_id": "sk", "params": {"workload_uuid": "wl-sk"}}),
    );
    let pid = r["output"]["pid"].as_u64().unwrap_or(0) as i32;
    let started = setup.config_dir().join("workloads/sk/started.json");
    let shim: i32 = crate::support::wait_for(REPLY, || {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&started).ok()?).ok()?;
        v["shim_pid"].as_i64().map(|p| p as i32)
    })
    .expect("started.json");
    // SAFETY: signals to the test's own grandchildren.
    unsafe { libc::kill(shim, libc::SIGKILL) };
    assert!(
        node.wait_log("supervisor of simulate sk", REPLY),
        "{}",
        node.log()
    );
    assert!(
        cp.statuses("wl-sk")
            .iter()
            .all(|b| b["status"] != "completed"),
        "not reported while it runs"
    );
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let done = completion(&cp, "wl-sk");
    assert_eq!(done["success"], false, "{done}");
    assert!(done.to_string().contains("supervisor was killed"), "{done}");
}

#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g3_a_completion_survives_a_full_disk_and_goes_out_when_space_returns() {
    crate::support::assert_root("to mount a small tmpfs");
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_MIN_FREE_DISK_MB", "0");
    let dir = setup.config_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs"])
        .arg(&dir)
        .status()
        .is_ok_and(|s| s.success());
    // No silent pass: root that cannot mount (a container without CAP_SYS_ADMIN) proved nothing.
    assert!(mounted, "cannot mount a tmpfs on {} here", dir.display());
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _unmount = Unmount(dir.clone());
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  training: head -c 3000000 /dev/zero | tr '\\0' x; echo; exit 7\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "full", "params": {"workload_uuid": "wl-full"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    // The disk fills up; the node keeps answering and says so, but not once per attempt.
    assert!(
        cp.status(&node.uuid(), "while-full", REPLY).is_some(),
        "{}",
        node.log()
    );
    std::thread::sleep(Duration::from_secs(2));
    let complaints = node
        .log()
        .lines()
        .filter(|l| l.contains("cannot persist the log cursor"))
        .count();
    assert!(complaints <= 2, "{complaints} cursor errors logged");
    // Space comes back (the workload's own log is what filled it).
    for stream in ["stdout", "stderr"] {
        let log = dir.join(format!("workload_logs/training_full.{stream}.log"));
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .open(&log)
            .map(|f| f.set_len(0));
    }
    let done = completion(&cp, "wl-full");
    assert_eq!(done["success"], false, "{done}");
    assert_eq!(
        done["exit_code"], 7,
        "the real exit code, not a lost one: {done}"
    );
    let n = cp
        .statuses("wl-full")
        .iter()
        .filter(|b| b["status"] == "completed")
        .count();
    assert_eq!(n, 1);
}

#[test]
fn g10_concurrent_workloads_upload_only_their_own_results() {
    let (_b, cp, setup, node) = node_with(
        "cyberwave:\n  training: |\n    id=$CYBERWAVE_REQUEST_ID\n    while [ ! -f go ]; do sleep 0.02; done\n    echo \"result of $id\" > \"$CYBERWAVE_RESULTS_DIR/$id.txt\"\n    mkdir -p out && echo loose > \"out/loose-$id.txt\"\n    while [ ! -f \"release-$id\" ]; do sleep 0.05; done\n  results_folder: out\ncloud_node:\n  max_concurrent_workloads: 2\n",
        &[],
    );
    for id in ["ra", "rb"] {
        let r = command(
            &cp,
            &node,
            json!({"command": "training", "request_id": id, "params": {"workload_uuid": format!("wl-{id}")}}),
        );
        assert_eq!(r["status"], "ok", "{r}");
    }
    // Both run before either writes: a loose file is new to both.
    std::fs::write(setup.cwd.join("go"), "").unwrap();
    let own_b = setup.cwd.join("out/rb/rb.txt");
    let out = |f: &str| setup.cwd.join("out").join(f);
    assert!(
        crate::support::wait_for(REPLY, || (own_b.exists()
            && out("ra/ra.txt").exists()
            && out("loose-ra.txt").exists()
            && out("loose-rb.txt").exists())
        .then_some(()))
        .is_some(),
        "each workload writes into its own CYBERWAVE_RESULTS_DIR"
    );
    std::fs::write(setup.cwd.join("release-ra"), "").unwrap();
    let done = completion(&cp, "wl-ra");
    assert_eq!(done["success"], true, "{done}");
    assert_eq!(
        uploaded(&cp, "wl-ra"),
        vec!["ra.txt"],
        "A uploads its own file only"
    );
    assert!(own_b.exists(), "B's result is untouched while B runs");
    // D61: a loose file either could have written (no name of its own in it: `ra` is too
    // short to tell) is neither's: it stays, and each completion names it.
    assert!(
        setup.cwd.join("out/loose-ra.txt").exists(),
        "a loose file either could have written stays on disk"
    );
    let left = |done: &serde_json::Value| -> Vec<String> {
        serde_json::from_value(done["unattributed_results"].clone()).unwrap_or_default()
    };
    assert_eq!(left(&done), ["loose-ra.txt", "loose-rb.txt"], "{done}");
    assert!(
        node.wait_log("unattributed_results", REPLY),
        "{}",
        node.log()
    );
    std::fs::write(setup.cwd.join("release-rb"), "").unwrap();
    let done_b = completion(&cp, "wl-rb");
    assert_eq!(left(&done_b), ["loose-ra.txt", "loose-rb.txt"], "{done_b}");
    assert!(setup.cwd.join("out/loose-rb.txt").exists());
    assert_eq!(uploaded(&cp, "wl-rb"), vec!["rb.txt"]);
    assert!(
        cp.uploads().values().any(|v| v == b"result of rb\n"),
        "B's bytes arrived"
    );
    assert!(
        !setup.cwd.join("out/rb").exists(),
        "B's folder is cleaned after its upload"
    );
}

#[test]
fn g10_results_over_max_result_bytes_are_skipped_by_name() {
    let (_b, cp, _setup, node) = node_with(
        "cyberwave:\n  training: |\n    head -c 100 /dev/zero > \"$CYBERWAVE_RESULTS_DIR/big.bin\"\n    printf small > \"$CYBERWAVE_RESULTS_DIR/small.txt\"\n  results_folder: out\ncloud_node:\n  max_result_bytes: 10\n",
        &[],
    );
    command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "mx", "params": {"workload_uuid": "wl-mx"}}),
    );
    completion(&cp, "wl-mx");
    assert_eq!(uploaded(&cp, "wl-mx"), vec!["small.txt"]);
    assert!(node.wait_log("big.bin skipped", REPLY), "{}", node.log());
}
