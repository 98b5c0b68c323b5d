//! Workload attacks: see `mod.rs`. Nothing a workload does may wedge or silence the node's
//! report of it, and nothing the node answered is lost on a crash: a cancel answered while its
//! workload starts survives a SIGKILL of the node, a workload that stops its own supervisor and
//! exits is still reported (D66), a hung upload endpoint holds a workload no longer than its
//! upload deadline and a cancel ends its uploads at once (D68), and a start that meets a full
//! state disk (of bytes or of inodes) is a retryable `disk_low` refusal that leaves nothing.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::disk::Tmpfs;
use crate::support::node::NodeSetup;
use crate::support::scenario::error_of;
use crate::support::timeouts::{DONE, READY, REPLY};
use crate::support::{procs, wait_for, ControlPlane, NodeProcess, Rig, Scenario, Start};

/// The lines workload `rid` appended to `t/<rid>.runs`.
fn runs(setup: &NodeSetup, rid: &str) -> String {
    std::fs::read_to_string(setup.cwd.join(format!("t/{rid}.runs"))).unwrap_or_default()
}

fn cancel(cp: &ControlPlane, uuid: &str, rid: &str, target: &str) {
    cp.command(
        uuid,
        json!({"command": "cancel", "request_id": rid, "params": {"workload_request_id": target}}),
    );
}

/// A cancel that comes while its workload starts (on a slow disk: the workload runs, its start
/// is not answered yet) is answered "recorded"; the node is SIGKILLed before the start is
/// answered. After the restart the re-adopted workload gets the cancel and is reported
/// cancelled, and the same cancel sent again is not answered with the promise again.
#[test]
fn g11_a_cancel_answered_while_its_workload_starts_is_carried_out_after_a_sigkill_of_the_node() {
    let mut rig = Scenario::new("cyberwave:\n  inference: echo $$ >> t/$CYBERWAVE_REQUEST_ID.runs; trap 'echo term >> t/$CYBERWAVE_REQUEST_ID.runs; exit 143' TERM; sleep 10 & wait\n").dir("t").rig();
    let Rig { cp, setup, .. } = &mut rig;
    setup.set("CYBERWAVE_TEST_SLOW_FSYNC_MS", "3000");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    let uuid = node.uuid();
    Start::new("inference", "pc").send(cp, &node);
    wait_for(Duration::from_secs(10), || {
        (runs(setup, "pc").lines().count() == 1).then_some(())
    })
    .expect("the workload did not run");
    cancel(cp, &uuid, "pc-x", "pc");
    let answer = cp
        .wait_reply("pc-x", Duration::from_secs(5))
        .expect("cancel not answered");
    assert_eq!(answer["status"], "ok", "{answer}");
    assert_eq!(answer["output"]["state"], "starting", "{answer}");
    assert!(
        cp.replies_for("pc").is_empty(),
        "the start was answered before the kill: the test needs it in flight"
    );
    node.kill9();
    setup.unset("CYBERWAVE_TEST_SLOW_FSYNC_MS");
    let node = setup.spawn();
    node.wait_ready(READY);
    let all = cp
        .wait_status("wl-pc", "cancelled", Duration::from_secs(20))
        .unwrap_or_else(|| {
            panic!(
                "the cancel answered before the kill was lost: {:?}; log:\n{}",
                cp.statuses("wl-pc"),
                node.log()
            )
        });
    assert_eq!(
        all.iter().filter(|b| b["status"] == "cancelled").count(),
        1,
        "{all:?}"
    );
    assert!(
        all.iter().all(|b| b["status"] != "completed"),
        "reported once: {all:?}"
    );
    let lines = runs(setup, "pc");
    assert!(
        lines.lines().count() == 2 && lines.ends_with("term\n"),
        "ran once and got SIGTERM: {lines:?}"
    );
    // Sent again (a QoS 1 redelivery after the restart): not the promise of the first answer.
    cancel(cp, &uuid, "pc-x", "pc");
    let again = wait_for(REPLY, || cp.replies_for("pc-x").get(1).cloned())
        .expect("the cancel sent again is not answered");
    assert_eq!(again["status"], "ok", "{again}");
    assert_ne!(again["output"]["state"], "starting", "{again}");
}

