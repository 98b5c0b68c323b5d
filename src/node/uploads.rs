//! Result uploads: after a successful workload, every regular file inside the results folder
//! goes to a signed URL (R9, REST E8 as fallback; PUT on the upload pool; up to 3 attempts a
//! file), then the backend is told (R10, REST E9 as fallback), then the completion is sent. The
//! workload stays busy ("finalizing") the whole time.
//!
//! The files of one workload go up side by side: up to the pool's size
//! (`CYBERWAVE_NODE_UPLOAD_WORKERS`) at once, the next file's signed URL asked for while the
//! current ones are sent (one request at a time per workload). A workload with nothing being
//! sent may always send one file, and a second one only while a worker is idle, so the
//! transfers of one workload never queue another's behind them; a file waiting for its retry
//! holds no worker and no other file.
//!
//! A workload's uploads have one deadline as a whole (D68, [`deadline_for`]: 30 min and a second
//! per MiB of its results, or `CYBERWAVE_NODE_UPLOAD_DEADLINE_SECONDS`), which also bounds each
//! transfer: past it, or at a `cancel` of the finalizing workload ([`Uploads::abandon`]), the
//! files not uploaded stay on disk and the completion names them in `results_not_uploaded`
//! (as it names the files given up on after their attempts), then goes out. A hung endpoint
//! never keeps a workload finalizing, and its slot taken, for longer.
//!
//! [`Uploads`] is a value of its own that the table owns: the uploads of every workload in its
//! `Uploading` phase, keyed by safe id. What it wants done (requests, worker jobs, statuses) it
//! adds to the table's [`Effect`]s, and it tells the table when a workload's uploads are over;
//! the table then moves the workload on. It never sees the table.

use crate::protocol::commands::TopicId;
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use crate::store::{self, Beneath};
use crate::workload::results::{self, Claim, Identity, Verdict, Walk};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::backend::{Attachment, BackendError, UploadMethod};
use crate::workers::{Done, Job};

use super::effect::{Effect, Fx};
use crate::workload::shim::Exit;
use crate::workload::Meta;

const ATTEMPTS: u32 = 3;

/// What the result uploads need from the configuration.
#[derive(Debug, Clone)]
pub struct UploadCfg {
    /// `upload_results`, and a backend to upload to (not standalone).
    pub enabled: bool,
    pub folder: PathBuf,
    pub max_bytes: u64,
    /// The upload pool's size: the most transfers at once ([`crate::workers::uploaders`]).
    pub workers: usize,
    /// The workloads' directories in the state dir (their [`Claim`]s).
    pub records: PathBuf,
    /// D61: the loose files decided, in the state dir.
    pub ledger: PathBuf,
    /// D65: workloads run as a `workload_user`, so a result file must be owned by the
    /// workload's uid with one link; the uid assumed for a record that names none (one written
    /// before records kept it).
    pub checked: Option<Option<u32>>,
    /// `CYBERWAVE_NODE_UPLOAD_DEADLINE_SECONDS`: one workload's uploads as a whole (D68); `None`:
    /// the default, [`deadline_for`].
    pub deadline: Option<Duration>,
}

/// The deadline of a workload's uploads as a whole (D68): `setting` when the operator set one,
/// else 30 minutes and a second per MiB (begun) of its `bytes` of results.
pub fn deadline_for(setting: Option<Duration>, bytes: u64) -> Duration {
    setting.unwrap_or_else(|| {
        let mib = bytes.div_ceil(1024 * 1024);
        DEFAULT_DEADLINE.saturating_add(Duration::from_secs(mib))
    })
}

/// The fixed part of the default upload deadline.
const DEFAULT_DEADLINE: Duration = Duration::from_secs(30 * 60);

impl UploadCfg {
    pub fn of(s: &crate::config::Settings) -> UploadCfg {
        UploadCfg {
            enabled: s.upload_results.value && !s.standalone,
            folder: s.results_folder.value.clone(),
            max_bytes: s
                .manifest
                .as_ref()
                .and_then(|m| m.max_result_bytes)
                .unwrap_or(DEFAULT_MAX_RESULT_BYTES),
            workers: crate::workers::uploaders(
                s.env.value("CYBERWAVE_NODE_UPLOAD_WORKERS").as_deref(),
            ),
            records: s.config_dir.value.join("workloads"),
            ledger: s.config_dir.value.join(LEDGER_FILE),
            checked: None,
            deadline: s.tuning.upload_deadline,
        }
    }
}

/// The loose files decided (D61), in the state dir.
pub const LEDGER_FILE: &str = "loose_results.json";

/// A tracked workload, as the uploads see it: its safe id and the uid it runs as.
pub struct Owner {
    pub id: String,
    pub uid: Option<u32>,
}

