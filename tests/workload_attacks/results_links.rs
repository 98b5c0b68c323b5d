//! D24, D61 and D65: what a workload under `workload_user` can make the node (root) do through the
//! folders it can write — `results_folder`, or the folder above it — by a link, a rename, a race
//! or a hard link, and what workloads under one user could do to each other. Each test is the
//! attack as a workload would run it, and checks that nothing outside `results_folder` changed
//! owner, mode or content and that nothing the workload does not own was uploaded or deleted.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;

use crate::support::scenario::{completion, uploaded};
use crate::support::timeouts::{EXIT, READY, REPLY};
use crate::support::{wait_for, ControlPlane, NodeProcess, Rig, Scenario, Start, TempDir};

/// Throwaway users for one test (`useradd` as root, each with a home of its own), removed with
/// their homes when the test ends.
struct Users {
    names: Vec<String>,
}

impl Users {
    fn new(tag: &str, n: usize) -> Users {
        crate::support::assert_root("to add users");
        let names: Vec<String> = (0..n)
            .map(|i| format!("cw{tag}{}x{i}", std::process::id() % 100_000))
            .collect();
        for name in &names {
            let _ = std::process::Command::new("userdel")
                .args(["-r", name])
                .output();
            // useradd fails while another test holds the passwd lock: tried again.
            let added = wait_for(Duration::from_secs(30), || {
                let out = std::process::Command::new("useradd")
                    .args(["-m", "-s", "/bin/sh", "-K", "HOME_MODE=0700", name])
                    .output()
                    .unwrap();
                if out.status.success() {
                    Some(())
                } else {
                    std::thread::sleep(Duration::from_millis(100));
                    None
                }
            });
            assert!(added.is_some(), "useradd {name} failed");
        }
        Users { names }
    }

    fn name(&self, i: usize) -> &str {
        &self.names[i]
    }

    fn uid(&self, i: usize) -> u32 {
        let out = std::process::Command::new("id")
            .args(["-u", self.name(i)])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }

    /// The pool setting naming them all.
    fn pool(&self) -> String {
        self.names.join(",")
    }
}

