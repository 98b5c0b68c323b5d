//! Workload attacks on what the node holds: its descriptors (D46.1), its environment and memory
//! (D46.2), through the workload or its supervisor. The log check of every test (support::secrets) covers D47.

use serde_json::json;

use crate::support::scenario::{completion, Start};
use crate::support::timeouts::{EXIT, READY, REPLY};
use crate::support::{procs, Rig, Scenario};

/// The uid an unprivileged same-uid attacker runs as (the node runs as it too).
const NOBODY: u32 = 65534;

/// D46.1: the node's broker socket (Paho C opens it without close-on-exec) and every other
/// descriptor of the node stay out of the workload: it holds exactly its three streams (with the
/// live broker connection it could publish as the node).
#[test]
fn g13_a_workload_holds_no_descriptor_of_the_node() {
    let (rig, node) =
        Scenario::new("cyberwave:\n  training: |\n    ls -l /proc/$$/fd > fds.txt\n").node();
    let Rig { cp, setup, .. } = &rig;
    let w = Start::training("fds");
    w.ok(cp, &node);
    w.completion(cp);
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
/// everything, so the attack is only meaningful without it.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_a_same_uid_workload_cannot_read_the_nodes_environment() {
    crate::support::assert_root(&format!("to run the node as uid {NOBODY}"));
    let mut rig = Scenario::new(concat!(
        "cyberwave:\n  training: |\n",
        "    node=$(awk '{print $4}' /proc/$PPID/stat)\n",
        "    echo \"$node\" > node.pid\n",
        "    if cat /proc/$node/environ > environ.txt 2>/dev/null; then echo read > environ.rc; else echo refused > environ.rc; fi\n",
        "    if ls /proc/$node/fd > nodefds.txt 2>/dev/null; then echo read > fd.rc; else echo refused > fd.rc; fi\n",
    )).rig();
    let Rig { cp, setup, .. } = &mut rig;
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
    let w = Start::training("env");
    w.ok(cp, &node);
    w.completion(cp);
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
/// state dir (its identity, other records, its own record).
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_a_workload_user_cannot_read_or_write_the_state_dir() {
    crate::support::assert_root(&format!("to run workloads as uid {NOBODY}"));
    let rig = Scenario::new("").rig();
    let Rig { cp, setup, .. } = &rig;
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
    completion(cp, "wl-wu");
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
    node.assert_logged("workloads run as nobody");
}

/// D46.3: a workload user that does not exist is refused at start with exit 2 naming the
/// setting, before anything runs (one the node lacks the privilege to become: the next test).
#[test]
fn g13_a_workload_user_the_node_cannot_become_is_refused_at_start_with_exit_2() {
    let rig = Scenario::new(
        "cloud_node:\n  workload_user: no-such-user-cw\ncyberwave:\n  training: echo x\n",
    )
    .rig();
    let Rig { setup, .. } = &rig;
    let mut node = setup.spawn();
    let code = node.wait_exit(EXIT).expect("exits");
    assert_eq!(code, Some(2), "{}", node.log());
    node.assert_logged("workload_user");
}

/// D46.3 for a node without the privilege (root to run it as uid 65534): a workload user it
/// cannot become is refused at start with exit 2 naming CAP_SETUID, before anything runs.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_a_workload_user_a_node_without_cap_setuid_cannot_become_is_refused_at_start_with_exit_2() {
    crate::support::assert_root(&format!("to run the node as uid {NOBODY}"));
    let mut rig =
        Scenario::new("cloud_node:\n  workload_user: root\ncyberwave:\n  training: echo x\n").rig();
    let Rig { setup, .. } = &mut rig;
    setup.uid = Some(NOBODY);
    // Only directories that uid may search: an unsearchable one on PATH (/root/.cargo/bin)
    // makes every exec of a PATH name fail with EACCES (nvidia-smi included: a "broken driver").
    setup.set("PATH", "/usr/local/bin:/usr/bin:/bin");
    chown_nobody(setup.home.path());
    let mut node = setup.spawn();
    let code = node.wait_exit(EXIT).expect("exits");
    assert_eq!(code, Some(2), "{}", node.log());
    node.assert_logged("CAP_SETUID");
}