/// Why one attempt at a file failed; [`UploadFailure::retriable`] decides whether it is tried again.
#[derive(Debug)]
enum UploadFailure {
    /// No signed URL (E8 after R9): always asked for again.
    NoUrl(BackendError),
    /// The transfer failed: tried again when the backend error says another try may help.
    Transfer(BackendError),
    /// The attachment reply asked for an upload method this node does not know (D40).
    UnknownMethod { method: String, name: String },
}

impl UploadFailure {
    fn retriable(&self) -> bool {
        match self {
            UploadFailure::NoUrl(_) => true,
            UploadFailure::Transfer(e) => e.retriable(),
            UploadFailure::UnknownMethod { .. } => false,
        }
    }
}

impl std::fmt::Display for UploadFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UploadFailure::NoUrl(e) => write!(f, "no signed URL: {e}"),
            UploadFailure::Transfer(e) => write!(f, "{e}"),
            UploadFailure::UnknownMethod { method, name } => write!(
                f,
                "the backend asked for upload_method {method:?} for {name}, which this node does not know (it knows signed_url and multipart)"
            ),
        }
    }
}

/// Where one result file is.
#[derive(Debug)]
enum State {
    /// To be asked for a signed URL (again at `File::retry_at`, if set).
    Waiting,
    /// Its signed URL is asked for (R9, or E8 on the http worker).
    Asking,
    /// Its URL came; it waits for a free upload worker.
    Ready(Attachment),
    /// Its transfer is on the upload pool.
    Sending(Attachment),
    Sent(Attachment),
    /// Given up on.
    Failed,
}

/// One result file of a workload.
struct File {
    /// Its name relative to the folder.
    name: String,
    path: Beneath,
    state: State,
    /// Failed attempts so far.
    attempt: u32,
    retry_at: Option<Instant>,
}

/// The uploads of one workload.
struct Upload {
    /// Its workload uuid (the backend's name for it).
    wl: TopicId,
    files: Vec<File>,
    /// R10/E9 is under way.
    notifying: bool,
    /// D68: past this, what is not uploaded stays on disk and the completion goes out.
    deadline: Instant,
}

impl Upload {
    fn count(&self, f: impl Fn(&State) -> bool) -> usize {
        self.files.iter().filter(|x| f(&x.state)).count()
    }

    fn sending(&self) -> usize {
        self.count(|s| matches!(s, State::Sending(_)))
    }

    /// A signed URL may be asked for now: none is under way, and fewer URLs are in hand
    /// (being sent or waiting for a worker) than the pool can take, plus the next one.
    fn may_ask(&self, workers: usize) -> bool {
        self.count(|s| matches!(s, State::Asking)) == 0
            && self.count(|s| matches!(s, State::Ready(_) | State::Sending(_))) <= workers.max(1)
    }

    /// The file whose URL is asked for.
    fn asking(&self) -> Option<usize> {
        self.files
            .iter()
            .position(|f| matches!(f.state, State::Asking))
    }
}

/// At most this many bytes of results per workload unless `max_result_bytes` says otherwise (D24).
pub const DEFAULT_MAX_RESULT_BYTES: u64 = 10 * 1024 * 1024 * 1024;

/// Keeps files in order while their sizes add up to at most `max` bytes; the names of the files
/// that did not fit are returned beside them.
fn within_budget(files: Vec<(String, Beneath)>, max: u64) -> (Vec<(String, Beneath)>, Vec<String>) {
    let mut total = 0u64;
    let mut kept = Vec::new();
    let mut skipped = Vec::new();
    for (name, path) in files {
        let size = path.listed().map_or(0, |l| l.size);
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

/// Removes the folder `id` of `folder` and the empty folders below it; anything still holding
/// a file stays. A symlink is never followed (a workload may plant one in place of its folder,
/// or of any folder below it): each folder is opened from the one above it, and removed by name
/// in it.
fn remove_empty_dirs(folder: &Path, id: &str) {
    fn below(dir: &OwnedFd, depth: usize) {
        let Ok(rd) = store::entries(dir) else {
            return;
        };
        for e in rd.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let name = e.file_name();
            if depth < store::MAX_DEPTH {
                if let Ok(sub) = store::open_dir_at(Some(dir), &name) {
                    below(&sub, depth.saturating_add(1));
                }
            }
            let _ = store::remove_dir_at(dir, &name);
        }
    }
    let Ok(top) = store::open_root(folder) else {
        return;
    };
    let id = std::ffi::OsStr::new(id);
    if let Ok(fd) = store::open_dir_at(Some(&top), id) {
        below(&fd, 0);
        // A link put in its place since is not followed by rmdir.
        let _ = store::remove_dir_at(&top, id);
    }
}

/// D61: a loose file decided, and to whom.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Decided {
    id: Identity,
    /// Its path below `results_folder` when it was decided.
    name: String,
    /// The workload it is the result of.
    #[serde(default)]
    to: Option<String>,
    /// Left on disk: the workloads that could have written it.
    #[serde(default)]
    candidates: Vec<String>,
}

