//! The reaper thread: `waitpid(-1)` on the node's children (the shims) and one message per
//! exit. The node learns of an exit at once, without polling. When the node has no children
//! the thread sleeps until [`Reaper::spawned`] wakes it.

use crossbeam_channel::{bounded, Receiver, Sender};

#[derive(Debug, Clone, Copy)]
pub struct Reaped {
    pub pid: i32,
}

#[derive(Clone)]
pub struct Reaper {
    wake: Sender<()>,
}

impl Reaper {
    /// `init`: the node is its container's PID 1 (D58), so orphans of any descendant become its
    /// children without a spawn to wake the thread: with no child it looks again every second.
    pub fn start(tx: Sender<Reaped>, init: bool) -> std::io::Result<Reaper> {
        let (wake, wake_rx) = bounded::<()>(1);
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || run(tx, wake_rx, init))?;
        Ok(Reaper { wake })
    }

    /// Call after starting a child.
    pub fn spawned(&self) {
        let _ = self.wake.try_send(());
    }
}

fn run(tx: Sender<Reaped>, wake: Receiver<()>, init: bool) {
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid out pointer.
        let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
        if pid > 0 {
            if tx.send(Reaped { pid }).is_err() {
                return;
            }
            continue;
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EINTR) => continue,
            // No children: sleep until the next spawn. `spawned` is called after the fork, so a
            // wake is never missed (an idle node must not poll: issue 15).
            _ if init => {
                if let Err(crossbeam_channel::RecvTimeoutError::Disconnected) =
                    wake.recv_timeout(std::time::Duration::from_secs(1))
                {
                    return;
                }
            }
            _ => {
                if wake.recv().is_err() {
                    return;
                }
            }
        }
    }
}
