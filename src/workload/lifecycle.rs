//! A workload's life as one explicit state machine: one [`Phase`] per
//! workload and one pure transition function, [`step`], from `(phase, event, now)` to the next
//! phase and the actions the node must carry out. Every path that changes where a workload is —
//! a cancel, its supervisor ending, its group emptying, its logs drained, its uploads done, a
//! deadline passing — goes through [`step`], so no path has to re-derive the phase from flags.
//!
//! The phase is not written to disk by itself: it is derived again after a restart from what is
//! (the cancel record in `meta.json`, the supervisor's `exit.json`, the started identity), by
//! feeding the same events to [`step`].

use std::time::{Duration, Instant};

use super::shim::Exit;

/// The report of a workload whose supervisor died before it could record the exit (D27).
pub const SUPERVISOR_KILLED: &str = "workload's supervisor was killed; exit status unknown";

/// How long the rest of a workload's output may take to reach the backend before its
/// completion goes out anyway.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(60);

/// Where a workload is.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// Its process runs (or may: one re-adopted after a restart).
    Running,
    /// A cancel signal went to its group; what is left of it gets SIGKILL at `escalate_at`.
    Cancelling { escalate_at: Option<Instant> },
    /// Its supervisor ended while something of its group still runs: a killed supervisor
    /// (`exit` None, D27) or a cancelled group that is being cleared. Still running for capacity,
    /// `status` and `cancel`.
    Lingering {
        exit: Option<Exit>,
        cancelled: bool,
        escalate_at: Option<Instant>,
    },
    /// It ended; the rest of its output is being shipped until `until`.
    Draining {
        exit: Option<Exit>,
        lost: Option<&'static str>,
        until: Instant,
    },
    /// Its results are being uploaded (the progress is kept beside the phase).
    Uploading { exit: Option<Exit> },
    /// Reported (its completion is queued): nothing more happens to it.
    Done,
}

/// What happened to a workload.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A cancel signal was sent to its group; SIGKILL follows after `grace`.
    Cancelled { grace: Duration },
    /// Its supervisor ended; `exit` is its record (None: none was written); `group_alive` says
    /// whether something of the workload's group provably still runs.
    SupervisorEnded {
        exit: Option<Exit>,
        group_alive: bool,
    },
    /// Nothing of its group runs any more.
    GroupEmpty,
    /// It is known to have ended, but its outcome cannot be trusted or was never recorded
    /// (host rebooted, record rebuilt at recovery, …): reported as failed with `reason`.
    Lost {
        exit: Option<Exit>,
        reason: &'static str,
    },
    /// Time passed (deadlines).
    Tick,
    /// Every byte of its output reached the backend.
    LogsDrained,
    /// There are results to upload, and their upload began.
    UploadsBegun,
    /// Its uploads are over (or there was nothing to upload).
    UploadsDone,
}

/// What the node must do after a transition.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// SIGKILL to what is provably left of its group.
    KillGroup,
    /// Ship what is left of its output now.
    ShipLogs,
    /// Look for its results and begin their upload (answer with `UploadsBegun` or
    /// `UploadsDone`).
    StartUploads,
    /// Queue its completion (with the exit record, or the reason it was lost).
    Report {
        exit: Option<Exit>,
        lost: Option<&'static str>,
    },
}

impl Phase {
    /// Nothing of it runs any more: it waits for its logs, uploads or report, and is never
    /// signalled again (D26). A lingering group is not finished (D25, D27).
    pub fn finished(&self) -> bool {
        matches!(
            self,
            Phase::Draining { .. } | Phase::Uploading { .. } | Phase::Done
        )
    }

    /// A cancel was sent and is still under way.
    pub fn cancelling(&self) -> bool {
        matches!(
            self,
            Phase::Cancelling { .. }
                | Phase::Lingering {
                    cancelled: true,
                    ..
                }
        )
    }

