//! What a workload finds in its environment and how its template reads, shaped like the
//! platform's own compute repositories run unmodified on a node: a training that derives its API
//! from `CYBERWAVE_ENVIRONMENT` when no URL is set, a workload whose SDK logs in to a site
//! broker, and a model served from a snap that is called with `curl -d '{body}'` (D62, D63).

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

use crate::support::node::{NodeSetup, TOKEN};
use crate::support::scenario::{completion, Start};
use crate::support::timeouts::{DONE, EXIT, READY};
use crate::support::{wait_for, Broker, ControlPlane, NodeProcess};

/// A training entry point as the platform's repositories write it (not their code): the API is
/// `CYBERWAVE_API_URL`, else `CYBERWAVE_BASE_URL`, else derived from `CYBERWAVE_ENVIRONMENT`
/// (`local`/`dev`/`development` → the local API, `production` → the public one, anything else
/// → the development API). It reports where it would send its metrics, and its environment.
const TRAIN_SH: &str = r#"#!/bin/sh
api="${CYBERWAVE_API_URL:-$CYBERWAVE_BASE_URL}"
if [ -z "$api" ]; then
  case "$(printf %s "${CYBERWAVE_ENVIRONMENT:-production}" | tr A-Z a-z)" in
    local|localhost|dev|development) api=http://localhost:8000 ;;
    production) api=https://api.cyberwave.com ;;
    *) api=https://api-dev.cyberwave.com ;;
  esac
fi
out="$(dirname "$0")/reported-$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["run"])' "$1")"
{ env | grep '^CYBERWAVE_' | sort; echo "metrics go to $api/api/v1/mltrainings"; } > "$out.tmp"
mv "$out.tmp" "$out"
"#;

/// The training section of a `cyberwave.yml` shaped like the SmolVLA repository's: a
/// multi-line template that sources a venv, then runs the entry point with `{body}`.
const TRAIN_MANIFEST: &str = "cyberwave-cloud-node:\n  training: |\n    . ./venv.sh && \\\n    sh train.sh {body}\n  results_folder: ./runs/artifacts\n  upload_results: true\n";

fn read_when_there(path: &Path) -> String {
    wait_for(DONE, || std::fs::read_to_string(path).ok())
        .unwrap_or_else(|| panic!("{} was never written", path.display()))
}

fn lines_of<'a>(env: &'a str, prefix: &str) -> Vec<&'a str> {
    env.lines().filter(|l| l.starts_with(prefix)).collect()
}

fn train_rig(prefix: &str) -> (Broker, ControlPlane, NodeSetup) {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, prefix);
    let mut setup = NodeSetup::new(&broker, &cp);
    // No backend: the node is standalone, so that it needs no URL of its own either.
    setup.unset("CYBERWAVE_BASE_URL").arg("--standalone");
    setup.write("cyberwave.yml", TRAIN_MANIFEST);
    setup.write("venv.sh", "export VIRTUAL_ENV=/opt/venv\n");
    setup.write("train.sh", TRAIN_SH);
    (broker, cp, setup)
}

fn train(cp: &ControlPlane, node: &NodeProcess, run: &str) {
    let r = Start::new("training", run)
        .params(json!({"workload_uuid": format!("wl-{run}"), "run": run}))
        .reply(cp, node);
    assert_eq!(r["status"], "ok", "{r}");
}

/// A training run with `CYBERWAVE_ENVIRONMENT=development` and no URL set by the operator
/// reports to the API its environment names, not to production: the node exports no
/// `CYBERWAVE_BASE_URL` of its own making (before, its built-in default always went out). With
/// a URL the operator set, that URL.
#[test]
fn d62_a_development_training_with_no_url_reports_where_its_environment_says() {
    let (_broker, cp, setup) = train_rig("development");
    assert_eq!(
        setup.env.get("CYBERWAVE_ENVIRONMENT").map(String::as_str),
        Some("development")
    );
    let mut node = setup.spawn();
    node.wait_ready(READY);
    train(&cp, &node, "dev-1");
    let env = read_when_there(&setup.cwd.join("reported-dev-1"));
    assert!(
        env.contains("metrics go to http://localhost:8000/api/v1/mltrainings"),
        "{env}"
    );
    assert!(lines_of(&env, "CYBERWAVE_BASE_URL=").is_empty(), "{env}");
    assert!(env.contains("CYBERWAVE_ENVIRONMENT=development\n"), "{env}");
    // Nothing else the node made up or worked out: the SDK derives the same itself.
    for derived in ["CYBERWAVE_MQTT_USE_TLS=", "CYBERWAVE_MQTT_TOPIC_PREFIX="] {
        assert!(lines_of(&env, derived).is_empty(), "{derived}: {env}");
    }
    // What the operator set goes through: the broker, the node's token as the API key.
    assert!(env.contains("CYBERWAVE_MQTT_HOST=127.0.0.1\n"), "{env}");
    assert!(
        env.contains(&format!("CYBERWAVE_API_KEY={TOKEN}\n")),
        "{env}"
    );
    completion(&cp, "wl-dev-1");
    node.sigterm();
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)));

    // The operator's URL, when there is one, in a `.env` this time.
    setup.write(".env", "CYBERWAVE_BASE_URL=http://api.site.lan:8000/\n");
    let node = setup.spawn();
    node.wait_ready(READY);
    train(&cp, &node, "dev-2");
    let env = read_when_there(&setup.cwd.join("reported-dev-2"));
    assert!(
        env.contains("metrics go to http://api.site.lan:8000/api/v1/mltrainings"),
        "{env}"
    );
}

