//! The node as its container's main process (D58, D70): PID 1 of a new PID namespace, the child of
//! an init or wrapper that is, or told so with `CYBERWAVE_NODE_INIT=1`. Its workloads die with the
//! container, so on SIGTERM it stops them itself (a second SIGTERM: SIGKILL at once) and gets
//! every completion out before it exits; as PID 1 it reaps the orphans it inherits. Also the
//! image: its user, and a state dir that user cannot write.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::node::NodeSetup;
use crate::support::timeouts::{EXIT, READY, REPLY};
use crate::support::{procs, wait_for, ControlPlane, NodeProcess, Rig, Scenario, Start};

/// One workload that ends on SIGTERM and one that ignores it (it needs the SIGKILL).
pub(crate) const MANIFEST: &str = "cloud_node:\n  max_concurrent_workloads: 2\ncyberwave:\n  inference: exec sleep 60\n  training: |\n    trap '' TERM\n    while :; do sleep 0.1; done\n";

/// The node's pid outside its namespace: the child of `unshare`.
fn pid_under_unshare(node: &NodeProcess) -> i32 {
    procs::children(node.pid())
        .first()
        .copied()
        .expect("the node under unshare")
}

fn last_status(cp: &ControlPlane, wl: &str) -> Value {
    cp.statuses(wl).last().cloned().unwrap_or(Value::Null)
}

/// Asserts each workload's end reached the backend as a cancel for the container's stop, and
/// that none of their processes is left.
fn assert_stopped_and_reported(cp: &ControlPlane, node: &NodeProcess, pids: &[i64]) {
    for (wl, want) in [("wl-inf", "cancelled"), ("wl-train", "failed")] {
        let st = last_status(cp, wl);
        assert_eq!(st["status"], want, "{wl}: {st}\n{}", node.log());
        assert_eq!(st["reason"], "the node's container is stopping", "{st}");
    }
    assert!(
        last_status(cp, "wl-train")["message"]
            .as_str()
            .unwrap_or_default()
            .contains("SIGKILL"),
        "the one that ignored SIGTERM was killed: {}",
        last_status(cp, "wl-train")
    );
    for pid in pids {
        assert!(
            wait_for(Duration::from_secs(2), || (!procs::alive(*pid))
                .then_some(()))
            .is_some(),
            "workload pid {pid} outlived the node"
        );
    }
}

#[test]
fn d58_a_container_init_stops_and_reports_every_workload_before_its_grace_ends() {
    let mut rig = Scenario::new(MANIFEST).rig();
    let Rig { cp, setup, .. } = &mut rig;
    setup.set("CYBERWAVE_NODE_INIT", "1");
    setup.set("CYBERWAVE_NODE_STOP_GRACE_SECONDS", "3");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    node.assert_logged("container's main process");
    let pids = [
        Start::new("inference", "inf").pid(cp, &node),
        Start::new("training", "train").pid(cp, &node),
    ];
    // The training workload's trap is set once it loops.
    std::thread::sleep(Duration::from_millis(300));
    let asked = Instant::now();
    node.sigterm();
    let code = node
        .wait_exit(Duration::from_secs(6))
        .expect("the node exits");
    let took = asked.elapsed();
    assert_eq!(code, Some(0), "{}", node.log());
    assert!(
        took < Duration::from_secs(3),
        "exited {took:?} after SIGTERM: past the 3 s grace"
    );
    assert_stopped_and_reported(cp, &node, &pids);
    assert!(node
        .log()
        .contains("every workload of the container is reported"));
}

