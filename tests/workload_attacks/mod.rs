//! The workload as the attacker (guarantee 13, D25, D46–D48, D52–D54, D61, D65, D66, D69): each
//! test runs a workload (or plants what a same-uid workload could plant) that attacks the node,
//! and checks that nothing of the node reached it and that nothing it did wedged the node, held
//! back its completion or outlived it. One file per thing attacked.

mod cleanup;
mod exit_path;
mod fds;
mod logs;
mod pids;
mod reports;
mod results_links;
mod state_files;
mod terminal;
