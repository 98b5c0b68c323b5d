//! Reading a workload's directory back at recovery: every file validated, a bad record rebuilt
//! from what can be proven.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value};

use super::record::{
    load_json, log_name_ok, parse_meta, save_meta, unix_now, Layout, Meta, MetaKind,
};
use super::shim::Started;
use super::{procinfo, spawner};
use crate::protocol::commands::{Kind, TopicId};
use crate::store;

/// How a workload's directory was read back at recovery.
#[derive(Debug)]
pub enum Recovered {
    /// The record validated.
    Intact(Meta),
    /// `meta.json` did not validate (it is quarantined): this record was rebuilt from what
    /// could be proven — the directory name, the pid identity (`started.json`), the
    /// workload uuid (`params.json`), the log files' names. Its `salvaged` says why.
    Salvaged(Meta),
}

/// Reads a workload's directory for recovery: every file validated, an invalid one
/// quarantined (one ERROR line each), a bad `meta.json` replaced by a rebuilt record that is
/// saved so the next start reads it as it is (recovery never repeats the same work or loops).
/// `params_cap`: the largest `params.json` read back (the command size limit in force: params
/// are as large as the command that brought them, `CYBERWAVE_NODE_MAX_COMMAND_BYTES`).
pub fn recover_meta(layout: &Layout, dir: &Path, name: &str, params_cap: u64) -> Recovered {
    let meta_path = dir.join("meta.json");
    let why = match parse_meta(dir) {
        Ok(mut meta) => {
            if meta.started.is_none() {
                let path = dir.join("started.json");
                // A node killed between forking the shim and the shim's start record: the
                // shim is still at work, and the record comes (never forget a workload that
                // is about to run: a redelivery would start it a second time).
                wait_for_shim_record(dir, &path);
                match store::read_record::<Started>(&path, store::MAX_RECORD_BYTES) {
                    Ok(st) => meta.started = Some(st),
                    Err(store::StoreError::Missing) => {}
                    // The shim wrote it, so the workload did start: it cannot be tracked
                    // without it, but it is reported, not forgotten.
                    Err(e) => {
                        let why = format!("started.json is not a valid workload start record: {e}");
                        if e.is_bad_content() {
                            let _ = store::quarantine(&path, &why);
                        }
                        meta.safe_id = name.to_string();
                        meta.salvaged = Some(why);
                        return Recovered::Salvaged(meta);
                    }
                }
            }
            meta.safe_id = name.to_string();
            return if meta.salvaged.is_some() {
                Recovered::Salvaged(meta)
            } else {
                Recovered::Intact(meta)
            };
        }
        Err(store::StoreError::Missing) => "meta.json is missing".to_string(),
        Err(e) => {
            let why = format!("meta.json is not a valid workload record: {e}");
            let _ = store::quarantine(&meta_path, &why);
            why
        }
    };
    let started: Option<Started> = load_json(&dir.join("started.json"), "workload start record");
    let workload_uuid = store::load_record::<Params>(
        &dir.join("params.json"),
        params_cap.max(store::MAX_ENTRY_BYTES),
        "workload params file",
    )
    .and_then(|p| p.workload_uuid());
    let kind = [Kind::Inference, Kind::Simulate, Kind::Training]
        .into_iter()
        .map(MetaKind::Known)
        .find(|k| {
            layout
                .logs()
                .join(format!("{k}_{name}.stdout.log"))
                .exists()
        })
        .unwrap_or(MetaKind::Unknown);
    // D36: the GPUs it holds, read back from its own environment when it provably still runs
    // (else they would look free and be given to a second workload).
    let gpus = started
        .as_ref()
        .filter(|s| procinfo::same_process_alive(s.pid, s.start_ticks))
        .and_then(|s| crate::gpu::assigned_in_environ(s.pid));
    // Its uid, when it runs as another user than the node's (D65: kept from the pool).
    let me = crate::util::euid();
    let uid = started
        .as_ref()
        .filter(|s| procinfo::same_process_alive(s.pid, s.start_ticks))
        .and_then(|s| std::fs::metadata(format!("/proc/{}", s.pid)).ok())
        .map(|md| std::os::unix::fs::MetadataExt::uid(&md))
        .filter(|uid| *uid != me);
    let meta = Meta {
        safe_id: name.to_string(),
        kind,
        request_id: Value::Null,
        workload_uuid,
        created_unix: unix_now(),
        command: String::new(),
        stdout_log: layout.logs().join(format!("{kind}_{name}.stdout.log")),
        stderr_log: layout.logs().join(format!("{kind}_{name}.stderr.log")),
        max_runtime_s: None,
        started,
        cancel: None,
        workflow: None,
        event_token: String::new(),
        salvaged: Some(why),
        uid,
        gpus,
    };
    // Saved only when it names a process to track: a record without one is reported and
    // retired right away.
    if meta.started.is_some() && log_name_ok(name) {
        if let Err(e) = save_meta(layout, &meta) {
            log::warn!(
                "cannot save the rebuilt record of workload {}: {e}",
                store::clip(name, 80)
            );
        }
    }
    Recovered::Salvaged(meta)
}

