//! Result uploads: after a successful workload, every regular file inside the results folder
//! goes to a signed URL (R9, REST E8 as fallback; PUT on the upload thread; up to 3 attempts),
//! then the backend is told (R10, REST E9 as fallback), then the completion is sent. The
//! workload stays busy ("finalizing") the whole time.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;

use super::table::{Outbound, Request, Table};
use crate::workers::{Done, Job};
use crate::workload::shim::Exit;

const ATTEMPTS: u32 = 3;

pub struct Upload {
    /// (name relative to the folder, path)
    pub files: Vec<(String, PathBuf)>,
    pub idx: usize,
    pub attempt: u32,
    pub retry_at: Option<Instant>,
    /// A request or transfer for the current step is under way.
    pub busy: bool,
    /// (name, signed url, attachment uuid) of the files uploaded.
    pub done: Vec<(String, String, String)>,
    pub notifying: bool,
}

/// Every regular file below `root` (sorted), never following a symlink: a workload must not be
/// able to upload a file outside its results folder.
pub fn collect(root: &Path) -> Vec<(String, PathBuf)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            let Ok(md) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if md.file_type().is_symlink() {
                log::warn!("result upload: skipping symlink {} (only regular files inside the results folder are uploaded)", crate::logtext::shown(&p.display().to_string()));
            } else if md.is_dir() {
                walk(root, &p, out);
            } else if md.is_file() {
                if let Ok(rel) = p.strip_prefix(root) {
                    out.push((rel.to_string_lossy().into_owned(), p));
                }
            }
        }
    }
    let mut out = Vec::new();
    if std::fs::symlink_metadata(root).is_ok_and(|m| m.is_dir()) {
        walk(root, root, &mut out);
    }
    out.sort();
    out
}

/// At most this many bytes of results per workload unless `max_result_bytes` says otherwise (D24).
pub const DEFAULT_MAX_RESULT_BYTES: u64 = 10 * 1024 * 1024 * 1024;

/// Keeps files in order while their sizes add up to at most `max` bytes; the names of the files
/// that did not fit are returned beside them.
fn within_budget(files: Vec<(String, PathBuf)>, max: u64) -> (Vec<(String, PathBuf)>, Vec<String>) {
    let mut total = 0u64;
    let mut kept = Vec::new();
    let mut skipped = Vec::new();
    for (name, path) in files {
        let size = std::fs::symlink_metadata(&path).map_or(0, |m| m.len());
        match total.checked_add(size).filter(|t| *t <= max) {
            Some(t) => {
                total = t;
                kept.push((name, path));
            }
            None => skipped.push(name),
        }
    }
    (kept, skipped)
}

