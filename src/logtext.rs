//! Outside text in the node's own log lines (D31). Request ids, command names, file names,
//! workload and workflow ids and backend messages come from elsewhere: written raw, a newline in
//! one forges a log line, an ANSI/OSC escape rewrites the operator's terminal, and a NUL makes
//! the log "binary" to grep. [`shown`] writes such text escaped and cut; [`Escaped`] is the
//! logger's backstop for whole lines (every control character escaped, nothing cut).
//!
//! What a workload prints, and outside text in the CLI's output, reach the operator's terminal
//! through [`push_terminal`] (D69): control characters and bytes that are not UTF-8 as `\xNN`.

use std::borrow::Cow;
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

/// True for a character the operator's terminal must never get raw (D69): C0 controls but TAB
/// (so ESC, and every escape sequence with it), DEL, C1 controls, and the format characters
/// that reorder or hide text.
pub fn terminal_unsafe(c: char) -> bool {
    c != '\t' && needs_escape(c)
}

/// Appends `bytes` as the operator's terminal may show them (D69): valid UTF-8 as it is, but
/// control characters other than TAB (a newline too), DEL and C1 as `\xNN` (their code), the
/// format characters of [`needs_escape`] as `\u{XXXX}`, and every byte that is not UTF-8 as
/// `\xNN`. The output is valid UTF-8 without a control character but TAB.
pub fn push_terminal(out: &mut Vec<u8>, bytes: &[u8]) {
    for chunk in bytes.utf8_chunks() {
        let mut rest = chunk.valid();
        // A byte at or above 0x7f starts a character worth a look (DEL, C1, a format one).
        while let Some(i) = rest
            .bytes()
            .position(|b| (b < 0x20 && b != b'\t') || b >= 0x7f)
        {
            out.extend_from_slice(rest.get(..i).unwrap_or_default().as_bytes());
            let mut chars = rest.get(i..).unwrap_or_default().chars();
            if let Some(c) = chars.next() {
                if !terminal_unsafe(c) {
                    let mut b = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
                } else if let Ok(byte) = u8::try_from(u32::from(c)) {
                    push_hex(out, byte);
                } else {
                    out.extend_from_slice(format!("\\u{{{:04x}}}", u32::from(c)).as_bytes());
                }
            }
            rest = chars.as_str();
        }
        out.extend_from_slice(rest.as_bytes());
        for b in chunk.invalid() {
            push_hex(out, *b);
        }
    }
}

fn push_hex(out: &mut Vec<u8>, b: u8) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.extend_from_slice(b"\\x");
    out.push(HEX.get(usize::from(b >> 4)).copied().unwrap_or(b'0'));
    out.push(HEX.get(usize::from(b & 0xf)).copied().unwrap_or(b'0'));
}

/// One field of outside text in the CLI's output (a request id, a path, a state): as
/// [`push_terminal`] writes it, so a newline in it is `\x0a` and cannot forge a line.
pub fn terminal(text: &str) -> Cow<'_, str> {
    if !text.chars().any(terminal_unsafe) {
        return Cow::Borrowed(text);
    }
    let mut out = Vec::with_capacity(text.len().saturating_add(16));
    push_terminal(&mut out, text.as_bytes());
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

/// The CLI's backstop for whole outputs: every line of `text` as [`terminal`] writes it, the
/// newlines between them kept.
pub fn terminal_lines(text: &str) -> Cow<'_, str> {
    if !text.chars().any(|c| c != '\n' && terminal_unsafe(c)) {
        return Cow::Borrowed(text);
    }
    let lines: Vec<Cow<'_, str>> = text.split('\n').map(terminal).collect();
    Cow::Owned(lines.join("\n"))
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

    fn term(bytes: &[u8]) -> String {
        let mut out = Vec::new();
        push_terminal(&mut out, bytes);
        String::from_utf8(out).expect("always UTF-8")
    }

    /// D69, hostile input first: escape sequences of every kind, terminal queries, C1 controls,
    /// DEL, bytes that are not UTF-8 (alone, cut, overlong, surrogates) all become `\xNN`.
    #[test]
    fn d69_terminal_text_escapes_controls_and_invalid_utf8() {
        for (input, want) in [
            (&b"\x1b]0;owned\x07"[..], "\\x1b]0;owned\\x07"),
            (b"\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),
            (
                b"\x1b[6n\x1b[c\x1bP+q544e\x1b\\",
                "\\x1b[6n\\x1b[c\\x1bP+q544e\\x1b\\",
            ),
            (b"a\rb\nc\x00d\x7fe", "a\\x0db\\x0ac\\x00d\\x7fe"),
            ("\u{9b}31m\u{85}\u{80}".as_bytes(), "\\x9b31m\\x85\\x80"),
            (b"\xff\xfe", "\\xff\\xfe"),
            (b"cut \xe2\x82", "cut \\xe2\\x82"),
            (b"overlong \xc0\xaf", "overlong \\xc0\\xaf"),
            (b"surrogate \xed\xa0\x80", "surrogate \\xed\\xa0\\x80"),
            (b"\xc2", "\\xc2"),
            (
                "bidi \u{202e}x\u{2028}".as_bytes(),
                "bidi \\u{202e}x\\u{2028}",
            ),
            (b"tab\tkept", "tab\tkept"),
            ("plain é ✓ 日本 😀 █▌".as_bytes(), "plain é ✓ 日本 😀 █▌"),
            (b"", ""),
        ] {
            assert_eq!(term(input), want, "{}", String::from_utf8_lossy(input));
        }
        // Whatever the bytes, nothing raw is left.
        let every: Vec<u8> = (0..=255u8).collect();
        let out = term(&every);
        assert!(!out.chars().any(terminal_unsafe), "{out}");
        assert!(!out.contains('\u{fffd}'));
    }

    #[test]
    fn d69_cli_fields_and_whole_outputs() {
        assert_eq!(
            terminal("req\n2026 FORGED\x1b]2;t\x07"),
            "req\\x0a2026 FORGED\\x1b]2;t\\x07"
        );
        assert!(matches!(terminal("plain"), Cow::Borrowed(_)));
        assert_eq!(terminal_lines("a\x1b[2J\nb\tc\n"), "a\\x1b[2J\nb\tc\n");
        assert!(matches!(terminal_lines("line\nline\n"), Cow::Borrowed(_)));
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
