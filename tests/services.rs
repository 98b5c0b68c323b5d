//! The platform's own compute repositories as their authors wrote them (D59, D60): an
//! inference entry point that keeps a model server warm between requests (started in a session
//! of its own when none answers, polled on `/health`, posted to, then the workload exits), and
//! install scripts that take minutes and start servers. The workloads here are small stand-ins
//! of that shape: `preview.py` and `server.py` below.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::node::{NodeProcess, NodeSetup};
use crate::support::preview::{PREVIEW, SERVER};
use crate::support::scenario::Start;
use crate::support::timeouts::{EXIT, READY, REPLY};
use crate::support::{free_port, rig, wait_for};

/// A node whose `inference` is the preview entry point against a server on a free port that
/// loads for `load` seconds; `extra` is more of the `cloud_node:` section.
fn preview_rig(
    load: &str,
    extra: &str,
) -> (
    crate::support::Broker,
    crate::support::ControlPlane,
    NodeSetup,
) {
    let port = free_port();
    let (b, cp, mut setup) = rig(&format!(
        "cyberwave:\n  inference: python3 preview.py {{body}} {port} {load}\n  heartbeat_interval: 0.5\ncloud_node:\n  max_concurrent_workloads: 2\n{extra}"
    ));
    setup.write("preview.py", PREVIEW);
    setup.write("server.py", SERVER);
    setup.set("CYBERWAVE_NODE_CLEANUP_GRACE_SECONDS", "1");
    (b, cp, setup)
}

/// Kills a test's stray processes on drop (what a failing test left running).
struct Strays(Vec<i32>);

impl Drop for Strays {
    fn drop(&mut self) {
        for pid in &self.0 {
            // SAFETY: a process this test started (by way of its node); its group too.
            unsafe {
                libc::kill(-*pid, libc::SIGKILL);
                libc::kill(*pid, libc::SIGKILL);
            }
        }
    }
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, r)| r.trim_start().to_string()))
        .is_some_and(|r| !r.starts_with('Z') && !r.starts_with('X'))
}

fn read_pid(path: &Path) -> i32 {
    wait_for(READY, || {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
    })
    .unwrap_or_else(|| panic!("no pid in {}", path.display()))
}

fn preview(rid: &str, extra: Value) -> Start {
    Start::new("inference", rid)
        .with(json!({"mlmodel_uuid": "m-1", "tag": rid}))
        .with(extra)
}

fn status(cp: &crate::support::ControlPlane, node: &NodeProcess, rid: &str) -> Value {
    let reply = cp
        .status(&node.uuid(), rid, REPLY)
        .unwrap_or_else(|| panic!("no status reply; log:\n{}", node.log()));
    reply["output"].clone()
}

fn service_pids(status: &Value) -> Vec<i64> {
    status["services"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s["pid"].as_i64()).collect())
        .unwrap_or_default()
}

/// D59: the second preview finds the server the first one started still warm (same pid,
/// started once) and is answered by it; the server is listed in `status` as a service of the
/// first preview, counted in the heartbeat and not as a workload, and the log says once that
/// it was kept. Without D59 the first preview's end would kill the server, and every preview
/// would pay the model load again.
#[test]
fn g2_d59_a_warm_model_server_outlives_its_preview_and_serves_the_next_one() {
    let (_b, cp, setup) = preview_rig("0.5", "");
    let node = setup.spawn();
    node.wait_ready(READY);
    let first = preview("pv-1", json!({}));
    first.ok(&cp, &node);
    assert_eq!(first.completion(&cp)["success"], true, "{}", node.log());
    let server = read_pid(&setup.cwd.join("server.pid"));
    let _strays = Strays(vec![server]);
    assert!(
        alive(server),
        "the server outlives the preview that started it"
    );
    let second = preview("pv-2", json!({}));
    second.ok(&cp, &node);
    assert_eq!(second.completion(&cp)["success"], true, "{}", node.log());
    let starts = std::fs::read_to_string(setup.cwd.join("server.starts")).unwrap();
    assert_eq!(
        starts.lines().collect::<Vec<_>>(),
        vec![server.to_string()],
        "started once"
    );
    let st = status(&cp, &node, "st-1");
    assert_eq!(service_pids(&st), vec![i64::from(server)], "{st}");
    let svc = &st["services"][0];
    assert_eq!(svc["started_by"], "inference");
    assert_eq!(svc["request_id"], "pv-1");
    assert_eq!(svc["workload_uuid"], "wl-pv-1");
    assert!(
        svc["command"]
            .as_str()
            .unwrap_or_default()
            .contains("server.py"),
        "{svc}"
    );
    assert_eq!(st["is_busy"], false, "a service holds no slot");
    // A heartbeat once both previews ended: the service counted, not as a workload.
    let beat = wait_for(REPLY, || {
        cp.requests("heartbeat")
            .into_iter()
            .rev()
            .find(|h| h.body["services"] == 1 && h.body["active_workloads"] == 0)
    });
    assert!(beat.is_some(), "no heartbeat counts the service alone");
    let log = node.log();
    assert_eq!(
        log.matches(&format!("service pid {server} (")).count(),
        1,
        "said once: {log}"
    );
    assert!(log.contains("kept running as a service"), "{log}");
}

