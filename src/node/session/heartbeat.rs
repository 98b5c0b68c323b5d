//! The heartbeat part of the broker session: its state and every decision
//! about a heartbeat's reply, as pure functions of (state, reply, now). The loop carries out
//! the verdict (log lines, watchdog, re-registration, shutdown); the cadence, the 401 back-off,
//! the 404 re-registration and the failure alarm are unit-tested here with a fake clock.

use std::time::{Duration, Instant, SystemTime};

use crate::protocol::replies::Reply;

/// How many refused-token heartbeats in a row end the node (exit 3).
pub const MAX_AUTH_FAILURES: u32 = 5;
/// The longest wait between two heartbeats after a 401.
pub const AUTH_RETRY_CAP: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
pub struct Heartbeat {
    pub next_due: Option<Instant>,
    pub auth_failures: u32,
    pub failures: u32,
    pub last_ok: Option<SystemTime>,
}

/// What the loop does after a heartbeat's reply (or its timeout).
#[derive(Debug, Clone, PartialEq)]
pub enum HeartbeatVerdict {
    /// Acknowledged; `recovered` after failures (say so once). Feed the watchdog.
    Ok { recovered: bool },
    /// The token was refused (`n` in a row); the next beat is due after `delay`.
    AuthRetry { n: u32, delay: Duration },
    /// The token was refused `n` times in a row: shut down with exit 3.
    GiveUp { n: u32 },
    /// The instance is gone (D5): register a new one.
    Gone,
    /// Refused or unanswered (`n` in a row); `alarm` once the backend may reap the instance.
    Failed { n: u32, alarm: bool },
}

impl Heartbeat {
    /// Decides on one reply (`None`: no reply in time). `interval` is the heartbeat interval,
    /// `auth_base` the first wait after a 401 (doubling, at most [`AUTH_RETRY_CAP`]).
    pub fn on_reply(
        &mut self,
        reply: Option<&Reply>,
        now: Instant,
        interval: Duration,
        auth_base: Duration,
    ) -> HeartbeatVerdict {
        match reply {
            Some(b) if b.success => {
                let recovered = self.failures > 0 || self.auth_failures > 0;
                self.failures = 0;
                self.auth_failures = 0;
                self.last_ok = Some(SystemTime::now());
                HeartbeatVerdict::Ok { recovered }
            }
            Some(b) if b.code == Some(401) => {
                self.auth_failures = self.auth_failures.saturating_add(1);
                let n = self.auth_failures;
                if n >= MAX_AUTH_FAILURES {
                    return HeartbeatVerdict::GiveUp { n };
                }
                let delay = auth_base
                    .saturating_mul(2u32.saturating_pow(n.saturating_sub(1)))
                    .min(AUTH_RETRY_CAP);
                self.next_due = now.checked_add(delay).or(Some(now));
                HeartbeatVerdict::AuthRetry { n, delay }
            }
            Some(b) if b.instance_gone() => {
                *self = Heartbeat {
                    last_ok: self.last_ok,
                    ..Heartbeat::default()
                };
                HeartbeatVerdict::Gone
            }
            _ => {
                self.failures = self.failures.saturating_add(1);
                // About two minutes of failures: what the backend waits before reaping.
                let threshold =
                    u32::try_from(120u64.checked_div(interval.as_secs()).unwrap_or(120).max(1))
                        .unwrap_or(u32::MAX);
                HeartbeatVerdict::Failed {
                    n: self.failures,
                    alarm: self.failures >= threshold,
                }
            }
        }
    }
}

