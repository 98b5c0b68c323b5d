//! Whether a start is taken: one pure decision ([`decide`]) over what the node knows (its
//! ledger, the workload running or starting for the request, its configuration, guards,
//! capacity and GPUs), unit-tested below with a fake clock. The loop gathers the facts and
//! carries out the decision (`start_path.rs`); nothing here does I/O.
//!
//! The order of the checks is the contract: exactly once first (the ledger, a running
//! workload, a start in flight), then what can never succeed here (no command configured),
//! then the guards (shutting down, draining, low disk), the spawner, GPUs (D36, before
//! capacity: with `auto`, a full node is a node without free GPUs), and capacity (D21).

use std::fmt;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::gpus::{GpuRefusal, Gpus, Holders};
use super::parts::{Busy, BUSY_PREFIX};
use crate::ledger::Ledger;
use crate::protocol::commands::{Kind, Seconds};

/// How long one self-heal lookup may take (the pass a busy start waits for, `selfheal.rs`).
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// SIGTERM → SIGKILL for a stale workload that a self-heal pass stops.
pub const STALE_GRACE: Duration = Duration::from_secs(5);

/// How long a busy start waits for a self-heal pass before it is answered: the pass's check,
/// the grace of what it stops, and a second.
pub fn defer_wait() -> Duration {
    CHECK_TIMEOUT
        .saturating_add(STALE_GRACE)
        .saturating_add(Duration::from_secs(1))
}

/// Why a start is refused. Its text ([`fmt::Display`]) is the reply's error, word for word what
/// backends have always seen; [`RejectReason::busy`] says whether it keeps the host-busy
/// contract (D13, D21).
#[derive(Debug, Clone, PartialEq)]
pub enum RejectReason {
    /// No command template for this type in cyberwave.yml: it can never run here.
    NotConfigured(Kind),
    ShuttingDown,
    Draining,
    DiskLow {
        free_mb: u64,
        min_mb: u64,
        state: String,
    },
    /// The disk the start writes its files to filled up while it wrote them (ENOSPC, of bytes
    /// or inodes, or EDQUOT): nothing of it is left, and it may be retried.
    DiskFull {
        state: String,
        why: String,
    },
    Gpus(GpuRefusal),
    Capacity {
        kind: Kind,
        used: usize,
        uploading: usize,
    },
    /// The start could not be carried out: the spawner is gone, no random bytes for the
    /// event token, the spawn failed.
    Failed {
        kind: String,
        why: String,
    },
    /// A start a node restart interrupted before its workload ran (D53), refused with the text
    /// recorded for it (the ledger keeps only the text): always retryable, [`Busy::Restarted`].
    Interrupted(String),
}

impl RejectReason {
    /// The "not now, not here" kind, when waiting or another node can help.
    pub fn busy(&self) -> Option<Busy> {
        match self {
            RejectReason::NotConfigured(_) | RejectReason::Failed { .. } => None,
            RejectReason::ShuttingDown => Some(Busy::ShuttingDown),
            RejectReason::Draining => Some(Busy::Draining),
            RejectReason::DiskLow { .. } | RejectReason::DiskFull { .. } => Some(Busy::DiskLow),
            RejectReason::Gpus(g) => g.busy(),
            RejectReason::Capacity { uploading, .. } => Some(if *uploading > 0 {
                Busy::Uploading
            } else {
                Busy::Capacity
            }),
            RejectReason::Interrupted(_) => Some(Busy::Restarted),
        }
    }

