//! How a command template runs: always as `bash -c TEMPLATE`, the params handed over as a file
//! (`{body}`) and never through a shell (guarantee 5); a plain word list is exec'd by bash in its
//! own place (D71); a `.py` module value calls the type's function with the params; `validate`
//! shows every template and warns of a `{body}` a shell would not pass on (D63).

use std::path::Path;

use serde_json::{json, Value};

use crate::support::node::NodeSetup;
use crate::support::scenario::completion;
use crate::support::timeouts::{DONE, REPLY};
use crate::support::{procs, wait_for, ControlPlane, NodeProcess, Rig, Scenario, Start};

/// Every path below `dir`, folders included.
fn files_below(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            out.push(p.display().to_string());
            if p.is_dir() {
                out.extend(files_below(&p));
            }
        }
    }
    out
}

/// Writes an executable script (making its folder).
fn executable(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
}

/// A `bash` first in the workloads' PATH that notes each command it is given, then is bash.
fn noting_bash(setup: &mut NodeSetup) -> std::path::PathBuf {
    let dir = setup.home.join("fakebin");
    let notes = setup.home.join("bash.notes");
    let script = format!(
        "#!/bin/sh\nprintf '%s\\n' \"$*\" >> '{}'\nexec /bin/bash \"$@\"\n",
        notes.display()
    );
    executable(&dir.join("bash"), &script);
    setup.path_first(&dir);
    notes
}

/// Starts workload `rid` of this kind and waits for its completion.
fn run(cp: &ControlPlane, node: &NodeProcess, kind: &str, rid: &str) {
    let w = Start::new(kind, rid);
    w.ok(cp, node);
    w.completion(cp);
}

/// What workload `rid` (of whichever kind) wrote to its stdout.
fn stdout_of(rig: &Rig, rid: &str) -> String {
    let logs = rig.state("workload_logs");
    let name = std::fs::read_dir(&logs)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n.contains(rid) && n.ends_with(".stdout.log")
        })
        .unwrap_or_else(|| panic!("no stdout log for {rid} in {}", logs.display()));
    std::fs::read_to_string(name).unwrap()
}

#[test]
fn g5_hostile_params_reach_the_workload_intact_and_never_a_shell() {
    let rig = Scenario::new("cyberwave:\n  inference: mkdir -p got && cp {body} \"got/$(date +%s%N).json\"\n  max_concurrent_workloads: 8\n").rig();
    let node = rig.node();
    let values = [
        json!("it's \"quoted\""),
        json!("$(touch canary)"),
        json!("`touch canary2`"),
        json!("line1\nline2; touch canary3"),
        json!("ünïcødé ✅ 🚀"),
        json!("x".repeat(1024 * 1024)),
    ];
    let params = json!({"workload_uuid": "wl-hostile", "a": values[0], "b": values[1], "c": values[2], "d": values[3], "e": values[4], "f": values[5], "cyberwave_workload_token": "cw_workload_secret"});
    let r = Start::new("inference", "hostile")
        .params(params.clone())
        .reply(&rig.cp, &node);
    assert_eq!(r["status"], "ok", "{r}");
    completion(&rig.cp, "wl-hostile");
    let got_dir = rig.work("got");
    let files = files_below(&got_dir);
    assert_eq!(files.len(), 1, "{files:?}");
    let received: Value =
        serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap_or_default())
            .unwrap_or_default();
    let mut expected = params;
    expected
        .as_object_mut()
        .map(|m| m.remove("cyberwave_workload_token"));
    assert_eq!(
        received, expected,
        "params reach the workload unchanged, token removed"
    );
    for c in ["canary", "canary2", "canary3"] {
        assert!(
            !rig.work(c).exists(),
            "{c} was created: request data reached a shell"
        );
    }
    // Hostile request ids create nothing outside the state dir.
    let home = rig.setup.home.path().to_path_buf();
    let before: Vec<String> = files_below(&home)
        .into_iter()
        .filter(|f| !f.contains("/.cyberwave/") && !f.contains("/got"))
        .collect();
    let long = "y".repeat(10_000);
    for (i, rid) in ["../../x", "/etc/cw-hostile-x", &long, "a\u{0}b", "..", "."]
        .iter()
        .enumerate()
    {
        rig.cp.command(&node.uuid(), json!({"command": "inference", "request_id": rid, "params": {"workload_uuid": format!("wl-id-{i}")}}));
        let r = rig
            .cp
            .wait_reply(rid, REPLY)
            .unwrap_or_else(|| panic!("no reply for id #{i}"));
        assert_eq!(r["status"], "ok", "{r}");
        completion(&rig.cp, &format!("wl-id-{i}"));
    }
    let after: Vec<String> = files_below(&home)
        .into_iter()
        .filter(|f| !f.contains("/.cyberwave/") && !f.contains("/got"))
        .collect();
    assert_eq!(before, after, "files appeared outside the state dir");
    assert!(!Path::new("/etc/cw-hostile-x").exists());
    for f in files_below(&home.join(".cyberwave/workload_logs")) {
        let name = Path::new(&f)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        assert!(name.len() < 100 && !name.starts_with('.'), "{name}");
    }
}

