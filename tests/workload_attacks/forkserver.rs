//! The fork server (issue 25 item 5) against a workload: the supervisor it forks holds what an
//! exec'd supervisor held and nothing more (D46.1), the fork server itself holds nothing of the
//! node, and a workload that kills it costs the next start nothing (it is exec'd instead).

use std::path::Path;

use crate::support::node::NodeProcess;
use crate::support::rig;
use crate::support::scenario::Start;
use crate::support::timeouts::{READY, REPLY};
use crate::support::wait_for;

/// Waits until the workload has written its supervisor's pid (its `$PPID`) to `t/<rid>.sup`.
const MANIFEST: &str = "cyberwave:\n  training: |\n    echo $PPID > t/$CYBERWAVE_REQUEST_ID.sup\n    until [ -e t/$CYBERWAVE_REQUEST_ID.stop ]; do sleep 0.05; done\n";

pub(super) fn proc_text(pid: i32, what: &str) -> String {
    std::fs::read(format!("/proc/{pid}/{what}"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// Field `n` after the command of `/proc/<pid>/stat` (0: the state, 1: the parent, 2: the
/// process group).
fn stat_field(pid: i32, n: usize) -> i32 {
    let stat = proc_text(pid, "stat");
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    after
        .split_whitespace()
        .nth(n)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0)
}

pub(super) fn parent_of(pid: i32) -> i32 {
    stat_field(pid, 1)
}

pub(super) fn group_of(pid: i32) -> i32 {
    stat_field(pid, 2)
}

/// The node's children with the fork server's command line in `/`: the fork server (which
/// leads its process group) and its standby (in that group).
pub(super) fn in_root(node: &NodeProcess) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            parent_of(*pid) == node.pid()
                && proc_text(*pid, "cmdline").contains(" __forkserver")
                && std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|c| c == Path::new("/"))
        })
        .collect()
}

/// The standby of the fork server `server`: forked ahead, waiting for the next start.
pub(super) fn standby_of(node: &NodeProcess, server: i32) -> Option<i32> {
    in_root(node)
        .into_iter()
        .find(|p| *p != server && group_of(*p) == server)
}

/// Descriptor number → what it points at.
fn fds(pid: i32) -> Vec<(i32, String)> {
    let mut v: Vec<(i32, String)> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_str()?.parse().ok()?;
            let to = std::fs::read_link(e.path()).ok()?;
            Some((n, to.display().to_string()))
        })
        .collect();
    v.sort();
    v
}

/// The node's fork servers: its children with the fork server's command line in `/` that lead
/// their process group (a standby is in its fork server's).
pub(super) fn fork_servers(node: &NodeProcess) -> Vec<i32> {
    in_root(node)
        .into_iter()
        .filter(|p| group_of(*p) == *p)
        .collect()
}

pub(super) fn supervisor_of(dir: &Path, rid: &str) -> i32 {
    wait_for(REPLY, || {
        std::fs::read_to_string(dir.join(format!("t/{rid}.sup")))
            .ok()?
            .trim()
            .parse()
            .ok()
    })
    .unwrap_or_else(|| panic!("the workload {rid} did not write its supervisor's pid"))
}

