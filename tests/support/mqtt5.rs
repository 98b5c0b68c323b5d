//! A small MQTT v5 client for the fake backend, written for the tests.
//!
//! Why not Paho here: the Paho C library keeps process-wide state (one send and one receive
//! thread for every client in the process). The test binary runs many tests at once, each with
//! a backend client of its own, and tears clients down while their broker is being killed or
//! restarted; that is where Paho C has known races (eclipse-paho/paho.mqtt.c #1194, #1621,
//! #1622), and one of them aborted a CI run with `free(): double free detected`. The node keeps
//! Paho (one client, never destroyed while running); the test process has none.
//!
//! What it does: CONNECT (clean start) and SUBSCRIBE (QoS 1) on every (re)connect, QoS 1
//! PUBLISH out with an optional wait for the PUBACK, PUBLISH in (QoS 0/1, acknowledged at once)
//! with the response topic, correlation data and user properties, PINGREQ every 10 s, and a
//! reconnect every 100 ms after the broker goes away until the client is dropped.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender};

/// A PUBLISH that arrived.
pub struct Incoming {
    pub topic: String,
    pub payload: Vec<u8>,
    pub response_topic: Option<String>,
    pub correlation: Option<Vec<u8>>,
    pub user: Vec<(String, String)>,
}

type Handler = Box<dyn Fn(&Client, Incoming) + Send + Sync>;

struct Inner {
    port: u16,
    client_id: String,
    topics: Vec<String>,
    handler: Handler,
    /// The live connection's write half; `None` while disconnected.
    writer: Mutex<Option<TcpStream>>,
    /// Who waits for which PUBACK / SUBACK.
    waiting: Mutex<HashMap<u16, Sender<bool>>>,
    next_id: AtomicU16,
    closed: AtomicBool,
}

#[derive(Clone)]
pub struct Client(Arc<Inner>);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Client {
    /// Connects, subscribes to `topics` (QoS 1) and returns once the SUBACK is in; then keeps
    /// the session up (reconnecting and resubscribing) until [`Client::close`].
    pub fn connect(
        port: u16,
        client_id: &str,
        topics: Vec<String>,
        handler: impl Fn(&Client, Incoming) + Send + Sync + 'static,
    ) -> Result<Client, String> {
        let client = Client(Arc::new(Inner {
            port,
            client_id: client_id.to_string(),
            topics,
            handler: Box::new(handler),
            writer: Mutex::new(None),
            waiting: Mutex::new(HashMap::new()),
            next_id: AtomicU16::new(1),
            closed: AtomicBool::new(false),
        }));
        // A just-started broker (or one on a loaded machine) may refuse or drop the first
        // connection: try for a while before giving up.
        let mut tries = 0;
        let reader = loop {
            match client.session() {
                Ok(r) => break r,
                Err(e) if tries >= 50 => return Err(e),
                Err(_) => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
            }
        };
        let c = client.clone();
        std::thread::Builder::new()
            .name("fake-backend-mqtt".into())
            .spawn(move || c.run(reader))
            .map_err(|e| e.to_string())?;
        Ok(client)
    }

