//! Result uploads: after a successful workload, every regular file inside the results folder
//! goes to a signed URL (R9, REST E8 as fallback; PUT on the upload thread; up to 3 attempts),
//! then the backend is told (R10, REST E9 as fallback), then the completion is sent. The
//! workload stays busy ("finalizing") the whole time.
//!
//! [`Uploads`] is a value of its own that the table owns: the uploads of every workload in its
//! `Uploading` phase, keyed by safe id. It reaches the outside only through [`Out`] (the
//! table's `Outbound` carries it out), and tells the table when a workload's uploads are over;
//! the table then moves the workload on. It never sees the table.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::backend::{Attachment, BackendError, UploadMethod};
use crate::workers::{Done, Job};
use crate::workload::shim::Exit;
use crate::workload::Meta;

const ATTEMPTS: u32 = 3;

/// Everything the uploads do to the outside world.
pub trait Out {
    /// The broker connection is up (requests go over MQTT, else over REST on the workers).
    fn connected(&self) -> bool;
    /// A non-terminal workload status (R7), fire and forget.
    fn workload_status(&mut self, wl: &str, body: Value);
    /// R9 over MQTT: a signed URL for `filename`, one result file of workload `id`; the
    /// answer comes back through [`Uploads::on_signed_url_reply`].
    fn ask_signed_url(&mut self, id: &str, wl: &str, filename: &str);
    /// R10 over MQTT: the backend is told which result files were uploaded; the answer comes
    /// back through [`Uploads::on_upload_reply`].
    fn tell_uploaded(&mut self, id: &str, wl: &str, body: Value);
    /// An HTTP job for the worker threads.
    fn submit(&mut self, job: Job);
}

/// What the result uploads need from the configuration.
#[derive(Debug, Clone)]
pub struct UploadCfg {
    /// `upload_results`, and a backend to upload to (not standalone).
    pub enabled: bool,
    pub folder: PathBuf,
    pub capacity: u32,
    pub max_bytes: u64,
}

impl UploadCfg {
    pub fn of(s: &crate::config::Settings) -> UploadCfg {
        UploadCfg {
            enabled: s.upload_results.value && !s.standalone,
            folder: s.results_folder.value.clone(),
            capacity: s.max_concurrent_workloads.value,
            max_bytes: s
                .manifest
                .as_ref()
                .and_then(|m| m.max_result_bytes)
                .unwrap_or(DEFAULT_MAX_RESULT_BYTES),
        }
    }
}

/// Why one attempt at a file failed; [`Failure::retriable`] decides whether it is tried again.
#[derive(Debug)]
enum Failure {
    /// No signed URL (E8 after R9): always asked for again.
    NoUrl(BackendError),
    /// The transfer failed: tried again when the backend error says another try may help.
    Transfer(BackendError),
    /// The attachment reply asked for an upload method this node does not know (D40).
    UnknownMethod { method: String, name: String },
}

impl Failure {
    fn retriable(&self) -> bool {
        match self {
            Failure::NoUrl(_) => true,
            Failure::Transfer(e) => e.retriable(),
            Failure::UnknownMethod { .. } => false,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::NoUrl(e) => write!(f, "no signed URL: {e}"),
            Failure::Transfer(e) => write!(f, "{e}"),
            Failure::UnknownMethod { method, name } => write!(
                f,
                "the backend asked for upload_method {method:?} for {name}, which this node does not know (it knows signed_url and multipart)"
            ),
        }
    }
}

/// The uploads of one workload.
struct Upload {
    /// Its workload uuid (the backend's name for it).
    wl: String,
    /// (name relative to the folder, path)
    files: Vec<(String, PathBuf)>,
    idx: usize,
    attempt: u32,
    retry_at: Option<Instant>,
    /// A request or transfer for the current step is under way.
    busy: bool,
    /// (name, signed url, attachment uuid) of the files uploaded.
    done: Vec<(String, String, String)>,
    notifying: bool,
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

/// The result uploads of the workloads in their `Uploading` phase, by safe id.
pub struct Uploads {
    cfg: UploadCfg,
    /// The warning about files straight in `results_folder` with capacity > 1 was given (D24).
    loose_results_warned: bool,
    active: BTreeMap<String, Upload>,
}

impl Uploads {
    pub fn new(cfg: UploadCfg) -> Uploads {
        Uploads {
            cfg,
            loose_results_warned: false,
            active: BTreeMap::new(),
        }
    }

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

