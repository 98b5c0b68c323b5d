//! Workload attacks: see `mod.rs`. The way out of a workload: its supervisor reaps what it
//! adopts (no zombies pile up while it runs), a workload that fills the state dir's disk still
//! gets its completion out (D54), and starts in flight when the node is SIGKILLed are all
//! answered after its restart (D53).

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::node::NodeSetup;
use crate::support::{wait_for, Broker, ControlPlane};

const READY: Duration = Duration::from_secs(15);

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
fn the_supervisor_reaps_the_orphans_it_adopts_while_the_workload_runs() {
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