#[test]
fn module_values_call_the_python_function_with_the_params() {
    let rig = Scenario::new(
        "cyberwave:\n  training: train.py\n  inference: broken.py\n  simulate: missing.py\n  max_concurrent_workloads: 4\n",
    )
    .rig();
    // A sibling import proves the module's folder is on sys.path.
    rig.setup
        .write("helper.py", "def double(x):\n    return 2 * x\n");
    rig.setup.write(
        "train.py",
        "import os, sys, time\nfrom helper import double\n\ndef train(**params):\n    print('kwargs', sorted(params), flush=True)\n    print('token', os.environ.get('CYBERWAVE_API_KEY'), flush=True)\n    if params.get('sleep'):\n        time.sleep(params['sleep'])\n    if params.get('boom'):\n        raise ValueError('boom: ' + params['boom'])\n    return {'doubled': double(params['n'])}\n",
    );
    rig.setup
        .write("broken.py", "def train(**params):\n    return 1\n");
    let node = rig.node();

    // Platform keys and workflow keys are not arguments; the workload token is the credential.
    let params = json!({"workload_uuid": "wl-mod", "n": 21, "note": "it's $(touch canary)",
        "workflow_uuid": "wf-1", "workflow_execution_uuid": "ex-1", "workflow_node_uuid": "n-1",
        "command_type": "training", "status": "x", "cyberwave_workload_token": "cw_workload_tok"});
    let r = Start::new("training", "m-ok")
        .params(params)
        .reply(&rig.cp, &node);
    assert_eq!(r["status"], "ok", "{r}");
    let done = completion(&rig.cp, "wl-mod");
    assert_eq!(done["success"], true, "{done}");
    assert!(
        node.wait_stdout("[workload wl-mod stdout] {\"doubled\": 42}\n", REPLY),
        "{}",
        node.stdout()
    );
    let out = node.stdout();
    assert!(
        out.contains("[workload wl-mod stdout] kwargs ['n', 'note']\n"),
        "{out}"
    );
    assert!(
        out.contains("[workload wl-mod stdout] token cw_workload_tok\n"),
        "{out}"
    );
    assert!(!rig.work("canary").exists());
    assert!(
        !rig.work("__pycache__").exists(),
        "no bytecode left in the working dir"
    );

    // The function's exception fails the workload with exit code 1 and names the error.
    Start::new("training", "m-boom")
        .params(json!({"workload_uuid": "wl-boom", "n": 1, "boom": "bad input"}))
        .reply(&rig.cp, &node);
    let boom = completion(&rig.cp, "wl-boom");
    assert_eq!(boom["success"], false);
    assert_eq!(boom["exit_code"], 1);
    assert_eq!(boom["error"], "ValueError: boom: bad input", "{boom}");

    // A module without the type's function says what to add.
    Start::new("inference", "m-nofn")
        .workload("wl-nofn")
        .reply(&rig.cp, &node);
    let nofn = completion(&rig.cp, "wl-nofn");
    assert_eq!(nofn["exit_code"], 2);
    assert_eq!(
        nofn["error"],
        "Module broken.py does not export infer(). Add 'def infer(**params): ...' to the module."
    );

    // A missing file is refused before anything starts, without a local path.
    rig.cp.command(&node.uuid(), json!({"command": "simulate", "request_id": "m-missing", "params": {"workload_uuid": "wl-missing"}}));
    let r = rig.cp.wait_reply("m-missing", REPLY).expect("reply");
    assert_eq!(r["status"], "error");
    assert_eq!(
        r["error"],
        "Failed to start simulate: Module not found: missing.py. Check 'simulate: missing.py' in cyberwave.yml.",
        "{r}"
    );

    // Module workloads are tracked like any other: busy, listed and cancellable.
    let r = Start::new("training", "m-long")
        .params(json!({"workload_uuid": "wl-long", "n": 1, "sleep": 30}))
        .reply(&rig.cp, &node);
    let pid = r["output"]["pid"].as_i64().unwrap_or(0);
    assert!(pid > 0 && procs::exists(pid), "{r}");
    rig.cp.command(&node.uuid(), json!({"command": "cancel", "request_id": "m-cancel", "params": {"workload_request_id": "m-long"}}));
    assert_eq!(
        rig.cp.wait_reply("m-cancel", REPLY).expect("cancel")["status"],
        "ok"
    );
    let long = rig
        .cp
        .wait_status("wl-long", "failed", DONE)
        .expect("cancelled");
    assert_eq!(
        long[1]["message"], "Workload cancelled by SIGTERM",
        "{long:?}"
    );
    assert!(wait_for(REPLY, || (!procs::exists(pid)).then_some(())).is_some());
}