    /// The result files of workload `id`, started at `since` (D24): everything in its own
    /// folder, and with capacity 1 also what was written straight into `results_folder`
    /// (outside the folders of `others`, the other workloads tracked). With capacity > 1 files
    /// straight in `results_folder` belong to nobody: never uploaded or deleted, and the node
    /// says so once.
    fn result_files(&mut self, id: &str, since: f64, others: &[String]) -> Vec<(String, PathBuf)> {
        let root = self.cfg.folder.clone();
        let mut files = collect(&root.join(id));
        let others: Vec<PathBuf> = others
            .iter()
            .filter(|k| k.as_str() != id)
            .map(|k| root.join(k))
            .collect();
        // Only what the workload wrote: a file older than its start (the operator's own files
        // in a results folder that holds them, what an earlier workload left) is never
        // uploaded or deleted as its result.
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

    /// Starts the uploads of workload `id` (its record `meta`, its exit `exit`), `others`
    /// being the other workloads tracked; false when there is nothing to upload.
    pub fn begin(
        &mut self,
        id: &str,
        meta: &Meta,
        exit: Option<&Exit>,
        others: &[String],
        now: Instant,
        out: &mut dyn Out,
    ) -> bool {
        let Some(wl) = meta.workload_uuid.clone() else {
            return false;
        };
        if !self.cfg.enabled || meta.cancel.is_some() || exit.map(Exit::code) != Some(0) {
            return false;
        }
        let files = self.result_files(id, meta.created_unix, others);
        if files.is_empty() {
            remove_empty_dirs(&self.cfg.folder.join(id));
            return false;
        }
        log::info!(
            "{} {}: uploading {} result file(s) from {}",
            meta.kind,
            crate::logtext::shown(&meta.request_id_text()),
            files.len(),
            self.cfg.folder.display()
        );
        let count = files.len();
        out.workload_status(&wl, json!({"status": "finalizing", "message": "Starting result file upload", "file_count": count}));
        self.active.insert(
            id.to_string(),
            Upload {
                wl,
                files,
                idx: 0,
                attempt: 0,
                retry_at: None,
                busy: false,
                done: Vec::new(),
                notifying: false,
            },
        );
        // Files to upload: the first step never ends the uploads.
        let _ = self.step(id, now, out);
        true
    }

    /// Moves an upload on by one step when nothing is under way; true when the uploads of
    /// `id` are over (the table then moves the workload on).
    pub fn step(&mut self, id: &str, now: Instant, out: &mut dyn Out) -> bool {
        let connected = out.connected();
        let Some(u) = self.active.get_mut(id) else {
            return false;
        };
        if u.busy || u.retry_at.is_some_and(|t| now < t) {
            return false;
        }
        u.retry_at = None;
        let wl = u.wl.clone();
        if u.idx < u.files.len() {
            u.busy = true;
            let filename = u.files.get(u.idx).map(|f| f.0.clone()).unwrap_or_default();
            if connected {
                out.ask_signed_url(id, &wl, &filename);
            } else {
                out.submit(Job::SignedUrl {
                    key: id.to_string(),
                    wl,
                    filename,
                });
            }
            return false;
        }
        if !u.notifying && !u.done.is_empty() {
            u.notifying = true;
            u.busy = true;
            let body = notice(u);
            if connected {
                out.tell_uploaded(id, &wl, body);
            } else {
                out.submit(Job::UploadResults {
                    key: id.to_string(),
                    wl,
                    body,
                });
            }
            return false;
        }
        self.finish(id, false)
    }

    /// R9's answer (`None`: no answer in time): on to the PUT, or the REST fallback. True
    /// when the uploads of `id` are over.
    pub fn on_signed_url_reply(
        &mut self,
        id: &str,
        body: Option<Value>,
        now: Instant,
        out: &mut dyn Out,
    ) -> bool {
        let parsed = body.as_ref().map(crate::backend::parse_signed_url);
        match parsed {
            Some(Ok(found)) => self.put(id, found, now, out),
            _ => {
                let Some(u) = self.active.get(id) else {
                    return false;
                };
                let Some(filename) = u.files.get(u.idx).map(|f| f.0.clone()) else {
                    return false;
                };
                out.submit(Job::SignedUrl {
                    key: id.to_string(),
                    wl: u.wl.clone(),
                    filename,
                });
                false
            }
        }
    }

    /// The transfer of the current file, by the route the attachment reply chose (D40).
    fn put(&mut self, id: &str, found: Attachment, now: Instant, out: &mut dyn Out) -> bool {
        let Some(u) = self.active.get_mut(id) else {
            return false;
        };
        let Some((name, path)) = u.files.get(u.idx).cloned() else {
            return false;
        };
        let multipart = match found.method {
            UploadMethod::SignedUrl => None,
            UploadMethod::Multipart => Some(name.clone()),
            UploadMethod::Other(m) => {
                // The backend's text, bounded: it goes into the log.
                let method: String = m.chars().take(80).collect();
                let why = Failure::UnknownMethod { method, name };
                return self.attempt_failed(id, &why, now, out);
            }
        };
        u.done.push((name, found.url.clone(), found.uuid));
        out.submit(Job::Put {
            key: id.to_string(),
            url: found.url,
            path,
            multipart,
        });
        false
    }

    /// R10's answer over MQTT (`ok` false: refused or silent, so the REST fallback). True when
    /// the uploads of `id` are over.
    pub fn on_upload_reply(&mut self, id: &str, ok: bool, out: &mut dyn Out) -> bool {
        if ok {
            return self.finish(id, true);
        }
        let Some(u) = self.active.get(id) else {
            return false;
        };
        out.submit(Job::UploadResults {
            key: id.to_string(),
            wl: u.wl.clone(),
            body: notice(u),
        });
        false
    }

    /// A worker's answer to an upload job (other answers are not the uploads': ignored).
    /// `Some(id)` when the uploads of workload `id` are over.
    pub fn on_worker_done(
        &mut self,
        done: Done,
        now: Instant,
        out: &mut dyn Out,
    ) -> Option<String> {
        let (key, over) = match done {
            Done::SignedUrl { key, result } => {
                let over = match result {
                    Ok(found) => self.put(&key, found, now, out),
                    Err(e) => self.attempt_failed(&key, &Failure::NoUrl(e), now, out),
                };
                (key, over)
            }
            Done::Put { key, result } => {
                let over = match result {
                    Ok(()) => {
                        if let Some(u) = self.active.get_mut(&key) {
                            if let Some(f) = u.files.get(u.idx) {
                                log::info!("uploaded result file {}", crate::logtext::shown(&f.0));
                            }
                            u.idx = u.idx.saturating_add(1);
                            u.attempt = 0;
                            u.busy = false;
                        }
                        self.step(&key, now, out)
                    }
                    Err(e) => {
                        if let Some(u) = self.active.get_mut(&key) {
                            u.done.pop();
                        }
                        self.attempt_failed(&key, &Failure::Transfer(e), now, out)
                    }
                };
                (key, over)
            }
            Done::UploadResults { key, result } => {
                if let Err(e) = &result {
                    log::error!(
                        "the backend was not told about the uploaded results: {}",
                        crate::logtext::shown(&e.to_string())
                    );
                }
                let over = self.finish(&key, result.is_ok());
                (key, over)
            }
            Done::CheckWorkload { .. } => return None,
        };
        over.then_some(key)
    }

    fn attempt_failed(&mut self, id: &str, why: &Failure, now: Instant, out: &mut dyn Out) -> bool {
        let Some(u) = self.active.get_mut(id) else {
            return false;
        };
        u.busy = false;
        u.attempt = u.attempt.saturating_add(1);
        let name = u.files.get(u.idx).map(|f| f.0.clone()).unwrap_or_default();
        let why_text = why.to_string();
        if why.retriable() && u.attempt < ATTEMPTS {
            // 2 s, 4 s, … (attempt is 1 or 2 here: ATTEMPTS is 3).
            let wait = Duration::from_secs(2u64 << u.attempt.saturating_sub(1).min(10));
            log::warn!(
                "upload of {} failed ({}); attempt {} of {ATTEMPTS} in {}s",
                crate::logtext::shown(&name),
                crate::logtext::shown(&why_text),
                u.attempt.saturating_add(1),
                wait.as_secs()
            );
            u.retry_at = Some(now.checked_add(wait).unwrap_or(now));
        } else {
            log::error!(
                "upload of {} failed ({}); giving up on this file",
                crate::logtext::shown(&name),
                crate::logtext::shown(&why_text)
            );
            u.idx = u.idx.saturating_add(1);
            u.attempt = 0;
        }
        self.step(id, now, out)
    }

    /// Uploads are over: delete the uploaded files once the backend knows of them. True when
    /// `id` was uploading (the table then sends the completion).
    fn finish(&mut self, id: &str, notified: bool) -> bool {
        let Some(u) = self.active.remove(id) else {
            return false;
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
        true
    }

    /// Workloads uploading their results.
    pub fn uploading(&self) -> usize {
        self.active.len()
    }

    /// The earliest retry due (for the loop's sleep), only while nothing is under way for it.
    pub fn next_due(&self) -> Option<Instant> {
        self.active
            .values()
            .filter(|u| !u.busy)
            .filter_map(|u| u.retry_at)
            .min()
    }

    /// Drops what is left of the uploads of workloads no longer tracked.
    pub fn retain(&mut self, tracked: impl Fn(&str) -> bool) {
        self.active.retain(|id, _| tracked(id));
    }
}

/// R10's body: the files uploaded so far.
fn notice(u: &Upload) -> Value {
    json!({
        "filenames": u.done.iter().map(|d| d.0.clone()).collect::<Vec<_>>(),
        "signed_urls": u.done.iter().map(|d| d.1.clone()).collect::<Vec<_>>(),
        "attachment_uuids": u.done.iter().map(|d| d.2.clone()).collect::<Vec<_>>(),
    })
}
