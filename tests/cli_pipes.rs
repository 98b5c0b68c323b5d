//! CLI commands whose reader went away (`status | head -2`): a quiet exit 0, as ripgrep does,
//! never a panic with a backtrace.

use std::os::fd::{FromRawFd, OwnedFd};
use std::process::Stdio;

use crate::support::node::{NodeSetup, TOKEN};

/// A pipe whose read end is already closed: every write to the returned end fails with EPIPE,
/// whatever the size of the output and however fast the command is.
fn closed_pipe() -> OwnedFd {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two new descriptors into the array; each is owned exactly once below.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors were just created and are owned by nobody else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    write
}

fn run_into_closed_pipe(setup: &NodeSetup, args: &[&str]) -> (Option<i32>, String) {
    let out = setup
        .command(args)
        .stdout(Stdio::from(closed_pipe()))
        .stderr(Stdio::piped())
        .output()
        .expect("run node");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn g8_cli_commands_end_quietly_with_exit_0_when_stdout_is_a_closed_pipe() {
    let mut s = NodeSetup::bare();
    s.set("CYBERWAVE_API_KEY", TOKEN);
    s.set("CYBERWAVE_MQTT_HOST", "127.0.0.1");
    // A finished workload's log, large enough to need many writes.
    let log: String = (0..20_000).map(|i| format!("line {i}\n")).collect();
    s.home
        .write(".cyberwave/workload_logs/training_pp.stdout.log", &log);
    // Each command really does print (so the pipe is really written to).
    for args in [&["logs", "pp"][..], &["status"], &["config"]] {
        let out = s.run(args);
        assert_eq!(out.code, Some(0), "{args:?}: {out:?}");
        assert!(!out.stdout.is_empty(), "{args:?}: {out:?}");
    }
    for args in [
        &["status"][..],
        &["status", "--json"],
        &["config"],
        &["config", "--json"],
        &["--help"],
        &["--version"],
        &["status", "--help"],
        &["logs", "pp"],
        &["logs", "pp", "-n", "3"],
        &["logs", "pp", "-f"],
    ] {
        let (code, stderr) = run_into_closed_pipe(&s, args);
        assert_eq!(code, Some(0), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("panicked") && !stderr.contains("backtrace"),
            "{args:?}: {stderr}"
        );
        assert!(
            !stderr.contains("error"),
            "{args:?}: a closed pipe is not an error: {stderr}"
        );
    }
}
