//! The streams part against a recording fake and a fake clock in milliseconds: a small
//! simulation answers the tailer's jobs from in-memory files, as the tailer thread would.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::*;

/// What the part asked for: `fx` as it returned it, the rest as read so far ([`Fake::seen`]).
#[derive(Default)]
struct Fake {
    fx: Vec<Effect>,
    tail: Vec<Request>,
    /// Chunks published, in order, with their decoded bodies.
    published: Vec<(Key, Value)>,
    install: Vec<Value>,
    console: [String; 2],
}

impl Fake {
    /// Reads what the part asked for since the last reading.
    fn seen(&mut self) -> &mut Fake {
        for e in std::mem::take(&mut self.fx) {
            match e {
                Effect::Tail(req) => self.tail.push(req),
                Effect::PublishLog { key, payload } => {
                    let body: Value =
                        serde_json::from_slice(&payload).expect("a chunk body is JSON");
                    self.published.push((key, body));
                }
                Effect::PublishInstall(payload) => self
                    .install
                    .push(serde_json::from_slice(&payload).expect("JSON")),
                Effect::Mirror { stream, text } => {
                    self.console[stream].push_str(std::str::from_utf8(&text).expect("UTF-8"))
                }
                other => panic!("not a streams effect: {other:?}"),
            }
        }
        self
    }
}

const ID: &str = "w1";

fn key(stream: usize) -> Key {
    Key {
        safe_id: ID.into(),
        stream,
    }
}

/// One workload "w1" whose two log files live in memory.
struct Sim {
    st: Streams,
    out: Fake,
    files: [Vec<u8>; 2],
    /// Armed watches: (stream, length when armed).
    watches: Vec<(usize, u64)>,
    /// The last cursor written, and how many were.
    cursor: Option<Cursor>,
    persists: usize,
    /// Reads the tailer did.
    reads: Vec<(usize, u64, usize)>,
    /// Hold persists (a slow disk) instead of completing them at once.
    hold_persists: bool,
    held: Vec<Request>,
    t0: Instant,
    now: Instant,
    /// Index of the first published chunk not yet answered.
    answered: usize,
}

fn settings(interval_ms: u64) -> StreamSettings {
    StreamSettings {
        interval: Duration::from_millis(interval_ms),
        max_log_bytes: 1 << 30,
        standalone: false,
        mirror_per_second: MIRROR_BYTES_PER_SECOND,
    }
}

impl Sim {
    fn new(s: StreamSettings) -> Sim {
        Sim::resumed(s, Cursor::default(), [Vec::new(), Vec::new()])
    }

    fn resumed(s: StreamSettings, cursor: Cursor, files: [Vec<u8>; 2]) -> Sim {
        let t0 = Instant::now();
        let mut st = Streams::new(&s);
        st.link(true, "inst-1", t0);
        st.track(
            ID,
            StreamSource {
                kind: "training".into(),
                request_id: Value::from("req-1"),
                workload_uuid: Some("wl-1".into()),
                logs: ["/x/out.log".into(), "/x/err.log".into()],
                cursor_path: "/x/cursor.json".into(),
            },
            cursor,
            t0,
        );
        Sim {
            st,
            out: Fake::default(),
            files,
            watches: Vec::new(),
            cursor: None,
            persists: 0,
            reads: Vec::new(),
            hold_persists: false,
            held: Vec::new(),
            t0,
            now: t0,
            answered: 0,
        }
    }

    /// Moves the clock to `ms` after the start, running every deadline that falls due on the
    /// way (as the loop's `next_wake` would) and the tailer's jobs.
    fn at(&mut self, ms: u64) {
        let target = self.t0 + Duration::from_millis(ms);
        loop {
            self.serve();
            match self.st.next_due() {
                Some(d) if d <= target => {
                    assert!(d >= self.t0, "a deadline before the start");
                    self.now = self.now.max(d);
                    self.st.pump(self.now, &mut self.out.fx);
                }
                _ => break,
            }
        }
        self.now = target;
        self.st.pump(self.now, &mut self.out.fx);
        self.serve();
    }

    fn write(&mut self, stream: usize, bytes: &[u8]) {
        self.files[stream].extend_from_slice(bytes);
        let now = self.now;
        let fired: Vec<usize> = self
            .watches
            .iter()
            .filter(|(s, _)| *s == stream)
            .map(|(s, _)| *s)
            .collect();
        self.watches.retain(|(s, _)| *s != stream);
        for s in fired {
            self.st.on_tail(Event::Grew(key(s)), now, &mut self.out.fx);
        }
        self.serve();
    }

