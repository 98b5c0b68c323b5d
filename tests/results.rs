//! Result uploads and stale-workload self-healing, end to end.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::node::NodeSetup;
use crate::support::scenario::Start;
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{wait_for, Broker, ControlPlane, HeartbeatMode, TempDir};

pub(crate) fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn g10_results_are_uploaded_byte_identical_while_the_node_stays_busy() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    cp.set_behaviour(|b| {
        // The failed first PUT and its 2 s back-off keep the upload going for ~3 s, time
        // enough to see the node busy; the back-off itself is unit-tested (node/table.rs).
        b.put_delay = Duration::from_millis(800);
        b.put_failures = 1; // the first PUT is retried
    });
    let outside = TempDir::new("outside");
    let secret = outside.write("secret.txt", "must not leave the host");
    let setup = NodeSetup::new(&broker, &cp);
    let a = pattern(1, 8 * 1024 * 1024);
    let b = pattern(7, 8 * 1024 * 1024);
    std::fs::write(setup.cwd.join("a.bin"), &a).expect("a");
    std::fs::write(setup.cwd.join("b.bin"), &b).expect("b");
    setup.write(
        "cyberwave.yml",
        &format!(
            "cyberwave:\n  training: mkdir -p out/sub && cp a.bin out/ && cp b.bin out/sub/ && ln -s {} out/leak.txt\n  results_folder: out\n",
            secret.display()
        ),
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::training("up").ok(&cp, &node);
    // During the upload the node is busy and says why.
    assert!(
        cp.wait_status("wl-up", "finalizing", DONE).is_some(),
        "{}",
        node.log()
    );
    let st = cp.status(&node.uuid(), "st", REPLY).expect("status");
    assert_eq!(st["output"]["is_busy"], true);
    assert_eq!(st["output"]["active_workloads"][0]["state"], "finalizing");
    let r = Start::training("during").reply(&cp, &node);
    assert_eq!(r["status"], "error");
    let err = r["error"].as_str().unwrap_or_default();
    assert!(
        err.starts_with("Controller host is busy with 1 active workload(s)")
            && err.contains("uploading results"),
        "{err}"
    );
    let failed = cp.wait_status("wl-during", "failed", REPLY).expect("R7");
    assert_eq!(failed[0]["busy_reason"], "uploading");
    // Then the completion, after R10.
    let statuses = cp
        .wait_status("wl-up", "completed", DONE)
        .unwrap_or_else(|| panic!("{}", node.log()));
    let finalizing = statuses
        .iter()
        .find(|s| s["status"] == "finalizing")
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        finalizing["file_count"], 2,
        "the symlink is not counted: {finalizing}"
    );
    let uploads = cp.uploads();
    assert_eq!(uploads.len(), 2, "{:?}", uploads.keys().collect::<Vec<_>>());
    let mut got: Vec<&Vec<u8>> = uploads.values().collect();
    got.sort_by_key(|v| v[0]);
    assert!(
        got.contains(&&a) && got.contains(&&b),
        "byte-identical uploads"
    );
    assert!(uploads.values().all(|v| v != b"must not leave the host"));
    let requests = cp.all_requests();
    let r10 = requests
        .iter()
        .position(|r| r.op == "workload:upload-results" && r.id == "wl-up")
        .expect("R10 sent");
    let r8 = requests
        .iter()
        .position(|r| {
            r.op == "workload:update-status" && r.id == "wl-up" && r.body["status"] == "completed"
        })
        .expect("R8");
    assert!(r10 < r8, "the completion comes after R10");
    let body = &requests[r10].body;
    assert_eq!(body["filenames"], json!(["a.bin", "sub/b.bin"]));
    assert_eq!(body["attachment_uuids"].as_array().map(Vec::len), Some(2));
    assert!(node.wait_log("skipping symlink", REPLY), "{}", node.log());
    assert!(
        !setup.cwd.join("out/a.bin").exists(),
        "uploaded files are removed once the backend knows of them"
    );
    assert!(secret.exists(), "the symlink's target is untouched");
    // And the node is free again.
    Start::training("after").ok(&cp, &node);
}

#[test]
fn a_stale_workload_is_terminated_and_its_slot_reused() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_HEARTBEAT_INTERVAL", "30");
    setup.write("cyberwave.yml", "cyberwave:\n  training: sleep 60\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    let first = Start::training("old").reply(&cp, &node);
    let pid = first["output"]["pid"].as_i64().unwrap_or(0);
    // The backend finished with it long ago; a new start must not be refused because of it.
    cp.set_behaviour(|b| {
        b.workloads
            .insert("wl-old".into(), Some((200, json!({"status": "completed"}))));
    });
    let t = Instant::now();
    let r = Start::training("new").reply(&cp, &node);
    assert_eq!(r["status"], "ok", "{r}\n{}", node.log());
    assert!(t.elapsed() < Duration::from_secs(8));
    // SAFETY: probing a pid.
    assert!(
        unsafe { libc::kill(pid as i32, 0) } != 0,
        "the stale workload is gone"
    );
    std::thread::sleep(Duration::from_millis(500));
    let old = cp.statuses("wl-old");
    assert!(
        old.iter().all(|s| s["status"] == "running"),
        "no completion for a stale workload: {old:?}"
    );
    assert!(
        node.log()
            .contains("is stale (the backend says it is completed)"),
        "{}",
        node.log()
    );
}

