//! The console mirror (D69): a workload's output as tagged lines, `[workload <tag> <stream>]
//! <line>`, on the node's stdout (workload stdout) or stderr (workload stderr), escaped for the
//! terminal ([`super::text::tag_lines`]), within a budget of bytes per second and stream: a
//! flood must not become a flood of the node's own output (journald and Docker's json-file keep
//! every byte the node writes). Past the budget a line is not printed; once a second the
//! console gets one line saying how many bytes were not. The log file and the stream keep them.

use std::time::{Duration, Instant};

use super::super::effect::Effect;
use super::text;
use super::MIRROR_PIECE;

/// How often the console hears how many bytes the budget kept from it.
pub const NOTE_EVERY: Duration = Duration::from_secs(1);

/// What one stream may print per second, and what it printed and held back.
#[derive(Debug, Clone)]
pub struct Budget {
    per_second: u64,
    /// The start of the current second, and what was printed in it.
    window: Option<Instant>,
    spent: u64,
    /// Bytes of output not printed since the last note.
    held: u64,
    /// When the console was last told (or the first byte was held since).
    noted: Option<Instant>,
}

impl Default for Budget {
    fn default() -> Budget {
        Budget::new(super::MIRROR_BYTES_PER_SECOND)
    }
}

impl Budget {
    pub fn new(per_second: u64) -> Budget {
        Budget {
            per_second,
            window: None,
            spent: 0,
            held: 0,
            noted: None,
        }
    }

    /// Whether a line that prints `cost` bytes (and used `used` bytes of the output) fits the
    /// second `now` is in; a line that does not is counted as held back.
    pub fn admit(&mut self, now: Instant, cost: u64, used: u64) -> bool {
        let fresh = self
            .window
            .is_none_or(|w| now.saturating_duration_since(w) >= Duration::from_secs(1));
        if fresh {
            self.window = Some(now);
            self.spent = 0;
        }
        if self.spent.saturating_add(cost) <= self.per_second {
            self.spent = self.spent.saturating_add(cost);
            return true;
        }
        if self.held == 0 && self.noted.is_none() {
            self.noted = Some(now); // the first note comes a second after the first byte held
        }
        self.held = self.held.saturating_add(used);
        false
    }

    /// When the next note is due (`None`: nothing held back).
    pub fn note_due(&self) -> Option<Instant> {
        if self.held == 0 {
            return None;
        }
        Some(
            self.noted
                .and_then(|t| t.checked_add(NOTE_EVERY))
                .unwrap_or_else(Instant::now),
        )
    }

    /// The bytes to tell the console of now (`force`: the stream ended, whatever the time).
    pub fn take_note(&mut self, now: Instant, force: bool) -> Option<u64> {
        let due = self.note_due()?;
        if !force && now < due {
            return None;
        }
        self.noted = Some(now);
        Some(std::mem::take(&mut self.held))
    }
}

/// The budget at one moment, as [`text::tag_lines`] asks it.
struct Within<'a> {
    budget: &'a mut Budget,
    now: Instant,
}

impl text::Gate for Within<'_> {
    fn admit(&mut self, cost: u64, used: u64) -> bool {
        self.budget.admit(self.now, cost, used)
    }
    fn charge(&mut self, extra: u64) {
        self.budget.spent = self.budget.spent.saturating_add(extra);
    }
}

/// The note line for `held` bytes.
pub fn note(prefix: &[u8], held: u64) -> Vec<u8> {
    let mut line = prefix.to_vec();
    line.extend_from_slice(
        format!("{held} bytes not mirrored (in the log file and the stream)\n").as_bytes(),
    );
    line
}

