//! A real mosquitto on a free loopback port, with its own config and data dir; stopped on drop.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, wait_for, TempDir};

pub struct Broker {
    pub port: u16,
    dir: TempDir,
    child: Option<Child>,
    tls: Option<(PathBuf, PathBuf, PathBuf)>,
    /// A password file inside `dir`: only its users may connect.
    passwords: Option<PathBuf>,
    /// The port of a hub broker this one bridges every topic to and from (MQTT v5), as the
    /// nodes of a cluster share their traffic.
    bridge_to: Option<u16>,
    /// Extra lines for `mosquitto.conf` (limits).
    extra_conf: String,
    /// An ACL file's text (mosquitto's `acl_file` syntax), written into `dir`.
    acl: Option<String>,
}

fn mosquitto_bin() -> String {
    for p in [
        "/usr/sbin/mosquitto",
        "/usr/bin/mosquitto",
        "/usr/local/sbin/mosquitto",
    ] {
        if std::path::Path::new(p).exists() {
            return p.to_string();
        }
    }
    "mosquitto".to_string()
}

impl Broker {
    pub fn start() -> Broker {
        Self::start_inner(None, None)
    }

    /// A TLS-only listener with the given CA, server certificate and key.
    pub fn start_tls(ca: PathBuf, cert: PathBuf, key: PathBuf) -> Broker {
        Self::start_inner(Some((ca, cert, key)), None)
    }

    /// A broker bridged to the broker on `hub` (every topic, both ways, MQTT v5): a test's
    /// stand-in for one address of a clustered broker.
    pub fn start_bridged(hub: u16) -> Broker {
        Self::start_full(None, None, Some(hub))
    }

    /// A broker that accepts only `user` with `password` (no anonymous clients).
    pub fn start_with_password(user: &str, password: &str) -> Broker {
        Self::start_inner(None, Some((user.to_string(), password.to_string())))
    }

    /// A broker with these extra `mosquitto.conf` lines (e.g. `max_packet_size 65536\n`).
    pub fn start_with_conf(conf: &str) -> Broker {
        Self::start_full_with(None, None, None, conf.to_string(), None)
    }

    /// A broker that applies this ACL (mosquitto's `acl_file` syntax) to every client.
    pub fn start_with_acl(acl: &str) -> Broker {
        Self::start_full_with(None, None, None, String::new(), Some(acl.to_string()))
    }

    fn start_inner(
        tls: Option<(PathBuf, PathBuf, PathBuf)>,
        credentials: Option<(String, String)>,
    ) -> Broker {
        Self::start_full(tls, credentials, None)
    }

    fn start_full(
        tls: Option<(PathBuf, PathBuf, PathBuf)>,
        credentials: Option<(String, String)>,
        bridge_to: Option<u16>,
    ) -> Broker {
        Self::start_full_with(tls, credentials, bridge_to, String::new(), None)
    }

    fn start_full_with(
        tls: Option<(PathBuf, PathBuf, PathBuf)>,
        credentials: Option<(String, String)>,
        bridge_to: Option<u16>,
        extra_conf: String,
        acl: Option<String>,
    ) -> Broker {
        let dir = TempDir::new("broker");
        // mosquitto started as root drops to its own user; let it write its log here.
        let _ = std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        );
        let passwords = credentials.map(|(user, password)| {
            let file = dir.join("passwords");
            let ok = Command::new("mosquitto_passwd")
                .args(["-c", "-b"])
                .arg(&file)
                .args([user, password])
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            assert!(ok, "mosquitto_passwd failed");
            let _ = std::fs::set_permissions(
                &file,
                std::os::unix::fs::PermissionsExt::from_mode(0o644),
            );
            file
        });
        let mut b = Broker {
            port: 0,
            dir,
            child: None,
            tls,
            passwords,
            bridge_to,
            extra_conf,
            acl,
        };
        for _ in 0..10 {
            b.port = free_port();
            if b.spawn() {
                return b;
            }
        }
        panic!("mosquitto did not start (is it installed? scripts/test installs it)");
    }

    fn spawn(&mut self) -> bool {
        let mut conf = format!(
            "listener {} 127.0.0.1\nallow_anonymous {}\nset_tcp_nodelay true\npersistence false\nmax_queued_messages 100000\nlog_dest file {}\nlog_type error\nlog_type warning\nlog_type notice\n",
            self.port,
            self.passwords.is_none(),
            self.dir.join("mosquitto.log").display()
        );
        if let Some(p) = &self.passwords {
            conf.push_str(&format!("password_file {}\n", p.display()));
        }
        if let Some((ca, cert, key)) = &self.tls {
            conf.push_str(&format!(
                "cafile {}\ncertfile {}\nkeyfile {}\n",
                ca.display(),
                cert.display(),
                key.display()
            ));
        }
        if let Some(hub) = self.bridge_to {
            conf.push_str(&format!(
                "connection hub\naddress 127.0.0.1:{hub}\ntopic # both 1\nbridge_protocol_version mqttv50\ntry_private true\nnotifications false\nrestart_timeout 1\n"
            ));
        }
        conf.push_str(&self.extra_conf);
        if let Some(acl) = &self.acl {
            let file = self.dir.write("acl", acl);
            let _ = std::fs::set_permissions(
                &file,
                std::os::unix::fs::PermissionsExt::from_mode(0o644),
            );
            conf.push_str(&format!("acl_file {}\n", file.display()));
        }
        let conf_path = self.dir.write("mosquitto.conf", &conf);
        let child = Command::new(mosquitto_bin())
            .arg("-c")
            .arg(&conf_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn mosquitto");
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

    /// Starts again on the same port (a fresh broker: sessions are gone).
    pub fn restart(&mut self) {
        self.stop();
        for _ in 0..50 {
            if self.spawn() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("mosquitto did not restart on port {}", self.port);
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("mosquitto.log")).unwrap_or_default()
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop();
    }
}
