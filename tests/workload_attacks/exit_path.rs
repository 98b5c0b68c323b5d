//! Workload attacks: see `mod.rs`. The way out of a workload: its supervisor reaps what it
//! adopts (no zombies pile up while it runs), a workload that fills the state dir's disk still
//! gets its completion out (D54), and starts in flight when the node is SIGKILLed are all
//! answered after its restart (D53), and its supervisor outlives the signals sent to it.

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::disk::Tmpfs;
use crate::support::scenario::error_of;
use crate::support::{procs, wait_for, Scenario, Start};

/// The pids of the zombie children of `parent`.
fn zombie_children(parent: i64) -> Vec<i32> {
    procs::all()
        .into_iter()
        .filter(|&pid| procs::state(pid) == Some('Z') && i64::from(procs::parent(pid)) == parent)
        .collect()
}

/// The supervisor is the subreaper of its workload: the orphans it adopts are reaped as soon as
/// they end, not when the workload does (a long workload that forks short-lived children must
/// not fill the process table with zombies).
#[test]
fn g13_the_supervisor_reaps_the_orphans_it_adopts_while_the_workload_runs() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  inference: for i in $(seq 20); do (sleep 0.01 &) ; done; touch forked; sleep 4\n",
    )
    .node();
    Start::new("inference", "z1").ok(&rig.cp, &node);
    let shim = rig.supervisor_of("z1");
    wait_for(Duration::from_secs(5), || {
        rig.work("forked").exists().then_some(())
    })
    .expect("the workload forked its children");
    // Each orphan sleeps 10 ms; a second is plenty for all to end and be reaped.
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        rig.cp
            .statuses("wl-z1")
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
    let done = rig
        .cp
        .wait_status("wl-z1", "completed", Duration::from_secs(15))
        .expect("no completion");
    let done: Vec<&Value> = done.iter().filter(|b| b["status"] == "completed").collect();
    assert_eq!(done[0]["exit_code"], 0, "{done:?}");
}

/// A small tmpfs mounted on the node's state dir (unmounted when dropped: declare it after the
/// `NodeSetup`, before the node). Mounting needs root: the tests using it need root.
/// The workload of the full-disk tests: once `t/go` exists, it fills the state dir's disk with
/// its own stdout (the write that finds it full fails) and exits 7.
const FILLER: &str = "cyberwave:\n  inference: until [ -e t/go ]; do sleep 0.05; done; head -c 8000000 /dev/zero | tr '\\0' x; exit 7\n";

fn full_disk_scenario() -> Scenario {
    Scenario::new(FILLER)
        .env("CYBERWAVE_MIN_FREE_DISK_MB", "0")
        .dir("t")
}

/// D54: a workload whose own log fills the state dir's disk gets its completion out while the
/// disk is still full (its supervisor cannot write `exit.json` and hands the status over), with
/// its real exit code; once space returns, nothing of it is left behind.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_a_workload_that_fills_the_disk_with_its_log_still_gets_its_completion_out() {
    let rig = full_disk_scenario().rig();
    let _disk = Tmpfs::on_state_dir(&rig.setup, "size=4m,mode=0700");
    let node = rig.node();
    Start::new("inference", "fill").ok(&rig.cp, &node);
    rig.touch("t/go");
    let done = rig
        .cp
        .wait_completions("wl-fill", Duration::from_secs(15))
        .expect("no completion while the disk is full");
    assert_eq!(done[0]["exit_code"], 7, "{done:?}");
    assert_eq!(done[0]["success"], false, "{done:?}");
    // Space returns (the test frees the log); the workload's record is settled: its exit
    // record written or the whole record retired once the completion was acknowledged.
    let logs = rig.state("workload_logs");
    for e in std::fs::read_dir(&logs).unwrap().flatten() {
        let _ = std::fs::remove_file(e.path());
    }
    let dir = rig.state("workloads/fill");
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
        rig.cp.completions("wl-fill").len(),
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
    let rig = full_disk_scenario().rig();
    let _disk = Tmpfs::on_state_dir(&rig.setup, "size=4m,mode=0700");
    let mut node = rig.node();
    Start::new("inference", "fill2").ok(&rig.cp, &node);
    // The supervisor writes started.json right after it reports the pid: wait, do not race it.
    let shim = rig.supervisor_of("fill2");
    node.kill9();
    rig.touch("t/go");
    // The workload ends; its supervisor does not wait for space that only the node could free.
    let gone = wait_for(Duration::from_secs(10), || {
        (!std::path::Path::new(&format!("/proc/{shim}")).exists()).then_some(())
    });
    assert!(
        gone.is_some(),
        "the supervisor still waits for disk space after its workload ended"
    );
    let _node = rig.node();
    let done = rig
        .cp
        .wait_completions("wl-fill2", Duration::from_secs(15))
        .expect("no completion after the restart on a full disk");
    assert_eq!(done[0]["exit_code"], 7, "{done:?}");
}

