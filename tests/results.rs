//! A workload's results: what is uploaded (its own folder, and loose files only it can have
//! written; never a link, nor another workload's, nor the operator's files: D24, D61), how (each
//! file by the route its attachment reply names, the API token only to the API's origin: D40),
//! side by side on the upload pool, byte-identical, before its completion (guarantee 10).

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::node::TOKEN;
use crate::support::scenario::error_of;
use crate::support::scenario::{completion, uploaded};
use crate::support::timeouts::{DONE, REPLY};
use crate::support::{wait_for, Scenario, Start, TempDir};

/// `len` bytes of a pattern that differs with `seed`.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn g10_results_are_uploaded_byte_identical_while_the_node_stays_busy() {
    let outside = TempDir::new("outside");
    let secret = outside.write("secret.txt", "must not leave the host");
    let rig = Scenario::new(&format!(
        "cyberwave:\n  training: mkdir -p out/sub && cp a.bin out/ && cp b.bin out/sub/ && ln -s {} out/leak.txt\n  results_folder: out\n",
        secret.display()
    ))
    .backend(|b| {
        // The failed first PUT and its 2 s back-off keep the upload going for ~3 s, time
        // enough to see the node busy; the back-off itself is unit-tested (node/table.rs).
        b.put_delay = Duration::from_millis(800);
        b.put_failures = 1; // the first PUT is retried
    })
    .rig();
    let a = pattern(1, 8 * 1024 * 1024);
    let b = pattern(7, 8 * 1024 * 1024);
    std::fs::write(rig.work("a.bin"), &a).expect("a");
    std::fs::write(rig.work("b.bin"), &b).expect("b");
    let node = rig.node();
    Start::training("up").ok(&rig.cp, &node);
    // During the upload the node is busy and says why.
    assert!(
        rig.cp.wait_status("wl-up", "finalizing", DONE).is_some(),
        "{}",
        node.log()
    );
    let st = rig.cp.status(&node.uuid(), "st", REPLY).expect("status");
    assert_eq!(st["output"]["is_busy"], true);
    assert_eq!(st["output"]["active_workloads"][0]["state"], "finalizing");
    let r = Start::training("during").reply(&rig.cp, &node);
    assert_eq!(r["status"], "error");
    let err = error_of(&r);
    assert!(
        err.starts_with("Controller host is busy with 1 active workload(s)")
            && err.contains("uploading results"),
        "{err}"
    );
    let failed = rig
        .cp
        .wait_status("wl-during", "failed", REPLY)
        .expect("R7");
    assert_eq!(failed[0]["busy_reason"], "uploading");
    // Then the completion, after R10.
    let statuses = rig
        .cp
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
    let uploads = rig.cp.uploads();
    assert_eq!(uploads.len(), 2, "{:?}", uploads.keys().collect::<Vec<_>>());
    let mut got: Vec<&Vec<u8>> = uploads.values().collect();
    got.sort_by_key(|v| v[0]);
    assert!(
        got.contains(&&a) && got.contains(&&b),
        "byte-identical uploads"
    );
    assert!(uploads.values().all(|v| v != b"must not leave the host"));
    let requests = rig.cp.all_requests();
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
    node.assert_logged("skipping symlink");
    assert!(
        !rig.work("out/a.bin").exists(),
        "uploaded files are removed once the backend knows of them"
    );
    assert!(secret.exists(), "the symlink's target is untouched");
    // And the node is free again.
    Start::training("after").ok(&rig.cp, &node);
}

/// D24, hostile config: a results folder that cannot be created (a file where its parent
/// should be). The spawner creates the folder, off the node's loop: the workload still starts,
/// without `CYBERWAVE_RESULTS_DIR`, the node says why, and goes on.
#[test]
fn a_results_folder_that_cannot_be_created_leaves_the_workload_without_one() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  training: echo \"dir=${CYBERWAVE_RESULTS_DIR-unset}\" > seen.txt\n  results_folder: blocker/out\n",
    )
    .file("blocker", "a file, not a folder")
    .node();
    let first = Start::training("nf");
    first.ok(&rig.cp, &node);
    assert!(
        rig.cp.wait_status(first.wl(), "completed", DONE).is_some(),
        "{}",
        node.log()
    );
    let seen = std::fs::read_to_string(rig.work("seen.txt")).unwrap_or_default();
    assert_eq!(seen.trim(), "dir=unset", "{}", node.log());
    node.assert_logged("cannot create the results folder");
    // The node goes on: the next start is answered too.
    Start::training("nf2").ok(&rig.cp, &node);
}

