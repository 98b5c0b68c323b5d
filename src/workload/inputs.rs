//! A start's inputs: module dispatch, the params file's contents, the command rendered from its
//! template, an inline image saved to the inputs folder.

use super::record::Layout;
use crate::store;

/// Module dispatch (product documentation, "Module dispatch for .py values"): a command value
/// that, trimmed, ends in `.py` and holds no whitespace names a Python file in the working
/// directory whose `infer` / `train` / `simulate` function is called with the params as keyword
/// arguments. It runs as an ordinary tracked workload through `module_runner.py`.
pub fn module_of(template: &str) -> Option<&str> {
    let t = template.trim();
    (t.ends_with(".py") && !t.contains(char::is_whitespace)).then_some(t)
}

/// The function a module must export for this workload type.
pub fn module_function(kind: &str) -> &'static str {
    match kind {
        "inference" => "infer",
        "training" => "train",
        _ => "simulate",
    }
}

pub(super) const MODULE_RUNNER: &str = include_str!("module_runner.py");

/// Keys the platform puts into params that are not the module function's arguments (with every
/// `workflow_*` key and the workload token, which never reaches the params file).
pub(super) const PLATFORM_PARAMS: &[&str] = &["workload_uuid", "command_type", "status"];

/// Quotes for a POSIX shell: bare when only safe characters, else single quotes.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_@%+=:,./-".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Decodes a (data-URL or plain) base64 image into the inputs folder; returns its file name.
pub(super) fn save_image(layout: &Layout, stem: &str, b64: &str) -> Result<String, String> {
    let data = b64.split_once(',').map(|(_, d)| d).unwrap_or(b64);
    let bytes = base64_decode(data).ok_or("not valid base64")?;
    let ext = match bytes.as_slice() {
        [0xFF, 0xD8, 0xFF, ..] => "jpg",
        [0x89, b'P', b'N', b'G', ..] => "png",
        [b'G', b'I', b'F', ..] => "gif",
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'E', b'B', b'P', ..] => "webp",
        _ => "jpg",
    };
    store::ensure_private_dir(&layout.inputs()).map_err(|e| e.to_string())?;
    let name = format!("image_{stem}.{ext}");
    store::write_atomic(&layout.inputs().join(&name), &bytes, 0o600).map_err(|e| e.to_string())?;
    Ok(name)
}

/// Lenient standard base64 (whitespace ignored, padding optional; URL-safe letters accepted).
// Each arm subtracts its own range's start, and `bits` stays below 14.
#[allow(clippy::arithmetic_side_effects)]
pub fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let mut acc = 0u32;
    let mut bits = 0;
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            b'=' => break,
            b' ' | b'\n' | b'\r' | b'\t' => continue,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_for_the_shell() {
        assert_eq!(shell_quote("/a/b_c.json"), "/a/b_c.json");
        assert_eq!(shell_quote("/a b/c"), "'/a b/c'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn decodes_base64() {
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVs\nbG8").unwrap(), b"hello");
        assert!(base64_decode("!!").is_none());
    }
}
