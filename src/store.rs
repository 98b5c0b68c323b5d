//! The on-disk layout's primitives: atomic writes with fixed modes, and file names that a
//! hostile identifier can never turn into a path outside the state dir.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Writes `data` to `path` atomically: a temp file beside it (created with `mode`), fsync,
/// rename over the target, fsync of the directory. A crash leaves the old or the new file.
pub fn write_atomic(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    write_replace(path, data, mode, true)
}

/// Like [`write_atomic`] without the syncs: readers never see a partial file, but a host crash
/// may lose it (for files that are useless after a crash anyway, such as a params file).
pub fn write_replace_unsynced(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    write_replace(path, data, mode, false)
}

fn write_replace(path: &Path, data: &[u8], mode: u32, sync: bool) -> io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        crate::util::hex(&crate::util::random_bytes::<4>())
    ));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        // The umask may have narrowed `mode`; it must never widen it, but make it exact.
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.write_all(data)?;
        if sync {
            f.sync_all()?;
        }
        fs::rename(&tmp, path)?;
        if sync {
            if let Ok(d) = fs::File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Creates `dir` (and parents) and makes it 0700: the state dir holds secrets.
pub fn ensure_private_dir(dir: &Path) -> io::Result<()> {
    fs::create_dir_all(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
}

/// Maps an identifier from the outside world to a file-name-safe id (decision D7): keeps
/// `[A-Za-z0-9._-]`, replaces anything else with `_`, at most 64 characters; an id that was
/// changed or cut (a leading `.` becomes `_`), or that is empty, gets `-<8 hex>` of a stable hash of the
/// original appended, so two different ids never share files.
pub fn safe_id(id: &str) -> String {
    let mut out: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    // No leading dot: no hidden files, no `.`/`..` lookalikes.
    let dots = out.chars().take_while(|c| *c == '.').count();
    out.replace_range(..dots, &"_".repeat(dots));
    let changed = out != id || out.is_empty();
    if changed {
        out.truncate(55);
        out.push_str(&format!("-{:08x}", fnv1a32(id.as_bytes())));
    }
    out
}

/// FNV-1a, 32 bit: stable across builds and platforms (unlike std's hasher).
fn fnv1a32(data: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in data {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safe_id_keeps_plain_ids() {
        assert_eq!(safe_id("req-123_A.b"), "req-123_A.b");
    }

    #[test]
    fn safe_id_neutralises_hostile_ids() {
        for hostile in [
            "../../x",
            "/etc/x",
            "..",
            ".",
            "",
            "a\0b",
            "ü",
            &"x".repeat(10_000),
        ] {
            let s = safe_id(hostile);
            assert!(!s.contains('/') && !s.contains('\0'), "{s}");
            assert!(s != "." && s != ".." && !s.is_empty(), "{s}");
            assert!(s.len() <= 64, "{}", s.len());
            assert!(!s.starts_with(".."), "{s}");
        }
        assert_ne!(safe_id("a/b"), safe_id("a_b"));
        assert_ne!(safe_id("a/b"), safe_id("a?b"));
        assert_eq!(safe_id("a/b"), safe_id("a/b"));
    }

    #[test]
    fn write_atomic_sets_mode_and_replaces() {
        let dir = std::env::temp_dir().join(format!("cw-store-{}", std::process::id()));
        ensure_private_dir(&dir).unwrap();
        let p = dir.join("f.json");
        write_atomic(&p, b"one", 0o600).unwrap();
        write_atomic(&p, b"two", 0o600).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            fs::read_dir(&dir).unwrap().count(),
            1,
            "no temp file left behind"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
