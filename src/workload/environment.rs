//! A workload's environment.

/// Environment variables that hold the node's own secrets or identity; never passed on as they
/// are (a workload gets its own credentials explicitly, and derives its own MQTT username).
pub const NODE_ONLY_VARS: &[&str] = &[
    "CYBERWAVE_API_KEY",
    "CYBERWAVE_MQTT_PASSWORD",
    "CYBERWAVE_MQTT_USERNAME",
    "CYBERWAVE_CLOUD_NODE_INSTANCE_UUID",
];