    /// Stops the client for good: no reconnect, the socket is shut.
    pub fn close(&self) {
        self.0.closed.store(true, Ordering::SeqCst);
        if let Some(s) = lock(&self.0.writer).take() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn packet_id(&self) -> u16 {
        loop {
            let id = self.0.next_id.fetch_add(1, Ordering::Relaxed);
            if id != 0 {
                return id;
            }
        }
    }

    /// One connection: CONNECT, CONNACK, then [`Client::subscribe`]. Returns the read half.
    fn session(&self) -> Result<TcpStream, String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.0.port)).map_err(|e| e.to_string())?;
        let _ = s.set_nodelay(true);
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        let mut body = Vec::new();
        put_str(&mut body, "MQTT");
        body.push(5); // protocol version
        body.push(0x02); // clean start
        body.extend_from_slice(&60u16.to_be_bytes()); // keep alive
        body.push(0); // no properties
        put_str(&mut body, &self.0.client_id);
        s.write_all(&packet(0x10, &body))
            .map_err(|e| e.to_string())?;
        let (kind, connack) = read_packet(&mut s)?;
        if kind >> 4 != 2 || connack.get(1).copied() != Some(0) {
            return Err(format!("broker refused the connection: {connack:?}"));
        }
        let w = s.try_clone().map_err(|e| e.to_string())?;
        *lock(&self.0.writer) = Some(w);
        let subscribed = self.subscribe(&mut s);
        if subscribed.is_err() {
            *lock(&self.0.writer) = None;
        }
        subscribed.map(|_| s)
    }

    fn subscribe(&self, s: &mut TcpStream) -> Result<(), String> {
        let id = self.packet_id();
        let mut body = id.to_be_bytes().to_vec();
        body.push(0); // no properties
        for t in &self.0.topics {
            put_str(&mut body, t);
            body.push(1); // QoS 1
        }
        self.write(&packet(0x82, &body))?;
        // Anything else that arrives before the SUBACK is handled as usual.
        loop {
            let (kind, rest) = read_packet(s)?;
            if kind >> 4 == 9 && rest.get(..2) == Some(&id.to_be_bytes()[..]) {
                let codes = rest.get(2..).map(skip_properties).unwrap_or_default();
                if codes.iter().any(|c| *c >= 0x80) {
                    return Err(format!("broker refused a subscription: {codes:?}"));
                }
                return s.set_read_timeout(None).map_err(|e| e.to_string());
            }
            self.dispatch(kind, rest);
        }
    }

    /// Reads until the connection drops, then reconnects (every 100 ms) until closed.
    fn run(&self, mut reader: TcpStream) {
        loop {
            let pinger = self.clone();
            let alive = Arc::new(AtomicBool::new(true));
            let a = alive.clone();
            std::thread::spawn(move || {
                while a.load(Ordering::SeqCst) {
                    for _ in 0..100 {
                        std::thread::sleep(Duration::from_millis(100));
                        if !a.load(Ordering::SeqCst) {
                            return;
                        }
                    }
                    let _ = pinger.write(&[0xC0, 0]);
                }
            });
            while let Ok((kind, body)) = read_packet(&mut reader) {
                self.dispatch(kind, body);
            }
            alive.store(false, Ordering::SeqCst);
            *lock(&self.0.writer) = None;
            for (_, w) in lock(&self.0.waiting).drain() {
                let _ = w.send(false);
            }
            reader = loop {
                if self.0.closed.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
                if let Ok(r) = self.session() {
                    break r;
                }
            };
            if self.0.closed.load(Ordering::SeqCst) {
                self.close();
                return;
            }
        }
    }

    fn dispatch(&self, kind: u8, body: Vec<u8>) {
        match kind >> 4 {
            3 => {
                let qos = (kind >> 1) & 3;
                if let Some((msg, id)) = parse_publish(&body, qos) {
                    if let Some(id) = id {
                        let mut ack = vec![0x40, 2];
                        ack.extend_from_slice(&id.to_be_bytes());
                        let _ = self.write(&ack);
                    }
                    (self.0.handler)(self, msg);
                }
            }
            4 => {
                if let Some(id) = body.get(..2) {
                    let id = u16::from_be_bytes([id[0], id[1]]);
                    let ok = body.get(2).is_none_or(|rc| *rc < 0x80);
                    if let Some(w) = lock(&self.0.waiting).remove(&id) {
                        let _ = w.send(ok);
                    }
                }
            }
            _ => {} // PINGRESP, SUBACK of nothing, DISCONNECT (the read fails next)
        }
    }

    fn write(&self, bytes: &[u8]) -> Result<(), String> {
        match lock(&self.0.writer).as_mut() {
            Some(s) => s.write_all(bytes).map_err(|e| e.to_string()),
            None => Err("not connected".into()),
        }
    }

    /// Publishes at QoS 1; the receiver hears `true` on the PUBACK (`false` if the connection
    /// dropped first). Fails at once while disconnected.
    pub fn publish(
        &self,
        topic: &str,
        payload: &[u8],
        correlation: Option<&[u8]>,
    ) -> Result<Receiver<bool>, String> {
        let id = self.packet_id();
        let mut body = Vec::new();
        put_str(&mut body, topic);
        body.extend_from_slice(&id.to_be_bytes());
        let mut props = Vec::new();
        if let Some(c) = correlation {
            props.push(0x09);
            put_bin(&mut props, c);
        }
        put_varint(&mut body, props.len());
        body.extend_from_slice(&props);
        body.extend_from_slice(payload);
        let (tx, rx) = bounded(1);
        lock(&self.0.waiting).insert(id, tx);
        let sent = self.write(&packet(0x32, &body));
        if sent.is_err() {
            lock(&self.0.waiting).remove(&id);
        }
        sent.map(|_| rx)
    }

    /// Publishes at QoS 1 and waits up to `timeout` for the broker's PUBACK.
    pub fn publish_acked(&self, topic: &str, payload: &[u8], timeout: Duration) -> bool {
        self.publish(topic, payload, None)
            .ok()
            .and_then(|rx| rx.recv_timeout(timeout).ok())
            .unwrap_or(false)
    }
}

