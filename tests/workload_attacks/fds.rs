//! Workload attacks on what the node holds: its descriptors (D46.1), its environment and memory
//! (D46.2). The log check of every test (support::secrets) covers D47.

use serde_json::json;

use crate::support::rig;
use crate::support::timeouts::{DONE, EXIT, READY, REPLY};

/// The uid an unprivileged same-uid attacker runs as (the node runs as it too).
const NOBODY: u32 = 65534;

/// D46.1: the node's broker socket (Paho C opens it without close-on-exec) and every other
/// descriptor of the node stay out of the workload: it holds exactly its three streams. On
/// main at f918294 the workload held the live broker connection and could publish as the node.
#[test]
fn g13_a_workload_holds_no_descriptor_of_the_node() {
    let (_b, cp, setup) = rig("cyberwave:\n  training: |\n    ls -l /proc/$$/fd > fds.txt\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    cp.command(
        &node.uuid(),
        json!({"command": "training", "request_id": "fds", "params": {"workload_uuid": "wl-fds"}}),
    );
    let r = cp.wait_reply("fds", REPLY).expect("reply");
    assert_eq!(r["status"], "ok", "{r}");
    assert!(
        cp.wait_status("wl-fds", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    let listing = std::fs::read_to_string(setup.cwd.join("fds.txt")).unwrap();
    // `ls` runs in a child of the workload's shell and lists the shell's descriptors.
    let numbers: Vec<&str> = listing
        .lines()
        .filter_map(|l| l.split_once(" -> ")?.0.split_whitespace().last())
        .collect();
    assert_eq!(
        numbers,
        ["0", "1", "2"],
        "the workload inherited descriptors of the node:\n{listing}"
    );
    assert!(!listing.contains("socket:"), "{listing}");
}

/// D46.2: a workload of the node's own uid cannot read the node's environment (its API key) nor
/// list its descriptors through /proc. The node runs as an unprivileged uid here: root reads
/// everything, so the attack is only meaningful without it. On main the workload read the key.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_a_same_uid_workload_cannot_read_the_nodes_environment() {
    crate::support::assert_root(&format!("to run the node as uid {NOBODY}"));
    let (_b, cp, mut setup) = rig(concat!(
        "cyberwave:\n  training: |\n",
        "    node=$(awk '{print $4}' /proc/$PPID/stat)\n",
        "    echo \"$node\" > node.pid\n",
        "    if cat /proc/$node/environ > environ.txt 2>/dev/null; then echo read > environ.rc; else echo refused > environ.rc; fi\n",
        "    if ls /proc/$node/fd > nodefds.txt 2>/dev/null; then echo read > fd.rc; else echo refused > fd.rc; fi\n",
    ));
    setup.uid = Some(NOBODY);
    // Only directories that uid may search: an unsearchable one on PATH (/root/.cargo/bin)
    // makes every exec of a PATH name fail with EACCES (nvidia-smi included: a "broken driver").
    setup.set("PATH", "/usr/local/bin:/usr/bin:/bin");
    let chown = std::process::Command::new("chown")
        .args(["-R", &format!("{NOBODY}:{NOBODY}")])
        .arg(setup.home.path())
        .status()
        .unwrap();
    assert!(chown.success());
    let node = setup.spawn();
    node.wait_ready(READY);
    cp.command(
        &node.uuid(),
        json!({"command": "training", "request_id": "env", "params": {"workload_uuid": "wl-env"}}),
    );
    let r = cp.wait_reply("env", REPLY).expect("reply");
    assert_eq!(r["status"], "ok", "{r}");
    assert!(
        cp.wait_status("wl-env", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    let read = |f: &str| std::fs::read_to_string(setup.cwd.join(f)).unwrap_or_default();
    assert_eq!(read("node.pid").trim(), node.pid().to_string());
    assert_eq!(
        read("environ.rc").trim(),
        "refused",
        "{}",
        read("environ.txt")
    );
    assert!(!read("environ.txt").contains(crate::support::node::TOKEN));
    assert_eq!(read("fd.rc").trim(), "refused", "{}", read("nodefds.txt"));
}

fn chown_nobody(path: &std::path::Path) {
    let chown = std::process::Command::new("chown")
        .args(["-R", &format!("{NOBODY}:{NOBODY}")])
        .arg(path)
        .status()
        .unwrap();
    assert!(chown.success());
}

/// D46.3: with `cloud_node.workload_user` the workload runs as that uid with that user's
/// groups only, reads its own params file, and can neither list, read nor write the node's
/// state dir (its identity, other records, its own record). On main the key was unknown and
/// the workload ran as root.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_a_workload_user_cannot_read_or_write_the_state_dir() {
    crate::support::assert_root(&format!("to run workloads as uid {NOBODY}"));
    let (_b, cp, setup) = rig("");
    let state = setup.config_dir().display().to_string();
    setup.write(
        "cyberwave.yml",
        &format!(
            concat!(
                "cloud_node:\n  workload_user: nobody\n",
                "cyberwave:\n  training: |\n",
                "    id -u > out/uid; id -G > out/groups; echo \"$HOME\" > out/home\n",
                "    cat {{body}} > out/params\n",
                "    try() {{ if \"$@\" > /dev/null 2>&1; then echo \"$*: allowed\"; else echo \"$*: refused\"; fi; }}\n",
                "    try ls {s} > out/attempts\n",
                "    try cat {s}/instance_identity.json >> out/attempts\n",
                "    try touch {s}/planted >> out/attempts\n",
                "    try ls {s}/workloads >> out/attempts\n",
                "    try cat \"$(dirname {{body}})/meta.json\" >> out/attempts\n",
                "    try touch \"$(dirname {{body}})/exit.json\" >> out/attempts\n",
                "    try ls {s}/workload_logs >> out/attempts\n",
                "    \"$CYBERWAVE_NODE_BIN\" emit started --workflow wf-u --trigger-json '{{}}' > out/emit 2>&1; echo \"rc=$?\" >> out/emit\n",
                "    python3 -c 'import socket,os; s=socket.socket(socket.AF_UNIX); s.connect(os.environ[\"CYBERWAVE_NODE_SOCKET\"]); s.sendall(b\"{{\\\"op\\\": \\\"drain\\\"}}\\n\"); print(s.makefile().readline())' > out/drain 2>&1\n",
                "    echo visible-output\n",
            ),
            s = state
        ),
    );
    let out = setup.cwd.join("out");
    std::fs::create_dir_all(&out).unwrap();
    chown_nobody(&out);
    let node = setup.spawn();
    node.wait_ready(READY);
    cp.command(
        &node.uuid(),
        json!({"command": "training", "request_id": "wu", "params": {"workload_uuid": "wl-wu", "x": 1}}),
    );
    let r = cp.wait_reply("wu", REPLY).expect("reply");
    assert_eq!(r["status"], "ok", "{r}");
    assert!(
        cp.wait_status("wl-wu", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    let read = |f: &str| std::fs::read_to_string(out.join(f)).unwrap_or_default();
    assert_eq!(read("uid").trim(), NOBODY.to_string(), "{}", node.log());
    assert_eq!(read("groups").trim(), NOBODY.to_string());
    assert!(read("params").contains("\"x\":1"), "{}", read("params"));
    let attempts = read("attempts");
    assert_eq!(attempts.lines().count(), 7, "{attempts}");
    assert!(!attempts.contains("allowed"), "{attempts}");
    assert!(!setup.config_dir().join("planted").exists());
    assert!(
        node.wait_stdout("visible-output", REPLY),
        "{}",
        node.stdout()
    );
    // Its workflow events still reach the node; nothing else of the control socket does.
    assert!(read("emit").contains("rc=0"), "{}", read("emit"));
    assert!(read("drain").contains("only `emit`"), "{}", read("drain"));
    assert!(
        node.log().contains("workloads run as nobody"),
        "{}",
        node.log()
    );
}

/// D46.3: a workload user that does not exist is refused at start with exit 2 naming the
/// setting, before anything runs (one the node lacks the privilege to become: the next test).
#[test]
fn g13_a_workload_user_the_node_cannot_become_is_refused_at_start_with_exit_2() {
    let (_b, _cp, setup) =
        rig("cloud_node:\n  workload_user: no-such-user-cw\ncyberwave:\n  training: echo x\n");
    let mut node = setup.spawn();
    let code = node.wait_exit(EXIT).expect("exits");
    assert_eq!(code, Some(2), "{}", node.log());
    assert!(node.log().contains("workload_user"), "{}", node.log());
}

/// D46.3 for a node without the privilege (root to run it as uid 65534): a workload user it
/// cannot become is refused at start with exit 2 naming CAP_SETUID, before anything runs.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_a_workload_user_a_node_without_cap_setuid_cannot_become_is_refused_at_start_with_exit_2() {
    crate::support::assert_root(&format!("to run the node as uid {NOBODY}"));
    let (_b, _cp, mut setup) =
        rig("cloud_node:\n  workload_user: root\ncyberwave:\n  training: echo x\n");
    setup.uid = Some(NOBODY);
    // Only directories that uid may search: an unsearchable one on PATH (/root/.cargo/bin)
    // makes every exec of a PATH name fail with EACCES (nvidia-smi included: a "broken driver").
    setup.set("PATH", "/usr/local/bin:/usr/bin:/bin");
    chown_nobody(setup.home.path());
    let mut node = setup.spawn();
    let code = node.wait_exit(EXIT).expect("exits");
    assert_eq!(code, Some(2), "{}", node.log());
    assert!(node.log().contains("CAP_SETUID"), "{}", node.log());
}
