//! `pip install cyberwave-cloud-node`: the wheel packaging/build-wheel.py
//! builds, installed into a scratch virtualenv, puts the binary on PATH and keeps the documented
//! Python API (`CloudNode`, `CloudNodeConfig`), whose `run()` runs the binary, forwards SIGTERM
//! and returns its exit code.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use crate::support::node::NodeSetup;
use crate::support::timeouts::{EXIT, READY};
use crate::support::{node_bin, Rig, Scenario, TempDir};

/// One wheel and one virtualenv for the whole test run (building and installing take seconds).
/// The wheel is built in a scratch folder that goes once it is installed.
fn venv() -> &'static PathBuf {
    static VENV: OnceLock<PathBuf> = OnceLock::new();
    VENV.get_or_init(|| {
        let dir = TempDir::new("wheel");
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let wheels = dir.join("wheels");
        // The binary under test without its debug sections (a debug build is ~60 MB of them):
        // the same program, packed and installed in seconds.
        let bin = dir.join("cyberwave-cloud-node");
        let stripped = Command::new("strip")
            .arg("-o")
            .arg(&bin)
            .arg(node_bin())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !stripped {
            std::fs::copy(node_bin(), &bin).unwrap();
        }
        let built = Command::new("python3")
            .arg(root.join("packaging/build-wheel.py"))
            .arg("--bin")
            .arg(&bin)
            .arg("--channel")
            .arg("dev")
            .arg("--build")
            .arg("7")
            .arg("--out")
            .arg(&wheels)
            .arg("--stored")
            .output()
            .expect("python3");
        assert!(built.status.success(), "{built:?}");
        let wheel = PathBuf::from(String::from_utf8_lossy(&built.stdout).trim());
        assert!(
            wheel
                .display()
                .to_string()
                .contains("-0.3.0.dev7-py3-none-manylinux_2_17_x86_64"),
            "{}",
            wheel.display()
        );
        // The virtualenv is kept between runs (making one installs pip: seconds to a minute);
        // the wheel is installed into it anew each run. A lock keeps test processes in turn.
        let env = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("pip-test-venv");
        let lock = std::fs::File::create(format!("{}.lock", env.display())).unwrap();
        // SAFETY: flock on a descriptor we own; released when `lock` is dropped.
        unsafe {
            libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX);
        }
        // A virtualenv copied from another checkout's target dir still installs into that one
        // (its scripts name their own interpreter): it is made anew here.
        let ours = std::fs::read_to_string(env.join("bin/pip")).is_ok_and(|t| {
            t.lines().next() == Some(&format!("#!{}", env.join("bin/python3").display()))
        });
        if !ours {
            let _ = std::fs::remove_dir_all(&env);
            let made = Command::new("python3")
                .args(["-m", "venv"])
                .arg(&env)
                .output()
                .unwrap();
            assert!(made.status.success(), "python3 -m venv: {made:?}");
        }
        let pip = Command::new(env.join("bin/pip"))
            .args([
                "install",
                "--no-index",
                "--no-deps",
                "--force-reinstall",
                "--quiet",
            ])
            .arg(&wheel)
            .output()
            .unwrap();
        assert!(pip.status.success(), "pip install: {pip:?}");
        drop(lock);
        env
    })
}

#[test]
fn pip_install_puts_the_binary_on_path_and_python_m_runs_it() {
    let env = venv();
    let v = Command::new(env.join("bin/cyberwave-cloud-node"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(v.status.success(), "{v:?}");
    assert!(
        String::from_utf8_lossy(&v.stdout).contains("0.3.0"),
        "{v:?}"
    );
    let m = Command::new(env.join("bin/python"))
        .args(["-m", "cyberwave_cloud_node", "--version"])
        .env_remove("CYBERWAVE_NODE_BIN")
        .output()
        .unwrap();
    assert_eq!(m.stdout, v.stdout, "{m:?}");
    let api = Command::new(env.join("bin/python"))
        .args([
            "-c",
            "import cyberwave_cloud_node as c; n = c.CloudNode.from_config_file(slug='s1'); print(c.__version__, n.command()[1:]); print(c.CloudNode(config=c.CloudNodeConfig(profile_slug='gpu', mqtt_port=1883, training='t {body}')).command()[1:])",
        ])
        .env_remove("CYBERWAVE_NODE_BIN")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&api.stdout);
    assert!(
        out.contains("0.3.0.dev7 ['start', '--slug', 's1']"),
        "{api:?}"
    );
    assert!(
        out.contains("['start', '--profile', 'gpu', '--mqtt-port', '1883']"),
        "{api:?}"
    );
}

/// The documented programmatic form runs the node (standalone here: no backend needed);
/// SIGTERM to the Python process reaches the node, which stops gracefully, and `run()` returns
/// its exit code.
#[test]
fn the_python_api_runs_the_node_and_forwards_sigterm() {
    let env = venv();
    let mut rig = Scenario::new("").rig();
    let Rig { setup, .. } = &mut rig;
    let script = setup.write(
        "run_node.py",
        "import sys\nfrom cyberwave_cloud_node import CloudNode, CloudNodeConfig\nconfig = CloudNodeConfig(training='echo from-python {body}', heartbeat_interval=30)\ncode = CloudNode(config=config, slug='py-node', args=['--standalone']).run()\nprint('run returned', code, flush=True)\nsys.exit(code)\n",
    );
    setup.bin = Some(env.join("bin/python"));
    setup.args = vec![script.display().to_string()];
    setup.unset("CYBERWAVE_NODE_BIN");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    let cfg = setup.run(&["config", "--json"]);
    assert_eq!(cfg.code, Some(0), "{cfg:?}");
    node.sigterm();
    let code = node.wait_exit(EXIT).expect("exits");
    assert_eq!(code, Some(0), "{}", node.log());
    assert!(
        node.stdout().contains("run returned 0"),
        "{}",
        node.stdout()
    );
    assert!(
        node.log().contains("SIGTERM") || node.log().contains("Term"),
        "{}",
        node.log()
    );
}

/// The README's Python examples (its "With pip" part), as written there.
fn readme_python_examples() -> Vec<String> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let part = readme
        .split_once("**With pip**")
        .and_then(|(_, rest)| rest.split_once("\n## "))
        .map(|(part, _)| part.to_string())
        .expect("the README's With pip part");
    part.split("```python\n")
        .skip(1)
        .filter_map(|b| b.split_once("```").map(|(code, _)| code.to_string()))
        .collect()
}