/// D53: the node is SIGKILLed with starts in flight, on a slow disk: at least one whose
/// workload runs (not yet answered: its record is being synced), and others not started yet
/// (waiting for that sync, or behind the image of `i1`, which is being saved); `n2`, last,
/// never started. After the restart every one of them gets exactly one answer, without being
/// asked again: `ok` and `running` for each that runs, a retryable host-busy error and a `failed`
/// status for each that never started; none runs twice.
#[test]
fn g1_starts_in_flight_when_the_node_is_killed_are_all_answered_after_its_restart() {
    let mut rig = Scenario::new(
        "cyberwave:\n  inference: echo $$ >> t/$CYBERWAVE_REQUEST_ID.runs; sleep 4\n",
    )
    .env("CYBERWAVE_MAX_CONCURRENT_WORKLOADS", "8")
    .slow_disk(2500)
    .dir("t")
    .rig();
    let mut node = rig.node();
    Start::new("inference", "r1").send(&rig.cp, &node);
    Start::new("inference", "r2").send(&rig.cp, &node);
    // Saving an image syncs it: the spawner is held up before it forks this one's supervisor.
    Start::new("inference", "i1")
        .with(json!({"image_bytes_base64": "aGVsbG8="}))
        .send(&rig.cp, &node);
    Start::new("inference", "n1").send(&rig.cp, &node);
    Start::new("inference", "n2").send(&rig.cp, &node);
    wait_for(Duration::from_secs(10), || {
        (rig.runs("r1") == 1).then_some(())
    })
    .expect("the first workload did not run");
    std::thread::sleep(Duration::from_millis(200));
    let all = ["r1", "r2", "i1", "n1", "n2"];
    for rid in all {
        assert!(
            rig.cp.replies_for(rid).is_empty(),
            "{rid} was answered before the kill: the test needs it in flight"
        );
    }
    node.kill9();
    rig.setup.unset("CYBERWAVE_TEST_SLOW_FSYNC_MS");
    let node = rig.node();
    for rid in all {
        wait_for(Duration::from_secs(10), || {
            Some(()).filter(|_| !rig.cp.replies_for(rid).is_empty())
        })
        .unwrap_or_else(|| panic!("{rid} not answered after the restart; log:\n{}", node.log()));
    }
    std::thread::sleep(Duration::from_millis(700));
    let ran: Vec<&str> = all.into_iter().filter(|r| rig.runs(r) == 1).collect();
    assert!(ran.contains(&"r1") && !ran.contains(&"n2"), "{ran:?}");
    for rid in ran.iter().copied() {
        let replies = rig.cp.replies_for(rid);
        assert_eq!(replies.len(), 1, "{rid}: exactly one answer: {replies:?}");
        assert_eq!(replies[0]["status"], "ok", "{rid}: {replies:?}");
        assert!(
            replies[0]["output"]["pid"].as_i64().unwrap_or(0) > 0,
            "{replies:?}"
        );
        let statuses = rig.cp.statuses(&format!("wl-{rid}"));
        assert_eq!(
            statuses.iter().filter(|s| s["status"] == "running").count(),
            1,
            "{rid}: one running status: {statuses:?}"
        );
        assert_eq!(rig.runs(rid), 1, "{rid} ran exactly once");
    }
    for rid in all.into_iter().filter(|r| !ran.contains(r)) {
        let replies = rig.cp.replies_for(rid);
        assert_eq!(replies.len(), 1, "{rid}: exactly one answer: {replies:?}");
        assert_eq!(replies[0]["status"], "error", "{rid}: {replies:?}");
        let text = error_of(&replies[0]).to_string();
        assert!(
            text.starts_with("Controller host is busy with")
                && text.contains("interrupted by a node restart"),
            "{rid}: a retryable refusal that says why: {text}"
        );
        let statuses = rig.cp.statuses(&format!("wl-{rid}"));
        let failed: Vec<&Value> = statuses
            .iter()
            .filter(|s| s["status"] == "failed")
            .collect();
        assert_eq!(failed.len(), 1, "{rid}: one failed status: {statuses:?}");
        assert_eq!(failed[0]["rejection_reason"], "host_busy", "{failed:?}");
        assert_eq!(rig.runs(rid), 0, "{rid} never ran");
    }
    // A redelivery of an interrupted start repeats its answer; nothing is spawned for it.
    Start::new("inference", "n1").send(&rig.cp, &node);
    Start::new("inference", "r1").send(&rig.cp, &node);
    wait_for(Duration::from_secs(10), || {
        (rig.cp.replies_for("n1").len() == 2 && rig.cp.replies_for("r1").len() == 2).then_some(())
    })
    .expect("redeliveries not answered");
    assert_eq!(rig.cp.replies_for("n1")[1]["status"], "error");
    assert_eq!(rig.cp.replies_for("r1")[1]["status"], "ok");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(rig.runs("n1"), 0, "n1 never ran");
    assert_eq!(rig.runs("r1"), 1, "r1 ran exactly once");
}

/// The supervisor outlives what a workload of its uid or a stopping node sends it: SIGTERM,
/// SIGINT, SIGHUP, SIGUSR1, SIGUSR2 are caught and ignored, and SIGPIPE (its pipe to a node
/// that is gone) is ignored. The workload's completion then goes out with its own exit code.
#[test]
fn g13_a_supervisor_outlives_the_signals_a_workload_or_a_stopping_node_sends_it() {
    let (rig, node) = Scenario::new(concat!(
        "cyberwave:\n  inference: |\n",
        "    echo $PPID > t/sup\n",
        "    until [ -e t/stop ]; do sleep 0.05; done\n",
        "    exit 6\n",
    ))
    .dir("t")
    .node();
    Start::new("inference", "sig").ok(&rig.cp, &node);
    let sup = rig.pid_in("t/sup");
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
    assert!(
        procs::alive(sup),
        "the supervisor died: {:?}; log:\n{}",
        procs::state(sup),
        node.log()
    );
    rig.touch("t/stop");
    let done = rig
        .cp
        .wait_completions("wl-sig", Duration::from_secs(15))
        .expect("no completion");
    assert_eq!(done[0]["exit_code"], 6, "{done:?}");
}
