//! Outside text in the node's own log lines (D31). Request ids, command names, file names,
//! workload and workflow ids and backend messages come from elsewhere: written raw, a newline in
//! one forges a log line, an ANSI/OSC escape rewrites the operator's terminal, and a NUL makes
//! the log "binary" to grep. [`shown`] writes such text escaped and cut; [`Escaped`] is the
//! logger's backstop for whole lines (every control character escaped, nothing cut).

use std::fmt::{self, Display, Write};

/// How many characters of one outside value a log line shows before `…`.
pub const MAX_CHARS: usize = 200;

/// Outside text as a log line shows it: control characters (and the invisible Unicode format
/// characters that reorder or hide text) escaped as `\n`, `\0`, `\u{1b}`, …, a backslash doubled
/// (so an escape cannot be faked), and cut after [`MAX_CHARS`] characters with `…`.
#[derive(Debug, Clone, Copy)]
pub struct Shown<'a>(pub &'a str);

/// `log::info!("command {} …", shown(&name))`.
pub fn shown(text: &str) -> Shown<'_> {
    Shown(text)
}

/// Like [`shown`] with another limit: at most `max` characters of `text`, escaped.
pub fn cut(text: &str, max: usize) -> String {
    let mut out = String::new();
    let _ = write_shown(&mut out, text, max);
    out
}

fn write_shown(f: &mut impl Write, text: &str, max: usize) -> fmt::Result {
    let mut chars = text.chars();
    for c in chars.by_ref().take(max) {
        if c == '\\' {
            f.write_str("\\\\")?;
        } else {
            escape_char(f, c)?;
        }
    }
    if chars.next().is_some() {
        f.write_char('…')?;
    }
    Ok(())
}

impl Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_shown(f, self.0, MAX_CHARS)
    }
}

/// How many characters of one whole log line the logger writes before `…`.
pub const MAX_LINE_CHARS: usize = 16 * 1024;

/// A whole log line with every control or format character escaped and cut after
/// [`MAX_LINE_CHARS`] characters (the logger's backstop for a call site that forgot [`shown`];
/// backslashes stay as they are, so text already passed through [`shown`] is not escaped twice).
#[derive(Debug, Clone, Copy)]
pub struct Escaped<'a>(pub &'a str);

impl Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.len() <= MAX_LINE_CHARS && !self.0.chars().any(needs_escape) {
            return f.write_str(self.0);
        }
        let mut chars = self.0.chars();
        for c in chars.by_ref().take(MAX_LINE_CHARS) {
            escape_char(f, c)?;
        }
        if chars.next().is_some() {
            f.write_char('…')?;
        }
        Ok(())
    }
}

/// True for characters a log line must never carry raw: C0/C1 controls and DEL, and the
/// Unicode format characters that reorder or hide text (bidi overrides, zero-width marks,
/// line and paragraph separators, the BOM).
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{2069}'
                | '\u{feff}'
        )
}

fn escape_char(f: &mut impl Write, c: char) -> fmt::Result {
    if !needs_escape(c) {
        return f.write_char(c);
    }
    match c {
        '\n' => f.write_str("\\n"),
        '\r' => f.write_str("\\r"),
        '\t' => f.write_str("\\t"),
        '\0' => f.write_str("\\0"),
        other => write!(f, "\\u{{{:x}}}", u32::from(other)),
    }
}

/// " (N more like it held back)" for a throttled log line.
pub fn held_note(held: u64) -> String {
    if held == 0 {
        String::new()
    } else {
        format!(" ({held} more like it in the last minute not logged)")
    }
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
    fn a_newline_cannot_forge_a_log_line() {
        let s = shown("x\n2026-11-30T00:00:00Z ERROR FORGED").to_string();
        assert_eq!(s, "x\\n2026-11-30T00:00:00Z ERROR FORGED");
        assert!(!s.contains('\n'));
    }

    #[test]
    fn escapes_ansi_osc_nul_del_c1_and_bidi() {
        let s = shown("a\u{1b}[31mred\u{1b}]0;title\u{7}\0\u{7f}\u{9b}\u{202e}\r\tz").to_string();
        assert_eq!(
            s,
            "a\\u{1b}[31mred\\u{1b}]0;title\\u{7}\\0\\u{7f}\\u{9b}\\u{202e}\\r\\tz"
        );
        assert!(!s.chars().any(needs_escape));
    }

    #[test]
    fn a_backslash_is_doubled_so_an_escape_cannot_be_faked() {
        assert_eq!(shown("a\\nb").to_string(), "a\\\\nb");
    }

    #[test]
    fn plain_unicode_is_kept() {
        assert_eq!(
            shown("héllo wörld ✓ 日本").to_string(),
            "héllo wörld ✓ 日本"
        );
        assert_eq!(shown("").to_string(), "");
    }

    #[test]
    fn cuts_after_200_characters_on_a_character_boundary() {
        let exact = "é".repeat(MAX_CHARS);
        assert_eq!(shown(&exact).to_string(), exact);
        let long = "é".repeat(MAX_CHARS + 1);
        let s = shown(&long).to_string();
        assert_eq!(s.chars().count(), MAX_CHARS + 1);
        assert!(s.ends_with("é…"));
        let huge = "\n".repeat(1 << 20);
        let s = shown(&huge).to_string();
        assert_eq!(s, format!("{}…", "\\n".repeat(MAX_CHARS)));
    }

    #[test]
    fn the_backstop_escapes_controls_but_not_backslashes() {
        assert_eq!(Escaped("plain \\ text").to_string(), "plain \\ text");
        assert_eq!(Escaped("a\nb\u{1b}c\0").to_string(), "a\\nb\\u{1b}c\\0");
        let once = shown("x\ny").to_string();
        assert_eq!(Escaped(&once).to_string(), once, "no double escaping");
        let huge = "a".repeat(MAX_LINE_CHARS + 1);
        assert_eq!(
            Escaped(&huge).to_string(),
            format!("{}…", "a".repeat(MAX_LINE_CHARS))
        );
        let exact = "é".repeat(MAX_LINE_CHARS);
        assert_eq!(Escaped(&exact).to_string(), exact);
    }
}
