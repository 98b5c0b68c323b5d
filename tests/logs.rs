//! Log streaming and console mirroring end to end.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::control_plane::Request;
use crate::support::node::NodeSetup;
use crate::support::scenario::Start;
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{wait_for, Broker, ControlPlane};

fn rig(manifest: &str, interval: &str) -> (Broker, ControlPlane, NodeSetup) {
    let (broker, cp, mut setup) = crate::support::rig(manifest);
    setup.set("CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL", interval);
    (broker, cp, setup)
}

/// Log chunks of workload `wl`, by stream: offset → the longest chunk sent from there. A chunk
/// sent again after a restart may reach further than the first time; the shorter one must be a
/// prefix of the longer.
fn chunks(cp: &ControlPlane, wl: &str) -> [BTreeMap<u64, String>; 2] {
    let mut out: [BTreeMap<u64, String>; 2] = [BTreeMap::new(), BTreeMap::new()];
    for r in cp.requests("logs") {
        if r.body["workload_uuid"] != json!(wl) {
            continue;
        }
        let i = usize::from(r.body["log_type"] == "stderr");
        let offset = r.body["offset"].as_u64().expect("offset");
        let mut text = r.body["log_content"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        // Protocol §2.6.4: no trailing newline in the content; `length` still counts it. (No
        // workload here prints an empty line, which would legitimately end the content in one.)
        assert!(!text.ends_with('\n'), "trailing newline in {text:?}");
        let length = r.body["length"].as_u64().expect("length") as usize;
        if length == text.len() + 1 {
            text.push('\n');
        } else {
            assert!(
                length == text.len() || text.contains('\u{FFFD}'),
                "length {length} does not account for {text:?}"
            );
        }
        let slot = out[i].entry(offset).or_default();
        assert!(
            slot.starts_with(&text) || text.starts_with(slot.as_str()),
            "offset {offset} carried different bytes"
        );
        if text.len() > slot.len() {
            *slot = text;
        }
    }
    out
}

/// The union of what the backend got, as the backend would rebuild it by offset; panics on a gap
/// or on overlapping chunks that disagree.
fn rebuild(chunks: &BTreeMap<u64, String>) -> String {
    let mut text = String::new();
    for (offset, c) in chunks {
        let at = *offset as usize;
        assert!(
            at <= text.len(),
            "gap before offset {at} (have {} bytes)",
            text.len()
        );
        let overlap = (text.len() - at).min(c.len());
        assert_eq!(
            &text[at..at + overlap],
            &c[..overlap],
            "overlap at {at} disagrees"
        );
        text.push_str(&c[overlap..]);
    }
    text
}

fn numbered(prefix: &str, n: usize) -> String {
    (1..=n).map(|i| format!("{prefix} {i}\n")).collect()
}

fn completion_request(cp: &ControlPlane, wl: &str) -> Option<Request> {
    cp.all_requests()
        .into_iter()
        .find(|r| r.op == "workload:update-status" && r.id == wl && r.body["status"] == "completed")
}

#[test]
fn g4_every_line_is_streamed_once_in_order_and_mirrored() {
    let (_b, cp, setup) = rig(
        "cyberwave:\n  training: |\n    for i in $(seq 1 100); do echo \"out $i\"; echo \"err $i\" >&2; sleep 0.01; done\n",
        "0.2",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::training("lines").ok(&cp, &node);
    assert!(
        cp.wait_status("wl-lines", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    let [out, err] = chunks(&cp, "wl-lines");
    assert_eq!(rebuild(&out), numbered("out", 100));
    assert_eq!(rebuild(&err), numbered("err", 100));
    // Once, really: with no crash no chunk is sent twice, so the raw chunks as they arrived (not
    // the set `chunks` keeps per offset) add up to exactly the bytes written, each offset once.
    for (stream, want) in [
        ("stdout", numbered("out", 100)),
        ("stderr", numbered("err", 100)),
    ] {
        let raw: Vec<(u64, u64)> = cp
            .requests("logs")
            .iter()
            .filter(|r| {
                r.body["workload_uuid"] == json!("wl-lines") && r.body["log_type"] == stream
            })
            .map(|r| {
                (
                    r.body["offset"].as_u64().unwrap(),
                    r.body["length"].as_u64().unwrap(),
                )
            })
            .collect();
        let total: u64 = raw.iter().map(|(_, l)| l).sum();
        assert_eq!(total, want.len() as u64, "{stream}: {raw:?}");
        let mut next = 0;
        for (offset, len) in &raw {
            assert_eq!(
                *offset, next,
                "{stream}: a chunk repeated or skipped: {raw:?}"
            );
            next = offset + len;
        }
    }
    let logs: Vec<Request> = cp.requests("logs");
    let done = completion_request(&cp, "wl-lines").expect("completion");
    let first = logs.first().expect("log chunks").at;
    assert!(
        done.at - first > Duration::from_millis(500),
        "the first chunk came before the workload ended"
    );
    assert!(
        logs.iter().all(|l| l.at <= done.at),
        "the completion comes after the logs"
    );
    assert!(
        out.len() > 2,
        "streamed in several chunks while running, not at the end: {}",
        out.len()
    );
    for l in &logs {
        assert_eq!(l.body["workload_request_id"], "lines");
        assert_eq!(l.body["instance_uuid"], node.uuid());
    }
    // Mirroring: each line once, tagged, on the matching stream of the node.
    assert!(node.wait_stdout("[workload wl-lines stdout] out 100\n", REPLY));
    assert!(node.wait_log("[workload wl-lines stderr] err 100\n", REPLY));
    let stdout = node.stdout();
    let stderr = node.log();
    for i in 1..=100 {
        let o = format!("[workload wl-lines stdout] out {i}\n");
        let e = format!("[workload wl-lines stderr] err {i}\n");
        assert_eq!(stdout.matches(&o).count(), 1, "{o:?}");
        assert_eq!(stderr.matches(&e).count(), 1, "{e:?}");
        assert!(!stdout.contains(&e) && !stderr.contains(&o));
    }
}

// A partial last line mirrored at the end and invalid UTF-8 replaced (with offsets and lengths
// in bytes) are unit tests of the streams part: node::streams::tests::
// a_workload_that_ended_ships_its_rest_at_once_and_is_drained and a_chunk_body_matches_the_wire_format,
// node::streams::text::tests::log_content_has_no_trailing_newline and
// every_line_of_a_chunk_is_tagged_and_an_unfinished_one_waits.

#[test]
fn g4_a_node_killed_mid_stream_resumes_without_gap_or_loss() {
    let (_b, cp, setup) = rig(
        "cyberwave:\n  training: |\n    for i in $(seq 1 200); do echo \"out $i\"; echo \"err $i\" >&2; sleep 0.01; done\n",
        "0.2",
    );
    let mut node = setup.spawn();
    node.wait_ready(READY);
    Start::training("kill").ok(&cp, &node);
    assert!(wait_for(REPLY, || (chunks(&cp, "wl-kill")[0].len() >= 2)
        .then_some(()))
    .is_some());
    node.kill9();
    std::thread::sleep(Duration::from_millis(700));
    let node = setup.spawn();
    node.wait_ready(READY);
    assert!(
        cp.wait_status("wl-kill", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    let [out, err] = chunks(&cp, "wl-kill");
    assert_eq!(rebuild(&out), numbered("out", 200));
    assert_eq!(rebuild(&err), numbered("err", 200));
}

#[test]
fn g4_a_broker_outage_mid_stream_loses_nothing() {
    let (mut broker, cp, setup) = rig(
        "cyberwave:\n  training: |\n    for i in $(seq 1 150); do echo \"out $i\"; sleep 0.01; done\n    while [ ! -f go ]; do sleep 0.05; done\n    for i in $(seq 151 300); do echo \"out $i\"; sleep 0.01; done\n",
        "0.2",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::training("outage").ok(&cp, &node);
    assert!(wait_for(REPLY, || (rebuild(&chunks(&cp, "wl-outage")[0])
        == numbered("out", 150))
    .then_some(()))
    .is_some());
    broker.stop();
    std::fs::write(setup.cwd.join("go"), "").expect("go");
    // Long enough for the node to notice and for output to be written meanwhile.
    std::thread::sleep(Duration::from_secs(2));
    broker.restart();
    assert!(
        cp.wait_status("wl-outage", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    let [out, _] = chunks(&cp, "wl-outage");
    assert_eq!(rebuild(&out), numbered("out", 300));
}

#[test]
fn g6_a_flood_of_output_does_not_starve_commands() {
    let (_b, cp, setup) = rig("cyberwave:\n  training: yes 0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz | head -c 500000000\n", "0.5");
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::training("flood").ok(&cp, &node);
    let log = setup
        .home
        .join(".cyberwave/workload_logs/training_flood.stdout.log");
    let mut answered = 0;
    for i in 0..20 {
        let rid = format!("during-{i}");
        if cp
            .status(&node.uuid(), &rid, Duration::from_secs(2))
            .is_some()
        {
            answered += 1;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(answered, 20, "every status during the flood was answered");
    let size = wait_for(Duration::from_secs(60), || {
        let len = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
        (len == 500_000_000).then_some(len)
    });
    assert_eq!(
        size,
        Some(500_000_000),
        "the whole output is in the log file"
    );
    let shipped: u64 = cp
        .requests("logs")
        .iter()
        .map(|r| r.body["length"].as_u64().unwrap_or(0))
        .sum();
    assert!(shipped < 500_000_000, "shipping is paced, not all at once");
    let status: Value = cp.status(&node.uuid(), "after", REPLY).expect("status");
    assert_eq!(status["status"], "ok");
}

#[test]
fn max_log_bytes_keeps_the_newest_part_and_says_what_was_dropped() {
    let (_b, cp, setup) = rig(
        "cyberwave:\n  training: |\n    head -c 300000 /dev/zero | tr '\\0' 'x' | fold -w 99\n    while [ ! -f go ]; do sleep 0.05; done\n    echo LAST\n  max_log_bytes: 100000\n",
        "0.2",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::training("cap").ok(&cp, &node);
    let log = setup
        .home
        .join(".cyberwave/workload_logs/training_cap.stdout.log");
    assert!(node.wait_log("over max_log_bytes", DONE), "{}", node.log());
    std::fs::write(setup.cwd.join("go"), "").expect("go");
    assert!(cp.wait_status("wl-cap", "completed", DONE).is_some());
    let kept = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(kept.len() as u64 <= 100_000, "{} bytes kept", kept.len());
    assert!(kept.ends_with("LAST\n"), "the newest part is kept");
    let chunks: Vec<Value> = cp
        .requests("logs")
        .into_iter()
        .map(|r| r.body)
        .filter(|b| b["workload_uuid"] == "wl-cap")
        .collect();
    let shipped: u64 = chunks
        .iter()
        .map(|b| b["length"].as_u64().unwrap_or(0))
        .sum();
    let dropped: u64 = chunks
        .iter()
        .map(|b| b["dropped"].as_u64().unwrap_or(0))
        .sum();
    let written = 300_000 + 300_000 / 99 + 5; // the x's, fold's newlines, "LAST\n"
    assert_eq!(
        shipped + dropped,
        written as u64,
        "every byte was shipped or announced as dropped"
    );
    let offsets: Vec<u64> = chunks
        .iter()
        .map(|b| b["offset"].as_u64().unwrap_or(0))
        .collect();
    assert!(
        offsets.windows(2).all(|w| w[0] < w[1]),
        "stream offsets keep growing: {offsets:?}"
    );
}

#[test]
fn old_logs_are_pruned_but_never_a_running_workloads() {
    let (_b, cp, setup) = rig(
        "cyberwave:\n  training: sleep 20\n  log_retention_days: 7\n",
        "0.5",
    );
    let state = setup.home.join(".cyberwave");
    let old = |rel: &str| {
        let p = setup.home.write(&format!(".cyberwave/{rel}"), "old\n");
        let ok = std::process::Command::new("touch")
            .args(["-d", "30 days ago"])
            .arg(&p)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "touch -d");
        p
    };
    let stale_log = old("workload_logs/training_gone.stdout.log");
    let stale_image = old("inputs/image_training_gone.png");
    let fresh = setup.home.write(
        ".cyberwave/workload_logs/training_recent.stdout.log",
        "new\n",
    );
    let mut node = setup.spawn();
    node.wait_ready(READY);
    assert!(
        wait_for(REPLY, || (!stale_log.exists() && !stale_image.exists())
            .then_some(()))
        .is_some(),
        "old files pruned"
    );
    assert!(fresh.exists(), "recent logs kept");
    // A running workload's log is kept however old its timestamp looks.
    Start::training("run").ok(&cp, &node);
    node.kill9();
    let running_log = state.join("workload_logs/training_run.stdout.log");
    let ok = std::process::Command::new("touch")
        .args(["-d", "30 days ago"])
        .arg(&running_log)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok);
    let node = setup.spawn();
    node.wait_ready(READY);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        running_log.exists(),
        "the running workload's log survives retention"
    );
}
