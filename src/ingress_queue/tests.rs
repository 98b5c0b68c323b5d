//! The ingress queue with a fake clock: bounds in bytes and events, per workload; order per
//! execution; refusals by PUBACK and by a dropped connection; payloads read back from disk.

use std::time::{Duration, Instant};

use serde_json::json;

use super::*;

fn item(topic: &str, owner: Option<&str>, pad: usize) -> Item {
    Item {
        topic: topic.into(),
        body: json!({"pad": "x".repeat(pad)}),
        label: topic.into(),
        key: None,
        owner: owner.map(String::from),
    }
}

fn node(wf: &str, ex: &str, n: u32) -> String {
    format!("cyberwave/workflow/{wf}/execution/{ex}/node/n{n}")
}

#[test]
fn d67_the_queue_is_bounded_in_bytes_and_per_workload() {
    let scratch = crate::scratch::Scratch::new("iq-bounds");
    let mut q = EventQueue::load(scratch.path().join("ingress"), 10_000).unwrap();
    let one = item(&node("wf", "ex", 1), Some("a"), 900);
    let size = EventQueue::size_of(&one);
    assert!((900..1100).contains(&size), "{size}");
    // A quarter each: 2 500 bytes, two events of about 1 000 for "a".
    assert_eq!(q.room("a", size), Ok(()));
    q.push(one.clone(), false).unwrap();
    q.push(one.clone(), false).unwrap();
    assert!(matches!(q.room("a", size), Err(Full::Share(_, 2500))));
    for w in ["b", "c", "d"] {
        for _ in 0..2 {
            assert_eq!(q.room(w, size), Ok(()), "{w}");
            q.push(item(&node("wf", w, 1), Some(w), 900), false)
                .unwrap();
        }
    }
    // Eight events of about 1 000: room for one more of the whole, by a fifth workload.
    assert_eq!(q.room("e", size), Ok(()));
    q.push(item(&node("wf", "e", 1), Some("e"), 900), false)
        .unwrap();
    let full = q.room("e", size).unwrap_err();
    assert!(matches!(full, Full::Bytes(_, 10_000)), "{full:?}");
    assert!(full
        .to_string()
        .contains("the node's workflow event queue is full"));
    assert_eq!(
        q.bytes(),
        std::fs::read_dir(q.dir())
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum::<u64>()
    );
    // Acknowledged, room again.
    let first = *q.entries.keys().next().unwrap();
    q.acknowledged(first);
    assert_eq!(q.room("a", size), Ok(()));
}

#[test]
fn d67_at_most_a_quarter_of_the_events_per_workload() {
    let scratch = crate::scratch::Scratch::new("iq-count");
    let mut q = EventQueue::load(scratch.path().join("ingress"), 1 << 30).unwrap();
    for _ in 0..MAX_QUEUED_EVENTS / 4 {
        q.push(item(&node("wf", "ex", 1), Some("a"), 0), false)
            .unwrap();
    }
    assert!(matches!(
        q.room("a", 10),
        Err(Full::ShareEvents(1024, 1024))
    ));
    assert_eq!(q.room("b", 10), Ok(()));
}

/// D67: the payload waits on disk: what the queue keeps in memory does not hold it.
#[test]
fn d67_payloads_wait_on_disk_and_are_read_back_to_be_sent() {
    let scratch = crate::scratch::Scratch::new("iq-disk");
    let mut q = EventQueue::load(scratch.path().join("ingress"), 1 << 30).unwrap();
    let big = item(&node("wf", "ex", 1), Some("a"), 200_000);
    let seq = q.push(big.clone(), false).unwrap();
    assert!(q.entries.values().all(|e| e.unwritten.is_none()));
    assert!(q.entries.values().all(|e| e.label.len() <= MAX_LABEL));
    assert_eq!(q.item(seq).unwrap(), big);
    // Loaded again, the same.
    let q = EventQueue::load(scratch.path().join("ingress"), 1 << 30).unwrap();
    assert_eq!(q.item(seq).unwrap(), big);
    assert_eq!(q.entries[&seq].owner.as_deref(), Some("a"));
}

/// D67: order per execution, none across executions: an execution's next event waits for
/// the one in flight; other executions' heads go beside it.
#[test]
fn d67_events_go_in_order_per_execution_and_executions_side_by_side() {
    let scratch = crate::scratch::Scratch::new("iq-order");
    let mut q = EventQueue::load(scratch.path().join("ingress"), 1 << 30).unwrap();
    let t0 = Instant::now();
    let started = Item {
        body: json!({"execution_uuid": "ex1"}),
        ..item("cyberwave/workflow/wf/execution/started", None, 0)
    };
    let s1 = q.push(started, false).unwrap();
    let n1 = q.push(item(&node("wf", "ex1", 1), None, 0), false).unwrap();
    let f1 = q
        .push(
            item("cyberwave/workflow/wf/execution/ex1/finished", None, 0),
            false,
        )
        .unwrap();
    let m1 = q.push(item(&node("wf", "ex2", 1), None, 0), false).unwrap();
    let m2 = q.push(item(&node("wf", "ex2", 2), None, 0), false).unwrap();
    let other = q
        .push(item(&node("wf2", "ex1", 1), None, 0), false)
        .unwrap();
    assert_eq!(q.due(t0), vec![s1, m1, other], "one per execution");
    for s in [s1, m1, other] {
        q.sent(s, t0);
    }
    assert!(q.due(t0).is_empty(), "each execution has one in flight");
    q.acknowledged(m1);
    assert_eq!(q.due(t0), vec![m2]);
    q.acknowledged(s1);
    assert_eq!(q.due(t0), vec![n1, m2]);
    q.sent(n1, t0);
    q.acknowledged(n1);
    assert_eq!(q.due(t0), vec![f1, m2]);
}

