//! What a workload finds in its environment: its own credentials and context (guarantee 7),
//! the broker's CA under the SDK's name too, and nothing the node made up, shaped like the
//! platform's own compute repositories run unmodified on a node: a training that derives its
//! API from `CYBERWAVE_ENVIRONMENT` when no URL is set, a workload whose SDK logs in to a site
//! broker (D62).

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

use crate::support::node::{NodeSetup, TOKEN};
use crate::support::scenario::completion;
use crate::support::timeouts::{DONE, EXIT, READY};
use crate::support::tls::Pki;
use crate::support::{wait_for, Broker, ControlPlane, NodeProcess, Rig, Scenario, Start};

#[test]
fn g7_the_workload_gets_its_own_credentials_and_context() {
    let (rig, node) =
        Scenario::new("cyberwave:\n  training: env | grep -E '^CYBERWAVE_' | sort > env.txt\n")
            .node();
    Start::new("training", "env-1").params(json!({"workload_uuid": "wl-env", "cyberwave_workload_token": "cw_scoped_workload_token"})).reply(&rig.cp, &node);
    completion(&rig.cp, "wl-env");
    let env = std::fs::read_to_string(rig.work("env.txt")).unwrap_or_default();
    assert!(
        env.contains("CYBERWAVE_API_KEY=cw_scoped_workload_token\n"),
        "{env}"
    );
    assert!(
        env.contains("CYBERWAVE_MQTT_PASSWORD=cw_scoped_workload_token\n"),
        "{env}"
    );
    assert!(env.contains("CYBERWAVE_REQUEST_ID=env-1\n"), "{env}");
    assert!(env.contains("CYBERWAVE_WORKLOAD_UUID=wl-env\n"), "{env}");
    assert!(env.contains("CYBERWAVE_WORKLOAD_TYPE=training\n"), "{env}");
    assert!(env.contains("CYBERWAVE_PARAMS_FILE=/"), "{env}");
    // D45: edge-core labels the containers a workload starts with these two.
    assert!(
        env.contains(&format!("CYBERWAVE_CLOUD_NODE_ID={}\n", node.uuid())),
        "{env}"
    );
    // Without TLS there is no CA to pass on.
    assert!(!env.contains("CYBERWAVE_MQTT_TLS_CA_CERT"), "{env}");
    assert!(
        !env.contains(TOKEN),
        "the node's own token is not passed on when a workload token came: {env}"
    );
    // Without a workload token the node's token is used (as the original does).
    Start::new("training", "env-2")
        .workload("wl-env2")
        .reply(&rig.cp, &node);
    completion(&rig.cp, "wl-env2");
    let env = std::fs::read_to_string(rig.work("env.txt")).unwrap_or_default();
    assert!(
        env.contains(&format!("CYBERWAVE_API_KEY={TOKEN}\n")),
        "{env}"
    );
    // The params file holds no token.
    assert!(
        !node.log().contains("cw_scoped_workload_token"),
        "a workload token reached the log"
    );
}

