//! A real rumqttd 0.20 (a second MQTT v5 broker) on a free loopback port, started by the
//! launcher of `broker.rs` as a [`Broker`]; stopped on drop. `scripts/deps.sh` installs it once
//! (`cargo install rumqttd --version 0.20.0`).

use std::path::PathBuf;
use std::process::{Command, Stdio};

use super::broker::BrokerProcess;
use super::{Broker, TempDir};

/// rumqttd, started as a [`Broker`] (so it can be a rig's broker: `Scenario::broker`).
pub struct Rumqttd;

fn bin() -> PathBuf {
    let home = std::env::var("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cargo")
        });
    let p = home.join("bin/rumqttd");
    if p.exists() {
        p
    } else {
        PathBuf::from("rumqttd")
    }
}

impl Rumqttd {
    /// `max_payload`: rumqttd's `max_payload_size`; it drops a client that publishes more,
    /// without saying so in CONNACK.
    pub fn start(max_payload: usize) -> Broker {
        Broker(BrokerProcess::start(
            TempDir::new("rumqttd"),
            "rumqttd.log",
            "rumqttd did not start (is it installed? scripts/deps.sh installs it)",
            Box::new(move |dir, port| {
                let conf = format!(
                    "id = 0\n\n[router]\nid = 0\nmax_connections = 1000\nmax_outgoing_packet_count = 200\nmax_segment_size = 104857600\nmax_segment_count = 10\n\n[v5.1]\nname = \"v5-1\"\nlisten = \"127.0.0.1:{port}\"\nnext_connection_delay_ms = 1\n    [v5.1.connections]\n    connection_timeout_ms = 60000\n    max_payload_size = {max_payload}\n    max_inflight_count = 100\n"
                );
                let path = dir.write("rumqttd.toml", &conf);
                let log = std::fs::File::create(dir.join("rumqttd.log")).ok()?;
                let mut cmd = Command::new(bin());
                cmd.arg("-c")
                    .arg(path)
                    .stdout(log.try_clone().map_or(Stdio::null(), Stdio::from))
                    .stderr(Stdio::from(log));
                Some(cmd)
            }),
        ))
    }
}