    /// What `status` shows.
    pub fn label(&self) -> &'static str {
        match self {
            Phase::Cancelling { .. }
            | Phase::Lingering {
                cancelled: true, ..
            } => "cancelling",
            Phase::Running | Phase::Lingering { .. } => "running",
            Phase::Draining { .. } => "finishing",
            Phase::Uploading { .. } | Phase::Done => "finalizing",
        }
    }

    /// The next moment this phase has something due (a deadline), if any.
    pub fn deadline(&self) -> Option<Instant> {
        match self {
            Phase::Cancelling { escalate_at } | Phase::Lingering { escalate_at, .. } => {
                *escalate_at
            }
            Phase::Draining { until, .. } => Some(*until),
            _ => None,
        }
    }
}

/// The one transition function. Pairs that cannot happen, or that change nothing, leave the
/// phase as it is with no action (never a panic).
pub fn step(phase: &Phase, event: Event, now: Instant) -> (Phase, Vec<Action>) {
    let same = || (phase.clone(), Vec::new());
    match event {
        Event::Cancelled { grace } => on_cancel(phase, grace, now).unwrap_or_else(same),
        Event::Tick => on_tick(phase, now).unwrap_or_else(same),
        Event::SupervisorEnded { exit, group_alive } => {
            on_supervisor_ended(phase, exit, group_alive, now).unwrap_or_else(same)
        }
        Event::Lost { exit, reason } => match phase {
            Phase::Running | Phase::Cancelling { .. } | Phase::Lingering { .. } => {
                drain(exit, Some(reason), now)
            }
            _ => same(),
        },
        // What lingered is gone.
        Event::GroupEmpty => match phase {
            Phase::Lingering { exit, .. } => {
                let lost = exit.is_none().then_some(SUPERVISOR_KILLED);
                drain(exit.clone(), lost, now)
            }
            _ => same(),
        },
        // The logs are shipped.
        Event::LogsDrained => match phase {
            Phase::Draining { exit, lost, .. } => settle(exit, *lost),
            _ => same(),
        },
        // Uploads.
        Event::UploadsBegun => same(),
        Event::UploadsDone => match phase {
            Phase::Uploading { exit } => (
                Phase::Done,
                vec![Action::Report {
                    exit: exit.clone(),
                    lost: None,
                }],
            ),
            _ => same(),
        },
    }
}

/// The logs are shipped before the end is reported, at most until [`DRAIN_LIMIT`].
fn drain(exit: Option<Exit>, lost: Option<&'static str>, now: Instant) -> (Phase, Vec<Action>) {
    (
        Phase::Draining {
            exit,
            lost,
            until: now.checked_add(DRAIN_LIMIT).unwrap_or(now),
        },
        vec![Action::ShipLogs],
    )
}

/// A cancel: only a running workload is signalled, and a second cancel keeps the first
/// deadline (the node does not send one; if it reports one anyway, nothing changes).
fn on_cancel(phase: &Phase, grace: Duration, now: Instant) -> Option<(Phase, Vec<Action>)> {
    let escalate_at = Some(now.checked_add(grace).unwrap_or(now));
    match phase {
        Phase::Running => Some((Phase::Cancelling { escalate_at }, Vec::new())),
        Phase::Lingering {
            exit,
            cancelled: false,
            ..
        } => Some((
            Phase::Lingering {
                exit: exit.clone(),
                cancelled: true,
                escalate_at,
            },
            Vec::new(),
        )),
        _ => None,
    }
}

/// Escalation deadlines, and the drain's time limit.
fn on_tick(phase: &Phase, now: Instant) -> Option<(Phase, Vec<Action>)> {
    match phase {
        Phase::Cancelling {
            escalate_at: Some(t),
        } if now >= *t => Some((
            Phase::Cancelling { escalate_at: None },
            vec![Action::KillGroup],
        )),
        Phase::Lingering {
            exit,
            cancelled,
            escalate_at: Some(t),
        } if now >= *t => Some((
            Phase::Lingering {
                exit: exit.clone(),
                cancelled: *cancelled,
                escalate_at: None,
            },
            vec![Action::KillGroup],
        )),
        Phase::Draining { exit, lost, until } if now >= *until => Some(settle(exit, *lost)),
        _ => None,
    }
}

