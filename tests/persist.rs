//! Persisted state read back (guarantee 8): a corrupted state dir — truncated, binary,
//! wrong-typed and enormous versions of every file the node reads at start — never stops the
//! node from starting; each bad file is quarantined and named in the log; workloads whose
//! records are bad are still reported; the node registers and answers `status`.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::support::node::NodeSetup;
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{Broker, ControlPlane, NodeProcess};

/// No process has this pid (pid_max is at most 2^22), so nothing is re-adopted or signalled.
const DEAD_PID: i64 = 2_147_483_000;

#[derive(Clone, Copy, Debug)]
enum Style {
    Truncated,
    Binary,
    WrongTyped,
    Enormous,
}

/// The files a corrupted state dir holds, and a valid sample of each (for truncation).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Identity,
    NodeId,
    Ledger,
    Outbox,
    Ingress,
    Meta,
    Started,
    Params,
    Exit,
    Cursor,
}

const KINDS: [Kind; 10] = [
    Kind::Identity,
    Kind::NodeId,
    Kind::Ledger,
    Kind::Outbox,
    Kind::Ingress,
    Kind::Meta,
    Kind::Started,
    Kind::Params,
    Kind::Exit,
    Kind::Cursor,
];

fn logs_dir(state: &Path) -> PathBuf {
    state.join("workload_logs")
}

fn meta(state: &Path, id: &str, wl: &str, max_runtime: f64) -> Value {
    json!({
        "safe_id": id, "kind": "inference", "request_id": format!("r-{id}"),
        "workload_uuid": wl, "created_unix": now(), "command": "true",
        "stdout_log": logs_dir(state).join(format!("inference_{id}.stdout.log")),
        "stderr_log": logs_dir(state).join(format!("inference_{id}.stderr.log")),
        "max_runtime_s": max_runtime, "phase": "starting", "event_token": "ab12"
    })
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn started() -> Value {
    json!({"pid": DEAD_PID, "start_ticks": 1, "shim_pid": DEAD_PID, "shim_start_ticks": 1,
           "boot_id": "", "started_at": "2026-11-30T00:00:00Z"})
}

fn sample(kind: Kind, state: &Path) -> Vec<u8> {
    let v = match kind {
        Kind::Identity => json!({"uuid": "u-old", "slug": "s-old"}),
        Kind::NodeId => return b"cloud_node_abcd1234".to_vec(),
        Kind::Ledger => json!({"rid": "r1", "at": 1.8e9, "ok": true, "body": {"pid": 5}}),
        Kind::Outbox | Kind::Ingress => {
            json!({"topic": "cyberwave/cloud-workload/wl-x/update-status", "body": {"a": 1}, "label": "l"})
        }
        Kind::Meta => meta(state, "wa", "wl-a", 60.0),
        Kind::Started => started(),
        Kind::Params => json!({"workload_uuid": "wl-a", "n": 1}),
        Kind::Exit => json!({"exit_code": 0, "started_at": "a", "ended_at": "b"}),
        Kind::Cursor => json!({"stdout": 0, "stderr": 0}),
    };
    v.to_string().into_bytes()
}

fn corrupt(style: Style, kind: Kind, state: &Path) -> Vec<u8> {
    let good = sample(kind, state);
    match style {
        Style::Truncated => good[..good.len() / 2].to_vec(),
        Style::Binary => {
            let mut b = vec![0u8, 0xff, 0xfe, 0x1b, b'[', b'2', b'J', 0x80, b'\n', 0xc3];
            b.extend(good.iter().rev());
            b
        }
        Style::WrongTyped => match kind {
            Kind::Identity => br#"{"uuid": 42, "slug": ["s"]}"#.to_vec(),
            Kind::NodeId => br#"{"id": 1}"#.to_vec(),
            Kind::Ledger => br#"{"rid": 5, "at": "yesterday", "ok": 1, "body": null}"#.to_vec(),
            Kind::Outbox | Kind::Ingress => br#"{"topic": 42, "body": "x", "label": []}"#.to_vec(),
            Kind::Meta => br#"{"kind": 5, "request_id": [], "created_unix": "now"}"#.to_vec(),
            Kind::Started => br#"{"pid": "1", "start_ticks": -1}"#.to_vec(),
            Kind::Params => br#"[1, 2, 3]"#.to_vec(),
            Kind::Exit => br#"{"exit_code": "0", "started_at": 1, "ended_at": null}"#.to_vec(),
            // Of the right type but out of range: an offset no log reaches.
            Kind::Cursor => br#"{"stdout": 18446744073709551615, "stderr": 0}"#.to_vec(),
        },
        Style::Enormous => {
            // Over the cap for its kind: 64 KiB for records, 4 MiB for entries and lines (and
            // params, whose cap is the command size limit, set to 4 MiB by `run`).
            let big = match kind {
                Kind::Ledger | Kind::Outbox | Kind::Ingress | Kind::Params => 5 << 20,
                _ => 100 << 10,
            };
            match kind {
                Kind::NodeId => format!("cloud_node_{}", "a".repeat(big)).into_bytes(),
                Kind::Ledger => vec![b'{'; big], // one line, no newline
                _ => {
                    let mut v: Value = serde_json::from_slice(&good).expect("sample");
                    v["padding"] = json!("x".repeat(big));
                    v.to_string().into_bytes()
                }
            }
        }
    }
}

/// Where each kind goes (workload `wa` has a bad record; `wb` a good one with bad exit and
/// cursor files).
fn path_of(kind: Kind, state: &Path) -> PathBuf {
    match kind {
        Kind::Identity => state.join("instance_identity.json"),
        Kind::NodeId => state.join("node_id"),
        Kind::Ledger => state.join("ledger.jsonl"),
        Kind::Outbox => state.join("outbox/00000000000000000001.json"),
        Kind::Ingress => state.join("ingress/00000000000000000002.json"),
        Kind::Meta => state.join("workloads/wa/meta.json"),
        Kind::Started => state.join("workloads/wa/started.json"),
        Kind::Params => state.join("workloads/wa/params.json"),
        Kind::Exit => state.join("workloads/wb/exit.json"),
        Kind::Cursor => state.join("workloads/wb/cursor.json"),
    }
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, bytes).expect("write");
}

