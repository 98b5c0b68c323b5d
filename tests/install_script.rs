//! The manifest's install script: run once at start-up, before registration, without the
//! node's token; its output shipped to the backend; a failure reported (R6) and exit 1.

use std::time::Duration;

use crate::support::scenario::error_of;
use crate::support::timeouts::REPLY;
use crate::support::Scenario;

#[test]
fn a_good_install_script_runs_before_registration() {
    let (rig, _node) = Scenario::new("cyberwave:\n  install: bash ./install.sh\n")
        .file(
            "install.sh",
            "#!/bin/sh\necho installing\necho \"token:${CYBERWAVE_API_KEY:-none}\" > installed.txt\n",
        )
        .node();
    let marker = std::fs::read_to_string(rig.work("installed.txt")).unwrap_or_default();
    assert_eq!(
        marker.trim(),
        "token:none",
        "the node's token is not handed to the install script"
    );
    // Its output is shipped to the backend once registered.
    let logs = rig.cp.wait_requests("logs", 1, REPLY);
    let install: Vec<_> = logs
        .iter()
        .filter(|r| r.body["source"] == "install")
        .collect();
    assert_eq!(install.len(), 1, "{logs:?}");
    assert_eq!(
        install[0].body["log_content"], "installing",
        "no trailing newline (a log chunk's content, docs/protocol.md)"
    );
}

#[test]
fn install_script_failure_is_reported_and_exits_1() {
    let rig =
        Scenario::new("cyberwave:\n  install: echo preparing; echo 'pip exploded' >&2; exit 7\n")
            .rig();
    let mut node = rig.spawn();
    node.assert_exit(1, Duration::from_secs(15));
    let fails = rig.cp.requests("fail");
    assert_eq!(fails.len(), 1, "R6 sent: {:?}", rig.cp.all_requests());
    let err = error_of(&fails[0].body);
    assert!(
        err.contains("exit code 7") && err.contains("pip exploded"),
        "{err}"
    );
    node.assert_logged("[install stdout] preparing");
    let logged =
        std::fs::read_to_string(rig.state("install_logs/install.stderr.log")).unwrap_or_default();
    assert!(logged.contains("pip exploded"));
}

#[test]
fn missing_install_script_is_a_clear_error() {
    let rig = Scenario::new("cyberwave:\n  install: ./setup.sh --gpu\n").rig();
    let mut node = rig.spawn();
    node.assert_exit(1, Duration::from_secs(15));
    node.assert_logged("install script ./setup.sh not found");
    let fails = rig.cp.requests("fail");
    assert_eq!(fails.len(), 1);
    assert!(error_of(&fails[0].body).contains("not found"));
}
