//! Worker threads for blocking HTTP: a small pool for result uploads (a PUT can take minutes;
//! two workloads that end together upload side by side, each its busy window alone), one
//! for short REST calls (self-heal lookups, upload fallbacks), so neither waits behind the other
//! and the event loop waits behind neither. Results come back as [`Done`] messages.

use std::time::Duration;

use crossbeam_channel::{unbounded, Sender};
use serde_json::Value;

use crate::backend::{self, Backend, BackendError, WorkloadCheck};

#[derive(Debug)]
pub enum Job {
    Put {
        key: String,
        /// Which of the workload's result files.
        file: usize,
        url: String,
        path: crate::store::Beneath,
        /// `Some(form file name)`: a multipart POST (decision D40) instead of a PUT.
        multipart: Option<String>,
        /// The workload's upload deadline (D68): the transfer is given up on by then.
        until: std::time::Instant,
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
        file: usize,
        result: Result<(), BackendError>,
    },
    SignedUrl {
        key: String,
        result: Result<backend::Attachment, BackendError>,
    },
    UploadResults {
        key: String,
        result: Result<(), BackendError>,
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

/// Upload threads by default, and the most `CYBERWAVE_NODE_UPLOAD_WORKERS` may ask for.
pub const DEFAULT_UPLOADERS: usize = 2;
pub const MAX_UPLOADERS: usize = 16;

/// `CYBERWAVE_NODE_UPLOAD_WORKERS`: a whole number from 1 to 16, else the default.
pub fn uploaders(value: Option<&str>) -> usize {
    value
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| (1..=MAX_UPLOADERS).contains(n))
        .unwrap_or(DEFAULT_UPLOADERS)
}

impl Workers {
    /// `uploaders` threads take transfers from one queue (in the order they were asked for);
    /// one thread takes the REST calls.
    pub fn start(
        backend: Backend,
        done: Sender<Done>,
        uploaders: usize,
    ) -> std::io::Result<Workers> {
        let spawn = |name: &str, threads: usize| -> std::io::Result<Sender<Job>> {
            let (tx, rx) = unbounded::<Job>();
            for _ in 0..threads.max(1) {
                let (b, d, rx) = (backend.clone(), done.clone(), rx.clone());
                std::thread::Builder::new()
                    .name(name.into())
                    .spawn(move || {
                        // Each worker keeps its own connections (per host) from one transfer to
                        // the next.
                        let agent = backend::transfer_agent();
                        for job in rx {
                            if d.send(run(&b, &agent, job)).is_err() {
                                return;
                            }
                        }
                    })?;
            }
            Ok(tx)
        };
        Ok(Workers {
            uploads: spawn("uploads", uploaders)?,
            http: spawn("http", 1)?,
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

fn run(b: &Backend, agent: &ureq::Agent, job: Job) -> Done {
    match job {
        Job::Put {
            key,
            file,
            url,
            path,
            multipart,
            until,
        } => {
            let left = until.saturating_duration_since(std::time::Instant::now());
            let result = if left.is_zero() {
                Err(BackendError::Transport(
                    "the workload's upload deadline passed before this transfer began".into(),
                ))
            } else {
                match multipart {
                    None => backend::put_file(agent, &url, &path, left),
                    Some(name) => b.post_multipart(agent, &url, &path, &name, left),
                }
            };
            Done::Put { key, file, result }
        }
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

#[cfg(test)]
mod tests {
    #[test]
    fn the_upload_pool_size_is_bounded_and_hostile_values_fall_back() {
        assert_eq!(super::uploaders(None), 2);
        assert_eq!(super::uploaders(Some(" 4 ")), 4);
        assert_eq!(super::uploaders(Some("16")), 16);
        for bad in ["0", "17", "-1", "x", "", "1e3", "99999999999999999999"] {
            assert_eq!(super::uploaders(Some(bad)), 2, "{bad:?}");
        }
    }
}