/// D59: two previews at once share one server (the first to take the lock starts it), and the
/// first preview's end does not kill the server the second is still waiting on: the clean-up
/// of the first must not kill the server under the second's request.
#[test]
fn g2_d59_two_previews_at_once_share_one_server_and_neither_kills_it() {
    let (_b, cp, setup) = preview_rig("0.5", "");
    let node = setup.spawn();
    node.wait_ready(READY);
    let quick = preview("pv-a", json!({"delay": 0}));
    let slow = preview("pv-b", json!({"delay": 3}));
    quick.send(&cp, &node);
    slow.send(&cp, &node);
    assert_eq!(quick.completion(&cp)["success"], true, "{}", node.log());
    let server = read_pid(&setup.cwd.join("server.pid"));
    let _strays = Strays(vec![server]);
    let done = slow.completion(&cp);
    assert_eq!(done["success"], true, "{done}; log:\n{}", node.log());
    assert!(alive(server));
    let starts = std::fs::read_to_string(setup.cwd.join("server.starts")).unwrap();
    assert_eq!(starts.lines().count(), 1, "{starts}");
}

/// D59: a service is kept across a node restart (the new node lists it with its pid, command
/// and workload), and `cancel` with its pid stops it: SIGTERM to its session, the reply says
/// so, the log says when it ended, and `status` no longer lists it. Without services a cancel
/// with the server's pid would find no workload.
#[test]
fn g2_d59_a_service_survives_a_node_restart_and_a_cancel_with_its_pid_stops_it() {
    let (_b, cp, setup) = preview_rig("0", "");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    let first = preview("pv-r", json!({}));
    first.ok(&cp, &node);
    assert_eq!(first.completion(&cp)["success"], true, "{}", node.log());
    let server = read_pid(&setup.cwd.join("server.pid"));
    let _strays = Strays(vec![server]);
    node.sigterm();
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)), "{}", node.log());
    assert!(
        node.log()
            .contains(&format!("left running: service pid {server} (")),
        "{}",
        node.log()
    );
    assert!(alive(server), "a node stop leaves services running");
    // (Its wrapper is kept: dropping it would kill what the test left, services included.)
    let _stopped = node;
    let node = setup.spawn();
    node.wait_ready(READY);
    assert!(
        node.log()
            .contains(&format!("tracking service pid {server} (")),
        "{}",
        node.log()
    );
    let st = status(&cp, &node, "st-r");
    assert_eq!(service_pids(&st), vec![i64::from(server)], "{st}");
    cp.command(
        &node.uuid(),
        json!({"command": "cancel", "request_id": "cx-1", "params": {"pid": server}}),
    );
    let reply = cp.wait_reply("cx-1", REPLY).expect("a reply to the cancel");
    assert_eq!(reply["status"], "ok", "{reply}");
    assert!(
        reply["output"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("Service pid"),
        "{reply}"
    );
    assert!(
        wait_for(REPLY, || (!alive(server)).then_some(())).is_some(),
        "stopped"
    );
    let ended = wait_for(REPLY, || {
        node.log()
            .lines()
            .find(|l| l.contains(&format!("service pid {server} (")) && l.ends_with(" stopped"))
            .map(String::from)
    });
    assert!(ended.is_some(), "the log says it ended: {}", node.log());
    let mut n = 0;
    let gone = wait_for(REPLY, || {
        n += 1;
        service_pids(&status(&cp, &node, &format!("st-gone-{n}")))
            .is_empty()
            .then_some(())
    });
    assert!(gone.is_some(), "no longer listed");
}

