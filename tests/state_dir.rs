//! The state dir: one node per state dir, owned by its user and by nobody else (D30,
//! guarantee 12); a copy of it on another host is named as a duplicate client id (guarantee 11);
//! a corrupted one (truncated, binary, wrong-typed, enormous or wrongly shaped versions of every
//! file the node reads at start) never stops the node: each bad file is quarantined and named in
//! the log, workloads whose records are bad are still reported (guarantee 8).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::scenario::error_of;
use crate::support::timeouts::{DONE, EXIT, REPLY};
use crate::support::{wait_for, Rig, Scenario, Start};

#[test]
fn g12_a_second_node_on_the_same_state_dir_exits_1_naming_the_first() {
    let (rig, first) = Scenario::new("cyberwave:\n  inference: echo hi\n").node();
    let Rig { cp, setup, .. } = &rig;
    let mut second = setup.spawn();
    second.assert_exit(1, EXIT);
    assert!(
        second
            .log()
            .contains(&format!("another node (pid {})", first.pid())),
        "{}",
        second.log()
    );
    // The first one is untouched: it still owns its control socket and answers.
    let out = setup.run(&["status", "--json"]);
    assert!(out.stdout.contains(&format!("{}", first.pid())), "{out:?}");
    assert!(cp.status(&first.uuid(), "still-first", EXIT).is_some());
}

#[test]
fn g12_a_state_dir_writable_by_others_is_refused_and_left_as_it_is() {
    let rig = Scenario::new("cyberwave:\n  inference: echo hi\n").rig();
    let Rig { setup, .. } = &rig;
    let dir = setup.config_dir();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut node = setup.spawn();
    node.assert_exit(2, EXIT);
    assert!(
        node.log().contains("chmod 700"),
        "names the fix: {}",
        node.log()
    );
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o777, "the node never changes a dir it refused");
    assert!(!dir.join("lock").exists(), "nothing written into it");
}

#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g12_a_root_node_refuses_a_state_dir_owned_by_another_user() {
    crate::support::assert_root("to hand the state dir to another user");
    let rig = Scenario::new("cyberwave:\n  inference: echo hi\n").rig();
    let Rig { setup, .. } = &rig;
    let dir = setup.config_dir();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    // A planted link that a careless root node would follow.
    let victim = setup.home.join("victim");
    std::fs::write(&victim, "root's file\n").unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("lock")).unwrap();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    let mut node = setup.spawn();
    node.assert_exit(2, EXIT);
    node.assert_logged("owned by uid 65534");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "root's file\n");
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
}

/// D30: a state dir the operator must fix exits 2 naming the path ("not a directory (or not a
/// regular lock file)"); only a lock held by another node exits 1. A `lock` that is a directory
/// (a careless `mkdir -p ~/.cyberwave/lock`) is an operator's mistake like a `lock` that is a
/// FIFO: exit 2, not the exit code of "another node runs".
#[test]
fn g12_d30_a_lock_that_is_a_directory_exits_2_like_a_lock_that_is_a_fifo() {
    let rig = Scenario::new("cyberwave:\n  inference: echo hi\n").rig();
    let Rig { setup, .. } = &rig;
    let dir = setup.config_dir();
    std::fs::create_dir_all(dir.join("lock")).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let mut node = setup.spawn();
    node.assert_exit(2, EXIT);
    node.assert_logged("not a regular lock file");
}

#[test]
fn g11_a_copied_state_dir_is_named_as_a_duplicate_client_id_and_doctor_fails() {
    let (rig, first) = Scenario::new("cyberwave:\n  inference: echo hi\n").node();
    let Rig { setup, .. } = &rig;
    let copy = rig.another_node();
    copy.write("cyberwave.yml", "cyberwave:\n  inference: echo hi\n");
    copy.plant(
        "node_id",
        std::fs::read(setup.config_dir().join("node_id")).unwrap(),
    );
    let second = copy.spawn();
    let said = wait_for(Duration::from_secs(20), || {
        [&first, &second]
            .into_iter()
            .find(|n| {
                n.log()
                    .contains("another client uses this node's MQTT client id")
            })
            .map(|n| n.pid())
    });
    assert!(
        said.is_some(),
        "first:\n{}\nsecond:\n{}",
        first.log(),
        second.log()
    );
    let which = if said == Some(first.pid()) {
        setup
    } else {
        &copy
    };
    let doctor = which.run(&["doctor"]);
    doctor.assert_stdout("FAIL  MQTT client id");
    // They do not take the session from each other several times a second.
    let takeovers = |n: &crate::support::NodeProcess| n.log().matches("reason 0x8E").count();
    let before = takeovers(&first) + takeovers(&second);
    // (The 30 s wait itself is unit-tested with a fake clock in node::session.)
    std::thread::sleep(Duration::from_millis(1500));
    let after = takeovers(&first) + takeovers(&second);
    assert!(after - before <= 2, "{before} → {after} takeovers in 1.5 s");
}

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
    let rig = Scenario::new("cyberwave:\n  inference: echo hi\n")
        // A params file is read back up to the command size limit in force: 4 MiB here, so the
        // enormous one (5 MiB) is over it.
        .env(
            "CYBERWAVE_NODE_MAX_COMMAND_BYTES",
            &(4u64 << 20).to_string(),
        )
        .rig();
    let state = rig.setup.config_dir();
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
    // `wc`: a max runtime of 1e19 s, which once panicked every restart.
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
    // An outbox entry that parses but whose topic would break the MQTT connection.
    write(
        &state.join("outbox/00000000000000000003.json"),
        json!({"topic": "cyberwave/cloud-workload/a/#/update-status", "body": {}, "label": "x"})
            .to_string()
            .as_bytes(),
    );

    let node = rig.node();
    let status = rig
        .cp
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
        let all = rig
            .cp
            .wait_status(wl, "completed", DONE)
            .unwrap_or_else(|| panic!("{style:?}: no completion for {wl}; log:\n{}", node.log()));
        let done: Vec<&Value> = all.iter().filter(|b| b["status"] == "completed").collect();
        assert_eq!(done.len(), 1, "{style:?}: {all:?}");
        assert_eq!(done[0]["success"], false, "{style:?}: {all:?}");
        assert!(error_of(done[0]).contains(why), "{style:?}: {all:?}");
    }
    assert!(
        node.wait_log("no known workload uuid", REPLY),
        "{style:?}: wa is named in an ERROR line; log:\n{}",
        node.log()
    );
    // A second start finds a clean state dir: nothing more is quarantined, nothing reported twice.
    drop(node);
    let again = rig.node();
    assert!(rig
        .cp
        .status(&again.uuid(), "st-persist-2", REPLY)
        .is_some());
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
    let rig = Scenario::new("cyberwave:\n  inference: echo hi\n").rig();
    let state = rig.setup.config_dir();
    let files = ["outbox", "ingress", "workloads"];
    let dirs = ["instance_identity.json", "node_id", "ledger.jsonl"];
    for f in files {
        write(&state.join(f), b"not a directory");
    }
    for d in dirs {
        std::fs::create_dir_all(state.join(d).join("inner")).expect("mkdir");
    }
    let node = rig.node();
    assert!(
        rig.cp.status(&node.uuid(), "st-shape", REPLY).is_some(),
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
    let w = Start::new("inference", "after-shape").workload("wl-shape");
    w.ok(&rig.cp, &node);
    w.completion(&rig.cp);
}
