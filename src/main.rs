//! cyberwave-cloud-node: parse the command line, run, map the outcome to an exit code.

use cyberwave_cloud_node::{app, signals};

fn main() {
    // Signals: `app::run` blocks them for `start` and the supervisor before any thread exists
    // (see signals.rs); every other command ends on SIGINT / SIGTERM (D51).
    // D46.2: a same-uid process (a workload) can neither read this process's environment or
    // memory through /proc nor ptrace it. Every mode: the CLI holds the API key too.
    signals::not_dumpable();
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(app::run(&args));
}
