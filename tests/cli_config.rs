//! The command line, `validate`, `config` and configuration errors, end to end; seconds at the
//! edge of every range in the environment are a usage error, never a panic.

use std::time::Duration;

use serde_json::Value;

use crate::support::node::{NodeSetup, TOKEN};
use crate::support::timeouts::EXIT;

fn config_json(setup: &NodeSetup, extra: &[&str]) -> Value {
    let mut args = vec!["config", "--json"];
    args.extend_from_slice(extra);
    let out = setup.run(&args);
    assert_eq!(out.code, Some(0), "{out:?}");
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

fn value(cfg: &Value, key: &str) -> String {
    cfg[key]["value"].as_str().unwrap_or_default().to_string()
}

fn source(cfg: &Value, key: &str) -> String {
    cfg[key]["source"].as_str().unwrap_or_default().to_string()
}

/// One clear line on stderr, no panic, no backtrace.
fn assert_one_clear_error(out: &crate::support::node::Output, needle: &str) {
    let lines: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.starts_with("error:"))
        .collect();
    assert_eq!(lines.len(), 1, "{out:?}");
    assert!(lines[0].contains(needle), "{out:?}");
    assert!(
        !out.stderr.contains("panicked") && !out.stderr.contains("backtrace"),
        "{out:?}"
    );
}

#[test]
fn version_and_help() {
    let s = NodeSetup::bare();
    let out = s.run(&["--version"]);
    assert_eq!(out.code, Some(0));
    assert!(out.stdout.starts_with("cyberwave-cloud-node "), "{out:?}");
    for args in [
        &["--help"][..],
        &["start", "--help"],
        &["validate", "-h"],
        &["config", "--help"],
    ] {
        let out = s.run(args);
        assert_eq!(out.code, Some(0), "{args:?}");
        assert!(out.stdout.contains("Usage:"), "{args:?}: {out:?}");
    }
}

#[test]
fn bad_flags_exit_2_with_one_line() {
    let s = NodeSetup::bare();
    for (args, needle) in [
        (&["start", "--mqtt-port", "eighty"][..], "--mqtt-port"),
        (&["--frobnicate"], "--frobnicate"),
        (&["launch"], "unknown command"),
    ] {
        let out = s.run(args);
        assert_eq!(out.code, Some(2), "{args:?}: {out:?}");
        assert_one_clear_error(&out, needle);
    }
}