/// A broker of the site's own, with a login of its own: the SDK inside a workload logs in to it
/// with the login the operator set (`CYBERWAVE_MQTT_USERNAME` / `_PASSWORD`), as under the
/// original node. Before, the username was dropped and the password replaced by the API token,
/// so the workload was refused. A per-workload token the backend minted is the workload's API key
/// and broker password, beside the operator's username.
#[test]
fn d62_the_sdk_in_a_workload_logs_in_to_the_site_broker_with_the_operators_login() {
    let broker = Broker::start_with_password("site-user", "site-pass");
    let mut setup = NodeSetup::bare();
    setup
        .set("CYBERWAVE_MQTT_HOST", "127.0.0.1")
        .set("CYBERWAVE_MQTT_PORT", &broker.port.to_string())
        .set("CYBERWAVE_MQTT_USERNAME", "site-user")
        .set("CYBERWAVE_MQTT_PASSWORD", "site-pass")
        .set("CYBERWAVE_API_KEY", TOKEN)
        .arg("--standalone");
    // The SDK's rule (`cyberwave.config`): username `CYBERWAVE_MQTT_USERNAME`, else its
    // placeholder; password `CYBERWAVE_MQTT_PASSWORD`, else the API key.
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  max_concurrent_workloads: 2\n  inference: |\n    run=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[\"run\"])' {body})\n    env | grep '^CYBERWAVE_' | sort > env.tmp\n    if mosquitto_pub -h \"$CYBERWAVE_MQTT_HOST\" -p \"$CYBERWAVE_MQTT_PORT\" -u \"${CYBERWAVE_MQTT_USERNAME:-mqttcyb}\" -P \"${CYBERWAVE_MQTT_PASSWORD:-$CYBERWAVE_API_KEY}\" -q 1 -t site/probe -m hello; then echo logged-in; else echo refused; fi >> env.tmp\n    mv env.tmp env-$run.txt\n",
    );
    let node = setup.spawn();
    node.wait_ready(READY);
    let command = |run: &str, params: Value| {
        let body = json!({"command": "inference", "request_id": run, "params": params});
        let ok = Command::new("mosquitto_pub")
            .args(["-h", "127.0.0.1", "-p", &broker.port.to_string()])
            .args(["-u", "site-user", "-P", "site-pass", "-q", "1"])
            .args([
                "-t",
                &format!("cyberwave/cloud-node/{}/command", node.uuid()),
            ])
            .args(["-m", &body.to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "mosquitto_pub of the command");
    };
    command("site-1", json!({"run": "site-1"}));
    let env = read_when_there(&setup.cwd.join("env-site-1.txt"));
    assert!(env.ends_with("\nlogged-in\n"), "{env}");
    assert!(env.contains("CYBERWAVE_MQTT_USERNAME=site-user\n"), "{env}");
    assert!(env.contains("CYBERWAVE_MQTT_PASSWORD=site-pass\n"), "{env}");
    assert!(
        env.contains(&format!("CYBERWAVE_API_KEY={TOKEN}\n")),
        "{env}"
    );

    command(
        "site-2",
        json!({"run": "site-2", "cyberwave_workload_token": "cw_minted_for_this_workload"}),
    );
    let env = read_when_there(&setup.cwd.join("env-site-2.txt"));
    // (The site broker knows only its own password: the minted token is not it.)
    assert!(env.ends_with("\nrefused\n"), "{env}");
    assert!(env.contains("CYBERWAVE_MQTT_USERNAME=site-user\n"), "{env}");
    assert!(
        env.contains("CYBERWAVE_MQTT_PASSWORD=cw_minted_for_this_workload\n"),
        "{env}"
    );
    assert!(
        env.contains("CYBERWAVE_API_KEY=cw_minted_for_this_workload\n"),
        "{env}"
    );
    assert!(!env.contains("site-pass"), "{env}");
    let _ = node;
}

/// The snap-served model's manifest: its inference posts `{body}` with `curl -d '{body}'`, which
/// sends the params file's path as text. `validate` says so (still valid: the platform accepts
/// it) and shows the whole template, every line; `start` says so in its log.
#[test]
fn d63_a_curl_template_with_body_in_quotes_is_warned_about_by_validate_and_at_start() {
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
    setup.write(
        "cyberwave.yml",
        "# A model served from a snap.\ncyberwave-cloud-node:\n  profile_slug: openvla-oft\n  install_script: ./install.sh\n  inference: |\n    curl -sf -X POST http://localhost:8080/act \\\n      -H \"Content-Type: application/json\" \\\n      -d '{body}'\n",
    );
    let install = setup.write("install.sh", "#!/bin/sh\nexit 0\n");
    std::fs::set_permissions(
        &install,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let out = setup.run(&["validate"]);
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
    assert!(out.stdout.contains("OK (1 warning)"), "{}", out.stdout);

    let node = setup.spawn();
    node.wait_ready(READY);
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
    let broker = Broker::start();
    let cp = ControlPlane::start(broker.port, "");
    let setup = NodeSetup::new(&broker, &cp);
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
    assert!(
        out.stdout
            .contains("  training: [shell mode] python train.py {body}\n"),
        "{}",
        out.stdout
    );
}
