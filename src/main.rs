//! cyberwave-cloud-node: parse the command line, run, map the outcome to an exit code.

mod app;
mod backend;
mod cli;
mod config;
mod control;
mod emit;
mod ingress;
mod ledger;
mod mqtt;
mod node;
mod ops;
mod outbox;
mod protocol;
mod signals;
mod store;
mod systemd;
mod util;
mod workers;
mod workload;

fn main() {
    // Signals are blocked before any thread exists, so every thread inherits the mask and only
    // the signal thread ever receives them (see signals.rs).
    signals::block_in_this_thread();
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(app::run(&args));
}
