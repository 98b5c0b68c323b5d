//! Log hygiene (D31) and bounds (D32) end to end: outside text cannot forge or corrupt the node's
//! own log, the control socket cannot be used to exhaust threads, and a workload's endless line
//! cannot exhaust memory.

use std::time::Duration;

use serde_json::json;

use crate::support::rig;

const READY: Duration = Duration::from_secs(15);
const REPLY: Duration = Duration::from_secs(5);
const DONE: Duration = Duration::from_secs(60);

/// A request id that tries every trick: a newline followed by a fake log line, an ANSI colour,
/// an OSC window-title sequence, a NUL, a bidi override and a carriage return.
const FORGED_RID: &str =
    "x\n2026-11-30T00:00:00Z ERROR FORGED\u{1b}[31mred\u{1b}]0;pwned\u{7}\0nul\u{202e}rev\rcr";

fn assert_clean(log: &str) {
    for line in log.lines() {
        assert!(
            !line.starts_with("2026-11-30T00:00:00Z"),
            "a forged log line: {line:?}"
        );
    }
    assert!(!log.contains('\u{1b}'), "a raw ESC in the node's log");
    assert!(!log.contains('\0'), "a raw NUL in the node's log");
    assert!(!log.contains('\r'), "a raw CR in the node's log");
    assert!(
        !log.contains('\u{202e}'),
        "a raw bidi override in the node's log"
    );
}

#[test]
fn outside_text_cannot_forge_or_corrupt_a_node_log_line() {
    let (_b, cp, setup) = rig("cyberwave:\n  training: echo done\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    let uuid = node.uuid();
    // A command the node answers, an unknown command name, and a workload that runs to its
    // completion: each logs the request id (or name) on its way.
    cp.command(
        &uuid,
        json!({"command": "status", "request_id": FORGED_RID}),
    );
    assert!(
        cp.wait_reply(FORGED_RID, REPLY).is_some(),
        "status answered"
    );
    let bad_cmd = "nope\n2026-11-30T00:00:00Z ERROR FORGED\u{1b}[2J";
    cp.command(&uuid, json!({"command": bad_cmd, "request_id": "bad-cmd"}));
    assert!(
        cp.wait_reply("bad-cmd", REPLY).is_some(),
        "unknown command answered"
    );
    let long_rid = format!("long-{}", "a".repeat(1000));
    for (rid, wl) in [(FORGED_RID, "wl-forged"), (long_rid.as_str(), "wl-long")] {
        cp.command(
            &uuid,
            json!({"command": "training", "request_id": rid, "params": {"workload_uuid": wl}}),
        );
        assert!(
            cp.wait_status(wl, "completed", DONE).is_some(),
            "{}",
            node.log()
        );
    }
    // The completion's log line is written after the workload's own output was mirrored.
    assert!(node.wait_log(") finished: success", DONE), "{}", node.log());
    assert!(
        node.wait_log("long-aaa", DONE) && node.wait_log("ERROR FORGED", DONE),
        "the test's ids reached the log at all"
    );
    let log = node.log();
    assert_clean(&log);
    assert!(
        log.contains("x\\n2026-11-30T00:00:00Z ERROR FORGED\\u{1b}[31mred"),
        "the id is shown escaped: {log}"
    );
    let finished: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("long-aaa") && l.contains("finished"))
        .collect();
    assert!(!finished.is_empty(), "{log}");
    for l in finished {
        assert!(
            l.contains(&format!("long-{}…", "a".repeat(195))),
            "cut after 200 characters: {l}"
        );
        assert!(
            !l.contains(&"a".repeat(196)),
            "cut after 200 characters: {l}"
        );
    }
    // The node still answers.
    assert!(cp.status(&uuid, "after", REPLY).is_some());
}

fn proc_status(pid: i32, key: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn idle_control_connections_cannot_exhaust_threads_or_lock_out_status() {
    let (_b, _cp, setup) = rig("cyberwave:\n  training: echo done\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    let sock = setup.config_dir().join("control.sock");
    let before = proc_status(node.pid(), "Threads:");
    assert!(before > 0);
    let idle: Vec<std::os::unix::net::UnixStream> = (0..200)
        .map(|_| std::os::unix::net::UnixStream::connect(&sock).expect("connect"))
        .collect();
    // `status` is accepted after the 200 (in order), so it also proves they were all handled.
    let out = setup.run(&["status", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("status JSON");
    assert_eq!(v["running"], true, "the running node answered: {v}");
    let during = proc_status(node.pid(), "Threads:");
    println!("node threads: {before} before, {during} with 200 idle control connections");
    assert!(
        during <= before + 64 + 8,
        "{during} threads with 200 idle connections ({before} before)"
    );
    drop(idle);
}