    /// The key it is counted under in the metrics' `rejections`.
    pub fn metric(&self) -> &'static str {
        match (self, self.busy()) {
            (_, Some(b)) => b.reason(),
            (RejectReason::NotConfigured(_), None) => "not_configured",
            (_, None) => "failed_to_start",
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectReason::NotConfigured(kind) => {
                let cap = match kind {
                    Kind::Inference => "Inference",
                    Kind::Simulate => "Simulate",
                    Kind::Training => "Training",
                };
                write!(f, "{cap} command not configured in cyberwave.yml")
            }
            RejectReason::ShuttingDown => write!(
                f,
                "{BUSY_PREFIX} shutting down: this node takes no new workloads"
            ),
            RejectReason::Draining => write!(
                f,
                "{BUSY_PREFIX} draining: it finishes its running workloads and takes no new ones"
            ),
            RejectReason::DiskLow {
                free_mb,
                min_mb,
                state,
            } => write!(
                f,
                "{BUSY_PREFIX} low disk space: not enough free disk: {free_mb} MiB free for {state}, min_free_disk_mb is {min_mb}"
            ),
            RejectReason::DiskFull { state, why } => write!(
                f,
                "{BUSY_PREFIX} low disk space: the disk of {state} is full (no space or no inodes left): {why}"
            ),
            RejectReason::Gpus(g) => g.fmt(f),
            RejectReason::Capacity {
                kind,
                used,
                uploading,
            } => {
                let what = if *kind == Kind::Inference {
                    "controller"
                } else {
                    "workload"
                };
                let detail = if *uploading > 0 {
                    format!(" ({uploading} uploading results)")
                } else {
                    String::new()
                };
                write!(
                    f,
                    "{BUSY_PREFIX} {used} active workload(s){detail}. Stop the existing {what} before starting a new one."
                )
            }
            RejectReason::Failed { kind, why } => write!(f, "Failed to start {kind}: {why}"),
            RejectReason::Interrupted(why) => f.write_str(why),
        }
    }
}

/// What a request asks for.
pub struct Ask<'a> {
    pub kind: Kind,
    /// The request id as the ledger keys it (never empty: an id is made up for none).
    pub rid: &'a str,
    pub gpus: Option<u32>,
    pub max_runtime: Option<Seconds>,
    /// False for a start that already waited for a self-heal pass: no second wait.
    pub may_wait: bool,
}

/// What the node knows when a start comes.
pub struct Facts<'a> {
    /// The `ok` output of the workload running for this request, if one is.
    pub running: Option<Value>,
    /// A start of this request is in flight.
    pub in_flight: bool,
    /// The command template for the requested type.
    pub template: Option<&'a str>,
    pub shutting_down: bool,
    pub draining: bool,
    /// `min_free_disk_mb` (0: no check) and the state dir it is checked for.
    pub min_free_disk_mb: u64,
    pub state: &'a Path,
    /// Free MiB of the state dir's disk; asked only when the check is on.
    pub free_mb: &'a dyn Fn(&Path) -> Option<u64>,
    /// Why the spawner is gone, if it is.
    pub spawner_gone: Option<&'a str>,
    /// `max_concurrent_workloads`.
    pub capacity: usize,
    /// Tracked workloads and starts in flight.
    pub used: usize,
    /// Of the tracked ones, those uploading results.
    pub uploading: usize,
    /// The manifest's `max_runtime_seconds`.
    pub manifest_limit: Option<Seconds>,
}

/// What the request already has.
#[derive(Debug, Clone, PartialEq)]
pub enum Earlier {
    /// The ledger's answer (exactly once).
    Answered { ok: bool, body: Value },
    /// Its workload runs: the start's `ok` output.
    Running(Value),
    /// Its start is in flight: the same answer once the spawn reports.
    InFlight,
}

/// The decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Replay(Earlier),
    Reject(RejectReason),
    /// Busy: wait until `until` for a self-heal pass if one can be had, else `otherwise`.
    Defer {
        until: Instant,
        otherwise: RejectReason,
    },
    Spawn {
        template: String,
        gpus: Option<Vec<String>>,
        /// The shorter of the manifest's and the command's limits (D20).
        max_runtime_s: Option<f64>,
    },
}

