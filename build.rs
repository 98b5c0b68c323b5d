//! Says whether this build runs as root, for the end-to-end tests that need root: they carry
//! `#[cfg_attr(not_root, ignore = "needs root")]` (CONTRIBUTING.md, "Tests that need root"), so
//! `cargo test` as root runs them and elsewhere lists them as ignored instead of passing
//! silently. The node's own code reads no cfg of it.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(not_root)");
    println!("cargo::rerun-if-changed=build.rs");
    // A build as another user (`sudo`, `su`) sets another USER: decide again.
    println!("cargo::rerun-if-env-changed=USER");
    if !effective_uid_is_root() {
        println!("cargo::rustc-cfg=not_root");
    }
}

/// The effective uid (the second field of `Uid:` in /proc/self/status) is 0.
fn effective_uid_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}
