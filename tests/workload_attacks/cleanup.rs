//! Workload attacks on the cleanup at a workload's end (D25, guarantee 9): processes a workload
//! hides from it (a new session, a name that is not UTF-8, a zombie leader whose thread runs on,
//! a child that turns up only once its parent is killed, a job in a group of its own) are ended
//! before the workload is reported.

use crate::support::timeouts::REPLY;
use crate::support::{procs, Scenario, Start};

/// Runs a training workload that leaves a process behind (its pid in `pid_file`), waits for
/// its completion, and asserts that process is gone (killing it if not, so nothing leaks).
fn assert_left_behind_is_ended(manifest: &str, rid: &str, pid_file: &str, what: &str) {
    assert_left_behind_is_ended_with(manifest, rid, pid_file, what, &[]);
}

/// [`assert_left_behind_is_ended`] with these node settings.
fn assert_left_behind_is_ended_with(
    manifest: &str,
    rid: &str,
    pid_file: &str,
    what: &str,
    settings: &[(&str, &str)],
) {
    let mut scenario = Scenario::new(manifest);
    for (k, v) in settings {
        scenario = scenario.env(k, v);
    }
    let (rig, node) = scenario.node();
    let w = Start::training(rid);
    w.ok(&rig.cp, &node);
    w.completion(&rig.cp);
    let pid = rig.pid_in(pid_file);
    let still = procs::alive(pid);
    if still {
        procs::signal(pid, libc::SIGKILL);
    }
    assert!(
        !still,
        "pid {pid}, {what}, outlived the workload's completion"
    );
    // D59: nothing is cleared silently: the log names it, with its command line.
    assert!(
        node.wait_log(&format!("cleared pid {pid} ("), REPLY),
        "pid {pid}, {what}, cleared without a word: {}",
        node.log()
    );
}

/// D25 with `cloud_node.services: stop` (D59's strict rule; docs/workloads.md, "Nothing is left
/// behind"): a workload that starts a child in a session of its own (`setsid`, as daemonising
/// tools do) does not leave it running after the node reported the workload: the supervisor, a
/// subreaper, sees the child re-parented to it and clears it, not only the workload's process
/// group. With `services: keep`, the default, such a child is a service and outlives the
/// workload (tests/services.rs).
#[test]
fn g9_d25_a_child_that_setsids_out_of_the_group_does_not_outlive_the_report() {
    assert_left_behind_is_ended(
        "cloud_node:\n  services: stop\ncyberwave:\n  training: |\n    setsid sh -c 'echo $$ > escaped.pid; exec sleep 300' </dev/null >/dev/null 2>&1 &\n    while [ ! -s escaped.pid ]; do sleep 0.05; done\n",
        "esc",
        "escaped.pid",
        "started by the workload with setsid",
    );
}

/// D25, hidden from /proc readers: a child that leaves the session (`setsid`) and names itself
/// with bytes that are not UTF-8 (`prctl(PR_SET_NAME)`), so that its `/proc/<pid>/stat` is not
/// text. The supervisor's search for what is left must still find it.
#[test]
fn g9_d25_a_child_that_setsids_and_names_itself_in_bytes_that_are_not_utf8_does_not_outlive_the_report(
) {
    assert_left_behind_is_ended(
        "cloud_node:\n  services: stop\ncyberwave:\n  training: |\n    setsid python3 -c 'import ctypes, os, time; ctypes.CDLL(None).prctl(15, b\"\\xff\\xfe)x\", 0, 0, 0); open(\"named.pid\", \"w\").write(str(os.getpid())); time.sleep(300)' </dev/null >/dev/null 2>&1 &\n    while [ ! -s named.pid ]; do sleep 0.05; done\n",
        "named",
        "named.pid",
        "started by the workload with setsid, named in bytes that are not UTF-8",
    );
}

/// D25, hidden as a zombie: a child whose main thread ends by the raw `exit` system call while
/// another thread of it runs on. Its `/proc/<pid>/stat` says `Z`, so it passed for gone; the
/// kernel tells its parent nothing until that thread ends.
#[test]
fn g9_d25_a_child_that_looks_like_a_zombie_while_a_thread_of_it_runs_does_not_outlive_the_report() {
    assert_left_behind_is_ended(
        "cyberwave:\n  training: |\n    python3 -c 'import ctypes, os, threading, time; threading.Thread(target=time.sleep, args=(300,)).start(); open(\"zombie.pid\", \"w\").write(str(os.getpid())); ctypes.CDLL(None).syscall({\"x86_64\": 60, \"aarch64\": 93}[os.uname().machine], 0)' </dev/null >/dev/null 2>&1 &\n    while [ ! -s zombie.pid ]; do sleep 0.05; done\n    sleep 0.2\n",
        "zombie",
        "zombie.pid",
        "a child of the workload whose main thread ended while another runs",
    );
}

/// D25, one step behind the kill: a background job in a group of its own that ignores SIGTERM
/// has a child that left the session (`setsid`), so the first look finds only the job; the
/// child is re-parented to the supervisor only when the job dies of the SIGKILL. Each look after
/// that kills what it finds.
#[test]
fn g9_d25_a_child_that_turns_up_only_when_its_parent_is_killed_does_not_outlive_the_report() {
    let manifest = "cloud_node:\n  services: stop\ncyberwave:\n  training: |\n    set -m\n    ( trap '' TERM; setsid sh -c 'echo $$ > hidden.pid; exec sleep 300' </dev/null >/dev/null 2>&1 & while :; do sleep 0.05; done ) </dev/null >/dev/null 2>&1 &\n    while [ ! -s hidden.pid ]; do sleep 0.05; done\n";
    assert_left_behind_is_ended_with(
        manifest,
        "hidden",
        "hidden.pid",
        "re-parented to the supervisor only once its parent was killed",
        &[("CYBERWAVE_NODE_CLEANUP_GRACE_SECONDS", "0.3")],
    );
}

/// D25, without leaving the session: a workload script with job control on (`set -m`, or
/// Python's `subprocess.Popen(..., process_group=0)`) puts its background job in a process
/// group of its own, still in the supervisor's session, where the supervisor finds it: it does
/// not outlive the workload's completion, though it is not in the workload's first group.
#[test]
fn g9_d25_a_background_job_in_its_own_process_group_does_not_outlive_the_report() {
    assert_left_behind_is_ended(
        "cyberwave:\n  training: bash -c 'set -m; sleep 300 </dev/null >/dev/null 2>&1 & echo $! > bg.pid'\n",
        "pg",
        "bg.pid",
        "a background job of the workload in its own process group",
    );
}
