//! One node of an rmqtt cluster on loopback, for the failover benchmark:
//!
//!     cw-bench-rmqtt broadcast|raft ID MQTT_ADDR GRPC_ADDR PLUGIN_CONFIG_DIR
//!
//! The plugin's own config file (`rmqtt-cluster-broadcast.toml` or `rmqtt-cluster-raft.toml`)
//! is in PLUGIN_CONFIG_DIR, written by the benchmark. Logs go to stderr, one line per record
//! with the Unix time in milliseconds.

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use rmqtt::{context::ServerContext, net::Builder, server::MqttServer};

struct Stderr;

impl log::Log for Stderr {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::Level::Info
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            let ms = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or(0);
            let _ = writeln!(
                std::io::stderr(),
                "{ms} {} {}: {}",
                r.level(),
                r.target(),
                r.args()
            );
        }
    }
    fn flush(&self) {}
}

static LOGGER: Stderr = Stderr;

#[tokio::main]
async fn main() -> rmqtt::Result<()> {
    let _ = log::set_logger(&LOGGER).map(|()| log::set_max_level(log::LevelFilter::Info));
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [mode, id, mqtt, grpc, dir] = args.as_slice() else {
        eprintln!("usage: cw-bench-rmqtt broadcast|raft ID MQTT_ADDR GRPC_ADDR PLUGIN_CONFIG_DIR");
        std::process::exit(2);
    };
    let id: u64 = id.parse()?;
    let mqtt: std::net::SocketAddr = mqtt.parse()?;
    let grpc: std::net::SocketAddr = grpc.parse()?;
    let scx = ServerContext::new()
        .node_id(id)
        // The benchmark shares a small machine: never refuse a client as "busy".
        .busy_check_enable(false)
        .plugins_config_dir(dir.as_str())
        .build()
        .await;
    scx.node.start_grpc_server(scx.clone(), grpc, true, false);
    match mode.as_str() {
        "broadcast" => rmqtt_cluster_broadcast::register(&scx, true, true).await?,
        "raft" => rmqtt_cluster_raft::register(&scx, true, true).await?,
        other => {
            eprintln!("unknown cluster mode {other}");
            std::process::exit(2);
        }
    }
    log::info!("node {id}: MQTT listener on {mqtt}");
    MqttServer::new(scx)
        .listener(
            Builder::new()
                .name("external/tcp")
                .reuseaddr(Some(true))
                .laddr(mqtt)
                .allow_anonymous(true)
                .bind()?
                .tcp()?,
        )
        .build()
        .run()
        .await?;
    Ok(())
}