/// A plain template goes through `bash -c` (the noting bash sees it), and bash execs the
/// program in its own place: the pid the node reports is the program's, its parent is the
/// supervisor (no bash waits in between), its argv is the template's words, and its exit code is
/// the completion's. Shell syntax runs as ever.
#[test]
fn a_plain_template_runs_through_bash_which_execs_the_program_in_its_place() {
    let mut rig = Scenario::default().dir("t").rig();
    let setup = &mut rig.setup;
    let notes = noting_bash(setup);
    executable(
        &setup.cwd.join("t/show"),
        "#!/bin/sh\necho \"pid $$\"\ntr '\\0' ' ' < /proc/$PPID/cmdline; echo\nprintf '<%s>\\n' \"$0\" \"$@\"\nexit 5\n",
    );
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  inference: ./t/show a,b --x=1 /c@d%e+f:g\n  training: touch t/shell.ran; true\n",
    );
    let node = rig.node();
    let w = Start::new("inference", "plain1");
    let reply = w.ok(&rig.cp, &node);
    let done = w.completion(&rig.cp);
    assert_eq!(done["exit_code"], 5, "{done}");
    let out = rig.stdout_of("inference", "plain1");
    let mut lines = out.lines();
    let pid: Option<i64> = lines
        .next()
        .and_then(|l| l.strip_prefix("pid "))
        .and_then(|p| p.parse().ok());
    assert_eq!(
        pid,
        reply["output"]["pid"].as_i64(),
        "the reported pid is the program's: {out}"
    );
    let parent = lines.next().unwrap_or_default();
    assert!(
        parent.contains("cyberwave-cloud-node"),
        "its parent is the supervisor, no bash in between: {out}"
    );
    let argv: Vec<&str> = lines.collect();
    assert_eq!(argv, ["<./t/show>", "<a,b>", "<--x=1>", "</c@d%e+f:g>"]);
    run(&rig.cp, &node, "training", "shell1");
    assert!(rig.work("t/shell.ran").exists(), "{}", node.log());
    let noted = std::fs::read_to_string(&notes).unwrap_or_default();
    assert!(
        noted.contains("-c ./t/show a,b --x=1 /c@d%e+f:g"),
        "a plain template goes through bash: {noted:?}"
    );
    assert!(
        noted.contains("-c touch t/shell.ran; true"),
        "shell syntax goes through bash: {noted:?}"
    );
}