/// The supervisor ended: what it left of the group lingers, else the logs are drained.
fn on_supervisor_ended(
    phase: &Phase,
    exit: Option<Exit>,
    group_alive: bool,
    now: Instant,
) -> Option<(Phase, Vec<Action>)> {
    let (cancelled, escalate_at) = match phase {
        Phase::Running => (false, None),
        Phase::Cancelling { escalate_at } => (true, *escalate_at),
        _ => return None,
    };
    if group_alive {
        return Some((
            Phase::Lingering {
                exit,
                cancelled,
                escalate_at,
            },
            Vec::new(),
        ));
    }
    let lost = exit.is_none().then_some(SUPERVISOR_KILLED);
    Some(drain(exit, lost, now))
}

/// After the drain: a lost workload is reported at once; one that ended is checked for results.
fn settle(exit: &Option<Exit>, lost: Option<&'static str>) -> (Phase, Vec<Action>) {
    match lost {
        Some(l) => (
            Phase::Done,
            vec![Action::Report {
                exit: exit.clone(),
                lost: Some(l),
            }],
        ),
        None => (
            Phase::Uploading { exit: exit.clone() },
            vec![Action::StartUploads],
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(code: i32) -> Option<Exit> {
        Some(Exit {
            exit_code: Some(code),
            signal: None,
            started_at: String::new(),
            ended_at: String::new(),
        })
    }

    /// A fake clock in milliseconds.
    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    fn phases(t0: Instant) -> Vec<Phase> {
        vec![
            Phase::Running,
            Phase::Cancelling {
                escalate_at: Some(at(t0, 1000)),
            },
            Phase::Cancelling { escalate_at: None },
            Phase::Lingering {
                exit: None,
                cancelled: false,
                escalate_at: None,
            },
            Phase::Lingering {
                exit: exit(0),
                cancelled: true,
                escalate_at: Some(at(t0, 1000)),
            },
            Phase::Draining {
                exit: exit(3),
                lost: None,
                until: at(t0, 60_000),
            },
            Phase::Draining {
                exit: None,
                lost: Some(SUPERVISOR_KILLED),
                until: at(t0, 60_000),
            },
            Phase::Uploading { exit: exit(0) },
            Phase::Done,
        ]
    }

    fn events() -> Vec<Event> {
        vec![
            Event::Cancelled {
                grace: Duration::from_millis(500),
            },
            Event::SupervisorEnded {
                exit: exit(0),
                group_alive: false,
            },
            Event::SupervisorEnded {
                exit: exit(0),
                group_alive: true,
            },
            Event::SupervisorEnded {
                exit: None,
                group_alive: true,
            },
            Event::SupervisorEnded {
                exit: None,
                group_alive: false,
            },
            Event::GroupEmpty,
            Event::Lost {
                exit: exit(0),
                reason: "host rebooted",
            },
            Event::Tick,
            Event::LogsDrained,
            Event::UploadsBegun,
            Event::UploadsDone,
        ]
    }

    #[test]
    fn every_event_in_every_phase_at_every_moment_is_defined_and_keeps_the_invariants() {
        let t0 = Instant::now();
        for p in phases(t0) {
            for e in events() {
                for now in [
                    at(t0, 0),
                    at(t0, 999),
                    at(t0, 1000),
                    at(t0, 60_000),
                    at(t0, u64::from(u32::MAX)),
                ] {
                    let (next, actions) = step(&p, e.clone(), now);
                    // A finished workload never becomes unfinished, and is never signalled.
                    if p.finished() {
                        assert!(next.finished(), "{p:?} + {e:?} → {next:?}");
                        assert!(!actions.contains(&Action::KillGroup), "{p:?} + {e:?}");
                    }
                    // Done is final.
                    if p == Phase::Done {
                        assert_eq!((next.clone(), actions.len()), (Phase::Done, 0));
                    }
                    // A report happens exactly on the step into Done.
                    let reports = actions
                        .iter()
                        .filter(|a| matches!(a, Action::Report { .. }))
                        .count();
                    assert_eq!(
                        reports,
                        usize::from(next == Phase::Done && p != Phase::Done),
                        "{p:?} + {e:?} → {next:?}"
                    );
                    // Deadlines never lie in the past of the step that set them.
                    if let Some(d) = next.deadline() {
                        assert!(d >= now || Some(d) == p.deadline(), "{p:?} + {e:?}: {d:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_normal_life_runs_drains_uploads_and_reports_once() {
        let t0 = Instant::now();
        let (p, a) = step(
            &Phase::Running,
            Event::SupervisorEnded {
                exit: exit(0),
                group_alive: false,
            },
            at(t0, 5),
        );
        assert_eq!(a, vec![Action::ShipLogs]);
        assert_eq!(p.deadline(), Some(at(t0, 5) + DRAIN_LIMIT));
        assert_eq!(p.label(), "finishing");
        let (p, a) = step(&p, Event::LogsDrained, at(t0, 10));
        assert_eq!(
            (p.clone(), a),
            (
                Phase::Uploading { exit: exit(0) },
                vec![Action::StartUploads]
            )
        );
        assert_eq!(p.label(), "finalizing");
        let (p, a) = step(&p, Event::UploadsDone, at(t0, 20));
        assert_eq!(p, Phase::Done);
        assert_eq!(
            a,
            vec![Action::Report {
                exit: exit(0),
                lost: None
            }]
        );
    }

    #[test]
    fn logs_that_never_drain_give_way_at_the_drain_limit() {
        let t0 = Instant::now();
        let (p, _) = step(
            &Phase::Running,
            Event::SupervisorEnded {
                exit: exit(1),
                group_alive: false,
            },
            t0,
        );
        assert_eq!(step(&p, Event::Tick, at(t0, 59_999)).1, vec![]);
        assert_eq!(
            step(&p, Event::Tick, at(t0, 60_000)).1,
            vec![Action::StartUploads]
        );
    }

    #[test]
    fn a_cancel_escalates_once_on_its_first_deadline() {
        let t0 = Instant::now();
        let (p, _) = step(
            &Phase::Running,
            Event::Cancelled {
                grace: Duration::from_millis(2000),
            },
            t0,
        );
        assert_eq!(p.label(), "cancelling");
        // A second cancel changes nothing: the deadline is not pushed out.
        let (p2, a) = step(
            &p,
            Event::Cancelled {
                grace: Duration::from_secs(60),
            },
            at(t0, 1000),
        );
        assert_eq!((p2.clone(), a.len()), (p.clone(), 0));
        assert_eq!(step(&p2, Event::Tick, at(t0, 1999)).1, vec![]);
        let (p3, a) = step(&p2, Event::Tick, at(t0, 2000));
        assert_eq!(a, vec![Action::KillGroup]);
        assert_eq!(
            step(&p3, Event::Tick, at(t0, 9000)).1,
            vec![],
            "SIGKILL once"
        );
    }

    #[test]
    fn a_killed_supervisor_lingers_cancellable_and_is_reported_lost_when_its_group_is_empty() {
        let t0 = Instant::now();
        let (p, a) = step(
            &Phase::Running,
            Event::SupervisorEnded {
                exit: None,
                group_alive: true,
            },
            t0,
        );
        assert!(a.is_empty());
        assert!(!p.finished(), "D27: still running, still cancellable");
        assert_eq!(p.label(), "running");
        let (p, _) = step(
            &p,
            Event::Cancelled {
                grace: Duration::from_millis(100),
            },
            at(t0, 10),
        );
        assert_eq!(p.label(), "cancelling");
        assert_eq!(
            step(&p, Event::Tick, at(t0, 110)).1,
            vec![Action::KillGroup]
        );
        let (p, a) = step(&p, Event::GroupEmpty, at(t0, 200));
        assert_eq!(a, vec![Action::ShipLogs]);
        let (p, a) = step(&p, Event::LogsDrained, at(t0, 300));
        assert_eq!(p, Phase::Done);
        assert_eq!(
            a,
            vec![Action::Report {
                exit: None,
                lost: Some(SUPERVISOR_KILLED)
            }]
        );
    }

    #[test]
    fn an_exited_workload_is_finished_and_a_cancel_then_changes_nothing() {
        let t0 = Instant::now();
        for p in [
            Phase::Draining {
                exit: exit(0),
                lost: None,
                until: at(t0, 100),
            },
            Phase::Uploading { exit: exit(0) },
        ] {
            assert!(p.finished());
            let (n, a) = step(
                &p,
                Event::Cancelled {
                    grace: Duration::ZERO,
                },
                t0,
            );
            assert_eq!(
                (n, a.len()),
                (p, 0),
                "D29: no signal, the real outcome is reported"
            );
        }
    }
}