/// The ledger's file.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct LedgerFile {
    files: Vec<Decided>,
}

impl store::Validate for LedgerFile {
    fn validate(&self) -> Result<(), store::Invalid> {
        Ok(())
    }
}

/// The loose files decided so far, by identity: a file is decided once, when it is first seen
/// with a candidate, and never again while it is there (a workload that ends later does not
/// take a file that others could have written). Kept in the state dir across restarts.
#[derive(Default)]
struct LooseLedger {
    entries: BTreeMap<Identity, Decided>,
}

impl LooseLedger {
    fn load(path: &Path) -> LooseLedger {
        const CAP: u64 = 16 * 1024 * 1024;
        let file: LedgerFile = store::read_record(path, CAP).unwrap_or_default();
        LooseLedger {
            entries: file.files.into_iter().map(|d| (d.id, d)).collect(),
        }
    }

    fn save(&self, path: &Path) {
        let file = LedgerFile {
            files: self.entries.values().cloned().collect(),
        };
        let written = serde_json::to_vec(&file)
            .map_err(std::io::Error::other)
            .and_then(|json| store::write_atomic(path, &json, 0o600));
        if let Err(e) = written {
            log::warn!(
                "cannot record the loose results decided in {}: {e}",
                path.display()
            );
        }
    }
}

/// The result uploads of the workloads in their `Uploading` phase, by safe id.
pub struct Uploads {
    cfg: UploadCfg,
    active: BTreeMap<String, Upload>,
    /// D61: the loose files decided.
    ledger: LooseLedger,
    /// Workloads whose end the results folder was looked at for: no longer candidates.
    ended: BTreeSet<String>,
    /// The workloads' [`Claim`]s read so far (`None`: a record without one).
    claims: BTreeMap<String, Option<Claim>>,
    /// Per workload, the loose files it could have written that were left on disk.
    unattributed: BTreeMap<String, Vec<String>>,
    /// Per workload whose uploads are over, its result files left on disk, not uploaded (D68).
    not_uploaded: BTreeMap<String, Vec<String>>,
}

impl Uploads {
    pub fn new(cfg: UploadCfg) -> Uploads {
        let ledger = if cfg.enabled {
            LooseLedger::load(&cfg.ledger)
        } else {
            LooseLedger::default()
        };
        Uploads {
            cfg,
            active: BTreeMap::new(),
            ledger,
            ended: BTreeSet::new(),
            claims: BTreeMap::new(),
            unattributed: BTreeMap::new(),
            not_uploaded: BTreeMap::new(),
        }
    }

    /// D24: the workload's own results folder, `<results_folder>/<safe-id>/`, when result
    /// uploads are on. The spawner creates it (off the loop, [`crate::workload::launch`]).
    pub fn results_dir_for(&self, safe_id: &str) -> Option<PathBuf> {
        self.cfg.enabled.then(|| self.cfg.folder.join(safe_id))
    }

    /// D61: looks at `results_folder` as workload `id`'s run is over (once), deciding the loose
    /// files first seen now among the `tracked` workloads still running (and `id`); `id` is
    /// then no longer a candidate. The loose files that are `id`'s results, and those it could
    /// have written that stay on disk (kept for its completion).
    fn observe(&mut self, id: &str, tracked: &[Owner]) -> Vec<(String, Beneath)> {
        if !self.cfg.enabled || self.ended.contains(id) {
            return Vec::new();
        }
        let records = self.cfg.records.clone();
        let ours: BTreeSet<&str> = tracked.iter().map(|t| t.id.as_str()).collect();
        // The workloads' own folders: every workload's the node knows of (in flight included).
        let skip = |name: &std::ffi::OsStr| {
            name.to_str().is_some_and(|n| ours.contains(n)) || records.join(name).is_dir()
        };
        let walked = Walk {
            skip_top: &skip,
            limit: results::MAX_FILES,
            warn: true,
        }
        .run(&self.cfg.folder, Path::new(""));
        for t in tracked {
            self.claims
                .entry(t.id.clone())
                .or_insert_with(|| Claim::load(&records.join(&t.id)));
        }
        let changed = self.decide(&walked.files, tracked);
        let present: BTreeSet<Identity> = walked
            .files
            .iter()
            .filter_map(|(_, b)| b.listed().map(Identity::of))
            .collect();
        let before = self.ledger.entries.len();
        if walked.complete {
            self.ledger.entries.retain(|k, _| present.contains(k));
        }
        if changed || before != self.ledger.entries.len() {
            self.ledger.save(&self.cfg.ledger);
        }
        self.ended.insert(id.to_string());
        let mine = |b: &Beneath, want: &dyn Fn(&Decided) -> bool| {
            b.listed()
                .and_then(|l| self.ledger.entries.get(&Identity::of(l)))
                .is_some_and(want)
        };
        let left: Vec<String> = walked
            .files
            .iter()
            .filter(|(_, b)| mine(b, &|d| d.candidates.iter().any(|c| c == id)))
            .map(|(n, _)| n.clone())
            .collect();
        let files = walked
            .files
            .iter()
            .filter(|(_, b)| mine(b, &|d| d.to.as_deref() == Some(id)))
            .cloned()
            .collect();
        if !left.is_empty() {
            self.unattributed.insert(id.to_string(), left);
        }
        files
    }