/// D59 with D58: as a container's main process the node stops its services when it stops,
/// as it stops its workloads (they would die with the container anyway), and says so.
#[test]
fn g9_d59_a_containers_node_stops_its_services_when_it_stops_and_says_so() {
    let (_b, cp, mut setup) = preview_rig("0", "");
    setup.set("CYBERWAVE_NODE_INIT", "1");
    setup.set("CYBERWAVE_NODE_STOP_GRACE_SECONDS", "3");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    let w = preview("pv-c", json!({}));
    w.ok(&cp, &node);
    assert_eq!(w.completion(&cp)["success"], true, "{}", node.log());
    let server = read_pid(&setup.cwd.join("server.pid"));
    let _strays = Strays(vec![server]);
    assert!(alive(server));
    node.sigterm();
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)), "{}", node.log());
    assert!(!alive(server), "stopped with the container's node");
    let log = node.log();
    assert!(
        log.lines()
            .any(|l| l.contains(&format!("service pid {server} ("))
                && l.contains("container is stopping")),
        "{log}"
    );
}

/// D59: `cloud_node.services: stop` restores the strict rule: the server the preview started
/// is cleared when the preview ends, and the log names it (pid and command line) and the
/// workload it came from, so that the operator learns why the server went.
#[test]
fn g9_d59_services_stop_clears_the_server_and_says_what_and_from_which_workload() {
    let (_b, cp, setup) = preview_rig("0", "  services: stop\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    let w = preview("pv-s", json!({}));
    w.ok(&cp, &node);
    assert_eq!(w.completion(&cp)["success"], true, "{}", node.log());
    let server = read_pid(&setup.cwd.join("server.pid"));
    let _strays = Strays(vec![server]);
    assert!(!alive(server), "cleared before the completion");
    let line = format!("cleared pid {server} (");
    assert!(
        node.wait_log(&line, REPLY),
        "the log names it: {}",
        node.log()
    );
    let log = node.log();
    let at = log.find(&line).unwrap();
    let whole = &log[log[..at].rfind('\n').map_or(0, |i| i + 1)..];
    let whole = whole.lines().next().unwrap_or_default();
    assert!(whole.contains("server.py"), "{whole}");
    assert!(whole.contains("pv-s"), "{whole}");
    assert!(service_pids(&status(&cp, &node, "st-s")).is_empty());
}

/// D59: a daemon made the classic way (the workload's child calls `setsid` and forks again,
/// then exits: its session has no leader left) is a service too, named by its main process;
/// a plain background job of the workload (`sleep 700 &`, no session of its own) is cleared,
/// and logged with its pid and command line.
#[test]
fn g9_d59_a_double_forked_daemon_is_a_service_and_a_plain_background_job_is_cleared_and_logged() {
    let (_b, cp, mut setup) = rig(concat!(
        "cyberwave:\n  training: |\n",
        "    setsid sh -c 'sleep 601 & echo $! > daemon.pid' < /dev/null > /dev/null 2>&1\n",
        "    sleep 702 &\n",
        "    echo $! > job.pid\n",
    ));
    setup.set("CYBERWAVE_NODE_CLEANUP_GRACE_SECONDS", "1");
    let node = setup.spawn();
    node.wait_ready(READY);
    let w = Start::training("dd-1");
    w.ok(&cp, &node);
    assert_eq!(w.completion(&cp)["exit_code"], 0, "{}", node.log());
    let daemon = read_pid(&setup.cwd.join("daemon.pid"));
    let job = read_pid(&setup.cwd.join("job.pid"));
    let _strays = Strays(vec![daemon, job]);
    assert!(alive(daemon), "the daemon is a service");
    assert!(!alive(job), "the plain job is cleared");
    let st = status(&cp, &node, "st-d");
    assert_eq!(service_pids(&st), vec![i64::from(daemon)], "{st}");
    assert_eq!(st["services"][0]["command"], "sleep 601");
    assert!(
        node.wait_log(&format!("cleared pid {job} (sleep 702)"), REPLY),
        "{}",
        node.log()
    );
}

/// An install script that takes minutes (as both of the platform's do).
const SLOW_INSTALL: &str = "#!/bin/sh\nsleep 300 &\necho $! > sleep.pid\necho installing\nwait\n";

/// D60: SIGTERM and SIGINT while the install script runs stop it at once (its group, the
/// `sleep` it waits on included) and the node exits 0 within the cleanup grace. On the node
/// before both were ignored until the install ended (minutes).
#[test]
fn g9_d60_sigterm_or_sigint_during_a_long_install_stops_it_within_the_grace() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let (_b, _cp, mut setup) =
            rig("cyberwave:\n  install_script: ./install.sh\n  training: echo x\n");
        let script = setup.write("install.sh", SLOW_INSTALL);
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        setup.set("CYBERWAVE_NODE_CLEANUP_GRACE_SECONDS", "1");
        let mut node = setup.spawn();
        assert!(
            node.wait_log("[install stdout] installing", READY),
            "{}",
            node.log()
        );
        let sleeper = read_pid(&setup.cwd.join("sleep.pid"));
        let _strays = Strays(vec![sleeper]);
        let at = Instant::now();
        node.signal(sig);
        let code = node.wait_exit(EXIT);
        let took = at.elapsed();
        assert_eq!(code, Some(Some(0)), "signal {sig}: {}", node.log());
        assert!(
            took < Duration::from_secs(5),
            "signal {sig}: {took:?}; {}",
            node.log()
        );
        assert!(
            !alive(sleeper),
            "the install's own processes are stopped too"
        );
        assert!(
            node.log().contains("stopping the install script"),
            "{}",
            node.log()
        );
    }
}