/// Removes `dir` and the empty folders below it; anything still holding a file stays. A
/// symlink is never followed (a workload may plant one in place of its folder).
fn remove_empty_dirs(dir: &Path) {
    if !std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
        return;
    }
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_empty_dirs(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

impl Table {
    /// D24: the workload's own results folder, `<results_folder>/<safe-id>/`, created empty
    /// when result uploads are on (None otherwise, or when it cannot be created).
    pub fn results_dir_for(&self, safe_id: &str) -> Option<PathBuf> {
        if !self.cfg.enabled {
            return None;
        }
        let dir = self.cfg.folder.join(safe_id);
        match std::fs::create_dir_all(&dir) {
            Ok(()) => Some(dir),
            Err(e) => {
                log::warn!(
                    "cannot create the results folder {}: {e}; the workload gets no CYBERWAVE_RESULTS_DIR",
                    dir.display()
                );
                None
            }
        }
    }

    /// The result files of workload `id` (D24): everything in its own folder, and with capacity
    /// 1 also what was written straight into `results_folder` (outside other workloads' own
    /// folders). With capacity > 1 files straight in `results_folder` belong to nobody: never
    /// uploaded or deleted, and the node says so once.
    fn result_files(&mut self, id: &str) -> Vec<(String, PathBuf)> {
        let root = self.cfg.folder.clone();
        let mut files = collect(&root.join(id));
        let others: Vec<PathBuf> = self
            .keys()
            .filter(|k| k.as_str() != id)
            .map(|k| root.join(k))
            .collect();
        // Only what the workload wrote: a file older than its start (the operator's own files
        // in a results folder that holds them, what an earlier workload left) is never
        // uploaded or deleted as its result.
        let since = self.get(id).map_or(f64::MAX, |a| a.meta.created_unix);
        // The status-change time: a file moved (`mv`) or copied in keeping its times still
        // counts as written by the workload.
        let written_since = |p: &Path| {
            use std::os::unix::fs::MetadataExt;
            std::fs::symlink_metadata(p).is_ok_and(|m| {
                let secs =
                    m.ctime() as f64 + f64::from(u32::try_from(m.ctime_nsec()).unwrap_or(0)) / 1e9;
                secs >= since
            })
        };
        let loose: Vec<(String, PathBuf)> = collect(&root)
            .into_iter()
            .filter(|(_, p)| {
                !p.starts_with(root.join(id))
                    && !others.iter().any(|o| p.starts_with(o))
                    && written_since(p)
            })
            .collect();
        if self.cfg.capacity <= 1 {
            files.extend(loose);
        } else if !loose.is_empty() && !self.loose_results_warned {
            self.loose_results_warned = true;
            log::warn!(
                "{} file(s) sit straight in the results folder {}: with max_concurrent_workloads > 1 they belong to no workload and are not uploaded; a workload writes its results into $CYBERWAVE_RESULTS_DIR",
                loose.len(),
                root.display()
            );
        }
        let max = self.cfg.max_bytes;
        let (kept, skipped) = within_budget(files, max);
        for name in skipped {
            log::warn!(
                "result file {} skipped: the workload's results exceed max_result_bytes ({max} bytes)",
                crate::logtext::shown(&name)
            );
        }
        kept
    }

    /// Starts the uploads of a finished workload; false when there is nothing to upload.
    pub(super) fn begin_uploads(
        &mut self,
        id: &str,
        exit: Option<Exit>,
        now: Instant,
        out: &mut dyn Outbound,
    ) -> bool {
        let Some(a) = self.get(id) else {
            return false;
        };
        let Some(wl) = a.meta.workload_uuid.clone() else {
            return false;
        };
        if !self.cfg.enabled || a.meta.cancel.is_some() || exit.as_ref().map(Exit::code) != Some(0)
        {
            return false;
        }
        let files = self.result_files(id);
        if files.is_empty() {
            remove_empty_dirs(&self.cfg.folder.join(id));
            return false;
        }
        if let Some(a) = self.get(id) {
            log::info!(
                "{} {}: uploading {} result file(s) from {}",
                a.meta.kind,
                crate::logtext::shown(&a.meta.request_id_text()),
                files.len(),
                self.cfg.folder.display()
            );
        }
        let count = files.len();
        if let Some(a) = self.get_mut(id) {
            a.upload = Some(Upload {
                files,
                idx: 0,
                attempt: 0,
                retry_at: None,
                busy: false,
                done: Vec::new(),
                notifying: false,
            });
        }
        out.workload_status(&wl, json!({"status": "finalizing", "message": "Starting result file upload", "file_count": count}));
        self.step_upload(id, now, out);
        true
    }

    /// Moves an upload on by one step when nothing is under way.
    pub(super) fn step_upload(&mut self, id: &str, now: Instant, out: &mut dyn Outbound) {
        let connected = out.connected();
        let Some(a) = self.get_mut(id) else {
            return;
        };
        let wl = a.meta.workload_uuid.clone().unwrap_or_default();
        let Some(u) = a.upload.as_mut() else { return };
        if u.busy || u.retry_at.is_some_and(|t| now < t) {
            return;
        }
        u.retry_at = None;
        if u.idx < u.files.len() {
            u.busy = true;
            let filename = u.files.get(u.idx).map(|f| f.0.clone()).unwrap_or_default();
            let key = id.to_string();
            if connected {
                out.request(Request::SignedUrl {
                    id: key,
                    wl,
                    filename,
                });
            } else {
                out.submit(Job::SignedUrl { key, wl, filename });
            }
            return;
        }
        if !u.notifying && !u.done.is_empty() {
            u.notifying = true;
            u.busy = true;
            let body = notice(u);
            let key = id.to_string();
            if connected {
                out.request(Request::UploadResults { id: key, wl, body });
            } else {
                out.submit(Job::UploadResults { key, wl, body });
            }
            return;
        }
        self.finish_upload(id, false, now, out);
    }

    /// R9's answer (`None`: no answer in time): on to the PUT, or the REST fallback.
    pub fn on_signed_url_reply(
        &mut self,
        id: &str,
        body: Option<serde_json::Value>,
        now: Instant,
        out: &mut dyn Outbound,
    ) {
        let parsed = body.as_ref().map(crate::backend::parse_signed_url);
        match parsed {
            Some(Ok(found)) => self.put(id, found, now, out),
            _ => {
                let Some(a) = self.get(id) else { return };
                let (Some(wl), Some(u)) = (a.meta.workload_uuid.clone(), a.upload.as_ref()) else {
                    return;
                };
                let Some(filename) = u.files.get(u.idx).map(|f| f.0.clone()) else {
                    return;
                };
                out.submit(Job::SignedUrl {
                    key: id.to_string(),
                    wl,
                    filename,
                });
            }
        }
    }

    /// The transfer of the current file, by the route the attachment reply chose (D40).
    fn put(
        &mut self,
        id: &str,
        found: crate::backend::Attachment,
        now: Instant,
        out: &mut dyn Outbound,
    ) {
        use crate::backend::UploadMethod;
        let Some(u) = self.get_mut(id).and_then(|a| a.upload.as_mut()) else {
            return;
        };
        let Some((name, path)) = u.files.get(u.idx).cloned() else {
            return;
        };
        let multipart = match found.method {
            UploadMethod::SignedUrl => None,
            UploadMethod::Multipart => Some(name.clone()),
            UploadMethod::Other(m) => {
                // The backend's text, bounded: it goes into the log.
                let m: String = m.chars().take(80).collect();
                let why = format!(
                    "the backend asked for upload_method {m:?} for {name}, which this node does not know (it knows signed_url and multipart)"
                );
                return self.upload_attempt_failed(id, false, &why, now, out);
            }
        };
        u.done.push((name, found.url.clone(), found.uuid));
        out.submit(Job::Put {
            key: id.to_string(),
            url: found.url,
            path,
            multipart,
        });
    }

    /// R10's answer over MQTT (`ok` false: refused or silent, so the REST fallback).
    pub fn on_upload_reply(&mut self, id: &str, ok: bool, now: Instant, out: &mut dyn Outbound) {
        if ok {
            return self.finish_upload(id, true, now, out);
        }
        let Some(a) = self.get(id) else { return };
        let (Some(wl), Some(u)) = (a.meta.workload_uuid.clone(), a.upload.as_ref()) else {
            return;
        };
        let body = notice(u);
        out.submit(Job::UploadResults {
            key: id.to_string(),
            wl,
            body,
        });
    }

    /// A worker's answer to an upload job (other answers are not the table's: ignored).
    pub fn on_worker_done(&mut self, done: Done, now: Instant, out: &mut dyn Outbound) {
        match done {
            Done::SignedUrl { key, result } => match result {
                Ok(found) => self.put(&key, found, now, out),
                Err(e) => {
                    self.upload_attempt_failed(&key, true, &format!("no signed URL: {e}"), now, out)
                }
            },
            Done::Put { key, result } => match result {
                Ok(()) => {
                    if let Some(u) = self.get_mut(&key).and_then(|a| a.upload.as_mut()) {
                        if let Some(f) = u.files.get(u.idx) {
                            log::info!("uploaded result file {}", crate::logtext::shown(&f.0));
                        }
                        u.idx = u.idx.saturating_add(1);
                        u.attempt = 0;
                        u.busy = false;
                    }
                    self.step_upload(&key, now, out);
                }
                Err((retriable, why)) => {
                    if let Some(u) = self.get_mut(&key).and_then(|a| a.upload.as_mut()) {
                        u.done.pop();
                    }
                    self.upload_attempt_failed(&key, retriable, &why, now, out);
                }
            },
            Done::UploadResults { key, result } => {
                if let Err(e) = &result {
                    log::error!(
                        "the backend was not told about the uploaded results: {}",
                        crate::logtext::shown(&e.to_string())
                    );
                }
                self.finish_upload(&key, result.is_ok(), now, out);
            }
            Done::CheckWorkload { .. } => {}
        }
    }

    fn upload_attempt_failed(
        &mut self,
        id: &str,
        retriable: bool,
        why: &str,
        now: Instant,
        out: &mut dyn Outbound,
    ) {
        let Some(u) = self.get_mut(id).and_then(|a| a.upload.as_mut()) else {
            return;
        };
        u.busy = false;
        u.attempt = u.attempt.saturating_add(1);
        let name = u.files.get(u.idx).map(|f| f.0.clone()).unwrap_or_default();
        if retriable && u.attempt < ATTEMPTS {
            // 2 s, 4 s, … (attempt is 1 or 2 here: ATTEMPTS is 3).
            let wait = Duration::from_secs(2u64 << u.attempt.saturating_sub(1).min(10));
            log::warn!(
                "upload of {} failed ({}); attempt {} of {ATTEMPTS} in {}s",
                crate::logtext::shown(&name),
                crate::logtext::shown(why),
                u.attempt.saturating_add(1),
                wait.as_secs()
            );
            u.retry_at = Some(now.checked_add(wait).unwrap_or(now));
        } else {
            log::error!(
                "upload of {} failed ({}); giving up on this file",
                crate::logtext::shown(&name),
                crate::logtext::shown(why)
            );
            u.idx = u.idx.saturating_add(1);
            u.attempt = 0;
        }
        self.step_upload(id, now, out);
    }

    /// Uploads are over: delete the uploaded files once the backend knows of them, then send
    /// the completion.
    fn finish_upload(&mut self, id: &str, notified: bool, now: Instant, out: &mut dyn Outbound) {
        let Some(u) = self.get_mut(id).and_then(|a| a.upload.take()) else {
            return;
        };
        if notified {
            for (name, _, _) in &u.done {
                if let Some((_, path)) = u.files.iter().find(|(n, _)| n == name) {
                    let _ = std::fs::remove_file(path);
                }
            }
        }
        log::info!(
            "result upload finished: {} of {} file(s) uploaded",
            u.done.len(),
            u.files.len()
        );
        remove_empty_dirs(&self.cfg.folder.join(id));
        self.advance(id, crate::workload::lifecycle::Event::UploadsDone, now, out);
    }

    /// Workloads uploading their results.
    pub fn uploading(&self) -> usize {
        self.values().filter(|a| a.upload.is_some()).count()
    }
}

/// R10's body: the files uploaded so far.
fn notice(u: &Upload) -> serde_json::Value {
    json!({
        "filenames": u.done.iter().map(|d| d.0.clone()).collect::<Vec<_>>(),
        "signed_urls": u.done.iter().map(|d| d.1.clone()).collect::<Vec<_>>(),
        "attachment_uuids": u.done.iter().map(|d| d.2.clone()).collect::<Vec<_>>(),
    })
}
