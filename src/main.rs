//! cyberwave-cloud-node: parse the command line, run, map the outcome to an exit code.

use cyberwave_cloud_node::{app, signals};

fn main() {
    // Signals are blocked before any thread exists, so every thread inherits the mask and only
    // the signal thread ever receives them (see signals.rs).
    signals::block_in_this_thread();
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(app::run(&args));
}