/// PID 1 of a real PID namespace (as under `docker run`): no flag needed; the orphans it
/// inherits (here from the install script) are reaped; SIGTERM from outside the namespace (as
/// `docker stop` sends it) stops and reports its workloads.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn d58_as_pid_1_of_its_namespace_the_node_reaps_orphans_and_stops_its_workloads() {
    crate::support::assert_root("to make a PID namespace");
    let mut rig = Scenario::new("").rig();
    let Rig { cp, setup, .. } = &mut rig;
    setup.write(
        "cyberwave.yml",
        &format!("{MANIFEST}  install: for i in 1 2 3 4 5; do (sleep 0.2; exit 0) & done\n"),
    );
    setup.set("CYBERWAVE_NODE_STOP_GRACE_SECONDS", "3");
    setup.under = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
        .map(String::from)
        .to_vec();
    let mut node = setup.spawn();
    node.wait_ready(READY);
    node.assert_logged("container's main process");
    let inner = pid_under_unshare(&node);
    // Pids inside the namespace: nothing of it outlives its PID 1 anyway; what matters is that
    // the backend heard of every workload.
    Start::new("inference", "inf").pid(cp, &node);
    Start::new("training", "train").pid(cp, &node);
    // The install script's five orphans ended 0.2 s after start; none is left a zombie.
    let zombies = || {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
            .filter(|stat| {
                let Some((_, rest)) = stat.rsplit_once(')') else {
                    return false;
                };
                let f: Vec<&str> = rest.split_whitespace().collect();
                f.first() == Some(&"Z") && f.get(1) == Some(&inner.to_string().as_str())
            })
            .count()
    };
    assert!(
        wait_for(Duration::from_secs(3), || (zombies() == 0).then_some(())).is_some(),
        "{} zombie(s) of the node",
        zombies()
    );
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: the test's own node process.
    unsafe {
        libc::kill(inner, libc::SIGTERM);
    }
    let code = node
        .wait_exit(Duration::from_secs(6))
        .expect("the node exits");
    assert_eq!(code, Some(0), "{}", node.log());
    assert_stopped_and_reported(cp, &node, &[]);
}

/// A minimal init of the container's own, the shape of `docker run --init` and of an entrypoint
/// script that runs the node without `exec`: PID 1 of the namespace, it runs its command as a
/// child, passes SIGTERM and SIGINT on to it and exits with its code.
const MINI_INIT: &str = "#!/bin/sh\n\"$@\" &\nchild=$!\ntrap 'kill -TERM $child 2>/dev/null' TERM\ntrap 'kill -INT $child 2>/dev/null' INT\nwhile :; do\n  wait $child\n  code=$?\n  kill -0 $child 2>/dev/null || exit $code\ndone\n";

/// The node in a new PID namespace (as in a container), behind `front` (its argv before the
/// node's) when there is one, else as PID 1 itself.
pub(crate) fn in_a_pid_namespace(setup: &mut NodeSetup, front: &[String]) {
    crate::support::assert_root("to make a PID namespace");
    setup.under = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
        .map(String::from)
        .to_vec();
    setup.under.extend_from_slice(front);
}

/// The minimal init, written beside the node's home: its argv.
fn mini_init(setup: &NodeSetup) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let init = setup.home.write("mini-init", MINI_INIT);
    std::fs::set_permissions(&init, std::fs::Permissions::from_mode(0o755)).unwrap();
    vec![init.display().to_string()]
}

/// SIGTERM to PID 1 of the node's namespace from outside it (as `docker stop` and `podman kill
/// -s TERM` send it), `times` times: the second once the node has begun its stop.
fn stop_the_container(node: &NodeProcess, times: usize) {
    let pid1 = pid_under_unshare(node);
    for n in 0..times {
        if n > 0 {
            node.assert_logged("shutting down");
        }
        // SAFETY: the test's own process.
        unsafe {
            libc::kill(pid1, libc::SIGTERM);
        }
    }
}

/// The container's stop with its workloads running (one that ends on SIGTERM, one that ignores
/// it) and a grace of `grace` seconds: the node exits 0 within `within` once the backend heard
/// of both.
pub(crate) fn assert_a_stop_reports_both(
    cp: &ControlPlane,
    node: &mut NodeProcess,
    times: usize,
    within: Duration,
) {
    Start::new("inference", "inf").pid(cp, node);
    Start::new("training", "train").pid(cp, node);
    // The training workload's trap is set once it loops.
    std::thread::sleep(Duration::from_millis(300));
    stop_the_container(node, times);
    let code = node.wait_exit(within).expect("the node exits");
    assert_eq!(code, Some(0), "{}", node.log());
    assert_stopped_and_reported(cp, node, &[]);
}

