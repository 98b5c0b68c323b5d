//! The manifest corpus (tests/manifests): `validate` gives the platform's verdict on every file,
//! strict and `--lenient`, except the documented exceptions below; `start` runs what it can.
//!
//! The expected verdicts (tests/manifests/verdicts.json) come from the Cyberwave SDK's own
//! validator, written by scripts/manifest-verdicts.py; this test never needs Python.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;

use crate::support::node::NodeSetup;
use crate::support::timeouts::{EXIT, READY};
use crate::support::{Rig, Scenario};

/// Where the node deliberately differs from the platform, with the reason (docs/configuration.md:
/// "Where the node deliberately differs"). `(file, mode)`: mode is "strict", "lenient" or "both".
const EXCEPTIONS: &[(&str, &str, &str)] = &[
    (
        "20-port-out-of-range.yml",
        "both",
        "a port outside 1-65535 is refused (the platform takes any int)",
    ),
    (
        "21-heartbeat-zero.yml",
        "both",
        "a heartbeat <= 0 is refused (the platform takes any int)",
    ),
    (
        "22-heartbeat-negative.yml",
        "both",
        "a heartbeat <= 0 is refused (the platform takes any int)",
    ),
    (
        "49-cloud-node-bad-value.yml",
        "both",
        "the node checks its own `cloud_node:` section, which the platform never reads",
    ),
    (
        "82-node-setting-bad-inside-wrapper.yml",
        "lenient",
        "a node setting the node cannot use is an error wherever it sits (the platform drops it with --lenient)",
    ),
    (
        "generated-huge-5mb.yml",
        "both",
        "a manifest over 4 MiB is refused before parsing",
    ),
];

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/manifests")
}

/// Keep in step with `generated()` in scripts/manifest-verdicts.py.
fn generated() -> BTreeMap<&'static str, Vec<u8>> {
    let head = b"cyberwave:\n  inference: python i.py {body}\n".to_vec();
    let mut filler = b"# ".to_vec();
    filler.extend(std::iter::repeat_n(b'x', 60));
    filler.push(b'\n');
    let big = |n: usize| {
        let mut v = head.clone();
        for _ in 0..n {
            v.extend_from_slice(&filler);
        }
        v
    };
    let mut many = head.clone();
    for i in 0..5_000 {
        many.extend_from_slice(format!("  k{i}: {i}\n").as_bytes());
    }
    BTreeMap::from([
        ("generated-huge-3mb.yml", big(48_000)),
        ("generated-huge-5mb.yml", big(80_000)),
        ("generated-many-keys.yml", many),
    ])
}

fn exception(file: &str, mode: &str) -> Option<&'static str> {
    EXCEPTIONS
        .iter()
        .find(|(f, m, _)| *f == file && (*m == mode || *m == "both"))
        .map(|(_, _, why)| *why)
}

