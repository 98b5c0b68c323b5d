//! The broker session driven with a fake clock (milliseconds) and a recording [`Link`]:
//! no broker, no backend, no sleeping.

use super::*;
use serde_json::json;

/// Records everything the session does to the world.
#[derive(Default)]
struct RecLink {
    /// What `is_connected` answers (the client's view).
    up: bool,
    connects: usize,
    endpoint_moves: usize,
    /// Broker addresses (empty: one, "broker:1883"); `cur` is the current one.
    endpoints: Vec<String>,
    cur: usize,
    subs: Vec<Vec<String>>,
    confirmed: Vec<Vec<String>>,
    unsubs: Vec<String>,
    /// (topic, body, correlation)
    requests: Vec<(String, Value, Vec<u8>)>,
    saved: Vec<Identity>,
    conflicts: usize,
    notes: Vec<String>,
}

impl Link for RecLink {
    fn connect(&mut self) {
        self.connects += 1;
    }
    fn is_connected(&self) -> bool {
        self.up
    }
    fn endpoint(&self) -> String {
        self.endpoints
            .get(self.cur)
            .cloned()
            .unwrap_or_else(|| "broker:1883".into())
    }
    fn endpoint_count(&self) -> usize {
        self.endpoints.len().max(1)
    }
    fn next_endpoint(&mut self) {
        self.endpoint_moves += 1;
        self.cur = (self.cur + 1) % self.endpoints.len().max(1);
    }
    fn subscribe(&mut self, topics: &[String]) {
        self.subs.push(topics.to_vec());
    }
    fn subscribe_confirmed(&mut self, topics: &[String]) {
        self.confirmed.push(topics.to_vec());
    }
    fn unsubscribe(&mut self, topic: &str) {
        self.unsubs.push(topic.into());
    }
    fn request(&mut self, topic: &str, payload: Vec<u8>, correlation: &[u8]) {
        let body = serde_json::from_slice(&payload).unwrap();
        self.requests
            .push((topic.into(), body, correlation.to_vec()));
    }
    fn save_identity(&mut self, identity: &Identity) -> Result<(), String> {
        self.saved.push(identity.clone());
        Ok(())
    }
    fn mark_client_id_conflict(&mut self) {
        self.conflicts += 1;
    }
    fn notify(&mut self, state: &str) {
        self.notes.push(state.into());
    }
}

impl RecLink {
    fn last_request(&self) -> (String, Value, Vec<u8>) {
        self.requests.last().cloned().expect("a request was sent")
    }
}

type S = Session<u32>;

fn cfg() -> Config {
    Config {
        topics: Topics::new("", "cloud_node_test"),
        token: "tok".into(),
        profile_slug: "gpu".into(),
        environment_uuid: None,
        slug_hint: None,
        instance_uuid: None,
        workspace_slug: None,
        standalone: false,
        heartbeat_interval: Duration::from_secs(30),
        tuning: Tuning::default(),
        state_dir: "/state".into(),
    }
}

fn at(t0: Instant, ms: u64) -> Instant {
    t0 + Duration::from_millis(ms)
}

fn reply_to(corr: &[u8], topics: &Topics, body: Value) -> MqttEvent {
    MqttEvent::Message {
        topic: topics.inbox(),
        payload: body.to_string().into_bytes(),
        correlation: Some(corr.to_vec()),
    }
}

/// A connected session at `t0`: its connect started and was accepted.
fn connected(cfg: Config, t0: Instant) -> (S, RecLink) {
    let mut s = S::new(cfg, None, None, t0);
    let mut rec = RecLink::default();
    assert!(s.tick(false, t0, &mut rec).is_empty());
    assert_eq!(rec.connects, 1, "the first connect starts at once");
    rec.up = true;
    let h = s.on_mqtt(MqttEvent::Connect(Ok(false)), false, t0, &mut rec);
    assert_eq!(h, vec![Happening::Connected { reconnect: false }]);
    assert!(s.connected());
    (s, rec)
}

/// A session that registered (R1, R2) and is ready (SUBACK) at `t0`.
fn ready(t0: Instant) -> (S, RecLink) {
    ready_with(cfg(), t0)
}

fn ready_with(cfg: Config, t0: Instant) -> (S, RecLink) {
    let topics = cfg.topics.clone();
    let (mut s, mut rec) = connected(cfg, t0);
    s.tick(false, t0, &mut rec);
    let (_, _, c1) = rec.last_request();
    let r = reply_to(
        &c1,
        &topics,
        json!({"success": true, "uuid": "u-1", "slug": "s-1"}),
    );
    assert!(s.on_mqtt(r, false, t0, &mut rec).is_empty());
    let (_, _, c2) = rec.last_request();
    let r = reply_to(&c2, &topics, json!({"success": true}));
    assert_eq!(
        s.on_mqtt(r, false, t0, &mut rec),
        vec![Happening::Registered]
    );
    s.on_mqtt(MqttEvent::Subscribed(Ok(vec![1, 1])), false, t0, &mut rec);
    (s, rec)
}

