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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_controls_and_cuts() {
        assert_eq!(shown("a\nb\u{1b}[31m\0"), "a\\nb\\u{1b}[31m\\u{0}");
        assert_eq!(shown("é"), "é");
        let long = shown(&"é".repeat(500));
        assert_eq!(long.chars().count(), 201);
        assert!(long.ends_with('…'));
    }
}
