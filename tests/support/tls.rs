//! A test certificate authority (made with `openssl` in a scratch folder) and the certificates
//! it signed: `good` for 127.0.0.1 and localhost, `wrong` for another host name.

use std::path::PathBuf;
use std::process::Command;

use super::{Broker, TempDir};

pub struct Pki {
    dir: TempDir,
}

impl Pki {
    pub fn new() -> Pki {
        let dir = TempDir::new("pki");
        let sh = |script: &str| {
            let ok = Command::new("sh")
                .arg("-c")
                .arg(script)
                .current_dir(dir.path())
                .output()
                .is_ok_and(|o| o.status.success());
            assert!(ok, "openssl failed: {script}");
        };
        sh("openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=cw-test-ca 2>/dev/null");
        for (name, san) in [
            ("good", "DNS:localhost,IP:127.0.0.1"),
            ("wrong", "DNS:other.example"),
        ] {
            sh(&format!(
                "openssl req -newkey rsa:2048 -nodes -keyout {name}.key -out {name}.csr -subj /CN={name} 2>/dev/null && \
                 printf 'subjectAltName={san}\\n' > {name}.ext && \
                 openssl x509 -req -in {name}.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out {name}.pem -days 2 -extfile {name}.ext 2>/dev/null"
            ));
        }
        // mosquitto started as root drops to its own user: it must be able to read the keys.
        sh("chmod 644 good.key wrong.key");
        Pki { dir }
    }

    /// The CA's certificate.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// The certificate `name` (`good`, `wrong`).
    pub fn cert(&self, name: &str) -> PathBuf {
        self.dir.join(&format!("{name}.pem"))
    }

    /// The key of certificate `name`.
    pub fn key(&self, name: &str) -> PathBuf {
        self.dir.join(&format!("{name}.key"))
    }

    /// A mosquitto whose only listener is TLS with certificate `name`.
    pub fn broker(&self, name: &str) -> Broker {
        Broker::start_tls(self.ca(), self.cert(name), self.key(name))
    }

    /// `mosquitto.conf` lines for a second listener, TLS with the `good` certificate, on `port`.
    pub fn listener(&self, port: u16) -> String {
        format!(
            "listener {port} 127.0.0.1\ncafile {}\ncertfile {}\nkeyfile {}\n",
            self.ca().display(),
            self.cert("good").display(),
            self.key("good").display()
        )
    }
}
