//! The loop's I/O handles as one value: the MQTT client and its naming, the feeders' channels
//! (broker events, reaped pids, spawn outcomes, log growth, worker results, acknowledgements,
//! control-socket requests, GPU snapshots) and the threads the loop sends work to (tailer,
//! workers, the ack thread, the GPU monitor), and the replies to the backend's commands
//! published on them ([`Replies`]). The parts never see it: the broker session reaches the
//! world through [`MqttLink`], built from these handles for the length of one call, and the
//! other parts return [`super::effect::Effect`]s that are carried out on them.

use std::io::Write;
use std::path::PathBuf;
use std::time::SystemTime;

use std::time::Duration;

use crossbeam_channel::{unbounded, Receiver, Sender};

use serde_json::{json, Value};

use super::effect::Effect;
use super::parts::Op;
use super::session::Session;
use crate::config::credentials::Identity;
use crate::config::Settings;
use crate::store::CLIENT_ID_CONFLICT;
use crate::workload::{self, Layout};

use crate::mqtt::{Mqtt, MqttEvent};
use crate::protocol::commands;
use crate::protocol::topics::Topics;
use crate::workers::{Done, Workers};
use crate::workload::reaper::Reaped;
use crate::workload::tail::{Event as TailEvent, Tailer};

/// The PUBACK of an ingress event: `Ok`, or `Err(Some((why, permanent)))` when the broker
/// refused it, `Err(None)` when no acknowledgement came.
pub type Acked = (u64, Result<(), Option<(String, bool)>>);
/// An ingress event's sequence number and its delivery token, for the ack thread.
pub type AwaitedAck = (u64, paho_mqtt::DeliveryToken);

/// Waits for delivery tokens, in order, off the event loop.
pub fn start_ack_thread() -> std::io::Result<(Sender<AwaitedAck>, Receiver<Acked>)> {
    let (tx, rx) = unbounded::<AwaitedAck>();
    let (atx, arx) = unbounded();
    std::thread::Builder::new()
        .name("acks".into())
        .spawn(move || {
            for (seq, token) in rx {
                let result = token.wait_for(Duration::from_secs(30)).map(|_| ());
                let acked = match crate::mqtt::refusal_of(&result) {
                    Some(refused) => Err(Some(refused)),
                    None => result.map_err(|_| None),
                };
                if atx.send((seq, acked)).is_err() {
                    return;
                }
            }
        })?;
    Ok((tx, arx))
}

pub struct Io {
    /// Time, injected so timers can be driven in tests without sleeping.
    pub clock: Box<dyn super::parts::Clock>,
    /// The state dir's layout.
    pub layout: Layout,
    pub mqtt: Mqtt,
    pub events: Receiver<MqttEvent>,
    pub topics: Topics,
    /// The node token every request carries.
    pub token: String,
    /// The reaper thread, told of each supervisor the table tracks (it ends once no handle
    /// is left).
    pub reaper: crate::workload::reaper::Reaper,
    pub reaped: Receiver<Reaped>,
    pub tailer: Tailer,
    pub chunks: Receiver<TailEvent>,
    pub workers: Workers,
    pub worker_done: Receiver<Done>,
    pub acks_tx: Sender<AwaitedAck>,
    pub acked: Receiver<Acked>,
    pub control: Receiver<crate::control::Request>,
    pub gpu_rx: Receiver<crate::gpu::Snapshot>,
    /// The GPU monitor thread (none when it could not start).
    pub gpu_monitor: Option<crate::gpu::Monitor>,
    /// Removes retired workload directories off the loop.
    pub sweeper: crate::store::Sweeper,
    /// The users workloads run as (`workload_user`, D46.3; several: a pool, D65); empty: the
    /// node's own.
    pub users: Vec<crate::workload::user::WorkloadUser>,
}

impl Io {
    /// The broker session's [`super::session::Link`] on these handles.
    pub fn link<'a>(&'a self, s: &Settings) -> MqttLink<'a> {
        MqttLink {
            io: self,
            identity_path: s.identity_path(),
            state: &self.layout.state,
        }
    }
}

/// What the session does to the world, done with the node's MQTT client and state dir.
pub struct MqttLink<'a> {
    pub io: &'a Io,
    identity_path: PathBuf,
    state: &'a std::path::Path,
}

impl super::session::Link for MqttLink<'_> {
    fn connect(&mut self) {
        self.io.mqtt.start_connect();
    }
    fn is_connected(&self) -> bool {
        self.io.mqtt.is_connected()
    }
    fn endpoint(&self) -> String {
        self.io.mqtt.endpoint()
    }
    fn endpoint_count(&self) -> usize {
        self.io.mqtt.endpoint_count()
    }
    fn next_endpoint(&mut self) {
        self.io.mqtt.next_endpoint();
    }
    fn subscribe(&mut self, topics: &[String]) {
        self.io.mqtt.subscribe(topics);
    }
    fn subscribe_confirmed(&mut self, topics: &[String]) {
        self.io.mqtt.subscribe_confirmed(topics);
    }
    fn unsubscribe(&mut self, topic: &str) {
        self.io.mqtt.unsubscribe(topic);
    }
    fn request(&mut self, topic: &str, payload: Vec<u8>, correlation: &[u8]) {
        self.io.mqtt.publish_request(
            topic,
            payload,
            &self.io.topics.inbox(),
            correlation,
            &self.io.token,
        );
    }
    fn save_identity(&mut self, identity: &Identity) -> Result<(), String> {
        identity
            .save(&self.identity_path)
            .map_err(|e| format!("{}: {e}", self.identity_path.display()))
    }
    fn mark_client_id_conflict(&mut self) {
        let marker = self.state.join(CLIENT_ID_CONFLICT);
        let _ = crate::store::write_atomic(
            &marker,
            crate::util::rfc3339(SystemTime::now()).as_bytes(),
            0o600,
        );
    }
    fn notify(&mut self, state: &str) {
        crate::systemd::notify(state);
    }
}

