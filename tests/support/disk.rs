//! A small tmpfs mounted on a node's state dir: a full disk, of bytes or of inodes, on demand.

use std::path::PathBuf;

use super::node::NodeSetup;

/// Unmounted when dropped: declare it after the rig and before the node, so that it goes once
/// the node is gone.
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounts a tmpfs with these `mount -o` options (e.g. `size=4m,mode=0700`) on the state dir
    /// of `setup`. Needs root.
    pub fn on_state_dir(setup: &NodeSetup, options: &str) -> Tmpfs {
        super::assert_root("a full state dir is a small tmpfs, and mounting one");
        let dir = setup.config_dir();
        std::fs::create_dir_all(&dir).expect("the state dir");
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(&dir)
            .output()
            .expect("run mount");
        // No silent pass: root that cannot mount (a container without CAP_SYS_ADMIN) proves
        // nothing.
        assert!(
            out.status.success(),
            "cannot mount a tmpfs ({options}) on {} as root: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs(dir)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .output();
    }
}
