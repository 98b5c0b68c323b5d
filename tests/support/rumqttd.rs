//! A real rumqttd 0.20 (a second MQTT v5 broker, issue 22) on a free loopback port; stopped on
//! drop. `scripts/deps.sh` installs it once (`cargo install rumqttd --version 0.20.0`).

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, wait_for, TempDir};

pub struct Rumqttd {
    pub port: u16,
    dir: TempDir,
    child: Option<Child>,
    /// rumqttd's `max_payload_size`: it drops a client that publishes more, without saying so
    /// in CONNACK.
    max_payload: usize,
}

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
    pub fn start(max_payload: usize) -> Rumqttd {
        let mut b = Rumqttd {
            port: 0,
            dir: TempDir::new("rumqttd"),
            child: None,
            max_payload,
        };
        for _ in 0..10 {
            b.port = free_port();
            if b.spawn() {
                return b;
            }
        }
        panic!("rumqttd did not start (is it installed? scripts/deps.sh installs it)");
    }

    fn spawn(&mut self) -> bool {
        let conf = format!(
            "id = 0\n\n[router]\nid = 0\nmax_connections = 1000\nmax_outgoing_packet_count = 200\nmax_segment_size = 104857600\nmax_segment_count = 10\n\n[v5.1]\nname = \"v5-1\"\nlisten = \"127.0.0.1:{}\"\nnext_connection_delay_ms = 1\n    [v5.1.connections]\n    connection_timeout_ms = 60000\n    max_payload_size = {}\n    max_inflight_count = 100\n",
            self.port, self.max_payload
        );
        let path = self.dir.write("rumqttd.toml", &conf);
        let log = std::fs::File::create(self.dir.join("rumqttd.log")).ok();
        let child = Command::new(bin())
            .arg("-c")
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(
                log.as_ref()
                    .and_then(|f| f.try_clone().ok())
                    .map_or(Stdio::null(), Stdio::from),
            )
            .stderr(log.map_or(Stdio::null(), Stdio::from))
            .spawn();
        let Ok(child) = child else {
            return false;
        };
        self.child = Some(child);
        let port = self.port;
        let up = wait_for(Duration::from_secs(5), || {
            TcpStream::connect(("127.0.0.1", port)).ok().map(|_| ())
        })
        .is_some();
        let alive = self
            .child
            .as_mut()
            .map(|c| matches!(c.try_wait(), Ok(None)))
            .unwrap_or(false);
        if !(up && alive) {
            self.stop();
            return false;
        }
        true
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts again on the same port (sessions are gone).
    pub fn restart(&mut self) {
        self.stop();
        for _ in 0..50 {
            if self.spawn() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("rumqttd did not restart on port {}", self.port);
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("rumqttd.log")).unwrap_or_default()
    }
}

impl Drop for Rumqttd {
    fn drop(&mut self) {
        self.stop();
    }
}
