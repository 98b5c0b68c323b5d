//! Workload attacks: see `mod.rs`. The way out of a workload: its supervisor reaps what it
//! adopts (no zombies pile up while it runs), a workload that fills the state dir's disk still
//! gets its completion out (D54), and starts in flight when the node is SIGKILLed are all
//! answered after its restart (D53), and its supervisor outlives the signals sent to it.

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::node::NodeSetup;
use crate::support::timeouts::{READY, REPLY};
use crate::support::{wait_for, Broker, ControlPlane};

fn rig(manifest: &str) -> (Broker, ControlPlane, NodeSetup) {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write("cyberwave.yml", manifest);
    (broker, cp, setup)
}

/// The `started.json` the supervisor of workload `safe_id` wrote.
fn started(setup: &NodeSetup, safe_id: &str) -> Option<Value> {
    let p = setup
        .config_dir()
        .join("workloads")
        .join(safe_id)
        .join("started.json");
    serde_json::from_slice(&std::fs::read(p).ok()?).ok()
}

/// The pids of the zombie children of `parent` (from each process's `stat`: state and ppid).
fn zombie_children(parent: i64) -> Vec<i64> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i64>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            // "pid (comm) S ppid …": the comm may hold anything, so split after its last ')'.
            let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
                return false;
            };
            let mut f = rest.split_whitespace();
            let state = f.next();
            let ppid = f.next().and_then(|p| p.parse::<i64>().ok());
            state == Some("Z") && ppid == Some(parent)
        })
        .collect()
}

/// The supervisor is the subreaper of its workload: the orphans it adopts are reaped as soon as
/// they end, not when the workload does (a long workload that forks short-lived children must
/// not fill the process table with zombies).
#[test]
fn g13_the_supervisor_reaps_the_orphans_it_adopts_while_the_workload_runs() {
    let (_broker, cp, setup) = rig(
        "cyberwave:\n  inference: for i in $(seq 20); do (sleep 0.01 &) ; done; touch forked; sleep 4\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    cp.command(
        &node.uuid(),
        json!({"command": "inference", "request_id": "z1", "params": {"workload_uuid": "wl-z1"}}),
    );
    let reply = cp
        .wait_reply("z1", Duration::from_secs(10))
        .unwrap_or_else(|| panic!("no reply; log:\n{}", node.log()));
    assert_eq!(reply["status"], "ok", "{reply}");
    let shim = wait_for(Duration::from_secs(5), || {
        started(&setup, "z1").and_then(|s| s["shim_pid"].as_i64())
    })
    .expect("the supervisor's start record");
    wait_for(Duration::from_secs(5), || {
        setup.cwd.join("forked").exists().then_some(())
    })
    .expect("the workload forked its children");
    // Each orphan sleeps 10 ms; a second is plenty for all to end and be reaped.
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        cp.statuses("wl-z1")
            .iter()
            .all(|s| s["status"] != "completed"),
        "the workload still runs"
    );
    let zombies = zombie_children(shim);
    assert!(
        zombies.is_empty(),
        "the supervisor (pid {shim}) left {} zombie children unreaped while its workload runs: {zombies:?}",
        zombies.len()
    );
    let done = cp
        .wait_status("wl-z1", "completed", Duration::from_secs(15))
        .unwrap_or_else(|| panic!("no completion; log:\n{}", node.log()));
    let done: Vec<&Value> = done.iter().filter(|b| b["status"] == "completed").collect();
    assert_eq!(done[0]["exit_code"], 0, "{done:?}");
}

/// A small tmpfs mounted on the node's state dir (unmounted when dropped: declare it after the
/// `NodeSetup`, before the node). Mounting needs root: the tests using it need root.
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn mount(setup: &NodeSetup) -> SmallDisk {
        crate::support::assert_root("a full state dir is a small tmpfs, and mounting one");
        let dir = setup.config_dir();
        std::fs::create_dir_all(&dir).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs"])
            .arg(&dir)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "cannot mount a 4 MiB tmpfs on {} as root: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        SmallDisk(dir)
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .output();
    }
}