#[test]
fn connects_registers_and_is_ready_only_after_the_suback() {
    let t0 = Instant::now();
    let (mut s, mut rec) = connected(cfg(), t0);
    let topics = cfg().topics;
    assert_eq!(rec.subs, vec![vec![topics.inbox()]], "the inbox first");
    // No known uuid: R1 (create), on the token's topic.
    s.tick(false, t0, &mut rec);
    let (topic, body, c1) = rec.last_request();
    assert_eq!(topic, topics.request_instance("tok"));
    assert_eq!(body["profile_slug"], "gpu");
    assert_eq!(body["provider"], "self-hosted");
    // R2 for the uuid the backend gave.
    let r = reply_to(
        &c1,
        &topics,
        json!({"success": true, "uuid": "u-1", "slug": "s-1"}),
    );
    s.on_mqtt(r, false, at(t0, 5), &mut rec);
    let (topic, _, c2) = rec.last_request();
    assert_eq!(topic, topics.register("u-1"));
    assert!(!s.registered());
    let r = reply_to(&c2, &topics, json!({"success": true}));
    let h = s.on_mqtt(r, false, at(t0, 9), &mut rec);
    assert_eq!(h, vec![Happening::Registered]);
    assert_eq!((s.uuid(), s.slug()), ("u-1", "s-1"));
    assert_eq!(rec.saved.len(), 1);
    assert_eq!(
        rec.confirmed,
        vec![vec![topics.command("u-1"), topics.command("s-1")]]
    );
    // Registered, but neither ready nor beating before the broker confirmed the commands.
    assert!(rec.notes.is_empty());
    assert!(s.tick(false, at(t0, 60_000), &mut rec).is_empty());
    s.on_mqtt(
        MqttEvent::Subscribed(Ok(vec![1, 1])),
        false,
        at(t0, 60_001),
        &mut rec,
    );
    assert_eq!(rec.notes, vec!["READY=1"]);
    assert_eq!(
        s.tick(false, at(t0, 60_001), &mut rec),
        vec![Happening::HeartbeatDue],
        "the first heartbeat goes with readiness"
    );
    // A reconnect renews the command subscriptions with the inbox.
    s.on_mqtt(MqttEvent::Lost("x".into()), false, at(t0, 70_000), &mut rec);
    s.tick(false, at(t0, 200_000), &mut rec);
    let h = s.on_mqtt(
        MqttEvent::Connect(Ok(true)),
        false,
        at(t0, 200_000),
        &mut rec,
    );
    assert_eq!(h, vec![Happening::Connected { reconnect: true }]);
    assert_eq!(
        rec.subs.last().unwrap(),
        &vec![topics.inbox(), topics.command("u-1"), topics.command("s-1")]
    );
}

#[test]
fn a_request_times_out_exactly_at_its_deadline_and_a_late_reply_is_dropped() {
    let t0 = Instant::now();
    let (mut s, mut rec) = ready(t0);
    let topics = cfg().topics;
    let corr = s.request(
        7,
        "t/x",
        &json!({"a": 1}),
        Duration::from_millis(5_000),
        t0,
        &mut rec,
    );
    assert_eq!(rec.last_request().0, "t/x");
    assert_eq!(s.next_due(), Some(t0), "the heartbeat is due first");
    s.tick(false, t0, &mut rec);
    assert!(s.next_due().unwrap() <= at(t0, 5_000));
    assert!(s.tick(false, at(t0, 4_999), &mut rec).is_empty());
    let h = s.tick(false, at(t0, 5_000), &mut rec);
    assert!(h.contains(&Happening::Outcome {
        tag: 7,
        reply: None,
        correlation: corr.clone()
    }));
    // Its reply, late, matches nothing.
    let late = reply_to(&corr, &topics, json!({"success": true}));
    assert!(s.on_mqtt(late, false, at(t0, 5_001), &mut rec).is_empty());
}