/// A plain template and one with shell syntax (`#`) see the same environment: the one bash
/// gives (its `_`, its shell level, no `OLDPWD` that is no directory), whatever the node was
/// started with.
#[test]
fn a_plain_argv_workload_gets_the_environment_bash_would_give_it() {
    let mut rig = Scenario::default().dir("t").rig();
    let setup = &mut rig.setup;
    let env = ["/usr/bin/env", "/bin/env"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("env installed");
    // What a node started from a login shell has: a PWD that is not its working directory,
    // a shell level, an OLDPWD that is no directory and a `_` of its own.
    setup.set("PWD", "/");
    setup.set("SHLVL", "2");
    setup.set("OLDPWD", "/nonexistent-old-pwd");
    setup.set("_", "/usr/bin/whatever");
    setup.write(
        "cyberwave.yml",
        &format!("cyberwave:\n  inference: {env}\n  training: {env} # through bash\n"),
    );
    let node = rig.node();
    run(&rig.cp, &node, "inference", "envplain");
    run(&rig.cp, &node, "training", "envbash");
    let lines = |rid: &str| {
        let mut v: Vec<String> = stdout_of(&rig, rid)
            .lines()
            // The per-workload ones differ by design.
            .filter(|l| {
                !["CYBERWAVE_", "NVIDIA_", "CUDA_"]
                    .iter()
                    .any(|p| l.starts_with(p))
            })
            .map(String::from)
            .collect();
        v.sort();
        v
    };
    let plain = lines("envplain");
    let bash = lines("envbash");
    assert_eq!(plain, bash);
    assert!(plain.iter().any(|l| l == &format!("_={env}")), "{plain:?}");
    assert!(plain.iter().any(|l| l == "SHLVL=2"), "{plain:?}");
    assert!(!plain.iter().any(|l| l.starts_with("OLDPWD=")), "{plain:?}");
}

/// D46.1 for a plain template (exec'd by bash in its own place): the workload holds no
/// descriptor of the node (its broker socket, its lock). `ls` lists its own descriptors; the
/// only one beyond its three streams is the directory it is reading.
#[test]
fn g13_a_plain_argv_workload_holds_no_descriptor_of_the_node() {
    let mut rig = Scenario::default().dir("t").rig();
    let setup = &mut rig.setup;
    let notes = noting_bash(setup);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  inference: ls -l /proc/self/fd\n",
    );
    let node = rig.node();
    run(&rig.cp, &node, "inference", "fdplain");
    let noted = std::fs::read_to_string(&notes).unwrap_or_default();
    assert!(
        noted.contains("-c ls -l /proc/self/fd"),
        "went through bash: {noted:?}"
    );
    let listing = stdout_of(&rig, "fdplain");
    let foreign: Vec<&str> = listing
        .lines()
        .filter_map(|l| l.split_once(" -> "))
        .filter(|(left, target)| {
            let n = left.split_whitespace().last().unwrap_or("");
            !matches!(n, "0" | "1" | "2") && !target.starts_with("/proc/")
        })
        .map(|(_, target)| target)
        .collect();
    assert!(
        foreign.is_empty(),
        "the workload inherited descriptors of the node: {foreign:?}\n{listing}"
    );
    assert!(!listing.contains("socket:"), "{listing}");
}

/// The supervisor execs bash by name, searched in the workloads' PATH: where the first `bash`
/// cannot be exec'd (it names a missing interpreter), the next one runs the command.
#[test]
fn a_bash_in_path_that_cannot_be_run_leaves_the_next_one_to_run_the_command() {
    let mut rig = Scenario::default().dir("t").rig();
    let setup = &mut rig.setup;
    let notes = noting_bash(setup);
    let broken = setup.home.join("brokenbin");
    executable(&broken.join("bash"), "#!/nonexistent/interpreter\n");
    setup.path_first(&broken);
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  training: touch t/shell.ran; true\n",
    );
    let node = rig.node();
    run(&rig.cp, &node, "training", "shell2");
    assert!(rig.work("t/shell.ran").exists(), "{}", node.log());
    let noted = std::fs::read_to_string(&notes).unwrap_or_default();
    assert!(
        noted.contains("-c touch t/shell.ran; true"),
        "the next bash in PATH ran it: {noted:?}"
    );
}

/// D25 / D51 / D46.1 for a plain template, from a real supervisor (which blocks the node's
/// handled signals): the program bash execs leads its own process group, has no signal blocked
/// and none of 1–31 ignored, and holds only its three streams.
#[test]
fn g13_a_plain_template_leads_its_group_with_no_signal_blocked_or_ignored() {
    let (rig, node) = Scenario::new(
        "cyberwave:\n  training: cat /proc/self/status\n  inference: ls -l /proc/self/fd\n",
    )
    .node();
    let st = Start::training("vst");
    st.ok(&rig.cp, &node);
    assert_eq!(st.completion(&rig.cp)["exit_code"], 0, "{}", node.log());
    let status = rig.stdout_of("training", "vst");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .unwrap_or_else(|| panic!("{status}"))
            .to_string()
    };
    assert_eq!(field("Name:"), "cat", "{status}");
    assert_eq!(field("Pid:"), field("NSpgid:"), "its own group: {status}");
    assert_eq!(field("SigBlk:"), "0000000000000000", "{status}");
    let ignored = u64::from_str_radix(&field("SigIgn:"), 16).unwrap();
    assert_eq!(ignored & 0x7fff_ffff, 0, "{status}");
    let fd = Start::new("inference", "vfd");
    fd.ok(&rig.cp, &node);
    assert_eq!(fd.completion(&rig.cp)["exit_code"], 0, "{}", node.log());
    let listing = rig.stdout_of("inference", "vfd");
    let numbers: Vec<&str> = listing
        .lines()
        .filter_map(|l| l.split_once(" -> ")?.0.split_whitespace().last())
        .collect();
    assert_eq!(numbers, ["0", "1", "2", "3"], "{listing}");
}