/// The workload of the full-disk tests: once `t/go` exists, it fills the state dir's disk with
/// its own stdout (the write that finds it full fails) and exits 7.
const FILLER: &str = "cyberwave:\n  inference: until [ -e t/go ]; do sleep 0.05; done; head -c 8000000 /dev/zero | tr '\\0' x; exit 7\n";

fn full_disk_rig() -> (Broker, ControlPlane, NodeSetup) {
    let (broker, cp, mut setup) = rig(FILLER);
    setup.set("CYBERWAVE_MIN_FREE_DISK_MB", "0");
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    (broker, cp, setup)
}

fn completions(cp: &ControlPlane, wl: &str) -> Vec<Value> {
    cp.statuses(wl)
        .into_iter()
        .filter(|b| b["status"] == "completed")
        .collect()
}

/// D54: a workload whose own log fills the state dir's disk gets its completion out while the
/// disk is still full (its supervisor cannot write `exit.json` and hands the status over), with
/// its real exit code; once space returns, nothing of it is left behind.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_a_workload_that_fills_the_disk_with_its_log_still_gets_its_completion_out() {
    let (_broker, cp, setup) = full_disk_rig();
    let _disk = SmallDisk::mount(&setup);
    let node = setup.spawn();
    node.wait_ready(READY);
    cp.command(
        &node.uuid(),
        json!({"command": "inference", "request_id": "fill", "params": {"workload_uuid": "wl-fill"}}),
    );
    let reply = cp
        .wait_reply("fill", Duration::from_secs(10))
        .unwrap_or_else(|| panic!("no reply; log:\n{}", node.log()));
    assert_eq!(reply["status"], "ok", "{reply}");
    std::fs::write(setup.cwd.join("t/go"), "").unwrap();
    let done = wait_for(Duration::from_secs(15), || {
        Some(completions(&cp, "wl-fill")).filter(|d| !d.is_empty())
    })
    .unwrap_or_else(|| panic!("no completion while the disk is full; log:\n{}", node.log()));
    assert_eq!(done[0]["exit_code"], 7, "{done:?}");
    assert_eq!(done[0]["success"], false, "{done:?}");
    // Space returns (the test frees the log); the workload's record is settled: its exit
    // record written or the whole record retired once the completion was acknowledged.
    let logs = setup.config_dir().join("workload_logs");
    for e in std::fs::read_dir(&logs).unwrap().flatten() {
        let _ = std::fs::remove_file(e.path());
    }
    let dir = setup.config_dir().join("workloads/fill");
    let settled = wait_for(Duration::from_secs(10), || {
        (!dir.exists() || dir.join("exit.json").is_file()).then_some(())
    });
    assert!(
        settled.is_some(),
        "the record of the workload is neither written nor retired after space returned: {:?}; log:\n{}",
        std::fs::read_dir(&dir).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>()),
        node.log()
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        completions(&cp, "wl-fill").len(),
        1,
        "exactly one completion"
    );
}

/// D54 across a restart: the node is SIGKILLed, then the workload fills the disk and exits; its
/// supervisor leaves the status where a full disk still takes it. The restarted node (the disk
/// still full) reports the real exit code.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_a_workload_that_fills_the_disk_while_the_node_is_down_is_reported_after_the_restart() {
    let (_broker, cp, setup) = full_disk_rig();
    let _disk = SmallDisk::mount(&setup);
    let mut node = setup.spawn();
    node.wait_ready(READY);
    cp.command(
        &node.uuid(),
        json!({"command": "inference", "request_id": "fill2", "params": {"workload_uuid": "wl-fill2"}}),
    );
    let reply = cp
        .wait_reply("fill2", Duration::from_secs(10))
        .unwrap_or_else(|| panic!("no reply; log:\n{}", node.log()));
    assert_eq!(reply["status"], "ok", "{reply}");
    // The supervisor writes started.json right after it reports the pid: wait, do not race it.
    let shim = wait_for(REPLY, || {
        started(&setup, "fill2").and_then(|s| s["shim_pid"].as_i64())
    });
    node.kill9();
    std::fs::write(setup.cwd.join("t/go"), "").unwrap();
    // The workload ends; its supervisor does not wait for space that only the node could free.
    let shim = shim.expect("the supervisor's start record");
    let gone = wait_for(Duration::from_secs(10), || {
        (!std::path::Path::new(&format!("/proc/{shim}")).exists()).then_some(())
    });
    assert!(
        gone.is_some(),
        "the supervisor still waits for disk space after its workload ended"
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let done = wait_for(Duration::from_secs(15), || {
        Some(completions(&cp, "wl-fill2")).filter(|d| !d.is_empty())
    })
    .unwrap_or_else(|| {
        panic!(
            "no completion after the restart on a full disk; log:\n{}",
            node.log()
        )
    });
    assert_eq!(done[0]["exit_code"], 7, "{done:?}");
}

