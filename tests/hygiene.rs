//! Log hygiene (D31) and bounds (D32) end to end: outside text cannot forge or corrupt the node's
//! own log, the control socket cannot be used to exhaust threads, and a workload's endless line
//! cannot exhaust memory.

use std::time::Duration;

use serde_json::json;

use crate::support::rig;
use crate::support::timeouts::{DONE, READY, REPLY};

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
fn g8_idle_control_connections_cannot_exhaust_threads_or_lock_out_status() {
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
    let (_b, cp, mut setup) = rig(
        "cyberwave:\n  training: |\n    cat endless.txt\n    while [ ! -f go ]; do sleep 0.05; done\n",
    );
    setup.set("CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL", "0.05");
    // Every piece is mirrored here: the console's budget (D69) is lifted for this test.
    setup.set("CYBERWAVE_NODE_MIRROR_BYTES_PER_SECOND", "1000000000");
    let data = endless_line(LEN);
    std::fs::write(setup.cwd.join("endless.txt"), &data).expect("write data");
    let node = setup.spawn();
    node.wait_ready(READY);
    let idle_hwm = proc_status(node.pid(), "VmHWM:");
    cp.command(
        &node.uuid(),
        json!({"command": "training", "request_id": "endless", "params": {"workload_uuid": "wl-endless"}}),
    );
    let shipped_while_running = crate::support::wait_for(Duration::from_secs(240), || {
        let n: u64 = cp
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
    std::fs::write(setup.cwd.join("go"), "").expect("go");
    assert!(
        cp.wait_status("wl-endless", "completed", Duration::from_secs(240))
            .is_some(),
        "{}",
        node.log()
    );
    let hwm = proc_status(node.pid(), "VmHWM:");
    // What the backend got: every byte, in order, in pieces of at most 512 KiB (a log chunk).
    let mut chunks: Vec<(u64, String)> = cp
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
fn wait_for_len(node: &crate::support::NodeProcess, len: usize) -> String {
    let end = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let out = node.stdout();
        if out.len() >= len || std::time::Instant::now() >= end {
            return out;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_carriage_return_in_workload_output_cannot_hide_the_mirror_tag() {
    let (_b, cp, setup) = rig("cyberwave:\n  training: printf '10%%\\rFORGED LINE\\r\\nlast'\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    cp.command(
        &node.uuid(),
        json!({"command": "training", "request_id": "cr", "params": {"workload_uuid": "wl-cr"}}),
    );
    assert!(cp.wait_status("wl-cr", "completed", DONE).is_some());
    let tag = "[workload wl-cr stdout] ";
    // D69: a redraw is a line of its own, ended as any other.
    let want = format!("{tag}10%\n{tag}FORGED LINE\n{tag}last\n");
    assert!(node.wait_stdout(&want, REPLY), "{:?}", node.stdout());
}

#[test]
fn g8_a_result_file_name_cannot_forge_a_node_log_line() {
    let (_b, cp, setup) = rig(
        "cyberwave:\n  training: mkdir -p out && printf x > \"out/$(printf 'f\\n2026-11-30T00:00:00Z ERROR FORGED\\033[31m')\"\n  results_folder: out\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    cp.command(
        &node.uuid(),
        json!({"command": "training", "request_id": "files", "params": {"workload_uuid": "wl-files"}}),
    );
    assert!(
        cp.wait_status("wl-files", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    assert!(
        node.wait_log("result upload finished", REPLY),
        "{}",
        node.log()
    );
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
/// before `main` (the node passed this as it was): a guard, should a build or a runtime ever
/// not.
#[test]
fn a_node_started_with_its_standard_streams_closed_writes_its_output_nowhere_it_should_not() {
    let (_broker, cp, mut setup) = crate::support::rig(
        "cyberwave:\n  inference: |\n    for i in $(seq 50); do echo out-line-$i; echo err-line-$i >&2; done\n",
    );
    setup.under = vec![
        "sh".into(),
        "-c".into(),
        "exec \"$0\" \"$@\" <&- >&- 2>&-".into(),
    ];
    let node = setup.spawn();
    let uuid = crate::support::wait_for(crate::support::timeouts::READY, || {
        let u = node.uuid();
        (!u.is_empty()).then_some(u)
    })
    .expect("the node registered");
    let st = crate::support::wait_for(crate::support::timeouts::READY, || {
        // Short: the first may go out before the node subscribed (no log line to wait for).
        cp.status(&uuid, "st-closed", std::time::Duration::from_millis(300))
    })
    .expect("status answered");
    assert_eq!(st["status"], "ok", "{st}");
    // Descriptors 0–2 of the node are /dev/null.
    for fd in 0..3 {
        let target = std::fs::read_link(format!("/proc/{}/fd/{fd}", node.pid()))
            .unwrap_or_else(|e| panic!("fd {fd} of the node: {e}"));
        assert_eq!(target, std::path::Path::new("/dev/null"), "fd {fd}");
    }
    cp.command(
        &uuid,
        serde_json::json!({"command": "inference", "request_id": "cl1", "params": {"workload_uuid": "wl-cl1"}}),
    );
    cp.wait_status("wl-cl1", "completed", crate::support::timeouts::DONE)
        .expect("the workload completed");
    // Nothing of the log or of the mirrored output went into a state file.
    let mut stack = vec![setup.config_dir()];
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
    use crate::support::node::NodeSetup;
    use crate::support::scenario::Start;
    use crate::support::{Broker, ControlPlane};
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  training: echo model > \"$CYBERWAVE_RESULTS_DIR/model.bin\"\n  results_folder: out\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let w = Start::training("dump");
    w.ok(&cp, &node);
    assert!(
        cp.wait_status("wl-dump", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    assert_eq!(cp.uploads().len(), 1, "the result went up over HTTP");
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