/// Writes its supervisor's pid (`$PPID`) to `t/<rid>.sup`, appends a line to `t/<rid>.runs`
/// (one per run of the command), waits for `t/<rid>.stop`.
const WAITING: &str = "cyberwave:\n  training: |\n    echo $PPID > t/$CYBERWAVE_REQUEST_ID.sup\n    echo $$ >> t/$CYBERWAVE_REQUEST_ID.runs\n    until [ -e t/$CYBERWAVE_REQUEST_ID.stop ]; do sleep 0.05; done\n";

/// `/proc/<pid>/<what>` as text, NULs as spaces.
fn proc_text(pid: i32, what: &str) -> String {
    std::fs::read(format!("/proc/{pid}/{what}"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// Descriptor number → what it points at.
fn fds_of(pid: i32) -> Vec<(i32, String)> {
    let mut v: Vec<(i32, String)> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let n = e.file_name().to_str()?.parse().ok()?;
                    let to = std::fs::read_link(e.path()).ok()?;
                    Some((n, to.display().to_string()))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The supervisor of the waiting workload `rid`, as the workload wrote it.
fn supervisor_of(cwd: &std::path::Path, rid: &str) -> i32 {
    crate::support::wait_for(REPLY, || {
        std::fs::read_to_string(cwd.join(format!("t/{rid}.sup")))
            .ok()?
            .trim()
            .parse()
            .ok()
    })
    .unwrap_or_else(|| panic!("the workload {rid} did not write its supervisor's pid"))
}

/// Whether `needle` is anywhere in the readable memory of `pid` (as a same-uid process reads a
/// dumpable process's memory: /proc/<pid>/maps and /proc/<pid>/mem).
fn memory_contains(pid: i32, needle: &[u8]) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mut mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    for line in maps.lines() {
        let mut words = line.split_whitespace();
        let (Some(range), Some(perms)) = (words.next(), words.next()) else {
            continue;
        };
        if !perms.starts_with('r') || line.contains("[vvar]") || line.contains("[vsyscall]") {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (a, b) = (
            u64::from_str_radix(a, 16).unwrap(),
            u64::from_str_radix(b, 16).unwrap(),
        );
        let mut buf = vec![0u8; usize::try_from(b - a).unwrap()];
        if mem.seek(SeekFrom::Start(a)).is_err() || mem.read_exact(&mut buf).is_err() {
            continue;
        }
        if buf.windows(needle.len()).any(|w| w == needle) {
            return true;
        }
    }
    false
}

/// D46.1 for the supervisor (`<exe> __shim`, the node's child): it runs in the workload's
/// directory with exactly the environment its workload starts with (nothing more of the
/// node's), and holds exactly its three streams: stdin `/dev/null`, stdout the pipe of its pid
/// line and then `/dev/null`, stderr `shim.log`.
#[test]
fn g13_a_supervisor_holds_only_its_three_streams_and_its_workloads_environment() {
    let rig = Scenario::new(WAITING).rig();
    let Rig { cp, setup, .. } = &rig;
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    let node = setup.spawn();
    node.wait_ready(READY);
    let w = Start::training("fs1");
    assert_eq!(w.reply(cp, &node)["status"], "ok");
    let sup = supervisor_of(&setup.cwd, "fs1");
    assert_eq!(procs::parent(sup), node.pid(), "the node's child");
    let cmdline = proc_text(sup, "cmdline");
    assert!(cmdline.contains(" __shim "), "{cmdline}");
    let cwd = std::fs::read_link(format!("/proc/{sup}/cwd")).unwrap();
    assert!(cwd.ends_with("workloads/fs1"), "{}", cwd.display());
    // Once it has settled (it may still be writing its start record: a temporary file and its
    // directory for a moment).
    let _ = crate::support::wait_for(REPLY, || (fds_of(sup).len() == 3).then_some(()));
    let held = fds_of(sup);
    let numbers: Vec<i32> = held.iter().map(|(n, _)| *n).collect();
    assert_eq!(numbers, [0, 1, 2], "only its streams: {held:?}");
    assert_eq!(held[0].1, "/dev/null", "{held:?}");
    assert_eq!(held[1].1, "/dev/null", "its pid told: {held:?}");
    assert!(held[2].1.ends_with("workloads/fs1/shim.log"), "{held:?}");
    // Its environment is exactly the one its workload started with, nothing of the node's.
    let entries = |pid: i32| -> std::collections::BTreeSet<Vec<u8>> {
        std::fs::read(format!("/proc/{pid}/environ"))
            .unwrap_or_default()
            .split(|b| *b == 0)
            .filter(|e| !e.is_empty())
            .map(<[u8]>::to_vec)
            .collect()
    };
    // The workload writes its pid as it starts: wait for it (the start's reply can come first).
    let workload: i32 = crate::support::wait_for(REPLY, || {
        std::fs::read_to_string(setup.cwd.join("t/fs1.runs"))
            .ok()?
            .trim()
            .parse()
            .ok()
    })
    .expect("the workload wrote its pid");
    assert!(proc_text(sup, "environ").contains("CYBERWAVE_REQUEST_ID=fs1"));
    assert_eq!(
        entries(sup),
        entries(workload),
        "the workload's environment"
    );
    std::fs::write(setup.cwd.join("t/fs1.stop"), "").unwrap();
    assert_eq!(w.completion(cp)["exit_code"], 0, "{}", node.log());
}

/// D46.2 / each workload its own token: start A carries a token of its own; start B, after it,
/// none. B's workload (same uid) can read its own supervisor's memory: it holds nothing of A's
/// token (every supervisor is exec'd from a fresh image).
#[test]
fn g13_a_supervisor_does_not_hold_an_earlier_start_token() {
    let rig = Scenario::new(WAITING).rig();
    let Rig { cp, setup, .. } = &rig;
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    let node = setup.spawn();
    node.wait_ready(READY);
    let token = "LEAKED-TOKEN-OF-A-".repeat(400);
    let a = Start::training("exa").with(json!({ "cyberwave_workload_token": token }));
    assert_eq!(a.reply(cp, &node)["status"], "ok", "{}", node.log());
    let _ = supervisor_of(&setup.cwd, "exa");
    std::fs::write(setup.cwd.join("t/exa.stop"), "").unwrap();
    assert_eq!(a.completion(cp)["exit_code"], 0, "{}", node.log());
    let b = Start::training("exb");
    assert_eq!(b.reply(cp, &node)["status"], "ok", "{}", node.log());
    let sup_b = supervisor_of(&setup.cwd, "exb");
    let leaked = memory_contains(sup_b, b"LEAKED-TOKEN-OF-A-LEAKED-TOKEN-OF-A-");
    std::fs::write(setup.cwd.join("t/exb.stop"), "").unwrap();
    assert_eq!(b.completion(cp)["exit_code"], 0, "{}", node.log());
    assert!(!leaked, "a supervisor holds an earlier start's token");
}

/// The node started with its stdin and stdout closed (a careless init script, `>&-`): the
/// descriptors it opens first may take 0 and 1. Starts still run once and complete, and each
/// supervisor holds exactly its three streams.
#[test]
fn g13_a_node_started_with_stdin_and_stdout_closed_still_starts_its_workloads() {
    let mut rig = Scenario::new(WAITING).rig();
    let Rig { cp, setup, .. } = &mut rig;
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    setup.under = ["sh", "-c", "exec \"$@\" 0<&- 1>&-", "sh"]
        .map(String::from)
        .to_vec();
    let node = setup.spawn();
    node.wait_ready(READY);
    for rid in ["cl1", "cl2", "cl3"] {
        let w = Start::training(rid);
        assert_eq!(w.reply(cp, &node)["status"], "ok", "{}", node.log());
        let sup = supervisor_of(&setup.cwd, rid);
        let settled = crate::support::wait_for(REPLY, || (fds_of(sup).len() == 3).then_some(()));
        assert!(settled.is_some(), "{rid}: {:?}", fds_of(sup));
        std::fs::write(setup.cwd.join(format!("t/{rid}.stop")), "").unwrap();
        assert_eq!(w.completion(cp)["exit_code"], 0, "{}", node.log());
        let runs = std::fs::read_to_string(setup.cwd.join(format!("t/{rid}.runs"))).unwrap();
        assert_eq!(runs.lines().count(), 1, "{rid}");
    }
}