    /// Answers the tailer's jobs until none is left.
    fn serve(&mut self) {
        while !self.out.seen().tail.is_empty() {
            let jobs = std::mem::take(&mut self.out.seen().tail);
            for job in jobs {
                let ev = match job {
                    Request::Read {
                        key, offset, max, ..
                    } => {
                        let f = &self.files[key.stream];
                        self.reads.push((key.stream, offset, max));
                        let from = (offset as usize).min(f.len());
                        let to = from.saturating_add(max).min(f.len());
                        Event::Chunk(Chunk {
                            data: f[from..to].to_vec(),
                            file_len: f.len() as u64,
                            disk_len: f.len() as u64,
                            key,
                            offset,
                            resume: offset,
                            ..Chunk::default()
                        })
                    }
                    Request::Cut { key, keep, .. } => {
                        let f = &mut self.files[key.stream];
                        let cut = (f.len() as u64).saturating_sub(keep);
                        f.drain(..cut as usize);
                        Event::Cut {
                            key,
                            result: Ok(cut),
                        }
                    }
                    Request::Unwatch(key) => {
                        self.watches.retain(|(s, _)| *s != key.stream);
                        continue;
                    }
                    Request::Watch { key, len, .. } => {
                        if self.files[key.stream].len() as u64 != len {
                            Event::Grew(key)
                        } else {
                            self.watches.push((key.stream, len));
                            continue;
                        }
                    }
                    p @ Request::Persist { .. } if self.hold_persists => {
                        self.held.push(p);
                        continue;
                    }
                    Request::Persist { key, path, data } => {
                        self.cursor = Some(serde_json::from_slice(&data).expect("cursor"));
                        self.persists += 1;
                        Event::Persisted {
                            key,
                            path,
                            result: Ok(()),
                        }
                    }
                };
                let now = self.now;
                self.st.on_tail(ev, now, &mut self.out.fx);
            }
        }
    }

    fn release_persists(&mut self) {
        self.hold_persists = false;
        let held = std::mem::take(&mut self.held);
        self.out.seen().tail.extend(held);
        self.serve();
    }

    /// Answers every chunk published and not answered yet (not those that go in answer).
    fn answer(&mut self, ok: bool) {
        let upto = self.out.seen().published.len();
        while self.answered < upto {
            let k = self.out.seen().published[self.answered].0.clone();
            self.answered += 1;
            let now = self.now;
            self.st.on_ack(&k, ok, now, &mut self.out.fx);
            self.serve();
        }
    }