#[test]
fn g8_validate_agrees_with_the_platform_on_every_corpus_file() {
    let verdicts: Value = serde_json::from_str(
        &std::fs::read_to_string(corpus_dir().join("verdicts.json")).expect("verdicts.json"),
    )
    .expect("verdicts.json is JSON");
    let verdicts = verdicts.as_object().expect("an object");
    let files: Vec<String> = std::fs::read_dir(corpus_dir())
        .expect("corpus dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yml"))
        .collect();
    assert!(files.len() >= 40, "the corpus has {} files", files.len());
    for f in &files {
        assert!(
            verdicts.contains_key(f),
            "{f} has no platform verdict: run scripts/manifest-verdicts.py"
        );
    }
    let setup = NodeSetup::bare();
    let generated = generated();
    let mut disagreements = Vec::new();
    let mut checked = 0;
    for (name, v) in verdicts {
        let path = match generated.get(name.as_str()) {
            Some(bytes) => {
                let p = setup.home.join(name);
                std::fs::write(&p, bytes).expect("write generated manifest");
                p
            }
            None => corpus_dir().join(name),
        };
        let path_s = path.to_string_lossy().into_owned();
        for mode in ["strict", "lenient"] {
            let platform_valid = v[mode]["valid"].as_bool().expect("valid flag");
            let mut args = vec!["validate", path_s.as_str()];
            if mode == "lenient" {
                args.push("--lenient");
            }
            let out = setup.run(&args);
            assert!(
                matches!(out.code, Some(0) | Some(1)),
                "{name} ({mode}): exit {:?}, no panic allowed\n{out:?}",
                out.code
            );
            assert!(!out.stderr.contains("panicked"), "{name}: {}", out.stderr);
            let node_valid = out.code == Some(0);
            checked += 1;
            let expected = match exception(name, mode) {
                Some(why) => {
                    assert!(
                        platform_valid && !node_valid,
                        "{name} ({mode}) is listed as an exception ({why}) but the verdicts no longer differ that way"
                    );
                    continue;
                }
                None => platform_valid,
            };
            if node_valid != expected {
                disagreements.push(format!(
                    "{name} ({mode}): platform {} / node {}\n{}",
                    if expected { "valid" } else { "invalid" },
                    if node_valid { "valid" } else { "invalid" },
                    out.stdout.lines().take(8).collect::<Vec<_>>().join("\n")
                ));
                continue;
            }
            if node_valid {
                continue;
            }
            // Every error names its file and line; every key the platform names, the node
            // names too (unless the key is not a string in YAML 1.1).
            for line in out.stdout.lines().filter(|l| l.contains(": error: ")) {
                let after = line
                    .trim_start_matches("error: ")
                    .strip_prefix(path_s.as_str())
                    .unwrap_or_else(|| panic!("{name}: error without the file name: {line}"));
                let lineno = after
                    .trim_start_matches(':')
                    .split(':')
                    .next()
                    .unwrap_or("");
                assert!(
                    lineno.parse::<usize>().is_ok(),
                    "{name}: error without a line number: {line}"
                );
            }
            for field in v[mode]["fields"].as_array().into_iter().flatten() {
                let field = field.as_str().unwrap_or_default();
                let key = field.split('.').next().unwrap_or_default();
                let named = match key {
                    "" => "runtime",
                    "yaml" | "structure" | "path" => continue,
                    k if k.parse::<i64>().is_ok() => continue,
                    k => k,
                };
                assert!(
                    out.stdout.contains(&format!(": error: {named}: ")),
                    "{name} ({mode}): the platform names `{field}`, the node does not:\n{}",
                    out.stdout
                );
            }
        }
    }
    assert!(
        disagreements.is_empty(),
        "{} disagreement(s) with the platform:\n\n{}",
        disagreements.len(),
        disagreements.join("\n\n")
    );
    assert!(checked >= 80);
}

#[test]
fn platform_refusals_the_node_can_live_with_say_start_still_runs() {
    let setup = NodeSetup::bare();
    let file = |n: &str| corpus_dir().join(n).to_string_lossy().into_owned();
    for (name, needle) in [
        ("10-version-int.yml", "m:2: error: version: "),
        (
            "15-fractional-heartbeat.yml",
            "m:3: error: heartbeat_interval: ",
        ),
        ("25-python-original-example.yml", "m:4: error: provider: "),
        (
            "18-node-keys-inside-wrapper.yml",
            "m:3: error: max_concurrent_workloads: ",
        ),
        ("14-unknown-tag.yml", "m:2: error: yaml: "),
    ] {
        let out = setup.run(&["validate", &file(name)]);
        assert_eq!(out.code, Some(1), "{out:?}");
        let needle = needle.replacen("m:", &format!("{}:", file(name)), 1);
        let line = out
            .stdout
            .lines()
            .find(|l| l.starts_with(&needle))
            .unwrap_or_else(|| panic!("no {needle:?} in\n{}", out.stdout));
        assert!(
            line.ends_with("[`start` would still run this file]"),
            "{line}"
        );
    }
    // A value the node cannot use: no such note.
    let out = setup.run(&["validate", &file("20-port-out-of-range.yml")]);
    assert!(out
        .stdout
        .contains("error: mqtt_port: expected a whole number from 1 to 65535"));
    assert!(!out.stdout.contains("would still run"), "{}", out.stdout);
}