#[test]
fn with_tls_the_workload_gets_the_broker_ca_under_the_sdks_name_too() {
    // D45: the platform SDK reads `CYBERWAVE_MQTT_TLS_CA_CERT`; the node's own name is
    // `…_CERTS`. A workload's SDK client must reach the same broker the same way.
    let pki = Pki::new();
    // One broker: plain for the fake backend, TLS for the node.
    let tls_port = crate::support::free_port();
    let rig = Scenario::new(
        "cyberwave:\n  mqtt_tls_ca_certs: ca.pem\n  training: env | grep -E '^CYBERWAVE_' | sort > env.txt\n",
    )
    .broker(Broker::start_with_conf(&pki.listener(tls_port)))
    .env("CYBERWAVE_MQTT_PORT", &tls_port.to_string())
    .env("CYBERWAVE_MQTT_USE_TLS", "true")
    .rig();
    // Relative to the working dir in the manifest: the workload gets the absolute path.
    std::fs::copy(pki.ca(), rig.work("ca.pem")).unwrap();
    let node = rig.node();
    node.assert_logged("(TLS)");
    Start::new("training", "tls-1")
        .workload("wl-tls")
        .reply(&rig.cp, &node);
    completion(&rig.cp, "wl-tls");
    let env = std::fs::read_to_string(rig.work("env.txt")).unwrap_or_default();
    let ca = rig.setup.cwd.join("ca.pem").display().to_string();
    for name in ["CYBERWAVE_MQTT_TLS_CA_CERT", "CYBERWAVE_MQTT_TLS_CA_CERTS"] {
        assert!(env.contains(&format!("{name}={ca}\n")), "{name}: {env}");
    }
    assert!(env.contains("CYBERWAVE_MQTT_USE_TLS=true\n"), "{env}");
    assert!(
        env.contains(&format!("CYBERWAVE_MQTT_PORT={tls_port}\n")),
        "{env}"
    );
}

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

/// A standalone node (no backend, so that it needs no URL of its own either) whose backend
/// speaks under `prefix`, with the training of [`TRAIN_MANIFEST`].
fn train_rig(prefix: &str) -> Rig {
    Scenario::new(TRAIN_MANIFEST)
        .prefix(prefix)
        .unset("CYBERWAVE_BASE_URL")
        .arg("--standalone")
        .file("venv.sh", "export VIRTUAL_ENV=/opt/venv\n")
        .file("train.sh", TRAIN_SH)
        .rig()
}

fn train(cp: &ControlPlane, node: &NodeProcess, run: &str) {
    let r = Start::new("training", run)
        .params(json!({"workload_uuid": format!("wl-{run}"), "run": run}))
        .reply(cp, node);
    assert_eq!(r["status"], "ok", "{r}");
}

/// A training run with `CYBERWAVE_ENVIRONMENT=development` and no URL set by the operator
/// reports to the API its environment names, not to production: the node exports no
/// `CYBERWAVE_BASE_URL` of its own making (its built-in default would send it to production).
/// With a URL the operator set, that URL.
#[test]
fn d62_a_development_training_with_no_url_reports_where_its_environment_says() {
    let rig = train_rig("development");
    let Rig { cp, setup, .. } = &rig;
    assert_eq!(
        setup.env.get("CYBERWAVE_ENVIRONMENT").map(String::as_str),
        Some("development")
    );
    let mut node = rig.node();
    train(cp, &node, "dev-1");
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
    completion(cp, "wl-dev-1");
    node.sigterm();
    assert_eq!(node.wait_exit(EXIT), Some(Some(0)));

    // The operator's URL, when there is one, in a `.env` this time.
    setup.write(".env", "CYBERWAVE_BASE_URL=http://api.site.lan:8000/\n");
    let node = rig.node();
    train(cp, &node, "dev-2");
    let env = read_when_there(&setup.cwd.join("reported-dev-2"));
    assert!(
        env.contains("metrics go to http://api.site.lan:8000/api/v1/mltrainings"),
        "{env}"
    );
}

/// A broker of the site's own, with a login of its own: the SDK inside a workload logs in to it
/// with the login the operator set (`CYBERWAVE_MQTT_USERNAME` / `_PASSWORD`), as under the
/// original node (with the username dropped and the password replaced by the API token, the
/// workload would be refused). A per-workload token the backend minted is the workload's API key
/// and broker password, beside the operator's username.
#[test]
fn d62_the_sdk_in_a_workload_logs_in_to_the_site_broker_with_the_operators_login() {
    let broker = Broker::start_with_password("site-user", "site-pass");
    let mut setup = NodeSetup::standalone(broker.port);
    setup
        .set("CYBERWAVE_MQTT_USERNAME", "site-user")
        .set("CYBERWAVE_MQTT_PASSWORD", "site-pass")
        .set("CYBERWAVE_API_KEY", TOKEN);
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
            .is_ok_and(|s| s.success());
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