#[test]
fn the_loops_replies_come_back_with_their_tag_and_foreign_ones_are_dropped() {
    let t0 = Instant::now();
    let (mut s, mut rec) = ready(t0);
    let topics = cfg().topics;
    let a = s.request(1, "t/a", &json!({}), Duration::from_secs(30), t0, &mut rec);
    let b = s.request(2, "t/b", &json!({}), Duration::from_secs(30), t0, &mut rec);
    assert_ne!(a, b);
    let h = s.on_mqtt(
        reply_to(&b, &topics, json!({"success": false, "message": "no"})),
        false,
        at(t0, 3),
        &mut rec,
    );
    match h.as_slice() {
        [Happening::Outcome {
            tag: 2,
            reply: Some(r),
            correlation,
        }] => {
            assert!(!r.success);
            assert_eq!(correlation, &b);
        }
        other => panic!("{other:?}"),
    }
    // A reply nobody asked for, and one without correlation: dropped.
    let foreign = reply_to(b"nope", &topics, json!({"success": true}));
    assert!(s.on_mqtt(foreign, false, at(t0, 4), &mut rec).is_empty());
    let bare = MqttEvent::Message {
        topic: topics.inbox(),
        payload: b"{}".to_vec(),
        correlation: None,
    };
    assert!(s.on_mqtt(bare, false, at(t0, 4), &mut rec).is_empty());
    // `forget` drops the loop's requests it picks: their replies then match nothing.
    s.forget(|t| *t == 1);
    let r = reply_to(&a, &topics, json!({"success": true}));
    assert!(s.on_mqtt(r, false, at(t0, 5), &mut rec).is_empty());
}

#[test]
fn an_unanswered_registration_is_retried_with_growing_capped_backoff() {
    let t0 = Instant::now();
    let mut c = cfg();
    c.tuning.request_timeout = Duration::from_millis(1_000);
    c.tuning.register_retry_max = Duration::from_millis(4_000);
    let (mut s, mut rec) = connected(c, t0);
    let mut now = t0;
    let mut gaps = Vec::new();
    for n in 0..8u32 {
        s.tick(false, now, &mut rec);
        assert_eq!(rec.requests.len() as u32, n + 1, "one R1 per attempt");
        let sent = now;
        // The request expires at its timeout; the retry comes after a jittered back-off.
        now = at(sent, 1_000);
        s.tick(false, now, &mut rec);
        let next = s.next_due().unwrap();
        let ceiling = Duration::from_millis(500)
            .saturating_mul(1 << n)
            .min(Duration::from_millis(4_000));
        assert!(
            next >= now && next - now <= ceiling,
            "attempt {n}: {:?}",
            next - now
        );
        gaps.push(next - now);
        now = next;
    }
    assert!(gaps.iter().all(|g| *g <= Duration::from_millis(4_000)));
    assert!(!s.registered());
}

#[test]
fn a_404_on_register_creates_a_new_instance_and_a_refusal_retries_the_same() {
    let t0 = Instant::now();
    let mut c = cfg();
    c.instance_uuid = Some("old-1".into());
    let topics = c.topics.clone();
    let (mut s, mut rec) = connected(c, t0);
    s.tick(false, t0, &mut rec);
    let (topic, _, corr) = rec.last_request();
    assert_eq!(
        topic,
        topics.register("old-1"),
        "a known uuid: R2 straight away"
    );
    // An ordinary refusal: R2 again, later.
    s.on_mqtt(
        reply_to(&corr, &topics, json!({"success": false, "code": 500})),
        false,
        t0,
        &mut rec,
    );
    let due = s.next_due().unwrap();
    s.tick(false, due, &mut rec);
    let (topic, _, corr) = rec.last_request();
    assert_eq!(topic, topics.register("old-1"));
    // 404: the instance is unknown; R1 at once.
    s.on_mqtt(
        reply_to(&corr, &topics, json!({"success": false, "code": 404})),
        false,
        due,
        &mut rec,
    );
    s.tick(false, due, &mut rec);
    assert_eq!(rec.last_request().0, topics.request_instance("tok"));
}

#[test]
fn an_instance_gone_on_heartbeat_registers_anew_and_moves_the_command_topics() {
    let t0 = Instant::now();
    let (mut s, mut rec) = ready_with(
        Config {
            environment_uuid: Some("env-1".into()),
            ..cfg()
        },
        t0,
    );
    let topics = cfg().topics;
    assert_eq!(s.tick(false, t0, &mut rec), vec![Happening::HeartbeatDue]);
    s.send_heartbeat(&json!({"n": 1}), t0, &mut rec);
    let (topic, _, corr) = rec.last_request();
    assert_eq!(topic, topics.heartbeat("u-1"));
    let gone = reply_to(&corr, &topics, json!({"success": false, "code": 404}));
    assert!(s.on_mqtt(gone, false, at(t0, 10), &mut rec).is_empty());
    assert!(!s.registered());
    // R1 again, then R2 for the new uuid; the old command topics are dropped.
    s.tick(false, at(t0, 10), &mut rec);
    let (topic, body, c1) = rec.last_request();
    assert_eq!(topic, topics.request_instance("tok"));
    assert_eq!(
        body["environment_uuid"], "env-1",
        "D5: the reservation goes again"
    );
    let r = reply_to(
        &c1,
        &topics,
        json!({"success": true, "uuid": "u-2", "slug": "s-1"}),
    );
    s.on_mqtt(r, false, at(t0, 11), &mut rec);
    let (_, _, c2) = rec.last_request();
    let r = reply_to(&c2, &topics, json!({"success": true}));
    assert_eq!(
        s.on_mqtt(r, false, at(t0, 12), &mut rec),
        vec![Happening::Registered]
    );
    assert_eq!(rec.unsubs, vec![topics.command("u-1")]);
    assert_eq!(s.uuid(), "u-2");
}