#[test]
fn g10_concurrent_workloads_upload_only_their_own_results() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  training: |\n    id=$CYBERWAVE_REQUEST_ID\n    while [ ! -f go ]; do sleep 0.02; done\n    echo \"result of $id\" > \"$CYBERWAVE_RESULTS_DIR/$id.txt\"\n    mkdir -p out && echo loose > \"out/loose-$id.txt\"\n    while [ ! -f \"release-$id\" ]; do sleep 0.05; done\n  results_folder: out\ncloud_node:\n  max_concurrent_workloads: 2\n",
    )
    .node();
    for id in ["ra", "rb"] {
        Start::training(id).ok(&rig.cp, &node);
    }
    // Both run before either writes: a loose file is new to both.
    rig.touch("go");
    let own_b = rig.work("out/rb/rb.txt");
    let out = |f: &str| rig.work("out").join(f);
    assert!(
        wait_for(REPLY, || (own_b.exists()
            && out("ra/ra.txt").exists()
            && out("loose-ra.txt").exists()
            && out("loose-rb.txt").exists())
        .then_some(()))
        .is_some(),
        "each workload writes into its own CYBERWAVE_RESULTS_DIR"
    );
    rig.touch("release-ra");
    let done = completion(&rig.cp, "wl-ra");
    assert_eq!(done["success"], true, "{done}");
    assert_eq!(
        uploaded(&rig.cp, "wl-ra"),
        vec!["ra.txt"],
        "A uploads its own file only"
    );
    assert!(own_b.exists(), "B's result is untouched while B runs");
    // D61: a loose file either could have written (no name of its own in it: `ra` is too
    // short to tell) is neither's: it stays, and each completion names it.
    assert!(
        rig.work("out/loose-ra.txt").exists(),
        "a loose file either could have written stays on disk"
    );
    let left = |done: &serde_json::Value| -> Vec<String> {
        serde_json::from_value(done["unattributed_results"].clone()).unwrap_or_default()
    };
    assert_eq!(left(&done), ["loose-ra.txt", "loose-rb.txt"], "{done}");
    node.assert_logged("unattributed_results");
    rig.touch("release-rb");
    let done_b = completion(&rig.cp, "wl-rb");
    assert_eq!(left(&done_b), ["loose-ra.txt", "loose-rb.txt"], "{done_b}");
    assert!(rig.work("out/loose-rb.txt").exists());
    assert_eq!(uploaded(&rig.cp, "wl-rb"), vec!["rb.txt"]);
    assert!(
        rig.cp.uploads().values().any(|v| v == b"result of rb\n"),
        "B's bytes arrived"
    );
    assert!(
        !rig.work("out/rb").exists(),
        "B's folder is cleaned after its upload"
    );
}

#[test]
fn g10_results_over_max_result_bytes_are_skipped_by_name() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  training: |\n    head -c 100 /dev/zero > \"$CYBERWAVE_RESULTS_DIR/big.bin\"\n    printf small > \"$CYBERWAVE_RESULTS_DIR/small.txt\"\n  results_folder: out\ncloud_node:\n  max_result_bytes: 10\n",
    )
    .node();
    Start::training("mx").reply(&rig.cp, &node);
    completion(&rig.cp, "wl-mx");
    assert_eq!(uploaded(&rig.cp, "wl-mx"), vec!["small.txt"]);
    node.assert_logged("big.bin skipped");
}