    /// Decides each of `files` not decided yet among the workloads still running ([`results::attribute`]);
    /// whether any was.
    fn decide(&mut self, files: &[(String, Beneath)], tracked: &[Owner]) -> bool {
        let fallback = self.cfg.checked.flatten();
        let running: Vec<results::Runner> = tracked
            .iter()
            .filter(|t| !self.ended.contains(&t.id))
            .filter_map(|t| {
                let claim = self.claims.get(&t.id)?.as_ref()?;
                Some(results::Runner {
                    id: &t.id,
                    uid: t.uid.or(fallback),
                    claim,
                })
            })
            .collect();
        let mut changed = false;
        for (name, b) in files {
            let Some(l) = b.listed() else {
                continue;
            };
            let key = Identity::of(l);
            if self.ledger.entries.contains_key(&key) {
                continue;
            }
            let loose = results::Loose { name, listed: l };
            let (to, candidates) = match results::attribute(
                &loose,
                &running,
                self.cfg.checked.is_some(),
            ) {
                Verdict::Nobody => continue,
                Verdict::To(w) => {
                    log::info!(
                        "{} in the results folder is {}'s result",
                        crate::logtext::shown(name),
                        crate::logtext::shown(&w)
                    );
                    (Some(w), Vec::new())
                }
                Verdict::Unattributed(c) => {
                    log::warn!(
                        "{} was written straight into the results folder {} while {} ran: it is none of theirs for sure, so it stays on disk, not uploaded, and each of their completions names it in unattributed_results (a workload writes its results into $CYBERWAVE_RESULTS_DIR, or names them after its workload uuid or request id)",
                        crate::logtext::shown(name),
                        self.cfg.folder.display(),
                        crate::logtext::shown(&c.join(", "))
                    );
                    (None, c)
                }
            };
            changed = true;
            self.ledger.entries.insert(
                key,
                Decided {
                    id: key,
                    name: name.clone(),
                    to,
                    candidates,
                },
            );
        }
        changed
    }

    /// The loose files workload `id` could have written that were left on disk (D61: its
    /// completion names them); looked for first if its end was not looked at yet.
    pub fn unattributed(&mut self, id: &str, tracked: &[Owner]) -> Vec<String> {
        self.observe(id, tracked);
        self.unattributed.remove(id).unwrap_or_default()
    }