#[test]
fn heartbeats_keep_their_cadence_for_an_hour_and_feed_the_watchdog() {
    let t0 = Instant::now();
    let (mut s, mut rec) = ready(t0);
    let topics = cfg().topics;
    let hour = at(t0, 3_600_000);
    let mut now = t0;
    let mut beats = Vec::new();
    while now < hour {
        for h in s.tick(false, now, &mut rec) {
            if h == Happening::HeartbeatDue {
                beats.push(now);
                s.send_heartbeat(&json!({}), now, &mut rec);
                let (_, _, corr) = rec.last_request();
                let ok = reply_to(&corr, &topics, json!({"success": true}));
                s.on_mqtt(ok, false, at(now, 40), &mut rec);
            }
        }
        // The loop sleeps until the session's next deadline.
        now = s.next_due().unwrap().max(at(now, 1));
    }
    let gaps: Vec<u128> = beats
        .windows(2)
        .map(|w| (w[1] - w[0]).as_millis())
        .collect();
    assert!(
        gaps.iter().all(|g| (27_000..33_000).contains(g)),
        "{gaps:?}"
    );
    assert!((109..=134).contains(&beats.len()), "{} beats", beats.len());
    let watchdogs = rec.notes.iter().filter(|n| *n == "WATCHDOG=1").count();
    assert_eq!(watchdogs, beats.len(), "one per acknowledged beat");
    assert!(s.last_heartbeat_ok().is_some());
}

#[test]
fn a_refused_token_backs_off_then_ends_the_node_and_unanswered_beats_are_counted() {
    let t0 = Instant::now();
    let (mut s, mut rec) = ready(t0);
    let topics = cfg().topics;
    let mut now = t0;
    let mut sent = Vec::new();
    let mut rejected = false;
    for _ in 0..5 {
        // The loop sleeps from deadline to deadline until the heartbeat is due.
        while s.tick(false, now, &mut rec) != vec![Happening::HeartbeatDue] {
            now = s.next_due().unwrap();
        }
        sent.push(now);
        s.send_heartbeat(&json!({}), now, &mut rec);
        let (_, _, corr) = rec.last_request();
        let r401 = reply_to(&corr, &topics, json!({"success": false, "code": 401}));
        rejected = s
            .on_mqtt(r401, false, now, &mut rec)
            .contains(&Happening::TokenRejected);
    }
    assert!(rejected, "the fifth refusal ends the node");
    let waits: Vec<u128> = sent.windows(2).map(|w| (w[1] - w[0]).as_millis()).collect();
    assert_eq!(waits, vec![2_000, 4_000, 8_000, 16_000]);
    // An unanswered heartbeat is a failure the loop counts.
    let (mut s, mut rec) = ready(t0);
    s.tick(false, t0, &mut rec);
    s.send_heartbeat(&json!({}), t0, &mut rec);
    let h = s.tick(false, at(t0, 10_000), &mut rec);
    assert_eq!(h, vec![Happening::HeartbeatFailed]);
}

#[test]
fn reconnects_back_off_with_full_jitter_up_to_the_cap() {
    let t0 = Instant::now();
    let mut s = S::new(cfg(), None, None, t0);
    let mut rec = RecLink::default();
    let mut now = t0;
    for n in 0..12u32 {
        s.tick(false, now, &mut rec);
        assert_eq!(rec.connects, n as usize + 1);
        s.on_mqtt(
            MqttEvent::Connect(Err("refused".into())),
            false,
            now,
            &mut rec,
        );
        assert!(!s.connected());
        let next = s.next_due().unwrap();
        let ceiling = Duration::from_millis(500)
            .saturating_mul(1 << n)
            .min(Duration::from_secs(30));
        assert!(next - now <= ceiling, "attempt {n}: {:?}", next - now);
        // Nothing before it is due.
        if next > now {
            s.tick(
                false,
                next - Duration::from_millis(1).min(next - now),
                &mut rec,
            );
        }
        now = next;
    }
    assert_eq!(
        rec.endpoint_moves, 12,
        "each failure moves to the next address"
    );
}