/// D70: `docker run --init`, a tini or a shell entrypoint in front of the node: the kernel ends
/// the node's workloads with that PID 1, which exits when the node does; so the node stops and
/// reports them on SIGTERM as it does as PID 1 itself.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn d70_behind_an_init_the_node_stops_and_reports_every_workload_on_sigterm() {
    let mut rig = Scenario::new(MANIFEST).rig();
    let Rig { cp, setup, .. } = &mut rig;
    setup.set("CYBERWAVE_NODE_STOP_GRACE_SECONDS", "3");
    let init = mini_init(setup);
    in_a_pid_namespace(setup, &init);
    let mut node = setup.spawn();
    node.wait_ready(READY);
    assert_a_stop_reports_both(cp, &mut node, 1, Duration::from_secs(6));
    assert!(
        node.log()
            .contains("is PID 1 of its PID namespace, a shell entrypoint in front of it"),
        "the start-up log says why: {}",
        node.log()
    );
}

/// D70: two quick SIGTERMs (`podman kill -s TERM` twice, an impatient operator): the second
/// sends SIGKILL at once to what is left, and the node still reports every workload before it
/// exits. The grace is long: only the second SIGTERM can end the stop this soon.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn d70_behind_an_init_a_second_sigterm_kills_at_once_and_every_workload_is_still_reported() {
    let mut rig = Scenario::new(MANIFEST).rig();
    let Rig { cp, setup, .. } = &mut rig;
    setup.set("CYBERWAVE_NODE_STOP_GRACE_SECONDS", "60");
    let init = mini_init(setup);
    in_a_pid_namespace(setup, &init);
    let mut node = setup.spawn();
    node.wait_ready(READY);
    assert_a_stop_reports_both(cp, &mut node, 2, Duration::from_secs(20));
    node.assert_logged("SIGKILL now");
}

/// D70: the same as PID 1 itself: a second SIGTERM kills at once, and still every workload is
/// reported (it does not just exit, leaving them unreported).
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn d70_as_pid_1_a_second_sigterm_kills_at_once_and_every_workload_is_still_reported() {
    let mut rig = Scenario::new(MANIFEST).rig();
    let Rig { cp, setup, .. } = &mut rig;
    setup.set("CYBERWAVE_NODE_STOP_GRACE_SECONDS", "60");
    in_a_pid_namespace(setup, &[]);
    let mut node = setup.spawn();
    node.wait_ready(READY);
    assert_a_stop_reports_both(cp, &mut node, 2, Duration::from_secs(20));
}

/// D70: a completion the backend never acknowledges before the grace ends: the node exits 1 and
/// says which workloads it could not report. (Told by CYBERWAVE_NODE_INIT=1; the workload ends on
/// SIGTERM, so nothing of it outlives the test.)
#[test]
fn d70_a_stop_that_cannot_report_its_workloads_exits_1() {
    let mut rig = Scenario::new(MANIFEST).rig();
    let Rig { cp, setup, .. } = &mut rig;
    setup.set("CYBERWAVE_NODE_INIT", "1");
    setup.set("CYBERWAVE_NODE_STOP_GRACE_SECONDS", "2");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    Start::new("inference", "inf").pid(cp, &node);
    cp.set_behaviour(|b| b.mute = true);
    node.sigterm();
    let code = node
        .wait_exit(Duration::from_secs(6))
        .expect("the node exits");
    assert_eq!(code, Some(1), "{}", node.log());
    node.assert_logged("not every workload was reported");
}