    /// The published chunks of a stream: (offset, length, content).
    fn chunks(&self, stream: usize) -> Vec<(u64, u64, String)> {
        self.out
            .published
            .iter()
            .filter(|(k, _)| k.stream == stream)
            .map(|(_, b)| {
                (
                    b["offset"].as_u64().unwrap(),
                    b["length"].as_u64().unwrap(),
                    b["log_content"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    /// The stream as a backend rebuilds it by offset; panics on a gap or on a chunk sent
    /// again that disagrees with what came before.
    fn rebuilt(&self, stream: usize) -> String {
        let mut text = String::new();
        for (offset, len, mut content) in self.chunks(stream) {
            if len as usize == content.len() + 1 {
                content.push('\n');
            }
            let at = offset as usize;
            assert!(at <= text.len(), "gap before {offset}: have {}", text.len());
            let overlap = (text.len() - at).min(content.len());
            assert_eq!(&text[at..at + overlap], &content[..overlap], "at {at}");
            text.push_str(&content[overlap..]);
        }
        text
    }
}

fn lines(prefix: &str, from: usize, to: usize) -> String {
    (from..=to).map(|i| format!("{prefix} {i}\n")).collect()
}

#[test]
fn a_line_goes_after_the_batching_window_and_nothing_wakes_an_idle_stream() {
    let mut sim = Sim::new(settings(3000));
    sim.at(300); // the first look at the (empty) files; then watches, no deadline
    assert_eq!(sim.st.next_due(), None, "nothing waits: no timer");
    assert_eq!(sim.watches.len(), 2, "both files watched");
    sim.at(1000);
    sim.write(0, b"hello\n");
    assert_eq!(
        sim.st.next_due(),
        Some(sim.t0 + Duration::from_millis(1250)),
        "the line waits the 250 ms window for company"
    );
    sim.at(1100);
    sim.write(0, b"world\n");
    sim.at(1249);
    assert!(sim.out.seen().published.is_empty());
    sim.at(1250);
    assert_eq!(sim.chunks(0), vec![(0, 12, "hello\nworld".to_string())]);
    let body = &sim.out.seen().published[0].1;
    assert_eq!(body["instance_uuid"], "inst-1");
    assert_eq!(body["log_type"], "stdout");
    assert_eq!(body["workload_request_id"], "req-1");
    assert_eq!(body["workload_uuid"], "wl-1");
    assert!(body.get("dropped").is_none());
    sim.answer(true);
    assert_eq!(
        sim.cursor.as_ref().map(|c| c.stdout),
        Some(12),
        "ack advances the cursor"
    );
    assert_eq!(sim.st.next_due(), None);
    assert_eq!(
        sim.out.seen().console[0],
        "[workload wl-1 stdout] hello\n[workload wl-1 stdout] world\n"
    );
}

#[test]
fn chunks_go_in_order_one_at_a_time_and_the_cursor_is_written_before_the_next() {
    let mut sim = Sim::new(settings(3000));
    sim.at(0);
    for i in 1..=50 {
        sim.write(0, format!("line {i}\n").as_bytes());
        sim.at(i * 100);
        // At most one chunk in flight: nothing more goes until the backend answers.
        let unanswered = sim.out.seen().published.len() - sim.answered;
        assert!(unanswered <= 1);
        if i % 3 == 0 {
            sim.hold_persists = true;
            sim.answer(true);
            sim.at(i * 100 + 50);
            assert_eq!(
                sim.out.seen().published.len(),
                sim.answered,
                "no chunk goes while the cursor of the last is being written"
            );
            sim.release_persists();
        }
    }
    sim.at(6000);
    sim.answer(true);
    assert_eq!(sim.rebuilt(0), lines("line", 1, 50));
    let offsets: Vec<u64> = sim.chunks(0).iter().map(|c| c.0).collect();
    assert!(offsets.windows(2).all(|w| w[0] < w[1]), "{offsets:?}");
    assert_eq!(
        sim.cursor.as_ref().map(|c| c.stdout),
        Some(lines("line", 1, 50).len() as u64)
    );
    // Lines every 100 ms go in batches, not one message each, and never 4+ a second.
    let n = sim.chunks(0).len();
    assert!(n <= 22, "{n} messages for 50 lines over 5 s");
}

#[test]
fn a_refused_or_timed_out_chunk_is_sent_again_from_the_acknowledged_offset() {
    let mut sim = Sim::new(settings(3000));
    sim.write(0, b"a\n");
    sim.at(300);
    sim.answer(true);
    sim.write(0, b"b\nc\n");
    sim.at(600);
    assert_eq!(sim.chunks(0).last().unwrap().0, 2);
    sim.answer(false); // refused, or no reply before the request timeout
    assert_eq!(
        sim.cursor.as_ref().map(|c| c.stdout),
        Some(2),
        "not advanced"
    );
    sim.write(0, b"d\n");
    sim.at(1000);
    let again = sim.chunks(0).last().unwrap().clone();
    assert_eq!(
        again,
        (2, 6, "b\nc\nd".into()),
        "from the acknowledged offset"
    );
    sim.answer(true);
    assert_eq!(sim.rebuilt(0), "a\nb\nc\nd\n");
    assert_eq!(sim.cursor.as_ref().map(|c| c.stdout), Some(8));
}

#[test]
fn a_lost_connection_forgets_the_chunk_in_flight_and_resends_it_after_the_reconnect() {
    let mut sim = Sim::new(settings(3000));
    sim.write(0, b"one\n");
    sim.at(300);
    assert_eq!(sim.chunks(0).len(), 1);
    sim.st.reset(sim.now); // connection lost: the chunk's reply will never come
    let now = sim.now;
    sim.st.link(false, "inst-1", now);
    sim.write(0, b"two\n");
    sim.at(2000);
    assert_eq!(
        sim.chunks(0).len(),
        1,
        "nothing is published while disconnected"
    );
    assert!(
        sim.out.seen().console[0].contains("] two\n"),
        "the console still gets the output"
    );
    // A reply of the old connection's request is not mistaken for a new chunk's.
    sim.st.on_ack(&key(0), true, now, &mut sim.out.fx);
    assert_eq!(sim.cursor, None);
    sim.at(3000);
    sim.st.link(true, "inst-1", sim.now);
    sim.at(3250);
    assert_eq!(sim.chunks(0)[1], (0, 8, "one\ntwo".into()));
    sim.answered = 1;
    sim.answer(true);
    assert_eq!(sim.rebuilt(0), "one\ntwo\n");
    // The console saw each line once.
    assert_eq!(sim.out.seen().console[0].matches("] one\n").count(), 1);
    assert_eq!(sim.out.seen().console[0].matches("] two\n").count(), 1);
}

#[test]
fn a_partial_line_waits_for_its_end_without_waking_the_loop() {
    let mut sim = Sim::new(settings(3000));
    sim.write(0, b"done\nhalf a li");
    sim.at(300);
    assert_eq!(sim.chunks(0), vec![(0, 5, "done".into())]);
    sim.answer(true);
    sim.at(5000);
    assert_eq!(sim.chunks(0).len(), 1);
    assert_eq!(sim.st.next_due(), None, "an unfinished line is not polled");
    sim.write(0, b"ne\n");
    sim.at(5250);
    assert_eq!(sim.chunks(0)[1], (5, 12, "half a line".into()));
}

#[test]
fn a_workload_that_ended_ships_its_rest_at_once_and_is_drained() {
    let mut sim = Sim::new(settings(3000));
    sim.write(0, b"out\nlast without end");
    sim.write(1, b"err\n");
    sim.at(300);
    sim.answer(true);
    assert!(!sim.st.drained(ID), "running: not drained");
    assert_eq!(sim.watches.len(), 2, "waiting for more output");
    let now = sim.now;
    sim.st.end(ID, now, &mut sim.out.fx);
    sim.serve();
    assert!(
        sim.watches.is_empty(),
        "an ended workload leaves no watch behind"
    );
    // No window at the end: the unfinished line went at once.
    assert_eq!(
        sim.chunks(0),
        vec![(0, 4, "out".into()), (4, 16, "last without end".into())]
    );
    assert_eq!(sim.chunks(1), vec![(0, 4, "err".into())]);
    assert!(!sim.st.drained(ID), "a chunk in flight");
    assert_eq!(sim.st.undrained(ID), vec!["stdout"]);
    sim.answer(true);
    assert!(sim.st.drained(ID));
    assert!(sim.st.undrained(ID).is_empty());
    assert!(sim.out.seen().console[0].ends_with("] last without end\n"));
    assert_eq!(sim.st.next_due(), None);
}

#[test]
fn during_an_outage_an_ended_workload_is_drained_only_if_everything_was_acknowledged() {
    let mut sim = Sim::new(settings(3000));
    sim.write(0, b"shipped\n");
    sim.at(300);
    sim.answer(true);
    let now = sim.now;
    sim.st.reset(now);
    sim.st.link(false, "inst-1", now);
    sim.st.end(ID, now, &mut sim.out.fx);
    sim.serve();
    assert!(
        sim.st.drained(ID),
        "nothing left to ship: no need to wait for the broker"
    );
    // Output the backend has not got keeps it waiting (until the drain limit, the loop's).
    let mut sim = Sim::new(settings(3000));
    let now = sim.now;
    sim.st.link(false, "inst-1", now);
    sim.write(1, b"unsent\n");
    sim.st.end(ID, now, &mut sim.out.fx);
    sim.serve();
    assert!(!sim.st.drained(ID));
    assert_eq!(sim.st.undrained(ID), vec!["stderr"]);
    assert!(
        sim.out.seen().console[1].contains("] unsent\n"),
        "mirrored meanwhile"
    );
    assert_eq!(sim.st.next_due(), None, "and nothing spins while it waits");
    sim.at(10_000);
    assert!(sim.out.seen().published.is_empty());
    sim.st.link(true, "inst-1", sim.now);
    sim.st.pump(sim.now, &mut sim.out.fx);
    sim.serve();
    sim.answer(true);
    assert!(sim.st.drained(ID));
    assert_eq!(sim.rebuilt(1), "unsent\n");
}

#[test]
fn an_ended_workload_is_not_drained_while_its_chunks_are_unacknowledged() {
    let mut sim = Sim::new(settings(3000));
    sim.write(1, &vec![b'x'; 3 << 20]); // 3 MiB on stderr, one line
    let now = sim.now;
    sim.st.end(ID, now, &mut sim.out.fx);
    sim.serve();
    let n = (3 << 20) / MAX_CHUNK;
    for _ in 0..n {
        assert!(!sim.st.drained(ID));
        assert_eq!(sim.st.undrained(ID), vec!["stderr"]);
        sim.answer(true);
    }
    assert!(sim.st.drained(ID));
    let sizes: Vec<u64> = sim.chunks(1).iter().map(|c| c.1).collect();
    assert_eq!(sizes, vec![MAX_CHUNK; n as usize]);
}

#[test]
fn a_flood_is_paced_by_the_budget_in_big_chunks_and_never_more_than_four_a_second() {
    let mut sim = Sim::new(settings(3000));
    let line = "0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz\n";
    // 60 MiB written during 10 s.
    for step in 0..100u64 {
        let block: String = line.repeat((600 << 10) / line.len() + 1);
        sim.write(0, block.as_bytes());
        sim.at(step * 100);
        sim.answer(true);
    }
    let chunks = sim.chunks(0);
    let shipped: u64 = chunks.iter().map(|c| c.1).sum();
    // 4 MiB at once, then 4 MiB per 3 s: about 17 MiB by 9.9 s, far less than was written.
    assert!(shipped < 19 << 20 && shipped > 14 << 20, "{shipped}");
    let per_mib = chunks.len() as f64 / (shipped as f64 / f64::from(1 << 20));
    assert!(per_mib <= 4.0, "{per_mib} messages per MiB");
    assert!(chunks.len() <= 41, "{} messages in 10 s", chunks.len());
    assert!(chunks.iter().all(|c| c.1 <= MAX_CHUNK));
    assert!(
        chunks.iter().all(|c| c.2.ends_with("xyz")),
        "chunks end at line ends"
    );
    // Every read asked for no more than one chunk.
    assert!(sim.reads.iter().all(|r| r.2 as u64 <= MAX_CHUNK));
    // Once it ends, the rest goes as fast as it is acknowledged.
    let now = sim.now;
    sim.st.end(ID, now, &mut sim.out.fx);
    sim.serve();
    let before = sim.chunks(0).len();
    for _ in 0..100 {
        sim.answer(true);
    }
    assert!(sim.st.drained(ID));
    assert_eq!(sim.rebuilt(0).len(), sim.files[0].len());
    let drain = &sim.chunks(0)[before..];
    assert!(drain.len() > 30, "{}", drain.len());
    assert!(
        drain[..drain.len() - 1].iter().all(|c| c.1 == MAX_CHUNK),
        "the rest in whole chunks"
    );
}

#[test]
fn chunks_fit_the_brokers_packet_size_even_when_escaping_makes_them_longer() {
    let mut sim = Sim::new(settings(3000));
    sim.st.set_packet_limit(Some(65_536));
    // 300 000 bytes on one line: shipped in pieces that fit, none skipped.
    sim.write(0, &vec![b'x'; 300_000]);
    sim.write(0, b"\n");
    for t in 1..40 {
        sim.at(t * 250);
        sim.answer(true);
    }
    assert_eq!(sim.rebuilt(0).len(), 300_001);
    // Control characters take 6 bytes each in JSON: the chunk is cut further to fit.
    sim.write(1, &vec![0x01; 50_000]);
    sim.write(1, b"\n");
    for t in 40..80 {
        sim.at(t * 250);
        sim.answer(true);
    }
    assert_eq!(sim.rebuilt(1).len(), 50_001);
    for (_, body) in &sim.out.seen().published {
        let size = serde_json::to_vec(body).unwrap().len() as u64;
        assert!(size <= 65_536 - PACKET_OVERHEAD, "a body of {size} bytes");
    }
}

#[test]
fn a_log_over_max_log_bytes_keeps_its_newest_half_and_announces_what_was_dropped() {
    let mut s = settings(3000);
    s.max_log_bytes = 1000;
    let mut sim = Sim::new(s);
    sim.write(0, lines("a", 1, 50).as_bytes()); // 341 bytes
    sim.at(300);
    sim.answer(true);
    let first = lines("a", 1, 50).len() as u64;
    sim.write(0, lines("b", 1, 200).as_bytes()); // the file grows past 1000 bytes
    sim.at(600);
    // The read saw the file over the cap: it was cut to its newest 500 bytes, then read.
    let total = first + lines("b", 1, 200).len() as u64;
    let cut = total - 500;
    let c = sim.chunks(0);
    assert_eq!(c.len(), 2);
    let body = &sim.out.seen().published[1].1;
    assert_eq!(body["dropped"], cut - first, "cut bytes never shipped");
    assert_eq!(c[1].0, cut, "stream offsets go on past the cut");
    sim.answer(true);
    let cursor = sim.cursor.clone().unwrap();
    assert_eq!(cursor.stdout_base, cut);
    assert_eq!(cursor.stdout + cursor.stdout_base, total);
    // Later chunks carry the base in their offset and no second `dropped`.
    sim.write(0, b"tail\n");
    sim.at(1000);
    let last = &sim.out.seen().published.last().unwrap().1;
    assert_eq!(last["offset"], total);
    assert!(last.get("dropped").is_none());
}

#[test]
fn a_resumed_workload_continues_at_its_cursor() {
    let text = lines("x", 1, 10);
    let cursor = Cursor {
        stdout: 12,
        ..Cursor::default()
    };
    let mut sim = Sim::resumed(
        settings(3000),
        cursor,
        [text.clone().into_bytes(), Vec::new()],
    );
    sim.at(300);
    assert_eq!(sim.chunks(0)[0].0, 12, "from the acknowledged offset");
    sim.answer(true);
    assert_eq!(
        sim.cursor.as_ref().map(|c| c.stdout),
        Some(text.len() as u64)
    );
    assert!(
        !sim.out.seen().console[0].contains("] x 1\n"),
        "what was mirrored before the restart is not again"
    );
}

#[test]
fn standalone_counts_a_publish_as_delivered() {
    let mut s = settings(3000);
    s.standalone = true;
    let mut sim = Sim::new(s);
    sim.write(0, b"a\n");
    sim.at(300);
    sim.write(0, b"b\n");
    sim.at(600);
    assert_eq!(sim.rebuilt(0), "a\nb\n");
    assert_eq!(sim.cursor.as_ref().map(|c| c.stdout), Some(4));
}

#[test]
fn a_short_interval_is_the_upper_bound_of_the_window() {
    let mut sim = Sim::new(settings(100));
    sim.at(200);
    sim.write(0, b"fast\n");
    assert_eq!(sim.st.next_due(), Some(sim.t0 + Duration::from_millis(300)));
}

#[test]
fn install_logs_go_once_in_chunks_that_end_at_line_ends() {
    let mut st = Streams::default();
    let mut out = Fake::default();
    st.link(true, "inst-9", Instant::now());
    let big = "y".repeat(99) + "\n";
    st.ship_install([big.repeat(1000), "oops\n".into()], &mut out.fx);
    st.ship_install(["again\n".into(), String::new()], &mut out.fx);
    out.seen();
    assert!(st.install_shipped());
    let stdout: Vec<&Value> = out
        .install
        .iter()
        .filter(|b| b["log_type"] == "stdout")
        .collect();
    assert_eq!(stdout.len(), 2, "100 000 bytes in 64 KiB chunks");
    assert!(out
        .install
        .iter()
        .all(|b| b["source"] == "install" && b["instance_uuid"] == "inst-9"));
    let err: Vec<&Value> = out
        .install
        .iter()
        .filter(|b| b["log_type"] == "stderr")
        .collect();
    assert_eq!(err.len(), 1);
    assert_eq!(err[0]["log_content"], "oops");
}

#[test]
fn a_chunk_body_matches_the_wire_format() {
    let src = StreamSource {
        kind: "inference".into(),
        request_id: serde_json::json!(42),
        workload_uuid: None,
        logs: ["a".into(), "b".into()],
        cursor_path: "c".into(),
    };
    let body = chunk_body(
        "u\"1",
        1,
        b"tab\there \xff\n",
        &src,
        7,
        &Notes {
            dropped: 3,
            ..Notes::default()
        },
    );
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        v,
        serde_json::json!({
            "instance_uuid": "u\"1",
            "log_type": "stderr",
            "log_content": "tab\there \u{FFFD}",
            "workload_request_id": 42,
            "offset": 7,
            "length": 11,
            "dropped": 3,
        })
    );
}

/// D52 against the real tailer's reads on real files: one workload "w1" whose stdout log the
/// test (as the workload) truncates, replaces or makes sparse.
struct Disk {
    st: Streams,
    out: Fake,
    dir: std::path::PathBuf,
    now: Instant,
    answered: usize,
    /// The last cursor written.
    cursor: Cursor,
    /// How chunks are answered (false: refused).
    ok: bool,
}

impl Disk {
    fn new(name: &str) -> Disk {
        let dir = std::env::temp_dir().join(format!("cw-streams-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for l in ["out.log", "err.log"] {
            std::fs::write(dir.join(l), b"").unwrap();
        }
        let mut d = Disk {
            st: Streams::new(&settings(1000)),
            out: Fake::default(),
            dir,
            now: Instant::now(),
            answered: 0,
            cursor: Cursor::default(),
            ok: true,
        };
        d.restart();
        d
    }

    /// A new node on the same files, from the last cursor written.
    fn restart(&mut self) {
        self.st = Streams::new(&settings(1000));
        self.st.link(true, "inst-1", self.now);
        let cursor = serde_json::from_slice(&serde_json::to_vec(&self.cursor).unwrap()).unwrap();
        crate::store::Validate::validate(&cursor).unwrap();
        self.st.track(
            ID,
            StreamSource {
                kind: "training".into(),
                request_id: Value::from("req-1"),
                workload_uuid: Some("wl-1".into()),
                logs: [self.dir.join("out.log"), self.dir.join("err.log")],
                cursor_path: self.dir.join("cursor.json"),
            },
            cursor,
            self.now,
        );
    }

    fn log(&self) -> std::path::PathBuf {
        self.dir.join("out.log")
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(self.log())
            .unwrap();
        std::io::Write::write_all(&mut f, bytes).unwrap();
    }

    fn set_len(&mut self, len: u64) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(self.log())
            .unwrap()
            .set_len(len)
            .unwrap();
    }

    /// Lets the node see the file changed and ship everything there is (each chunk answered ok).
    fn settle(&mut self) {
        for _ in 0..100 {
            self.now += Duration::from_secs(1);
            let now = self.now;
            self.st.on_tail(Event::Grew(key(0)), now, &mut self.out.fx);
            self.serve();
            let before = self.answered;
            while self.answered < self.out.seen().published.len() {
                let k = self.out.seen().published[self.answered].0.clone();
                self.answered += 1;
                let ok = self.ok;
                self.st.on_ack(&k, ok, now, &mut self.out.fx);
                self.serve();
            }
            if (before == self.answered || !self.ok) && self.out.seen().tail.is_empty() {
                return;
            }
        }
        panic!("the stream never settled");
    }

    fn serve(&mut self) {
        while !self.out.seen().tail.is_empty() {
            for job in std::mem::take(&mut self.out.seen().tail) {
                let ev = match job {
                    Request::Read {
                        key,
                        path,
                        offset,
                        max,
                        marks,
                    } => Event::Chunk(crate::workload::tail::read(key, &path, offset, max, &marks)),
                    Request::Cut { key, path, keep } => Event::Cut {
                        key,
                        result: crate::workload::tail::cut_front(&path, keep),
                    },
                    Request::Persist { key, path, data } => {
                        self.cursor = serde_json::from_slice(&data).unwrap();
                        Event::Persisted {
                            key,
                            path,
                            result: Ok(()),
                        }
                    }
                    Request::Watch { .. } | Request::Unwatch(_) => continue,
                };
                let now = self.now;
                self.st.on_tail(ev, now, &mut self.out.fx);
            }
        }
    }

    /// The stdout chunks' bodies.
    fn bodies(&self) -> Vec<Value> {
        self.out
            .published
            .iter()
            .filter(|(k, _)| k.stream == 0)
            .map(|(_, b)| b.clone())
            .collect()
    }

    /// The stream as the backend rebuilds it by offset: no gap except one a chunk announces
    /// (`gap`, `dropped`), no offset that goes back, no NUL byte.
    fn rebuilt(&self) -> String {
        let mut text = String::new();
        let mut next = 0u64;
        let mut by_offset = BTreeMap::new();
        for b in self.bodies() {
            let offset = b["offset"].as_u64().unwrap();
            if let Some(had) = by_offset.insert(offset, b.clone()) {
                assert_eq!(had, b, "a chunk sent again is the same");
            }
        }
        for b in by_offset.into_values() {
            let offset = b["offset"].as_u64().unwrap();
            let len = b["length"].as_u64().unwrap();
            let mut content = b["log_content"].as_str().unwrap().to_string();
            assert!(!content.contains('\0'), "a NUL byte shipped: {b}");
            let said = b["gap"].as_u64().unwrap_or(0) + b["dropped"].as_u64().unwrap_or(0);
            assert_eq!(offset, next + said, "offsets are contiguous: {b}");
            if len as usize == content.len() + 1 {
                content.push('\n');
            }
            text.push_str(&content);
            next = offset + len;
        }
        text
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn a_log_truncated_to_zero_continues_with_what_is_written_after() {
    let mut d = Disk::new("trunc0");
    d.write(lines("old", 1, 5).as_bytes());
    d.settle();
    d.set_len(0);
    d.write(lines("new", 1, 3).as_bytes());
    d.settle();
    // Truncated again and longer than before when the node looks.
    d.set_len(0);
    d.write(lines("newer", 1, 20).as_bytes());
    d.settle();
    let want = lines("old", 1, 5) + &lines("new", 1, 3) + &lines("newer", 1, 20);
    assert_eq!(d.rebuilt(), want);
    let b = d.bodies();
    assert_eq!(b.len(), 3);
    assert!(b[0].get("truncated").is_none());
    assert_eq!(
        (b[1]["truncated"].clone(), b[2]["truncated"].clone()),
        (json!(true), json!(true))
    );
    let console: String = d.out.seen().console[0].replace("[workload wl-1 stdout] ", "");
    assert_eq!(console, want, "each line once on the console");
}

#[test]
fn a_log_truncated_to_a_middle_offset_loses_and_repeats_nothing() {
    let mut d = Disk::new("truncmid");
    for i in 1..=6 {
        d.write(format!("a {i}\n").as_bytes());
        d.settle();
    }
    d.set_len(lines("a", 1, 3).len() as u64);
    d.write(lines("b", 1, 10).as_bytes());
    d.settle();
    let want = lines("a", 1, 6) + &lines("b", 1, 10);
    assert_eq!(d.rebuilt(), want);
    let last = d.bodies().pop().unwrap();
    assert_eq!(last["truncated"], true);
    assert_eq!(last["log_content"], lines("b", 1, 10).trim_end());
    assert_eq!(
        d.out.seen().console[0].replace("[workload wl-1 stdout] ", ""),
        want
    );
}

#[test]
fn a_hole_in_the_middle_is_skipped_and_announced_as_a_gap() {
    let mut d = Disk::new("hole");
    d.write(b"before\n");
    d.settle();
    d.set_len(64 << 20);
    d.write(b"after\n");
    d.settle();
    assert_eq!(d.rebuilt(), "before\nafter\n");
    let b = d.bodies();
    assert_eq!(b.len(), 2);
    assert_eq!(b[1]["offset"], 64 << 20);
    assert_eq!(b[1]["gap"], (64 << 20) - 7);
    assert_eq!(
        d.out.seen().console[0],
        "[workload wl-1 stdout] before\n[workload wl-1 stdout] after\n"
    );
}

#[test]
fn a_hole_at_the_end_is_skipped_and_the_stream_drains() {
    let mut d = Disk::new("holeend");
    d.write(b"partial");
    d.settle();
    d.set_len(1 << 20);
    d.settle();
    let now = d.now;
    d.st.end(ID, now, &mut d.out.fx);
    d.settle();
    assert_eq!(d.rebuilt(), "partial");
    assert!(d.st.drained(ID), "{:?}", d.st.undrained(ID));
    assert_eq!(d.out.seen().console[0], "[workload wl-1 stdout] partial\n");
}

#[test]
fn a_huge_sparse_log_ships_only_its_text_in_milliseconds() {
    let t = Instant::now();
    let mut d = Disk::new("huge");
    d.write(b"x\n");
    d.settle();
    d.set_len(3 << 30);
    d.write(b"y\n");
    d.settle();
    assert_eq!(d.rebuilt(), "x\ny\n");
    assert_eq!(
        d.out.seen().console[0],
        "[workload wl-1 stdout] x\n[workload wl-1 stdout] y\n"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

#[test]
fn a_truncation_while_the_node_was_down_is_found_after_its_restart() {
    let mut d = Disk::new("restart");
    d.write(lines("old", 1, 5).as_bytes());
    d.settle();
    assert!(d.cursor.stdout_mark.is_some(), "the cursor keeps a mark");
    // The node is down; the workload truncates its log and writes more than it held.
    d.set_len(0);
    d.write(lines("new", 1, 20).as_bytes());
    d.restart();
    d.settle();
    assert_eq!(d.rebuilt(), lines("old", 1, 5) + &lines("new", 1, 20));
    assert_eq!(d.bodies().last().unwrap()["truncated"], true);
}

#[test]
fn the_truncated_note_goes_again_with_a_chunk_sent_again() {
    let mut d = Disk::new("resend");
    d.write(lines("old", 1, 5).as_bytes());
    d.settle();
    d.set_len(0);
    d.write(b"new\n");
    d.ok = false;
    d.settle();
    d.ok = true;
    d.settle();
    let b = d.bodies();
    assert!(b.len() >= 3, "refused, then sent again: {b:?}");
    assert!(b[1..].iter().all(|b| b["truncated"] == true), "{b:?}");
    assert_eq!(d.rebuilt(), lines("old", 1, 5) + "new\n");
}

#[test]
fn a_truncation_during_an_outage_is_mirrored_once_and_shipped_after_it() {
    let mut d = Disk::new("outage");
    d.write(lines("old", 1, 5).as_bytes());
    d.settle();
    let now = d.now;
    d.st.reset(now);
    d.st.link(false, "inst-1", now);
    d.set_len(0);
    d.write(lines("new", 1, 20).as_bytes());
    d.settle();
    let want = lines("old", 1, 5) + &lines("new", 1, 20);
    assert_eq!(
        d.out.seen().console[0].replace("[workload wl-1 stdout] ", ""),
        want,
        "mirrored once while disconnected"
    );
    let now = d.now;
    d.st.link(true, "inst-1", now);
    d.settle();
    assert_eq!(d.rebuilt(), want);
    assert_eq!(
        d.out.seen().console[0].replace("[workload wl-1 stdout] ", ""),
        want
    );
}

#[test]
fn a_cursor_mark_that_is_not_hex_or_past_the_cursor_is_refused() {
    use crate::store::Validate;
    let with = |end: u64, tail: &str| Cursor {
        stdout: 10,
        stdout_mark: Some(SavedMark {
            end,
            tail: tail.into(),
        }),
        ..Cursor::default()
    };
    assert!(with(10, "0a").validate().is_ok());
    let long = "00".repeat(MARK_BYTES + 1);
    for (end, tail) in [
        (11, "0a"),
        (10, "zz"),
        (10, "0"),
        (10, ""),
        (10, long.as_str()),
    ] {
        assert!(with(end, tail).validate().is_err(), "{end} {tail}");
    }
    assert!(
        with(0, "0a").validate().is_err(),
        "a mark longer than its end"
    );
    assert_eq!(
        with(10, "0a").stdout_mark.unwrap().mark(),
        Some(Mark {
            end: 10,
            tail: vec![10]
        })
    );
}

#[test]
fn text_with_nul_bytes_inside_goes_in_one_chunk_without_them() {
    let mut d = Disk::new("nulinside");
    d.write(&b"w\0i\0d\0e\0\n".repeat(100));
    d.settle();
    assert_eq!(d.bodies().len(), 1, "not a chunk per character");
    assert_eq!(d.rebuilt(), "wide\n".repeat(100).trim_end());
    assert_eq!(
        d.out.seen().console[0],
        "[workload wl-1 stdout] wide\n".repeat(100)
    );
}
