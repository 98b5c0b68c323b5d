//! How long end-to-end tests wait, in one place. Each is an upper bound for something that
//! normally takes milliseconds: a passing test never waits it out, a failing one fails within it
//! (generous, for a loaded 2-core machine). A test that proves something does NOT happen waits
//! for a bound of its own, named where it is used.

use std::time::Duration;

/// Node started → "node ready".
pub const READY: Duration = Duration::from_secs(20);
/// A command → its reply; a log line or status that follows at once.
pub const REPLY: Duration = Duration::from_secs(10);
/// A workload started → its completion at the fake backend.
pub const DONE: Duration = Duration::from_secs(60);
/// SIGTERM (or a one-shot command) → the process exited.
pub const EXIT: Duration = Duration::from_secs(10);
/// Through a broker's restart or a move to another of its endpoints (the reconnect back-off
/// included), or from a broker slower to start than mosquitto.
pub const RECONNECT: Duration = Duration::from_secs(30);