#[test]
fn a_silent_loss_is_noticed_at_the_next_tick_and_a_loss_racing_the_connect_is_checked() {
    let t0 = Instant::now();
    let (mut s, mut rec) = connected(cfg(), t0);
    rec.up = false;
    let h = s.tick(false, at(t0, 100), &mut rec);
    assert_eq!(h, vec![Happening::Lost]);
    assert!(!s.connected());
    // The connect's outcome arrives after its loss: never claimed (D34).
    let due = next_connect(&mut s, &mut rec, at(t0, 100));
    let h = s.on_mqtt(MqttEvent::Connect(Ok(false)), false, due, &mut rec);
    assert!(h.is_empty(), "{h:?}");
    assert!(!s.connected());
    // A loss reported while connecting: looked at again 100 ms later.
    let due = next_connect(&mut s, &mut rec, due);
    s.on_mqtt(MqttEvent::Lost("gone".into()), false, due, &mut rec);
    assert_eq!(s.next_due(), Some(due + Duration::from_millis(100)));
}

/// Sleeps from deadline to deadline, from `now`, until the session starts a connect; returns
/// when it did.
fn next_connect(s: &mut S, rec: &mut RecLink, now: Instant) -> Instant {
    let connects = rec.connects;
    let mut due = now;
    while rec.connects == connects {
        due = s.next_due().unwrap().max(due);
        s.tick(false, due, rec);
    }
    due
}

#[test]
fn d33_two_takeovers_within_a_minute_mark_a_conflict_and_wait_thirty_seconds() {
    let t0 = Instant::now();
    let (mut s, mut rec) = connected(cfg(), t0);
    assert_eq!(
        s.on_mqtt(MqttEvent::TakenOver, false, at(t0, 1_000), &mut rec),
        vec![Happening::Lost]
    );
    assert_eq!(rec.conflicts, 0, "once can be a restart");
    let due = s.next_due().unwrap();
    s.tick(false, due, &mut rec);
    s.on_mqtt(MqttEvent::Connect(Ok(true)), false, due, &mut rec);
    let second = at(t0, 50_000);
    s.on_mqtt(MqttEvent::TakenOver, false, second, &mut rec);
    assert_eq!(rec.conflicts, 1);
    // No connect for 30 s, then one.
    let connects = rec.connects;
    let mut now = second;
    while now < second + DUPLICATE_ID_BACKOFF {
        s.tick(false, now, &mut rec);
        assert_eq!(
            rec.connects,
            connects,
            "{:?} after the takeover",
            now - second
        );
        now = s.next_due().unwrap().max(now + Duration::from_millis(1));
    }
    s.tick(false, now, &mut rec);
    assert_eq!(rec.connects, connects + 1);
    // Two takeovers more than a minute apart are not a sign.
    let (mut s, mut rec) = connected(cfg(), t0);
    s.on_mqtt(MqttEvent::TakenOver, false, at(t0, 1_000), &mut rec);
    let due = s.next_due().unwrap();
    s.tick(false, due, &mut rec);
    s.on_mqtt(MqttEvent::Connect(Ok(true)), false, due, &mut rec);
    s.on_mqtt(MqttEvent::TakenOver, false, at(t0, 62_000), &mut rec);
    assert_eq!(rec.conflicts, 0);
}

/// Connects at `now` at the first attempt after a loss and loses it 1 s later.
fn short_connection(s: &mut S, rec: &mut RecLink, now: Instant, publishing: bool) -> Instant {
    let due = next_connect(s, rec, now);
    s.on_mqtt(MqttEvent::Connect(Ok(false)), false, due, rec);
    let lost = due + Duration::from_millis(1_000);
    s.on_mqtt(MqttEvent::Lost("closed".into()), publishing, lost, rec);
    lost
}

#[test]
fn d33_three_short_connections_in_a_minute_are_a_duplicate_but_not_while_publishing() {
    let t0 = Instant::now();
    let (mut s, mut rec) = connected(cfg(), t0);
    s.on_mqtt(MqttEvent::Lost("x".into()), false, at(t0, 10_000), &mut rec);
    let mut now = at(t0, 10_000);
    for _ in 0..3 {
        now = short_connection(&mut s, &mut rec, now, false);
    }
    assert_eq!(rec.conflicts, 1);
    // While the loop's messages are in flight, a short connection may be a refused publish
    // (D34): not counted.
    let (mut s, mut rec) = connected(cfg(), t0);
    s.on_mqtt(MqttEvent::Lost("x".into()), false, at(t0, 10_000), &mut rec);
    let mut now = at(t0, 10_000);
    for _ in 0..5 {
        now = short_connection(&mut s, &mut rec, now, true);
    }
    assert_eq!(rec.conflicts, 0);
}

