//! The workload as the attacker (guarantee 13, D46–D48, D52–D54): each test runs a workload (or
//! plants what a same-uid workload could plant) that attacks the node, and checks that nothing of
//! the node reached it and that nothing it did wedged the node or held back its completion.
//! Every test here failed on main at f918294 when it was written, except `pids.rs`, written
//! later, which the node passed as it was (83f2416): a measurement, kept as a guard.

mod exit_path;
mod fds;
mod logs;
mod pids;
mod reports;
mod results_links;
mod state_files;
mod terminal;