    /// The result files of workload `id` (D24, D61, D65), running as `uid`: what is in its own
    /// folder, and the loose files that are its own ([`Uploads::observe`]); with a workload
    /// user, only files its uid owns with one link.
    fn result_files(
        &mut self,
        id: &str,
        uid: Option<u32>,
        tracked: &[Owner],
    ) -> Vec<(String, Beneath)> {
        let loose = self.observe(id, tracked);
        let owner = self
            .cfg
            .checked
            .map(|fallback| uid.or(fallback).unwrap_or(u32::MAX));
        // A record without a claim was started before it was kept: its folder is its own.
        let made = self
            .claims
            .get(id)
            .and_then(Option::as_ref)
            .is_none_or(|c| c.made);
        let mut files = Vec::new();
        if made {
            files = Walk {
                skip_top: &|_| false,
                limit: usize::MAX,
                warn: true,
            }
            .run(&self.cfg.folder, Path::new(id))
            .files;
        }
        files.retain(|(name, b)| {
            let ok = owner.is_none_or(|o| b.listed().is_some_and(|l| l.uid == o && l.nlink == 1));
            if !ok {
                log::warn!(
                    "result file {} skipped: it is not the workload user's own file with a single link",
                    crate::logtext::shown(name)
                );
            }
            ok
        });
        files.extend(loose);
        let files = files
            .into_iter()
            .map(|(n, b)| (n, b.owned_by(owner)))
            .collect();
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

    /// Starts the uploads of workload `id` (its record `meta`, its exit `exit`), `tracked`
    /// being the workloads tracked (itself included); false when there is nothing to upload.
    pub fn begin(
        &mut self,
        id: &str,
        meta: &Meta,
        exit: Option<&Exit>,
        tracked: &[Owner],
        now: Instant,
        fx: &mut Fx,
    ) -> bool {
        // D61: the folder is looked at as every workload ends, whatever its end: what was
        // written while it ran is decided before it is no longer a candidate.
        let files = self.result_files(id, meta.uid, tracked);
        let Some(wl) = meta.workload_uuid.clone() else {
            return false;
        };
        if !self.cfg.enabled || meta.cancel.is_some() || exit.map(Exit::code) != Some(0) {
            return false;
        }
        if files.is_empty() {
            remove_empty_dirs(&self.cfg.folder, id);
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
        let bytes = files
            .iter()
            .filter_map(|(_, b)| b.listed().map(|l| l.size))
            .fold(0u64, u64::saturating_add);
        let deadline = crate::util::later(now, deadline_for(self.cfg.deadline, bytes));
        let body = json!({"status": "finalizing", "message": "Starting result file upload", "file_count": count});
        fx.push(Effect::WorkloadStatus {
            wl: wl.clone(),
            body,
        });
        let files = files
            .into_iter()
            .map(|(name, path)| File {
                name,
                path,
                state: State::Waiting,
                attempt: 0,
                retry_at: None,
            })
            .collect();
        self.active.insert(
            id.to_string(),
            Upload {
                wl,
                files,
                notifying: false,
                deadline,
            },
        );
        // Files to upload: the first step never ends the uploads.
        let _ = self.pump(id, now, fx);
        true
    }

    /// Moves every workload's uploads on as far as they can go now (retries that fell due,
    /// workers freed); the ids whose uploads are over (the table then moves them on).
    pub fn pump_all(&mut self, now: Instant, fx: &mut Fx) -> Vec<String> {
        let ids: Vec<String> = self.active.keys().cloned().collect();
        ids.into_iter()
            .filter(|id| self.expired(id, now) || self.pump(id, now, fx))
            .collect()
    }

    /// D68: the uploads of `id` passed their deadline, and are abandoned now.
    fn expired(&mut self, id: &str, now: Instant) -> bool {
        if self.active.get(id).is_none_or(|u| now < u.deadline) {
            return false;
        }
        self.abandon(
            id,
            "its uploads passed their deadline (CYBERWAVE_NODE_UPLOAD_DEADLINE_SECONDS)",
        )
    }

    /// D68: the uploads of `id` stop now (`why`: their deadline passed, the workload was
    /// cancelled): the files not uploaded stay on disk, named by its completion, and a transfer
    /// still under way is no longer waited for (its answer is ignored). True when `id` was
    /// uploading (the table then sends the completion).
    pub fn abandon(&mut self, id: &str, why: &str) -> bool {
        let Some(u) = self.active.get(id) else {
            return false;
        };
        // A file sent but not yet told to the backend is not attached to the workload either.
        log::error!(
            "result upload of {} abandoned: {why}; its {} file(s) stay on disk in {}, named in the completion's results_not_uploaded",
            crate::logtext::shown(id),
            u.files.len(),
            self.cfg.folder.display()
        );
        self.finish(id, false)
    }

    /// How many result files of `id` its uploads left on disk (once they are over).
    pub fn left(&self, id: &str) -> usize {
        self.not_uploaded.get(id).map_or(0, Vec::len)
    }

    /// The result files of `id` its uploads left on disk, not uploaded (once they are over).
    pub fn not_uploaded(&mut self, id: &str) -> Vec<String> {
        self.not_uploaded.remove(id).unwrap_or_default()
    }

    /// After an event of workload `id`: it moves on first, then the others (a worker may
    /// have been freed for them).
    fn after(&mut self, id: &str, now: Instant, fx: &mut Fx) -> Vec<String> {
        let mut over: Vec<String> = Vec::new();
        if self.pump(id, now, fx) {
            over.push(id.to_string());
        }
        over.extend(self.pump_all(now, fx));
        over
    }

    /// Moves the uploads of `id` on: transfers for the URLs in hand while the pool allows,
    /// the next URL asked for, and once every file is sent or given up on, R10. True when
    /// its uploads are over.
    fn pump(&mut self, id: &str, now: Instant, fx: &mut Fx) -> bool {
        let connected = fx.connected;
        let workers = self.cfg.workers.max(1);
        let mut sending_all: usize = self.active.values().map(Upload::sending).sum();
        let Some(u) = self.active.get_mut(id) else {
            return false;
        };
        // Transfers: one always when none of its own is under way, more while a worker is idle.
        while u.sending() == 0 || sending_all < workers {
            let Some(f) = u
                .files
                .iter_mut()
                .enumerate()
                .find(|(_, f)| matches!(f.state, State::Ready(_)))
            else {
                break;
            };
            let (i, f) = f;
            let State::Ready(found) = std::mem::replace(&mut f.state, State::Failed) else {
                break;
            };
            let multipart = match found.method {
                UploadMethod::Multipart => Some(f.name.clone()),
                _ => None,
            };
            fx.submit(Job::Put {
                key: id.to_string(),
                file: i,
                url: found.url.clone(),
                path: f.path.clone(),
                multipart,
                until: u.deadline,
            });
            f.state = State::Sending(found);
            sending_all = sending_all.saturating_add(1);
        }
        // The next signed URL, while the current files are sent.
        if u.may_ask(workers) {
            let due = u
                .files
                .iter_mut()
                .find(|f| matches!(f.state, State::Waiting) && f.retry_at.is_none_or(|t| now >= t));
            if let Some(f) = due {
                f.state = State::Asking;
                f.retry_at = None;
                let filename = f.name.clone();
                if connected {
                    fx.push(Effect::AskSignedUrl {
                        id: id.to_string(),
                        wl: u.wl.clone(),
                        filename,
                    });
                } else {
                    fx.submit(Job::SignedUrl {
                        key: id.to_string(),
                        wl: u.wl.to_string(),
                        filename,
                    });
                }
            }
        }
        let settled = u
            .files
            .iter()
            .all(|f| matches!(f.state, State::Sent(_) | State::Failed));
        if !settled || u.notifying {
            return false;
        }
        if u.count(|s| matches!(s, State::Sent(_))) > 0 {
            u.notifying = true;
            let body = notice(u);
            if connected {
                fx.push(Effect::TellUploaded {
                    id: id.to_string(),
                    wl: u.wl.clone(),
                    body,
                });
            } else {
                fx.submit(Job::UploadResults {
                    key: id.to_string(),
                    wl: u.wl.to_string(),
                    body,
                });
            }
            return false;
        }
        self.finish(id, false)
    }

    /// R9's answer (`None`: no answer in time): on to the PUT, or the REST fallback. The ids
    /// whose uploads are over.
    pub fn on_signed_url_reply(
        &mut self,
        id: &str,
        body: Option<Value>,
        now: Instant,
        fx: &mut Fx,
    ) -> Vec<String> {
        let Some(u) = self.active.get(id) else {
            return Vec::new();
        };
        let Some(i) = u.asking() else {
            return Vec::new();
        };
        match body.as_ref().map(crate::backend::parse_signed_url) {
            Some(Ok(found)) => self.url_came(id, i, found, now, fx),
            _ => {
                if let Some(f) = u.files.get(i) {
                    fx.submit(Job::SignedUrl {
                        key: id.to_string(),
                        wl: u.wl.to_string(),
                        filename: f.name.clone(),
                    });
                }
                Vec::new()
            }
        }
    }

    /// File `i`'s signed URL came: it waits for a worker, unless the backend chose a route
    /// this node does not know (D40).
    fn url_came(
        &mut self,
        id: &str,
        i: usize,
        found: Attachment,
        now: Instant,
        fx: &mut Fx,
    ) -> Vec<String> {
        let Some(f) = self.active.get_mut(id).and_then(|u| u.files.get_mut(i)) else {
            return Vec::new();
        };
        if let UploadMethod::Other(m) = &found.method {
            // The backend's text, bounded: it goes into the log.
            let method: String = m.chars().take(80).collect();
            let why = UploadFailure::UnknownMethod {
                method,
                name: f.name.clone(),
            };
            return self.attempt_failed(id, i, &why, now, fx);
        }
        f.state = State::Ready(found);
        self.after(id, now, fx)
    }

    /// R10's answer over MQTT (`ok` false: refused or silent, so the REST fallback). True when
    /// the uploads of `id` are over.
    pub fn on_upload_reply(&mut self, id: &str, ok: bool, fx: &mut Fx) -> bool {
        if ok {
            return self.finish(id, true);
        }
        let Some(u) = self.active.get(id) else {
            return false;
        };
        fx.submit(Job::UploadResults {
            key: id.to_string(),
            wl: u.wl.to_string(),
            body: notice(u),
        });
        false
    }

    /// A worker's answer to an upload job (other answers are not the uploads': ignored).
    /// The ids whose uploads are over.
    pub fn on_worker_done(&mut self, done: Done, now: Instant, fx: &mut Fx) -> Vec<String> {
        match done {
            Done::SignedUrl { key, result } => {
                let Some(i) = self.active.get(&key).and_then(Upload::asking) else {
                    return Vec::new();
                };
                match result {
                    Ok(found) => self.url_came(&key, i, found, now, fx),
                    Err(e) => self.attempt_failed(&key, i, &UploadFailure::NoUrl(e), now, fx),
                }
            }
            Done::Put { key, file, result } => {
                let Some(f) = self
                    .active
                    .get_mut(&key)
                    .and_then(|u| u.files.get_mut(file))
                else {
                    return Vec::new();
                };
                if !matches!(f.state, State::Sending(_)) {
                    return Vec::new();
                }
                match result {
                    Ok(()) => {
                        log::info!("uploaded result file {}", crate::logtext::shown(&f.name));
                        if let State::Sending(found) =
                            std::mem::replace(&mut f.state, State::Failed)
                        {
                            f.state = State::Sent(found);
                        }
                        self.after(&key, now, fx)
                    }
                    Err(e) => self.attempt_failed(&key, file, &UploadFailure::Transfer(e), now, fx),
                }
            }
            Done::UploadResults { key, result } => {
                if let Err(e) = &result {
                    log::error!(
                        "the backend was not told about the uploaded results: {}",
                        crate::logtext::shown(&e.to_string())
                    );
                }
                let mut over = Vec::new();
                if self.finish(&key, result.is_ok()) {
                    over.push(key);
                }
                over
            }
            Done::CheckWorkload { .. } => Vec::new(),
        }
    }

    /// Attempt at file `i` failed: tried again 2 s, then 4 s later while `why` allows and
    /// attempts are left, else given up on. The ids whose uploads are over.
    fn attempt_failed(
        &mut self,
        id: &str,
        i: usize,
        why: &UploadFailure,
        now: Instant,
        fx: &mut Fx,
    ) -> Vec<String> {
        let Some(f) = self.active.get_mut(id).and_then(|u| u.files.get_mut(i)) else {
            return Vec::new();
        };
        f.attempt = f.attempt.saturating_add(1);
        let why_text = why.to_string();
        if why.retriable() && f.attempt < ATTEMPTS {
            // 2 s, 4 s, … (attempt is 1 or 2 here: ATTEMPTS is 3).
            let wait = Duration::from_secs(2u64 << f.attempt.saturating_sub(1).min(10));
            log::warn!(
                "upload of {} failed ({}); attempt {} of {ATTEMPTS} in {}s",
                crate::logtext::shown(&f.name),
                crate::logtext::shown(&why_text),
                f.attempt.saturating_add(1),
                wait.as_secs()
            );
            f.state = State::Waiting;
            f.retry_at = Some(now.checked_add(wait).unwrap_or(now));
        } else {
            log::error!(
                "upload of {} failed ({}); giving up on this file",
                crate::logtext::shown(&f.name),
                crate::logtext::shown(&why_text)
            );
            f.state = State::Failed;
        }
        self.after(id, now, fx)
    }

    /// Uploads are over: delete the uploaded files once the backend knows of them. True when
    /// `id` was uploading (the table then sends the completion).
    fn finish(&mut self, id: &str, notified: bool) -> bool {
        let Some(u) = self.active.remove(id) else {
            return false;
        };
        let sent = u.count(|s| matches!(s, State::Sent(_)));
        if notified {
            for f in u.files.iter().filter(|f| matches!(f.state, State::Sent(_))) {
                let _ = f.path.remove();
            }
        }
        // What stays on disk: every file but those sent and told to the backend.
        let left: Vec<String> = u
            .files
            .iter()
            .filter(|f| !notified || !matches!(f.state, State::Sent(_)))
            .map(|f| f.name.clone())
            .collect();
        if !left.is_empty() {
            self.not_uploaded.insert(id.to_string(), left);
        }
        log::info!(
            "result upload finished: {sent} of {} file(s) uploaded",
            u.files.len()
        );
        remove_empty_dirs(&self.cfg.folder, id);
        true
    }

    /// Workloads uploading their results.
    pub fn uploading(&self) -> usize {
        self.active.len()
    }

    /// The earliest retry due (for the loop's sleep), only of workloads that may ask for a
    /// URL now (else it waits for an answer, which wakes the loop anyway).
    pub fn next_due(&self) -> Option<Instant> {
        let workers = self.cfg.workers;
        let retries = self
            .active
            .values()
            .filter(|u| u.may_ask(workers))
            .flat_map(|u| {
                u.files
                    .iter()
                    .filter(|f| matches!(f.state, State::Waiting))
                    .filter_map(|f| f.retry_at)
            });
        retries
            .chain(self.active.values().map(|u| u.deadline))
            .min()
    }

    /// Drops what is left of the uploads of workloads no longer tracked.
    pub fn retain(&mut self, tracked: impl Fn(&str) -> bool) {
        self.active.retain(|id, _| tracked(id));
        self.ended.retain(|id| tracked(id));
        self.claims.retain(|id, _| tracked(id));
        self.unattributed.retain(|id, _| tracked(id));
        self.not_uploaded.retain(|id, _| tracked(id));
    }
}

/// R10's body: the files uploaded, in their order.
fn notice(u: &Upload) -> Value {
    let sent: Vec<(&str, &Attachment)> = u
        .files
        .iter()
        .filter_map(|f| match &f.state {
            State::Sent(a) => Some((f.name.as_str(), a)),
            _ => None,
        })
        .collect();
    json!({
        "filenames": sent.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        "signed_urls": sent.iter().map(|(_, a)| a.url.clone()).collect::<Vec<_>>(),
        "attachment_uuids": sent.iter().map(|(_, a)| a.uuid.clone()).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every regular file of the folder `root` of its parent (the results folder), as the
    /// uploads list a workload's own folder.
    fn collect(root: &Path) -> Vec<(String, Beneath)> {
        Walk {
            skip_top: &|_| false,
            limit: usize::MAX,
            warn: true,
        }
        .run(root.parent().unwrap(), Path::new(root.file_name().unwrap()))
        .files
    }

    /// The results folder `out/w/sub/result.bin`, and beside it a folder `secret` holding what a
    /// workload must never have uploaded or deleted (standing for the node's state dir, `/etc`).
    fn tree(tag: &str) -> (crate::scratch::Scratch, PathBuf, PathBuf) {
        let s = crate::scratch::Scratch::new(tag);
        let root = s.path().join("out").join("w");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::write(root.join("sub").join("result.bin"), b"result").unwrap();
        let secret = s.path().join("secret");
        std::fs::create_dir_all(secret.join("empty")).unwrap();
        std::fs::write(secret.join("result.bin"), b"the node's secret").unwrap();
        (s, root, secret)
    }

    /// D24: a workload that swaps a folder of its results for a link once they were listed (the
    /// link pointing at the node's state) makes the node neither upload nor delete what the
    /// link points at.
    #[test]
    fn d24_a_results_folder_swapped_for_a_link_after_the_listing_reaches_nothing_behind_it() {
        let (_s, root, secret) = tree("swap");
        let files = collect(&root);
        assert_eq!(files.len(), 1, "{files:?}");
        assert_eq!(files[0].0, "sub/result.bin");
        // The swap.
        std::fs::rename(root.join("sub"), root.join("moved")).unwrap();
        std::os::unix::fs::symlink(&secret, root.join("sub")).unwrap();
        let opened = files[0].1.open();
        assert!(
            matches!(opened, Err(store::StoreError::NotRegular(_))),
            "opened through the link: {opened:?}"
        );
        assert!(files[0].1.remove().is_err(), "removed through the link");
        assert_eq!(
            std::fs::read(secret.join("result.bin")).unwrap(),
            b"the node's secret"
        );
        // Listed again, the link is not followed either; the empty-folder clean-up leaves the
        // link's target alone.
        assert!(collect(&root).iter().all(|(n, _)| n.starts_with("moved/")));
        std::fs::remove_file(root.join("moved").join("result.bin")).unwrap();
        remove_empty_dirs(root.parent().unwrap(), "w");
        assert!(
            secret.join("empty").is_dir(),
            "an empty folder behind the link was removed"
        );
        assert!(secret.join("result.bin").exists());
    }

    /// A real folder renamed away and another put in its place between the listing and the
    /// upload (no link anywhere): the file there is not the one listed, so it is neither
    /// uploaded nor deleted.
    #[test]
    fn d24_a_file_put_in_place_of_the_listed_one_is_neither_uploaded_nor_deleted() {
        let (_s, root, _secret) = tree("replace");
        let files = collect(&root);
        std::fs::rename(root.join("sub"), root.join("kept")).unwrap();
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::write(root.join("sub").join("result.bin"), b"another").unwrap();
        assert!(
            matches!(files[0].1.open(), Err(store::StoreError::NotRegular(_))),
            "another file opened"
        );
        assert!(files[0].1.remove().is_err());
        assert!(root.join("sub").join("result.bin").exists());
        // Renamed back, it is the listed file again.
        std::fs::remove_dir_all(root.join("sub")).unwrap();
        std::fs::rename(root.join("kept"), root.join("sub")).unwrap();
        assert!(files[0].1.open().is_ok());
        assert!(files[0].1.remove().is_ok());
    }

    /// The results folder itself swapped for a link: nothing is listed, opened or removed.
    #[test]
    fn d24_a_results_folder_that_is_itself_a_link_is_not_followed() {
        let (s, root, secret) = tree("swaproot");
        let files = collect(&root);
        std::fs::rename(&root, s.path().join("gone")).unwrap();
        std::os::unix::fs::symlink(&secret, &root).unwrap();
        assert!(collect(&root).is_empty());
        assert!(files[0].1.open().is_err());
        remove_empty_dirs(root.parent().unwrap(), "w");
        assert!(secret.join("empty").is_dir());
    }

    /// A tree deeper than [`store::MAX_DEPTH`] is walked down to that depth only (a deeper one
    /// would cost a descriptor and a stack frame a level).
    #[test]
    fn a_results_tree_deeper_than_the_limit_is_not_followed_below_it() {
        let s = crate::scratch::Scratch::new("deep");
        let mut dir = s.path().to_path_buf();
        for _ in 0..store::MAX_DEPTH + 3 {
            dir = dir.join("d");
        }
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("deepest.bin"), b"x").unwrap();
        std::fs::write(s.path().join("d").join("top.bin"), b"x").unwrap();
        let names: Vec<String> = collect(&s.path().join("d"))
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(names, ["top.bin"]);
        remove_empty_dirs(s.path(), "d");
    }
}
