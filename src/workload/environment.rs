//! A workload's environment: the node's own environment files without the node's secrets, and
//! what the workload needs to reach its node, the platform and its GPUs. The table in
//! docs/workloads.md ("The workload's environment") says what a workload gets in each case; keep it true.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::record::Meta;
use super::user::WorkloadUser;
use crate::config::Settings;

/// Environment variables that hold the node's own secrets or identity; never passed on as they
/// are (a workload gets its own credentials explicitly, and derives its own MQTT username).
pub const NODE_ONLY_VARS: &[&str] = &[
    "CYBERWAVE_API_KEY",
    "CYBERWAVE_MQTT_PASSWORD",
    "CYBERWAVE_MQTT_USERNAME",
    "CYBERWAVE_CLOUD_NODE_INSTANCE_UUID",
];

/// The connection variables a workload gets only as the operator set them (D62,
/// `Settings::workload_connection`): never the node's defaults, never what the node derived.
pub const CONNECTION_VARS: &[&str] = &[
    "CYBERWAVE_BASE_URL",
    "CYBERWAVE_ENVIRONMENT",
    "CYBERWAVE_MQTT_HOST",
    "CYBERWAVE_MQTT_PORT",
    "CYBERWAVE_MQTT_USE_TLS",
    "CYBERWAVE_MQTT_USERNAME",
    "CYBERWAVE_MQTT_PASSWORD",
    "CYBERWAVE_MQTT_TLS_CA_CERTS",
];

/// What a workload's environment names beyond the settings and its record.
pub(super) struct Context<'a> {
    /// The per-workload token the backend minted (`cyberwave_workload_token`), if any.
    pub workload_token: Option<String>,
    /// The node's own API token (empty when it has none, as a standalone node may).
    pub node_token: &'a str,
    pub params_file: &'a Path,
    pub results_dir: Option<&'a Path>,
    pub user: Option<&'a WorkloadUser>,
    pub inputs: PathBuf,
    /// The node's control socket and binary, for `emit`.
    pub socket: &'a Path,
    pub exe: &'a Path,
    /// The node's instance UUID (D45).
    pub node_uuid: &'a str,
}

/// The environment a workload runs in (D2/D3, D45, D62).
pub(super) fn of(s: &Settings, meta: &Meta, c: &Context) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = s.env.merged();
    for k in NODE_ONLY_VARS.iter().chain(CONNECTION_VARS) {
        env.remove(*k);
    }
    // The simulated slow disk (`store::slow_disk_pause`) is the node's own, not its workloads'.
    env.remove("CYBERWAVE_TEST_SLOW_FSYNC_MS");
    env.extend(s.workload_connection.clone());
    credentials(&mut env, c);
    workload_vars(&mut env, meta, c);
    // D45: edge-core labels the containers a workload starts with this node and workload
    // (`container_spec.workload_labels`).
    env.insert("CYBERWAVE_CLOUD_NODE_ID".into(), c.node_uuid.to_string());
    if let Some(gpus) = &meta.gpus {
        gpu_vars(&mut env, gpus);
    }
    env
}

/// D62: a minted per-workload token is the workload's API key and broker password (as the
/// original node passes it); without one the API key is the node's token and the broker
/// password stays the operator's own, if any (the SDK falls back to the API key).
fn credentials(env: &mut BTreeMap<String, String>, c: &Context) {
    let minted = c.workload_token.as_deref().filter(|t| !t.trim().is_empty());
    match minted {
        Some(token) => {
            env.insert("CYBERWAVE_API_KEY".into(), token.to_string());
            env.insert("CYBERWAVE_MQTT_PASSWORD".into(), token.to_string());
        }
        None if !c.node_token.is_empty() => {
            env.insert("CYBERWAVE_API_KEY".into(), c.node_token.to_string());
        }
        None => {}
    }
}

/// What the workload reads about itself and its node.
fn workload_vars(env: &mut BTreeMap<String, String>, meta: &Meta, c: &Context) {
    env.insert(
        "CYBERWAVE_PARAMS_FILE".into(),
        c.params_file.display().to_string(),
    );
    // An environment value cannot hold NUL; such an id is passed with NUL as U+FFFD.
    env.insert(
        "CYBERWAVE_REQUEST_ID".into(),
        meta.request_id_text().replace('\0', "\u{FFFD}"),
    );
    env.insert("CYBERWAVE_WORKLOAD_TYPE".into(), meta.kind.to_string());
    if let Some(d) = c.results_dir {
        env.insert("CYBERWAVE_RESULTS_DIR".into(), d.display().to_string());
    }
    if let Some(u) = c.user {
        env.insert("HOME".into(), u.home.display().to_string());
        env.insert("USER".into(), u.name.clone());
        env.insert("LOGNAME".into(), u.name.clone());
    }
    env.insert(
        "CYBERWAVE_INPUTS_DIR".into(),
        c.inputs.display().to_string(),
    );
    env.insert(
        "CYBERWAVE_NODE_SOCKET".into(),
        c.socket.display().to_string(),
    );
    env.insert("CYBERWAVE_NODE_BIN".into(), c.exe.display().to_string());
    env.insert(
        "CYBERWAVE_NODE_EVENT_TOKEN".into(),
        meta.event_token.clone(),
    );
    if let Some(wl) = &meta.workload_uuid {
        env.insert("CYBERWAVE_WORKLOAD_UUID".into(), wl.to_string());
    }
}

