//! Workload attacks: see `mod.rs`.