/// D60: an install script that starts a server with `cmd &` and leaves its output on the
/// install's pipe does not hang start-up: the node is ready, a WARN names the process that
/// still holds the output (pid and command line), and that process is a service started by
/// `install`. Waiting for the end of that output would hold start-up for ever.
#[test]
fn g13_d60_an_install_that_leaves_a_job_holding_its_output_does_not_hang_start_up() {
    let (_b, cp, setup) = rig(
        "cyberwave:\n  install_script: sleep 1000 & echo $! > job.pid; echo started\n  training: echo x\n",
    );
    let node = setup.spawn();
    let job = read_pid(&setup.cwd.join("job.pid"));
    let _strays = Strays(vec![job]);
    node.wait_ready(READY);
    let log = node.log();
    let warn = log
        .lines()
        .find(|l| l.contains("still holds its"))
        .unwrap_or_else(|| panic!("no WARN: {log}"));
    assert!(warn.contains("WARN"), "{warn}");
    assert!(warn.contains(&format!("pid {job} (sleep 1000)")), "{warn}");
    assert!(alive(job));
    let st = status(&cp, &node, "st-i");
    assert_eq!(service_pids(&st), vec![i64::from(job)], "{st}");
    assert_eq!(st["services"][0]["started_by"], "install");
}

/// D60: with `workload_user` the install script runs as that user with that user's HOME (where
/// it builds the venv the workloads then find); `install_user: node` keeps the node's user.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_d60_the_install_script_runs_as_the_workload_user_with_its_home() {
    crate::support::assert_root("to run the install script as nobody");
    for (extra, uid, home) in [
        ("", "65534", "/nonexistent"),
        ("  install_user: node\n", "0", ""),
    ] {
        let (_b, _cp, setup) = rig(&format!(
            "cloud_node:\n  workload_user: nobody\n{extra}cyberwave:\n  install_script: id -u > out/uid; echo \"$HOME\" > out/home\n  training: echo x\n"
        ));
        let out = setup.cwd.join("out");
        std::fs::create_dir_all(&out).unwrap();
        std::fs::set_permissions(&out, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .unwrap();
        let node = setup.spawn();
        node.wait_ready(READY);
        assert_eq!(
            std::fs::read_to_string(out.join("uid")).unwrap().trim(),
            uid,
            "{}",
            node.log()
        );
        let got = std::fs::read_to_string(out.join("home")).unwrap();
        if home.is_empty() {
            assert_eq!(got.trim(), setup.home.path().display().to_string());
        } else {
            assert_eq!(got.trim(), home);
        }
    }
}