fn runs(setup: &NodeSetup, rid: &str) -> usize {
    std::fs::read_to_string(setup.cwd.join(format!("t/{rid}.runs")))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// D53: the node is SIGKILLed with starts in flight, on a slow disk: at least one whose
/// workload runs (not yet answered: its record is being synced), and others not started yet
/// (waiting for that sync, or behind the image of `i1`, which is being saved); `n2`, last,
/// never started. After the restart every one of them gets exactly one answer, without being
/// asked again: `ok` and `running` for each that runs, a retryable host-busy error and a `failed`
/// status for each that never started; none runs twice.
#[test]
fn g1_starts_in_flight_when_the_node_is_killed_are_all_answered_after_its_restart() {
    let (_broker, cp, mut setup) =
        rig("cyberwave:\n  inference: echo $$ >> t/$CYBERWAVE_REQUEST_ID.runs; sleep 4\n");
    setup.set("CYBERWAVE_MAX_CONCURRENT_WORKLOADS", "8");
    setup.set("CYBERWAVE_TEST_SLOW_FSYNC_MS", "2500");
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    let mut node = setup.spawn();
    node.wait_ready(READY);
    let start = |uuid: &str, rid: &str, extra: Value| {
        let mut params = json!({"workload_uuid": format!("wl-{rid}")});
        if let (Some(p), Some(e)) = (params.as_object_mut(), extra.as_object()) {
            p.extend(e.clone());
        }
        cp.command(
            uuid,
            json!({"command": "inference", "request_id": rid, "params": params}),
        );
    };
    let uuid = node.uuid();
    start(&uuid, "r1", json!({}));
    start(&uuid, "r2", json!({}));
    // Saving an image syncs it: the spawner is held up before it forks this one's supervisor.
    start(&uuid, "i1", json!({"image_bytes_base64": "aGVsbG8="}));
    start(&uuid, "n1", json!({}));
    start(&uuid, "n2", json!({}));
    wait_for(Duration::from_secs(10), || {
        (runs(&setup, "r1") == 1).then_some(())
    })
    .unwrap_or_else(|| panic!("the first workload did not run; log:\n{}", node.log()));
    std::thread::sleep(Duration::from_millis(200));
    let all = ["r1", "r2", "i1", "n1", "n2"];
    for rid in all {
        assert!(
            cp.replies_for(rid).is_empty(),
            "{rid} was answered before the kill: the test needs it in flight"
        );
    }
    node.kill9();
    setup.unset("CYBERWAVE_TEST_SLOW_FSYNC_MS");
    let node = setup.spawn();
    node.wait_ready(READY);
    for rid in all {
        wait_for(Duration::from_secs(10), || {
            Some(()).filter(|_| !cp.replies_for(rid).is_empty())
        })
        .unwrap_or_else(|| panic!("{rid} not answered after the restart; log:\n{}", node.log()));
    }
    std::thread::sleep(Duration::from_millis(700));
    let ran: Vec<&str> = all.into_iter().filter(|r| runs(&setup, r) == 1).collect();
    assert!(ran.contains(&"r1") && !ran.contains(&"n2"), "{ran:?}");
    for rid in ran.iter().copied() {
        let replies = cp.replies_for(rid);
        assert_eq!(replies.len(), 1, "{rid}: exactly one answer: {replies:?}");
        assert_eq!(replies[0]["status"], "ok", "{rid}: {replies:?}");
        assert!(
            replies[0]["output"]["pid"].as_i64().unwrap_or(0) > 0,
            "{replies:?}"
        );
        let statuses = cp.statuses(&format!("wl-{rid}"));
        assert_eq!(
            statuses.iter().filter(|s| s["status"] == "running").count(),
            1,
            "{rid}: one running status: {statuses:?}"
        );
        assert_eq!(runs(&setup, rid), 1, "{rid} ran exactly once");
    }
    for rid in all.into_iter().filter(|r| !ran.contains(r)) {
        let replies = cp.replies_for(rid);
        assert_eq!(replies.len(), 1, "{rid}: exactly one answer: {replies:?}");
        assert_eq!(replies[0]["status"], "error", "{rid}: {replies:?}");
        let text = replies[0]["error"].as_str().unwrap_or_default().to_string();
        assert!(
            text.starts_with("Controller host is busy with")
                && text.contains("interrupted by a node restart"),
            "{rid}: a retryable refusal that says why: {text}"
        );
        let statuses = cp.statuses(&format!("wl-{rid}"));
        let failed: Vec<&Value> = statuses
            .iter()
            .filter(|s| s["status"] == "failed")
            .collect();
        assert_eq!(failed.len(), 1, "{rid}: one failed status: {statuses:?}");
        assert_eq!(failed[0]["rejection_reason"], "host_busy", "{failed:?}");
        assert_eq!(runs(&setup, rid), 0, "{rid} never ran");
    }
    // A redelivery of an interrupted start repeats its answer; nothing is spawned for it.
    start(&uuid, "n1", json!({}));
    start(&uuid, "r1", json!({}));
    wait_for(Duration::from_secs(10), || {
        (cp.replies_for("n1").len() == 2 && cp.replies_for("r1").len() == 2).then_some(())
    })
    .unwrap_or_else(|| panic!("redeliveries not answered; log:\n{}", node.log()));
    assert_eq!(cp.replies_for("n1")[1]["status"], "error");
    assert_eq!(cp.replies_for("r1")[1]["status"], "ok");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(runs(&setup, "n1"), 0, "n1 never ran");
    assert_eq!(runs(&setup, "r1"), 1, "r1 ran exactly once");
}

/// The supervisor outlives what a workload of its uid or a stopping node sends it: SIGTERM,
/// SIGINT, SIGHUP, SIGUSR1, SIGUSR2 are caught and ignored, and SIGPIPE (its pipe to a node
/// that is gone) is ignored. The workload's completion then goes out with its own exit code.
#[test]
fn g13_a_supervisor_outlives_the_signals_a_workload_or_a_stopping_node_sends_it() {
    let (_broker, cp, setup) = rig(concat!(
        "cyberwave:\n  inference: |\n",
        "    echo $PPID > t/sup\n",
        "    until [ -e t/stop ]; do sleep 0.05; done\n",
        "    exit 6\n",
    ));
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    let node = setup.spawn();
    node.wait_ready(READY);
    cp.command(
        &node.uuid(),
        json!({"command": "inference", "request_id": "sig", "params": {"workload_uuid": "wl-sig"}}),
    );
    assert_eq!(cp.wait_reply("sig", REPLY).expect("reply")["status"], "ok");
    let sup: i32 = wait_for(REPLY, || {
        std::fs::read_to_string(setup.cwd.join("t/sup"))
            .ok()?
            .trim()
            .parse()
            .ok()
    })
    .expect("the workload wrote its supervisor's pid");
    for sig in [
        libc::SIGTERM,
        libc::SIGINT,
        libc::SIGHUP,
        libc::SIGUSR1,
        libc::SIGUSR2,
        libc::SIGPIPE,
    ] {
        // SAFETY: kill of the supervisor this test's workload named.
        assert_eq!(unsafe { libc::kill(sup, sig) }, 0, "signal {sig}");
    }
    std::thread::sleep(Duration::from_millis(300));
    let state = std::fs::read_to_string(format!("/proc/{sup}/stat")).unwrap_or_default();
    assert!(
        !state.is_empty() && !state.contains(") Z "),
        "the supervisor died: {state:?}; log:\n{}",
        node.log()
    );
    std::fs::write(setup.cwd.join("t/stop"), "").unwrap();
    let done = wait_for(Duration::from_secs(15), || {
        Some(completions(&cp, "wl-sig")).filter(|d| !d.is_empty())
    })
    .unwrap_or_else(|| panic!("no completion; log:\n{}", node.log()));
    assert_eq!(done[0]["exit_code"], 6, "{done:?}");
}
