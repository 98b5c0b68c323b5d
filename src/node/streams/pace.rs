//! When a running workload's stream sends: a pure decision over a fake-able
//! clock. New bytes go once the oldest unsent byte is [`WINDOW`] old (batching, like Nagle's
//! algorithm: a line alone goes after 250 ms, a burst of lines goes together), at most one
//! message per [`GAP`] (4 per second per stream), and within a byte budget: a bucket of
//! [`BUDGET_PER_INTERVAL`] refilled continuously at that much per stream interval, so a flood is
//! shipped at a steady pace (on average the budget per interval, at most a bucket more in any
//! one interval) while the file on disk stays complete. A workload that ended is not paced (its
//! rest goes as fast as the backend acknowledges it; see `Streams::end`).
//!
//! `CYBERWAVE_WORKLOAD_LOG_STREAM_INTERVAL` stays the upper bound: window and gap are never longer
//! than the interval (an interval of 0.1 s means up to 10 messages per second), and the budget
//! is counted per interval as before.

use std::time::{Duration, Instant};

use crate::util::later;

/// How long the first unsent byte waits for company.
pub const WINDOW: Duration = Duration::from_millis(250);
/// The least time between two messages of a stream (4 per second).
pub const GAP: Duration = Duration::from_millis(250);
/// Bytes a stream may ship per stream interval while its workload runs.
pub const BUDGET_PER_INTERVAL: u64 = 4 * 1024 * 1024;
/// The least a read asks for: a line up to this long is never cut in pieces, whatever the
/// budget says (the budget may then be overdrawn by up to this much, and is paid back).
pub const MIN_READ: u64 = 64 * 1024;

/// The rules of one node (from its stream interval).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rules {
    pub window: Duration,
    pub gap: Duration,
    pub budget: u64,
    pub interval: Duration,
}

impl Rules {
    pub fn new(interval: Duration) -> Rules {
        let interval = interval.max(Duration::from_millis(1));
        Rules {
            window: WINDOW.min(interval),
            gap: GAP.min(interval),
            budget: BUDGET_PER_INTERVAL,
            interval,
        }
    }

    /// How long the budget takes to earn `bytes`.
    fn earn_time(&self, bytes: u64) -> Duration {
        let nanos = u128::from(bytes)
            .saturating_mul(self.interval.as_nanos())
            .checked_div(u128::from(self.budget.max(1)))
            .unwrap_or(0);
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }
}

/// One stream's pace.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Pace {
    /// When the oldest byte not yet sent was first known to be there (`None`: nothing known).
    since: Option<Instant>,
    last_sent: Option<Instant>,
    /// The budget left (may be overdrawn by up to [`MIN_READ`]: then negative).
    tokens: i64,
    /// When `tokens` was last brought up to date (`None`: never; the budget starts full).
    filled: Option<Instant>,
}

impl Pace {
    /// New bytes were seen (or are known to be unsent) at `now`.
    pub fn unsent(&mut self, now: Instant) {
        self.since.get_or_insert(now);
    }

    /// Nothing is known to be waiting (everything was sent, or what is left is an unfinished
    /// line that waits for its end).
    pub fn caught_up(&mut self) {
        self.since = None;
    }

    pub fn waiting(&self) -> bool {
        self.since.is_some()
    }

    /// When the waiting bytes are to be read and sent: `None` when nothing waits.
    pub fn due(&self, r: &Rules) -> Option<Instant> {
        let since = self.since?;
        let mut t = later(since, r.window);
        if let Some(l) = self.last_sent {
            t = t.max(later(l, r.gap));
        }
        if let Some(f) = self.filled {
            let short = i128::from(MIN_READ).saturating_sub(i128::from(self.tokens));
            if short > 0 {
                let short = u64::try_from(short).unwrap_or(u64::MAX);
                t = t.max(later(f, r.earn_time(short)));
            }
        }
        Some(t)
    }

    /// How many bytes may be read and sent now (at least [`MIN_READ`] when anything may go at
    /// all; the caller asks only once [`Pace::due`] passed).
    pub fn allowance(&mut self, now: Instant, r: &Rules) -> u64 {
        self.refill(now, r);
        u64::try_from(self.tokens).unwrap_or(0).max(MIN_READ)
    }

    fn refill(&mut self, now: Instant, r: &Rules) {
        let budget = i64::try_from(r.budget).unwrap_or(i64::MAX);
        let Some(f) = self.filled else {
            self.tokens = budget;
            self.filled = Some(now);
            return;
        };
        let dt = now.saturating_duration_since(f).as_nanos();
        let earned = u128::from(r.budget)
            .saturating_mul(dt)
            .checked_div(r.interval.as_nanos().max(1))
            .unwrap_or(0);
        let earned = i64::try_from(earned).unwrap_or(i64::MAX);
        self.tokens = self.tokens.saturating_add(earned).min(budget);
        self.filled = Some(now);
    }