/// D70: the README's Python examples end with the node's exit code: a configuration error (no
/// API token) is exit 2, not a script that succeeded; a node stopped with SIGTERM is 0; and the
/// standalone example runs without a backend or token.
#[test]
fn d70_the_readmes_python_examples_exit_with_the_nodes_code() {
    let examples = readme_python_examples();
    assert_eq!(examples.len(), 2, "{examples:?}");
    for code in &examples {
        assert!(code.contains("sys.exit("), "{code}");
    }
    let env = venv();
    let mut rig = Scenario::new("cyberwave:\n  inference: exec sleep 60\n").rig();
    let Rig { setup, .. } = &mut rig;
    let main = setup.write("readme_example.py", &examples[0]);
    let standalone = setup.write("readme_standalone.py", &examples[1]);
    setup.bin = Some(env.join("bin/python"));
    setup.unset("CYBERWAVE_NODE_BIN");
    // As written, against the backend: runs until SIGTERM, then 0.
    setup.args = vec![main.display().to_string()];
    runs_until_sigterm(setup);
    // Without an API token: the node's exit 2 is the script's.
    setup.unset("CYBERWAVE_API_KEY");
    let mut node = setup.spawn();
    node.assert_exit(2, EXIT);
    node.assert_logged("API token");
    // Standalone: no backend, no token.
    setup.args = vec![standalone.display().to_string()];
    runs_until_sigterm(setup);
}

/// The node `setup` starts becomes ready, and exits 0 on SIGTERM.
fn runs_until_sigterm(setup: &NodeSetup) {
    let mut node = setup.spawn();
    node.wait_ready(READY);
    node.sigterm();
    node.assert_exit(0, EXIT);
}

/// D70: the Python API as a container's command (PID 1 of a new PID namespace): `run()` becomes
/// the node, which as PID 1 stops and reports its workloads on SIGTERM, once or twice (the
/// second sends SIGKILL at once); the grace is long, so only that can end the stop this soon.
fn the_python_api_as_pid_1(times: usize) {
    let env = venv();
    let mut rig = Scenario::new(crate::containers::MANIFEST).rig();
    let Rig { cp, setup, .. } = &mut rig;
    setup.set(
        "CYBERWAVE_NODE_STOP_GRACE_SECONDS",
        if times == 1 { "3" } else { "60" },
    );
    let script = setup.write(
        "run_node.py",
        "import sys\nfrom cyberwave_cloud_node import CloudNode\nsys.exit(CloudNode.from_config_file(slug='py-pid1').run())\n",
    );
    crate::containers::in_a_pid_namespace(setup, &[]);
    setup.bin = Some(env.join("bin/python"));
    setup.args = vec![script.display().to_string()];
    setup.unset("CYBERWAVE_NODE_BIN");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    crate::containers::assert_a_stop_reports_both(cp, &mut node, times, Duration::from_secs(20));
    assert!(
        node.log()
            .contains("(the node is PID 1 of its PID namespace)"),
        "run() became the node: {}",
        node.log()
    );
}

#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn d70_the_python_api_as_a_containers_pid_1_stops_and_reports_its_workloads() {
    the_python_api_as_pid_1(1);
}

#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn d70_the_python_api_as_a_containers_pid_1_survives_a_second_sigterm_and_reports() {
    the_python_api_as_pid_1(2);
}