/// While a shim started for `dir` is alive and `started` does not exist yet, waits for it (at
/// most the pid timeout, `spawner::PID_TIMEOUT`).
fn wait_for_shim_record(dir: &Path, started: &Path) {
    if started.exists() {
        return;
    }
    let Some((pid, ticks)) = shim_of(dir) else {
        return;
    };
    log::info!(
        "the supervisor of {} (pid {pid}) is still starting its workload; waiting for its start record",
        store::shown(dir)
    );
    let until = crate::util::later(std::time::Instant::now(), spawner::PID_TIMEOUT);
    while !started.exists()
        && procinfo::same_process_alive(pid, ticks)
        && std::time::Instant::now() < until
    {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The live shim process (pid, start ticks) supervising `dir`, found among this user's
/// processes by its command line: `<exe> __shim <dir> …`.
fn shim_of(dir: &Path) -> Option<(i32, u64)> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .find_map(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            // The command line first: the user is read only for the few that match.
            if !supervises(&cmd, dir) || !ours(pid) {
                return None;
            }
            let ticks = procinfo::start_ticks(pid)?;
            procinfo::same_process_alive(pid, ticks).then_some((pid, ticks))
        })
}

/// The process `pid` runs as this process's user, as every supervisor does (it drops to a
/// `workload_user` only in the workload it starts): a workload's own process that calls itself
/// `… __shim <dir>` is not taken for one.
fn ours(pid: i32) -> bool {
    // The `Uid:` line of its status (real, effective, saved, filesystem), not the owner of its
    // /proc entries, which is root for a process that made itself not dumpable.
    let me = crate::util::euid().to_string();
    let Ok(status) = std::fs::read(format!("/proc/{pid}/status")) else {
        return false;
    };
    let status = String::from_utf8_lossy(&status);
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .is_some_and(|ids| {
            let ids: Vec<&str> = ids.split_whitespace().collect();
            ids.len() == 4 && ids.iter().all(|id| *id == me)
        })
}

/// Whether the process with command line `cmd` is a supervisor of `dir`.
fn supervises(cmd: &[u8], dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let want = dir.as_os_str().as_bytes();
    let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
    args.windows(2)
        .any(|w| w.first() == Some(&b"__shim".as_slice()) && w.get(1) == Some(&want))
}

/// `params.json` as far as the node reads it back: a JSON object.
#[derive(Debug, Deserialize)]
#[serde(transparent)]
struct Params(Map<String, Value>);

impl Params {
    /// The workload uuid, if it is there and valid (D20).
    fn workload_uuid(&self) -> Option<TopicId> {
        let raw = self.0.get("workload_uuid").and_then(Value::as_str);
        crate::protocol::commands::workload_id(raw.map(String::from))
            .and_then(|u| TopicId::new("workload_uuid", &u).ok())
    }
}

impl store::Validate for Params {
    fn validate(&self) -> Result<(), store::Invalid> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_of_this_user_is_ours_and_one_of_another_is_not() {
        assert!(ours(std::process::id() as i32));
        assert!(!ours(i32::MAX), "no such process");
        // A process of another user: only root can start one here.
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            use std::os::unix::process::CommandExt;
            let mut other = std::process::Command::new("sleep")
                .arg("5")
                .uid(65534)
                .gid(65534)
                .spawn()
                .unwrap();
            let pid = other.id() as i32;
            // Its uid is dropped before the exec; wait for the exec to be sure.
            for _ in 0..200 {
                if std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| c.starts_with(b"sleep"))
                {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            assert!(!ours(pid), "another user's process");
            let _ = other.kill();
            let _ = other.wait();
        }
    }
    use crate::workload::testkit::{good_meta, scratch};
    use std::process::Command;