fn packet(first: u8, body: &[u8]) -> Vec<u8> {
    let mut p = vec![first];
    put_varint(&mut p, body.len());
    p.extend_from_slice(body);
    p
}

fn put_varint(out: &mut Vec<u8>, mut n: usize) {
    loop {
        let mut b = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            b |= 0x80;
        }
        out.push(b);
        if n == 0 {
            return;
        }
    }
}

fn put_bin(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u16).to_be_bytes());
    out.extend_from_slice(b);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_bin(out, s.as_bytes());
}

fn read_packet(s: &mut TcpStream) -> Result<(u8, Vec<u8>), String> {
    let mut first = [0u8; 1];
    s.read_exact(&mut first).map_err(|e| e.to_string())?;
    let (mut len, mut shift) = (0usize, 0);
    loop {
        let mut b = [0u8; 1];
        s.read_exact(&mut b).map_err(|e| e.to_string())?;
        len |= usize::from(b[0] & 0x7F) << shift;
        if b[0] & 0x80 == 0 {
            break;
        }
        shift += 7;
        if shift > 21 {
            return Err("malformed remaining length".into());
        }
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).map_err(|e| e.to_string())?;
    Ok((first[0], body))
}

/// A cursor over a packet body.
struct Cur<'a>(&'a [u8]);

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    fn bin(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()?;
        self.take(usize::from(n))
    }
    fn string(&mut self) -> Option<String> {
        self.bin().map(|b| String::from_utf8_lossy(b).into_owned())
    }
    fn varint(&mut self) -> Option<usize> {
        let (mut n, mut shift) = (0usize, 0);
        loop {
            let b = self.u8()?;
            n |= usize::from(b & 0x7F) << shift;
            if b & 0x80 == 0 {
                return Some(n);
            }
            shift += 7;
            if shift > 21 {
                return None;
            }
        }
    }
}

/// What follows a properties block (the SUBACK reason codes).
fn skip_properties(b: &[u8]) -> Vec<u8> {
    let mut c = Cur(b);
    let Some(n) = c.varint() else {
        return Vec::new();
    };
    if c.take(n).is_none() {
        return Vec::new();
    }
    c.0.to_vec()
}

