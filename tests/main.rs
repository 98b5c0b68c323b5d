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

mod brokers;
mod cancel;
mod cli_config;
mod cli_pipes;
mod cli_signals;
mod commands;
mod completions;
mod connection;
mod containers;
mod decisions;
mod doc_links;
mod gpus;
mod guarantees;
mod ingress;
mod install;
mod install_script;
mod logs;
mod manifest_corpus;
mod node_log;
mod operate;
mod outbox;
mod pip;
mod random_commands;
mod refusals;
mod results;
mod self_heal;
mod services;
mod session;
mod shutdown;
mod starts;
mod state_dir;
mod supervisor;
mod templates;
mod workload_attacks;
mod workload_env;
