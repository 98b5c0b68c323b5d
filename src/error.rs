//! Errors as types: one error type per concern, each knowing the exit code it leads
//! to, so exit codes are chosen here and nowhere else. The codes are the README's "Exit codes".

use std::fmt;

/// The documented exit codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// 0: done, or stopped normally.
    Ok,
    /// 1: a runtime failure, or `validate`/`doctor` found a problem.
    Runtime,
    /// 2: a usage or configuration error.
    Usage,
    /// 3: credentials rejected.
    Credentials,
}

impl Exit {
    pub const fn code(self) -> i32 {
        match self {
            Exit::Ok => 0,
            Exit::Runtime => 1,
            Exit::Usage => 2,
            Exit::Credentials => 3,
        }
    }
}

/// An error that ends the process: what to tell the person (`Display`) and the exit it leads to.
pub trait Failure: fmt::Display {
    fn exit(&self) -> Exit;
    /// The command already said everything (e.g. `validate` printed its findings).
    fn told(&self) -> bool {
        false
    }
}

/// The binary's edge for a command's failure: one `error: …` line on stderr (unless the command
/// already told), and the exit code.
pub fn report(e: &dyn Failure) -> i32 {
    if !e.told() {
        crate::errln!("error: {e}");
    }
    e.exit().code()
}

/// `Ok` is exit 0; an error is reported (see `report`).
pub fn exit_code<E: Failure>(result: Result<(), E>) -> i32 {
    match result {
        Ok(()) => Exit::Ok.code(),
        Err(e) => report(&e),
    }
}

/// Errors of the operator commands (`status`, `logs`, `drain`, `resume`, `doctor`, `validate`,
/// `config`, `install-service`, …).
#[derive(Debug, PartialEq)]
pub enum CliError {
    /// A bad flag or argument (exit 2).
    Usage(String),
    /// The configuration does not resolve: one line per problem (exit 2).
    Config(Vec<String>),
    /// The command could not do its work (exit 1).
    Runtime(String),
    /// The command found problems and has printed them (exit 1, nothing more to say).
    Found,
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Usage(m) | CliError::Runtime(m) => f.write_str(m),
            // `report` writes the first `error: `; every further problem gets its own.
            CliError::Config(lines) => f.write_str(&lines.join("\nerror: ")),
            CliError::Found => f.write_str("problems found"),
        }
    }
}

impl Failure for CliError {
    fn exit(&self) -> Exit {
        match self {
            CliError::Usage(_) | CliError::Config(_) => Exit::Usage,
            CliError::Runtime(_) | CliError::Found => Exit::Runtime,
        }
    }
    fn told(&self) -> bool {
        *self == CliError::Found
    }
}

/// Errors of `emit` (decision D19).
#[derive(Debug, PartialEq)]
pub enum EmitError {
    /// The event is invalid; nothing was queued (exit 2).
    Invalid(String),
    /// The node refused the workload's token or workflow (exit 3).
    Refused(String),
    /// The event could not be handed over or queued (exit 1).
    Failed(String),
}

impl fmt::Display for EmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EmitError::Invalid(m) | EmitError::Refused(m) | EmitError::Failed(m) => f.write_str(m),
        }
    }
}

impl Failure for EmitError {
    fn exit(&self) -> Exit {
        match self {
            EmitError::Invalid(_) => Exit::Usage,
            EmitError::Refused(_) => Exit::Credentials,
            EmitError::Failed(_) => Exit::Runtime,
        }
    }
}

/// Why the node could not start (logged as one ERROR line by `node::startup::run`).
#[derive(Debug, PartialEq)]
pub enum StartupError {
    /// The configuration cannot work: no API token, an unusable TLS setting, … (exit 2).
    Config(String),
    /// The backend rejected the API token (exit 3).
    Credentials(String),
    /// The host did not let the node start: state dir, threads, sockets, … (exit 1).
    Runtime(String),
    /// A stop (SIGTERM, SIGINT) came during start-up, e.g. while the install script ran, and
    /// was carried out (exit 0, as for any stop).
    Stopped(String),
}

impl fmt::Display for StartupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartupError::Config(m)
            | StartupError::Credentials(m)
            | StartupError::Runtime(m)
            | StartupError::Stopped(m) => f.write_str(m),
        }
    }
}

impl Failure for StartupError {
    fn exit(&self) -> Exit {
        match self {
            StartupError::Config(_) => Exit::Usage,
            StartupError::Credentials(_) => Exit::Credentials,
            StartupError::Runtime(_) => Exit::Runtime,
            StartupError::Stopped(_) => Exit::Ok,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_are_the_documented_ones() {
        assert_eq!(
            [Exit::Ok, Exit::Runtime, Exit::Usage, Exit::Credentials].map(Exit::code),
            [0, 1, 2, 3]
        );
        assert_eq!(CliError::Usage("x".into()).exit(), Exit::Usage);
        assert_eq!(CliError::Config(vec![]).exit(), Exit::Usage);
        assert_eq!(CliError::Runtime("x".into()).exit(), Exit::Runtime);
        assert_eq!(CliError::Found.exit(), Exit::Runtime);
        assert!(CliError::Found.told() && !CliError::Runtime("x".into()).told());
        assert_eq!(EmitError::Invalid("x".into()).exit(), Exit::Usage);
        assert_eq!(EmitError::Refused("x".into()).exit(), Exit::Credentials);
        assert_eq!(EmitError::Failed("x".into()).exit(), Exit::Runtime);
        assert_eq!(StartupError::Config("x".into()).exit(), Exit::Usage);
        assert_eq!(
            StartupError::Credentials("x".into()).exit(),
            Exit::Credentials
        );
        assert_eq!(StartupError::Runtime("x".into()).exit(), Exit::Runtime);
        assert_eq!(exit_code::<CliError>(Ok(())), 0);
        assert_eq!(exit_code(Err(CliError::Found)), 1);
    }

    #[test]
    fn config_errors_become_one_error_line_each() {
        let e = CliError::Config(vec!["a".into(), "b".into()]);
        assert_eq!(format!("error: {e}"), "error: a\nerror: b");
    }
}