/// When the next heartbeat is due (D39): `interval` ± up to 10 %, placed by `random` (uniform
/// over all u64), so a fleet started together does not beat in the same instant. Integer
/// arithmetic: the due time is always in [0.9 × interval, 1.1 × interval). `None` only if the
/// moment is beyond what the clock can hold.
pub fn beat_due(now: Instant, interval: Duration, random: u64) -> Option<Instant> {
    let nanos = interval.as_nanos();
    let spread = nanos / 10;
    // random / 2^64 of the whole band (2 × spread), from its low end.
    let offset = spread
        .checked_mul(2)?
        .checked_mul(u128::from(random))?
        .checked_shr(64)?;
    let after = nanos.checked_sub(spread)?.checked_add(offset)?;
    let secs = u64::try_from(after / 1_000_000_000).ok()?;
    let sub = u32::try_from(after % 1_000_000_000).ok()?;
    now.checked_add(Duration::new(secs, sub))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn reply(v: serde_json::Value) -> Reply {
        Reply::from_value(v)
    }

    fn ms(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn a_refused_token_backs_off_doubling_to_the_cap_and_gives_up_at_five() {
        let t0 = Instant::now();
        let mut hb = Heartbeat::default();
        let r401 = reply(json!({"success": false, "code": 401}));
        let base = Duration::from_millis(2000);
        let mut delays = Vec::new();
        for i in 0..4u64 {
            match hb.on_reply(Some(&r401), ms(t0, i * 10), Duration::from_secs(30), base) {
                HeartbeatVerdict::AuthRetry { n, delay } => {
                    assert_eq!(n, u32::try_from(i + 1).unwrap());
                    assert_eq!(hb.next_due, Some(ms(t0, i * 10) + delay));
                    delays.push(delay.as_millis());
                }
                v => panic!("{v:?}"),
            }
        }
        assert_eq!(delays, vec![2000, 4000, 8000, 16000]);
        assert_eq!(
            hb.on_reply(Some(&r401), ms(t0, 50), Duration::from_secs(30), base),
            HeartbeatVerdict::GiveUp { n: 5 }
        );
        // The cap holds for a large base.
        let mut hb = Heartbeat::default();
        let v = hb.on_reply(
            Some(&r401),
            t0,
            Duration::from_secs(30),
            Duration::from_secs(3600),
        );
        assert_eq!(
            v,
            HeartbeatVerdict::AuthRetry {
                n: 1,
                delay: AUTH_RETRY_CAP
            }
        );
    }

    #[test]
    fn an_acknowledgement_resets_the_counts_and_says_it_recovered_once() {
        let t0 = Instant::now();
        let mut hb = Heartbeat::default();
        let i = Duration::from_secs(30);
        let b = Duration::from_secs(2);
        hb.on_reply(None, t0, i, b);
        hb.on_reply(Some(&reply(json!({"code": 401}))), t0, i, b);
        let ok = reply(json!({"success": true}));
        assert_eq!(
            hb.on_reply(Some(&ok), t0, i, b),
            HeartbeatVerdict::Ok { recovered: true }
        );
        assert_eq!((hb.failures, hb.auth_failures), (0, 0));
        assert!(hb.last_ok.is_some());
        assert_eq!(
            hb.on_reply(Some(&ok), t0, i, b),
            HeartbeatVerdict::Ok { recovered: false }
        );
    }

    #[test]
    fn a_gone_instance_means_a_new_registration_with_counts_reset() {
        let t0 = Instant::now();
        let mut hb = Heartbeat {
            next_due: Some(ms(t0, 5)),
            auth_failures: 2,
            failures: 3,
            last_ok: Some(SystemTime::UNIX_EPOCH),
        };
        let i = Duration::from_secs(30);
        for gone in [
            json!({"code": 404, "message": "instance not found"}),
            json!({"code": 400, "message": "Instance was terminated"}),
        ] {
            hb.failures = 3;
            assert_eq!(
                hb.on_reply(Some(&reply(gone)), t0, i, i),
                HeartbeatVerdict::Gone
            );
            assert_eq!((hb.next_due, hb.failures, hb.auth_failures), (None, 0, 0));
            assert_eq!(hb.last_ok, Some(SystemTime::UNIX_EPOCH), "kept for status");
        }
        // A 400 about something else is an ordinary failure.
        let v = hb.on_reply(
            Some(&reply(json!({"code": 400, "message": "bad"}))),
            t0,
            i,
            i,
        );
        assert!(matches!(v, HeartbeatVerdict::Failed { n: 1, alarm: false }));
    }

    #[test]
    fn failures_raise_the_alarm_after_about_two_minutes_of_beats() {
        let t0 = Instant::now();
        for (interval_s, alarm_at) in [(30u64, 4u32), (1, 120), (0, 120), (600, 1)] {
            let mut hb = Heartbeat::default();
            let i = Duration::from_secs(interval_s);
            let mut first_alarm = None;
            for n in 1..=130u32 {
                if let HeartbeatVerdict::Failed { alarm: true, .. } = hb.on_reply(None, t0, i, i) {
                    first_alarm.get_or_insert(n);
                }
            }
            assert_eq!(first_alarm, Some(alarm_at), "interval {interval_s}s");
        }
    }

    #[test]
    fn heartbeats_keep_their_cadence_within_ten_percent() {
        // The cadence itself (D39) is `beat_due`; a fake clock over a thousand beats.
        let t0 = Instant::now();
        let interval = Duration::from_millis(30_000);
        let mut now = t0;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1000 {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let due = beat_due(now, interval, seed).unwrap();
            let gap = due - now;
            assert!(gap >= Duration::from_millis(27_000) && gap < Duration::from_millis(33_000));
            now = due;
        }
        let mean = (now - t0) / 1000;
        assert!(mean > Duration::from_millis(29_000) && mean < Duration::from_millis(31_000));
    }

    #[test]
    fn heartbeats_spread_within_ten_percent_of_the_interval() {
        let now = Instant::now();
        let i = Duration::from_secs(30);
        let at = |r| beat_due(now, i, r).unwrap() - now;
        // The ends and the middle of the random range.
        assert_eq!(at(0), Duration::from_secs(27));
        assert_eq!(at(1u64 << 63), Duration::from_secs(30));
        let top = at(u64::MAX);
        assert!(
            top < Duration::from_secs(33) && top > Duration::from_millis(32_999),
            "{top:?}"
        );
        // Every random value lands inside the band, and the band is used (not one phase).
        let mut seen = std::collections::BTreeSet::new();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let d = at(x);
            assert!(
                d >= Duration::from_secs(27) && d < Duration::from_secs(33),
                "{d:?}"
            );
            seen.insert(d.as_millis() / 600);
        }
        assert_eq!(
            seen.len(),
            10,
            "10 bands of 600 ms between 27 s and 33 s: {seen:?}"
        );
    }

    #[test]
    fn heartbeat_spread_survives_extreme_intervals() {
        let now = Instant::now();
        assert_eq!(beat_due(now, Duration::ZERO, 12345), Some(now));
        let tiny = beat_due(now, Duration::from_nanos(1), u64::MAX).unwrap();
        assert!(tiny - now <= Duration::from_nanos(2));
        // Beyond the clock: no due time rather than a panic.
        assert_eq!(beat_due(now, Duration::MAX, u64::MAX), None);
    }
}
