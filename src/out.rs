//! Output of the CLI commands. `println!` panics when stdout is gone (`status | head -2` closes
//! the pipe); here a reader that went away ends the command quietly with exit 0, as ripgrep
//! does, and any other write error ends it with one line on stderr and exit 1.

use std::io::Write;

/// Writes `text` to stdout and flushes, so a closed pipe is noticed at the write that hit it.
pub fn stdout(text: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(text).and_then(|()| out.flush()) {
        gone(&e)
    }
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
    let _ = std::io::stderr().lock().write_fmt(text);
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
