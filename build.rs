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
    gpu_captures();
    // The static musl binary (the shipped one) relocates itself at every start, the supervisor's
    // too: packed relative relocations (DT_RELR, musl ≥ 1.2.4, GNU ld ≥ 2.38)
    // replace a 660 KiB table of 28 000 entries read on every exec with a few KiB.
    if std::env::var("CARGO_CFG_TARGET_ENV").as_deref() == Ok("musl") {
        println!("cargo::rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}

/// The real `nvidia-smi` captures and their stand-in (`fixtures/gpu/real/` of the shared folder
/// beside the repository, `../shared`, or `CW_SHARED_DIR`), which the GPU tests replay: where
/// they are, `CW_GPU_REAL` names the folder for the tests; where they are not, the `no_gpu_captures`
/// cfg lists those tests as ignored with that reason instead of letting them pass silently.
/// The node's own code reads neither.
fn gpu_captures() {
    println!("cargo::rustc-check-cfg=cfg(no_gpu_captures)");
    println!("cargo::rerun-if-env-changed=CW_SHARED_DIR");
    let shared = std::env::var_os("CW_SHARED_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            let root = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default();
            std::path::Path::new(&root).join("../shared")
        });
    let real = shared.join("fixtures/gpu/real");
    match std::fs::canonicalize(&real) {
        Ok(dir) if dir.join("nvidia-smi").is_file() => {
            println!("cargo::rerun-if-changed={}", dir.display());
            println!("cargo::rustc-env=CW_GPU_REAL={}", dir.display());
        }
        // (A path that does not exist would make cargo run this script at every build.)
        _ => println!("cargo::rustc-cfg=no_gpu_captures"),
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