#[test]
fn commands_before_registration_are_kept_bounded_and_handed_over_in_order() {
    let t0 = Instant::now();
    let (mut s, mut rec) = connected(cfg(), t0);
    let topics = cfg().topics;
    for i in 0..(MAX_EARLY_COMMANDS + 5) {
        let h = s.on_mqtt(
            MqttEvent::Message {
                topic: topics.command("u-1"),
                payload: format!("{i}").into_bytes(),
                correlation: None,
            },
            false,
            t0,
            &mut rec,
        );
        assert!(h.is_empty());
    }
    // A message on a topic that is neither: ignored.
    let stray = MqttEvent::Message {
        topic: "elsewhere".into(),
        payload: b"x".to_vec(),
        correlation: None,
    };
    assert!(s.on_mqtt(stray, false, t0, &mut rec).is_empty());
    s.tick(false, t0, &mut rec);
    let (_, _, c1) = rec.last_request();
    let r = reply_to(
        &c1,
        &topics,
        json!({"success": true, "uuid": "u-1", "slug": "s-1"}),
    );
    s.on_mqtt(r, false, t0, &mut rec);
    let (_, _, c2) = rec.last_request();
    let h = s.on_mqtt(
        reply_to(&c2, &topics, json!({"success": true})),
        false,
        t0,
        &mut rec,
    );
    assert_eq!(h.first(), Some(&Happening::Registered));
    let commands: Vec<_> = h
        .iter()
        .filter_map(|h| match h {
            Happening::Command(p) => Some(String::from_utf8(p.clone()).unwrap()),
            _ => None,
        })
        .collect();
    assert_eq!(commands.len(), MAX_EARLY_COMMANDS);
    assert_eq!(commands.first().map(String::as_str), Some("0"));
    assert_eq!(
        commands.last().unwrap(),
        &format!("{}", MAX_EARLY_COMMANDS - 1)
    );
    // Once registered, commands go straight through.
    let h = s.on_mqtt(
        MqttEvent::Message {
            topic: topics.command("s-1"),
            payload: b"now".to_vec(),
            correlation: None,
        },
        false,
        t0,
        &mut rec,
    );
    assert_eq!(h, vec![Happening::Command(b"now".to_vec())]);
}

#[test]
fn a_closing_session_starts_nothing_but_its_requests_still_end() {
    let t0 = Instant::now();
    let (mut s, mut rec) = ready(t0);
    let corr = s.request(
        9,
        "t/terminate",
        &json!({}),
        Duration::from_millis(500),
        t0,
        &mut rec,
    );
    s.close();
    rec.up = false;
    let h = s.tick(false, at(t0, 10), &mut rec);
    assert_eq!(h, vec![Happening::Lost]);
    let connects = rec.connects;
    let h = s.tick(false, at(t0, 500), &mut rec);
    assert_eq!(
        h,
        vec![Happening::Outcome {
            tag: 9,
            reply: None,
            correlation: corr
        }]
    );
    assert!(s.tick(false, at(t0, 600_000), &mut rec).is_empty());
    assert_eq!(rec.connects, connects, "no reconnect while closing");
    assert_eq!(s.next_due(), None, "nothing left to wake for");
}

#[test]
fn a_failed_start_registers_to_report_it_and_subscribes_to_no_command() {
    let t0 = Instant::now();
    let mut s = S::new(cfg(), None, Some("install failed".into()), t0);
    let mut rec = RecLink::default();
    let topics = cfg().topics;
    s.tick(false, t0, &mut rec);
    rec.up = true;
    s.on_mqtt(MqttEvent::Connect(Ok(false)), false, t0, &mut rec);
    s.tick(false, t0, &mut rec);
    let (_, _, c1) = rec.last_request();
    let r = reply_to(&c1, &topics, json!({"success": true, "uuid": "u-1"}));
    s.on_mqtt(r, false, t0, &mut rec);
    let (_, _, c2) = rec.last_request();
    let h = s.on_mqtt(
        reply_to(&c2, &topics, json!({"success": true})),
        false,
        t0,
        &mut rec,
    );
    assert_eq!(
        h,
        vec![Happening::RegisteredAfterFailedStart(
            "install failed".into()
        )]
    );
    assert!(rec.confirmed.is_empty());
    assert_eq!(s.slug(), "cn-u-1", "a slug made up from the uuid");
}

