//! The text work of log streaming, written for speed (every byte of a flood passes here
//! twice): the chunk's JSON body, `log_content`, console tagging (escaped for the
//! terminal, D69), and cutting on character boundaries. Valid UTF-8 (the usual case) is checked once per chunk and then only
//! copied; line ends are found by `memchr` and characters that need escaping a word (8 bytes) at
//! a time.

use std::borrow::Cow;

/// The `log_content` of a chunk: its lines joined with `\n`, with no trailing newline
/// (R4 in docs/protocol.md), so the one line end a chunk stops at is left out. `offset` and `length`
/// still count the bytes of the file, that line end included, so the next chunk starts at
/// `offset + length`; a backend rebuilding the file by offset adds a `\n` wherever `length`
/// exceeds the content's bytes by one. Invalid UTF-8 becomes U+FFFD.
pub fn log_content(data: &[u8]) -> Cow<'_, str> {
    let data = data.strip_suffix(b"\n").unwrap_or(data);
    if data.contains(&0) {
        // No NUL byte is shipped (D52): a short run inside text is dropped from it.
        return Cow::Owned(String::from_utf8_lossy(data).replace('\0', ""));
    }
    match std::str::from_utf8(data) {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => String::from_utf8_lossy(data),
    }
}

const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;

/// Bytes of `w` equal to `b` have their high bit set (exact: no false positives).
fn eq_mask(w: u64, b: u8) -> u64 {
    let x = w ^ (LO.wrapping_mul(u64::from(b)));
    !(((x & !HI).wrapping_add(!HI)) | x) & HI
}

/// The first `\n` or `\r` in `bytes`.
pub fn find_eol(bytes: &[u8]) -> Option<usize> {
    memchr::memchr2(b'\n', b'\r', bytes)
}

/// The first byte that JSON must escape: a control character, `"` or `\`.
fn find_escape(bytes: &[u8]) -> Option<usize> {
    first_match(
        bytes,
        |v| {
            // Bytes below 0x20: (v - 0x20..) sets the high bit of a byte that was < 0x20 (or
            // that borrowed), `& !v` drops bytes that were ≥ 0x80; exact for the first such byte.
            let low = v.wrapping_sub(LO.wrapping_mul(0x20)) & !v & HI;
            low | eq_mask(v, b'"') | eq_mask(v, b'\\')
        },
        |b| b < 0x20 || b == b'"' || b == b'\\',
    )
}

/// The first byte `byte` picks, eight at a time: `word` gives a mask with the high bit set in
/// each matching byte of a little-endian word (exact for the lowest one).
fn first_match(
    bytes: &[u8],
    word: impl Fn(u64) -> u64,
    byte: impl Fn(u8) -> bool,
) -> Option<usize> {
    let mut words = bytes.chunks_exact(8);
    let mut at = 0usize;
    for w in words.by_ref() {
        let m = word(u64::from_le_bytes(w.try_into().unwrap_or([0; 8])));
        if m != 0 {
            return Some(at.saturating_add((m.trailing_zeros() / 8) as usize));
        }
        at = at.saturating_add(8);
    }
    words
        .remainder()
        .iter()
        .position(|b| byte(*b))
        .map(|p| at.saturating_add(p))
}

/// Appends `s` as a JSON string, escaped exactly as serde_json escapes it (`\"`, `\\`, `\b`,
/// `\f`, `\n`, `\r`, `\t`, other control characters as `\u00XX`; everything else as is).
pub fn push_json_str(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let mut rest = s.as_bytes();
    while let Some(p) = find_escape(rest) {
        let (run, tail) = rest.split_at(p);
        out.extend_from_slice(run);
        let Some((&b, tail)) = tail.split_first() else {
            break;
        };
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            _ => {
                out.extend_from_slice(b"\\u00");
                out.push(HEX.get(usize::from(b >> 4)).copied().unwrap_or(b'0'));
                out.push(HEX.get(usize::from(b & 0xf)).copied().unwrap_or(b'0'));
            }
        }
        rest = tail;
    }
    out.extend_from_slice(rest);
    out.push(b'"');
}

