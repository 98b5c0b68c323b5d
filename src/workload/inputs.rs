//! A start's inputs: module dispatch, the params file's contents, the command rendered from its
//! template, an inline image saved to the inputs folder.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::error::SpawnError;
use super::record::Layout;
use super::request::StartRequest;
use super::user::{self, WorkloadUser};
use crate::config::Settings;
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

const MODULE_RUNNER: &str = include_str!("module_runner.py");

/// Keys the platform puts into params that are not the module function's arguments (with every
/// `workflow_*` key and the workload token, which never reaches the params file).
const PLATFORM_PARAMS: &[&str] = &["workload_uuid", "command_type", "status"];

/// The module a `.py` command value names (the value, its file in the working directory);
/// `Err` when that file is missing (refused before anything is written).
pub(super) fn module_file(
    s: &Settings,
    template: &str,
    kind: &str,
) -> Result<Option<(String, PathBuf)>, SpawnError> {
    let Some(value) = module_of(template) else {
        return Ok(None);
    };
    let path = s.working_dir.join(value);
    if !path.is_file() {
        return Err(SpawnError::ModuleNotFound {
            value: value.to_string(),
            kind: kind.to_string(),
        });
    }
    Ok(Some((value.to_string(), path)))
}

/// The platform's own keys go: they are not the module function's arguments.
pub(super) fn drop_platform_params(params: &mut Map<String, Value>) {
    params.retain(|k, _| !PLATFORM_PARAMS.contains(&k.as_str()) && !k.starts_with("workflow_"));
}

/// An inline `image_bytes_base64` saved to the inputs folder and replaced by the file's name in
/// `image` (one that does not decode is passed on unchanged, with a warning); the file saved.
/// A full disk fails the start (a retryable refusal), whose failure removes the file.
pub(super) fn inline_image(
    layout: &Layout,
    stem: &str,
    safe_id: &str,
    params: &mut Map<String, Value>,
    user: Option<&WorkloadUser>,
) -> Result<Option<PathBuf>, SpawnError> {
    let Some(b64) = params
        .get("image_bytes_base64")
        .and_then(Value::as_str)
        .filter(|b| !b.is_empty())
    else {
        return Ok(None);
    };
    match save_image(layout, stem, b64) {
        Ok(name) => {
            let file = layout.inputs().join(&name);
            if user.is_some() {
                let _ = user::traversable(&layout.inputs());
                if let Err(e) = user::give(user, &file) {
                    let _ = std::fs::remove_file(&file);
                    return Err(e);
                }
            }
            params.remove("image_bytes_base64");
            params.insert("image".into(), Value::String(name));
            Ok(Some(file))
        }
        Err(ImageError::Io(source))
            if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) =>
        {
            Err(SpawnError::Write {
                what: "the inline image",
                source,
            })
        }
        Err(e) => {
            log::warn!(
                "workload {safe_id}: image_bytes_base64 not decoded ({e}); params passed on unchanged"
            );
            Ok(None)
        }
    }
}

/// Writes the params file into the workload's directory; returns its path.
pub(super) fn write_params(
    dir: &Path,
    params: Map<String, Value>,
    user: Option<&WorkloadUser>,
) -> Result<PathBuf, SpawnError> {
    let params_file = dir.join("params.json");
    let params_json = serde_json::to_vec(&Value::Object(params))?;
    // Not synced: the workload needs it complete, not durable (after a host crash the workload
    // is reported lost anyway). Written in place: the directory is the start's own, just
    // created, and the workload reads it only once it runs.
    store::write_new(&params_file, &params_json, 0o600).map_err(|source| SpawnError::Write {
        what: "the params file",
        source,
    })?;
    user::give(user, &params_file)?;
    Ok(params_file)
}

/// The workload's command line: the template with `{body}` replaced by the params file, or for
/// a module, the module runner (written into the workload's directory) calling its function.
pub(super) fn command_line(
    s: &Settings,
    dir: &Path,
    req: &StartRequest,
    module: Option<&(String, PathBuf)>,
    params_file: &Path,
    user: Option<&WorkloadUser>,
) -> Result<String, SpawnError> {
    let Some((value, path)) = module else {
        return Ok(req
            .template
            .replace("{body}", &shell_quote(&params_file.display().to_string())));
    };
    let runner = dir.join("module_runner.py");
    store::write_replace_unsynced(&runner, MODULE_RUNNER.as_bytes(), 0o600).map_err(|source| {
        SpawnError::Write {
            what: "the module runner",
            source,
        }
    })?;
    user::give(user, &runner)?;
    let python = s
        .env
        .value("CYBERWAVE_PYTHON")
        .filter(|p| !p.trim().is_empty())
        .unwrap_or_else(|| "python3".into());
    Ok(format!(
        "exec {} {} {} {} {} {}",
        shell_quote(python.trim()),
        shell_quote(&runner.display().to_string()),
        shell_quote(&path.display().to_string()),
        module_function(req.kind.as_str()),
        shell_quote(&params_file.display().to_string()),
        shell_quote(value)
    ))
}

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
/// Why an inline image was not saved (it is then passed on as it came).
#[derive(Debug)]
enum ImageError {
    NotBase64,
    Io(std::io::Error),
}

impl std::fmt::Display for ImageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImageError::NotBase64 => f.write_str("not valid base64"),
            ImageError::Io(e) => write!(f, "{e}"),
        }
    }
}

fn save_image(layout: &Layout, stem: &str, b64: &str) -> Result<String, ImageError> {
    let data = b64.split_once(',').map(|(_, d)| d).unwrap_or(b64);
    let bytes = base64_decode(data).ok_or(ImageError::NotBase64)?;
    let ext = match bytes.as_slice() {
        [0xFF, 0xD8, 0xFF, ..] => "jpg",
        [0x89, b'P', b'N', b'G', ..] => "png",
        [b'G', b'I', b'F', ..] => "gif",
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'E', b'B', b'P', ..] => "webp",
        _ => "jpg",
    };
    store::ensure_private_dir(&layout.inputs()).map_err(ImageError::Io)?;
    let name = format!("image_{stem}.{ext}");
    store::write_atomic(&layout.inputs().join(&name), &bytes, 0o600).map_err(ImageError::Io)?;
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