#[test]
fn standalone_uses_its_own_identity_and_sends_no_request() {
    let t0 = Instant::now();
    let mut c = cfg();
    c.standalone = true;
    let me = Identity {
        uuid: "me".into(),
        slug: "me-slug".into(),
        standalone: true,
        ..Identity::default()
    };
    let mut s = S::new(c, Some(me), None, t0);
    let mut rec = RecLink::default();
    s.tick(false, t0, &mut rec);
    rec.up = true;
    s.on_mqtt(MqttEvent::Connect(Ok(false)), false, t0, &mut rec);
    let h = s.tick(false, t0, &mut rec);
    assert_eq!(h, vec![Happening::Registered]);
    s.on_mqtt(MqttEvent::Subscribed(Ok(vec![1, 1])), false, t0, &mut rec);
    assert!(rec.requests.is_empty());
    assert_eq!(rec.notes, vec!["READY=1"]);
    assert!(
        s.tick(false, at(t0, 3_600_000), &mut rec).is_empty(),
        "no heartbeats without a backend"
    );
}

#[test]
fn a_refused_request_comes_back_refused_once_and_never_times_out() {
    let t0 = Instant::now();
    let (mut s, mut rec) = ready(t0);
    assert!(
        !s.loop_requests_pending(),
        "heartbeats and registration are not the loop's"
    );
    let corr = s.request(9, "t/big", &json!({}), Duration::from_secs(5), t0, &mut rec);
    assert!(s.loop_requests_pending());
    let refused = |permanent| MqttEvent::Refused {
        correlation: corr.clone(),
        why: "too big".into(),
        permanent,
    };
    let h = s.on_mqtt(refused(true), false, at(t0, 10), &mut rec);
    assert_eq!(
        h,
        vec![Happening::Refused {
            tag: 9,
            why: "too big".into(),
            permanent: true
        }]
    );
    assert!(!s.loop_requests_pending());
    // Nothing more of it: no second refusal, no timeout, and the connection stays.
    assert!(s
        .on_mqtt(refused(false), false, at(t0, 20), &mut rec)
        .is_empty());
    let later = s.tick(false, at(t0, 60_000), &mut rec);
    assert!(
        !later
            .iter()
            .any(|h| matches!(h, Happening::Outcome { tag: 9, .. })),
        "{later:?}"
    );
    assert!(s.connected());
}

#[test]
fn a_refused_registration_fails_at_once_and_is_retried() {
    let t0 = Instant::now();
    let mut s: S = Session::new(cfg(), None, None, t0);
    let mut rec = RecLink {
        up: true,
        ..RecLink::default()
    };
    s.tick(false, t0, &mut rec);
    s.on_mqtt(MqttEvent::Connect(Ok(false)), false, t0, &mut rec);
    s.tick(false, t0, &mut rec);
    let (topic, _, corr) = rec.last_request();
    assert!(topic.ends_with("request-instance"), "{topic}");
    let sent = rec.requests.len();
    let h = s.on_mqtt(
        MqttEvent::Refused {
            correlation: corr,
            why: "Not authorized".into(),
            permanent: false,
        },
        false,
        at(t0, 5),
        &mut rec,
    );
    assert!(h.is_empty(), "{h:?}");
    // Sent again within the first registration backoff, not after the request's timeout
    // (30 s).
    let retry = at(t0, 5) + REGISTER_RETRY_BASE;
    assert!(s.next_due().is_some_and(|d| d <= retry));
    s.tick(false, retry, &mut rec);
    assert_eq!(rec.requests.len(), sent + 1);
}

/// Each broker address has its own back-off. A dead address that refuses at once
/// does not lengthen the wait before a live one (one counter for all would double it at each
/// failure of the dead one).
#[test]
fn each_broker_address_backs_off_on_its_own_failures() {
    let t0 = Instant::now();
    let mut s = S::new(cfg(), None, None, t0);
    let mut rec = RecLink {
        endpoints: vec!["a:1".into(), "b:1".into()],
        ..RecLink::default()
    };
    let mut now = t0;
    for i in 0..16u32 {
        s.tick(false, now, &mut rec);
        s.on_mqtt(
            MqttEvent::Connect(Err("refused".into())),
            false,
            now,
            &mut rec,
        );
        let next = s.next_due().unwrap();
        // The next address has failed (i + 1) / 2 times: its own back-off, not the 2^i of
        // one counter for both.
        let own = i.div_ceil(2).saturating_sub(1);
        let ceiling = Duration::from_millis(500) * (1 << own);
        assert!(
            next - now <= ceiling,
            "attempt {i}: {:?} > {ceiling:?}",
            next - now
        );
        now = next;
    }
    assert_eq!(s.failures.get("a:1"), Some(&8));
    assert_eq!(s.failures.get("b:1"), Some(&8));
    // A connection on a that lasts resets a only; b's failures stay b's.
    s.tick(false, now, &mut rec);
    rec.up = true;
    s.on_mqtt(MqttEvent::Connect(Ok(false)), false, now, &mut rec);
    let later = now + Duration::from_secs(60);
    s.on_mqtt(MqttEvent::Lost("x".into()), false, later, &mut rec);
    assert_eq!(s.failures.get("a:1"), Some(&0));
    assert_eq!(s.failures.get("b:1"), Some(&8));
}