    /// The default command size limit.
    const CAP: u64 = crate::protocol::commands::MAX_COMMAND_BYTES as u64;

    /// Params may be as large as the command that brought them (32 MiB by default): a record
    /// rebuilt at recovery still finds the workload uuid in params of 20 MiB; params over the
    /// limit in force are not read (quarantined, as a file too large for its kind is).
    #[test]
    fn a_rebuilt_record_finds_the_workload_uuid_in_params_as_large_as_a_command() {
        let layout = scratch("salvage-big");
        let big = "x".repeat(20 * 1024 * 1024);
        let params = serde_json::json!({ "image_bytes_base64": big, "workload_uuid": "wl-big" });
        let dir = bad_record_of_a_training(&layout, &params.to_string());
        let Recovered::Salvaged(m) = recover_meta(&layout, &dir, "w1", CAP) else {
            panic!("must be salvaged");
        };
        assert_eq!(m.workload_uuid.as_deref(), Some("wl-big"));
        // A node whose limit is lower than the file reads no uuid from it.
        std::fs::remove_file(dir.join("meta.json")).unwrap();
        let Recovered::Salvaged(m) = recover_meta(&layout, &dir, "w1", 1024) else {
            panic!("must be salvaged");
        };
        assert_eq!(m.workload_uuid, None);
        assert!(!dir.join("params.json").exists(), "quarantined");
        std::fs::remove_dir_all(&layout.state).unwrap();
    }

    /// Workload `w1`, a training: a record with a runtime out of range (to be salvaged), its
    /// start record, these params and its log; returns its directory.
    fn bad_record_of_a_training(
        layout: &crate::workload::Layout,
        params: &str,
    ) -> std::path::PathBuf {
        let dir = layout.dir("w1");
        let mut bad = good_meta(layout);
        bad["max_runtime_s"] = serde_json::json!(1e19);
        std::fs::write(dir.join("meta.json"), bad.to_string()).unwrap();
        std::fs::write(dir.join("started.json"), bad["started"].to_string()).unwrap();
        std::fs::write(dir.join("params.json"), params).unwrap();
        std::fs::write(layout.logs().join("training_w1.stdout.log"), "").unwrap();
        dir
    }

    /// A salvaged record takes its workload uuid from the params only when it is one: the text
    /// `"None"`, `""` or an id that could not be a topic's gives none (R7–R10, D20).
    #[test]
    fn d20_a_salvaged_record_takes_no_workload_uuid_that_is_none_or_hostile() {
        for raw in ["None", "", "wl/#", "a b"] {
            let layout = scratch("salvage-none");
            let params = serde_json::json!({ "workload_uuid": raw }).to_string();
            let dir = bad_record_of_a_training(&layout, &params);
            let Recovered::Salvaged(m) = recover_meta(&layout, &dir, "w1", CAP) else {
                panic!("must be salvaged");
            };
            assert_eq!(m.workload_uuid, None, "{raw:?}");
            let _ = std::fs::remove_dir_all(&layout.state);
        }
    }