#[test]
fn self_heal_runs_before_heartbeats_and_404_means_stale() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_HEARTBEAT_INTERVAL", "0.5");
    setup.write("cyberwave.yml", "cyberwave:\n  training: sleep 60\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    let r = Start::training("gone").reply(&cp, &node);
    let pid = r["output"]["pid"].as_i64().unwrap_or(0);
    cp.set_behaviour(|b| {
        b.workloads.insert(
            "wl-gone".into(),
            Some((404, json!({"detail": "not found"}))),
        );
    });
    // SAFETY: probing a pid.
    let gone = wait_for(Duration::from_secs(8), || {
        (unsafe { libc::kill(pid as i32, 0) } != 0).then_some(())
    });
    assert!(
        gone.is_some(),
        "terminated by the pass before a heartbeat; log:\n{}",
        node.log()
    );
    let mut n = 0;
    let emptied = wait_for(REPLY, || {
        n += 1;
        let st = cp.status(&node.uuid(), &format!("st-{n}"), REPLY)?;
        (st["output"]["active_workloads"] == json!([])).then_some(())
    });
    assert!(emptied.is_some(), "the stale workload is no longer tracked");
    assert!(
        cp.statuses("wl-gone")
            .iter()
            .all(|s| s["status"] == "running"),
        "and was not reported"
    );
}

/// D20 allows `.`, `?` and `=` in a workload id: a workload named `..` or `x?y=1` is still asked
/// about on its own REST path (`…/cloud-node-workloads/%2E%2E`), never on another endpoint, nor
/// with a query of its choosing, with the node's token.
#[test]
fn g5_a_workload_id_of_dots_or_a_query_stays_on_its_own_rest_path() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_HEARTBEAT_INTERVAL", "0.5");
    setup.set("CYBERWAVE_MAX_CONCURRENT_WORKLOADS", "2");
    setup.write("cyberwave.yml", "cyberwave:\n  training: sleep 60\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    for (rid, wl) in [("dots", ".."), ("query", "x?y=1")] {
        let r = Start::training(rid).workload(wl).reply(&cp, &node);
        assert_eq!(r["status"], "ok", "{r}");
    }
    let asked = wait_for(Duration::from_secs(8), || {
        let hits: Vec<String> = cp.http_hits().into_iter().map(|(url, _)| url).collect();
        let both = [
            "/api/v1/cloud-node-workloads/%2E%2E",
            "/api/v1/cloud-node-workloads/x%3Fy%3D1",
        ]
        .iter()
        .all(|want| hits.iter().any(|u| u == want));
        both.then_some(())
    });
    assert!(asked.is_some(), "{:?}\n{}", cp.http_hits(), node.log());
    for (url, _) in cp.http_hits() {
        assert!(!url.contains("/..") && !url.contains('?'), "{url}");
    }
}

#[test]
fn g6_an_inconclusive_backend_keeps_the_workload_and_heartbeats_stay_on_time() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let mut setup = NodeSetup::new(&broker, &cp);
    setup.set("CYBERWAVE_HEARTBEAT_INTERVAL", "0.5");
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  training: sleep 60\n  max_concurrent_workloads: 2\n",
    );
    cp.set_behaviour(|b| {
        b.workloads.insert("wl-500".into(), Some((500, json!({}))));
        b.workloads.insert("wl-hang".into(), None);
        b.heartbeat = HeartbeatMode::Ok;
    });
    let node = setup.spawn();
    node.wait_ready(READY);
    let p1 = Start::training("k500").workload("wl-500").reply(&cp, &node)["output"]["pid"]
        .as_i64()
        .unwrap_or(0);
    let p2 = Start::training("khang")
        .workload("wl-hang")
        .reply(&cp, &node)["output"]["pid"]
        .as_i64()
        .unwrap_or(0);
    let from = Instant::now();
    // Within a second a pass asks about wl-hang, whose lookup hangs for its whole 5 s timeout:
    // 3 s of beats fall inside the hang (the table's timers are unit-tested in node/table.rs).
    std::thread::sleep(Duration::from_secs(3));
    let beats: Vec<Instant> = cp
        .requests("heartbeat")
        .into_iter()
        .map(|r| r.at)
        .filter(|t| *t >= from)
        .collect();
    assert!(beats.len() >= 5, "{} heartbeats in 3 s", beats.len());
    for w in beats.windows(2) {
        assert!(
            w[1] - w[0] < Duration::from_millis(900),
            "a heartbeat was late: {:?}",
            w[1] - w[0]
        );
    }
    // SAFETY: probing pids.
    assert!(
        unsafe { libc::kill(p1 as i32, 0) } == 0 && unsafe { libc::kill(p2 as i32, 0) } == 0,
        "both kept"
    );
    let hits = cp
        .http_hits()
        .iter()
        .filter(|(u, _)| u.starts_with("/api/v1/cloud-node-workloads/"))
        .count();
    assert!(hits >= 2, "the backend was asked: {hits}");
}

