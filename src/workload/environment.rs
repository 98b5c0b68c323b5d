//! A workload's environment: the node's own environment files without the node's secrets, and
//! what the workload needs to reach its node, the platform and its GPUs.

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

/// What a workload's environment names beyond the settings and its record.
pub(super) struct Context<'a> {
    /// Its API key and broker password: its own token, else the node's (none when empty).
    pub credential: String,
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

/// The environment a workload runs in (D2/D3 and the per-workload token of ecosystem §5).
pub(super) fn of(s: &Settings, meta: &Meta, c: &Context) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = s.env.merged();
    for k in NODE_ONLY_VARS {
        env.remove(*k);
    }
    // The simulated slow disk (`store::slow_disk_pause`) is the node's own, not its workloads'.
    env.remove("CYBERWAVE_TEST_SLOW_FSYNC_MS");
    if !c.credential.is_empty() {
        env.insert("CYBERWAVE_API_KEY".into(), c.credential.clone());
        env.insert("CYBERWAVE_MQTT_PASSWORD".into(), c.credential.clone());
    }
    workload_vars(&mut env, meta, c);
    platform_vars(&mut env, s, c.node_uuid);
    if let Some(gpus) = &meta.gpus {
        gpu_vars(&mut env, gpus);
    }
    env
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

/// Where the platform and its broker are.
fn platform_vars(env: &mut BTreeMap<String, String>, s: &Settings, node_uuid: &str) {
    env.insert("CYBERWAVE_BASE_URL".into(), s.base_url.value.clone());
    env.insert("CYBERWAVE_MQTT_HOST".into(), s.mqtt_host.value.clone());
    env.insert("CYBERWAVE_MQTT_PORT".into(), s.mqtt_port.value.to_string());
    env.insert(
        "CYBERWAVE_MQTT_USE_TLS".into(),
        s.mqtt_use_tls.value.to_string(),
    );
    env.insert(
        "CYBERWAVE_MQTT_TOPIC_PREFIX".into(),
        s.topic_prefix.value.clone(),
    );
    // D45: what the platform SDK and edge-core read. Edge-core labels the containers a
    // workload starts with this node and workload (`container_spec.workload_labels`); the SDK
    // takes the broker's CA under its own name.
    env.insert("CYBERWAVE_CLOUD_NODE_ID".into(), node_uuid.to_string());
    if let Some(ca) = s.mqtt_ca_certs.as_ref().filter(|_| s.mqtt_use_tls.value) {
        for name in ["CYBERWAVE_MQTT_TLS_CA_CERTS", "CYBERWAVE_MQTT_TLS_CA_CERT"] {
            env.insert(name.into(), ca.value.display().to_string());
        }
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