/// The shipped image (packaging/build-image.sh), unpacked by packaging/check.sh into the root
/// filesystem named by `CYBERWAVE_TEST_IMAGE_ROOTFS` (with a static busybox added as the
/// workloads' shell: the image itself has none). The node runs from it as the image's user
/// (nobody) and PID 1 of a new PID and mount namespace chrooted there, takes a workload, and on
/// SIGTERM stops and reports it; no zombie is left.
#[test]
#[ignore = "needs an unpacked image: packaging/check.sh runs it with CYBERWAVE_TEST_IMAGE_ROOTFS"]
fn d58_the_image_runs_the_node_as_pid_1_and_reports_its_workload_on_stop() {
    let rootfs = std::path::PathBuf::from(
        std::env::var("CYBERWAVE_TEST_IMAGE_ROOTFS")
            .expect("CYBERWAVE_TEST_IMAGE_ROOTFS: the unpacked image's root filesystem"),
    );
    assert!(rootfs.join("usr/bin/cyberwave-cloud-node").is_file());
    let mut rig = Scenario::new("").rig();
    let Rig { cp, setup, .. } = &mut rig;
    std::fs::write(
        rootfs.join("work/cyberwave.yml"),
        "cyberwave:\n  training: |\n    echo from-the-image\n    exec sleep 60\n",
    )
    .unwrap();
    setup.set("CYBERWAVE_NODE_STOP_GRACE_SECONDS", "3");
    setup.set("CYBERWAVE_EDGE_CONFIG_DIR", "/var/lib/cyberwave-cloud-node");
    setup.set("HOME", "/root");
    setup.set("PATH", "/usr/bin:/bin");
    setup.under = vec![
        "unshare".into(),
        "--pid".into(),
        "--fork".into(),
        "--mount".into(),
        format!("--root={}", rootfs.display()),
        "--wd=/work".into(),
        "--mount-proc".into(),
        "--kill-child".into(),
        // The image's user (its config's `user`), who owns the state dir.
        "--setuid=65534".into(),
        "--setgid=65534".into(),
    ];
    setup.bin = Some("/usr/bin/cyberwave-cloud-node".into());
    let mut node = setup.spawn();
    node.wait_ready(READY);
    node.assert_logged("container's main process");
    let uuid =
        std::fs::read_to_string(rootfs.join("var/lib/cyberwave-cloud-node/instance_identity.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| v["uuid"].as_str().map(String::from))
            .expect("the node's identity in the image's state dir");
    cp.command(
        &uuid,
        json!({"command": "training", "request_id": "img", "params": {"workload_uuid": "wl-img"}}),
    );
    let r = cp.wait_reply("img", REPLY).expect("reply");
    assert_eq!(r["status"], "ok", "{r}");
    assert!(
        node.wait_stdout("from-the-image", REPLY),
        "{}",
        node.stdout()
    );
    let inner = pid_under_unshare(&node);
    // SAFETY: the test's own node process.
    unsafe {
        libc::kill(inner, libc::SIGTERM);
    }
    let code = node
        .wait_exit(Duration::from_secs(6))
        .expect("the node exits");
    assert_eq!(code, Some(0), "{}", node.log());
    let st = last_status(cp, "wl-img");
    assert_eq!(st["status"], "failed", "{st}");
    assert_eq!(st["reason"], "the node's container is stopping", "{st}");
}

/// A container run with `--user` on a state volume root owns: the node exits 2 naming the state
/// dir and its user, not a `.env` it does not have (it said "cannot read …/.env: Permission
/// denied"); a state dir its user owns but cannot write is named as that, not as a lock file.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn a_state_dir_the_nodes_user_cannot_write_is_named_as_that() {
    use std::os::unix::fs::PermissionsExt;
    crate::support::assert_root("to start the node as another uid");
    let mut s = NodeSetup::bare();
    s.set("CYBERWAVE_API_KEY", "cw_state_dir_test_token_aaaa");
    s.arg("--standalone");
    let state = s.home.join("state");
    std::fs::create_dir(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    s.set("CYBERWAVE_EDGE_CONFIG_DIR", &state.display().to_string());
    s.uid = Some(65534);
    let run = |s: &NodeSetup| {
        let mut node = s.spawn();
        let code = node.wait_exit(EXIT).expect("exits");
        (code, node.log())
    };
    let (code, log) = run(&s);
    assert_eq!(code, Some(2), "{log}");
    let named = format!(
        "the state dir {} cannot be read or written by this user (uid 65534) (owned by uid 0",
        state.display()
    );
    assert!(log.contains(&named), "{log}");
    assert!(!log.contains(".env"), "{log}");
    // Its own, but read-only to it.
    std::os::unix::fs::chown(&state, Some(65534), Some(65534)).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o500)).unwrap();
    let (code, log) = run(&s);
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains(&format!(
            "the state dir {} is not writable by this node's user",
            state.display()
        )),
        "{log}"
    );
}