/// Issue 25: two workloads that end together upload side by side (a pool of upload workers,
/// `CYBERWAVE_NODE_UPLOAD_WORKERS`, default 2), so the second's files do not wait behind the
/// first's. Proven by the fake sink seeing both PUTs at once, not by timing. On main at f918294
/// one upload thread sent them one after the other.
/// D24, hostile config: a results folder that cannot be created (a file where its parent
/// should be). The spawner creates the folder now (issue 25 item 5, off the node's loop): the
/// workload still starts, without `CYBERWAVE_RESULTS_DIR`, the node says why, and goes on.
#[test]
fn a_results_folder_that_cannot_be_created_leaves_the_workload_without_one() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    std::fs::write(setup.cwd.join("blocker"), "a file, not a folder").unwrap();
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  training: echo \"dir=${CYBERWAVE_RESULTS_DIR-unset}\" > seen.txt\n  results_folder: blocker/out\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let first = Start::training("nf");
    first.ok(&cp, &node);
    assert!(
        cp.wait_status(first.wl(), "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    let seen = std::fs::read_to_string(setup.cwd.join("seen.txt")).unwrap_or_default();
    assert_eq!(seen.trim(), "dir=unset", "{}", node.log());
    assert!(
        node.log().contains("cannot create the results folder"),
        "{}",
        node.log()
    );
    // The node goes on: the next start is answered too.
    Start::training("nf2").ok(&cp, &node);
}

#[test]
fn two_workloads_ending_together_upload_side_by_side() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    cp.set_behaviour(|b| b.put_delay = Duration::from_millis(700));
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        "cloud_node:\n  max_concurrent_workloads: 2\ncyberwave:\n  training: |\n    while [ ! -f go ]; do sleep 0.02; done\n    head -c 100000 /dev/urandom > \"$CYBERWAVE_RESULTS_DIR/model.bin\"\n  results_folder: out\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::training("pa").ok(&cp, &node);
    Start::training("pb").ok(&cp, &node);
    std::fs::write(setup.cwd.join("go"), "").unwrap();
    for wl in ["wl-pa", "wl-pb"] {
        assert!(
            cp.wait_status(wl, "completed", DONE).is_some(),
            "{wl}: {}",
            node.log()
        );
    }
    assert_eq!(cp.uploads().len(), 2, "{:?}", cp.uploads().keys());
    assert_eq!(
        cp.max_puts_in_flight(),
        2,
        "the two workloads' uploads went one after the other"
    );
}

/// Issue 25 item 3: the files of ONE workload go up side by side on the upload pool (default 2
/// workers), never more at once than the pool holds, a retried file not holding up the others;
/// the backend is told of every file (in their order) and the completion comes once, after
/// all of them. Proven by the fake sink seeing two PUTs at once, not by timing. On main at
/// 24ce237 one workload's files went one after the other.
#[test]
fn g10_the_files_of_one_workload_upload_side_by_side_and_complete_once() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    cp.set_behaviour(|b| {
        b.put_delay = Duration::from_millis(600);
        b.put_failures = 1; // one PUT is refused once and retried 2 s later
    });
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  training: |\n    for f in a b c d; do head -c 50000 /dev/urandom > \"$CYBERWAVE_RESULTS_DIR/$f.bin\"; done\n  results_folder: out\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::training("pf").ok(&cp, &node);
    let statuses = cp
        .wait_status("wl-pf", "completed", DONE)
        .unwrap_or_else(|| panic!("{}", node.log()));
    assert_eq!(
        statuses
            .iter()
            .filter(|s| s["status"] == "completed")
            .count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(cp.uploads().len(), 4, "{:?}", cp.uploads().keys());
    assert_eq!(
        cp.max_puts_in_flight(),
        2,
        "one workload's files went one after the other (or more than the pool at once)"
    );
    let requests = cp.all_requests();
    let r10: Vec<usize> = (0..requests.len())
        .filter(|&i| requests[i].op == "workload:upload-results" && requests[i].id == "wl-pf")
        .collect();
    assert_eq!(r10.len(), 1, "the backend is told once");
    let body = &requests[r10[0]].body;
    assert_eq!(
        body["filenames"],
        json!(["a.bin", "b.bin", "c.bin", "d.bin"])
    );
    let completed = requests
        .iter()
        .position(|r| {
            r.op == "workload:update-status" && r.id == "wl-pf" && r.body["status"] == "completed"
        })
        .expect("R8");
    assert!(r10[0] < completed, "the completion comes after R10");
    assert!(node.wait_log("attempt 2 of 3", REPLY), "{}", node.log());
}