#[test]
fn start_runs_the_python_originals_example_manifest() {
    let text = std::fs::read_to_string(corpus_dir().join("25-python-original-example.yml"))
        .expect("corpus file");
    let rig = Scenario::new(&text).rig();
    let Rig { setup, .. } = &rig;
    let install = setup.write("install.sh", "#!/bin/sh\nexit 0\n");
    std::fs::set_permissions(
        &install,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod install.sh");
    let mut node = setup.spawn();
    node.wait_ready(READY);
    let log = node.log();
    assert!(
        log.contains("provider: unknown field"),
        "the unknown keys are warnings in the log:\n{log}"
    );
    node.sigterm();
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)));
}

#[test]
fn start_refuses_a_value_it_needs_and_cannot_use() {
    let setup = NodeSetup::bare();
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  inference: python i.py {body}\n  heartbeat_interval: soon\n",
    );
    let out = setup.run(&["config"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr
            .contains("cyberwave.yml:3: error: heartbeat_interval: "),
        "{out:?}"
    );
}

#[test]
fn merged_values_are_used_and_config_shows_where_each_value_came_from() {
    let setup = NodeSetup::bare();
    setup.write(
        "cyberwave.yml",
        "defaults: &d\n  profile_slug: from-merge\n  upload_results: off\ncyberwave:\n  <<: *d\n  inference: python i.py {body}\n  max_log_bytes: 4096\n  max_concurrent_workloads: 2\ncloud_node:\n  max_concurrent_workloads: 5\n  gpus_per_workload: 2\n  max_result_bytes: \"1_000\"\n  workflow_reporting: off\n",
    );
    for lenient in [false, true] {
        let mut args = vec!["config", "--json"];
        if lenient {
            args.push("--lenient");
        }
        let out = setup.run(&args);
        assert_eq!(out.code, Some(0), "{out:?}");
        let cfg: Value = serde_json::from_str(&out.stdout).expect("json");
        let v = |k: &str| cfg[k]["value"].as_str().unwrap_or_default().to_string();
        let s = |k: &str| cfg[k]["source"].as_str().unwrap_or_default().to_string();
        assert_eq!(v("profile_slug"), "from-merge", "{cfg}");
        assert_eq!(v("upload_results"), "false");
        assert_eq!(v("max_concurrent_workloads"), "5", "cloud_node: wins");
        assert!(
            s("max_concurrent_workloads").ends_with("(cloud_node:)"),
            "{cfg}"
        );
        assert_eq!(v("max_log_bytes"), "4096");
        assert!(s("max_log_bytes").ends_with("(cyberwave:)"), "{cfg}");
        assert_eq!(v("gpus_per_workload"), "2");
        assert_eq!(v("max_result_bytes"), "1000");
        assert_eq!(v("workflow_reporting"), "off");
        assert!(s("profile_slug").ends_with("(cyberwave:)"), "{cfg}");
    }
    let out = setup.run(&["config"]);
    out.assert_stdout("max_concurrent_workloads: ignored: `cloud_node:` sets it too");
}

/// What `validate` says about `start` is true: on every corpus file, `config` (which resolves
/// the settings exactly as `start` does) succeeds unless `validate` named an error that `start`
/// cannot live with.
#[test]
fn validate_tells_the_truth_about_start_on_every_corpus_file() {
    let setup = NodeSetup::bare();
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .expect("corpus dir")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "yml"))
        .collect();
    files.sort();
    let mut blocked = 0;
    for f in &files {
        let path = f.to_string_lossy().into_owned();
        let v = setup.run(&["validate", &path]);
        let fatal = v.stdout.lines().chain(v.stderr.lines()).any(|l| {
            l.contains(": error: ") && !l.ends_with("[`start` would still run this file]")
        });
        let c = setup.run(&["config", "--config", &path]);
        let expected = if fatal { Some(2) } else { Some(0) };
        assert_eq!(
            c.code, expected,
            "{path}: validate said\n{}\nconfig said\n{}{}",
            v.stdout, c.stdout, c.stderr
        );
        if fatal {
            blocked += 1;
            assert!(c.stderr.contains("error: "), "{}", c.stderr);
        } else {
            assert!(!c.stderr.contains("panicked"));
        }
    }
    assert!(
        blocked >= 5 && blocked < files.len() / 2,
        "{blocked} blocked"
    );
}
