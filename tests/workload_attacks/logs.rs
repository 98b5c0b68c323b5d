//! Workload attacks on their own log files (D52): a workload truncates, replaces or makes sparse
//! its log (its stdout is the log file, `/proc/self/fd/1`). Nothing written after is lost, no NUL
//! byte of a hole reaches the backend or the node's console, and the node says so once. A log
//! replaced by a link to another file never ships that file.

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::timeouts::{DONE, REPLY};
use crate::support::{wait_for, ControlPlane, NodeProcess, Rig, Scenario, Start};

/// A node whose training is `script` (with [`GO`] before it), its log streamed every 0.2 s.
fn rig(script: &str) -> Rig {
    let body: String = format!("{GO}{script}")
        .lines()
        .map(|l| format!("    {l}\n"))
        .collect();
    Scenario::new(&format!("cyberwave:\n  training: |\n{body}"))
        .env("CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL", "0.2")
        .rig()
}

/// The script waits for the test at `go N`: until the file `goN` is in its folder.
const GO: &str = "go() { while [ ! -f \"go$1\" ]; do sleep 0.02; done; }\n";

/// Starts workload `wl`; at step N the test waits until the backend has the line `steps[N-1]`,
/// then lets the script go on past `go N`; then waits for the completion.
fn run(rig: &Rig, node: &NodeProcess, wl: &str, steps: &[&str]) {
    Start::training(wl).workload(wl).ok(&rig.cp, node);
    for (n, line) in steps.iter().enumerate() {
        let shipped = wait_for(REPLY, || {
            stream(&rig.cp, wl)
                .0
                .lines()
                .any(|l| l == *line)
                .then_some(())
        });
        assert!(shipped.is_some(), "{line:?} never shipped: {}", node.log());
        rig.touch(&format!("go{}", n + 1));
    }
    assert!(
        rig.cp.wait_status(wl, "completed", DONE).is_some(),
        "no completion: {}",
        node.log()
    );
}

/// The stdout stream of `wl` as it arrived: every chunk, in arrival order (one is in flight at a
/// time), each continuing where the one before ended, or after the hole its `gap` (or `dropped`)
/// announces; no NUL byte. Nothing is dropped before a test counts: a chunk sent twice is in the
/// text twice (and its lines counted twice). Returns the text and the chunks' bodies.
fn stream(cp: &ControlPlane, wl: &str) -> (String, Vec<Value>) {
    let bodies: Vec<Value> = cp
        .requests("logs")
        .into_iter()
        .filter(|r| r.body["workload_uuid"] == json!(wl) && r.body["log_type"] == "stdout")
        .map(|r| r.body)
        .collect();
    let mut text = String::new();
    let mut next = 0u64;
    for b in &bodies {
        let offset = b["offset"].as_u64().expect("offset");
        let content = b["log_content"].as_str().expect("content");
        assert!(!content.contains('\0'), "a NUL byte reached the backend");
        let said = b["gap"].as_u64().unwrap_or(0) + b["dropped"].as_u64().unwrap_or(0);
        // A repeat (an offset already had) passes here; the counts of its lines catch it.
        if offset >= next {
            assert_eq!(offset, next + said, "a gap nobody announced before {b}");
        }
        let length = b["length"].as_u64().expect("length");
        text.push_str(content);
        if length as usize == content.len() + 1 {
            text.push('\n');
        }
        next = offset + length;
    }
    (text, bodies)
}

/// The lines the node mirrored for `wl`'s stdout, without their tag.
fn console(node: &NodeProcess, wl: &str) -> Vec<String> {
    let tag = format!("[workload {wl} stdout] ");
    let out = node.stdout();
    assert!(!out.contains('\0'), "a NUL byte reached the console");
    out.lines()
        .filter_map(|l| l.strip_prefix(&tag).map(str::to_string))
        .collect()
}

fn count(lines: &[&str], want: &str) -> usize {
    lines.iter().filter(|l| **l == want).count()
}