/// The examples' Dockerfiles name their base images in full (`docker.io/…`): podman refuses a
/// short name unless a search registry is configured.
#[test]
fn the_example_dockerfiles_name_their_base_images_in_full() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for d in [
        "examples/docker/Dockerfile",
        "examples/compose/node/Dockerfile",
        "examples/compose/sim/Dockerfile",
    ] {
        let text = std::fs::read_to_string(root.join(d)).unwrap();
        let bases: Vec<&str> = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("FROM "))
            .filter_map(|rest| rest.split_whitespace().next())
            .collect();
        assert!(!bases.is_empty(), "{d}: no FROM");
        for base in bases {
            let registry = base.split_once('/').map(|(r, _)| r).unwrap_or_default();
            assert!(
                registry.contains('.') || registry.contains(':') || registry == "localhost",
                "{d}: FROM {base} is a short name"
            );
        }
    }
}

/// The container examples' manifests are valid for the node (and the platform's validator).
#[test]
fn the_container_examples_manifests_validate() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for m in [
        "examples/docker/cyberwave.yml",
        "examples/compose/node/cyberwave.yml",
    ] {
        let setup = crate::support::node::NodeSetup::bare();
        let path = root.join(m);
        let out = setup.run(&["validate", &path.display().to_string()]);
        assert_eq!(out.code, Some(0), "{m}: {out:?}");
    }
}

/// D58, D71: as PID 1 of its namespace the node still starts each supervisor with `Command` and
/// waits for it by its pid, while it reaps the orphans nobody waits for: a supervisor is PID 1's
/// child, runs its workload once, and the completion goes out with the workload's exit code (a
/// sweep that took the supervisor's status first would lose it).
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g8_d58_as_pid_1_its_supervisors_are_its_children_and_each_workload_runs_once() {
    crate::support::assert_root("to make a PID namespace");
    let mut rig = Scenario::new(concat!(
        "cyberwave:\n  training: |\n",
        "    echo $PPID > t/$CYBERWAVE_REQUEST_ID.sup\n",
        "    echo $$ >> t/$CYBERWAVE_REQUEST_ID.runs\n",
        "    until [ -e t/$CYBERWAVE_REQUEST_ID.stop ]; do sleep 0.05; done\n",
        "    exit 4\n",
    ))
    .rig();
    let Rig { cp, setup, .. } = &mut rig;
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    setup.under = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
        .map(String::from)
        .to_vec();
    let node = setup.spawn();
    node.wait_ready(READY);
    let inner = pid_under_unshare(&node);
    for rid in ["pid1", "pid2"] {
        let w = Start::training(rid);
        assert_eq!(w.reply(cp, &node)["status"], "ok", "{}", node.log());
        let sup = wait_for(REPLY, || {
            // Any thread of the node may have started it: every process whose parent it is.
            procs::all().into_iter().find(|&pid| {
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                procs::parent(pid) == inner
                    && String::from_utf8_lossy(&cmd).contains("__shim")
                    && std::fs::read_link(format!("/proc/{pid}/cwd"))
                        .is_ok_and(|c| c.ends_with(rid))
            })
        });
        assert!(
            sup.is_some(),
            "no supervisor of PID 1; log:\n{}",
            node.log()
        );
        std::fs::write(setup.cwd.join(format!("t/{rid}.stop")), "").unwrap();
        assert_eq!(w.completion(cp)["exit_code"], 4, "{}", node.log());
        let runs = std::fs::read_to_string(setup.cwd.join(format!("t/{rid}.runs"))).unwrap();
        assert_eq!(runs.lines().count(), 1, "{rid}");
    }
}