/// D24: only a workload's own folder is uploaded and cleaned for it. A result file that workload
/// A left in its own folder (skipped by max_result_bytes) is not uploaded as workload B's
/// (`<A's safe id>/b.txt`) nor deleted, with capacity 1, where every file below
/// `results_folder` could pass for B's loose result.
#[test]
fn g10_d24_a_file_left_in_a_finished_workloads_folder_is_not_uploaded_as_the_next_ones() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  training: |\n    if [ \"$CYBERWAVE_REQUEST_ID\" = ra ]; then head -c 100 /dev/zero > \"$CYBERWAVE_RESULTS_DIR/a.bin\"; head -c 60 /dev/zero > \"$CYBERWAVE_RESULTS_DIR/b.txt\"; fi\n  results_folder: out\ncloud_node:\n  max_result_bytes: 150\n",
    )
    .node();
    for id in ["ra", "rb"] {
        let w = Start::training(id);
        w.ok(&rig.cp, &node);
        w.completion(&rig.cp);
    }
    assert_eq!(uploaded(&rig.cp, "wl-ra"), vec!["a.bin"], "{}", node.log());
    assert!(
        uploaded(&rig.cp, "wl-rb").is_empty(),
        "B wrote nothing, yet uploaded {:?}",
        uploaded(&rig.cp, "wl-rb")
    );
    assert!(
        rig.work("out/ra/b.txt").exists(),
        "A's skipped result was deleted by B's upload"
    );
}

/// A careless operator's `results_folder: .` (or `~`, or the folder the code lives in): with
/// capacity 1 every regular file below it could pass for the workload's result. The operator's
/// own files there (the manifest, scripts) are neither uploaded nor deleted.
#[test]
fn g5_d24_a_results_folder_holding_the_manifest_does_not_upload_and_delete_it() {
    let rig = Scenario::new("cyberwave:\n  training: echo done\n  results_folder: .\n").rig();
    let precious = rig.write("train.py", "print('my code')\n");
    let node = rig.node();
    let w = Start::training("dot");
    w.ok(&rig.cp, &node);
    w.completion(&rig.cp);
    let up: Vec<String> = rig.cp.uploads().keys().cloned().collect();
    assert!(
        precious.exists() && rig.work("cyberwave.yml").exists(),
        "the operator's files were deleted after upload (uploaded: {up:?})"
    );
    assert!(up.is_empty(), "the operator's files were uploaded: {up:?}");
}

/// Two workloads that end together upload side by side (a pool of upload workers,
/// `CYBERWAVE_NODE_UPLOAD_WORKERS`, default 2), so the second's files do not wait behind the
/// first's. Proven by the fake sink seeing both PUTs at once, not by timing.
#[test]
fn two_workloads_ending_together_upload_side_by_side() {
    let (rig, node) = Scenario::new(
        "cloud_node:\n  max_concurrent_workloads: 2\ncyberwave:\n  training: |\n    while [ ! -f go ]; do sleep 0.02; done\n    head -c 100000 /dev/urandom > \"$CYBERWAVE_RESULTS_DIR/model.bin\"\n  results_folder: out\n",
    )
    .backend(|b| b.put_delay = Duration::from_millis(700))
    .node();
    Start::training("pa").ok(&rig.cp, &node);
    Start::training("pb").ok(&rig.cp, &node);
    rig.touch("go");
    for wl in ["wl-pa", "wl-pb"] {
        assert!(
            rig.cp.wait_status(wl, "completed", DONE).is_some(),
            "{wl}: {}",
            node.log()
        );
    }
    assert_eq!(rig.cp.uploads().len(), 2, "{:?}", rig.cp.uploads().keys());
    assert_eq!(
        rig.cp.max_puts_in_flight(),
        2,
        "the two workloads' uploads went one after the other"
    );
}

/// The files of ONE workload go up side by side on the upload pool (default 2 workers), never
/// more at once than the pool holds, a retried file not holding up the others; the backend is
/// told of every file (in their order) and the completion comes once, after all of them.
/// Proven by the fake sink seeing two PUTs at once, not by timing.
#[test]
fn g10_the_files_of_one_workload_upload_side_by_side_and_complete_once() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  training: |\n    for f in a b c d; do head -c 50000 /dev/urandom > \"$CYBERWAVE_RESULTS_DIR/$f.bin\"; done\n  results_folder: out\n",
    )
    .backend(|b| {
        b.put_delay = Duration::from_millis(600);
        b.put_failures = 1; // one PUT is refused once and retried 2 s later
    })
    .node();
    Start::training("pf").ok(&rig.cp, &node);
    let statuses = rig
        .cp
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
    assert_eq!(rig.cp.uploads().len(), 4, "{:?}", rig.cp.uploads().keys());
    assert_eq!(
        rig.cp.max_puts_in_flight(),
        2,
        "one workload's files went one after the other (or more than the pool at once)"
    );
    let requests = rig.cp.all_requests();
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
    node.assert_logged("attempt 2 of 3");
}

