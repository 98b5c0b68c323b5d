//! Integration tests: the real binary against a real mosquitto and a fake control plane.

// Tests may panic: the no-panic lints (Cargo.toml `[lints.clippy]`) are for the node's own code.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

mod support;

mod attack;
mod brokers;
mod cli_config;
mod cli_pipes;
mod cli_signals;
mod container;
mod decisions;
mod edge;
mod endpoints;
mod gpu;
mod guarantees;
mod hostile;
mod hygiene;
mod ingress;
mod install;
mod lifecycle;
mod logs;
mod manifest_corpus;
mod no_panic;
mod operate;
mod persist;
mod pip;
mod plain_argv;
mod platform;
mod results;
mod services;
mod starts;
mod statedir;
mod wire;
mod workload_attacks;
mod workload_env;
mod workloads;
