//! The real brokers of the tests, on free loopback ports: mosquitto (`Broker`, every test's) and
//! rumqttd (`rumqttd.rs`), both started, restarted and stopped by one launcher.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, wait_for, TempDir};

/// The command that starts a broker on a port, given its scratch folder (where it writes its
/// config for that port first); `None` when it cannot be started at all.
type Launch = Box<dyn Fn(&TempDir, u16) -> Option<Command> + Send>;

/// A broker process on a free loopback port, with a scratch folder of its own for its config
/// and log; started again on the same port by `restart`, killed on drop.
pub struct BrokerProcess {
    pub port: u16,
    pub dir: TempDir,
    child: Option<Child>,
    launch: Launch,
    /// Its log file in `dir`.
    log_file: &'static str,
}

impl BrokerProcess {
    /// Starts `launch` on a free port (another one when the port was taken meanwhile); panics
    /// with `missing` when it never comes up.
    pub fn start(dir: TempDir, log_file: &'static str, missing: &str, launch: Launch) -> Self {
        let mut b = BrokerProcess {
            port: 0,
            dir,
            child: None,
            launch,
            log_file,
        };
        for _ in 0..10 {
            b.port = free_port();
            if b.spawn() {
                return b;
            }
        }
        panic!("{missing}");
    }

    /// Up when it accepts a connection on its port and has not exited.
    fn spawn(&mut self) -> bool {
        let Some(mut cmd) = (self.launch)(&self.dir, self.port) else {
            return false;
        };
        let Ok(child) = cmd.stdin(Stdio::null()).spawn() else {
            return false;
        };
        self.child = Some(child);
        let port = self.port;
        let up = wait_for(Duration::from_secs(5), || {
            TcpStream::connect(("127.0.0.1", port)).ok().map(|_| ())
        })
        .is_some();
        let running = self
            .child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)));
        if !(up && running) {
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

    /// Starts again on the same port: a fresh broker, its sessions gone.
    pub fn restart(&mut self) {
        self.stop();
        for _ in 0..50 {
            if self.spawn() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the broker did not restart on port {}", self.port);
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join(self.log_file)).unwrap_or_default()
    }
}

impl Drop for BrokerProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How a mosquitto is set up beyond a plain anonymous listener.
#[derive(Clone, Default)]
struct Options {
    /// A TLS-only listener: CA, server certificate, key.
    tls: Option<(PathBuf, PathBuf, PathBuf)>,
    /// A password file in the broker's folder: only its users may connect.
    passwords: Option<PathBuf>,
    /// The port of a hub broker this one bridges every topic to and from (MQTT v5), as the
    /// nodes of a cluster share their traffic.
    bridge_to: Option<u16>,
    /// Extra lines for `mosquitto.conf` (limits, another listener).
    extra_conf: String,
    /// An ACL file's text (mosquitto's `acl_file` syntax), written into the broker's folder.
    acl: Option<String>,
}

impl Options {
    fn conf(&self, dir: &TempDir, port: u16) -> String {
        let mut conf = format!(
            "listener {port} 127.0.0.1\nallow_anonymous {}\nset_tcp_nodelay true\npersistence false\nmax_queued_messages 100000\nlog_dest file {}\nlog_type error\nlog_type warning\nlog_type notice\n",
            self.passwords.is_none(),
            dir.join("mosquitto.log").display()
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
            let file = readable(dir.write("acl", acl));
            conf.push_str(&format!("acl_file {}\n", file.display()));
        }
        conf
    }
}

/// mosquitto started as root drops to its own user: what it reads must be readable to all.
fn readable(file: PathBuf) -> PathBuf {
    let _ = std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o644));
    file
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

/// A real broker on a free loopback port, with its own config and log; stopped on drop: a
/// mosquitto (the constructors below), or a rumqttd (`Rumqttd::start`).
pub struct Broker(pub(super) BrokerProcess);

impl std::ops::Deref for Broker {
    type Target = BrokerProcess;
    fn deref(&self) -> &BrokerProcess {
        &self.0
    }
}

impl std::ops::DerefMut for Broker {
    fn deref_mut(&mut self) -> &mut BrokerProcess {
        &mut self.0
    }
}

impl Broker {
    pub fn start() -> Broker {
        Self::with(Options::default(), None)
    }

    /// A TLS-only listener with the given CA, server certificate and key.
    pub fn start_tls(ca: PathBuf, cert: PathBuf, key: PathBuf) -> Broker {
        let tls = Some((ca, cert, key));
        Self::with(
            Options {
                tls,
                ..Options::default()
            },
            None,
        )
    }

    /// A broker bridged to the broker on `hub` (every topic, both ways, MQTT v5): a test's
    /// stand-in for one address of a clustered broker.
    pub fn start_bridged(hub: u16) -> Broker {
        let bridge_to = Some(hub);
        Self::with(
            Options {
                bridge_to,
                ..Options::default()
            },
            None,
        )
    }

    /// A broker that accepts only `user` with `password` (no anonymous clients).
    pub fn start_with_password(user: &str, password: &str) -> Broker {
        Self::with(Options::default(), Some((user, password)))
    }

    /// A broker with these extra `mosquitto.conf` lines (e.g. `max_packet_size 65536\n`).
    pub fn start_with_conf(conf: &str) -> Broker {
        let extra_conf = conf.to_string();
        Self::with(
            Options {
                extra_conf,
                ..Options::default()
            },
            None,
        )
    }

    /// A broker that applies this ACL (mosquitto's `acl_file` syntax) to every client.
    pub fn start_with_acl(acl: &str) -> Broker {
        let acl = Some(acl.to_string());
        Self::with(
            Options {
                acl,
                ..Options::default()
            },
            None,
        )
    }

    fn with(mut options: Options, credentials: Option<(&str, &str)>) -> Broker {
        let dir = TempDir::new("broker");
        // mosquitto started as root drops to its own user; let it write its log here.
        let _ = std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        );
        options.passwords = credentials.map(|(user, password)| {
            let file = dir.join("passwords");
            let ok = Command::new("mosquitto_passwd")
                .args(["-c", "-b"])
                .arg(&file)
                .args([user, password])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "mosquitto_passwd failed");
            readable(file)
        });
        let launch: Launch = Box::new(move |dir, port| {
            let conf = dir.write("mosquitto.conf", &options.conf(dir, port));
            let mut cmd = Command::new(mosquitto_bin());
            cmd.arg("-c")
                .arg(conf)
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            Some(cmd)
        });
        Broker(BrokerProcess::start(
            dir,
            "mosquitto.log",
            "mosquitto did not start (is it installed? scripts/test installs it)",
            launch,
        ))
    }
}
