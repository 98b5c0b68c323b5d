//! A command template that is a plain word list (D71): it runs as `bash -c TEMPLATE` like every
//! other, with no emulation of bash in the node, and bash execs the lone command in its own
//! place, so the process the node reports is the program itself, with exactly the template's
//! words as its argv, the environment bash gives it, a clean start (its own process group, no
//! signal blocked or ignored, no descriptor of the node) and its own exit code.

use std::path::Path;

use serde_json::json;

use crate::support::node::NodeSetup;
use crate::support::rig;
use crate::support::scenario::Start;
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

/// A plain template goes through `bash -c` (the noting bash sees it), and bash execs the
/// program in its own place: the pid the node reports is the program's, its parent is the
/// supervisor (no bash waits in between), its argv is the template's words, and its exit code is
/// the completion's. Shell syntax runs as ever.
#[test]
fn a_plain_template_runs_through_bash_which_execs_the_program_in_its_place() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    let notes = noting_bash(&mut setup);
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    let show = setup.cwd.join("t/show");
    std::fs::write(
        &show,
        "#!/bin/sh\necho \"pid $$\"\ntr '\\0' ' ' < /proc/$PPID/cmdline; echo\nprintf '<%s>\\n' \"$0\" \"$@\"\nexit 5\n",
    )
    .unwrap();
    std::fs::set_permissions(&show, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  inference: ./t/show a,b --x=1 /c@d%e+f:g\n  training: touch t/shell.ran; true\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let rid = "plain1";
    cp.command(
        &node.uuid(),
        json!({"command": "inference", "request_id": rid, "params": {"workload_uuid": "wl-plain1"}}),
    );
    let reply = cp.wait_reply(rid, REPLY).expect("start answered");
    assert_eq!(reply["status"], "ok", "{reply}");
    let done = cp
        .wait_status("wl-plain1", "completed", DONE)
        .expect("completed");
    let done: Vec<&serde_json::Value> =
        done.iter().filter(|b| b["status"] == "completed").collect();
    assert_eq!(done[0]["exit_code"], 5, "{done:?}");
    let out = stdout_of(&setup, rid);
    let mut lines = out.lines();
    let pid: Option<i64> = lines
        .next()
        .and_then(|l| l.strip_prefix("pid "))
        .and_then(|p| p.parse().ok());
    assert_eq!(
        pid,
        reply["output"]["pid"].as_i64(),
        "the reported pid is the program's: {out}"
    );
    let parent = lines.next().unwrap_or_default();
    assert!(
        parent.contains("cyberwave-cloud-node"),
        "its parent is the supervisor, no bash in between: {out}"
    );
    let argv: Vec<&str> = lines.collect();
    assert_eq!(argv, ["<./t/show>", "<a,b>", "<--x=1>", "</c@d%e+f:g>"]);
    run(&cp, &node.uuid(), "training", "shell1");
    assert!(setup.cwd.join("t/shell.ran").exists(), "{}", node.log());
    let noted = std::fs::read_to_string(&notes).unwrap_or_default();
    assert!(
        noted.contains("-c ./t/show a,b --x=1 /c@d%e+f:g"),
        "a plain template goes through bash: {noted:?}"
    );
    assert!(
        noted.contains("-c touch t/shell.ran; true"),
        "shell syntax goes through bash: {noted:?}"
    );
}

/// A plain template and one with shell syntax (`#`) see the same environment: the one bash
/// gives (its `_`, its shell level, no `OLDPWD` that is no directory), whatever the node was
/// started with.
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

/// D46.1 for a plain template (exec'd by bash in its own place): the workload holds no
/// descriptor of the node (its broker socket, its lock). `ls` lists its own descriptors; the
/// only one beyond its three streams is the directory it is reading.
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
        noted.contains("-c ls -l /proc/self/fd"),
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

/// The supervisor execs bash by name, searched in the workloads' PATH: where the first `bash`
/// cannot be exec'd (it names a missing interpreter), the next one runs the command.
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

/// D25 / D51 / D46.1 for a plain template, from a real supervisor (which blocks the node's
/// handled signals): the program bash execs leads its own process group, has no signal blocked
/// and none of 1–31 ignored, and holds only its three streams.
#[test]
fn g13_a_plain_template_leads_its_group_with_no_signal_blocked_or_ignored() {
    let (_b, cp, setup) =
        rig("cyberwave:\n  training: cat /proc/self/status\n  inference: ls -l /proc/self/fd\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    let logs = setup.home.join(".cyberwave/workload_logs");
    let st = Start::training("vst");
    assert_eq!(st.reply(&cp, &node)["status"], "ok", "{}", node.log());
    assert_eq!(st.completion(&cp)["exit_code"], 0, "{}", node.log());
    let status = std::fs::read_to_string(logs.join("training_vst.stdout.log")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .unwrap_or_else(|| panic!("{status}"))
            .to_string()
    };
    assert_eq!(field("Name:"), "cat", "{status}");
    assert_eq!(field("Pid:"), field("NSpgid:"), "its own group: {status}");
    assert_eq!(field("SigBlk:"), "0000000000000000", "{status}");
    let ignored = u64::from_str_radix(&field("SigIgn:"), 16).unwrap();
    assert_eq!(ignored & 0x7fff_ffff, 0, "{status}");
    let fd = Start::new("inference", "vfd");
    assert_eq!(fd.reply(&cp, &node)["status"], "ok", "{}", node.log());
    assert_eq!(fd.completion(&cp)["exit_code"], 0, "{}", node.log());
    let listing = std::fs::read_to_string(logs.join("inference_vfd.stdout.log")).unwrap();
    let numbers: Vec<&str> = listing
        .lines()
        .filter_map(|l| l.split_once(" -> ")?.0.split_whitespace().last())
        .collect();
    assert_eq!(numbers, ["0", "1", "2", "3"], "{listing}");
}
