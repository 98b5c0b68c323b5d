//! The node's own log and console (D31, D69): outside text (request ids, command names, result
//! file names, workload output) cannot forge or corrupt a log line or hide the console's
//! mirror tag; started with its standard streams closed the node writes its output nowhere it
//! should not; the HTTP client's wire dump never reaches the log, even at trace.

use serde_json::json;

use crate::support::scenario::completion;
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{wait_for, Scenario, Start};

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
fn g8_outside_text_cannot_forge_or_corrupt_a_node_log_line() {
    let (rig, node) = Scenario::new("cyberwave:\n  training: echo done\n").node();
    let uuid = node.uuid();
    // A command the node answers, an unknown command name, and a workload that runs to its
    // completion: each logs the request id (or name) on its way.
    rig.cp.command(
        &uuid,
        json!({"command": "status", "request_id": FORGED_RID}),
    );
    assert!(
        rig.cp.wait_reply(FORGED_RID, REPLY).is_some(),
        "status answered"
    );
    let bad_cmd = "nope\n2026-11-30T00:00:00Z ERROR FORGED\u{1b}[2J";
    rig.cp
        .command(&uuid, json!({"command": bad_cmd, "request_id": "bad-cmd"}));
    assert!(
        rig.cp.wait_reply("bad-cmd", REPLY).is_some(),
        "unknown command answered"
    );
    let long_rid = format!("long-{}", "a".repeat(1000));
    for (rid, wl) in [(FORGED_RID, "wl-forged"), (long_rid.as_str(), "wl-long")] {
        rig.cp.command(
            &uuid,
            json!({"command": "training", "request_id": rid, "params": {"workload_uuid": wl}}),
        );
        completion(&rig.cp, wl);
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
    assert!(rig.cp.status(&uuid, "after", REPLY).is_some());
}

#[test]
fn a_carriage_return_in_workload_output_cannot_hide_the_mirror_tag() {
    let (rig, node) =
        Scenario::new("cyberwave:\n  training: printf '10%%\\rFORGED LINE\\r\\nlast'\n").node();
    let w = Start::training("cr");
    w.ok(&rig.cp, &node);
    w.completion(&rig.cp);
    let tag = "[workload wl-cr stdout] ";
    // D69: a redraw is a line of its own, ended as any other.
    let want = format!("{tag}10%\n{tag}FORGED LINE\n{tag}last\n");
    assert!(node.wait_stdout(&want, REPLY), "{:?}", node.stdout());
}

#[test]
fn g8_a_result_file_name_cannot_forge_a_node_log_line() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  training: mkdir -p out && printf x > \"out/$(printf 'f\\n2026-11-30T00:00:00Z ERROR FORGED\\033[31m')\"\n  results_folder: out\n",
    )
    .node();
    let w = Start::training("files");
    w.ok(&rig.cp, &node);
    w.completion(&rig.cp);
    node.assert_logged("result upload finished");
    let log = node.log();
    assert!(
        log.contains("f\\n2026-11-30T00:00:00Z ERROR FORGED\\u{1b}[31m"),
        "the file name is shown escaped: {log}"
    );
    assert_clean(&log);
}

/// Started with its standard streams closed (`nohup`-style launchers, a `daemonize` that
/// closes them, `>&- 2>&-`): descriptors 0–2 would go to the first files and sockets the node
/// opens, and its log and its workloads' mirrored output would be written into them (the
/// state-dir lock, a record, the broker connection). Rust's runtime puts `/dev/null` there
/// before `main`: a guard, should a build or a runtime ever not.
#[test]
fn a_node_started_with_its_standard_streams_closed_writes_its_output_nowhere_it_should_not() {
    let mut rig = Scenario::new(
        "cyberwave:\n  inference: |\n    for i in $(seq 50); do echo out-line-$i; echo err-line-$i >&2; done\n",
    )
    .rig();
    rig.setup.under = vec![
        "sh".into(),
        "-c".into(),
        "exec \"$0\" \"$@\" <&- >&- 2>&-".into(),
    ];
    let node = rig.spawn();
    let uuid = wait_for(READY, || {
        let u = node.uuid();
        (!u.is_empty()).then_some(u)
    })
    .expect("the node registered");
    // The first may go out before the node subscribed (there is no log line to wait for).
    let st = rig
        .cp
        .status_eventually(&uuid, "st-closed", READY)
        .expect("status answered");
    assert_eq!(st["status"], "ok", "{st}");
    // Descriptors 0–2 of the node are /dev/null.
    for fd in 0..3 {
        let target = std::fs::read_link(format!("/proc/{}/fd/{fd}", node.pid()))
            .unwrap_or_else(|e| panic!("fd {fd} of the node: {e}"));
        assert_eq!(target, std::path::Path::new("/dev/null"), "fd {fd}");
    }
    let w = Start::new("inference", "cl1");
    w.send(&rig.cp, &node);
    w.completion(&rig.cp);
    // Nothing of the log or of the mirrored output went into a state file.
    let mut stack = vec![rig.setup.config_dir()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let text = String::from_utf8_lossy(&std::fs::read(&p).unwrap_or_default()).into_owned();
            let is_log = p.to_string_lossy().contains("workload_logs");
            assert!(
                is_log
                    || !(text.contains("[workload ")
                        || text.contains(" INFO ")
                        || text.contains(" DEBUG ")),
                "{} holds the node's output:\n{}",
                p.display(),
                text.chars().take(400).collect::<String>()
            );
        }
    }
}

/// What the HTTP client logs at trace: every request's bytes as hex rows of 16 characters, the
/// `Authorization: Token …` header included, split across rows so that no row holds the whole
/// token (the secret scan of every test looks for it whole). With `RUST_LOG=trace`, as every
/// test node runs, a result upload talks to the backend over HTTP and no such row is printed.
#[test]
fn g7_the_http_clients_wire_dump_never_reaches_the_log_at_trace() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  training: echo model > \"$CYBERWAVE_RESULTS_DIR/model.bin\"\n  results_folder: out\n",
    )
    .node();
    let w = Start::training("dump");
    w.ok(&rig.cp, &node);
    w.completion(&rig.cp);
    assert_eq!(rig.cp.uploads().len(), 1, "the result went up over HTTP");
    let log = node.log();
    let row = |msg: &str| {
        // `6765 7420 2f61 …  get /a…`: eight groups of four hex digits (or `--`) then the text.
        let mut words = msg.split(' ');
        (0..8).all(|_| {
            words.next().is_some_and(|w| {
                w.len() == 4 && w.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
            })
        })
    };
    for line in log.lines() {
        let msg = line.splitn(3, ' ').nth(2).unwrap_or("").trim_start();
        assert!(!row(msg), "a wire dump row in the node's log: {line:?}");
        assert!(
            !msg.to_ascii_lowercase().contains("authorization"),
            "an Authorization header in the node's log: {line:?}"
        );
    }
}