/// Replies to the backend's commands, on the node's MQTT client and under its session's names.
pub(super) struct Replies<'a> {
    pub(super) io: &'a Io,
    pub(super) session: &'a Session<Op>,
}

impl Replies<'_> {
    pub(super) fn ok(&self, request_id: &Value, output: Value) {
        self.publish(true, request_id, output);
    }

    pub(super) fn error(&self, request_id: &Value, error: &str) {
        self.publish(false, request_id, json!(error));
    }

    /// The answer a request had before, again (the ledger's `ok` output or `error` text).
    pub(super) fn replay(&self, request_id: &Value, ok: bool, body: Value) {
        if ok {
            self.ok(request_id, body)
        } else {
            self.error(request_id, body.as_str().unwrap_or(""))
        }
    }

    fn publish(&self, ok: bool, request_id: &Value, body: Value) {
        let (slug, uuid) = (self.session.slug(), self.session.uuid());
        let payload = commands::reply(ok, request_id, slug, uuid, body);
        let topic = self.io.topics.reply(uuid);
        // D12: QoS 1 so a reply survives a short outage (Paho buffers it).
        self.io
            .mqtt
            .publish(&topic, payload, 1, paho_mqtt::Properties::new());
    }
}

/// Carries out an effect that needs no more than the broker session and the I/O handles
/// (requests are kept by the session until their reply); returns the ones that need the
/// node's other parts ([`Effect::ShipLogs`], [`Effect::Report`]).
pub(super) fn send(e: Effect, session: &mut Session<Op>, io: &Io, s: &Settings) -> Option<Effect> {
    let timeout = s.tuning.request_timeout;
    let now = io.clock.now();
    let link = &mut io.link(s);
    match e {
        Effect::WorkloadStatus { wl, body } => {
            let topic = io.topics.workload_status(&wl);
            session.request(Op::WorkloadStatus, &topic, &body, timeout, now, link);
        }
        Effect::AskSignedUrl { id, wl, filename } => {
            let topic = io.topics.signed_url(&wl);
            let body = json!({ "filename": filename });
            session.request(Op::SignedUrl(id), &topic, &body, timeout, now, link);
        }
        Effect::TellUploaded { id, wl, body } => {
            let topic = io.topics.upload_results(&wl);
            session.request(Op::UploadResults(id), &topic, &body, timeout, now, link);
        }
        Effect::Submit(job) => io.workers.submit(job),
        Effect::SaveMeta { meta, what } => {
            if let Err(e) = workload::save_meta(&io.layout, &meta) {
                let id = crate::logtext::shown(&meta.safe_id);
                log::warn!("workload {id}: cannot record {what}: {e}");
            }
        }
        Effect::Retire(id) => retire(&io.layout, &io.sweeper, &id),
        Effect::Tail(req) => io.tailer.request(req),
        Effect::PublishLog { key, payload } => {
            let topic = io.topics.logs(session.uuid());
            session.request_payload(Op::Log(key), &topic, payload, timeout, now, link);
        }
        Effect::PublishInstall(payload) => {
            let topic = io.topics.logs(session.uuid());
            session.request_payload(Op::WorkloadStatus, &topic, payload, timeout, now, link);
        }
        Effect::Mirror { stream, text } => mirror(stream, &text),
        e @ (Effect::ShipLogs | Effect::Report { .. }) => return Some(e),
    }
    None
}

/// Tagged lines of a workload's output on the node's stdout (stream 0) or stderr.
fn mirror(stream: usize, text: &[u8]) {
    static WIDEN: std::sync::Once = std::sync::Once::new();
    WIDEN.call_once(|| {
        // A journal or a terminal multiplexer reads the node's stdout and stderr through a
        // pipe of 64 KiB: a flood's console lines then cost a context switch per 64 KiB.
        // A wider pipe (1 MiB, the default most a user may ask for) lets one write go at
        // once. Not a pipe (a file, a terminal): nothing changes.
        for fd in [1, 2] {
            // SAFETY: F_SETPIPE_SZ on a standard descriptor touches no memory; failures
            // (not a pipe, a lower limit) are harmless and ignored.
            unsafe { libc::fcntl(fd, libc::F_SETPIPE_SZ, 1 << 20) };
        }
    });
    if stream == 0 {
        let mut o = std::io::stdout().lock();
        let _ = o.write_all(text);
        let _ = o.flush();
    } else {
        let mut e = std::io::stderr().lock();
        let _ = e.write_all(text);
        let _ = e.flush();
    }
}

/// Removes a reported workload's directory: first an atomic rename (so a crash never leaves
/// a half-deleted record that a restart would misread), then the deletion, off the loop.
fn retire(layout: &Layout, sweeper: &crate::store::Sweeper, safe_id: &str) {
    let dir = layout.dir(safe_id);
    let trash = layout.workloads().join(format!(".retired-{safe_id}"));
    let target = match std::fs::rename(&dir, &trash) {
        Ok(()) => trash,
        Err(e) => {
            log::warn!(
                "cannot retire {}: {e}",
                crate::logtext::shown(&dir.display().to_string())
            );
            return;
        }
    };
    sweeper.sweep(target);
}