#[test]
fn each_file_goes_up_by_the_route_its_attachment_reply_names() {
    // Names with a quote, a CR-free unicode name and a boundary-looking body test the framing.
    let odd = "sub/r\u{e9}sultat \"final\".txt";
    let rig = Scenario::new("cyberwave:\n  training: cp -r src/. out/\n  results_folder: out\n")
        .env("CYBERWAVE_WORKSPACE_ID", "ws-1")
        .backend(|b| {
            for (name, method) in [
                ("big.bin", json!("multipart")),
                (odd, json!("multipart")),
                ("explicit.bin", json!("signed_url")),
                ("null.bin", Value::Null),
                ("weird.bin", json!("ftp")),
                ("number.bin", json!(7)),
            ] {
                b.upload_methods.insert(name.to_string(), method);
            }
            // The form upload is an API call: scoped like every other one.
            b.require_workspace_uuid = true;
        })
        .rig();
    let src = rig.work("src");
    std::fs::create_dir_all(src.join("sub")).expect("src");
    let mut files = vec![
        ("big.bin", pattern(3, 6 * 1024 * 1024 + 17)),
        (
            odd,
            b"--cyberwave-node-\r\n\r\nnot a boundary\r\n--".to_vec(),
        ),
        ("explicit.bin", pattern(5, 1000)),
        ("null.bin", pattern(9, 10)),
        ("plain.bin", Vec::new()),
        ("weird.bin", pattern(11, 100)),
        ("number.bin", pattern(13, 100)),
    ];
    files.sort();
    for (name, bytes) in &files {
        std::fs::write(src.join(name), bytes).expect("write");
    }
    let node = rig.node();
    Start::training("mp").ok(&rig.cp, &node);
    completion(&rig.cp, "wl-mp");
    let puts = rig.cp.uploads();
    let forms = rig.cp.form_uploads();
    for (name, bytes) in &files {
        let att = rig
            .cp
            .attachment_name(name)
            .unwrap_or_else(|| panic!("R9 for {name}"));
        let uuid = att.rsplit_once('.').map_or(att.as_str(), |(s, _)| s);
        match *name {
            "big.bin" | "sub/r\u{e9}sultat \"final\".txt" => {
                let f = forms
                    .get(uuid)
                    .unwrap_or_else(|| panic!("{name} by multipart"));
                assert_eq!(&f.bytes, bytes, "{name} byte-identical");
                assert_eq!((f.field.as_str(), f.parts), ("file", 1));
                let expect = name
                    .rsplit('/')
                    .next()
                    .unwrap_or_default()
                    .replace('"', "%22");
                assert_eq!(f.filename, expect);
                assert_eq!(f.authorization, Some(format!("Token {TOKEN}")));
                assert!(!puts.contains_key(&att), "{name} not PUT as well");
            }
            "explicit.bin" | "null.bin" | "plain.bin" => {
                assert_eq!(puts.get(&att), Some(bytes), "{name} PUT byte-identical");
                assert!(!forms.contains_key(uuid), "{name} not POSTed as well");
            }
            _ => {
                assert!(
                    !puts.contains_key(&att) && !forms.contains_key(uuid),
                    "{name}"
                );
                let why = if *name == "weird.bin" {
                    "\"ftp\""
                } else {
                    "\"7\""
                };
                assert!(
                    node.log()
                        .lines()
                        .any(|l| l.contains(name) && l.contains(why)),
                    "the error names {name} and the method: {}",
                    node.log()
                );
            }
        }
    }
    let r10 = rig.cp.requests("workload:upload-results");
    assert_eq!(r10.len(), 1);
    assert_eq!(
        r10[0].body["filenames"],
        json!(["big.bin", "explicit.bin", "null.bin", "plain.bin", odd]),
        "the failed files are left out"
    );
}