impl Drop for Users {
    fn drop(&mut self) {
        for name in &self.names {
            for _ in 0..50 {
                let done = std::process::Command::new("userdel")
                    .args(["-r", "-f", name])
                    .output()
                    .map(|o| o.status.code() != Some(10) && o.status.code() != Some(1))
                    .unwrap_or(true);
                if done {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn chown(path: &Path, uid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(uid)).unwrap();
}

/// A node whose workloads run as `users` (a name or a pool) with `slots` slots and this
/// training script, its results in `results` (relative to its working dir).
fn node_as(users: &str, slots: u32, results: &str, script: &str) -> Rig {
    let indented: String = script.lines().map(|l| format!("    {l}\n")).collect();
    Scenario::new(&format!(
        "cloud_node:\n  workload_user: {users}\n  max_concurrent_workloads: {slots}\ncyberwave:\n  training: |\n{indented}  results_folder: {results}\n"
    ))
    // Only directories every user may search on PATH.
    .env("PATH", "/usr/local/bin:/usr/bin:/bin")
    .rig()
}

/// A folder of root's outside the results folder, holding a file: what an attack must not reach.
struct Outside {
    _dir: TempDir,
    path: PathBuf,
}

impl Outside {
    fn new(tag: &str) -> Outside {
        let dir = TempDir::new(tag);
        let path = dir.join("target");
        std::fs::create_dir(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(path.join("keep.txt"), "root's own\n").unwrap();
        Outside { _dir: dir, path }
    }

    /// Its owner, mode and entries are what they were.
    fn assert_untouched(&self, log: &str) {
        let md = std::fs::metadata(&self.path).unwrap();
        assert_eq!(
            (md.uid(), md.gid(), md.mode() & 0o7777),
            (0, 0, 0o755),
            "the folder outside changed owner or mode\n{log}"
        );
        let mut entries: Vec<String> = std::fs::read_dir(&self.path)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        entries.sort();
        assert_eq!(entries, ["keep.txt"], "{log}");
        let keep = std::fs::metadata(self.path.join("keep.txt")).unwrap();
        assert_eq!((keep.uid(), keep.mode() & 0o777), (0, 0o644), "{log}");
    }
}

/// Starts `rid` and waits for its completion.
fn run(cp: &ControlPlane, node: &NodeProcess, rid: &str) -> serde_json::Value {
    let w = Start::training(rid);
    w.ok(cp, node);
    w.completion(cp)
}

/// D65: a workload plants a symlink named like the next request id in `results_folder`
/// (pointing at a folder of root's). The node (root) must not make the next workload's results
/// folder through it, nor change the folder it points at: the folder is made with `mkdirat`
/// from a descriptor, so a name that exists is refused, never followed.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g10_d65_a_link_named_like_the_next_request_id_reaches_nothing_outside() {
    let users = Users::new("ln", 1);
    let outside = Outside::new("ln");
    let rig = node_as(
        users.name(0),
        1,
        "out",
        &format!(
            "if [ \"$CYBERWAVE_REQUEST_ID\" = plant ]; then ln -s {} out/victim; fi",
            outside.path.display()
        ),
    );
    let Rig { cp, setup, .. } = &rig;
    let out = setup.cwd.join("out");
    std::fs::create_dir(&out).unwrap();
    chown(&out, users.uid(0));
    let node = setup.spawn();
    node.wait_ready(READY);
    run(cp, &node, "plant");
    let done = run(cp, &node, "victim");
    assert_eq!(done["success"], true, "{done}");
    outside.assert_untouched(&node.log());
    assert!(
        std::fs::symlink_metadata(out.join("victim"))
            .unwrap()
            .file_type()
            .is_symlink(),
        "the planted link is left as it was"
    );
    node.assert_logged("cannot create the results folder");
}

/// D65, the race: a concurrent workload watches `results_folder` and swaps every new folder for
/// a link to a folder of root's as soon as it appears (ids it cannot guess do not help). Every
/// step after the `mkdirat` is on the folder's own descriptor, so root never hands the link's
/// target over (a path-based step would, about once in 7 starts).
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g10_d65_a_race_swapping_new_results_folders_for_links_reaches_nothing_outside() {
    let users = Users::new("race", 1);
    let outside = Outside::new("race");
    let racer = format!(
        concat!(
            "import os\n",
            "seen = set(os.listdir('out'))\n",
            "open('racing', 'w').close()\n",
            "while not os.path.exists('stop'):\n",
            "    for n in os.listdir('out'):\n",
            "        if n in seen or n.startswith('.'):\n",
            "            continue\n",
            "        seen.add(n)\n",
            "        try:\n",
            "            os.rename('out/' + n, 'out/.moved-' + n)\n",
            "            os.symlink('{}', 'out/' + n)\n",
            "        except OSError:\n",
            "            pass\n",
        ),
        outside.path.display()
    );
    let rig = node_as(
        users.name(0),
        2,
        "out",
        "if [ \"$CYBERWAVE_REQUEST_ID\" = racer ]; then python3 racer.py; fi",
    );
    let Rig { cp, setup, .. } = &rig;
    setup.write("racer.py", &racer);
    let out = setup.cwd.join("out");
    std::fs::create_dir(&out).unwrap();
    chown(&out, users.uid(0));
    chown(&setup.cwd, users.uid(0));
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::training("racer").ok(cp, &node);
    assert!(
        wait_for(REPLY, || setup.cwd.join("racing").exists().then_some(())).is_some(),
        "{}",
        node.log()
    );
    for i in 0..30 {
        let w = Start::training(&format!("v{i}"));
        w.ok(cp, &node);
        w.completion(cp);
    }
    std::fs::write(setup.cwd.join("stop"), "").unwrap();
    completion(cp, "wl-racer");
    outside.assert_untouched(&node.log());
}

/// D65: a workload that can write the folder above `results_folder` replaces `results` with a
/// link to a folder of root's. The node must not make the next workload's results folder inside
/// it, owned by the workload user: a link there that another user could have planted is not
/// followed.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g10_d65_a_results_folder_swapped_for_a_link_makes_nothing_outside() {
    let users = Users::new("sw", 1);
    let outside = Outside::new("sw");
    let rig = node_as(
        users.name(0),
        1,
        "shared/results",
        &format!(
            concat!(
                "if [ \"$CYBERWAVE_REQUEST_ID\" = plant ]; then mv shared/results shared/moved && ln -s {} shared/results; exit; fi\n",
                "touch shared/running; while [ ! -f go ]; do sleep 0.02; done",
            ),
            outside.path.display()
        ),
    );
    let Rig { cp, setup, .. } = &rig;
    let shared = setup.cwd.join("shared");
    std::fs::create_dir(&shared).unwrap();
    chown(&shared, users.uid(0));
    let node = setup.spawn();
    node.wait_ready(READY);
    run(cp, &node, "plant");
    assert!(std::fs::symlink_metadata(shared.join("results"))
        .unwrap()
        .file_type()
        .is_symlink());
    // Looked at while the victim runs (once it ends, an empty folder of its is removed again).
    Start::training("victim").ok(cp, &node);
    let running = shared.join("running");
    assert!(wait_for(REPLY, || running.exists().then_some(())).is_some());
    outside.assert_untouched(&node.log());
    std::fs::write(setup.cwd.join("go"), "").unwrap();
    let done = completion(cp, "wl-victim");
    assert_eq!(done["success"], true, "{done}");
    outside.assert_untouched(&node.log());
}

/// D65: a folder already there under a request id's name (an operator's, root-only) is not
/// handed over to the workload of that id (chowned to the workload user), nor are its files
/// uploaded or deleted as its results.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g10_d65_a_folder_already_named_like_the_request_id_is_not_handed_over() {
    let users = Users::new("ex", 1);
    let rig = node_as(users.name(0), 1, "out", "true");
    let Rig { cp, setup, .. } = &rig;
    let out = setup.cwd.join("out");
    let keep = out.join("keep");
    std::fs::create_dir_all(&keep).unwrap();
    chown(&out, users.uid(0));
    std::fs::set_permissions(&keep, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(keep.join("model.bin"), "the operator's model").unwrap();
    std::fs::set_permissions(
        keep.join("model.bin"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let node = setup.spawn();
    node.wait_ready(READY);
    let done = run(cp, &node, "keep");
    assert_eq!(done["success"], true, "{done}");
    let md = std::fs::metadata(&keep).unwrap();
    assert_eq!(
        (md.uid(), md.mode() & 0o7777),
        (0, 0o700),
        "handed over\n{}",
        node.log()
    );
    assert_eq!(
        std::fs::read_to_string(keep.join("model.bin")).unwrap(),
        "the operator's model"
    );
    assert!(
        uploaded(cp, "wl-keep").is_empty(),
        "{:?}",
        cp.uploads().keys()
    );
}

/// D65 with one slot: a workload renames a root-only file of the operator's (one it cannot
/// read, in a folder it can write) into `results_folder`. The rename makes it look new (its
/// status-change time), yet it is neither uploaded nor deleted: a result must be the workload
/// user's own.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g10_d65_a_root_only_file_renamed_into_the_results_folder_is_neither_uploaded_nor_deleted() {
    let users = Users::new("mv", 1);
    let rig = node_as(users.name(0), 1, "out", "mv drop/secret.txt out/secret.txt");
    let Rig { cp, setup, .. } = &rig;
    let out = setup.cwd.join("out");
    let drop = setup.cwd.join("drop");
    for d in [&out, &drop] {
        std::fs::create_dir(d).unwrap();
        chown(d, users.uid(0));
    }
    std::fs::write(drop.join("secret.txt"), "operator secret").unwrap();
    std::fs::set_permissions(
        drop.join("secret.txt"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let node = setup.spawn();
    node.wait_ready(READY);
    let done = run(cp, &node, "mv");
    assert_eq!(done["success"], true, "{done}");
    assert!(
        cp.uploads().values().all(|v| v != b"operator secret"),
        "the operator's file was uploaded\n{}",
        node.log()
    );
    assert_eq!(
        std::fs::read_to_string(out.join("secret.txt")).unwrap_or_default(),
        "operator secret",
        "the operator's file was deleted\n{}",
        node.log()
    );
}

/// D65 with one slot: a hard link to a root-only file put into `results_folder` while the
/// workload runs (its own `ln` where `fs.protected_hardlinks=0`, the kernel's default; where
/// the host forbids it, the test makes the link in its stead). The file is neither uploaded nor
/// the link deleted: a result must have a single link.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g10_d65_a_hard_link_to_a_root_only_file_is_neither_uploaded_nor_deleted() {
    let users = Users::new("hl", 1);
    let secret_dir = TempDir::new("hl-secret");
    let secret = secret_dir.join("secret.txt");
    std::fs::write(&secret, "operator secret").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let rig = node_as(
        users.name(0),
        1,
        "out",
        &format!(
            "ln {} out/leak.txt 2>/dev/null || {{ touch out/.want-link; while [ ! -f linked ]; do sleep 0.02; done; }}",
            secret.display()
        ),
    );
    let Rig { cp, setup, .. } = &rig;
    let out = setup.cwd.join("out");
    std::fs::create_dir(&out).unwrap();
    chown(&out, users.uid(0));
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::training("hl").ok(cp, &node);
    let asked = wait_for(REPLY, || {
        (out.join(".want-link").exists() || out.join("leak.txt").exists()).then_some(())
    });
    assert!(asked.is_some(), "{}", node.log());
    if out.join(".want-link").exists() {
        std::fs::remove_file(out.join(".want-link")).unwrap();
        std::fs::hard_link(&secret, out.join("leak.txt")).unwrap();
        std::fs::write(setup.cwd.join("linked"), "").unwrap();
    }
    let done = completion(cp, "wl-hl");
    assert_eq!(done["success"], true, "{done}");
    assert!(
        cp.uploads().values().all(|v| v != b"operator secret"),
        "the operator's file was uploaded\n{}",
        node.log()
    );
    assert!(out.join("leak.txt").exists(), "the link was deleted");
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "operator secret");
}

/// D65: workloads under one pool run as distinct uids: one cannot read another's environment
/// (its token and event token: so it cannot emit as it either) or params, nor plant a
/// `usercustomize.py` in its HOME that runs inside it (workloads of one user could do all this).
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_d65_workloads_of_a_pool_cannot_reach_each_other() {
    let users = Users::new("pool", 2);
    let shared = TempDir::new("pool-shared");
    std::fs::set_permissions(shared.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let s = shared.path().display().to_string();
    let rig = node_as(
        &users.pool(),
        2,
        "out",
        &format!(
            concat!(
                "if [ \"$CYBERWAVE_REQUEST_ID\" = victim ]; then\n",
                "  echo $$ > {s}/victim.pid.tmp; mv {s}/victim.pid.tmp {s}/victim.pid\n",
                "  python3 -m site --user-site > {s}/victim.site\n",
                "  while [ ! -f {s}/attacked ]; do sleep 0.02; done\n",
                "  python3 -c pass\n",
                "else\n",
                "  while [ ! -f {s}/victim.pid ]; do sleep 0.02; done\n",
                "  pid=$(cat {s}/victim.pid)\n",
                "  try() {{ if \"$@\" > /dev/null 2>&1; then echo \"$1 $2: allowed\"; else echo \"$1 $2: refused\"; fi; }}\n",
                "  try cat /proc/$pid/environ > {s}/attempts\n",
                "  cat /proc/$pid/environ > {s}/environ 2>/dev/null\n",
                "  try cat \"$(dirname \"$CYBERWAVE_PARAMS_FILE\")/../victim/params.json\" >> {s}/attempts\n",
                "  site=$(cat {s}/victim.site)\n",
                "  try mkdir -p \"$site\" >> {s}/attempts\n",
                "  echo \"open('{s}/planted-ran', 'w').close()\" > \"$site/usercustomize.py\" 2>/dev/null\n",
                "  id -u > {s}/attacker.uid\n",
                "  touch {s}/attacked\n",
                "fi\n",
            ),
            s = s
        ),
    );
    let Rig { cp, setup, .. } = &rig;
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::training("victim")
        .with(json!({"cyberwave_workload_token": "victim-secret-token-0123", "note": "victim-param-secret"}))
        .ok(cp, &node);
    Start::training("attacker").ok(cp, &node);
    for wl in ["wl-victim", "wl-attacker"] {
        let done = completion(cp, wl);
        assert_eq!(done["success"], true, "{wl}: {done}\n{}", node.log());
    }
    let read = |f: &str| std::fs::read_to_string(shared.join(f)).unwrap_or_default();
    let attempts = read("attempts");
    assert_eq!(attempts.lines().count(), 3, "{attempts}");
    assert!(!attempts.contains("allowed"), "{attempts}");
    assert!(!read("environ").contains("victim-secret-token-0123"));
    assert!(
        !shared.join("planted-ran").exists(),
        "the planted usercustomize ran"
    );
    assert_eq!(read("attacker.uid").trim(), users.uid(1).to_string());
    node.assert_logged("a pool of 2 users");
}

/// D65: a re-adopted workload keeps its uid of the pool after a node restart, and the next
/// start gets the other one.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_d65_a_readopted_workload_keeps_its_uid_of_the_pool() {
    let users = Users::new("keep", 2);
    let shared = TempDir::new("keep-shared");
    std::fs::set_permissions(shared.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let s = shared.path().display().to_string();
    let rig = node_as(
        &users.pool(),
        2,
        "out",
        &format!(
            "id -u > {s}/$CYBERWAVE_REQUEST_ID.uid\nwhile [ ! -f {s}/go ]; do sleep 0.02; done"
        ),
    );
    let Rig { cp, setup, .. } = &rig;
    let mut node = setup.spawn();
    node.wait_ready(READY);
    Start::training("first").ok(cp, &node);
    // `id -u > file` makes the file before it writes: wait for its line.
    let written = |p: &Path| {
        wait_for(REPLY, || {
            let text = std::fs::read_to_string(p).ok()?;
            text.ends_with('\n').then_some(())
        })
        .is_some()
    };
    let first = shared.join("first.uid");
    assert!(written(&first));
    node.kill9();
    let node = setup.spawn();
    node.wait_ready(READY);
    Start::training("second").ok(cp, &node);
    let second = shared.join("second.uid");
    assert!(written(&second));
    std::fs::write(shared.join("go"), "").unwrap();
    let uid = |p: &Path| std::fs::read_to_string(p).unwrap().trim().to_string();
    assert_eq!(uid(&first), users.uid(0).to_string());
    assert_eq!(uid(&second), users.uid(1).to_string(), "{}", node.log());
    completion(cp, "wl-second");
}

/// D65: a pool of two or more users smaller than `max_concurrent_workloads` is refused at start
/// (exit 2), saying why.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_d65_a_pool_smaller_than_the_slots_is_refused_at_start() {
    let users = Users::new("small", 2);
    let rig = node_as(&users.pool(), 3, "out", "true");
    let Rig { setup, .. } = &rig;
    let mut node = setup.spawn();
    node.assert_exit(2, EXIT);
    node.assert_logged("fewer than max_concurrent_workloads");
}

/// D65: with a workload user the state dir is opened to others (0711), so a `.env` or
/// `credentials.json` there that group or others may read (the node's token) is refused at
/// start (exit 2), naming the file and the `chmod` to run, rather than leave the token readable
/// by the workload user and every local user.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn g13_d65_a_readable_token_file_in_the_state_dir_is_refused_with_a_workload_user() {
    crate::support::assert_root("to run workloads as nobody");
    for name in [".env", "credentials.json"] {
        let rig =
            Scenario::new("cloud_node:\n  workload_user: nobody\ncyberwave:\n  training: true\n")
                .rig();
        let Rig { setup, .. } = &rig;
        let state = setup.config_dir();
        std::fs::create_dir_all(&state).unwrap();
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
        let file = state.join(name);
        let text = if name == ".env" {
            "CYBERWAVE_SOMETHING=1\n"
        } else {
            "{}"
        };
        std::fs::write(&file, text).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut node = setup.spawn();
        assert_eq!(
            node.wait_exit(EXIT),
            Some(Some(2)),
            "{name}: {}",
            node.log()
        );
        let want = format!("chmod 600 {}", file.display());
        assert!(node.log().contains(&want), "{name}: {}", node.log());
    }
}

/// D24, nothing outside is written because of a request: a workload that replaces its own
/// results folder with a symlink to another folder (`rmdir $CYBERWAVE_RESULTS_DIR; ln -s …`) is
/// not uploaded, and the node's cleanup of empty folders does not follow the link to delete the
/// empty folders below its target, outside the results folder.
#[test]
fn g5_d24_cleanup_does_not_follow_a_results_folder_replaced_by_a_symlink() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  training: rmdir \"$CYBERWAVE_RESULTS_DIR\" && ln -s \"$PWD/keep\" \"$CYBERWAVE_RESULTS_DIR\"\n  results_folder: out\n",
    )
    .dir("keep/empty/deeper")
    .node();
    let keep = rig.work("keep/empty/deeper");
    let w = Start::training("ln");
    w.ok(&rig.cp, &node);
    w.completion(&rig.cp);
    assert!(
        keep.exists(),
        "the node deleted {} (outside the results folder) through a symlink the workload planted",
        keep.display()
    );
}