#[test]
fn bad_manifest_and_bad_env_exit_2_on_start() {
    let mut s = NodeSetup::bare();
    s.set("CYBERWAVE_API_KEY", "cw_x");
    s.write(
        "cyberwave.yml",
        "cyberwave:\n  inference: x\n  heartbeat_interval: soon\n",
    );
    let out = s.run(&["start"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert_one_clear_error(
        &out,
        "cyberwave.yml:3: error: heartbeat_interval: expected a number of seconds greater than 0",
    );

    s.write("cyberwave.yml", "cyberwave:\n  inference: x\n");
    s.set("CYBERWAVE_MQTT_PORT", "not-a-port");
    let out = s.run(&["start"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert_one_clear_error(
        &out,
        "CYBERWAVE_MQTT_PORT (env CYBERWAVE_MQTT_PORT): expected a whole number from 1 to 65535",
    );
}

#[test]
fn missing_token_is_a_configuration_error() {
    let s = NodeSetup::bare();
    let out = s.run(&["start", "--mqtt-port", "1"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("no API token"), "{out:?}");
    assert!(out.stderr.contains("credentials.json"), "{out:?}");
}

#[test]
fn validate_good_manifest() {
    let s = NodeSetup::bare();
    s.write(
        "cyberwave.yml",
        "cyberwave:\n  install: ./install.sh\n  inference: |\n    source venv/bin/activate && \\\n      python infer.py --params {body}\n  training: python train.py {body}\n  simulate: sim.py\ncloud_node:\n  max_concurrent_workloads: 2\n",
    );
    let out = s.run(&["validate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("OK (0 warnings)"), "{out:?}");
    assert!(out.stdout.contains("inference: [shell mode]"), "{out:?}");
    assert!(
        out.stdout.contains(
            "simulate: [module mode: calls simulate(**params); sim.py does not exist yet] sim.py"
        ),
        "{out:?}"
    );
}

#[test]
fn validate_and_start_read_a_manifest_with_a_byte_order_mark_and_refuse_one_over_4_mib() {
    // D49: saved by a Windows editor; PyYAML (the platform) skips the mark.
    let s = NodeSetup::bare();
    s.write(
        "cyberwave.yml",
        "\u{FEFF}cyberwave:\n  inference: python infer.py {body}\n  mqtt_host: bom-broker\n",
    );
    let out = s.run(&["validate"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("OK (0 warnings)"), "{out:?}");
    assert!(out.stdout.contains("inference: [shell mode]"), "{out:?}");
    // `start` reads the same values (`config` shows what `start` would use).
    let out = s.run(&["config", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["mqtt_host"]["value"], "bom-broker", "{v}");
    // Over the bound: refused, naming the size and the bound.
    let big = s.write("big.yml", "cyberwave:\n  inference: x\n");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&big)
        .unwrap()
        .set_len(5 << 20)
        .unwrap();
    let out = s.run(&["validate", big.to_str().unwrap()]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stdout
            .contains("the file is 5242880 bytes; a manifest may be at most 4194304 (4 MiB)"),
        "{out:?}"
    );
}

#[test]
fn a_topic_prefix_with_a_wildcard_stops_start_with_exit_2_naming_the_variable() {
    // D50: `#` in the prefix would make every subscription a wildcard: the node would be deaf.
    for (var, value) in [
        ("CYBERWAVE_ENVIRONMENT", "dev#"),
        ("CYBERWAVE_TOPIC_PREFIX", "a+b/"),
        ("CYBERWAVE_MQTT_TOPIC_PREFIX", "de v/"),
    ] {
        let mut s = NodeSetup::bare();
        s.set("CYBERWAVE_API_KEY", "cw_prefix_test_token_aaaa");
        s.set("CYBERWAVE_MQTT_PORT", "1");
        s.set(var, value);
        let mut node = s.spawn();
        let code = node.wait_exit(EXIT);
        let log = node.log();
        node.kill9();
        assert_eq!(code, Some(Some(2)), "{var}={value:?}: {log}");
        assert!(
            log.contains(&format!("{var} (env {var})")) && log.contains("cannot be a topic prefix"),
            "{log}"
        );
    }
}

/// The home of `uid`'s passwd entry, as the C library gives it.
fn passwd_home(uid: u32) -> Option<String> {
    // SAFETY: getpwuid returns null or a pointer to a static entry, read at once (this test
    // process looks up no other user meanwhile).
    unsafe {
        let pw = libc::getpwuid(uid);
        if pw.is_null() || (*pw).pw_dir.is_null() {
            return None;
        }
        Some(
            std::ffi::CStr::from_ptr((*pw).pw_dir)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

#[test]
fn without_home_the_config_dir_is_the_passwd_home_as_under_a_unit_without_user() {
    // D42: `cyberwave compute install` writes a unit without `User=`: systemd sets no HOME,
    // and a node that needed one would exit 2 every 5 s for ever.
    let mut s = NodeSetup::bare();
    s.unset("HOME").unset("CYBERWAVE_EDGE_CONFIG_DIR");
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    let home = passwd_home(me).expect("this test's uid has a passwd entry");
    let out = s.run(&["config", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(
        v["config_dir"]["value"],
        format!("{}/.cyberwave", home.trim_end_matches('/')),
        "{v}"
    );
    assert!(
        v["config_dir"]["source"]
            .as_str()
            .unwrap_or_default()
            .contains(&format!("the home of uid {me} in the passwd database")),
        "{v}"
    );
    // HOME, when set, comes before it; the start-up line says which was used.
    let mut s = NodeSetup::bare();
    s.unset("CYBERWAVE_EDGE_CONFIG_DIR")
        .set("CYBERWAVE_API_KEY", "cw_home_test_token_aaaa")
        .set("CYBERWAVE_BASE_URL", "http://127.0.0.1:1")
        .set("CYBERWAVE_MQTT_HOST", "127.0.0.1")
        .set("CYBERWAVE_MQTT_PORT", "1");
    let mut node = s.spawn();
    let line = format!(
        "starting: state dir {} ($HOME/.cyberwave)",
        s.home.join(".cyberwave").display()
    );
    let seen = node.wait_log(&line, Duration::from_secs(10));
    let log = node.log();
    node.kill9();
    assert!(seen, "no {line:?} in:\n{log}");
}

/// D42 for `start` under other uids (root to become them): without HOME, `start` uses the passwd
/// home too, and a uid without a passwd entry exits 2 naming what it looked for.
#[test]
#[cfg_attr(not_root, ignore = "needs root")]
fn without_home_start_uses_the_passwd_home_and_a_uid_without_an_entry_exits_2() {
    crate::support::assert_root("to start the node as other uids");
    // `start` uses the passwd home too: nobody's (/nonexistent) cannot be created.
    let mut s = NodeSetup::bare();
    s.unset("HOME")
        .unset("CYBERWAVE_EDGE_CONFIG_DIR")
        .set("CYBERWAVE_API_KEY", "cw_home_test_token_aaaa");
    s.cwd = std::path::PathBuf::from("/");
    if let Some(nobody) = passwd_home(65534) {
        s.uid = Some(65534);
        let mut node = s.spawn();
        let code = node.wait_exit(EXIT);
        let log = node.log();
        node.kill9();
        assert!(matches!(code, Some(Some(c)) if c != 0), "{code:?} {log}");
        let dir = format!("{}/.cyberwave", nobody.trim_end_matches('/'));
        assert!(log.contains(&dir), "no {dir} in:\n{log}");
    }
    // All three fail (a uid without a passwd entry): exit 2, naming each.
    s.uid = Some(4242);
    assert!(
        passwd_home(4242).is_none(),
        "uid 4242 is in use on this host"
    );
    let mut node = s.spawn();
    let code = node.wait_exit(EXIT);
    let log = node.log();
    node.kill9();
    assert_eq!(code, Some(Some(2)), "{log}");
    for needle in [
        "cannot find a config dir",
        "CYBERWAVE_EDGE_CONFIG_DIR is not set",
        "HOME is not set",
        "uid 4242 has no passwd entry",
    ] {
        assert!(log.contains(needle), "no {needle:?} in:\n{log}");
    }
}

#[test]
fn validate_lists_every_problem_with_its_line() {
    let s = NodeSetup::bare();
    let path = s.write(
        "m.yml",
        "cyberwave:\n  inferense: python x.py\n  mqtt_port: 99999\n  upload_results: maybe\n  provider: aws\n",
    );
    let out = s.run(&["validate", path.to_str().unwrap_or_default()]);
    assert_eq!(out.code, Some(1), "{out:?}");
    for needle in [
        "m.yml:2: error: inferense: unknown field (did you mean `inference`?)",
        "m.yml:3: error: mqtt_port: expected a whole number from 1 to 65535, got the integer 99999",
        "m.yml:4: error: upload_results: expected a boolean",
        "m.yml:5: error: provider: unknown field",
        "4 errors, 0 warnings",
    ] {
        assert!(
            out.stdout.contains(needle),
            "missing {needle:?} in:\n{}",
            out.stdout
        );
    }
    // --lenient: unknown keys become warnings; the type error still fails.
    let out = s.run(&[
        "validate",
        "--config",
        path.to_str().unwrap_or_default(),
        "--lenient",
    ]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stdout.contains("m.yml:5: warning: provider"), "{out:?}");
    assert!(out.stdout.contains("2 errors, 2 warnings"), "{out:?}");
    // A legacy wrapper with only unknown keys passes with --lenient.
    s.write(
        "cyberwave.yml",
        "cyberwave-cloud-node:\n  simulate: s {body}\n  server_port: 8080\n",
    );
    let out = s.run(&["validate", "--lenient"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("legacy wrapper"), "{out:?}");
    let out = s.run(&["validate", "nope.yml"]);
    assert_eq!(out.code, Some(1), "{out:?}");
}

#[test]
fn config_precedence_end_to_end() {
    let mut s = NodeSetup::bare();
    // credentials.json is the last resort for the token and the broker.
    s.home.write(
        ".cyberwave/credentials.json",
        r#"{"token":"cw_credentials_token_aaaa","envs":{"CYBERWAVE_MQTT_HOST":"cred-host"}}"#,
    );
    let cfg = config_json(&s, &[]);
    assert_eq!(value(&cfg, "api_token"), "cw_…aaaa");
    assert!(
        source(&cfg, "api_token").ends_with("credentials.json"),
        "{cfg}"
    );
    assert_eq!(value(&cfg, "mqtt_host"), "cred-host");

    // <config dir>/.env beats credentials.json …
    s.home.write(
        ".cyberwave/.env",
        "CYBERWAVE_API_KEY=cw_shared_env_token_bbbb\nCYBERWAVE_MQTT_HOST=shared-host\n",
    );
    let cfg = config_json(&s, &[]);
    assert_eq!(value(&cfg, "api_token"), "cw_…bbbb");
    assert_eq!(value(&cfg, "mqtt_host"), "shared-host");
    // … ./.env beats <config dir>/.env (the documented order) …
    s.write(
        ".env",
        "CYBERWAVE_API_KEY=cw_local_env_token_cccc\nCYBERWAVE_MQTT_HOST=local-host\n",
    );
    let cfg = config_json(&s, &[]);
    assert_eq!(value(&cfg, "api_token"), "cw_…cccc");
    assert!(source(&cfg, "api_token").contains("work/.env"), "{cfg}");
    assert_eq!(value(&cfg, "mqtt_host"), "local-host");
    // … the process environment beats both …
    s.set("CYBERWAVE_API_KEY", "cw_process_env_token_dddd");
    s.set("CYBERWAVE_MQTT_HOST", "env-host");
    let cfg = config_json(&s, &[]);
    assert_eq!(value(&cfg, "api_token"), "cw_…dddd");
    assert_eq!(source(&cfg, "api_token"), "env CYBERWAVE_API_KEY");
    assert_eq!(value(&cfg, "mqtt_host"), "env-host");
    // … the file beats the environment …
    s.write(
        "cyberwave.yml",
        "cyberwave:\n  mqtt_host: file-host\n  mqtt_port: 1883\n",
    );
    let cfg = config_json(&s, &[]);
    assert_eq!(value(&cfg, "mqtt_host"), "file-host");
    assert_eq!(
        value(&cfg, "mqtt_use_tls"),
        "false",
        "port 1883 ⇒ no TLS: {cfg}"
    );
    // … and a flag beats the file; the flag's port decides TLS.
    let cfg = config_json(&s, &["--mqtt-host", "flag-host", "--mqtt-port", "8883"]);
    assert_eq!(value(&cfg, "mqtt_host"), "flag-host");
    assert_eq!(source(&cfg, "mqtt_host"), "flag --mqtt-host");
    assert_eq!(value(&cfg, "mqtt_use_tls"), "true");
    // Secrets never appear in full.
    let out = s.run(&["config"]);
    assert!(!out.stdout.contains("cw_process_env_token_dddd"), "{out:?}");
}

#[test]
fn the_manifest_path_can_come_from_the_environment() {
    let mut s = NodeSetup::bare();
    let m = s
        .home
        .write("repo/cyberwave.yml", "cyberwave:\n  training: t {body}\n");
    s.set("CYBERWAVE_MANIFEST", &m.display().to_string());
    let out = s.run(&["config", "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let cfg: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_default();
    assert_eq!(cfg["training"]["value"], "t {body}");
    assert!(cfg["working_dir"]["value"]
        .as_str()
        .unwrap_or_default()
        .ends_with("repo"));
}

#[test]
fn g8_huge_seconds_in_the_environment_are_no_panic() {
    let mut base = NodeSetup::bare();
    base.set("CYBERWAVE_API_KEY", TOKEN);
    base.set("CYBERWAVE_MQTT_HOST", "127.0.0.1");
    for var in [
        "CYBERWAVE_HEARTBEAT_INTERVAL",
        "CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL",
        "CYBERWAVE_NODE_REQUEST_TIMEOUT_SECONDS",
        "CYBERWAVE_NODE_RECONNECT_BASE_SECONDS",
    ] {
        for v in ["1e300", "1e19", "18446744073709551616"] {
            let mut s = NodeSetup {
                home: base.home.clone(),
                env: base.env.clone(),
                args: base.args.clone(),
                cwd: base.cwd.clone(),
                uid: None,
                under: Vec::new(),
                bin: None,
            };
            s.set(var, v);
            let out = s.run(&["config", "--json"]);
            assert!(!out.stderr.contains("panicked"), "{var}={v}: {out:?}");
            assert!(
                out.code == Some(0) || out.code == Some(2),
                "{var}={v}: accepted or a usage error, nothing else: {out:?}"
            );
        }
    }
}
