//! Attacks on this session's changes (hostile backend, hostile workload, careless operator).
//! Every test here FAILED on main at 37df9d2 when it was written: each is a finding, named
//! after the decision or guarantee it breaks. The node's code was not changed on this branch.

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::node::NodeSetup;
use crate::support::scenario::uploaded;
use crate::support::timeouts::{DONE, EXIT, READY, REPLY};
use crate::support::{rig, wait_for, ControlPlane, NodeProcess};

fn command(cp: &ControlPlane, node: &NodeProcess, body: Value) -> Value {
    let rid = match &body["request_id"] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    cp.command(&node.uuid(), body);
    cp.wait_reply(&rid, REPLY)
        .unwrap_or_else(|| panic!("no reply to {rid}; log:\n{}", node.log()))
}

fn ran(setup: &NodeSetup) -> usize {
    std::fs::read_dir(setup.cwd.join("ran"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Exists and is not a zombie.
fn alive(pid: i32) -> bool {
    // Bytes: a process may name itself in bytes that are not UTF-8.
    let Ok(stat) = std::fs::read(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let stat = String::from_utf8_lossy(&stat);
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, r)| r.split_whitespace().next().map(String::from))
        .unwrap_or_default();
    // A zombie whose other threads still run (its main thread ended by the raw `exit`) runs.
    let threads =
        || std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |rd| rd.take(2).count());
    match state.as_str() {
        "X" => false,
        "Z" => threads() > 1,
        _ => true,
    }
}

/// The FNV-1a 32 hash `store::safe_id` appends to an id it changed.
fn fnv1a32(data: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in data {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// D7: "two ids never share files". The id `x/y` maps to `x_y-<hash of x/y>`; the id that IS
/// that text is already safe and maps to itself. So the backend (or anyone who can send a
/// command) picks a request id that collides with a running workload's: the node answers the
/// second start with the FIRST workload's output (`ok`, its pid, `workload_request_id: x/y`)
/// and never runs the second workload — and, were the first gone, both would share
/// `workloads/<safe id>/` and `<results_folder>/<safe id>/`.
#[test]
fn g1_d7_a_request_id_equal_to_another_ids_safe_id_gets_its_own_workload() {
    let (_b, cp, setup) = rig(
        "cyberwave:\n  training: |\n    mkdir -p ran && touch \"ran/$$\"\n    while [ ! -f release ]; do sleep 0.05; done\ncloud_node:\n  max_concurrent_workloads: 2\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let first = "x/y";
    let second = format!("x_y-{:08x}", fnv1a32(first.as_bytes()));
    let a = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": first, "params": {"workload_uuid": "wl-a"}}),
    );
    assert_eq!(a["status"], "ok", "{a}");
    let b = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": second, "params": {"workload_uuid": "wl-b"}}),
    );
    std::fs::write(setup.cwd.join("release"), "").unwrap();
    assert_eq!(b["status"], "ok", "{b}");
    assert_eq!(
        b["output"]["workload_request_id"], second,
        "the second start was answered with another workload's output: {b}"
    );
    assert!(
        wait_for(REPLY, || (ran(&setup) == 2).then_some(())).is_some(),
        "the second workload never ran ({} ran); log:\n{}",
        ran(&setup),
        node.log()
    );
}

/// docs/workloads.md, "Nothing is left behind" (under Supervision) / D25 with
/// `cloud_node.services: stop` (D59: the strict rule): a workload that starts a child in a
/// session of its own (`setsid`, as daemonising tools do) leaves that child running after the
/// node reported the workload as completed. The supervisor is a subreaper and sees the child
/// re-parented to it, yet cleared only the process group. (With `services: keep`, the default,
/// such a child is a service and outlives the workload: tests/services.rs.)
#[test]
fn g9_d25_a_child_that_setsids_out_of_the_group_does_not_outlive_the_report() {
    assert_left_behind_is_ended(
        "cloud_node:\n  services: stop\ncyberwave:\n  training: |\n    setsid sh -c 'echo $$ > escaped.pid; exec sleep 300' </dev/null >/dev/null 2>&1 &\n    while [ ! -s escaped.pid ]; do sleep 0.05; done\n",
        "esc",
        "escaped.pid",
        "started by the workload with setsid",
    );
}

/// D25 (with `services: stop`), hidden from /proc readers: a child that leaves the session
/// (`setsid`) and names itself with bytes that are not UTF-8 (`prctl(PR_SET_NAME)`), so that its
/// `/proc/<pid>/stat` is not text. The supervisor's search for what is left must still find it.
#[test]
fn g9_d25_a_child_that_setsids_and_names_itself_in_bytes_that_are_not_utf8_does_not_outlive_the_report(
) {
    assert_left_behind_is_ended(
        "cloud_node:\n  services: stop\ncyberwave:\n  training: |\n    setsid python3 -c 'import ctypes, os, time; ctypes.CDLL(None).prctl(15, b\"\\xff\\xfe)x\", 0, 0, 0); open(\"named.pid\", \"w\").write(str(os.getpid())); time.sleep(300)' </dev/null >/dev/null 2>&1 &\n    while [ ! -s named.pid ]; do sleep 0.05; done\n",
        "named",
        "named.pid",
        "started by the workload with setsid, named in bytes that are not UTF-8",
    );
}

/// D25, hidden as a zombie: a child whose main thread ends by the raw `exit` system call while
/// another thread of it runs on. Its `/proc/<pid>/stat` says `Z`, so it passed for gone; the
/// kernel tells its parent nothing until that thread ends.
#[test]
fn g9_d25_a_child_that_looks_like_a_zombie_while_a_thread_of_it_runs_does_not_outlive_the_report() {
    assert_left_behind_is_ended(
        "cyberwave:\n  training: |\n    python3 -c 'import ctypes, os, threading, time; threading.Thread(target=time.sleep, args=(300,)).start(); open(\"zombie.pid\", \"w\").write(str(os.getpid())); ctypes.CDLL(None).syscall({\"x86_64\": 60, \"aarch64\": 93}[os.uname().machine], 0)' </dev/null >/dev/null 2>&1 &\n    while [ ! -s zombie.pid ]; do sleep 0.05; done\n    sleep 0.2\n",
        "zombie",
        "zombie.pid",
        "a child of the workload whose main thread ended while another runs",
    );
}

/// D25 (with `services: stop`), one step behind the kill: a background job in a group of its
/// own that ignores SIGTERM has a child that left the session (`setsid`), so the first look finds
/// only the job; the child is re-parented to the supervisor only when the job dies of the
/// SIGKILL. Each look after that kills what it finds.
#[test]
fn g9_d25_a_child_that_turns_up_only_when_its_parent_is_killed_does_not_outlive_the_report() {
    let manifest = "cloud_node:\n  services: stop\ncyberwave:\n  training: |\n    set -m\n    ( trap '' TERM; setsid sh -c 'echo $$ > hidden.pid; exec sleep 300' </dev/null >/dev/null 2>&1 & while :; do sleep 0.05; done ) </dev/null >/dev/null 2>&1 &\n    while [ ! -s hidden.pid ]; do sleep 0.05; done\n";
    assert_left_behind_is_ended_with(
        manifest,
        "hidden",
        "hidden.pid",
        "re-parented to the supervisor only once its parent was killed",
        &[("CYBERWAVE_NODE_CLEANUP_GRACE_SECONDS", "0.3")],
    );
}

/// Runs a training workload that leaves a process behind (its pid in `pid_file`), waits for
/// its completion, and asserts that process is gone (killing it if not, so nothing leaks).
fn assert_left_behind_is_ended(manifest: &str, rid: &str, pid_file: &str, what: &str) {
    assert_left_behind_is_ended_with(manifest, rid, pid_file, what, &[]);
}

/// [`assert_left_behind_is_ended`] with these node settings.
fn assert_left_behind_is_ended_with(
    manifest: &str,
    rid: &str,
    pid_file: &str,
    what: &str,
    settings: &[(&str, &str)],
) {
    let (_b, cp, mut setup) = rig(manifest);
    for (k, v) in settings {
        setup.set(k, v);
    }
    let node = setup.spawn();
    node.wait_ready(READY);
    let wl = format!("wl-{rid}");
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": rid, "params": {"workload_uuid": wl}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    assert!(
        cp.wait_status(&wl, "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    let pid: i32 = std::fs::read_to_string(setup.cwd.join(pid_file))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let still = alive(pid);
    if still {
        // SAFETY: the test's own leftover process.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
    assert!(
        !still,
        "pid {pid}, {what}, outlived the workload's completion"
    );
    // D59: nothing is cleared silently: the log names it, with its command line.
    assert!(
        node.wait_log(&format!("cleared pid {pid} ("), REPLY),
        "pid {pid}, {what}, cleared without a word: {}",
        node.log()
    );
}

/// D33 false accusation: a broker that restarts three times within a minute (a crash loop, a
/// rolling update of a broker cluster) closes connections "right after accepting them". The
/// node then logs an ERROR that another host runs a copy of its state dir, tells the operator
/// to delete its identity, writes the `client_id_conflict` marker (so `doctor` FAILs) and waits
/// 30 s — though no other client ever used its id (no 0x8E was sent).
#[test]
fn g11_d33_a_broker_restart_loop_is_not_reported_as_a_duplicate_client_id() {
    let (mut broker, cp, setup) = rig("cyberwave:\n  training: sleep 1\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    const ACCUSED: &str = "another client uses this node's MQTT client id";
    // The n-th connection, or the accusation (after which the node waits 30 s to reconnect).
    let connects = |n: usize| {
        wait_for(Duration::from_secs(10), || {
            let log = node.log();
            (log.matches("connected to MQTT broker").count() >= n || log.contains(ACCUSED))
                .then_some(())
        })
        .is_some()
    };
    assert!(connects(1), "{}", node.log());
    for i in 2..=4 {
        broker.restart();
        assert!(connects(i), "reconnect {i}; log:\n{}", node.log());
    }
    assert!(
        !node.log().contains(ACCUSED),
        "a broker restart loop was reported as a copied state dir:\n{}",
        node.log()
    );
    assert!(
        !setup.config_dir().join("client_id_conflict").exists(),
        "doctor would FAIL on a duplicate client id that does not exist"
    );
    // It still serves once it is back. A command published before the node (or the fake
    // backend's own client) is subscribed again is lost with the restarted broker's sessions:
    // ask until one is answered.
    let mut n = 0;
    let answered = wait_for(Duration::from_secs(10), || {
        n += 1;
        cp.status(
            &node.uuid(),
            &format!("after-restarts-{n}"),
            Duration::from_secs(2),
        )
    });
    assert!(
        answered.is_some(),
        "no status reply within 10 s after the broker came back:\n{}",
        node.log()
    );
}

/// D30: a state dir the operator must fix exits 2 naming the path ("not a directory (or not a
/// regular lock file)"); only a lock held by another node exits 1. A `lock` that is a directory
/// (a careless `mkdir -p ~/.cyberwave/lock`) is an operator's mistake like a `lock` that is a
/// FIFO, yet it exits 1 with a bare "Is a directory" — the exit code of "another node runs".
#[test]
fn g12_d30_a_lock_that_is_a_directory_exits_2_like_a_lock_that_is_a_fifo() {
    let (_broker, _cp, setup) = rig("cyberwave:\n  inference: echo hi\n");
    let dir = setup.config_dir();
    std::fs::create_dir_all(dir.join("lock")).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let mut node = setup.spawn();
    assert_eq!(node.wait_exit(EXIT), Some(Some(2)), "{}", node.log());
    assert!(
        node.log().contains("not a regular lock file"),
        "{}",
        node.log()
    );
}

/// D24: "only that folder is uploaded and cleaned for it". A result file that workload A left
/// in its own folder (skipped by max_result_bytes) is uploaded as workload B's result
/// (`<A's safe id>/b.txt`) and deleted, with capacity 1: the "loose files" rule takes every
/// file below `results_folder`, other (finished) workloads' folders included.
#[test]
fn g10_d24_a_file_left_in_a_finished_workloads_folder_is_not_uploaded_as_the_next_ones() {
    let (_broker, cp, setup) = rig(
        "cyberwave:\n  training: |\n    if [ \"$CYBERWAVE_REQUEST_ID\" = ra ]; then head -c 100 /dev/zero > \"$CYBERWAVE_RESULTS_DIR/a.bin\"; head -c 60 /dev/zero > \"$CYBERWAVE_RESULTS_DIR/b.txt\"; fi\n  results_folder: out\ncloud_node:\n  max_result_bytes: 150\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    for id in ["ra", "rb"] {
        let wl = format!("wl-{id}");
        let r = command(
            &cp,
            &node,
            json!({"command": "training", "request_id": id, "params": {"workload_uuid": wl}}),
        );
        assert_eq!(r["status"], "ok", "{r}");
        assert!(
            cp.wait_status(&wl, "completed", DONE).is_some(),
            "{}",
            node.log()
        );
    }
    assert_eq!(uploaded(&cp, "wl-ra"), vec!["a.bin"], "{}", node.log());
    assert!(
        uploaded(&cp, "wl-rb").is_empty(),
        "B wrote nothing, yet uploaded {:?}",
        uploaded(&cp, "wl-rb")
    );
    assert!(
        setup.cwd.join("out/ra/b.txt").exists(),
        "A's skipped result was deleted by B's upload"
    );
}

/// D25, without leaving the session: a workload script with job control on (`set -m`, or
/// Python's `subprocess.Popen(..., process_group=0)`) puts its background job in a process
/// group of its own — still in the supervisor's session, so the supervisor could find it.
/// It survives the workload's completion: only the workload's first group is cleared.
#[test]
fn g9_d25_a_background_job_in_its_own_process_group_does_not_outlive_the_report() {
    assert_left_behind_is_ended(
        "cyberwave:\n  training: bash -c 'set -m; sleep 300 </dev/null >/dev/null 2>&1 & echo $! > bg.pid'\n",
        "pg",
        "bg.pid",
        "a background job of the workload in its own process group",
    );
}

/// D34 meets D33: an outbox entry that the broker refuses by closing the connection (here a
/// topic of 251 levels: valid for the node, over mosquitto's limit of 200 levels) makes every
/// connection short. The third one, well before the fifth refusal sets the entry aside, is
/// taken as "another client uses this node's MQTT client id": a false ERROR telling the
/// operator to delete the node's identity, `doctor` FAILs, and 30 s pauses between attempts
/// delay the quarantine D34 promises.
#[test]
fn g11_d34_an_outbox_entry_the_broker_refuses_is_not_reported_as_a_duplicate_client_id() {
    let (_broker, _cp, setup) = rig("cyberwave:\n  training: sleep 1\n");
    let dir = setup.config_dir();
    std::fs::create_dir_all(dir.join("outbox")).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let topic = vec!["a"; 251].join("/");
    std::fs::write(
        dir.join("outbox/00000000000000000001.json"),
        json!({"topic": topic, "body": {"x": 1}, "label": "deep topic"}).to_string(),
    )
    .unwrap();
    let node = setup.spawn();
    const ACCUSED: &str = "another client uses this node's MQTT client id";
    let outcome = wait_for(Duration::from_secs(90), || {
        let log = node.log();
        if log.contains(ACCUSED) {
            Some("accused")
        } else if log.contains("deep topic") && log.contains("ERROR") {
            Some("set aside")
        } else {
            None
        }
    });
    assert_eq!(
        outcome,
        Some("set aside"),
        "the refused entry was not set aside (D34) without a false duplicate-client-id ERROR:\n{}",
        node.log()
    );
    assert!(!dir.join("client_id_conflict").exists());
    // With the entry set aside the node comes up and serves.
    node.wait_ready(READY);
}

/// D24 / "nothing outside is written because of a request": a workload that replaces its own
/// results folder with a symlink to another folder (`rmdir $CYBERWAVE_RESULTS_DIR; ln -s …`)
/// is not uploaded (good), but the node's cleanup (`remove_empty_dirs`) follows the link and
/// deletes every empty folder below the link's target, outside the results folder.
#[test]
fn g5_d24_cleanup_does_not_follow_a_results_folder_replaced_by_a_symlink() {
    let (_broker, cp, setup) = rig(
        "cyberwave:\n  training: rmdir \"$CYBERWAVE_RESULTS_DIR\" && ln -s \"$PWD/keep\" \"$CYBERWAVE_RESULTS_DIR\"\n  results_folder: out\n",
    );
    let keep = setup.cwd.join("keep/empty/deeper");
    std::fs::create_dir_all(&keep).unwrap();
    let node = setup.spawn();
    node.wait_ready(READY);
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "ln", "params": {"workload_uuid": "wl-ln"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    assert!(
        cp.wait_status("wl-ln", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    assert!(
        keep.exists(),
        "the node deleted {} (outside the results folder) through a symlink the workload planted",
        keep.display()
    );
}

/// D34 "never retried forever": after the refused entry is set aside, the node must come up.
/// It does not: the QoS 1 PUBLISH stays in the MQTT session (paho resends unacknowledged
/// messages when the session is resumed), so every reconnect — "session resumed" — sends it
/// again and the broker drops the connection again, ~10 times a second (the reconnect backoff
/// restarts at attempt 0 after each short connection), pausing only for the false D33 waits.
/// The node never registers; only deleting the broker's session (or a restart) ends it.
#[test]
fn g11_d34_a_set_aside_outbox_entry_is_not_resent_by_the_resumed_session() {
    let (_broker, _cp, setup) = rig("cyberwave:\n  training: sleep 1\n");
    let dir = setup.config_dir();
    std::fs::create_dir_all(dir.join("outbox")).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let topic = vec!["a"; 251].join("/");
    std::fs::write(
        dir.join("outbox/00000000000000000001.json"),
        json!({"topic": topic, "body": {"x": 1}, "label": "deep topic"}).to_string(),
    )
    .unwrap();
    let node = setup.spawn();
    assert!(
        // Set aside as soon as it is read (too deep a topic), or after the broker refused it.
        node.wait_log("set aside in", Duration::from_secs(150)),
        "never set aside:\n{}",
        node.log()
    );
    let aside = node.log().len();
    // Ready after the entry was set aside, or already before it (a connection that outlived
    // the refusal): either way the node must be up. Both are looked at on every poll.
    let ready = wait_for(Duration::from_secs(30), || {
        node.log().contains("node ready").then_some(())
    })
    .is_some();
    assert!(
        ready,
        "the node did not come up after the entry was set aside ({} connections so far):\n{}",
        node.log().matches("connected to MQTT broker").count(),
        node.log()
            .get(aside..)
            .unwrap_or("")
            .chars()
            .take(6000)
            .collect::<String>()
    );
}

/// D40 / "secrets never reach an unintended party": a `multipart` attachment reply whose URL is
/// not on the platform's API host (another origin: here another port; in the field a storage
/// host, or whatever a proxied or compromised reply names) gets the node's API token in its
/// `Authorization` header. The token should go only to the API base URL's origin.
#[test]
fn g7_d40_the_api_token_is_not_sent_to_a_multipart_url_off_the_api_host() {
    use std::io::{Read, Write};
    let foreign = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = foreign.local_addr().unwrap().port();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let seen2 = seen.clone();
    std::thread::spawn(move || {
        for s in foreign.incoming().flatten() {
            let mut s = s;
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let mut buf = vec![0u8; 64 * 1024];
            let mut head = Vec::new();
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 {
                    break;
                }
                head.extend_from_slice(&buf[..n]);
                if head.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            seen2
                .lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&head));
            let _ =
                s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    let (_broker, cp, setup) = rig(
        "cyberwave:\n  training: echo r > \"$CYBERWAVE_RESULTS_DIR/r.txt\"\n  results_folder: out\n",
    );
    cp.set_behaviour(|b| {
        b.upload_methods
            .insert("r.txt".to_string(), json!("multipart"));
        b.multipart_url = Some(format!("http://127.0.0.1:{port}/collect"));
    });
    let node = setup.spawn();
    node.wait_ready(READY);
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "tk", "params": {"workload_uuid": "wl-tk"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    assert!(
        wait_for(DONE, || (!seen.lock().unwrap().is_empty()).then_some(())).is_some(),
        "the foreign URL was never called:\n{}",
        node.log()
    );
    let got = seen.lock().unwrap().clone();
    assert!(
        !got.contains(crate::support::node::TOKEN),
        "the API token went to http://127.0.0.1:{port} (not the API host):\n{got}"
    );
}

/// Careless operator: `results_folder: .` (or `~`, or the folder the code lives in). With
/// capacity 1 every regular file below `results_folder` counts as the workload's result, so the
/// first workload uploads the operator's own files — the manifest, scripts, anything below the
/// working dir — and then deletes them. A results folder that holds the manifest should be
/// refused (or its pre-existing files left alone).
#[test]
fn g5_d24_a_results_folder_holding_the_manifest_does_not_upload_and_delete_it() {
    let (_broker, cp, setup) = rig("cyberwave:\n  training: echo done\n  results_folder: .\n");
    let precious = setup.write("train.py", "print('my code')\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "dot", "params": {"workload_uuid": "wl-dot"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    assert!(
        cp.wait_status("wl-dot", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    let up: Vec<String> = cp.uploads().keys().cloned().collect();
    assert!(
        precious.exists() && setup.cwd.join("cyberwave.yml").exists(),
        "the operator's files were deleted after upload (uploaded: {up:?})"
    );
    assert!(up.is_empty(), "the operator's files were uploaded: {up:?}");
}

/// D29 "Cancel of a workload that already exited: reply ok with `already finished`". That holds
/// only while the node still tracks the workload. A cancel that crosses the completion on the
/// wire (the backend sends it just after the node reported and forgot the workload) gets an
/// ERROR "No active workload found with request_id …" — though the node's ledger still knows
/// that request id ran here and finished.
#[test]
fn g9_d29_a_cancel_just_after_the_completion_was_acknowledged_answers_already_finished() {
    let (_broker, cp, setup) = rig("cyberwave:\n  training: echo hi\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "fin", "params": {"workload_uuid": "wl-fin"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    assert!(
        cp.wait_status("wl-fin", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    // The completion was acknowledged: the node forgot the workload.
    let record = setup.config_dir().join("workloads/fin");
    assert!(
        wait_for(REPLY, || (!record.exists()).then_some(())).is_some(),
        "record kept"
    );
    let c = command(
        &cp,
        &node,
        json!({"command": "cancel", "request_id": "fin-c", "params": {"workload_request_id": "fin"}}),
    );
    assert_eq!(c["status"], "ok", "{c}");
    assert!(c.to_string().contains("already finished"), "{c}");
}

// ---- a broker that refuses a publish must not silence the node (D34) -----------------------

const ACCUSED: &str = "another client uses this node's MQTT client id";

/// Writes `entry` as queue entry `seq` of `queue` (`outbox` or `ingress`) in the node's state
/// dir before it starts.
fn plant(setup: &NodeSetup, queue: &str, seq: u64, entry: Value) {
    let dir = setup.config_dir();
    std::fs::create_dir_all(dir.join(queue)).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    std::fs::write(
        dir.join(format!("{queue}/{seq:020}.json")),
        entry.to_string(),
    )
    .unwrap();
}

/// Files in the node's quarantine folder.
fn set_aside(setup: &NodeSetup) -> usize {
    std::fs::read_dir(setup.config_dir().join("quarantine"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// The node answers `status` over MQTT (request id `rid`).
fn answers(cp: &ControlPlane, node: &NodeProcess, rid: &str) {
    assert!(
        cp.status(&node.uuid(), rid, REPLY).is_some(),
        "no status reply to {rid}; log:\n{}",
        node.log()
    );
}

/// What every refusal test checks at its end: one connection all along (the node never sent
/// what the broker drops clients for, and nothing it refused cost the connection), no false
/// duplicate-client-id alarm, one ERROR line per entry set aside, and `status` answered.
fn assert_stayed_up(cp: &ControlPlane, node: &NodeProcess, labels: &[&str]) {
    let log = node.log();
    assert_eq!(
        log.matches("connected to MQTT broker").count(),
        1,
        "the connection did not survive the refusals:\n{log}"
    );
    assert!(!log.contains(ACCUSED), "{log}");
    for label in labels {
        let line = format!("the {label} cannot be delivered");
        assert_eq!(
            log.lines()
                .filter(|l| l.contains(&line) && l.contains("ERROR") && l.contains("set aside in"))
                .count(),
            1,
            "one ERROR line for the {label}:\n{log}"
        );
    }
    answers(cp, node, "after");
}

/// A completion and a workflow event over the broker's Maximum Packet Size (which the broker
/// named in its CONNACK) are never sent: mosquitto would drop the node's connection for them,
/// over and over. One over `message_size_limit` is refused in its PUBACK (0x95): too large
/// for ever, so set aside at once. What queues behind them is delivered, and the node answers
/// `status` throughout.
#[test]
fn g11_d34_messages_too_large_for_the_broker_are_set_aside_without_losing_the_connection() {
    let broker = crate::support::Broker::start_with_conf(
        "max_packet_size 65536\nmessage_size_limit 10000\n",
    );
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write("cyberwave.yml", "cyberwave:\n  training: sleep 1\n");
    let status = |wl: &str| format!("cyberwave/cloud-workload/{wl}/update-status");
    let pad = |n: usize| "x".repeat(n);
    plant(
        &setup,
        "outbox",
        1,
        json!({"topic": status("wl-huge"), "body": {"status": "completed", "pad": pad(100_000)}, "label": "huge completion"}),
    );
    plant(
        &setup,
        "outbox",
        2,
        json!({"topic": status("wl-large"), "body": {"status": "completed", "pad": pad(20_000)}, "label": "large completion"}),
    );
    plant(
        &setup,
        "outbox",
        3,
        json!({"topic": status("wl-ok"), "body": {"status": "completed"}, "label": "small completion"}),
    );
    plant(
        &setup,
        "ingress",
        1,
        json!({"topic": "cyberwave/workflow/wf/execution/started", "body": {"pad": pad(100_000)}, "label": "huge event"}),
    );
    plant(
        &setup,
        "ingress",
        2,
        json!({"topic": "cyberwave/workflow/wf/execution/ex/finished", "body": {"ok": true}, "label": "small event"}),
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    answers(&cp, &node, "during");
    assert!(
        node.wait_log("backend acknowledged the small completion", DONE),
        "the completion queued behind the refused ones was not delivered:\n{}",
        node.log()
    );
    assert!(
        wait_for(DONE, || (!cp.requests("ingress").is_empty()).then_some(())).is_some(),
        "the event queued behind the refused one was not delivered:\n{}",
        node.log()
    );
    let events = cp.requests("ingress");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].id, "wf/execution/ex/finished");
    assert!(
        wait_for(DONE, || (set_aside(&setup) == 3).then_some(())).is_some(),
        "{} set aside:\n{}",
        set_aside(&setup),
        node.log()
    );
    assert!(cp.statuses("wl-huge").is_empty() && cp.statuses("wl-large").is_empty());
    assert_stayed_up(
        &cp,
        &node,
        &["huge completion", "large completion", "huge event"],
    );
}

/// A workload that writes more than the broker's Maximum Packet Size at once: before, each
/// log chunk over the limit made mosquitto drop the node (every few seconds, resent after
/// each reconnect), the short connections were taken for a copied state dir (D33 ERROR, 30 s
/// pauses), and `status` went unanswered for most of a minute. Now log chunks are cut to fit
/// the broker's limit (every byte arrives, none is skipped), the connection stays, `status` is
/// answered while the workload runs, and its completion arrives.
#[test]
fn g11_d34_a_log_chunk_over_the_brokers_packet_size_does_not_cost_the_connection() {
    let broker = crate::support::Broker::start_with_conf("max_packet_size 65536\n");
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  training: head -c 300000 /dev/zero | tr '\\0' x; echo; while [ ! -f release ]; do sleep 0.05; done\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "big-log", "params": {"workload_uuid": "wl-bl"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    let shipped = || -> u64 {
        cp.requests("logs")
            .iter()
            .filter(|r| r.body["workload_uuid"] == "wl-bl")
            .map(|r| r.body["length"].as_u64().unwrap_or(0))
            .sum()
    };
    assert!(
        crate::support::wait_for(DONE, || (shipped() >= 300_001).then_some(())).is_some(),
        "the line arrives whole, in pieces that fit: {} bytes\n{}",
        shipped(),
        node.log()
    );
    assert!(!node.log().contains("not publishing"), "{}", node.log());
    // While the workload runs, the node answers.
    for i in 0..3 {
        answers(&cp, &node, &format!("during-{i}"));
    }
    std::fs::write(setup.cwd.join("release"), "").unwrap();
    assert!(
        cp.wait_status("wl-bl", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    assert_stayed_up(&cp, &node, &[]);
}

/// An ACL that denies the node one workload's status topic and one workflow's events (MQTT v5:
/// PUBACK 0x87, the connection stays). Before, the completion was retried for ever with a
/// backoff up to a minute, and the denied event, sent strictly in order, held up every event
/// after it for ever. Now each is set aside after 5 refusals with one ERROR line, the events
/// behind it are delivered, and the node answers `status` throughout.
#[test]
fn g11_d34_an_acl_deny_sets_the_entry_aside_and_what_follows_is_delivered() {
    let broker = crate::support::Broker::start_with_acl(
        "pattern deny cyberwave/cloud-workload/wl-denied/#\npattern deny cyberwave/workflow/wf-denied/#\npattern readwrite #\n",
    );
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write("cyberwave.yml", "cyberwave:\n  training: echo done\n");
    plant(
        &setup,
        "ingress",
        1,
        json!({"topic": "cyberwave/workflow/wf-denied/execution/started", "body": {"x": 1}, "label": "denied event"}),
    );
    plant(
        &setup,
        "ingress",
        2,
        json!({"topic": "cyberwave/workflow/wf/execution/started", "body": {"x": 2}, "label": "allowed event"}),
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "denied", "params": {"workload_uuid": "wl-denied"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    answers(&cp, &node, "during");
    assert!(
        wait_for(DONE, || (set_aside(&setup) == 2).then_some(())).is_some(),
        "{} set aside:\n{}",
        set_aside(&setup),
        node.log()
    );
    let events = cp.requests("ingress");
    assert!(
        events.iter().any(|e| e.id == "wf/execution/started"),
        "the event behind the denied one was held up: {events:?}\n{}",
        node.log()
    );
    // Another workload's completion goes through.
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "allowed", "params": {"workload_uuid": "wl-allowed"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    assert!(
        cp.wait_status("wl-allowed", "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    let label = node
        .log()
        .lines()
        .find(|l| l.contains("cannot be delivered") && !l.contains("denied event"))
        .and_then(|l| l.split("the ").nth(1))
        .and_then(|l| l.split(" cannot be delivered").next())
        .map(String::from)
        .unwrap_or_default();
    assert!(label.contains("denied"), "{label:?}:\n{}", node.log());
    assert_stayed_up(&cp, &node, &["denied event", &label]);
}

/// A hostile workload (it runs as the node's user) replaces its own log files: stdout with a
/// symlink to a secret of the node's user, stderr with a hard link to it, then fails. Neither the
/// log stream nor the failure summary may carry the secret, and the secret is left as it was
/// (a `max_log_bytes` cut through the link would rewrite it).
#[test]
fn g5_a_workload_cannot_have_the_node_ship_a_file_its_log_was_replaced_with() {
    let (_broker, cp, mut setup) = rig("cyberwave:\n  training: 'true'\n");
    let secret = setup.home.join("secret.txt");
    std::fs::write(&secret, "TOPSECRET-42\n".repeat(20)).unwrap();
    let logs = setup.config_dir().join("workload_logs");
    let manifest = format!(
        "cyberwave:\n  max_log_bytes: 64\n  training: |\n    echo visible line\n    echo visible error >&2\n    sleep 0.5\n    ln -sf {secret} {logs}/training_swap.stdout.log\n    ln -f {secret} {logs}/training_swap.stderr.log\n    sleep 1\n    exit 1\n",
        secret = secret.display(),
        logs = logs.display()
    );
    setup.write("cyberwave.yml", &manifest);
    setup.set("CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL", "0.2");
    let node = setup.spawn();
    node.wait_ready(READY);
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "swap", "params": {"workload_uuid": "wl-swap"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    let all = cp
        .wait_status("wl-swap", "completed", DONE)
        .unwrap_or_else(|| panic!("no completion; log:\n{}", node.log()));
    let shipped: String = cp
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

/// An ACL that denies the node its logs topic (MQTT v5: PUBACK 0x87, the connection stays):
/// each chunk is refused and offered again at the stream's pace, up to 4 times a second. The
/// node keeps serving, and says so at most once a minute, not once per refused chunk.
#[test]
fn g11_d34_a_logs_topic_the_broker_denies_is_not_a_warning_per_chunk() {
    let broker = crate::support::Broker::start_with_acl(
        "pattern deny cyberwave/cloud-node/+/logs\npattern readwrite #\n",
    );
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  training: |\n    for i in $(seq 1 60); do echo \"line $i\"; sleep 0.05; done\n    sleep 30\n",
    );
    setup.set("CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL", "0.2");
    let node = setup.spawn();
    node.wait_ready(READY);
    let r = command(
        &cp,
        &node,
        json!({"command": "training", "request_id": "quiet", "params": {"workload_uuid": "wl-quiet"}}),
    );
    assert_eq!(r["status"], "ok", "{r}");
    // Refusals happen (the PUBACK says 0x87)...
    assert!(
        wait_for(DONE, || node.log().contains("not delivered").then_some(())).is_some(),
        "{}",
        node.log()
    );
    std::thread::sleep(Duration::from_secs(3));
    answers(&cp, &node, "during");
    // ...and are reported once a minute.
    let warned = node.log().matches("not delivered").count();
    assert!(
        warned <= 2,
        "{warned} warnings for one refused stream in 3 s:\n{}",
        node.log()
    );
    assert_eq!(node.log().matches("connected to MQTT broker").count(), 1);
}