/// Each of these lines of `wl` is once in its stream and once on the node's console.
fn assert_each_once(node: &NodeProcess, wl: &str, text: &str, want: &[String]) {
    let lines: Vec<&str> = text.lines().collect();
    let shown = console(node, wl);
    let shown: Vec<&str> = shown.iter().map(String::as_str).collect();
    for l in want {
        assert_eq!(count(&lines, l), 1, "{l} in the stream: {text}");
        assert_eq!(count(&shown, l), 1, "{l} on the console: {shown:?}");
    }
}

#[test]
fn g13_a_workload_that_truncates_its_log_loses_no_line_written_after() {
    // Truncated to zero and written past the old length at once (before the node looks), then
    // again: every line after each truncation reaches the backend and the console once.
    let rig = rig("for i in $(seq 1 20); do echo \"before $i\"; done\n\
         go 1\n\
         truncate -s 0 /proc/self/fd/1\n\
         for i in $(seq 1 40); do echo \"after $i\"; done\n\
         go 2\n\
         truncate -s 0 /proc/self/fd/1\n\
         for i in $(seq 1 40); do echo \"again $i\"; done\n");
    let node = rig.node();
    run(&rig, &node, "wl-trunc", &["before 20", "after 40"]);
    let (text, bodies) = stream(&rig.cp, "wl-trunc");
    let want: Vec<String> = (1..=40)
        .flat_map(|i| ["after", "again"].map(|what| format!("{what} {i}")))
        .collect();
    assert_each_once(&node, "wl-trunc", &text, &want);
    assert_eq!(
        bodies.iter().filter(|b| b["truncated"] == true).count(),
        2,
        "each truncation is said once in the stream"
    );
    assert_eq!(
        node.log()
            .matches("truncated or replaced by the workload")
            .count(),
        1,
        "one note on the console: {}",
        node.log()
    );
}

#[test]
fn g13_a_workload_that_truncates_its_log_to_the_middle_loses_no_line_written_after() {
    let rig = rig("for i in $(seq 1 10); do echo \"keep $i\"; done\n\
         go 1\n\
         size=$(stat -L -c %s /proc/$$/fd/1)\n\
         for i in $(seq 1 10); do echo \"cut $i\"; done\n\
         go 2\n\
         truncate -s \"$size\" /proc/self/fd/1\n\
         for i in $(seq 1 40); do echo \"after $i\"; done\n");
    let node = rig.node();
    run(&rig, &node, "wl-mid", &["keep 10", "cut 10"]);
    let (text, _) = stream(&rig.cp, "wl-mid");
    let want: Vec<String> = (1..=40).map(|i| format!("after {i}")).collect();
    assert_each_once(&node, "wl-mid", &text, &want);
    // What the truncation kept is not sent again: reading resumed where it cut (the end of the
    // chunk of `keep` lines, still intact).
    let lines: Vec<&str> = text.lines().collect();
    for i in 1..=10 {
        assert_eq!(count(&lines, &format!("cut {i}")), 1, "{text}");
    }
    let kept: Vec<String> = (1..=10).map(|i| format!("keep {i}")).collect();
    assert_each_once(&node, "wl-mid", &text, &kept);
    assert_eq!(
        node.log()
            .matches("truncated or replaced by the workload")
            .count(),
        1,
        "{}",
        node.log()
    );
}

