//! D47 in every end-to-end test: when a node process ends (its wrapper is dropped), nothing it
//! wrote to its log or to its own stdout lines holds a secret of the test — the API key and MQTT
//! password it was given, the workload tokens the fake backend sent, the event tokens it minted —
//! as text, as a list of decimal bytes (a `Debug` of bytes), as hex or as base64.

use std::collections::BTreeSet;
use std::sync::Mutex;

/// Shorter values are not secrets worth the name (and would match by chance).
const MIN_LEN: usize = 8;

static SECRETS: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// A secret every node of this test process must keep out of its log (e.g. a workload token
/// the fake backend sends).
pub fn register(secret: &str) {
    if secret.len() >= MIN_LEN {
        SECRETS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(secret.to_string());
    }
}

pub fn registered() -> Vec<String> {
    SECRETS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .cloned()
        .collect()
}

/// Registers every value under a key named like a token, key or password in this JSON.
pub fn register_in(v: &serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                let k = k.to_ascii_lowercase();
                if let (true, Some(s)) = (
                    k.contains("token") || k.contains("api_key") || k.contains("password"),
                    x.as_str(),
                ) {
                    register(s);
                }
                register_in(x);
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(register_in),
        _ => {}
    }
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64(data: &[u8]) -> String {
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        let chars = chunk.len() + 1;
        for i in 0..4 {
            if i < chars {
                out.push(B64[((n >> (18 - 6 * i)) & 63) as usize] as char);
            }
        }
    }
    out
}

/// The forms a secret may take in a log line, each with its name.
pub fn forms(secret: &str) -> Vec<(&'static str, String)> {
    let bytes = secret.as_bytes();
    let decimal = |sep: &str| {
        bytes
            .iter()
            .map(u8::to_string)
            .collect::<Vec<_>>()
            .join(sep)
    };
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let mut v = vec![
        ("text", secret.to_string()),
        ("decimal bytes", decimal(", ")),
        ("decimal bytes", decimal(",")),
        ("hex", hex.clone()),
        ("hex", hex.to_ascii_uppercase()),
    ];
    // Base64 at each of the three alignments the secret can have in an encoded stream: the
    // characters that depend on the secret's bytes alone (the last group, which depends on what
    // follows, is left out). URL-safe letters are compared as standard ones.
    for skip in 0..3 {
        let Some(rest) = bytes.get(skip..) else {
            continue;
        };
        let full = rest.len() / 3 * 3;
        let enc = base64(&rest[..full]);
        if enc.len() >= 8 {
            v.push(("base64", enc));
        }
    }
    v
}

/// Each (secret, form, line) where a form of a secret occurs in `text`.
pub fn leaks(text: &str, secrets: &[String]) -> Vec<String> {
    let normalised = text.replace('-', "+").replace('_', "/");
    let mut found = Vec::new();
    for s in secrets.iter().filter(|s| s.len() >= MIN_LEN) {
        for (form, needle) in forms(s) {
            let hay = if form == "base64" { &normalised } else { text };
            if let Some(line) = hay.lines().find(|l| l.contains(&needle)) {
                found.push(format!("{form} of secret {s:?} in: {line}"));
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: &str = "cw_test_token_0123456789abcdef";

    #[test]
    fn g7_d47_the_check_finds_a_secret_in_every_form() {
        let secrets = vec![S.to_string()];
        let debug = format!("Connect options: password: Some({:?})", S.as_bytes());
        let hex: String = S.bytes().map(|b| format!("{b:02X}")).collect();
        for (i, prefix) in ["", "a", "ab"].iter().enumerate() {
            let b64 = base64(format!("{prefix}{S}").as_bytes());
            assert_eq!(
                leaks(&format!("x {b64} y"), &secrets).len(),
                1,
                "alignment {i}"
            );
        }
        assert_eq!(leaks(&format!("topic a/{S}/b"), &secrets).len(), 1);
        assert_eq!(leaks(&debug, &secrets).len(), 1);
        assert_eq!(leaks(&format!("key={hex}"), &secrets).len(), 1);
        assert!(leaks("nothing here", &secrets).is_empty());
        // A short value is not checked (it would match by chance).
        assert!(leaks("abc", &["abc".into()]).is_empty());
    }
}