/// D36: exactly its GPUs, by UUID; none at all when it needs none.
fn gpu_vars(env: &mut BTreeMap<String, String>, gpus: &[String]) {
    let list = gpus.join(",");
    env.insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
    env.insert("CUDA_VISIBLE_DEVICES".into(), list.clone());
    let nvidia = if list.is_empty() { "none".into() } else { list };
    env.insert("NVIDIA_VISIBLE_DEVICES".into(), nvidia);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::env::EnvLayers;
    use crate::workload::testkit::{good_meta, scratch};

    /// The environment of a workload of a node started with `vars` (and a config dir of its
    /// own), with `token` minted or not, as `user` or not.
    fn env_of(
        tag: &str,
        vars: &[(&str, &str)],
        token: Option<&str>,
        user: Option<&WorkloadUser>,
    ) -> BTreeMap<String, String> {
        let layout = scratch(tag);
        let mut process: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        process.insert(
            "CYBERWAVE_EDGE_CONFIG_DIR".into(),
            layout.state.display().to_string(),
        );
        let s = crate::config::resolve(
            &crate::config::Flags::default(),
            EnvLayers::new(process),
            &layout.state,
        )
        .unwrap();
        let meta: Meta = serde_json::from_value(good_meta(&layout)).unwrap();
        let node_token = s
            .api_token
            .as_ref()
            .map(|t| t.value.clone())
            .unwrap_or_default();
        let env = of(
            &s,
            &meta,
            &Context {
                workload_token: token.map(String::from),
                node_token: &node_token,
                params_file: Path::new("/state/workloads/w1/params.json"),
                results_dir: None,
                user,
                inputs: PathBuf::from("/state/inputs"),
                socket: Path::new("/state/control.sock"),
                exe: Path::new("/usr/bin/cyberwave-cloud-node"),
                node_uuid: "node-uuid",
            },
        );
        let _ = std::fs::remove_dir_all(&layout.state);
        env
    }

    fn get<'a>(env: &'a BTreeMap<String, String>, k: &str) -> Option<&'a str> {
        env.get(k).map(String::as_str)
    }

    #[test]
    fn d62_no_url_is_made_up_for_a_workload_that_derives_its_own() {
        let env = env_of(
            "d62-dev",
            &[
                ("CYBERWAVE_ENVIRONMENT", "development"),
                ("CYBERWAVE_API_KEY", "cw_node"),
                ("HOME", "/home/node"),
            ],
            None,
            None,
        );
        assert_eq!(get(&env, "CYBERWAVE_ENVIRONMENT"), Some("development"));
        for absent in [
            "CYBERWAVE_BASE_URL",
            "CYBERWAVE_MQTT_HOST",
            "CYBERWAVE_MQTT_PORT",
            "CYBERWAVE_MQTT_USE_TLS",
            "CYBERWAVE_MQTT_TOPIC_PREFIX",
            "CYBERWAVE_MQTT_USERNAME",
            "CYBERWAVE_MQTT_PASSWORD",
        ] {
            assert_eq!(get(&env, absent), None, "{absent}: {env:?}");
        }
        assert_eq!(get(&env, "CYBERWAVE_API_KEY"), Some("cw_node"));
        assert_eq!(get(&env, "HOME"), Some("/home/node"));
        assert_eq!(get(&env, "CYBERWAVE_CLOUD_NODE_ID"), Some("node-uuid"));
    }

    #[test]
    fn d62_the_operators_broker_login_passes_and_a_minted_token_replaces_the_password() {
        let vars = [
            ("CYBERWAVE_MQTT_USERNAME", "site-user"),
            ("CYBERWAVE_MQTT_PASSWORD", "site-pass"),
            ("CYBERWAVE_API_KEY", "cw_node"),
        ];
        let env = env_of("d62-login", &vars, None, None);
        assert_eq!(get(&env, "CYBERWAVE_MQTT_USERNAME"), Some("site-user"));
        assert_eq!(get(&env, "CYBERWAVE_MQTT_PASSWORD"), Some("site-pass"));
        assert_eq!(get(&env, "CYBERWAVE_API_KEY"), Some("cw_node"));
        let env = env_of("d62-minted", &vars, Some("cw_workload"), None);
        assert_eq!(get(&env, "CYBERWAVE_MQTT_USERNAME"), Some("site-user"));
        assert_eq!(get(&env, "CYBERWAVE_MQTT_PASSWORD"), Some("cw_workload"));
        assert_eq!(get(&env, "CYBERWAVE_API_KEY"), Some("cw_workload"));
        // An empty token is no token.
        let env = env_of("d62-empty", &vars, Some(" "), None);
        assert_eq!(get(&env, "CYBERWAVE_API_KEY"), Some("cw_node"));
        assert_eq!(get(&env, "CYBERWAVE_MQTT_PASSWORD"), Some("site-pass"));
        // Without a node token (standalone) nor a minted one: no API key at all.
        let env = env_of("d62-nokey", &[], None, None);
        assert_eq!(get(&env, "CYBERWAVE_API_KEY"), None);
        assert_eq!(get(&env, "CYBERWAVE_MQTT_PASSWORD"), None);
    }

    #[test]
    fn d62_a_workload_user_gets_its_own_home_user_and_logname() {
        let user = WorkloadUser {
            name: "cwwork0".into(),
            uid: 1500,
            gid: 1500,
            groups: vec![1500],
            home: PathBuf::from("/home/cwwork0"),
        };
        let vars = [("HOME", "/root"), ("USER", "root"), ("LOGNAME", "root")];
        let env = env_of("d62-user", &vars, None, Some(&user));
        assert_eq!(get(&env, "HOME"), Some("/home/cwwork0"));
        assert_eq!(get(&env, "USER"), Some("cwwork0"));
        assert_eq!(get(&env, "LOGNAME"), Some("cwwork0"));
        let env = env_of("d62-nouser", &vars, None, None);
        assert_eq!(get(&env, "HOME"), Some("/root"));
        assert_eq!(get(&env, "USER"), Some("root"));
    }
}