fn run(style: Style) {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    // A params file is read back up to the command size limit in force: 4 MiB here, so the
    // enormous one (5 MiB) is over it.
    setup.set(
        "CYBERWAVE_NODE_MAX_COMMAND_BYTES",
        &(4u64 << 20).to_string(),
    );
    setup.write("cyberwave.yml", "cyberwave:\n  inference: echo hi\n");
    let state = setup.config_dir();
    for kind in KINDS {
        write(&path_of(kind, &state), &corrupt(style, kind, &state));
    }
    let wb = style_tag("wl-b", style);
    let wc = style_tag("wl-c", style);
    // `wb`: a valid record whose process is gone; its exit and cursor files are bad.
    write(
        &state.join("workloads/wb/meta.json"),
        meta(&state, "wb", &wb, 3600.0).to_string().as_bytes(),
    );
    write(
        &state.join("workloads/wb/started.json"),
        started().to_string().as_bytes(),
    );
    // `wc`: finding 1 of issue 11 — a max runtime of 1e19 s panicked every restart.
    write(
        &state.join("workloads/wc/meta.json"),
        meta(&state, "wc", &wc, 1e19).to_string().as_bytes(),
    );
    write(
        &state.join("workloads/wc/started.json"),
        started().to_string().as_bytes(),
    );
    write(
        &state.join("workloads/wc/params.json"),
        json!({"workload_uuid": wc}).to_string().as_bytes(),
    );
    // `wd`: a valid record whose start record (pid proof) is bad.
    let wd = style_tag("wl-d", style);
    write(
        &state.join("workloads/wd/meta.json"),
        meta(&state, "wd", &wd, 3600.0).to_string().as_bytes(),
    );
    write(
        &state.join("workloads/wd/started.json"),
        &corrupt(style, Kind::Started, &state),
    );
    // An outbox entry that parses but whose topic would break the MQTT connection (finding 3).
    write(
        &state.join("outbox/00000000000000000003.json"),
        json!({"topic": "cyberwave/cloud-workload/a/#/update-status", "body": {}, "label": "x"})
            .to_string()
            .as_bytes(),
    );

    let node: NodeProcess = setup.spawn();
    node.wait_ready(READY);
    let status = cp
        .status(&node.uuid(), "st-persist", REPLY)
        .unwrap_or_else(|| panic!("{style:?}: no status reply; log:\n{}", node.log()));
    assert_eq!(status["status"], "ok", "{style:?}: {status}");

    let log = node.log();
    let mut bad: Vec<PathBuf> = KINDS.iter().map(|k| path_of(*k, &state)).collect();
    bad.push(state.join("workloads/wc/meta.json"));
    bad.push(state.join("outbox/00000000000000000003.json"));
    bad.push(state.join("workloads/wd/started.json"));
    for p in &bad {
        assert!(
            log.contains(&format!("quarantined {}", p.display())),
            "{style:?}: {} is not named as quarantined; log:\n{log}",
            p.display()
        );
    }
    let kept = std::fs::read_dir(state.join("quarantine"))
        .map(|rd| rd.count())
        .unwrap_or(0);
    assert_eq!(kept, bad.len(), "{style:?}: every bad file kept aside");
    assert!(!log.contains("panicked"), "{style:?}: {log}");

    // The workloads are reported, not forgotten.
    for (wl, why) in [
        (&wb, "no exit status was recorded"),
        (&wc, "workload record was corrupt"),
        (&wd, "workload record was corrupt"),
    ] {
        let all = cp
            .wait_status(wl, "completed", DONE)
            .unwrap_or_else(|| panic!("{style:?}: no completion for {wl}; log:\n{}", node.log()));
        let done: Vec<&Value> = all.iter().filter(|b| b["status"] == "completed").collect();
        assert_eq!(done.len(), 1, "{style:?}: {all:?}");
        assert_eq!(done[0]["success"], false, "{style:?}: {all:?}");
        assert!(
            done[0]["error"].as_str().unwrap_or("").contains(why),
            "{style:?}: {all:?}"
        );
    }
    assert!(
        node.wait_log("no known workload uuid", REPLY),
        "{style:?}: wa is named in an ERROR line; log:\n{}",
        node.log()
    );
    // A second start finds a clean state dir: nothing more is quarantined, nothing reported twice.
    drop(node);
    let again = setup.spawn();
    again.wait_ready(READY);
    assert!(cp.status(&again.uuid(), "st-persist-2", REPLY).is_some());
    assert!(
        !again.log().contains("quarantined"),
        "{style:?}: {}",
        again.log()
    );
    let kept2 = std::fs::read_dir(state.join("quarantine"))
        .map(|rd| rd.count())
        .unwrap_or(0);
    assert_eq!(kept2, bad.len(), "{style:?}");
}