fn parse_publish(body: &[u8], qos: u8) -> Option<(Incoming, Option<u16>)> {
    let mut c = Cur(body);
    let topic = c.string()?;
    let id = if qos > 0 { Some(c.u16()?) } else { None };
    let plen = c.varint()?;
    let mut p = Cur(c.take(plen)?);
    let mut msg = Incoming {
        topic,
        payload: Vec::new(),
        response_topic: None,
        correlation: None,
        user: Vec::new(),
    };
    while !p.0.is_empty() {
        match p.varint()? {
            0x01 | 0x24 | 0x25 | 0x28 | 0x29 | 0x2A | 0x17 | 0x19 => {
                p.u8()?;
            }
            0x02 | 0x11 | 0x18 | 0x27 => {
                p.take(4)?;
            }
            0x13 | 0x21 | 0x22 | 0x23 => {
                p.u16()?;
            }
            0x0B => {
                p.varint()?;
            }
            0x08 => msg.response_topic = Some(p.string()?),
            0x09 => msg.correlation = Some(p.bin()?.to_vec()),
            0x26 => {
                let k = p.string()?;
                let v = p.string()?;
                msg.user.push((k, v));
            }
            // content type, assigned client id, auth method/data, response information,
            // server reference, reason string: all length-prefixed.
            0x03 | 0x12 | 0x15 | 0x16 | 0x1A | 0x1C | 0x1F => {
                p.bin()?;
            }
            _ => return None,
        }
    }
    msg.payload = c.0.to_vec();
    Some((msg, id))
}

// ---- a scripted broker ------------------------------------------------------------------------

/// What a [`ScriptedBroker`] does; change it between connections with [`ScriptedBroker::set`].
#[derive(Clone, Default)]
pub struct Script {
    /// Never answer a CONNECT (a cluster node still taking the session over).
    pub hold_connack: bool,
    /// Answer a v5 CONNECT as a v3.1.1-only broker does: a v3 CONNACK with return code 1
    /// ("unacceptable protocol version"), then close.
    pub v3_only: bool,
    /// Refuse the connection with this v5 CONNACK reason (0: accept).
    pub connack_reason: u8,
    /// Raw v5 properties of an accepting CONNACK (Maximum QoS, Receive Maximum, …).
    pub connack_props: Vec<u8>,
    /// Close this many connections right after their CONNACK (counts down).
    pub drop_after_connack: u32,
    /// SUBACK reason for every filter containing this text (granted QoS 1 for the others).
    pub refuse_filter: Option<(String, u8)>,
    /// Grant at most this QoS in SUBACK (default 1).
    pub grant_qos: Option<u8>,
    /// Close the connection, without PUBACK, on a PUBLISH packet over this many bytes.
    pub drop_publish_over: Option<usize>,
    /// Never send PUBACK: the client's QoS 1 messages stay in flight.
    pub withhold_puback: bool,
    /// Once a filter containing the first text is subscribed, publish the second to it (once).
    pub command: Option<(String, Vec<u8>)>,
}

/// A CONNECT the broker saw.
#[derive(Clone, Debug)]
pub struct SeenConnect {
    pub version: u8,
    pub clean_start: bool,
    /// QoS 1 PUBLISHes the broker received from this client id and never acknowledged (the
    /// client holds them in flight) when this CONNECT came.
    pub unacked: usize,
    pub at: std::time::Instant,
}

#[derive(Default)]
struct Seen {
    connects: Vec<SeenConnect>,
    /// (topic, packet size, qos) of every PUBLISH received.
    publishes: Vec<(String, usize, u8)>,
    /// The first 4 KiB of each PUBLISH's body (topic, properties, payload).
    bodies: Vec<Vec<u8>>,
    /// Packet ids of QoS 1 PUBLISHes never acknowledged.
    unacked: std::collections::BTreeSet<u16>,
    drops_after_publish: usize,
    command_sent: bool,
}

/// A fake MQTT v5 broker on a free loopback port whose answers a test scripts: refused
/// subscriptions, a v3-only or a refusing CONNACK, a held CONNACK, a drop after a large publish,
/// a drop right after CONNACK. One thread per connection; it records what the client sent.
pub struct ScriptedBroker {
    pub port: u16,
    script: Arc<Mutex<Script>>,
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    /// The live connections (for [`ScriptedBroker::kick`]).
    live: Arc<Mutex<Vec<TcpStream>>>,
}