/// D46.1 through the fork server: the supervisor is the node's child (its reaper reaps it), runs
/// in the workload's directory with the workload's environment alone, and holds exactly its three
/// streams (stdin `/dev/null`, stdout the pid pipe and then `/dev/null`, stderr `shim.log`): not the fork server's
/// socket, not the descriptors it received. The fork server itself holds its socket and two
/// `/dev/null`s, and none of the node's environment (its API key).
#[test]
fn g13_a_supervisor_forked_by_the_fork_server_holds_only_its_three_streams() {
    let (_b, cp, setup) = rig(MANIFEST);
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    let node = setup.spawn();
    node.wait_ready(READY);
    let w = Start::training("fs1");
    assert_eq!(w.reply(&cp, &node)["status"], "ok");
    let sup = supervisor_of(&setup.cwd, "fs1");
    assert_eq!(
        parent_of(sup),
        node.pid(),
        "the supervisor is the node's child"
    );
    let cmdline = proc_text(sup, "cmdline");
    assert!(
        cmdline.contains(" __forkserver"),
        "forked, not exec'd: {cmdline}"
    );
    let cwd = std::fs::read_link(format!("/proc/{sup}/cwd")).unwrap();
    assert!(cwd.ends_with("workloads/fs1"), "{}", cwd.display());
    // Once it has settled (it may still be writing its start record: a temporary file and its
    // directory for a moment).
    let _ = wait_for(REPLY, || (fds(sup).len() == 3).then_some(()));
    let held = fds(sup);
    let numbers: Vec<i32> = held.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        numbers,
        [0, 1, 2],
        "the supervisor holds only its streams: {held:?}"
    );
    assert_eq!(held[0].1, "/dev/null", "{held:?}");
    // Its stdout was the pid pipe; once the pid is told, `/dev/null` (shim.rs, report_start).
    assert_eq!(held[1].1, "/dev/null", "{held:?}");
    assert!(held[2].1.ends_with("workloads/fs1/shim.log"), "{held:?}");
    // Its environment is the workload's (the workload found `t/fs1.sup` by its
    // CYBERWAVE_REQUEST_ID), set after the fork: /proc shows the fork server's empty block.
    let environ = proc_text(sup, "environ");
    for secret in setup.secrets() {
        assert!(
            !environ.contains(&secret),
            "the node's secret reached the supervisor"
        );
    }

    let servers = fork_servers(&node);
    assert_eq!(servers.len(), 1, "one fork server: {servers:?}");
    let server = servers[0];
    // The fork server and its standby (forked again after the start above took the first):
    // their socket, two `/dev/null`s and the pipes between them (the standby's way to know the
    // fork server is gone: both its ends in the fork server, which hands the read end on to
    // each standby; the fork server's way to know the standby took a request); nothing of the
    // node, no environment.
    let standby = wait_for(REPLY, || standby_of(&node, server))
        .unwrap_or_else(|| panic!("no standby; log:\n{}", node.log()));
    for (who, pid, pipes) in [("fork server", server, 3), ("standby", standby, 2)] {
        let held = fds(pid);
        let numbers: Vec<i32> = held.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            numbers.get(..3),
            Some([0, 1, 2].as_slice()),
            "the {who} holds its streams: {held:?}"
        );
        assert_eq!(
            held.len(),
            3 + pipes,
            "and {pipes} pipes, nothing else: {held:?}"
        );
        assert!(held[0].1.starts_with("socket:"), "{held:?}");
        assert_eq!(
            (held[1].1.as_str(), held[2].1.as_str()),
            ("/dev/null", "/dev/null")
        );
        assert!(
            held[3..].iter().all(|(_, to)| to.starts_with("pipe:")),
            "{held:?}"
        );
        assert_eq!(
            proc_text(pid, "environ"),
            "",
            "the {who} has no environment"
        );
    }

    std::fs::write(setup.cwd.join("t/fs1.stop"), "").unwrap();
    assert_eq!(w.completion(&cp)["exit_code"], 0, "{}", node.log());
}

/// A same-uid workload kills the fork server: the next start is exec'd instead (`__shim` on its
/// command line), answered and reported; the node says once why.
#[test]
fn g13_a_workload_that_kills_the_fork_server_costs_the_next_start_nothing() {
    let (_b, cp, setup) = rig(MANIFEST);
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    let node = setup.spawn();
    node.wait_ready(READY);
    let servers = wait_for(REPLY, || {
        Some(fork_servers(&node)).filter(|s| !s.is_empty())
    })
    .unwrap_or_else(|| panic!("no fork server; log:\n{}", node.log()));
    // As the workload would (its uid, its `kill`).
    // SAFETY: kill of a process this test found as the node's fork server.
    unsafe {
        libc::kill(servers[0], libc::SIGKILL);
    }
    // Its standby ends with it (it never takes a request once the fork server is gone).
    assert!(
        wait_for(REPLY, || in_root(&node).is_empty().then_some(())).is_some(),
        "left: {:?}",
        in_root(&node)
    );
    let w = Start::training("fs2");
    assert_eq!(w.reply(&cp, &node)["status"], "ok", "{}", node.log());
    let sup = supervisor_of(&setup.cwd, "fs2");
    let cmdline = proc_text(sup, "cmdline");
    assert!(cmdline.contains(" __shim "), "exec'd: {cmdline}");
    assert_eq!(parent_of(sup), node.pid());
    assert!(
        node.log()
            .contains("supervisors are exec'd until a new one is started"),
        "{}",
        node.log()
    );
    std::fs::write(setup.cwd.join("t/fs2.stop"), "").unwrap();
    assert_eq!(w.completion(&cp)["exit_code"], 0, "{}", node.log());
    // And the one after: exec'd too, reported too.
    let w = Start::training("fs3");
    assert_eq!(w.reply(&cp, &node)["status"], "ok", "{}", node.log());
    let _ = supervisor_of(&setup.cwd, "fs3");
    std::fs::write(setup.cwd.join("t/fs3.stop"), "").unwrap();
    assert_eq!(w.completion(&cp)["exit_code"], 0, "{}", node.log());
}

