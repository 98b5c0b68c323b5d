//! Output of the CLI commands. `println!` panics when stdout is gone (`status | head -2` closes
//! the pipe); here a reader that went away ends the command quietly with exit 0, as ripgrep
//! does, and any other write error ends it with one line on stderr and exit 1.
//!
//! Everything written here reaches the operator's terminal escaped (D69): a control character
//! other than a newline or TAB, DEL or C1 is `\xNN` ([`crate::logtext::terminal_lines`]).
//! Outside text that may hold a newline is escaped field by field where it is formatted
//! ([`crate::logtext::terminal`]); JSON goes through [`json`].

use std::io::Write;

/// Writes `text` to stdout and flushes, so a closed pipe is noticed at the write that hit it.
pub fn stdout(text: std::fmt::Arguments<'_>) {
    let text = text.to_string();
    let shown = crate::logtext::terminal_lines(&text);
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(shown.as_bytes()).and_then(|()| out.flush()) {
        gone(&e)
    }
}

/// A JSON value as one line of output: serde_json leaves DEL, C1 and the format characters
/// raw inside strings; here they are `\u00XX` escapes, so the line is still the same JSON.
pub fn json(v: &serde_json::Value) -> String {
    let text = v.to_string();
    if !text.chars().any(crate::logtext::terminal_unsafe) {
        return text;
    }
    let mut out = String::with_capacity(text.len().saturating_add(16));
    for c in text.chars() {
        if crate::logtext::terminal_unsafe(c) {
            out.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}

/// Raw bytes to stdout (workload logs are not necessarily UTF-8).
pub fn stdout_bytes(bytes: &[u8]) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(bytes).and_then(|()| out.flush()) {
        gone(&e)
    }
}

/// Writes `text` to stderr; a closed stderr is ignored (there is nobody left to tell).
pub fn stderr(text: std::fmt::Arguments<'_>) {
    let text = text.to_string();
    let shown = crate::logtext::terminal_lines(&text);
    let _ = std::io::stderr().lock().write_all(shown.as_bytes());
}

fn gone(e: &std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(crate::error::Exit::Ok.code())
    }
    stderr(format_args!(
        "error: cannot write to standard output: {e}\n"
    ));
    std::process::exit(crate::error::Exit::Runtime.code())
}

/// `println!` for the CLI commands (see the module's comment).
#[macro_export]
macro_rules! outln {
    () => {
        $crate::out::stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` for the CLI commands (see the module's comment).
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::stdout(format_args!($($arg)*))
    };
}

/// `eprintln!` that never panics: a closed stderr is ignored.
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::out::stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn d69_json_output_escapes_del_c1_and_format_characters_and_stays_json() {
        let v = serde_json::json!({"request_id": "a\u{7f}\u{9b}2J\u{202e}\u{1b}[0m\n"});
        let line = super::json(&v);
        assert!(!line.chars().any(crate::logtext::terminal_unsafe), "{line}");
        let back: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(back, v);
    }
}