/// Writes `data` as tagged lines (see the module's comment). A line ends at `\n`, at `\r\n` or
/// at a lone `\r`; a line longer than [`MIRROR_PIECE`] is written in pieces of at most that
/// size, each tagged. What follows the last line end waits in `partial` (at most
/// [`MIRROR_PIECE`] bytes) unless `last` is set.
// Each argument is one thing a mirrored line needs; a struct of them would only rename them.
#[allow(clippy::too_many_arguments)]
pub fn mirror(
    prefix: &[u8],
    stream: usize,
    data: &[u8],
    last: bool,
    partial: &mut Vec<u8>,
    budget: &mut Budget,
    now: Instant,
    fx: &mut Vec<Effect>,
) {
    // No NUL byte reaches the console (D52): a short run inside text is dropped from it.
    let kept: Vec<u8>;
    let data = if data.contains(&0) {
        kept = data.iter().copied().filter(|b| *b != 0).collect();
        kept.as_slice()
    } else {
        data
    };
    let mut text = Vec::with_capacity(data.len().saturating_add(data.len() / 2).saturating_add(64));
    let mut gate = Within {
        budget: &mut *budget,
        now,
    };
    if partial.is_empty() {
        // The usual case (a chunk ends at a line end): no copy into `partial`.
        let used = text::tag_lines(prefix, data, last, MIRROR_PIECE, &mut text, &mut gate);
        partial.extend_from_slice(data.get(used..).unwrap_or_default());
    } else {
        partial.extend_from_slice(data);
        let used = text::tag_lines(prefix, partial, last, MIRROR_PIECE, &mut text, &mut gate);
        partial.drain(..used.min(partial.len()));
    }
    if let Some(held) = budget.take_note(now, last) {
        text.extend_from_slice(&note(prefix, held));
    }
    if !text.is_empty() {
        fx.push(Effect::Mirror { stream, text });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(t0: Instant, n: u64) -> Instant {
        t0 + Duration::from_millis(n)
    }

    /// D69: the budget with a fake clock: what fits a second is printed, the rest is counted,
    /// and the count is told once a second (or when the stream ends).
    #[test]
    fn d69_the_budget_prints_what_fits_a_second_and_counts_the_rest() {
        let t0 = Instant::now();
        let mut b = Budget::new(100);
        assert!(b.admit(t0, 60, 50));
        assert!(b.admit(ms(t0, 10), 40, 30));
        assert!(!b.admit(ms(t0, 20), 1, 1), "the second is spent");
        assert!(!b.admit(ms(t0, 500), 30, 25));
        assert_eq!(b.note_due(), Some(ms(t0, 1020)));
        assert_eq!(b.take_note(ms(t0, 900), false), None, "not yet");
        // A new second: room again.
        assert!(b.admit(ms(t0, 1000), 100, 90));
        assert!(!b.admit(ms(t0, 1001), 1, 7));
        assert_eq!(b.take_note(ms(t0, 1020), false), Some(33));
        assert_eq!(b.take_note(ms(t0, 1021), false), None, "nothing held since");
        assert!(
            !b.admit(ms(t0, 1500), 500, 400),
            "a line over the budget never fits"
        );
        assert_eq!(
            b.take_note(ms(t0, 1600), false),
            None,
            "a second after the last note"
        );
        assert_eq!(
            b.take_note(ms(t0, 1600), true),
            Some(400),
            "the stream ended"
        );
        assert_eq!(b.note_due(), None);
    }

    /// What went to the console.
    fn printed(console: &[Effect]) -> Vec<u8> {
        let mut out = Vec::new();
        for e in console {
            if let Effect::Mirror { text, .. } = e {
                out.extend_from_slice(text);
            }
        }
        out
    }

    /// What escaping adds counts too: a flood of bytes that print as `\xNN` (four times their
    /// size) is held to the budget as printed.
    #[test]
    fn d69_escaped_bytes_count_as_printed() {
        let t0 = Instant::now();
        let mut console = Vec::new();
        let mut budget = Budget::new(10_000);
        let mut line = vec![0xffu8; 999];
        line.push(b'\n');
        let flood = line.repeat(100);
        let mut partial = Vec::new();
        mirror(
            b"> ",
            0,
            &flood,
            false,
            &mut partial,
            &mut budget,
            t0,
            &mut console,
        );
        assert!(
            printed(&console).len() <= 10_000 + 4 * 1000,
            "{} bytes printed",
            printed(&console).len()
        );
        assert!(printed(&console).len() >= 4 * 1000);
    }

    /// D69: a flood of empty lines (a byte each, a tag each on the console) prints at most the
    /// budget per second, however many there are, and says how much it left out.
    #[test]
    fn d69_a_flood_of_newlines_is_not_amplified_past_the_budget() {
        let t0 = Instant::now();
        let mut console = Vec::new();
        let mut budget = Budget::new(64 * 1024);
        let prefix = b"[workload wl-1 stdout] ";
        let flood = vec![b'\n'; 10 << 20];
        let mut partial = Vec::new();
        for (i, chunk) in flood.chunks(512 * 1024).enumerate() {
            let now = ms(t0, i as u64 * 100); // 5 MiB/s for 2 s
            mirror(
                prefix,
                0,
                chunk,
                false,
                &mut partial,
                &mut budget,
                now,
                &mut console,
            );
        }
        mirror(
            prefix,
            0,
            b"",
            true,
            &mut partial,
            &mut budget,
            ms(t0, 2000),
            &mut console,
        );
        let out = String::from_utf8(printed(&console)).unwrap();
        assert!(
            out.len() <= 3 * 64 * 1024 + 200,
            "{} bytes printed",
            out.len()
        );
        let told: u64 = out
            .lines()
            .filter_map(|l| l.strip_prefix("[workload wl-1 stdout] "))
            .filter_map(|l| l.strip_suffix(" bytes not mirrored (in the log file and the stream)"))
            .map(|n| n.parse::<u64>().unwrap())
            .sum();
        let printed = out
            .lines()
            .filter(|l| *l == "[workload wl-1 stdout] ")
            .count() as u64;
        assert_eq!(told + printed, 10 << 20, "every byte is printed or counted");
        assert!(
            (2..=4).contains(&out.matches("not mirrored").count()),
            "{out}"
        );
    }
}
