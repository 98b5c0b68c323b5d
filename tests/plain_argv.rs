//! Starts at the speed of fork (issue 25 item 5): a command template that is a plain word list
//! is exec'd by the supervisor itself, without `bash -c` in between; one with any shell syntax
//! still goes through bash, and a plain one sees the environment bash would have given it.

use std::path::Path;

use serde_json::json;

use crate::support::node::NodeSetup;
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{Broker, ControlPlane};

/// A `bash` first in the workloads' PATH that notes each command it is given, then is bash.
fn noting_bash(setup: &mut NodeSetup) -> std::path::PathBuf {
    let dir = setup.home.join("fakebin");
    std::fs::create_dir_all(&dir).unwrap();
    let notes = setup.home.join("bash.notes");
    let script = format!(
        "#!/bin/sh\nprintf '%s\\n' \"$*\" >> '{}'\nexec /bin/bash \"$@\"\n",
        notes.display()
    );
    let bash = dir.join("bash");
    std::fs::write(&bash, script).unwrap();
    std::fs::set_permissions(&bash, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = setup.env.get("PATH").cloned().unwrap_or_default();
    setup.set("PATH", &format!("{}:{path}", dir.display()));
    notes
}

fn run(cp: &ControlPlane, uuid: &str, kind: &str, rid: &str) {
    let wl = format!("wl-{rid}");
    cp.command(
        uuid,
        json!({"command": kind, "request_id": rid, "params": {"workload_uuid": wl}}),
    );
    let reply = cp.wait_reply(rid, REPLY).expect("start answered");
    assert_eq!(reply["status"], "ok", "{reply}");
    assert!(
        cp.wait_status(&wl, "completed", DONE).is_some(),
        "{rid} completed"
    );
}

fn stdout_of(setup: &NodeSetup, rid: &str) -> String {
    let logs = setup.config_dir().join("workload_logs");
    let name = std::fs::read_dir(&logs)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n.contains(rid) && n.ends_with(".stdout.log")
        })
        .unwrap_or_else(|| panic!("no stdout log for {rid} in {}", logs.display()));
    std::fs::read_to_string(name).unwrap()
}

#[test]
fn a_plain_argv_workload_runs_without_a_shell_and_shell_syntax_still_gets_bash() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    let notes = noting_bash(&mut setup);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  inference: touch t/plain.ran\n  training: touch t/shell.ran; true\n",
    );
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    let node = setup.spawn();
    node.wait_ready(READY);
    run(&cp, &node.uuid(), "inference", "plain1");
    run(&cp, &node.uuid(), "training", "shell1");
    assert!(setup.cwd.join("t/plain.ran").exists(), "{}", node.log());
    assert!(setup.cwd.join("t/shell.ran").exists(), "{}", node.log());
    let noted = std::fs::read_to_string(&notes).unwrap_or_default();
    assert!(
        noted.contains("-c touch t/shell.ran; true"),
        "shell syntax goes through bash: {noted:?}"
    );
    assert!(
        !noted.contains("t/plain.ran"),
        "a plain word list is exec'd without bash: {noted:?}"
    );
}

/// The same `env` run both ways (`#` makes it bash's) prints the same environment.
#[test]
fn a_plain_argv_workload_gets_the_environment_bash_would_give_it() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    let env = ["/usr/bin/env", "/bin/env"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("env installed");
    // What a node started from a login shell has: a PWD that is not its working directory,
    // a shell level, an OLDPWD that is no directory and a `_` of its own.
    setup.set("PWD", "/");
    setup.set("SHLVL", "2");
    setup.set("OLDPWD", "/nonexistent-old-pwd");
    setup.set("_", "/usr/bin/whatever");
    setup.write(
        "cyberwave.yml",
        &format!("cyberwave:\n  inference: {env}\n  training: {env} # through bash\n"),
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    run(&cp, &node.uuid(), "inference", "envplain");
    run(&cp, &node.uuid(), "training", "envbash");
    let lines = |rid: &str| {
        let mut v: Vec<String> = stdout_of(&setup, rid)
            .lines()
            // The per-workload ones differ by design.
            .filter(|l| {
                !["CYBERWAVE_", "NVIDIA_", "CUDA_"]
                    .iter()
                    .any(|p| l.starts_with(p))
            })
            .map(String::from)
            .collect();
        v.sort();
        v
    };
    let plain = lines("envplain");
    let bash = lines("envbash");
    assert_eq!(plain, bash);
    assert!(plain.iter().any(|l| l == &format!("_={env}")), "{plain:?}");
    assert!(plain.iter().any(|l| l == "SHLVL=2"), "{plain:?}");
    assert!(!plain.iter().any(|l| l.starts_with("OLDPWD=")), "{plain:?}");
}

/// D46.1 on the direct path: a workload exec'd without bash holds no descriptor of the node
/// either (its broker socket, its lock). `ls` lists its own descriptors; the only one beyond
/// its three streams is the directory it is reading.
#[test]
fn g13_a_plain_argv_workload_holds_no_descriptor_of_the_node() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    let notes = noting_bash(&mut setup);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  inference: ls -l /proc/self/fd\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    run(&cp, &node.uuid(), "inference", "fdplain");
    let noted = std::fs::read_to_string(&notes).unwrap_or_default();
    assert!(
        !noted.contains("/proc/self/fd"),
        "went through bash: {noted:?}"
    );
    let listing = stdout_of(&setup, "fdplain");
    let foreign: Vec<&str> = listing
        .lines()
        .filter_map(|l| l.split_once(" -> "))
        .filter(|(left, target)| {
            let n = left.split_whitespace().last().unwrap_or("");
            !matches!(n, "0" | "1" | "2") && !target.starts_with("/proc/")
        })
        .map(|(_, target)| target)
        .collect();
    assert!(
        foreign.is_empty(),
        "the workload inherited descriptors of the node: {foreign:?}\n{listing}"
    );
    assert!(!listing.contains("socket:"), "{listing}");
}

/// The supervisor looks bash up in the workloads' PATH before the start (not by one failed exec
/// per entry after it); where what it found cannot be exec'd, the exec by name decides, as it
/// always did: here the first `bash` names a missing interpreter, so the next one runs.
#[test]
fn a_bash_in_path_that_cannot_be_run_leaves_the_next_one_to_run_the_command() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    let notes = noting_bash(&mut setup);
    let broken = setup.home.join("brokenbin");
    std::fs::create_dir_all(&broken).unwrap();
    let bash = broken.join("bash");
    std::fs::write(&bash, "#!/nonexistent/interpreter\n").unwrap();
    std::fs::set_permissions(&bash, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = setup.env.get("PATH").cloned().unwrap_or_default();
    setup.set("PATH", &format!("{}:{path}", broken.display()));
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  training: touch t/shell.ran; true\n",
    );
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    let node = setup.spawn();
    node.wait_ready(READY);
    run(&cp, &node.uuid(), "training", "shell2");
    assert!(setup.cwd.join("t/shell.ran").exists(), "{}", node.log());
    let noted = std::fs::read_to_string(&notes).unwrap_or_default();
    assert!(
        noted.contains("-c touch t/shell.ran; true"),
        "the next bash in PATH ran it: {noted:?}"
    );
}