/// Where an install-log chunk that starts at `from` ends: after the last line end within
/// `chunk` bytes, else at `chunk` bytes back to a character boundary, else at the text's end.
pub fn install_chunk_end(text: &str, from: usize, chunk: usize) -> usize {
    let limit = from.saturating_add(chunk).min(text.len());
    if limit >= text.len() {
        return text.len();
    }
    let window = text.get(from..limit).unwrap_or_default();
    if let Some(p) = window.rfind('\n') {
        return from.saturating_add(p).saturating_add(1);
    }
    let mut end = limit;
    while end > from && !text.is_char_boundary(end) {
        end = end.saturating_sub(1);
    }
    if end == from {
        text.len()
    } else {
        end
    }
}

/// Appends the lines of `buf` to `out`, each as `prefix`, the line escaped for the terminal
/// ([`crate::logtext::push_terminal`], D69) and `\n`; returns how many bytes of `buf` were used.
/// A line ends at `\n`, at `\r\n`, or at a lone `\r` (a progress bar's redraw: one line of
/// its own, so that no text reaches the console without a tag); the empty line a redraw leaves
/// (`\r` at the start of a line) is dropped. A line over `piece` bytes is cut (on a character
/// boundary) into tagged pieces. Without `last`, an unfinished line (or a `\r` that may yet be
/// followed by `\n`) is left unused. `gate` says whether a line is printed (the mirror's
/// budget).
pub fn tag_lines(
    prefix: &[u8],
    buf: &[u8],
    last: bool,
    piece: usize,
    out: &mut Vec<u8>,
    gate: &mut dyn Gate,
) -> usize {
    let mut start = 0;
    loop {
        let rest = buf.get(start..).unwrap_or_default();
        if rest.is_empty() {
            return start;
        }
        let term = find_eol(
            rest.get(..piece.saturating_add(1).min(rest.len()))
                .unwrap_or(rest),
        );
        let line_len = term.unwrap_or(rest.len());
        let (len, used, redraw) = if line_len > piece {
            let cut = utf8_cut(rest, piece);
            (cut, cut, false)
        } else {
            match term.map(|p| (p, rest.get(p), rest.get(p.saturating_add(1)))) {
                Some((p, Some(b'\n'), _)) => (p, p.saturating_add(1), false),
                Some((p, _, Some(b'\n'))) => (p, p.saturating_add(2), false),
                Some((p, _, Some(_))) => (p, p.saturating_add(1), true),
                Some((p, _, None)) if last => (p, p.saturating_add(1), true),
                None if last => (rest.len(), rest.len(), false),
                _ => return start, // wait for the rest of the line
            }
        };
        start = start.saturating_add(used).min(buf.len());
        if redraw && len == 0 {
            continue;
        }
        let cost = (prefix.len() as u64)
            .saturating_add(len as u64)
            .saturating_add(1);
        if !gate.admit(cost, used as u64) {
            continue;
        }
        let before = out.len();
        out.extend_from_slice(prefix);
        crate::logtext::push_terminal(out, rest.get(..len).unwrap_or_default());
        out.push(b'\n');
        gate.charge((out.len().saturating_sub(before) as u64).saturating_sub(cost));
    }
}

/// What decides whether a line is printed (the mirror's budget).
pub trait Gate {
    /// Before the line is escaped: `cost`, the bytes it prints if nothing needs escaping (tag
    /// and line end included); `used`, the bytes of the output it stands for.
    fn admit(&mut self, cost: u64, used: u64) -> bool;
    /// After: what escaping added to a line that was admitted.
    fn charge(&mut self, extra: u64);
}

/// Every line printed.
pub struct Open;

impl Gate for Open {
    fn admit(&mut self, _: u64, _: u64) -> bool {
        true
    }
    fn charge(&mut self, _: u64) {}
}

