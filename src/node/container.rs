//! The node as a container's main process (D58).
//!
//! As PID 1 of its PID namespace (or with `CYBERWAVE_NODE_INIT=1`) the node's workloads cannot
//! outlive it: when it exits the kernel kills everything in the namespace, and the backend would
//! never hear of them again. So there the node reaps every orphan (its reaper waits on any child,
//! and orphans are its children), says at start that its workloads end with it, and on SIGTERM
//! (`docker stop`: SIGKILL after a grace, 10 s by default) it stops its workloads itself —
//! SIGTERM, SIGKILL halfway through the grace — and gets each one's completion out (`cancelled`,
//! the container is stopping) before it exits, one second before the grace ends.

use std::time::Duration;

use crate::config::env::EnvLayers;

/// `docker stop`'s default grace.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(10);
/// The longest grace accepted (a day).
const MAX_STOP_GRACE_S: f64 = 86_400.0;
/// Why a workload stopped this way ended: its completion says so.
pub const REASON: &str = "the node's container is stopping";

/// Whether the node is its container's init: PID 1, or told so.
pub fn is_init(env: &EnvLayers) -> bool {
    std::process::id() == 1 || init_flag(env.value("CYBERWAVE_NODE_INIT").as_deref())
}

fn init_flag(v: Option<&str>) -> bool {
    matches!(
        v.map(|s| s.trim().to_ascii_lowercase()).as_deref(),
        Some("1" | "true" | "yes" | "on")
    )
}

/// `CYBERWAVE_NODE_STOP_GRACE_SECONDS` (default 10 s, like `docker stop`); a value that is not a
/// number of seconds from 1 to a day is ignored with the default.
pub fn stop_grace(env: &EnvLayers) -> Duration {
    grace_of(env.value("CYBERWAVE_NODE_STOP_GRACE_SECONDS").as_deref())
}

fn grace_of(v: Option<&str>) -> Duration {
    v.and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|g| g.is_finite() && (1.0..=MAX_STOP_GRACE_S).contains(g))
        .map_or(DEFAULT_STOP_GRACE, Duration::from_secs_f64)
}

/// When the stop must be over: one second before the grace ends (at least half of it).
pub fn deadline_after(grace: Duration) -> Duration {
    grace.saturating_sub(Duration::from_secs(1)).max(kill_after(grace))
}

/// After how long a stopped workload that ignored SIGTERM gets SIGKILL: half the grace.
pub fn kill_after(grace: Duration) -> Duration {
    grace.checked_div(2).unwrap_or(grace)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn d58_the_grace_is_docker_stops_unless_told_and_hostile_values_fall_back() {
        assert_eq!(grace_of(None), DEFAULT_STOP_GRACE);
        assert_eq!(grace_of(Some("30")), Duration::from_secs(30));
        assert_eq!(grace_of(Some(" 2.5 ")), Duration::from_millis(2500));
        for bad in [
            "", "0", "0.5", "-3", "nan", "inf", "1e300", "86401", "ten", "5s",
        ] {
            assert_eq!(grace_of(Some(bad)), DEFAULT_STOP_GRACE, "{bad:?}");
        }
        assert_eq!(
            deadline_after(Duration::from_secs(10)),
            Duration::from_secs(9)
        );
        assert_eq!(
            deadline_after(Duration::from_secs(1)),
            Duration::from_millis(500)
        );
        assert_eq!(kill_after(Duration::from_secs(10)), Duration::from_secs(5));
    }

    #[test]
    fn d58_init_mode_is_pid_1_or_an_explicit_yes() {
        for yes in ["1", "true", "YES", " on "] {
            assert!(init_flag(Some(yes)), "{yes:?}");
        }
        for no in ["", "0", "false", "no", "2", "init"] {
            assert!(!init_flag(Some(no)), "{no:?}");
        }
        assert!(!init_flag(None));
    }
}
