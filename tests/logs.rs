//! Workload logs (guarantee 4): every line streamed to the backend once, in order, while the
//! workload runs, and mirrored on the node's console; without a gap or a loss across a kill -9
//! of the node or a broker outage; a flood paced without starving commands, an endless line in
//! pieces with the node's memory bounded, chunks cut to the broker's packet size and a denied
//! logs topic not a warning per chunk (D34); `max_log_bytes` and log retention.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::control_plane::Request;
use crate::support::scenario::completion;
use crate::support::timeouts::{DONE, REPLY};
use crate::support::{procs, wait_for, Broker, ControlPlane, NodeProcess, Scenario, Start};

const ACCUSED: &str = "another client uses this node's MQTT client id";

/// A node whose logs are streamed every `interval` seconds.
fn streaming(manifest: &str, interval: &str) -> Scenario {
    Scenario::new(manifest).env("CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL", interval)
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
        // A chunk's content has no trailing newline; its `length` still counts it (see
        // docs/protocol.md). (No workload here prints an empty line, which would legitimately
        // end the content in one.)
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
    let (rig, node) = streaming(
        "cyberwave:\n  training: |\n    for i in $(seq 1 100); do echo \"out $i\"; echo \"err $i\" >&2; sleep 0.01; done\n",
        "0.2",
    )
    .node();
    Start::training("lines").ok(&rig.cp, &node);
    completion(&rig.cp, "wl-lines");
    let [out, err] = chunks(&rig.cp, "wl-lines");
    assert_eq!(rebuild(&out), numbered("out", 100));
    assert_eq!(rebuild(&err), numbered("err", 100));
    // Once, really: with no crash no chunk is sent twice, so the raw chunks as they arrived (not
    // the set `chunks` keeps per offset) add up to exactly the bytes written, each offset once.
    for (stream, want) in [
        ("stdout", numbered("out", 100)),
        ("stderr", numbered("err", 100)),
    ] {
        let raw: Vec<(u64, u64)> = rig
            .cp
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
    let logs: Vec<Request> = rig.cp.requests("logs");
    let done = completion_request(&rig.cp, "wl-lines").expect("completion");
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

// A partial last line mirrored at the end and invalid UTF-8 replaced (with offsets and lengths
// in bytes) are unit tests of the streams part: node::streams::tests::
// a_workload_that_ended_ships_its_rest_at_once_and_is_drained and a_chunk_body_matches_the_wire_format,
// node::streams::text::tests::log_content_has_no_trailing_newline and
// every_line_of_a_chunk_is_tagged_and_an_unfinished_one_waits.

#[test]
fn g4_a_node_killed_mid_stream_resumes_without_gap_or_loss() {
    let (rig, mut node) = streaming(
        "cyberwave:\n  training: |\n    for i in $(seq 1 200); do echo \"out $i\"; echo \"err $i\" >&2; sleep 0.01; done\n",
        "0.2",
    )
    .node();
    Start::training("kill").ok(&rig.cp, &node);
    assert!(
        wait_for(REPLY, || (chunks(&rig.cp, "wl-kill")[0].len() >= 2)
            .then_some(()))
        .is_some()
    );
    node.kill9();
    std::thread::sleep(Duration::from_millis(700));
    let _node = rig.node();
    completion(&rig.cp, "wl-kill");
    let [out, err] = chunks(&rig.cp, "wl-kill");
    assert_eq!(rebuild(&out), numbered("out", 200));
    assert_eq!(rebuild(&err), numbered("err", 200));
}

#[test]
fn g4_a_broker_outage_mid_stream_loses_nothing() {
    let (mut rig, node) = streaming(
        "cyberwave:\n  training: |\n    for i in $(seq 1 150); do echo \"out $i\"; sleep 0.01; done\n    while [ ! -f go ]; do sleep 0.05; done\n    for i in $(seq 151 300); do echo \"out $i\"; sleep 0.01; done\n",
        "0.2",
    )
    .node();
    Start::training("outage").ok(&rig.cp, &node);
    assert!(
        wait_for(REPLY, || (rebuild(&chunks(&rig.cp, "wl-outage")[0])
            == numbered("out", 150))
        .then_some(()))
        .is_some()
    );
    rig.broker.stop();
    rig.touch("go");
    // Long enough for the node to notice and for output to be written meanwhile.
    std::thread::sleep(Duration::from_secs(2));
    rig.broker.restart();
    completion(&rig.cp, "wl-outage");
    let [out, _] = chunks(&rig.cp, "wl-outage");
    assert_eq!(rebuild(&out), numbered("out", 300));
}

#[test]
fn g6_a_flood_of_output_does_not_starve_commands() {
    let (rig, node) = streaming("cyberwave:\n  training: yes 0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz | head -c 500000000\n", "0.5").node();
    Start::training("flood").ok(&rig.cp, &node);
    let log = rig.state("workload_logs/training_flood.stdout.log");
    let mut answered = 0;
    for i in 0..20 {
        let rid = format!("during-{i}");
        if rig
            .cp
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
    let shipped: u64 = rig
        .cp
        .requests("logs")
        .iter()
        .map(|r| r.body["length"].as_u64().unwrap_or(0))
        .sum();
    assert!(shipped < 500_000_000, "shipping is paced, not all at once");
    let status: Value = rig.cp.status(&node.uuid(), "after", REPLY).expect("status");
    assert_eq!(status["status"], "ok");
}

/// 50 MB with no newline: numbered records (so order shows) with multibyte characters (so a
/// piece boundary inside a character would show).
fn endless_line(len: usize) -> Vec<u8> {
    let mut data = Vec::with_capacity(len + 32);
    let mut i = 0u64;
    while data.len() < len {
        data.extend_from_slice(format!("{i:09}é✓ ").as_bytes());
        i += 1;
    }
    // End on a whole character: the records are ASCII up to the multibyte ones.
    while std::str::from_utf8(&data[..len.min(data.len())]).is_err() {
        data.pop();
    }
    data.truncate(len.min(data.len()));
    data
}

fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[test]
fn g4_fifty_megabytes_without_a_newline_keep_node_memory_bounded_and_arrive_whole() {
    const LEN: usize = 50_000_000;
    // The workload keeps running after its output: the line is shipped while it runs.
    let rig = streaming(
        "cyberwave:\n  training: |\n    cat endless.txt\n    while [ ! -f go ]; do sleep 0.05; done\n",
        "0.05",
    )
    // Every piece is mirrored here: the console's budget (D69) is lifted for this test.
    .env("CYBERWAVE_NODE_MIRROR_BYTES_PER_SECOND", "1000000000")
    .rig();
    let data = endless_line(LEN);
    std::fs::write(rig.work("endless.txt"), &data).expect("write data");
    let node = rig.node();
    let idle_hwm = procs::status_number(node.pid(), "VmHWM:");
    Start::training("endless").send(&rig.cp, &node);
    let shipped_while_running = wait_for(Duration::from_secs(240), || {
        let n: u64 = rig
            .cp
            .requests("logs")
            .iter()
            .map(|r| r.body["length"].as_u64().unwrap_or(0))
            .sum();
        std::thread::sleep(Duration::from_millis(100));
        (n + 64 * 1024 > LEN as u64).then_some(n)
    });
    assert!(
        shipped_while_running.is_some(),
        "all but the last piece is shipped while the workload runs"
    );
    rig.touch("go");
    assert!(
        rig.cp
            .wait_status("wl-endless", "completed", Duration::from_secs(240))
            .is_some(),
        "{}",
        node.log()
    );
    let hwm = procs::status_number(node.pid(), "VmHWM:");
    // What the backend got: every byte, in order, in pieces of at most 512 KiB (a log chunk).
    let mut chunks: Vec<(u64, String)> = rig
        .cp
        .requests("logs")
        .into_iter()
        .filter(|r| r.body["workload_uuid"] == "wl-endless" && r.body["log_type"] == "stdout")
        .map(|r| {
            (
                r.body["offset"].as_u64().expect("offset"),
                r.body["log_content"].as_str().expect("content").to_string(),
            )
        })
        .collect();
    chunks.sort_by_key(|c| c.0);
    chunks.dedup_by_key(|c| c.0);
    let mut shipped = Vec::with_capacity(LEN);
    for (offset, c) in &chunks {
        assert_eq!(*offset, shipped.len() as u64, "no gap and no overlap");
        assert!(c.len() <= 512 * 1024, "a piece of {} bytes", c.len());
        shipped.extend_from_slice(c.as_bytes());
    }
    assert_eq!(shipped.len(), data.len(), "every byte was shipped");
    assert_eq!(fnv1a(&shipped), fnv1a(&data), "in order, unchanged");
    // The console: every piece carries the tag, and the pieces are the output.
    let tag = "[workload wl-endless stdout] ";
    let out = wait_for_len(&node, LEN);
    let mut mirrored = Vec::with_capacity(LEN);
    let mut pieces = 0;
    for line in out.split_inclusive('\n') {
        if !line.contains("wl-endless") {
            continue;
        }
        let body = line
            .strip_prefix(tag)
            .unwrap_or_else(|| panic!("an untagged line: {:?}", line.get(..80)));
        let body = body.strip_suffix('\n').unwrap_or(body);
        assert!(
            body.len() <= 64 * 1024,
            "a mirrored piece of {} bytes",
            body.len()
        );
        mirrored.extend_from_slice(body.as_bytes());
        pieces += 1;
    }
    assert_eq!(mirrored.len(), data.len(), "every byte was mirrored");
    assert_eq!(
        fnv1a(&mirrored),
        fnv1a(&data),
        "mirrored in order, unchanged"
    );
    println!(
        "50 MB without a newline: node VmHWM {idle_hwm} kB idle, {hwm} kB after; {} chunks shipped, {pieces} pieces mirrored",
        chunks.len()
    );
    // A 64 KiB piece is held at most a few times over (read, shipped, mirrored); the rest is
    // the node's own footprint at rest.
    assert!(
        hwm <= idle_hwm + 16 * 1024,
        "node memory grew from {idle_hwm} kB to {hwm} kB"
    );
}

/// The node's stdout once it holds at least `len` bytes (the pipe is copied by a thread).
fn wait_for_len(node: &NodeProcess, len: usize) -> String {
    let end = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let out = node.stdout();
        if out.len() >= len || std::time::Instant::now() >= end {
            return out;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// D34: a workload that writes more than the broker's Maximum Packet Size at once. A log chunk
/// over the limit would make mosquitto drop the node (every few seconds, resent after each
/// reconnect; the short connections taken for a copied state dir, `status` unanswered). Log
/// chunks are cut to fit the broker's limit (every byte arrives, none is skipped), the
/// connection stays, `status` is answered while the workload runs, and its completion arrives.
#[test]
fn g11_d34_a_log_chunk_over_the_brokers_packet_size_does_not_cost_the_connection() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  training: head -c 300000 /dev/zero | tr '\\0' x; echo; while [ ! -f release ]; do sleep 0.05; done\n",
    )
    .broker(Broker::start_with_conf("max_packet_size 65536\n"))
    .node();
    Start::training("big-log")
        .workload("wl-bl")
        .ok(&rig.cp, &node);
    let shipped = || -> u64 {
        rig.cp
            .requests("logs")
            .iter()
            .filter(|r| r.body["workload_uuid"] == "wl-bl")
            .map(|r| r.body["length"].as_u64().unwrap_or(0))
            .sum()
    };
    assert!(
        wait_for(DONE, || (shipped() >= 300_001).then_some(())).is_some(),
        "the line arrives whole, in pieces that fit: {} bytes\n{}",
        shipped(),
        node.log()
    );
    assert!(!node.log().contains("not publishing"), "{}", node.log());
    // While the workload runs, the node answers.
    for i in 0..3 {
        let rid = format!("during-{i}");
        assert!(
            rig.cp.status(&node.uuid(), &rid, REPLY).is_some(),
            "{}",
            node.log()
        );
    }
    rig.touch("release");
    completion(&rig.cp, "wl-bl");
    assert_eq!(
        node.log().matches("connected to MQTT broker").count(),
        1,
        "one connection all along"
    );
    assert!(!node.log().contains(ACCUSED), "{}", node.log());
}

/// D34: an ACL that denies the node its logs topic (MQTT v5: PUBACK 0x87, the connection stays):
/// each chunk is refused and offered again at the stream's pace, up to 4 times a second. The
/// node keeps serving, and says so at most once a minute, not once per refused chunk.
#[test]
fn g11_d34_a_logs_topic_the_broker_denies_is_not_a_warning_per_chunk() {
    let (rig, node) = streaming(
        "cyberwave:\n  training: |\n    for i in $(seq 1 60); do echo \"line $i\"; sleep 0.05; done\n    sleep 30\n",
        "0.2",
    )
    .broker(Broker::start_with_acl(
        "pattern deny cyberwave/cloud-node/+/logs\npattern readwrite #\n",
    ))
    .node();
    Start::training("quiet").ok(&rig.cp, &node);
    // Refusals happen (the PUBACK says 0x87)...
    assert!(
        wait_for(DONE, || node.log().contains("not delivered").then_some(())).is_some(),
        "{}",
        node.log()
    );
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        rig.cp.status(&node.uuid(), "during", REPLY).is_some(),
        "{}",
        node.log()
    );
    // ...and are reported once a minute.
    let warned = node.log().matches("not delivered").count();
    assert!(
        warned <= 2,
        "{warned} warnings for one refused stream in 3 s:\n{}",
        node.log()
    );
    assert_eq!(node.log().matches("connected to MQTT broker").count(), 1);
}

#[test]
fn max_log_bytes_keeps_the_newest_part_and_says_what_was_dropped() {
    let (rig, node) = streaming(
        "cyberwave:\n  training: |\n    head -c 300000 /dev/zero | tr '\\0' 'x' | fold -w 99\n    while [ ! -f go ]; do sleep 0.05; done\n    echo LAST\n  max_log_bytes: 100000\n",
        "0.2",
    )
    .node();
    Start::training("cap").ok(&rig.cp, &node);
    let log = rig.state("workload_logs/training_cap.stdout.log");
    assert!(node.wait_log("over max_log_bytes", DONE), "{}", node.log());
    rig.touch("go");
    assert!(rig.cp.wait_status("wl-cap", "completed", DONE).is_some());
    let kept = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(kept.len() as u64 <= 100_000, "{} bytes kept", kept.len());
    assert!(kept.ends_with("LAST\n"), "the newest part is kept");
    let chunks: Vec<Value> = rig
        .cp
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
    let rig = streaming(
        "cyberwave:\n  training: sleep 20\n  log_retention_days: 7\n",
        "0.5",
    )
    .rig();
    let old = |rel: &str| {
        let p = rig.setup.plant(rel, "old\n");
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
    let fresh = rig
        .setup
        .plant("workload_logs/training_recent.stdout.log", "new\n");
    let mut node = rig.node();
    assert!(
        wait_for(REPLY, || (!stale_log.exists() && !stale_image.exists())
            .then_some(()))
        .is_some(),
        "old files pruned"
    );
    assert!(fresh.exists(), "recent logs kept");
    // A running workload's log is kept however old its timestamp looks.
    Start::training("run").ok(&rig.cp, &node);
    node.kill9();
    let running_log = rig.state("workload_logs/training_run.stdout.log");
    let ok = std::process::Command::new("touch")
        .args(["-d", "30 days ago"])
        .arg(&running_log)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok);
    let _node = rig.node();
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        running_log.exists(),
        "the running workload's log survives retention"
    );
}