/// The longest prefix of `bytes`, at most `max` long, that does not end inside a UTF-8
/// character (so a piece of text cut there reads back unchanged); never 0 for a non-empty
/// input.
pub fn utf8_cut(bytes: &[u8], max: usize) -> usize {
    let n = max.min(bytes.len());
    for back in 1..=3usize {
        let Some(idx) = n.checked_sub(back) else {
            return n;
        };
        let b = bytes.get(idx).copied().unwrap_or(0);
        if b & 0b1100_0000 == 0b1000_0000 {
            continue; // a continuation byte: look further back for the lead
        }
        let width: usize = match b {
            0xc0..=0xdf => 2,
            0xe0..=0xef => 3,
            0xf0..=0xf7 => 4,
            _ => 1,
        };
        return if idx > 0 && idx.saturating_add(width) > n {
            idx
        } else {
            n
        };
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK: usize = 64 * 1024;

    #[test]
    fn log_content_has_no_trailing_newline() {
        assert_eq!(log_content(b"a\nb\n"), "a\nb");
        assert_eq!(log_content(b"a\n\n"), "a\n", "an empty last line stays");
        assert_eq!(log_content(b"partial"), "partial");
        assert_eq!(log_content(b"\n"), "");
        assert_eq!(log_content(b"crlf\r\n"), "crlf\r");
        assert_eq!(log_content(b"bad \xff\n"), "bad \u{FFFD}");
        assert_eq!(log_content(b""), "");
        assert_eq!(log_content(b"a\0b\0\n"), "ab", "no NUL byte is shipped");
    }

    /// A small deterministic generator of awkward text.
    fn noise(seed: u64, n: usize) -> Vec<u8> {
        let mut x = seed | 1;
        let alphabet: &[&[u8]] = &[
            b"a",
            b"Z",
            b" ",
            b"\n",
            b"\r",
            b"\t",
            b"\"",
            b"\\",
            b"\x00",
            b"\x1f",
            b"\x7f",
            b"\x08",
            b"\x0c",
            "é".as_bytes(),
            "✓".as_bytes(),
            "😀".as_bytes(),
            b"\xff",
            b"/",
        ];
        let mut out = Vec::new();
        while out.len() < n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            out.extend_from_slice(alphabet[(x % alphabet.len() as u64) as usize]);
        }
        out
    }

    #[test]
    fn json_strings_are_escaped_exactly_as_serde_json_does() {
        for seed in 0..300u64 {
            let bytes = noise(seed, (seed as usize * 7) % 200);
            let text = String::from_utf8_lossy(&bytes);
            let mut mine = Vec::new();
            push_json_str(&mut mine, &text);
            assert_eq!(
                String::from_utf8(mine).unwrap(),
                serde_json::to_string(&text).unwrap(),
                "{text:?}"
            );
        }
        let mut all = Vec::new();
        let every: String = (0u8..0x80).map(char::from).collect();
        push_json_str(&mut all, &every);
        assert_eq!(all, serde_json::to_vec(&every).unwrap());
    }

    #[test]
    fn line_ends_are_found_anywhere_in_a_word() {
        for len in 0..40 {
            for at in 0..len {
                for eol in [b'\n', b'\r'] {
                    let mut v = vec![b'x'; len];
                    v[at] = eol;
                    if at + 3 < len {
                        v[at + 3] = b'\n';
                    }
                    assert_eq!(find_eol(&v), Some(at), "{len} {at}");
                }
            }
            assert_eq!(find_eol(&vec![0xffu8; len]), None);
        }
        // High bytes next to the searched ones never give a false match.
        assert_eq!(
            find_eol(&[0x8a, 0x8d, 0x0b, 0x0c, 0xff, 0x00, 0x0e, 0x09, 0x0a]),
            Some(8)
        );
    }

    #[test]
    fn install_chunks_end_at_line_ends_and_char_boundaries() {
        assert_eq!(install_chunk_end("short\ntext", 0, CHUNK), 10);
        let lines = "x".repeat(100) + "\n";
        let text = lines.repeat(1000); // 101 000 bytes
        let end = install_chunk_end(&text, 0, CHUNK);
        assert!(end <= CHUNK && text[..end].ends_with('\n'), "{end}");
        assert_eq!(install_chunk_end(&text, end, CHUNK), text.len());
        // One huge line of 3-byte characters: cut on a boundary, never mid-character.
        let wide = "\u{20ac}".repeat(30_000);
        let end = install_chunk_end(&wide, 0, CHUNK);
        assert!(end <= CHUNK && wide.is_char_boundary(end) && end > 0);
        assert_eq!(install_chunk_end(&wide, end, CHUNK), wide.len());
    }

    fn tag(buf: &[u8], last: bool, piece: usize, out: &mut Vec<u8>) -> usize {
        tag_lines(b"[T] ", buf, last, piece, out, &mut Open)
    }

    fn tagged(buf: &[u8], last: bool, piece: usize) -> (String, usize) {
        let mut out = Vec::new();
        let used = tag(buf, last, piece, &mut out);
        (String::from_utf8(out).unwrap(), used)
    }

    #[test]
    fn every_line_of_a_chunk_is_tagged_and_an_unfinished_one_waits() {
        assert_eq!(
            tagged(b"a\nb\n\nc", false, 100),
            ("[T] a\n[T] b\n[T] \n".into(), 5)
        );
        assert_eq!(tagged(b"c", true, 100), ("[T] c\n".into(), 1));
        assert_eq!(tagged(b"", true, 100), (String::new(), 0));
    }

    /// D69: what a workload prints reaches the console escaped, one tagged line per line.
    #[test]
    fn d69_escape_sequences_queries_and_invalid_utf8_reach_the_console_escaped() {
        assert_eq!(
            tagged(
                b"\x1b]0;pwned\x07\x1b[2J\x1b[6n\xff\xc3(\x00ok\n",
                false,
                100
            )
            .0,
            "[T] \\x1b]0;pwned\\x07\\x1b[2J\\x1b[6n\\xff\\xc3(\\x00ok\n"
        );
        assert_eq!(
            tagged("\u{9b}1;1H\u{85}é\tx\n".as_bytes(), false, 100).0,
            "[T] \\x9b1;1H\\x85é\tx\n"
        );
        // A backspace or a DEL cannot rub out the tag either.
        assert_eq!(
            tagged(b"\x08\x08\x08\x7fX\n", false, 100).0,
            "[T] \\x08\\x08\\x08\\x7fX\n"
        );
    }

    /// D69: a `\r`-ended redraw is one line; the empty line a redraw leaves is dropped.
    #[test]
    fn d69_a_redraw_is_one_line_and_its_empty_lines_are_dropped() {
        assert_eq!(
            tagged(b"10%\r20%\rforged\r\nx\n", false, 100),
            ("[T] 10%\n[T] 20%\n[T] forged\n[T] x\n".into(), 18)
        );
        // tqdm without a terminal: every redraw starts with \r.
        assert_eq!(
            tagged(b"\r 1%|#\r 2%|##\r\r\r\r100%|###\n", false, 100).0,
            "[T]  1%|#\n[T]  2%|##\n[T] 100%|###\n"
        );
        // An empty line ended by \n (or \r\n) is output, not a redraw: kept.
        assert_eq!(tagged(b"\n\r\n", false, 100).0, "[T] \n[T] \n");
        // A \r at the end of what was read may yet be followed by \n: it waits.
        assert_eq!(tagged(b"a\r", false, 100), (String::new(), 0));
        assert_eq!(tagged(b"a\r", true, 100), ("[T] a\n".into(), 2));
        assert_eq!(tagged(b"\r", true, 100), (String::new(), 1));
    }

    #[test]
    fn a_line_is_admitted_or_not_as_a_whole_and_charged_what_it_printed() {
        struct RecGate(Vec<(u64, u64)>, Vec<u64>);
        impl Gate for RecGate {
            fn admit(&mut self, cost: u64, used: u64) -> bool {
                self.0.push((cost, used));
                cost != 8
            }
            fn charge(&mut self, extra: u64) {
                self.1.push(extra);
            }
        }
        let mut gate = RecGate(Vec::new(), Vec::new());
        let mut out = Vec::new();
        let used = tag_lines(
            b"[T] ",
            b"one\ntwo\r\nthr\x1be\n",
            false,
            100,
            &mut out,
            &mut gate,
        );
        assert_eq!(used, 15);
        assert_eq!(gate.0, vec![(8, 4), (8, 5), (10, 6)]);
        assert_eq!(gate.1, vec![3], "\\x1b is 3 bytes more than ESC");
        assert_eq!(String::from_utf8(out).unwrap(), "[T] thr\\x1be\n");
    }

    #[test]
    fn a_line_split_across_chunks_is_written_once_with_one_tag() {
        let mut partial = Vec::new();
        let mut out = Vec::new();
        for part in [&b"hel"[..], b"lo wo", b"rld\nnext"] {
            partial.extend_from_slice(part);
            let used = tag(&partial, false, 100, &mut out);
            partial.drain(..used);
        }
        assert_eq!(String::from_utf8(out).unwrap(), "[T] hello world\n");
        assert_eq!(partial, b"next");
    }

    #[test]
    fn a_line_without_end_is_written_in_tagged_pieces_on_character_boundaries() {
        let text = "é".repeat(10); // 20 bytes
        let (out, used) = tagged(text.as_bytes(), false, 7);
        // 7 bytes would cut an é: pieces of 6; the last 2 bytes (under the piece size) wait.
        assert_eq!(out, "[T] ééé\n[T] ééé\n[T] ééé\n");
        assert_eq!(used, 18);
        let mut out = Vec::new();
        let mut partial = Vec::new();
        let big = vec![b'x'; 10 * CHUNK + 5];
        for c in big.chunks(CHUNK) {
            partial.extend_from_slice(c);
            let used = tag(&partial, false, CHUNK, &mut out);
            partial.drain(..used);
            assert!(partial.len() <= CHUNK, "what waits stays bounded");
        }
        let used = tag(&partial, true, CHUNK, &mut out);
        assert_eq!(used, partial.len());
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().count(), 11);
        assert!(text
            .lines()
            .all(|l| l.starts_with("[T] ") && l.len() <= CHUNK + 4));
        let joined: String = text.lines().map(|l| &l[4..]).collect();
        assert_eq!(joined.len(), big.len());
    }

    #[test]
    fn tagging_awkward_text_matches_the_line_by_line_definition() {
        // Line by line: split at \n, \r\n or a lone \r, drop the empty lines of redraws,
        // escape each line for the terminal.
        for seed in 0..200u64 {
            let buf = noise(seed, 300);
            let mut out = Vec::new();
            let used = tag_lines(b"> ", &buf, true, 1000, &mut out, &mut Open);
            assert_eq!(used, buf.len());
            let mut model = Vec::new();
            let text = buf.as_slice();
            let mut i = 0;
            while i < text.len() {
                let p = text[i..]
                    .iter()
                    .position(|b| *b == b'\n' || *b == b'\r')
                    .map_or(text.len(), |p| i + p);
                let redraw = p < text.len() && text[p] == b'\r' && text.get(p + 1) != Some(&b'\n');
                if !(redraw && p == i) {
                    model.extend_from_slice(b"> ");
                    crate::logtext::push_terminal(&mut model, &text[i..p]);
                    model.push(b'\n');
                }
                i = if p == text.len() {
                    p
                } else if text[p] == b'\r' && text.get(p + 1) == Some(&b'\n') {
                    p + 2
                } else {
                    p + 1
                };
            }
            let out = String::from_utf8(out).unwrap();
            assert_eq!(out, String::from_utf8(model).unwrap(), "seed {seed}");
            assert!(!out
                .chars()
                .any(|c| c.is_control() && c != '\n' && c != '\t'));
        }
    }

    #[test]
    fn utf8_cut_never_splits_a_character_and_never_returns_zero() {
        let s = "aé✓😀".as_bytes(); // 1 + 2 + 3 + 4 bytes
        let cuts: Vec<usize> = (0..=s.len()).map(|m| utf8_cut(s, m)).collect();
        assert_eq!(cuts, vec![0, 1, 1, 3, 3, 3, 6, 6, 6, 6, 10]);
        assert_eq!(
            utf8_cut("😀".as_bytes(), 2),
            2,
            "never 0: invalid text is cut anyway"
        );
        assert_eq!(utf8_cut(b"\xff\xfe\xfd", 2), 2);
        assert_eq!(utf8_cut(b"ab", 100), 2);
        assert_eq!(utf8_cut(b"", 5), 0);
    }
}