/// The snap-served model's manifest: its inference posts `{body}` with `curl -d '{body}'`, which
/// sends the params file's path as text. `validate` says so (still valid: the platform accepts
/// it) and shows the whole template, every line; `start` says so in its log.
#[test]
fn d63_a_curl_template_with_body_in_quotes_is_warned_about_by_validate_and_at_start() {
    let rig = Scenario::new(
        "# A model served from a snap.\ncyberwave-cloud-node:\n  profile_slug: openvla-oft\n  install_script: ./install.sh\n  inference: |\n    curl -sf -X POST http://localhost:8080/act \\\n      -H \"Content-Type: application/json\" \\\n      -d '{body}'\n",
    )
    .rig();
    let install = rig.write("install.sh", "#!/bin/sh\nexit 0\n");
    std::fs::set_permissions(
        &install,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let out = rig.setup.run(&["validate"]);
    assert_eq!(out.code, Some(0), "{}", out.stdout);
    let warning = out
        .stdout
        .lines()
        .find(|l| l.contains("warning: inference:"))
        .unwrap_or_else(|| panic!("no warning: {}", out.stdout));
    assert!(warning.contains("cyberwave.yml:5:"), "{warning}");
    assert!(
        warning.contains("`{body}` inside single quotes (line 3 of the template)"),
        "{warning}"
    );
    assert!(warning.contains("path as text, not the JSON"), "{warning}");
    assert!(warning.contains("`-d @{body}`"), "{warning}");
    for line in [
        "    curl -sf -X POST http://localhost:8080/act \\",
        "      -H \"Content-Type: application/json\" \\",
        "      -d '{body}'",
    ] {
        assert!(
            out.stdout.lines().any(|l| l == line),
            "{line}: {}",
            out.stdout
        );
    }
    out.assert_stdout("OK (1 warning)");

    let node = rig.node();
    assert!(
        node.log()
            .lines()
            .any(|l| l.contains("WARN") && l.contains("`{body}` inside single quotes")),
        "{}",
        node.log()
    );
}

/// The SmolVLA manifest's templates (`source …/activate && \` then `python … {body}`): no
/// warning, and `validate` shows both lines of each, not only the `source` line.
#[test]
fn d63_validate_shows_every_line_of_a_multi_line_template() {
    let rig = Scenario::default().rig();
    let setup = &rig.setup;
    setup.write(
        "cyberwave.yml",
        "cyberwave-cloud-node:\n  install_script: ./install.sh\n  inference: |\n    source \"$HOME/.venv/smolvla/bin/activate\" && \\\n    python preview.py {body}\n  training: |\n    source \"$HOME/.venv/smolvla/bin/activate\" && \\\n    python train.py {body}\n  results_folder: ./runs/artifacts\n  upload_results: true\n  profile_slug: smolvla-policy-preview\n",
    );
    setup.write("install.sh", "#!/bin/sh\nexit 0\n");
    let out = setup.run(&["validate"]);
    assert_eq!(out.code, Some(0), "{}", out.stdout);
    assert!(!out.stdout.contains("warning:"), "{}", out.stdout);
    let lines: Vec<&str> = out.stdout.lines().collect();
    for (kind, script) in [("inference", "preview.py"), ("training", "train.py")] {
        let at = lines
            .iter()
            .position(|l| *l == format!("  {kind}: [shell mode]"))
            .unwrap_or_else(|| panic!("{kind}: {}", out.stdout));
        assert_eq!(
            lines.get(at + 1..at + 3),
            Some(
                &[
                    "    source \"$HOME/.venv/smolvla/bin/activate\" && \\",
                    &*format!("    python {script} {{body}}"),
                ][..]
            ),
            "{}",
            out.stdout
        );
    }
    // A one-line template stays on one line.
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  training: python train.py {body}\n",
    );
    let out = setup.run(&["validate"]);
    out.assert_stdout("  training: [shell mode] python train.py {body}\n");
}