/// The admission decision for one start, at `now` (a deferred start waits until a bound from
/// it: `wait` is [`defer_wait`]).
pub fn decide(
    ask: &Ask<'_>,
    facts: &Facts<'_>,
    ledger: &Ledger,
    gpus: &Gpus,
    held: &Holders,
    now: Instant,
    wait: Duration,
) -> Decision {
    if let Some(e) = ledger.get(ask.rid) {
        return Decision::Replay(Earlier::Answered {
            ok: e.ok,
            body: e.body.clone(),
        });
    }
    if let Some(out) = &facts.running {
        return Decision::Replay(Earlier::Running(out.clone()));
    }
    if facts.in_flight {
        return Decision::Replay(Earlier::InFlight);
    }
    let Some(template) = facts.template else {
        return Decision::Reject(RejectReason::NotConfigured(ask.kind));
    };
    if let Some(r) = guard(facts) {
        return Decision::Reject(r);
    }
    if let Some(gone) = facts.spawner_gone {
        return Decision::Reject(RejectReason::Failed {
            kind: ask.kind.as_str().into(),
            why: gone.into(),
        });
    }
    let until = now.checked_add(wait).unwrap_or(now);
    let assigned = match gpus.assign(ask.gpus, facts.capacity, held) {
        Ok(g) => g,
        Err(g) => {
            let busy = g.busy() == Some(Busy::GpusBusy);
            let otherwise = RejectReason::Gpus(g);
            return if busy && ask.may_wait {
                Decision::Defer { until, otherwise }
            } else {
                Decision::Reject(otherwise)
            };
        }
    };
    // Starts in flight count: they hold their place from the moment they are accepted.
    if facts.used >= facts.capacity {
        let otherwise = RejectReason::Capacity {
            kind: ask.kind,
            used: facts.used,
            uploading: facts.uploading,
        };
        return if ask.may_wait {
            Decision::Defer { until, otherwise }
        } else {
            Decision::Reject(otherwise)
        };
    }
    // Both limits are bounded (D20): the manifest's by the configuration, the command's by its
    // type; the shorter wins.
    let max_runtime_s = match (facts.manifest_limit, ask.max_runtime) {
        (Some(m), Some(p)) => Some(m.get().min(p.get())),
        (m, p) => m.or(p).map(Seconds::get),
    };
    Decision::Spawn {
        template: template.to_string(),
        gpus: assigned,
        max_runtime_s,
    }
}

/// The guards: shutting down, draining, not enough free disk.
fn guard(facts: &Facts<'_>) -> Option<RejectReason> {
    if facts.shutting_down {
        return Some(RejectReason::ShuttingDown);
    }
    if facts.draining {
        return Some(RejectReason::Draining);
    }
    let min = facts.min_free_disk_mb;
    if min > 0 {
        if let Some(free) = (facts.free_mb)(facts.state) {
            if free < min {
                return Some(RejectReason::DiskLow {
                    free_mb: free,
                    min_mb: min,
                    state: facts.state.display().to_string(),
                });
            }
        }
    }
    None
}