impl ScriptedBroker {
    pub fn start(script: Script) -> ScriptedBroker {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let b = ScriptedBroker {
            port,
            script: Arc::new(Mutex::new(script)),
            seen: Arc::new(Mutex::new(Seen::default())),
            stop: Arc::new(AtomicBool::new(false)),
            live: Arc::new(Mutex::new(Vec::new())),
        };
        let (script, seen, stop) = (b.script.clone(), b.seen.clone(), b.stop.clone());
        let live = b.live.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                if let Ok(c) = conn.try_clone() {
                    lock(&live).push(c);
                }
                let (script, seen, stop) = (script.clone(), seen.clone(), stop.clone());
                std::thread::spawn(move || serve(conn, &script, &seen, &stop));
            }
        });
        b
    }

    /// Changes the script (for the connections that follow, and the live one's next packet).
    pub fn set(&self, f: impl FnOnce(&mut Script)) {
        f(&mut lock(&self.script));
    }

    pub fn connects(&self) -> Vec<SeenConnect> {
        lock(&self.seen).connects.clone()
    }

    /// (topic, packet size, qos) of every PUBLISH the client sent.
    pub fn publishes(&self) -> Vec<(String, usize, u8)> {
        lock(&self.seen).publishes.clone()
    }

    /// How many PUBLISHes the client sent whose first 4 KiB contain `needle`.
    pub fn publishes_containing(&self, needle: &str) -> usize {
        lock(&self.seen)
            .bodies
            .iter()
            .filter(|b| String::from_utf8_lossy(b).contains(needle))
            .count()
    }

    /// Drops every live connection (as a broker restart or a network cut would).
    pub fn kick(&self) {
        for s in lock(&self.live).drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// How often the broker closed a connection on a PUBLISH over `drop_publish_over`.
    pub fn drops_after_publish(&self) -> usize {
        lock(&self.seen).drops_after_publish
    }
}