/// D61, the platform's trainer: with two slots, a training that writes
/// `<its training uuid>.tar.gz` straight into `results_folder` (as the SmolVLA trainer writes
/// `./runs/artifacts/<training uuid>.tar.gz`, not into `$CYBERWAVE_RESULTS_DIR`) has it uploaded
/// with its own completion, though another workload ran beside it and ended first, once the
/// archive was there. On main, with more than one slot, the archive was never uploaded.
#[test]
fn g10_d61_a_trainers_archive_named_after_its_training_uuid_is_uploaded_with_its_completion() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        concat!(
            "cloud_node:\n  max_concurrent_workloads: 2\n",
            "cyberwave:\n  results_folder: runs/artifacts\n  training: |\n",
            "    while [ ! -f go ]; do sleep 0.02; done\n",
            "    if [ \"$CYBERWAVE_REQUEST_ID\" = trainer ]; then\n",
            "      uuid=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[\"training_uuid\"])' {body})\n",
            "      head -c 3000 /dev/urandom > \"runs/artifacts/$uuid.tar.gz\"\n",
            "      while [ ! -f release ]; do sleep 0.02; done\n",
            "    else\n",
            "      until ls runs/artifacts/*.tar.gz > /dev/null 2>&1; do sleep 0.02; done\n",
            "    fi\n",
        ),
    );
    let uuid = "7d0c6c1e-3c47-4b8f-9d59-2c7d0f6f4a11";
    let node = setup.spawn();
    node.wait_ready(READY);
    let trainer = Start::training("trainer").with(json!({"training_uuid": uuid}));
    trainer.ok(&cp, &node);
    let other = Start::training("other");
    other.ok(&cp, &node);
    std::fs::write(setup.cwd.join("go"), "").unwrap();
    let done = other.completion(&cp);
    assert_eq!(done["success"], true, "{done}");
    assert!(done.get("unattributed_results").is_none(), "{done}");
    assert!(other.uploaded(&cp).is_empty(), "{}", node.log());
    let archive = setup.cwd.join(format!("runs/artifacts/{uuid}.tar.gz"));
    let bytes = std::fs::read(&archive).unwrap();
    std::fs::write(setup.cwd.join("release"), "").unwrap();
    let done = trainer.completion(&cp);
    assert_eq!(done["success"], true, "{done}");
    assert!(done.get("unattributed_results").is_none(), "{done}");
    assert_eq!(
        trainer.uploaded(&cp),
        [format!("{uuid}.tar.gz")],
        "{}",
        node.log()
    );
    assert!(
        cp.uploads().values().any(|v| *v == bytes),
        "the archive's bytes arrived"
    );
    assert!(!archive.exists(), "uploaded, then removed");
}

/// D61: a workload's loose result is known as new by its identity, not by comparing times with
/// the wall clock: after the clock stepped back (here: the start was recorded an hour ahead, the
/// node restarted meanwhile) what the workload writes is still uploaded. On main it was neither
/// uploaded nor cleaned up, without a word.
#[test]
fn g10_d61_a_loose_result_is_uploaded_after_the_clock_stepped_back() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  results_folder: out\n  training: |\n    while [ ! -f go ]; do sleep 0.02; done\n    echo model > out/model.bin\n",
    );
    let mut node = setup.spawn();
    node.wait_ready(READY);
    let w = Start::training("clk");
    w.ok(&cp, &node);
    node.kill9();
    let meta_path = setup.config_dir().join("workloads/clk/meta.json");
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
    let ahead = meta["created_unix"].as_f64().unwrap() + 3600.0;
    meta["created_unix"] = json!(ahead);
    std::fs::write(&meta_path, serde_json::to_vec(&meta).unwrap()).unwrap();
    let node = setup.spawn();
    node.wait_ready(READY);
    std::fs::write(setup.cwd.join("go"), "").unwrap();
    let done = w.completion(&cp);
    assert_eq!(done["success"], true, "{done}");
    assert_eq!(w.uploaded(&cp), ["model.bin"], "{}", node.log());
    assert!(!setup.cwd.join("out/model.bin").exists());
}
