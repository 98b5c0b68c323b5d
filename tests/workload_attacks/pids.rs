//! Workload attacks: see `mod.rs`. A workload that takes every process its cgroup may hold.
//! Under systemd the node's threads and its workloads' processes count against one `TasksMax`
//! (`KillMode=process` keeps the workloads in the node's cgroup), so a workload that forks
//! until the kernel says no leaves the node unable to make a thread or a process: it must
//! neither abort nor wedge, must answer, must refuse a start it cannot make with a clear error,
//! and must still cancel and report the workload that did it.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;

use crate::support::scenario::error_of;
use crate::support::scenario::Start;
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{wait_for, Rig, Scenario};

/// A pids cgroup of its own (cgroup v1's `pids` hierarchy, or v2's unified one), every process
/// in it killed and the cgroup removed when dropped. Making one needs root.
struct PidsCgroup(PathBuf);

impl PidsCgroup {
    fn new(tag: &str) -> PidsCgroup {
        crate::support::assert_root("a pids cgroup of the test's own");
        let v1 = PathBuf::from("/sys/fs/cgroup/pids");
        let v2 = PathBuf::from("/sys/fs/cgroup");
        let parent = if v1.join("cgroup.procs").exists() {
            v1
        } else {
            // v2: the pids controller enabled for the root's children.
            let _ = std::fs::write(v2.join("cgroup.subtree_control"), "+pids");
            v2
        };
        let dir = parent.join(format!("cwtest-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir(&dir);
        std::fs::create_dir(&dir)
            .unwrap_or_else(|e| panic!("cannot make the cgroup {}: {e}", dir.display()));
        assert!(
            dir.join("pids.max").exists(),
            "{} has no pids.max: no pids controller",
            dir.display()
        );
        PidsCgroup(dir)
    }

    /// What the node runs under: a shell that enters the cgroup, then execs the node.
    fn under(&self) -> Vec<String> {
        let procs = self.0.join("cgroup.procs");
        vec![
            "sh".into(),
            "-c".into(),
            format!("echo $$ > {} && exec \"$0\" \"$@\"", procs.display()),
        ]
    }

    fn current(&self) -> u64 {
        std::fs::read_to_string(self.0.join("pids.current"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    fn set_max(&self, max: u64) {
        std::fs::write(self.0.join("pids.max"), max.to_string()).expect("write pids.max");
    }

    fn pids(&self) -> Vec<i32> {
        std::fs::read_to_string(self.0.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for PidsCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(self.0.join("pids.max"), "max");
        for _ in 0..100 {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            for p in pids {
                // SAFETY: kill of a process in the test's own cgroup.
                unsafe {
                    libc::kill(p, libc::SIGKILL);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Forks children that sleep until a fork fails, then says how many it made (`full`).
const BOMB: &str = "import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n    if pid == 0:\n        time.sleep(600)\n        os._exit(0)\n    n += 1\nwith open('full.tmp', 'w') as f:\n    f.write(str(n))\nos.rename('full.tmp', 'full')\ntime.sleep(600)\n";

#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_a_workload_that_takes_every_process_of_the_nodes_cgroup_neither_ends_nor_wedges_the_node() {
    let mut rig = Scenario::new(
        "cyberwave:\n  inference: python3 bomb.py\n  simulate: touch simulated\n  max_concurrent_workloads: 4\n",
    )
    .file("bomb.py", BOMB)
    .rig();
    let cg = PidsCgroup::new("pids");
    rig.setup.under = cg.under();
    let Rig { cp, setup, .. } = &rig;
    let node = setup.spawn();
    node.wait_ready(READY);
    // Room for the workload's supervisor, its shell or python, and a few children.
    let base = cg.current();
    cg.set_max(base + 16);
    Start::new("inference", "b1").ok(cp, &node);
    let made = wait_for(DONE, || {
        std::fs::read_to_string(setup.cwd.join("full")).ok()
    })
    .expect("the workload never filled its cgroup");
    assert!(
        cg.current() >= base + 16,
        "the cgroup is full: {made} children"
    );
    // The node answers, and refuses what it cannot start, in words.
    let st = cp
        .status(&node.uuid(), "st-full", REPLY)
        .expect("no status while the cgroup is full");
    assert_eq!(st["status"], "ok", "{st}");
    let refused = Start::new("simulate", "b2").reply(cp, &node);
    assert_eq!(refused["status"], "error", "{refused}");
    let why = error_of(&refused);
    assert!(why.contains("Failed to start simulate"), "{refused}");
    // The workload that did it is cancelled and reported; then starts work again.
    Start::new("cancel", "c1")
        .params(json!({"workload_request_id": "b1"}))
        .ok(cp, &node);
    cp.wait_status("wl-b1", "cancelled", DONE)
        .expect("the cancelled workload was not reported");
    Start::new("simulate", "b3").ok(cp, &node);
    assert!(
        !node.log().contains("panicked"),
        "the node panicked; log:\n{}",
        node.log()
    );
    drop(node);
}