/// `CYBERWAVE_NO_FORKSERVER=1`: no fork server, every supervisor exec'd as before.
#[test]
fn g13_without_the_fork_server_every_supervisor_is_execd() {
    let (_b, cp, mut setup) = rig(MANIFEST);
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    setup.set("CYBERWAVE_NO_FORKSERVER", "1");
    let node = setup.spawn();
    node.wait_ready(READY);
    let w = Start::training("fs4");
    assert_eq!(w.reply(&cp, &node)["status"], "ok");
    let sup = supervisor_of(&setup.cwd, "fs4");
    assert!(proc_text(sup, "cmdline").contains(" __shim "));
    assert!(fork_servers(&node).is_empty());
    std::fs::write(setup.cwd.join("t/fs4.stop"), "").unwrap();
    assert_eq!(w.completion(&cp)["exit_code"], 0, "{}", node.log());
}

/// A fork server that is gone is started again once its wait
/// (`CYBERWAVE_NODE_FORKSERVER_RESTART_SECONDS`, 30 s by default) is over: the start that found
/// it gone is exec'd, a start after the wait is forked by a new fork server.
#[test]
fn g13_a_killed_fork_server_is_started_again_after_its_wait() {
    let (_b, cp, mut setup) = rig(MANIFEST);
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    setup.set("CYBERWAVE_NODE_FORKSERVER_RESTART_SECONDS", "0.2");
    let node = setup.spawn();
    node.wait_ready(READY);
    let first = wait_for(REPLY, || fork_servers(&node).first().copied())
        .unwrap_or_else(|| panic!("no fork server; log:\n{}", node.log()));
    // SAFETY: kill of a process this test found as the node's fork server.
    unsafe {
        libc::kill(first, libc::SIGKILL);
    }
    assert!(wait_for(REPLY, || fork_servers(&node).is_empty().then_some(())).is_some());
    let w = Start::training("fs5");
    assert_eq!(w.reply(&cp, &node)["status"], "ok", "{}", node.log());
    let sup = supervisor_of(&setup.cwd, "fs5");
    assert!(proc_text(sup, "cmdline").contains(" __shim "), "exec'd");
    std::fs::write(setup.cwd.join("t/fs5.stop"), "").unwrap();
    assert_eq!(w.completion(&cp)["exit_code"], 0, "{}", node.log());
    std::thread::sleep(std::time::Duration::from_millis(400));
    let w2 = Start::training("fs6");
    assert_eq!(w2.reply(&cp, &node)["status"], "ok", "{}", node.log());
    let sup2 = supervisor_of(&setup.cwd, "fs6");
    assert!(
        proc_text(sup2, "cmdline").contains(" __forkserver"),
        "forked by a new fork server; log:\n{}",
        node.log()
    );
    let again = fork_servers(&node);
    assert_eq!(again.len(), 1, "{again:?}");
    assert_ne!(again[0], first);
    assert!(
        node.log().contains("fork server started again"),
        "{}",
        node.log()
    );
    std::fs::write(setup.cwd.join("t/fs6.stop"), "").unwrap();
    assert_eq!(w2.completion(&cp)["exit_code"], 0, "{}", node.log());
}