    /// A chunk of `bytes` was sent at `now`; `more`: bytes beyond it are known to wait already.
    pub fn sent(&mut self, now: Instant, bytes: u64, more: bool, r: &Rules) {
        self.refill(now, r);
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        self.tokens = self.tokens.saturating_sub(bytes);
        self.last_sent = Some(now);
        self.since = more.then_some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_lone_line_goes_after_the_window_and_a_burst_goes_together() {
        let r = Rules::new(Duration::from_secs(3));
        let t0 = Instant::now();
        let mut p = Pace::default();
        assert_eq!(p.due(&r), None, "nothing waits: no deadline, no wake-up");
        p.unsent(t0);
        assert_eq!(p.due(&r), Some(t0 + ms(250)));
        // More lines within the window do not move the deadline: they go with the first.
        p.unsent(t0 + ms(100));
        p.unsent(t0 + ms(240));
        assert_eq!(p.due(&r), Some(t0 + ms(250)));
        p.sent(t0 + ms(250), 300, false, &r);
        assert_eq!(p.due(&r), None);
        // A line long after the last message waits the window, not more.
        p.unsent(t0 + ms(5000));
        assert_eq!(p.due(&r), Some(t0 + ms(5250)));
    }

    #[test]
    fn at_most_four_messages_a_second_per_stream() {
        let r = Rules::new(Duration::from_secs(3));
        let t0 = Instant::now();
        let mut p = Pace::default();
        // Output every 10 ms for 10 s: count the messages the pace allows.
        let mut sent = Vec::new();
        let mut t = t0;
        while t < t0 + Duration::from_secs(10) {
            p.unsent(t);
            if p.due(&r).is_some_and(|d| d <= t) {
                let n = p.allowance(t, &r).min(1000);
                p.sent(t, n, false, &r);
                sent.push(t);
            }
            t += ms(10);
        }
        assert!(sent.windows(2).all(|w| w[1] - w[0] >= ms(250)), "{sent:?}");
        assert!(sent.len() >= 36 && sent.len() <= 40, "{}", sent.len());
        // The first line of the run waited the window, no more.
        assert_eq!(sent[0], t0 + ms(250));
    }

    #[test]
    fn the_interval_stays_the_upper_bound() {
        let r = Rules::new(ms(100));
        assert_eq!((r.window, r.gap), (ms(100), ms(100)));
        let t0 = Instant::now();
        let mut p = Pace::default();
        p.unsent(t0);
        assert_eq!(p.due(&r), Some(t0 + ms(100)));
        p.sent(t0 + ms(100), 10, true, &r);
        assert_eq!(
            p.due(&r),
            Some(t0 + ms(200)),
            "more waiting: the next after the gap"
        );
        let slow = Rules::new(Duration::from_secs(30));
        assert_eq!((slow.window, slow.gap), (WINDOW, GAP));
    }

    #[test]
    fn a_flood_is_shipped_within_the_budget_per_interval() {
        let r = Rules::new(Duration::from_secs(3));
        let t0 = Instant::now();
        let mut p = Pace::default();
        p.unsent(t0);
        let mut t = t0;
        let mut shipped = 0u64;
        let mut messages = 0u64;
        // Always more waiting (a flood); send whatever the pace allows, up to 1 MiB a message.
        while t < t0 + Duration::from_secs(30) {
            if let Some(d) = p.due(&r) {
                t = t.max(d);
                let n = p.allowance(t, &r).min(1 << 20);
                p.sent(t, n, true, &r);
                shipped += n;
                messages += 1;
            }
        }
        let per_interval = shipped as f64 / 10.0;
        // The first interval spends the full bucket; after that the refill rate rules.
        assert!(
            per_interval <= (BUDGET_PER_INTERVAL + BUDGET_PER_INTERVAL / 10 + MIN_READ) as f64,
            "{per_interval}"
        );
        assert!(
            per_interval >= BUDGET_PER_INTERVAL as f64 * 0.95,
            "{per_interval}"
        );
        // Messages stay big: far fewer per MiB than 64 KiB chunks (16 per MiB).
        let per_mib = messages as f64 / (shipped as f64 / (1 << 20) as f64);
        assert!(per_mib <= 4.0, "{per_mib} messages per MiB");
        // ...and never more than 4 a second.
        assert!(messages <= 4 * 30 + 1, "{messages}");
    }

    #[test]
    fn an_empty_budget_defers_the_next_message_until_a_read_is_earned() {
        let r = Rules::new(Duration::from_secs(4));
        let t0 = Instant::now();
        let mut p = Pace::default();
        p.unsent(t0);
        assert_eq!(p.allowance(t0, &r), BUDGET_PER_INTERVAL);
        p.sent(t0, BUDGET_PER_INTERVAL, true, &r);
        // 64 KiB of a 4 MiB-per-4-s budget take 62.5 ms, less than the gap: the gap rules.
        assert_eq!(p.due(&r), Some(t0 + ms(250)));
        // 256 KiB earned since, 1 MiB sent: overdrawn by 768 KiB. The next message waits until
        // 64 KiB are in hand again: 832 KiB to earn, 812.5 ms.
        p.sent(t0 + ms(250), 1 << 20, true, &r);
        let due = p.due(&r).unwrap();
        assert!(
            due >= t0 + ms(1062) && due <= t0 + ms(1063),
            "{:?}",
            due - t0
        );
        assert_eq!(p.allowance(due, &r), MIN_READ);
    }
}