    #[test]
    fn a_workload_with_a_bad_record_is_salvaged_from_what_can_be_proven() {
        let layout = scratch("salvage");
        let dir = bad_record_of_a_training(&layout, r#"{"workload_uuid":"wl-9","x":1}"#);
        let Recovered::Salvaged(m) = recover_meta(&layout, &dir, "w1", CAP) else {
            panic!("must be salvaged");
        };
        assert_eq!(m.workload_uuid.as_deref(), Some("wl-9"));
        assert_eq!(m.kind, Kind::Training);
        assert_eq!(m.pid(), 123456);
        assert!(m.salvaged.as_deref().unwrap().contains("max_runtime_s"));
        assert_eq!(m.max_runtime_s, None);
        let q = layout.state.join("quarantine");
        assert_eq!(
            std::fs::read_dir(&q).unwrap().count(),
            1,
            "meta.json quarantined"
        );
        // The rebuilt record is saved: the next recovery reads it without quarantining again.
        let Recovered::Salvaged(again) = recover_meta(&layout, &dir, "w1", CAP) else {
            panic!("still a salvaged record");
        };
        assert_eq!(again.workload_uuid.as_deref(), Some("wl-9"));
        assert_eq!(std::fs::read_dir(&q).unwrap().count(), 1);

        // Nothing provable: no pid, params invalid (quarantined too), unknown kind.
        std::fs::remove_file(dir.join("meta.json")).unwrap();
        std::fs::write(dir.join("started.json"), r#"{"pid":-4}"#).unwrap();
        std::fs::write(dir.join("params.json"), "\u{0}\u{0}").unwrap();
        std::fs::remove_file(layout.logs().join("training_w1.stdout.log")).unwrap();
        let Recovered::Salvaged(m) = recover_meta(&layout, &dir, "w1", CAP) else {
            panic!("salvaged");
        };
        assert!(m.started.is_none() && m.workload_uuid.is_none());
        assert_eq!(m.kind, MetaKind::Unknown);
        assert_eq!(
            std::fs::read_dir(&q).unwrap().count(),
            3,
            "started.json and params.json"
        );
        assert!(
            !dir.join("meta.json").exists(),
            "nothing to track: not saved"
        );

        // A valid record whose start record is bad: reported, not forgotten as "never started".
        let mut no_start = good_meta(&layout);
        no_start.as_object_mut().unwrap().remove("started");
        std::fs::write(dir.join("meta.json"), no_start.to_string()).unwrap();
        std::fs::write(dir.join("started.json"), r#"{"pid":0}"#).unwrap();
        let Recovered::Salvaged(m) = recover_meta(&layout, &dir, "w1", CAP) else {
            panic!("a bad started.json makes it salvaged");
        };
        assert!(m.started.is_none());
        assert_eq!(m.workload_uuid.as_deref(), Some("wl-1"));
        assert!(m.salvaged.unwrap().contains("started.json"));
        assert_eq!(std::fs::read_dir(&q).unwrap().count(), 4);
        std::fs::remove_dir_all(&layout.state).unwrap();
    }

    /// A node killed between forking a shim and the shim's start record: recovery waits for
    /// the record while that shim lives, so the workload is re-adopted, not forgotten (and
    /// then started a second time by a redelivery).
    #[test]
    fn recovery_waits_for_the_start_record_of_a_shim_still_starting() {
        let layout = scratch("waitshim");
        let dir = layout.dir("w1");
        let mut meta = good_meta(&layout);
        meta.as_object_mut().unwrap().remove("started");
        std::fs::write(dir.join("meta.json"), meta.to_string()).unwrap();
        // Stands in for the shim: `__shim <dir>` on its command line.
        let mut shim = Command::new("sh")
            .arg("-c")
            .arg("sleep 5; true")
            .arg("__shim")
            .arg(&dir)
            .spawn()
            .unwrap();
        // Until `sh` has exec'd, the child is a copy of this test binary, which no search takes
        // for a supervisor: on a loaded machine recovery would look too early and not wait.
        let cmdline = format!("/proc/{}/cmdline", shim.id());
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while !std::fs::read(&cmdline).is_ok_and(|c| c.windows(6).any(|w| w == b"__shim")) {
            assert!(
                std::time::Instant::now() < until,
                "the stand-in shim never ran"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let record = good_meta(&layout)["started"].to_string();
        let writer = {
            let path = dir.join("started.json");
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                // Atomically, as the shim writes it: a plain write is seen empty for a moment.
                let tmp = path.with_extension("tmp");
                std::fs::write(&tmp, record).unwrap();
                std::fs::rename(&tmp, path).unwrap();
            })
        };
        let Recovered::Intact(m) = recover_meta(&layout, &dir, "w1", CAP) else {
            panic!("intact");
        };
        writer.join().unwrap();
        assert_eq!(m.pid(), 123456, "the start record the shim wrote meanwhile");
        shim.kill().unwrap();
        shim.wait().unwrap();
        // No shim: nothing to wait for (a record without a pid is forgotten by the node).
        std::fs::remove_file(dir.join("started.json")).unwrap();
        let Recovered::Intact(m) = recover_meta(&layout, &dir, "w1", CAP) else {
            panic!("intact");
        };
        assert!(m.started.is_none());
        std::fs::remove_dir_all(&layout.state).unwrap();
    }
}