/// D59: `services.json` is read back as outside input. An entry naming a process that is not
/// the one recorded (another start time, another boot) is never tracked, and a cancel with its
/// pid signals nothing; an entry naming init, or a file that is not JSON, is quarantined with
/// an ERROR naming it.
#[test]
fn g9_d59_a_services_record_naming_another_process_is_never_tracked_nor_signalled() {
    let (_b, cp, setup) = rig("cyberwave:\n  training: echo x\n");
    let state = setup.config_dir();
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&state, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let mut bystander = std::process::Command::new("sleep")
        .arg("300")
        .spawn()
        .unwrap();
    let pid = bystander.id() as i32;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let ticks: u64 = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .nth(19)
        .unwrap()
        .parse()
        .unwrap();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let entry = |pid: i32, ticks: u64, boot: &str| {
        json!({"process": {"pid": pid, "start_ticks": ticks, "scope": "session", "scope_id": pid,
                           "sid": pid, "leader_start": ticks, "uid": 0, "cmdline": "sleep 300"},
               "started_by": "install", "since": "2026-12-01T00:00:00Z", "since_unix": 1.0,
               "boot_id": boot.trim()})
    };
    let path = state.join("services.json");
    let cases = [
        (
            json!({"services": [entry(pid, ticks + 7, &boot)]}),
            "ended while the node was down",
        ),
        (
            json!({"services": [entry(pid, ticks, "another-boot")]}),
            "ended while the node was down",
        ),
        (json!({"services": [entry(1, 1, &boot)]}), "quarantined"),
        (json!("not a record"), "quarantined"),
    ];
    for (i, (record, said)) in cases.iter().enumerate() {
        std::fs::write(&path, serde_json::to_vec(record).unwrap()).unwrap();
        let node = setup.spawn();
        node.wait_ready(READY);
        assert!(node.log().contains(said), "case {i}: {}", node.log());
        let rid = format!("cx-{i}");
        cp.command(
            &node.uuid(),
            json!({"command": "cancel", "request_id": rid, "params": {"pid": pid}}),
        );
        let reply = cp.wait_reply(&rid, REPLY).expect("a reply");
        assert_eq!(reply["status"], "error", "case {i}: {reply}");
        assert!(service_pids(&status(&cp, &node, &format!("st-{i}"))).is_empty());
        assert!(
            bystander.try_wait().unwrap().is_none(),
            "case {i}: the bystander was signalled"
        );
    }
    let _ = bystander.kill();
    let _ = bystander.wait();
}

/// D59: `status` (the CLI, while the node runs and from the state dir once it is down) and
/// `doctor` show the services; `doctor` warns when the state dir holds what an install or a
/// workload kept under a HOME there (the packaged service's HOME), which `apt-get purge` deletes.
#[test]
fn d59_status_and_doctor_show_the_services_and_doctor_warns_of_a_home_in_the_state_dir() {
    let (_b, cp, setup) = preview_rig("0", "");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    let w = preview("pv-d", json!({}));
    w.ok(&cp, &node);
    assert_eq!(w.completion(&cp)["success"], true, "{}", node.log());
    let server = read_pid(&setup.cwd.join("server.pid"));
    let _strays = Strays(vec![server]);
    let human = setup.run(&["status"]);
    assert!(human.stdout.contains("services:   1"), "{human:?}");
    assert!(
        human.stdout.contains(&format!("pid {server} ")),
        "{human:?}"
    );
    node.sigterm();
    assert!(node.wait_exit(EXIT).is_some());
    let down = setup.run(&["status", "--json"]);
    let st: Value = serde_json::from_str(&down.stdout).unwrap();
    assert_eq!(st["running"], false);
    assert_eq!(st["services"][0]["pid"], server, "{st}");
    assert_eq!(st["services"][0]["state"], "running");
    std::fs::create_dir_all(setup.config_dir().join(".venv")).unwrap();
    let doctor = setup.run(&["doctor"]);
    let line = |what: &str| {
        doctor
            .stdout
            .lines()
            .find(|l| l.contains(what))
            .unwrap_or_else(|| panic!("no {what} line: {}", doctor.stdout))
            .to_string()
    };
    let svc = line(&format!("pid {server} ("));
    assert!(
        svc.starts_with("PASS") && svc.contains("server.py"),
        "{svc}"
    );
    let home = line(".venv");
    assert!(
        home.starts_with("WARN") && home.contains("apt-get purge"),
        "{home}"
    );
}