impl Drop for ScriptedBroker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn serve(mut s: TcpStream, script: &Mutex<Script>, seen: &Mutex<Seen>, stop: &AtomicBool) {
    let _ = s.set_nodelay(true);
    let mut held = false;
    // Until the client closes the connection (a node that exits does).
    loop {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok((kind, body)) = read_packet(&mut s) else {
            return;
        };
        let sc = lock(script).clone();
        if held {
            continue;
        }
        match kind >> 4 {
            1 => {
                let mut c = Cur(&body);
                let _ = c.string();
                let version = c.u8().unwrap_or(0);
                let flags = c.u8().unwrap_or(0);
                let present = {
                    let mut seen = lock(seen);
                    let unacked = seen.unacked.len();
                    let present = flags & 0x02 == 0 && !seen.connects.is_empty();
                    seen.connects.push(SeenConnect {
                        version,
                        clean_start: flags & 0x02 != 0,
                        unacked,
                        at: std::time::Instant::now(),
                    });
                    if flags & 0x02 != 0 {
                        seen.unacked.clear();
                    }
                    present
                };
                if sc.hold_connack {
                    held = true;
                    continue;
                }
                if sc.v3_only && version != 4 {
                    let _ = s.write_all(&[0x20, 2, 0, 1]);
                    return;
                }
                // Session present: the broker keeps sessions, as mosquitto does.
                let mut b = vec![
                    u8::from(present && sc.connack_reason == 0),
                    sc.connack_reason,
                ];
                put_varint(&mut b, sc.connack_props.len());
                b.extend_from_slice(&sc.connack_props);
                let _ = s.write_all(&packet(0x20, &b));
                if sc.connack_reason != 0 {
                    return;
                }
                if sc.drop_after_connack > 0 {
                    lock(script).drop_after_connack -= 1;
                    std::thread::sleep(Duration::from_millis(50));
                    let _ = s.shutdown(Shutdown::Both);
                    return;
                }
            }
            3 => {
                let qos = (kind >> 1) & 3;
                let mut len_bytes = Vec::new();
                put_varint(&mut len_bytes, body.len());
                let size = 1 + len_bytes.len() + body.len();
                let mut c = Cur(&body);
                let topic = c.string().unwrap_or_default();
                let id = if qos > 0 { c.u16() } else { None };
                {
                    let mut seen = lock(seen);
                    seen.publishes.push((topic, size, qos));
                    seen.bodies.push(body.get(..4096).unwrap_or(&body).to_vec());
                }
                if sc.drop_publish_over.is_some_and(|n| size > n) {
                    let mut seen = lock(seen);
                    seen.drops_after_publish += 1;
                    if let Some(id) = id {
                        seen.unacked.insert(id);
                    }
                    drop(seen);
                    let _ = s.shutdown(Shutdown::Both);
                    return;
                }
                if let Some(id) = id {
                    if sc.withhold_puback {
                        lock(seen).unacked.insert(id);
                    } else {
                        lock(seen).unacked.remove(&id);
                        let mut ack = vec![0x40, 2];
                        ack.extend_from_slice(&id.to_be_bytes());
                        let _ = s.write_all(&ack);
                    }
                }
            }
            8 => {
                let mut c = Cur(&body);
                let id = c.u16().unwrap_or(0);
                let plen = c.varint().unwrap_or(0);
                let _ = c.take(plen);
                let mut codes = Vec::new();
                let mut filters = Vec::new();
                while let Some(f) = c.string() {
                    let opts = c.u8().unwrap_or(1);
                    let code = match &sc.refuse_filter {
                        Some((needle, code)) if f.contains(needle.as_str()) => *code,
                        _ => (opts & 3).min(sc.grant_qos.unwrap_or(1)),
                    };
                    codes.push(code);
                    filters.push(f);
                }
                let mut b = id.to_be_bytes().to_vec();
                b.push(0);
                b.extend_from_slice(&codes);
                let _ = s.write_all(&packet(0x90, &b));
                if let Some((needle, payload)) = &sc.command {
                    let target = filters.iter().find(|f| f.contains(needle.as_str()));
                    let mut seen = lock(seen);
                    if let (Some(t), false) = (target, seen.command_sent) {
                        seen.command_sent = true;
                        let mut b = Vec::new();
                        put_str(&mut b, t);
                        b.extend_from_slice(&0x7001u16.to_be_bytes());
                        b.push(0);
                        b.extend_from_slice(payload);
                        let _ = s.write_all(&packet(0x32, &b));
                    }
                }
            }
            10 => {
                let id = body.get(..2).map(|b| [b[0], b[1]]).unwrap_or([0, 0]);
                let _ = s.write_all(&[0xB0, 4, id[0], id[1], 0, 0]);
            }
            12 => {
                let _ = s.write_all(&[0xD0, 0]);
            }
            14 => return,
            _ => {} // PUBACK of the command, and the rest
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_round_trips_through_the_parser() {
        let mut body = Vec::new();
        put_str(&mut body, "a/b");
        body.extend_from_slice(&7u16.to_be_bytes());
        let mut props = vec![0x08];
        put_str(&mut props, "inbox");
        props.push(0x09);
        put_bin(&mut props, b"corr");
        props.push(0x26);
        put_str(&mut props, "X-API-Token");
        put_str(&mut props, "tok");
        props.push(0x02);
        props.extend_from_slice(&5u32.to_be_bytes());
        put_varint(&mut body, props.len());
        body.extend_from_slice(&props);
        body.extend_from_slice(b"{}");
        let (m, id) = parse_publish(&body, 1).expect("parses");
        assert_eq!(id, Some(7));
        assert_eq!(m.topic, "a/b");
        assert_eq!(m.response_topic.as_deref(), Some("inbox"));
        assert_eq!(m.correlation.as_deref(), Some(&b"corr"[..]));
        assert_eq!(m.user, vec![("X-API-Token".into(), "tok".into())]);
        assert_eq!(m.payload, b"{}");
    }

    #[test]
    fn varint_encodes_the_spec_examples() {
        for (n, want) in [
            (0usize, vec![0u8]),
            (127, vec![0x7F]),
            (128, vec![0x80, 0x01]),
            (16_383, vec![0xFF, 0x7F]),
            (2_097_152, vec![0x80, 0x80, 0x80, 0x01]),
        ] {
            let mut v = Vec::new();
            put_varint(&mut v, n);
            assert_eq!(v, want);
            assert_eq!(Cur(&v).varint(), Some(n));
        }
    }
}
