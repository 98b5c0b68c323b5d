//! Installed and run the ways users do (issue 24): started as the platform's CLI starts it
//! (D43), under the unit `cyberwave compute install` writes (D42, D44).

use std::time::Duration;

use crate::support::node::NodeSetup;
use crate::support::node_bin;

/// A process's command line, its arguments split.
fn cmdline(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|c| *c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A node with a token and nowhere to connect: it gets as far as its start-up line.
fn offline() -> NodeSetup {
    let mut s = NodeSetup::bare();
    s.set("CYBERWAVE_API_KEY", "cw_reexec_test_token_aaaa")
        .set("CYBERWAVE_BASE_URL", "http://127.0.0.1:1")
        .set("CYBERWAVE_MQTT_HOST", "127.0.0.1")
        .set("CYBERWAVE_MQTT_PORT", "1");
    s
}

#[test]
fn without_a_subcommand_the_node_becomes_start_in_the_same_process_once() {
    // D43: `cyberwave compute start` runs `<bin> [--config X]`; its `stop` and `restart` look
    // for `pgrep -f "cyberwave-cloud-node start"`.
    let bin = node_bin().display().to_string();
    let mut s = offline();
    s.args = vec!["--slug".into(), "reexec-node".into()];
    let mut node = s.spawn();
    assert!(
        node.wait_log("starting: state dir", Duration::from_secs(10)),
        "{}",
        node.log()
    );
    let argv = cmdline(node.pid());
    let pgrep = std::process::Command::new("pgrep")
        .args(["-f", "cyberwave-cloud-node start"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    node.kill9();
    assert_eq!(argv, [bin.as_str(), "start", "--slug", "reexec-node"]);
    if let Ok(pids) = pgrep {
        assert!(
            pids.lines().any(|p| p.trim() == node.pid().to_string()),
            "pgrep did not find pid {}: {pids}",
            node.pid()
        );
    }
    // The marker stops a second round: a node that finds it set runs as `start` unchanged.
    let mut s = offline();
    s.args = vec![];
    s.set("CYBERWAVE_NODE_REEXECUTED", "1");
    let mut node = s.spawn();
    assert!(
        node.wait_log("starting: state dir", Duration::from_secs(10)),
        "{}",
        node.log()
    );
    let argv = cmdline(node.pid());
    node.kill9();
    assert_eq!(argv, [bin.as_str()]);
    // --help and --version answer as before, without a re-exec.
    let out = offline().run(&["--version"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.starts_with("cyberwave-cloud-node "), "{out:?}");
}

/// The unit `cyberwave compute install` (cyberwave-cli 0.12.7) writes when it masks the
/// packaged one: `Type=simple`, root, no environment file (ecosystem.md §4.1).
pub const CLI_UNIT: &str = "[Unit]\nDescription=Cyberwave Cloud Node\nAfter=network-online.target\nWants=network-online.target\n\n[Service]\nType=simple\nExecStart=/usr/bin/cyberwave-cloud-node start\nRestart=on-failure\nRestartSec=5\nStandardOutput=journal\nStandardError=journal\nSyslogIdentifier=cyberwave-cloud-node\n\n[Install]\nWantedBy=multi-user.target\n";

#[test]
fn doctor_warns_that_the_cli_unit_masks_the_packaged_one_and_says_how_to_go_back() {
    // D44. The unit dirs of a test host: /etc's beside the package's /lib.
    let (_broker, _cp, mut setup) = crate::support::rig("cyberwave:\n  training: sleep 1\n");
    let units = crate::support::TempDir::new("units");
    let packaged = std::process::Command::new(node_bin())
        .arg("__print-unit")
        .output()
        .unwrap();
    assert!(packaged.status.success());
    units.write(
        "lib/systemd/system/cyberwave-cloud-node.service",
        &String::from_utf8_lossy(&packaged.stdout),
    );
    let dirs = format!(
        "{}:{}",
        units.join("etc/systemd/system").display(),
        units.join("lib/systemd/system").display()
    );
    setup.set("CYBERWAVE_NODE_SYSTEMD_DIRS", &dirs);
    let line = |out: &crate::support::node::Output, level: &str| {
        out.stdout
            .lines()
            .find(|l| l.starts_with(level) && l.contains("systemd unit"))
            .map(String::from)
    };
    let out = setup.run(&["doctor"]);
    assert_eq!(out.code, Some(0), "the packaged unit alone passes: {out:?}");
    assert!(line(&out, "WARN").is_none(), "{}", out.stdout);
    units.write("etc/systemd/system/cyberwave-cloud-node.service", CLI_UNIT);
    let out = setup.run(&["doctor"]);
    let warn = line(&out, "WARN").unwrap_or_else(|| panic!("no WARN: {}", out.stdout));
    for needle in [
        "is not the packaged unit: it masks",
        "User=",
        "EnvironmentFile=",
        "Type=notify",
        "a state dir",
        "sudo systemctl revert cyberwave-cloud-node",
    ] {
        assert!(warn.contains(needle), "no {needle:?} in {warn}");
    }
    // It also lacks KillMode=process: a restart would kill the workloads.
    assert!(line(&out, "FAIL").is_some(), "{}", out.stdout);
    assert_eq!(out.code, Some(1), "{out:?}");
}