/// A connection the broker drops within seconds of accepting it is a failed attempt
/// for the back-off: a broker that accepts and drops at once gets no reconnect storm.
#[test]
fn a_connection_that_dies_within_seconds_counts_as_a_failure_for_the_backoff() {
    let t0 = Instant::now();
    let (mut s, mut rec) = connected(cfg(), t0);
    let mut now = at(t0, 60_000);
    s.on_mqtt(MqttEvent::Lost("x".into()), true, now, &mut rec);
    assert_eq!(s.failures.get("broker:1883"), Some(&0), "a long connection");
    for n in 1..=6u32 {
        now = s.next_due().unwrap();
        s.tick(false, now, &mut rec);
        s.on_mqtt(MqttEvent::Connect(Ok(true)), false, now, &mut rec);
        now += Duration::from_millis(300);
        // Publishing: not counted towards a duplicate client id, but still a failure.
        s.on_mqtt(MqttEvent::Lost("dropped".into()), true, now, &mut rec);
        assert_eq!(s.failures.get("broker:1883"), Some(&n));
    }
    assert_eq!(rec.conflicts, 0);
}

/// D50: a SUBACK that refuses the command subscriptions (EMQX/HiveMQ-class brokers: 0x87,
/// 0x80) is never followed by READY=1 or heartbeats; the next connect asks again, and a grant
/// then makes the node ready.
#[test]
fn d50_a_refused_command_subscription_is_never_ready_and_is_asked_again_on_reconnect() {
    let t0 = Instant::now();
    let (mut s, mut rec) = connected(cfg(), t0);
    let topics = cfg().topics;
    s.tick(false, t0, &mut rec);
    let (_, _, c1) = rec.last_request();
    let r = reply_to(
        &c1,
        &topics,
        json!({"success": true, "uuid": "u-1", "slug": "s-1"}),
    );
    s.on_mqtt(r, false, t0, &mut rec);
    let (_, _, c2) = rec.last_request();
    let r = reply_to(&c2, &topics, json!({"success": true}));
    assert_eq!(
        s.on_mqtt(r, false, t0, &mut rec),
        vec![Happening::Registered]
    );
    for codes in [vec![0x87, 0x87], vec![1, 0x80]] {
        s.on_mqtt(MqttEvent::Subscribed(Ok(codes)), false, t0, &mut rec);
        assert!(rec.notes.is_empty(), "{:?}", rec.notes);
        assert!(
            s.tick(false, at(t0, 60_000), &mut rec).is_empty(),
            "no heartbeat"
        );
    }
    // A SUBACK lost with its connection: not ready either.
    rec.up = false;
    s.on_mqtt(
        MqttEvent::Subscribed(Err("disconnected".into())),
        false,
        t0,
        &mut rec,
    );
    assert!(rec.notes.is_empty());
    // The next connect asks for them again, confirmed; a grant makes the node ready.
    s.on_mqtt(MqttEvent::Lost("x".into()), false, at(t0, 60_000), &mut rec);
    let due = s.next_due().unwrap();
    s.tick(false, due, &mut rec);
    rec.up = true;
    s.on_mqtt(MqttEvent::Connect(Ok(true)), false, due, &mut rec);
    assert_eq!(rec.confirmed.len(), 2, "{:?}", rec.confirmed);
    assert_eq!(rec.subs.last().unwrap(), &vec![topics.inbox()]);
    s.on_mqtt(MqttEvent::Subscribed(Ok(vec![1, 1])), false, due, &mut rec);
    assert_eq!(rec.notes, vec!["READY=1"]);
}

/// A SUBACK that grants QoS 0 instead of 1 is a grant (with a warning), not a refusal.
#[test]
fn a_command_subscription_granted_at_qos_0_is_ready() {
    let t0 = Instant::now();
    let (mut s, mut rec) = connected(cfg(), t0);
    let topics = cfg().topics;
    s.tick(false, t0, &mut rec);
    let (_, _, c1) = rec.last_request();
    let r = reply_to(
        &c1,
        &topics,
        json!({"success": true, "uuid": "u-1", "slug": "s-1"}),
    );
    s.on_mqtt(r, false, t0, &mut rec);
    let (_, _, c2) = rec.last_request();
    s.on_mqtt(
        reply_to(&c2, &topics, json!({"success": true})),
        false,
        t0,
        &mut rec,
    );
    s.on_mqtt(MqttEvent::Subscribed(Ok(vec![0, 0])), false, t0, &mut rec);
    assert_eq!(rec.notes, vec!["READY=1"]);
}