fn style_tag(base: &str, style: Style) -> String {
    format!("{base}-{}", format!("{style:?}").to_lowercase())
}

#[test]
fn g8_a_truncated_state_dir_is_quarantined_and_the_node_starts() {
    run(Style::Truncated);
}

#[test]
fn g8_a_binary_state_dir_is_quarantined_and_the_node_starts() {
    run(Style::Binary);
}

#[test]
fn g8_a_wrong_typed_state_dir_is_quarantined_and_the_node_starts() {
    run(Style::WrongTyped);
}

#[test]
fn g8_an_enormous_state_dir_is_quarantined_and_the_node_starts() {
    run(Style::Enormous);
}

#[test]
fn g8_files_where_directories_belong_and_directories_where_files_belong_never_stop_the_node() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write("cyberwave.yml", "cyberwave:\n  inference: echo hi\n");
    let state = setup.config_dir();
    let files = ["outbox", "ingress", "workloads"];
    let dirs = ["instance_identity.json", "node_id", "ledger.jsonl"];
    for f in files {
        write(&state.join(f), b"not a directory");
    }
    for d in dirs {
        std::fs::create_dir_all(state.join(d).join("inner")).expect("mkdir");
    }
    let node = setup.spawn();
    node.wait_ready(READY);
    assert!(
        cp.status(&node.uuid(), "st-shape", REPLY).is_some(),
        "no status reply; log:\n{}",
        node.log()
    );
    let log = node.log();
    for p in files.iter().chain(dirs.iter()) {
        assert!(
            log.contains(&format!("quarantined {}", state.join(p).display())),
            "{p} is not named as quarantined; log:\n{log}"
        );
    }
    assert!(state.join("outbox").is_dir() && state.join("workloads").is_dir());
    // The node works: a workload starts and completes.
    cp.command(
        &node.uuid(),
        json!({"command": "inference", "request_id": "after-shape", "params": {"workload_uuid": "wl-shape"}}),
    );
    let r = cp.wait_reply("after-shape", REPLY).expect("reply");
    assert_eq!(r["status"], "ok", "{r}; log:\n{}", node.log());
    assert!(cp.wait_status("wl-shape", "completed", DONE).is_some());
}
