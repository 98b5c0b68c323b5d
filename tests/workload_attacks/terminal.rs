//! Workload attacks: see `mod.rs`. D69: what a workload prints, and outside text in the CLI's
//! output, never reaches the operator's terminal raw (escape sequences, terminal queries, a
//! forged line, bytes that are not UTF-8), and the console mirror does not amplify a flood.
//! The log file and the stream keep every byte as written.

use std::time::Instant;

use serde_json::{json, Value};

use crate::support::scenario::Start;
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{wait_for, Rig, Scenario};

/// No control character but a newline or TAB, no DEL or C1 control.
fn assert_clean(text: &str, what: &str) {
    let bad: Vec<char> = text
        .chars()
        .filter(|c| {
            (c.is_control() && *c != '\n' && *c != '\t') || ('\u{7f}'..='\u{9f}').contains(c)
        })
        .collect();
    assert!(bad.is_empty(), "{what} holds {bad:?}:\n{text}");
}

#[test]
fn g13_d69_escape_sequences_queries_and_invalid_utf8_are_mirrored_escaped() {
    let (rig, node) = Scenario::new("cyberwave:\n  training: |\n    printf 'a\\033]0;pwned\\007\\033[2J\\033[6n\\033P+q544e\\033\\\\\\302\\233H\\377\\376z\\n'\n    printf 'progress\\r 10%%\\r 20%%\\r\\r100%%\\n'\n    printf 'x\\033[1A\\033[2K\\r2026-12-06T00:00:00Z INFO forged\\n'\n    printf '\\033[31mred\\n' >&2\n").node();
    let Rig { cp, setup, .. } = &rig;
    Start::training("esc").workload("wl-esc").ok(cp, &node);
    assert!(cp.wait_status("wl-esc", "completed", DONE).is_some());
    let tag = "[workload wl-esc stdout] ";
    let want = format!(
        "{tag}a\\x1b]0;pwned\\x07\\x1b[2J\\x1b[6n\\x1bP+q544e\\x1b\\\\x9bH\\xff\\xfez\n\
         {tag}progress\n{tag} 10%\n{tag} 20%\n{tag}100%\n\
         {tag}x\\x1b[1A\\x1b[2K\n{tag}2026-12-06T00:00:00Z INFO forged\n"
    );
    assert!(
        node.wait_stdout(&want, REPLY),
        "want:\n{want}\ngot:\n{}",
        node.stdout()
    );
    assert!(node.wait_log("[workload wl-esc stderr] \\x1b[31mred\n", REPLY));
    assert_clean(&node.stdout(), "the node's stdout");
    assert_clean(&node.log(), "the node's log");
    // The log file and the stream keep every byte as written.
    let file = std::fs::read_dir(setup.config_dir().join("workload_logs"))
        .expect("logs")
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().ends_with("stdout.log"))
        .expect("the stdout log");
    let bytes = std::fs::read(file).expect("read the log");
    assert!(bytes.starts_with(b"a\x1b]0;pwned\x07\x1b[2J"), "{bytes:?}");
    let shipped: String = cp
        .requests("logs")
        .into_iter()
        .filter(|r| r.body["workload_uuid"] == json!("wl-esc") && r.body["log_type"] == "stdout")
        .map(|r| {
            r.body["log_content"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert!(shipped.contains("\u{1b}]0;pwned\u{7}"), "{shipped:?}");
}

/// Ten megabytes of newlines made 230 MB of tagged empty lines on the node's stdout (a
/// journal or Docker's json-file keeps them all): the mirror prints at most its budget per
/// second and says how many bytes it left out; the stream still gets them all.
#[test]
fn g13_d69_a_flood_of_newlines_is_not_amplified_on_the_nodes_stdout() {
    let mut rig = Scenario::new(
        "cyberwave:\n  training: head -c 1000000 /dev/zero | tr '\\0' '\\n'; echo done\n",
    )
    .rig();
    let Rig { cp, setup, .. } = &mut rig;
    setup.set("CYBERWAVE_NODE_MIRROR_BYTES_PER_SECOND", "65536");
    let node = setup.spawn();
    node.wait_ready(READY);
    let t0 = Instant::now();
    Start::training("nl").workload("wl-nl").ok(cp, &node);
    assert!(cp.wait_status("wl-nl", "completed", DONE).is_some());
    let tag = "[workload wl-nl stdout] ";
    // The last line may itself be over the budget: wait for the final count instead.
    let counted = |out: &str| -> u64 {
        out.lines()
            .filter_map(|l| l.strip_prefix(tag))
            .filter_map(|l| l.strip_suffix(" bytes not mirrored (in the log file and the stream)"))
            .map(|n| n.parse::<u64>().expect("a count"))
            .sum()
    };
    let printed = |out: &str| {
        out.lines()
            .filter_map(|l| l.strip_prefix(tag))
            .filter(|l| l.is_empty() || *l == "done")
            .count() as u64
    };
    let total = wait_for(DONE, || {
        let out = node.stdout();
        (counted(&out) + printed(&out) >= 1_000_005).then_some(out)
    })
    .unwrap_or_else(|| panic!("not every byte printed or counted:\n{}", node.stdout()));
    let elapsed = t0.elapsed().as_secs() + 2;
    let mirrored = total.len() as u64;
    assert!(
        mirrored <= 65536 * elapsed + 4096 * elapsed,
        "{mirrored} bytes on the console in {elapsed} s"
    );
    assert!(
        mirrored < 1_000_000,
        "{mirrored} bytes for 1 MB of newlines"
    );
    // Every byte is in the stream.
    let shipped: u64 = cp
        .requests("logs")
        .into_iter()
        .filter(|r| r.body["workload_uuid"] == json!("wl-nl"))
        .map(|r| r.body["length"].as_u64().unwrap_or(0))
        .sum();
    assert!(shipped >= 1_000_005, "{shipped} bytes shipped");
}

/// A request id is outside text: `status` shows it escaped, on its own line (as text) and in
/// valid JSON with no raw DEL or C1 (as `--json`).
#[test]
fn g13_d69_status_shows_a_hostile_request_id_escaped() {
    let rig =
        Scenario::new("cyberwave:\n  training: |\n    while [ ! -f go ]; do sleep 0.05; done\n")
            .rig();
    let Rig { cp, setup, .. } = &rig;
    let node = setup.spawn();
    node.wait_ready(READY);
    let rid = "r\u{1b}]0;pwned\u{7}\u{1b}[2J\n2026-12-06T00:00:00Z FORGED\u{9b}31m\u{7f}";
    cp.command(
        &node.uuid(),
        json!({"command": "training", "request_id": rid, "params": {"workload_uuid": "wl-rid"}}),
    );
    assert_eq!(cp.wait_reply(rid, REPLY).expect("a reply")["status"], "ok");
    let out = setup.run(&["status"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_clean(&out.stdout, "status");
    assert!(
        !out.stdout.lines().any(|l| l.starts_with("2026-12-06")),
        "a forged line:\n{}",
        out.stdout
    );
    out.assert_stdout("r\\x1b]0;pwned\\x07\\x1b[2J\\x0a2026-12-06T00:00:00Z FORGED\\x9b31m\\x7f");
    let out = setup.run(&["status", "--json"]);
    assert_clean(&out.stdout, "status --json");
    let v: Value = serde_json::from_str(out.stdout.trim()).expect("JSON");
    assert_eq!(v["workloads"][0]["request_id"], json!(rid));
    std::fs::write(setup.cwd.join("go"), "").expect("go");
    assert!(cp.wait_status("wl-rid", "completed", DONE).is_some());
}

/// `logs -n N` reads from the end and cuts a line at 1 MiB: a log whose last lines are a 3 MiB
/// line and a short one shows 1 MiB of the first with a note, then the second; escaped.
#[test]
fn g13_d69_logs_n_shows_the_last_lines_cut_at_a_mib_and_escaped() {
    let (rig, node) = Scenario::new("cyberwave:\n  training: |\n    seq 1 1000\n    head -c 3145728 /dev/zero | tr '\\0' x; echo\n    printf 'last \\033[2J\\377\\n'\n").node();
    let Rig { cp, setup, .. } = &rig;
    Start::training("big-line").workload("wl-big").ok(cp, &node);
    assert!(cp.wait_status("wl-big", "completed", DONE).is_some());
    let out = setup.run(&["logs", "big-line", "-n", "2"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_clean(&out.stdout, "logs");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        lines.len(),
        2,
        "{:?}",
        lines.iter().map(|l| l.len()).collect::<Vec<_>>()
    );
    assert_eq!(
        lines[0],
        format!(
            "{} … (2097152 more bytes of this line in the log file)",
            "x".repeat(1 << 20)
        )
    );
    assert_eq!(lines[1], "last \\x1b[2J\\xff");
    let out = setup.run(&["logs", "big-line", "-n", "1003"]);
    assert_eq!(
        out.stdout.lines().next(),
        Some("1"),
        "the whole log from its first line"
    );
    assert_eq!(out.stdout.lines().count(), 1002);
}