/// D66: a workload of the node's own uid stops its supervisor (SIGSTOP) and exits. Nothing reaps
/// it while its supervisor is stopped; the node notices, continues the supervisor, and the
/// workload is reported once, with its exit code, and its slot freed.
#[test]
fn g13_d66_a_workload_that_stops_its_supervisor_and_exits_is_reported_once() {
    let (rig, node) = Scenario::new(concat!(
        "cyberwave:\n  inference: |\n",
        "    echo $PPID > t/sup\n",
        "    sleep 1\n",
        "    kill -STOP $PPID\n",
        "    exit 3\n",
    ))
    .dir("t")
    .node();
    Start::new("inference", "stop").ok(&rig.cp, &node);
    let sup = rig.pid_in("t/sup");
    let done = rig
        .cp
        .wait_completions("wl-stop", Duration::from_secs(15))
        .unwrap_or_else(|| {
            panic!(
            "no completion for a workload whose supervisor it stopped (supervisor: {:?}); log:\n{}",
            procs::state(sup),
            node.log()
        )
        });
    assert_eq!(done[0]["exit_code"], 3, "{done:?}");
    assert_eq!(done[0]["success"], false, "{done:?}");
    let gone = wait_for(REPLY, || procs::state(sup).is_none().then_some(()));
    assert!(gone.is_some(), "the supervisor was left stopped");
    let st = rig.cp.status(&node.uuid(), "st", REPLY).expect("status");
    assert_eq!(
        st["output"]["active_workloads"],
        json!([]),
        "its slot is free: {st}"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        rig.cp.completions("wl-stop").len(),
        1,
        "exactly one completion"
    );
}

/// D66 across a restart: the node is SIGKILLed, then the workload stops its supervisor and
/// exits. The restarted node re-adopts the workload (its supervisor lives, stopped), continues
/// the supervisor and reports the workload once, with its exit code.
#[test]
fn g13_d66_a_workload_that_stops_its_supervisor_while_the_node_is_down_is_reported_after_the_restart(
) {
    let (rig, mut node) = Scenario::new(concat!(
        "cyberwave:\n  inference: |\n",
        "    echo $PPID > t/sup\n",
        "    until [ -e t/go ]; do sleep 0.05; done\n",
        "    kill -STOP $PPID\n",
        "    exit 4\n",
    ))
    .dir("t")
    .node();
    let Rig { cp, setup, .. } = &rig;
    Start::new("inference", "stop2").ok(cp, &node);
    let sup = rig.pid_in("t/sup");
    node.kill9();
    rig.touch("t/go");
    let stopped = wait_for(REPLY, || (procs::state(sup) == Some('T')).then_some(()));
    assert!(
        stopped.is_some(),
        "the workload did not stop its supervisor"
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let done = cp
        .wait_completions("wl-stop2", Duration::from_secs(15))
        .expect("no completion after the restart");
    assert_eq!(done[0]["exit_code"], 4, "{done:?}");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        cp.completions("wl-stop2").len(),
        1,
        "exactly one completion"
    );
}

/// A training that writes three result files into its own results folder.
const THREE_RESULTS: &str = "cyberwave:\n  training: for f in a b c; do head -c 20000 /dev/urandom > \"$CYBERWAVE_RESULTS_DIR/$f.bin\"; done\n  results_folder: out\n";

/// A node running [`THREE_RESULTS`] whose upload endpoint takes the bytes and never answers
/// (for ten minutes).
fn hung_backend() -> Scenario {
    Scenario::new(THREE_RESULTS).backend(|b| b.put_delay = Duration::from_secs(600))
}