#[test]
fn d67_a_refused_event_holds_back_its_own_execution_only_and_is_set_aside() {
    let scratch = crate::scratch::Scratch::new("iq-refused");
    let mut q = EventQueue::load(scratch.path().join("ingress"), 1 << 30).unwrap();
    let t0 = Instant::now();
    let denied = q
        .push(item(&node("denied", "ex", 1), None, 0), false)
        .unwrap();
    let behind = q
        .push(item(&node("denied", "ex", 2), None, 0), false)
        .unwrap();
    let ok = q.push(item(&node("ok", "ex", 1), None, 0), false).unwrap();
    let mut now = t0;
    for round in 1..MAX_REFUSALS {
        assert!(q.due(now).contains(&denied), "round {round}");
        q.sent(denied, now);
        assert!(q.refused(denied, false, now).is_none());
        assert!(!q.due(now).contains(&denied), "backs off");
        assert!(!q.due(now).contains(&behind), "its execution waits");
        now += REFUSAL_RETRY;
    }
    assert!(q.due(t0).contains(&ok), "another workflow goes at once");
    q.sent(denied, now);
    let (label, aside) = q.refused(denied, false, now).unwrap();
    assert_eq!(label, node("denied", "ex", 1));
    assert!(aside.exists());
    assert!(q.due(now).contains(&behind));
    // Too large for the broker: set aside at the first refusal.
    assert!(q.refused(ok, true, now).is_some());
    assert_eq!(q.len(), 1);
}

/// A broker that drops the connection to refuse names nothing: several events in flight
/// become suspects, each sent alone; the one alone in flight at the next drop is charged.
#[test]
fn d67_a_dropped_connection_blames_only_an_event_that_was_alone_in_flight() {
    let scratch = crate::scratch::Scratch::new("iq-drop");
    let mut q = EventQueue::load(scratch.path().join("ingress"), 1 << 30).unwrap();
    let t0 = Instant::now();
    let bad = q.push(item(&node("bad", "ex", 1), None, 0), false).unwrap();
    let good = q
        .push(item(&node("good", "ex", 1), None, 0), false)
        .unwrap();
    let later = q
        .push(item(&node("later", "ex", 1), None, 0), false)
        .unwrap();
    let mut now = t0;
    for s in q.due(now) {
        q.sent(s, now);
    }
    assert_eq!(q.in_flight_count(), 3);
    assert!(q.reset_in_flight(now).is_empty(), "nobody is blamed");
    // Suspects go alone, oldest first; the good one is acknowledged.
    assert_eq!(q.due(now), vec![bad]);
    for round in 1..=MAX_REFUSALS {
        assert_eq!(q.due(now), vec![bad], "round {round}");
        q.sent(bad, now);
        assert!(q.due(now).is_empty(), "nothing beside a suspect");
        let aside = q.reset_in_flight(now);
        assert_eq!(
            aside.len(),
            usize::from(round == MAX_REFUSALS),
            "round {round}"
        );
        now += Duration::from_millis(10);
    }
    assert_eq!(q.due(now), vec![good]);
    q.sent(good, now);
    q.acknowledged(good);
    assert_eq!(
        q.due(now),
        vec![later],
        "not a suspect: goes with others again"
    );
    // An event sent long before the drop is not blamed.
    q.sent(later, now);
    assert!(q.reset_in_flight(now + REFUSAL_WINDOW * 2).is_empty());
    assert_eq!(q.entries[&later].refusals, 0);
}

#[test]
fn while_the_node_is_down_all_events_share_one_workloads_share() {
    let scratch = crate::scratch::Scratch::new("iq-down");
    let dir = scratch.path().join("ingress");
    std::fs::create_dir_all(&dir).unwrap();
    assert_eq!(room_while_down(&dir, 10), Ok(()));
    let share = crate::ingress::MAX_QUEUE_BYTES / 4;
    std::fs::write(
        dir.join("00000000000000000001.json"),
        vec![b' '; share as usize - 5],
    )
    .unwrap();
    std::fs::write(dir.join("stray.json.tmp"), vec![b' '; 100]).unwrap();
    assert_eq!(room_while_down(&dir, 5), Ok(()));
    assert!(matches!(room_while_down(&dir, 6), Err(Full::Share(_, _))));
}
