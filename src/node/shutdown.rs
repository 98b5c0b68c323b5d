//! Signals and shutdown: SIGTERM/SIGINT begin it (a second one exits at once), the goodbye to
//! the backend (R5) or the start-up failure (R6) ends it once answered or at its deadline; as
//! a container's main process the node first stops and reports its workloads (D58).

use std::time::Instant;

use serde_json::json;

use super::{container, Node, Op, EXIT_OK, EXIT_RUNTIME};
use crate::signals::Signal;
use crate::util;

pub(super) struct Shutdown {
    pub deadline: Instant,
    pub exit_code: i32,
    /// Correlation of the R5 (or R6) request whose reply ends the shutdown early.
    pub waiting_for: Option<Vec<u8>>,
    /// D58: a container's init waits for its stopped workloads' completions to be acknowledged
    /// before it says goodbye (R5), at most until `deadline`.
    pub stopping_workloads: bool,
}

impl Node {
    /// Registered after start-up failed: tell the backend (R6), then exit.
    pub(super) fn report_failed_start(&mut self, err: String) {
        let uuid = self.uuid().to_string();
        log::error!("reporting the start-up failure to the backend, then exiting");
        if self.s.standalone {
            return self.begin_shutdown(EXIT_RUNTIME, "start-up failed");
        }
        let topic = self.io.topics.fail(&uuid);
        let corr = self.request(
            Op::Fail,
            &topic,
            json!({"instance_uuid": uuid, "error": err}),
            self.s.tuning.heartbeat_timeout,
        );
        self.begin_shutdown(EXIT_RUNTIME, "start-up failed");
        if let Some(s) = &mut self.life.shutdown {
            s.waiting_for = Some(corr);
        }
    }

    // ---- signals and shutdown -------------------------------------------------------------------

    pub(super) fn on_signal(&mut self, sig: Signal) {
        match sig {
            Signal::Term | Signal::Int => {
                if self.life.shutdown.is_some() {
                    log::warn!("second {sig:?}: exiting now");
                    self.life.exit = Some(EXIT_OK);
                    return;
                }
                self.begin_shutdown(EXIT_OK, &format!("{sig:?} received"));
            }
            Signal::Hup => {
                log::info!("SIGHUP ignored (restart the service to reload the configuration)")
            }
            Signal::Usr1 => self.set_draining(true, "SIGUSR1"),
            Signal::Usr2 => self.set_draining(false, "SIGUSR2"),
        }
    }

    pub(super) fn begin_shutdown(&mut self, exit_code: i32, why: &str) {
        if self.life.shutdown.is_some() {
            return;
        }
        crate::systemd::notify("STOPPING=1");
        let now = self.io.clock.now();
        if container::is_init(&self.s.env) {
            // D58: its workloads die with the container; stop them and report them first.
            let grace = container::stop_grace(&self.s.env);
            let kill = container::kill_after(grace);
            let n = self.with_table(|t, out, now| t.cancel_all(container::REASON, kill, now, out));
            log::info!(
                "shutting down ({why}); as its container's main process the node stops its {n} running workload(s) (SIGTERM, SIGKILL after {:.1}s) and reports them before it exits, within {:.1}s",
                kill.as_secs_f64(),
                grace.as_secs_f64()
            );
            self.session.close();
            self.life.shutdown = Some(Shutdown {
                deadline: util::later(now, container::deadline_after(grace)),
                exit_code,
                waiting_for: None,
                stopping_workloads: true,
            });
            return;
        }
        log::info!("shutting down ({why}); running workloads are left running");
        self.log_running_workloads();
        self.session.close();
        self.say_goodbye(now, exit_code, None);
    }

    /// R5: the goodbye to the backend when there is one to hear it, then the shutdown's last
    /// stretch: until its reply or the flush time (at most `limit`), at once without a backend.
    pub(super) fn say_goodbye(&mut self, now: Instant, exit_code: i32, limit: Option<Instant>) {
        let waiting_for = if !self.session.registered()
            || !self.session.connected()
            || self.s.standalone
            || self.session.startup_failed()
        {
            None
        } else {
            let topic = self.io.topics.terminate(self.uuid());
            Some(self.request(
                Op::Terminate,
                &topic,
                json!({}),
                self.s.tuning.shutdown_flush,
            ))
        };
        let deadline = match (&waiting_for, limit) {
            (None, _) => now,
            (Some(_), None) => util::later(now, self.s.tuning.shutdown_flush),
            (Some(_), Some(l)) => util::later(now, self.s.tuning.shutdown_flush).min(l),
        };
        self.life.shutdown = Some(Shutdown {
            deadline,
            exit_code,
            waiting_for,
            stopping_workloads: false,
        });
    }

    /// D58: once every stopped workload's completion is out (acknowledged, or published when
    /// standalone), the goodbye (R5) goes out as in any shutdown, within the same deadline.
    pub(super) fn finish_stopping_workloads(&mut self) {
        let Some(s) = &self.life.shutdown else {
            return;
        };
        if !s.stopping_workloads || !self.active.is_empty() || !self.durable.outbox.is_empty() {
            return;
        }
        let (limit, exit_code) = (s.deadline, s.exit_code);
        log::info!("every workload of the container is reported; exiting");
        let now = self.io.clock.now();
        self.say_goodbye(now, exit_code, Some(limit));
    }
}
