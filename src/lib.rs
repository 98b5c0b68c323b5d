//! cyberwave-cloud-node as a library: the binary (`main.rs`) is a thin wrapper, and the fuzz
//! targets (`fuzz/`) reach the parsers of outside input through these modules.

// No panic outside tests (Cargo.toml `[lints.clippy]` denies these); unit tests may.
#![cfg_attr(
    test,
    allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing,
        clippy::arithmetic_side_effects
    )
)]

pub mod app;
pub mod backend;
pub mod cli;
pub mod config;
pub mod control;
pub mod emit;
pub mod error;
pub mod fds;
pub mod gpu;
pub mod ingress;
pub mod ingress_queue;
pub mod ledger;
pub mod logtext;
pub mod manpage;
pub mod mqtt;
pub mod node;
pub mod ops;
pub mod out;
pub mod outbox;
pub mod protocol;
#[cfg(test)]
pub mod scratch;
pub mod signals;
pub mod statedir;
pub mod store;
pub mod systemd;
pub mod util;
pub mod workers;
pub mod workload;