/// D40, secrets never reach an unintended party: a `multipart` attachment reply whose URL is not
/// on the platform's API host (another origin: here another port; in the field a storage host,
/// or whatever a proxied or compromised reply names) does not get the node's API token, which
/// goes only to the API base URL's origin.
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
    let (rig, node) = Scenario::new(
        "cyberwave:\n  training: echo r > \"$CYBERWAVE_RESULTS_DIR/r.txt\"\n  results_folder: out\n",
    )
    .backend(|b| {
        b.upload_methods
            .insert("r.txt".to_string(), json!("multipart"));
        b.multipart_url = Some(format!("http://127.0.0.1:{port}/collect"));
    })
    .node();
    Start::training("tk").ok(&rig.cp, &node);
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

/// D61, the platform's trainer: with two slots, a training that writes
/// `<its training uuid>.tar.gz` straight into `results_folder` (as the SmolVLA trainer writes
/// `./runs/artifacts/<training uuid>.tar.gz`, not into `$CYBERWAVE_RESULTS_DIR`) has it uploaded
/// with its own completion, though another workload ran beside it and ended first, once the
/// archive was there.
#[test]
fn g10_d61_a_trainers_archive_named_after_its_training_uuid_is_uploaded_with_its_completion() {
    let rig = Scenario::new(concat!(
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
    ))
    .rig();
    let uuid = "7d0c6c1e-3c47-4b8f-9d59-2c7d0f6f4a11";
    let node = rig.node();
    let trainer = Start::training("trainer").with(json!({"training_uuid": uuid}));
    trainer.ok(&rig.cp, &node);
    let other = Start::training("other");
    other.ok(&rig.cp, &node);
    rig.touch("go");
    let done = other.completion(&rig.cp);
    assert_eq!(done["success"], true, "{done}");
    assert!(done.get("unattributed_results").is_none(), "{done}");
    assert!(other.uploaded(&rig.cp).is_empty(), "{}", node.log());
    let archive = rig.work(&format!("runs/artifacts/{uuid}.tar.gz"));
    let bytes = std::fs::read(&archive).unwrap();
    rig.touch("release");
    let done = trainer.completion(&rig.cp);
    assert_eq!(done["success"], true, "{done}");
    assert!(done.get("unattributed_results").is_none(), "{done}");
    assert_eq!(
        trainer.uploaded(&rig.cp),
        [format!("{uuid}.tar.gz")],
        "{}",
        node.log()
    );
    assert!(
        rig.cp.uploads().values().any(|v| *v == bytes),
        "the archive's bytes arrived"
    );
    assert!(!archive.exists(), "uploaded, then removed");
}

/// D61: a workload's loose result is known as new by its identity, not by comparing times with
/// the wall clock: after the clock stepped back (here: the start was recorded an hour ahead, the
/// node restarted meanwhile) what the workload writes is still uploaded, and cleaned up.
#[test]
fn g10_d61_a_loose_result_is_uploaded_after_the_clock_stepped_back() {
    let (rig, mut node) = Scenario::new(
        "cyberwave:\n  results_folder: out\n  training: |\n    while [ ! -f go ]; do sleep 0.02; done\n    echo model > out/model.bin\n",
    )
    .node();
    let w = Start::training("clk");
    w.ok(&rig.cp, &node);
    node.kill9();
    let meta_path = rig.state("workloads/clk/meta.json");
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
    let ahead = meta["created_unix"].as_f64().unwrap() + 3600.0;
    meta["created_unix"] = json!(ahead);
    std::fs::write(&meta_path, serde_json::to_vec(&meta).unwrap()).unwrap();
    let _node = rig.node();
    rig.touch("go");
    let done = w.completion(&rig.cp);
    assert_eq!(done["success"], true, "{done}");
    assert_eq!(w.uploaded(&rig.cp), ["model.bin"], "{}", node.log());
    assert!(!rig.work("out/model.bin").exists());
}
