//! The broker connection the settings describe: the one place that turns [`Settings`] into
//! the MQTT client's options (used by `start` and by `doctor`'s broker check).

use super::Settings;
use crate::mqtt::{self, MqttError, MqttOptions};
use crate::util;

/// The broker connection the settings describe (TLS trust store, username chain, password).
pub fn mqtt_options(
    s: &Settings,
    client_id: String,
    session_expiry: std::time::Duration,
) -> Result<MqttOptions, MqttError> {
    let ca_file = if s.mqtt_use_tls.value {
        Some(mqtt::trust_store(
            s.mqtt_ca_certs.as_ref().map(|c| c.value.as_path()),
            s.env.value("SSL_CERT_FILE").as_deref(),
        )?)
    } else {
        None
    };
    let username = s
        .mqtt_username
        .as_ref()
        .map(|u| u.value.clone())
        .or_else(|| s.instance_uuid.as_ref().map(|u| u.value.clone()))
        .or_else(|| s.slug_hint.as_ref().map(|u| u.value.clone()))
        .unwrap_or_else(|| {
            format!(
                "cloud-node-bootstrap-{}",
                util::hex(&util::random_bytes::<4>())
            )
        });
    let endpoints = mqtt::parse_endpoints(&s.mqtt_host.value, s.mqtt_port.value)?;
    let endpoints = mqtt::shuffled(endpoints, || u64::from_le_bytes(util::random_bytes::<8>()));
    Ok(MqttOptions {
        endpoints,
        tls: s.mqtt_use_tls.value,
        ca_file,
        client_id,
        username,
        password: s.mqtt_password.as_ref().map(|p| p.value.clone()),
        keep_alive: std::time::Duration::from_secs(60),
        session_expiry,
        connect_timeout: s.tuning.connect_timeout,
    })
}
