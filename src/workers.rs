//! Worker threads for blocking HTTP: one for result uploads (a PUT can take minutes), one for
//! short REST calls (self-heal lookups, upload fallbacks), so neither waits behind the other and
//! the event loop waits behind neither. Results come back as [`Done`] messages.

use std::path::PathBuf;
use std::time::Duration;

use crossbeam_channel::{unbounded, Sender};
use serde_json::Value;

use crate::backend::{self, Backend, WorkloadCheck};

#[derive(Debug)]
pub enum Job {
    Put {
        key: String,
        url: String,
        path: PathBuf,
        /// `Some(form file name)`: a multipart POST (decision D40) instead of a PUT.
        multipart: Option<String>,
    },
    SignedUrl {
        key: String,
        wl: String,
        filename: String,
    },
    UploadResults {
        key: String,
        wl: String,
        body: Value,
    },
    CheckWorkload {
        key: String,
        wl: String,
        my_uuid: String,
        timeout: Duration,
    },
}

#[derive(Debug)]
pub enum Done {
    Put {
        key: String,
        result: Result<(), (bool, String)>,
    },
    SignedUrl {
        key: String,
        result: Result<backend::Attachment, String>,
    },
    UploadResults {
        key: String,
        result: Result<(), String>,
    },
    CheckWorkload {
        key: String,
        check: WorkloadCheck,
    },
}

pub struct Workers {
    uploads: Sender<Job>,
    http: Sender<Job>,
}

impl Workers {
    pub fn start(backend: Backend, done: Sender<Done>) -> std::io::Result<Workers> {
        let spawn = |name: &str| -> std::io::Result<Sender<Job>> {
            let (tx, rx) = unbounded::<Job>();
            let (b, d) = (backend.clone(), done.clone());
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    for job in rx {
                        if d.send(run(&b, job)).is_err() {
                            return;
                        }
                    }
                })?;
            Ok(tx)
        };
        Ok(Workers {
            uploads: spawn("uploads")?,
            http: spawn("http")?,
        })
    }

    pub fn submit(&self, job: Job) {
        let lane = if matches!(job, Job::Put { .. }) {
            &self.uploads
        } else {
            &self.http
        };
        let _ = lane.send(job);
    }
}

fn run(b: &Backend, job: Job) -> Done {
    match job {
        Job::Put {
            key,
            url,
            path,
            multipart,
        } => Done::Put {
            key,
            result: match multipart {
                None => backend::put_file(&url, &path),
                Some(name) => b.post_multipart(&url, &path, &name),
            },
        },
        Job::SignedUrl { key, wl, filename } => Done::SignedUrl {
            key,
            result: b.signed_url(&wl, &filename),
        },
        Job::UploadResults { key, wl, body } => Done::UploadResults {
            key,
            result: b.upload_results(&wl, &body),
        },
        Job::CheckWorkload {
            key,
            wl,
            my_uuid,
            timeout,
        } => Done::CheckWorkload {
            key,
            check: b.check_workload(&wl, &my_uuid, timeout),
        },
    }
}