fn results_left(rig: &Rig, rid: &str) -> Vec<String> {
    let dir = rig.work("out").join(rid);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// The completion of `rid` names its three results as not uploaded, they are left on disk, and
/// its slot is free.
fn assert_uploads_abandoned(rig: &Rig, node: &NodeProcess, done: &Value, rid: &str) {
    assert_eq!(
        done["results_not_uploaded"],
        json!(["a.bin", "b.bin", "c.bin"]),
        "{done}"
    );
    assert_eq!(results_left(rig, rid), ["a.bin", "b.bin", "c.bin"]);
    let st = rig.cp.status(&node.uuid(), "st", REPLY).expect("status");
    assert_eq!(st["output"]["active_workloads"], json!([]), "{st}");
}

/// D68: an upload endpoint that never answers holds a finalizing workload no longer than its
/// upload deadline (`CYBERWAVE_NODE_UPLOAD_DEADLINE_SECONDS`, here 3 s): then the completion
/// goes out, naming the files left on disk in `results_not_uploaded`, and the slot is free.
#[test]
fn g3_d68_a_hung_upload_endpoint_holds_a_workload_no_longer_than_its_upload_deadline() {
    let (rig, node) = hung_backend()
        .env("CYBERWAVE_NODE_UPLOAD_DEADLINE_SECONDS", "3")
        .node();
    Start::training("hung").ok(&rig.cp, &node);
    rig.cp
        .wait_status("wl-hung", "finalizing", DONE)
        .expect("no finalizing status");
    let done = rig
        .cp
        .wait_completions("wl-hung", Duration::from_secs(20))
        .expect("a hung upload endpoint holds the workload finalizing");
    assert_eq!(done[0]["exit_code"], 0, "{done:?}");
    assert_uploads_abandoned(&rig, &node, &done[0], "hung");
    node.assert_logged("abandoned");
}

/// D68: `cancel` of a finalizing workload (its upload endpoint hangs, the default deadline of
/// half an hour) abandons its uploads at once and says so; the completion goes out now, with
/// the workload's own exit code and the files left on disk named.
#[test]
fn g3_d68_a_cancel_of_a_finalizing_workload_abandons_its_uploads_at_once() {
    let (rig, node) = hung_backend().node();
    Start::training("fin").ok(&rig.cp, &node);
    rig.cp
        .wait_status("wl-fin", "finalizing", DONE)
        .expect("no finalizing status");
    cancel(&rig.cp, &node.uuid(), "fin-x", "fin");
    let answer = rig.cp.wait_reply("fin-x", REPLY).expect("cancel answered");
    assert_eq!(answer["status"], "ok", "{answer}");
    let message = answer["output"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("result uploads were abandoned"),
        "{answer}"
    );
    let done = rig
        .cp
        .wait_completions("wl-fin", Duration::from_secs(5))
        .expect("no completion after the cancel");
    assert_eq!(done[0]["success"], true, "it exited 0: {done:?}");
    assert_uploads_abandoned(&rig, &node, &done[0], "fin");
}

/// Fills the state dir's disk: one file of bytes until no byte fits, or (`inodes`) empty files
/// until no file fits. Returns the folder holding them.
fn fill(setup: &NodeSetup, inodes: bool) -> PathBuf {
    use std::io::Write;
    let dir = setup.config_dir().join("filler");
    std::fs::create_dir_all(&dir).unwrap();
    if inodes {
        for i in 0.. {
            if std::fs::File::create(dir.join(i.to_string())).is_err() {
                break;
            }
        }
    } else {
        let mut f = std::fs::File::create(dir.join("bytes")).unwrap();
        let block = vec![b'x'; 64 * 1024];
        while f.write_all(&block).is_ok() {}
        while f.write_all(b"x").is_ok() {}
    }
    dir
}

/// A start that meets a full state disk while it writes its files: the retryable `disk_low`
/// refusal (host busy), not a permanent failure; nothing of it is left (no record, no note, no
/// inline image); once space returns the same request starts.
fn a_start_on_a_full_disk_is_refused_retryably(inodes: bool) {
    let mut rig =
        Scenario::new("cyberwave:\n  inference: echo ran >> t/$CYBERWAVE_REQUEST_ID.runs\n")
            .dir("t")
            .rig();
    let Rig { cp, setup, .. } = &mut rig;
    // The admission's own check of free space is off: the start itself meets the full disk.
    setup.set("CYBERWAVE_MIN_FREE_DISK_MB", "0");
    let _disk = Tmpfs::on_state_dir(
        setup,
        if inodes {
            "size=64m,nr_inodes=200,mode=0700"
        } else {
            "size=4m,mode=0700"
        },
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let filler = fill(setup, inodes);
    // An inline image, as a preview sends it: what the start writes first.
    let image = json!({"image_bytes_base64": "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="});
    let start = Start::new("inference", "full").with(image);
    let reply = start.reply(cp, &node);
    assert_eq!(reply["status"], "error", "{reply}");
    let text = error_of(&reply);
    assert!(
        text.starts_with("Controller host is busy with low disk space"),
        "a retryable refusal that says why: {text}"
    );
    let failed = cp
        .wait_status("wl-full", "failed", REPLY)
        .expect("no failed status");
    let failed: Vec<&Value> = failed.iter().filter(|s| s["status"] == "failed").collect();
    assert_eq!(failed[0]["rejection_reason"], "host_busy", "{failed:?}");
    assert_eq!(failed[0]["busy_reason"], "disk_low", "{failed:?}");
    let state = setup.config_dir();
    let left = |sub: &str| -> Vec<String> {
        std::fs::read_dir(state.join(sub))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(left("workloads"), Vec::<String>::new(), "no record left");
    assert_eq!(left("starts"), Vec::<String>::new(), "no note left");
    assert_eq!(left("inputs"), Vec::<String>::new(), "no image left");
    assert_eq!(runs(setup, "full"), "", "nothing ran");
    // Space returns: the same request, retried, starts.
    std::fs::remove_dir_all(&filler).unwrap();
    start.send(cp, &node);
    let again = wait_for(REPLY, || cp.replies_for("full").get(1).cloned())
        .expect("the retried start is not answered");
    assert_eq!(again["status"], "ok", "{again}; log:\n{}", node.log());
    wait_for(REPLY, || (runs(setup, "full") == "ran\n").then_some(()))
        .expect("the retried start did not run");
}

#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_a_start_that_meets_a_full_state_disk_is_refused_retryably_and_leaves_nothing() {
    a_start_on_a_full_disk_is_refused_retryably(false);
}

#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_a_start_that_meets_a_state_disk_out_of_inodes_is_refused_retryably_and_leaves_nothing() {
    a_start_on_a_full_disk_is_refused_retryably(true);
}
