//! The loop's periodic work besides the session's ([`tick`], after every event and every
//! wake-up) and when it is next due ([`next_wake`]): the loop sleeps exactly until then. An idle node wakes for its
//! heartbeat and little else; while workloads run it wakes at least every [`BUSY_TICK`].

use std::time::{Duration, Instant};

use super::operate;
use super::parts::{Due, Exit};
use super::shutdown;
use super::start_path::Start;

/// The loop's longest sleep while a workload is tracked: a safety net under the workload timers,
/// each of which has its own deadline in [`next_wake`].
pub const BUSY_TICK: Duration = Duration::from_secs(1);
/// The loop's longest sleep when nothing is tracked (a heartbeat is due sooner anyway).
pub const IDLE_TICK: Duration = Duration::from_secs(60);
/// Retrying outbox writes that a full disk refused (D28).
const DISK_RETRY: Duration = Duration::from_secs(1);
/// How often events that `emit` queued itself are looked for while workloads run (they are
/// the ones that emit) or the queue is not empty; an idle node looks once a minute.
const RESCAN_BUSY: Duration = Duration::from_secs(2);
const RESCAN_IDLE: Duration = Duration::from_secs(60);

/// The loop's periodic work after the session's (`Node::tick`, which takes `now` for both):
/// run after every event and every wake-up.
pub(super) fn tick(st: &mut Start<'_>, due: &mut Due, now: Instant) {
    st.work.tick();
    st.retry_deferred();
    let w = &mut st.work;
    if now >= due.rescan {
        // Events `emit` queued by itself while the node was unreachable.
        w.ingress.queue.rescan();
        let every = if w.active.is_empty() && w.ingress.queue.is_empty() {
            RESCAN_IDLE
        } else {
            RESCAN_BUSY
        };
        due.rescan = now.checked_add(every).unwrap_or(now);
    }
    w.with_ingress(|i, out| i.send(out));
    if operate::drain_after_one_done(w.s, w.life, w.active, w.outbox, now) {
        shutdown::begin(w, Exit::Ok, "--drain-after-one: the workload completed");
    }
    let queued = w.outbox.len().saturating_add(w.ingress.queue.len());
    let (active, starts) = (&*w.active, &*w.starts);
    operate::write_metrics(
        w.s,
        &mut due.metrics,
        now,
        w.life,
        queued,
        active,
        starts,
        w.gpu,
    );
    operate::prune_old_files(w.s, &mut due.prune, w.active, &w.io.layout, now);
    if w.s.standalone && w.session.connected() && now >= due.watchdog {
        // No heartbeats without a backend: a live broker connection feeds the watchdog.
        crate::systemd::notify("WATCHDOG=1");
        due.watchdog = crate::util::later(now, Duration::from_secs(10));
    }
    w.services.tick(now);
    w.flush_outbox();
    w.pump_logs();
    shutdown::finish_stopping_workloads(w);
    let overdue = w.life.shutdown.as_ref().is_some_and(|s| now >= s.deadline);
    if overdue && w.life.exit.is_none() {
        w.life.exit = shutdown::stop_overdue(w);
    }
}

/// The earliest moment something is due: every timer that [`tick`] acts on has its deadline
/// here.
pub(super) fn next_wake(st: &Start<'_>, due: &Due, now: Instant) -> Instant {
    let w = &st.work;
    let cap = if w.active.is_empty() {
        IDLE_TICK
    } else {
        BUSY_TICK
    };
    let mut t = now.checked_add(cap).unwrap_or(now);
    let mut at = |d: Instant| t = t.min(d);
    let open = w.life.shutdown.is_none();
    let connected = w.session.connected();
    let deadlines = [
        w.session.next_due(),
        w.life.shutdown.as_ref().map(|s| s.deadline),
        // Only while a stream has unsent bytes: growth of a file arrives as an event.
        w.streams.next_due(),
        w.active.next_due(),
        w.services.next_due(),
        connected.then(|| w.outbox.next_try()).flatten(),
        connected.then(|| w.ingress.queue.next_try()).flatten(),
        w.outbox
            .has_pending_writes()
            .then(|| now.checked_add(DISK_RETRY).unwrap_or(now)),
        Some(due.rescan),
        w.s.metrics_file.is_some().then_some(due.metrics),
        Some(due.prune),
        (w.s.standalone && connected).then_some(due.watchdog),
    ];
    deadlines.into_iter().flatten().for_each(&mut at);
    for (.., until) in &st.heal.deferred {
        at(*until);
    }
    if let Some(since) = w.life.drain.idle_since {
        if w.s.drain_after_one && open && w.active.is_empty() {
            at(since
                .checked_add(operate::DRAIN_AFTER_ONE_WAIT)
                .unwrap_or(since));
        }
    }
    t
}
