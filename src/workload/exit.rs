//! A workload's exit record: `exit.json`, or the status its supervisor left in a symbolic link
//! when the disk was full (D54).

use std::path::Path;

use super::record::load_json;
use super::shim;
use crate::store;

/// The node's read of a workload's exit record in `dir` (D54): `exit.json` (quarantined when
/// invalid), else the status the supervisor left in [`shim::EXIT_LINK`] when the disk was full.
/// A status found only there is written to `exit.json` as soon as the disk takes it (then the
/// link goes; until then it stays, so a restart finds it too).
pub fn load_exit(dir: &Path) -> Option<shim::Exit> {
    let path = dir.join("exit.json");
    if let Some(exit) = load_json(&path, "workload exit record") {
        return Some(exit);
    }
    let link = dir.join(shim::EXIT_LINK);
    let exit = read_exit_link(&link)?;
    let written = serde_json::to_vec(&exit)
        .map_err(std::io::Error::other)
        .and_then(|json| store::write_atomic(&path, &json, 0o600));
    match written {
        Ok(()) => {
            let _ = std::fs::remove_file(&link);
        }
        Err(e) => log::warn!(
            "the supervisor of {} left its exit status in {} (the disk was full); reporting it from there, exit.json still cannot be written: {e}",
            store::shown(dir),
            shim::EXIT_LINK
        ),
    }
    Some(exit)
}

/// The status in an `exit.status` link: only a symbolic link (never followed) with a short
/// target in the exact form the supervisor writes; anything else is no record.
fn read_exit_link(path: &Path) -> Option<shim::Exit> {
    let md = std::fs::symlink_metadata(path).ok()?;
    if !md.file_type().is_symlink() || md.len() > 64 {
        return None;
    }
    let target = std::fs::read_link(path).ok()?;
    shim::Exit::from_link_text(target.to_str()?)
}

impl store::Validate for shim::Exit {
    fn validate(&self) -> Result<(), store::Invalid> {
        if let Some(c) = self.exit_code {
            if !(0..=255).contains(&c) {
                return Err(store::Invalid::Range {
                    field: "exit_code",
                    low: 0,
                    high: 255,
                    got: i64::from(c),
                });
            }
        }
        if let Some(sig) = self.signal {
            if !(1..=64).contains(&sig) {
                return Err(store::Invalid::Range {
                    field: "signal",
                    low: 1,
                    high: 64,
                    got: i64::from(sig),
                });
            }
        }
        store::check_text("started_at", &self.started_at, 64)?;
        store::check_text("ended_at", &self.ended_at, 64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::testkit::scratch;

    #[test]
    fn the_exit_status_link_holds_exactly_what_the_supervisor_writes() {
        use shim::Exit;
        let e = |c: Option<i32>, s: Option<i32>| Exit {
            exit_code: c,
            signal: s,
            started_at: String::new(),
            ended_at: String::new(),
        };
        for exit in [
            e(Some(0), None),
            e(Some(255), None),
            e(None, Some(9)),
            e(None, None),
        ] {
            let text = exit.link_text();
            assert!(text.len() <= 59, "fits a fast symlink: {text}");
            assert_eq!(Exit::from_link_text(&text), Some(exit));
        }
        for bad in [
            "",
            "v1",
            "v1 ",
            "exit=3",
            "v2 exit=3",
            "v1 exit=",
            "v1 exit=256",
            "v1 exit=-1",
            "v1 exit=+3",
            "v1 exit=0003",
            "v1 exit=3 ",
            "v1 signal=0",
            "v1 signal=65",
            "v1 signal=9x",
            "v1 unknown ",
            "v1 exit=3\n",
        ] {
            assert_eq!(Exit::from_link_text(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_status_left_in_the_link_is_read_and_written_to_exit_json() {
        let layout = scratch("exitlink");
        let dir = layout.dir("w1");
        assert!(load_exit(&dir).is_none());
        // Planted in its place: a regular file, a FIFO, a link to a file, an overlong target.
        let link = dir.join(shim::EXIT_LINK);
        std::fs::write(&link, "v1 exit=0").unwrap();
        assert!(load_exit(&dir).is_none(), "a regular file is no record");
        std::fs::remove_file(&link).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &link).unwrap();
        assert!(load_exit(&dir).is_none(), "a link is never followed");
        std::fs::remove_file(&link).unwrap();
        std::os::unix::fs::symlink(format!("v1 exit=3{}", " ".repeat(100)), &link).unwrap();
        assert!(load_exit(&dir).is_none());
        std::fs::remove_file(&link).unwrap();
        assert!(!dir.join("exit.json").exists());
        // What the supervisor leaves on a full disk: reported, then written as exit.json.
        std::os::unix::fs::symlink("v1 exit=7", &link).unwrap();
        let exit = load_exit(&dir).unwrap();
        assert_eq!(exit.code(), 7);
        assert!(std::fs::symlink_metadata(&link).is_err(), "the link went");
        let again = load_exit(&dir).unwrap();
        assert_eq!(again, exit, "exit.json holds it now");
        std::fs::remove_dir_all(&layout.state).unwrap();
    }
}
