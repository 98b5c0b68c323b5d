//! One node per state dir, owned by its user (decision D30, guarantee 12).

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use crate::support::rig;
use crate::support::timeouts::{EXIT, READY};

#[test]
fn g12_a_second_node_on_the_same_state_dir_exits_1_naming_the_first() {
    let (_broker, cp, setup) = rig("cyberwave:\n  inference: echo hi\n");
    let first = setup.spawn();
    first.wait_ready(READY);
    let mut second = setup.spawn();
    assert_eq!(second.wait_exit(EXIT), Some(Some(1)), "{}", second.log());
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
    let (_broker, _cp, setup) = rig("cyberwave:\n  inference: echo hi\n");
    let dir = setup.config_dir();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut node = setup.spawn();
    assert_eq!(node.wait_exit(EXIT), Some(Some(2)), "{}", node.log());
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
    let (_broker, _cp, setup) = rig("cyberwave:\n  inference: echo hi\n");
    let dir = setup.config_dir();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    // A planted link that a careless root node would follow.
    let victim = setup.home.join("victim");
    std::fs::write(&victim, "root's file\n").unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("lock")).unwrap();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    let mut node = setup.spawn();
    assert_eq!(node.wait_exit(EXIT), Some(Some(2)), "{}", node.log());
    assert!(node.log().contains("owned by uid 65534"), "{}", node.log());
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "root's file\n");
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
}

#[test]
fn g11_a_copied_state_dir_is_named_as_a_duplicate_client_id_and_doctor_fails() {
    let (broker, cp, setup) = rig("cyberwave:\n  inference: echo hi\n");
    let first = setup.spawn();
    first.wait_ready(READY);
    let copy = crate::support::node::NodeSetup::new(&broker, &cp);
    copy.write("cyberwave.yml", "cyberwave:\n  inference: echo hi\n");
    let dir = copy.config_dir();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::copy(setup.config_dir().join("node_id"), dir.join("node_id")).unwrap();
    let second = copy.spawn();
    let said = crate::support::wait_for(Duration::from_secs(20), || {
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
        &setup
    } else {
        &copy
    };
    let doctor = which.run(&["doctor"]);
    assert!(
        doctor.stdout.contains("FAIL  MQTT client id"),
        "{}",
        doctor.stdout
    );
    // They no longer take the session from each other several times a second.
    let takeovers = |n: &crate::support::NodeProcess| n.log().matches("reason 0x8E").count();
    let before = takeovers(&first) + takeovers(&second);
    // (The 30 s wait itself is unit-tested with a fake clock in node::session.)
    std::thread::sleep(Duration::from_millis(1500));
    let after = takeovers(&first) + takeovers(&second);
    assert!(after - before <= 2, "{before} → {after} takeovers in 1.5 s");
}
