//! cyberwave-cloud-node: parse the command line, run, map the outcome to an exit code.

use cyberwave_cloud_node::{app, signals};

fn main() {
    // Signals are blocked before any thread exists, so every thread inherits the mask and only
    // the signal thread ever receives them (see signals.rs).
    signals::block_in_this_thread();
    // D46.2: a same-uid process (a workload) can neither read this process's environment or
    // memory through /proc nor ptrace it. Every mode: the CLI holds the API key too.
    signals::not_dumpable();
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(app::run(&args));
}
