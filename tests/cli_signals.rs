//! D51: the CLI commands end at once on SIGINT / SIGTERM (only `start` blocks them for its
//! signal thread), even when they inherited a blocked mask or an ignored disposition (a command
//! run from inside a workload of an older node, or from a script's background job).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::node::NodeSetup;

/// Runs the CLI with SIGINT and SIGTERM blocked and SIGINT ignored, as its parent left them.
fn spawn_hostile_parent(setup: &NodeSetup, args: &[&str]) -> Child {
    let mut cmd = setup.command(args);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    // SAFETY: sigprocmask and signal are async-signal-safe; nothing is allocated.
    unsafe {
        cmd.pre_exec(|| {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            libc::signal(libc::SIGINT, libc::SIG_IGN);
            Ok(())
        });
    }
    cmd.spawn().expect("spawn the CLI")
}

/// Sends `sig` once the command has been running a while; how it ended and how long that took.
fn interrupt(mut child: Child, sig: i32, what: &str) -> (std::process::ExitStatus, Duration) {
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        child.try_wait().unwrap().is_none(),
        "{what} ended before it was interrupted: the test proves nothing"
    );
    // SAFETY: kill on our own child's pid.
    unsafe {
        libc::kill(child.id() as i32, sig);
    }
    let sent = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return (st, sent.elapsed());
        }
        if sent.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} ignored signal {sig} for 5 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn assert_ended_by(st: std::process::ExitStatus, took: Duration, sig: i32, what: &str) {
    // Ended by the signal (the shell shows 128 + N: 130 / 143), within a second.
    let code = st.code().or(st.signal().map(|s| 128 + s));
    assert_eq!(code, Some(128 + sig), "{what}: {st:?}");
    assert!(took < Duration::from_secs(1), "{what} took {took:?}");
}

/// A control socket that answers `drain` and reports a workload running for ever, and never
/// answers anything when `silent`.
fn fake_node(setup: &NodeSetup, silent: bool) {
    let dir = setup.config_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let listener = UnixListener::bind(dir.join("control.sock")).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().flatten() {
            if silent {
                held.push(conn);
                continue;
            }
            let mut line = String::new();
            let mut r = BufReader::new(&conn);
            let _ = r.read_line(&mut line);
            let answer = if line.contains("\"drain\"") {
                json!({"ok": true, "active_workloads": 1})
            } else {
                json!({"ok": true, "status": {"workloads": [{"request_id": "busy"}]}})
            };
            let _ = writeln!(&conn, "{answer}");
        }
    });
}

#[test]
fn logs_follow_ends_at_once_on_sigterm_and_sigint_whatever_mask_it_inherited() {
    let s = NodeSetup::bare();
    let state = s.config_dir();
    let logs = state.join("workload_logs");
    std::fs::create_dir_all(&logs).unwrap();
    std::fs::write(logs.join("inference_sg.stdout.log"), "a line\n").unwrap();
    // A tracked (running) workload: `logs -f` follows it until its record goes.
    s.home.write(
        ".cyberwave/workloads/sg/meta.json",
        &json!({
            "safe_id": "sg", "kind": "inference", "request_id": "r-sg",
            "created_unix": 1.0, "command": "sleep 1000",
            "stdout_log": logs.join("inference_sg.stdout.log"),
            "stderr_log": logs.join("inference_sg.stderr.log"),
            "phase": "starting", "event_token": "ab12"
        })
        .to_string(),
    );
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let child = spawn_hostile_parent(&s, &["logs", "r-sg", "-f"]);
        let (st, took) = interrupt(child, sig, "logs -f");
        assert_ended_by(st, took, sig, "logs -f");
    }
}

#[test]
fn drain_wait_status_and_doctor_end_at_once_on_sigterm() {
    let s = NodeSetup::bare();
    fake_node(&s, false);
    let child = spawn_hostile_parent(&s, &["drain", "--wait"]);
    let (st, took) = interrupt(child, libc::SIGTERM, "drain --wait");
    assert_ended_by(st, took, libc::SIGTERM, "drain --wait");

    let s = NodeSetup::bare();
    fake_node(&s, true);
    let child = spawn_hostile_parent(&s, &["status"]);
    let (st, took) = interrupt(child, libc::SIGINT, "status");
    assert_ended_by(st, took, libc::SIGINT, "status");

    // `doctor` waiting on a backend that accepted the connection and never answers.
    let backend = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut s = NodeSetup::bare();
    s.set("CYBERWAVE_API_KEY", "cw_signal_test_token_aaaa")
        .set(
            "CYBERWAVE_BASE_URL",
            &format!("http://{}", backend.local_addr().unwrap()),
        )
        .set("CYBERWAVE_NODE_TOKEN_CHECK_TIMEOUT_SECONDS", "30")
        .set("CYBERWAVE_MQTT_HOST", "127.0.0.1")
        .set("CYBERWAVE_MQTT_PORT", "1");
    let child = spawn_hostile_parent(&s, &["doctor"]);
    let (st, took) = interrupt(child, libc::SIGTERM, "doctor");
    assert_ended_by(st, took, libc::SIGTERM, "doctor");
    drop(backend);
}