/// Whether a deferred start goes ahead now (to be decided again, without a second wait): once
/// there is room, once its time is up, or once nothing is left to wait for.
pub fn go_ahead(now: Instant, until: Instant, room: bool, undecided: bool) -> bool {
    room || now >= until || !undecided
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{Gpu, Health};
    use serde_json::json;

    /// The fake clock: a fixed instant and offsets from it.
    struct FakeClock(Instant);
    impl FakeClock {
        fn at(&self, ms: u64) -> Instant {
            self.0 + Duration::from_millis(ms)
        }
    }

    const WAIT: Duration = Duration::from_millis(31_000);

    fn no_disk(_: &Path) -> Option<u64> {
        None
    }

    fn facts<'a>() -> Facts<'a> {
        Facts {
            running: None,
            in_flight: false,
            template: Some("run {params}"),
            shutting_down: false,
            draining: false,
            min_free_disk_mb: 0,
            state: Path::new("/var/lib/cw"),
            free_mb: &no_disk,
            spawner_gone: None,
            capacity: 1,
            used: 0,
            uploading: 0,
            manifest_limit: None,
        }
    }

    fn ask(rid: &str) -> Ask<'_> {
        Ask {
            kind: Kind::Training,
            rid,
            gpus: None,
            max_runtime: None,
            may_wait: true,
        }
    }

    fn ledger(tag: &str) -> Ledger {
        let p = std::env::temp_dir().join(format!("cw-admit-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        Ledger::load(p)
    }

    fn gpu(uuid: &str, healthy: bool) -> Gpu {
        Gpu {
            index: "0".into(),
            uuid: uuid.into(),
            name: "H200".into(),
            bus_id: String::new(),
            memory_total_mib: None,
            memory_used_mib: None,
            util_pct: None,
            power_w: None,
            temperature_c: None,
            health: if healthy {
                Health::Healthy
            } else {
                Health::Unhealthy("hot".into())
            },
            parent: None,
            members: Vec::new(),
            shared: false,
        }
    }

    fn gpu_host(units: Vec<Gpu>) -> Gpus {
        Gpus {
            present: true,
            units,
            ..Gpus::default()
        }
    }

    fn run(a: &Ask<'_>, f: &Facts<'_>, l: &Ledger, g: &Gpus, h: &Holders) -> Decision {
        let clock = FakeClock(Instant::now());
        decide(a, f, l, g, h, clock.at(0), WAIT)
    }

    #[test]
    fn a_busy_start_waits_for_one_self_heal_pass_and_a_second() {
        assert_eq!(
            defer_wait(),
            CHECK_TIMEOUT + STALE_GRACE + Duration::from_secs(1)
        );
        assert_eq!(defer_wait(), Duration::from_secs(11));
    }

    #[test]
    fn a_request_seen_before_is_replayed_before_any_check() {
        let mut l = ledger("replay");
        l.record("r1", false, json!("refused before"));
        let f = Facts {
            shutting_down: true,
            template: None,
            ..facts()
        };
        let d = run(&ask("r1"), &f, &l, &Gpus::default(), &Holders::new());
        assert_eq!(
            d,
            Decision::Replay(Earlier::Answered {
                ok: false,
                body: json!("refused before")
            })
        );
        let running = Facts {
            running: Some(json!({"pid": 7})),
            ..facts()
        };
        let d = run(&ask("r2"), &running, &l, &Gpus::default(), &Holders::new());
        assert_eq!(d, Decision::Replay(Earlier::Running(json!({"pid": 7}))));
        let starting = Facts {
            in_flight: true,
            ..facts()
        };
        let d = run(&ask("r2"), &starting, &l, &Gpus::default(), &Holders::new());
        assert_eq!(d, Decision::Replay(Earlier::InFlight));
        let _ = std::fs::remove_file(
            std::env::temp_dir().join(format!("cw-admit-replay-{}", std::process::id())),
        );
    }

    #[test]
    fn refusals_come_in_order_with_their_reasons_and_texts() {
        let l = ledger("order");
        let none = Holders::new();
        let cpu = Gpus::default();
        let f = Facts {
            template: None,
            shutting_down: true,
            ..facts()
        };
        let d = run(&ask("r"), &f, &l, &cpu, &none);
        let Decision::Reject(r) = d else {
            panic!("{d:?}")
        };
        assert_eq!(r, RejectReason::NotConfigured(Kind::Training));
        assert_eq!(
            r.to_string(),
            "Training command not configured in cyberwave.yml"
        );
        assert_eq!((r.busy(), r.metric()), (None, "not_configured"));

        let f = Facts {
            shutting_down: true,
            draining: true,
            ..facts()
        };
        let r = RejectReason::ShuttingDown;
        assert_eq!(run(&ask("r"), &f, &l, &cpu, &none), Decision::Reject(r));

        let low = |_: &Path| Some(10);
        let f = Facts {
            min_free_disk_mb: 100,
            free_mb: &low,
            spawner_gone: Some("gone"),
            ..facts()
        };
        let Decision::Reject(r) = run(&ask("r"), &f, &l, &cpu, &none) else {
            panic!()
        };
        assert_eq!(r.busy(), Some(Busy::DiskLow));
        assert_eq!(
            r.to_string(),
            format!("{BUSY_PREFIX} low disk space: not enough free disk: 10 MiB free for /var/lib/cw, min_free_disk_mb is 100")
        );

        let f = Facts {
            spawner_gone: Some("the spawner stopped"),
            ..facts()
        };
        let Decision::Reject(r) = run(&ask("r"), &f, &l, &cpu, &none) else {
            panic!()
        };
        assert_eq!(
            r.to_string(),
            "Failed to start training: the spawner stopped"
        );
        assert_eq!((r.busy(), r.metric()), (None, "failed_to_start"));
    }

    #[test]
    fn a_full_node_defers_once_then_refuses_with_the_uploads_named() {
        let clock = FakeClock(Instant::now());
        let l = ledger("full");
        let f = Facts {
            used: 1,
            uploading: 1,
            ..facts()
        };
        let d = decide(
            &ask("r"),
            &f,
            &l,
            &Gpus::default(),
            &Holders::new(),
            clock.at(5),
            WAIT,
        );
        let otherwise = RejectReason::Capacity {
            kind: Kind::Training,
            used: 1,
            uploading: 1,
        };
        assert_eq!(
            d,
            Decision::Defer {
                until: clock.at(31_005),
                otherwise: otherwise.clone()
            }
        );
        assert_eq!(otherwise.busy(), Some(Busy::Uploading));
        assert_eq!(
            otherwise.to_string(),
            format!("{BUSY_PREFIX} 1 active workload(s) (1 uploading results). Stop the existing workload before starting a new one.")
        );
        // After its wait: no second one.
        let again = Ask {
            may_wait: false,
            ..ask("r")
        };
        let d = run(&again, &f, &l, &Gpus::default(), &Holders::new());
        assert_eq!(d, Decision::Reject(otherwise));
        // The deferred start goes ahead at its limit, or once there is room.
        assert!(!go_ahead(clock.at(31_004), clock.at(31_005), false, true));
        assert!(go_ahead(clock.at(31_005), clock.at(31_005), false, true));
        assert!(go_ahead(clock.at(10), clock.at(31_005), true, true));
        assert!(go_ahead(clock.at(10), clock.at(31_005), false, false));
    }

    #[test]
    fn gpus_are_assigned_before_capacity_and_held_ones_defer() {
        let l = ledger("gpus");
        let g = gpu_host(vec![gpu("GPU-a", true), gpu("GPU-b", false)]);
        let mut held = Holders::new();
        let d = run(&ask("r"), &facts(), &l, &g, &held);
        assert_eq!(
            d,
            Decision::Spawn {
                template: "run {params}".into(),
                gpus: Some(vec!["GPU-a".into()]),
                max_runtime_s: None
            }
        );
        held.insert("GPU-a".into(), json!("other"));
        let full = Facts { used: 1, ..facts() };
        let Decision::Defer { otherwise, .. } = run(&ask("r"), &full, &l, &g, &held) else {
            panic!()
        };
        assert_eq!(otherwise.busy(), Some(Busy::GpusBusy));
        assert_eq!(
            otherwise.to_string(),
            format!("{BUSY_PREFIX} GPUs in use: 1 needed, 0 of 1 healthy GPU(s) free")
        );
        // Two asked for, one healthy: unhealthy, not worth waiting for.
        let two = Ask {
            gpus: Some(2),
            ..ask("r")
        };
        let Decision::Reject(r) = run(&two, &facts(), &l, &g, &Holders::new()) else {
            panic!()
        };
        assert_eq!(r.metric(), "gpus_unhealthy");
        // A CPU-only node refuses a GPU request for good.
        let Decision::Reject(r) = run(&two, &facts(), &l, &Gpus::default(), &Holders::new()) else {
            panic!()
        };
        assert_eq!(r.busy(), None);
        assert_eq!(
            r.to_string(),
            "this workload needs 2 GPU(s) and this node has none (no nvidia-smi)"
        );
    }

    #[test]
    fn the_shorter_runtime_limit_wins() {
        let l = ledger("limit");
        let f = Facts {
            manifest_limit: Seconds::from_f64(60.0),
            ..facts()
        };
        let a = Ask {
            max_runtime: Seconds::from_f64(30.0),
            ..ask("r")
        };
        let Decision::Spawn { max_runtime_s, .. } =
            run(&a, &f, &l, &Gpus::default(), &Holders::new())
        else {
            panic!()
        };
        assert_eq!(max_runtime_s, Some(30.0));
        let Decision::Spawn { max_runtime_s, .. } =
            run(&ask("r"), &f, &l, &Gpus::default(), &Holders::new())
        else {
            panic!()
        };
        assert_eq!(max_runtime_s, Some(60.0));
    }

    #[test]
    fn an_interrupted_start_is_refused_as_busy_whatever_its_recorded_text() {
        for text in [
            format!("{BUSY_PREFIX} a restart"),
            "nope".into(),
            String::new(),
        ] {
            let r = RejectReason::Interrupted(text.clone());
            assert_eq!(r.busy(), Some(Busy::Restarted));
            assert_eq!(r.metric(), "node_restarted");
            assert_eq!(r.to_string(), text);
        }
    }
}