#[test]
fn g13_a_workload_that_makes_its_log_sparse_ships_no_nul_and_floods_nothing() {
    // A 3 GiB hole in the middle, then one at the end.
    let rig = rig("echo before\n\
         go 1\n\
         truncate -s 3G /proc/self/fd/1\n\
         echo after\n\
         go 2\n\
         truncate -s +1G /proc/self/fd/1\n");
    let node = rig.node();
    let t = std::time::Instant::now();
    run(&rig, &node, "wl-sparse", &["before", "after"]);
    let (text, bodies) = stream(&rig.cp, "wl-sparse");
    assert_eq!(text, "before\nafter\n");
    assert!(bodies
        .iter()
        .any(|b| b["gap"].as_u64().unwrap_or(0) > 0 || b["dropped"].as_u64().unwrap_or(0) > 0));
    assert_eq!(console(&node, "wl-sparse"), ["before", "after"]);
    assert!(
        node.stdout().len() < 4096,
        "the console is not flooded: {} bytes",
        node.stdout().len()
    );
    assert_eq!(
        node.log().matches("has a hole").count(),
        1,
        "one note of the hole: {}",
        node.log()
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    // The operator's `logs` command reads it the same way (not 4 GiB of NUL bytes).
    let o = rig.setup.run(&["logs", "wl-sparse"]);
    assert_eq!(o.stdout, "before\nafter\n", "{}", o.stderr);
}

#[test]
fn g13_a_log_replaced_by_a_file_renamed_over_it_is_followed() {
    // The workload's own descriptor still writes to the old (unlinked) file; what it writes to
    // the new file at the log's path is streamed.
    let rig = rig("log=$(readlink /proc/$$/fd/1)\n\
         echo \"old 1\"\n\
         go 1\n\
         for i in $(seq 1 20); do echo \"new $i\"; done > \"$log.tmp\"\n\
         mv \"$log.tmp\" \"$log\"\n\
         go 2\n\
         for i in $(seq 21 30); do echo \"new $i\"; done >> \"$log\"\n\
         go 3\n");
    let node = rig.node();
    // The new file streams while the workload runs (its watch woke), not only at its end.
    run(&rig, &node, "wl-renamed", &["old 1", "new 20", "new 30"]);
    let (text, _) = stream(&rig.cp, "wl-renamed");
    let want: Vec<String> = (1..=30).map(|i| format!("new {i}")).collect();
    assert_each_once(&node, "wl-renamed", &text, &want);
}

/// A hostile workload (it runs as the node's user) replaces its own log files: stdout with a
/// symlink to a secret of the node's user, stderr with a hard link to it, then fails. Neither the
/// log stream nor the failure summary carries the secret, and the secret is left as it was (a
/// `max_log_bytes` cut through the link would rewrite it).
#[test]
fn g5_a_workload_cannot_have_the_node_ship_a_file_its_log_was_replaced_with() {
    let rig = Scenario::default()
        .env("CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL", "0.2")
        .rig();
    let secret = rig.setup.home.join("secret.txt");
    std::fs::write(&secret, "TOPSECRET-42\n".repeat(20)).unwrap();
    let logs = rig.state("workload_logs");
    let manifest = format!(
        "cyberwave:\n  max_log_bytes: 64\n  training: |\n    echo visible line\n    echo visible error >&2\n    sleep 0.5\n    ln -sf {secret} {logs}/training_swap.stdout.log\n    ln -f {secret} {logs}/training_swap.stderr.log\n    sleep 1\n    exit 1\n",
        secret = secret.display(),
        logs = logs.display()
    );
    rig.write("cyberwave.yml", &manifest);
    let node = rig.node();
    Start::training("swap").ok(&rig.cp, &node);
    let all = rig
        .cp
        .wait_status("wl-swap", "completed", DONE)
        .expect("no completion");
    let shipped: String = rig
        .cp
        .requests("logs")
        .iter()
        .filter(|r| r.body["workload_uuid"] == json!("wl-swap"))
        .map(|r| r.body.to_string())
        .collect();
    assert!(shipped.contains("visible line"), "{shipped}");
    assert!(
        !shipped.contains("TOPSECRET"),
        "a replaced log file shipped another file: {shipped}"
    );
    let statuses = serde_json::to_string(&all).unwrap();
    assert!(
        !statuses.contains("TOPSECRET"),
        "the failure summary read another file: {statuses}"
    );
    assert!(!node.log().contains("TOPSECRET"), "{}", node.log());
    assert_eq!(
        std::fs::read_to_string(&secret).unwrap(),
        "TOPSECRET-42\n".repeat(20),
        "the secret was rewritten through the link"
    );
}
