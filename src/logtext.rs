//! Outside text in the node's own log lines (D31): escaped and cut, so a request id can neither
//! forge a log line nor carry terminal escapes.

/// `s` with control characters escaped (`\n`, `\u{1b}`, …) and cut to 200 characters with `…`.
pub fn shown(s: &str) -> String {
    const MAX: usize = 200;
    let mut out = String::new();
    for (n, c) in s.chars().enumerate() {
        if n >= MAX {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Lets a repeated error through once per [`Throttle::PERIOD`] (D28: a full disk is logged
/// once a minute, not once per attempt). Returns how many were held back since the last one.
#[derive(Debug, Default)]
pub struct Throttle {
    last: Option<std::time::Instant>,
    held: u64,
}

impl Throttle {
    pub const PERIOD: std::time::Duration = std::time::Duration::from_secs(60);

    /// `Some(held back)` when a line may be written now.
    pub fn ready(&mut self, now: std::time::Instant) -> Option<u64> {
        match self.last {
            Some(t) if now.saturating_duration_since(t) < Self::PERIOD => {
                self.held = self.held.saturating_add(1);
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.held))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_lets_one_line_a_minute_through_and_counts_the_rest() {
        let t0 = std::time::Instant::now();
        let mut t = Throttle::default();
        assert_eq!(t.ready(t0), Some(0));
        for ms in [1, 100, 59_999] {
            assert_eq!(t.ready(t0 + std::time::Duration::from_millis(ms)), None);
        }
        assert_eq!(t.ready(t0 + Throttle::PERIOD), Some(3));
        assert_eq!(t.ready(t0 + Throttle::PERIOD), None);
    }

    #[test]
    fn escapes_controls_and_cuts() {
        assert_eq!(shown("a\nb\u{1b}[31m\0"), "a\\nb\\u{1b}[31m\\u{0}");
        assert_eq!(shown("é"), "é");
        let long = shown(&"é".repeat(500));
        assert_eq!(long.chars().count(), 201);
        assert!(long.ends_with('…'));
    }
}
