//! `./scripts/bench brokers [KILLS]`: a 64 KiB-line flood on each broker, then failover on a
//! clustered broker. `CW_BROKERS_CASES` (default `flood,failover`) chooses.
//!
//! Flood: on mosquitto, rumqttd 0.20 (100 KiB `max_payload_size`, unannounced), one rmqtt 0.24
//! node and the 3-node rmqtt raft cluster, the real node (production back-off) runs a workload
//! printing one 64 KiB line about every 100 ms for `CW_FLOOD_SECONDS` (default 60); one line per
//! broker: minutes, connection losses ("MQTT connection problem" in the node's log) per minute,
//! whether the node still runs, stdout bytes against log bytes received, completions.
//!
//! Failover:
//! A 3-node rmqtt cluster on loopback (its broadcast plugin, then its raft plugin), built once by
//! `scripts/bench` from rmqtt's crates (`benches/rmqtt/`, path in `CW_RMQTT_BIN`). The fake
//! backend sits on cluster node 1, which is never killed; the real node lists nodes 2 and 3 as
//! its endpoints and runs a workload streaming numbered log lines. KILLS times (default 5), the
//! cluster node the node is on is killed (SIGKILL), and two clocks start:
//!
//! - the broker's own recovery: a probe client that was on the killed node, with the same kind
//!   of MQTT v5 connect as the node's, connects to the surviving endpoint over and over (the
//!   cluster's session takeover bounds it) until a message published on node 1 reaches it;
//! - the node's: a `status` command sent from node 1 every 250 ms until one is answered.
//!
//! The difference is the node-side delay (its loss detection, back-off and connect timeout).
//! The killed node is started again and rejoins before the next kill. At the end the workload
//! ends and every byte of its stdout is checked against the log messages' offsets (missing,
//! duplicated), and the completion counted. `CW_BROKERS_CLUSTERS` (default `broadcast,raft`)
//! chooses the clusters. Judges nothing.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use super::support::mqtt5;
use super::support::node::{NodeProcess, NodeSetup, TOKEN};
use super::support::rumqttd::Rumqttd;
use super::support::{free_port, wait_for, Broker, ControlPlane, TempDir};

const NODES: usize = 3;

pub fn run(kills: usize) {
    let cases = std::env::var("CW_BROKERS_CASES").unwrap_or_else(|_| "flood,failover".into());
    let has = |case: &str| cases.split(',').any(|c| c.trim() == case);
    let bin = std::env::var_os("CW_RMQTT_BIN")
        .map(PathBuf::from)
        .filter(|p| p.exists());
    if has("flood") {
        flood_all(bin.as_deref());
    }
    if !has("failover") {
        return;
    }
    let Some(bin) = bin else {
        println!("brokers: no rmqtt build (CW_RMQTT_BIN unset or missing); `./scripts/bench brokers` builds it");
        return;
    };
    let modes = std::env::var("CW_BROKERS_CLUSTERS").unwrap_or_else(|_| "broadcast,raft".into());
    for mode in modes.split(',').map(str::trim).filter(|m| !m.is_empty()) {
        failover(&bin, mode, kills);
    }
}

/// One rmqtt process per cluster node, with its ports and its log.
struct Cluster {
    bin: PathBuf,
    mode: String,
    dir: TempDir,
    mqtt: Vec<u16>,
    grpc: Vec<u16>,
    children: Vec<Option<Child>>,
}

impl Cluster {
    /// `nodes` cluster nodes (1: a lone rmqtt node, its plugin with no peers).
    fn start(bin: &Path, mode: &str, nodes: usize) -> Option<Cluster> {
        let dir = TempDir::new("rmqtt");
        let mqtt: Vec<u16> = (0..nodes).map(|_| free_port()).collect();
        let grpc: Vec<u16> = (0..nodes).map(|_| free_port()).collect();
        let raft: Vec<u16> = (0..nodes).map(|_| free_port()).collect();
        let list = |ports: &[u16]| {
            ports
                .iter()
                .enumerate()
                .map(|(i, p)| format!("\"{}@127.0.0.1:{p}\"", i + 1))
                .collect::<Vec<_>>()
                .join(", ")
        };
        // Our own minimal plugin configs: the peers' addresses, everything else rmqtt's defaults
        // (raft: leader = the first peer, node 1, which the benchmark never kills).
        dir.write(
            "plugins/rmqtt-cluster-broadcast.toml",
            &format!("node_grpc_addrs = [{}]\n", list(&grpc)),
        );
        dir.write(
            "plugins/rmqtt-cluster-raft.toml",
            &format!(
                "worker_threads = 2\nraft.grpc_reuseaddr = true\nnode_grpc_addrs = [{}]\nraft_peer_addrs = [{}]\n",
                list(&grpc),
                list(&raft)
            ),
        );
        let mut c = Cluster {
            bin: bin.to_path_buf(),
            mode: mode.to_string(),
            dir,
            mqtt,
            grpc,
            children: (0..nodes).map(|_| None).collect(),
        };
        for i in 0..nodes {
            let t = Instant::now();
            if !c.spawn(i) {
                println!(
                    "rmqtt {mode}: cluster node {} did not come up; its log:\n{}",
                    i + 1,
                    c.log(i)
                );
                return None;
            }
            println!(
                "rmqtt {mode}: cluster node {} listening on 127.0.0.1:{} after {:.1} s",
                i + 1,
                c.mqtt[i],
                t.elapsed().as_secs_f64()
            );
        }
        Some(c)
    }

    fn log_path(&self, i: usize) -> PathBuf {
        self.dir.join(&format!("node{}.log", i + 1))
    }

    fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.log_path(i)).unwrap_or_default()
    }

    /// Starts cluster node `i` (again) and waits for its MQTT listener (60 s: raft joins first).
    fn spawn(&mut self, i: usize) -> bool {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(i))
            .ok();
        let child = Command::new(&self.bin)
            .arg(&self.mode)
            .arg((i + 1).to_string())
            .arg(format!("127.0.0.1:{}", self.mqtt[i]))
            .arg(format!("127.0.0.1:{}", self.grpc[i]))
            .arg(self.dir.join("plugins"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log.map_or(Stdio::null(), Stdio::from))
            .spawn();
        let Ok(child) = child else { return false };
        self.children[i] = Some(child);
        let port = self.mqtt[i];
        let up = wait_for(Duration::from_secs(60), || {
            TcpStream::connect(("127.0.0.1", port)).ok().map(|_| ())
        });
        let alive = self.children[i]
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)));
        up.is_some() && alive
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.children[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.children.len() {
            self.kill(i);
        }
    }
}

// A raw MQTT v5 probe: one connection, a CONNACK wait as long as the node's connect timeout.

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn packet(first: u8, body: &[u8]) -> Vec<u8> {
    let mut p = vec![first];
    let mut n = body.len();
    loop {
        let mut b = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            b |= 0x80;
        }
        p.push(b);
        if n == 0 {
            break;
        }
    }
    p.extend_from_slice(body);
    p
}

fn read_packet(s: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    let mut first = [0u8; 1];
    s.read_exact(&mut first).ok()?;
    let (mut len, mut mul) = (0usize, 1usize);
    loop {
        let mut b = [0u8; 1];
        s.read_exact(&mut b).ok()?;
        len += (b[0] & 0x7f) as usize * mul;
        mul *= 128;
        if b[0] & 0x80 == 0 {
            break;
        }
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).ok()?;
    Some((first[0], body))
}

/// CONNECT (clean start, as the node after a lost session) and SUBSCRIBE `topic`: the stream,
/// or `None` when refused, dropped or unanswered within `wait`.
fn probe_connect(port: u16, client_id: &str, topic: &str, wait: Duration) -> Option<TcpStream> {
    let mut s =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(wait)).ok()?;
    let mut body = Vec::new();
    put_str(&mut body, "MQTT");
    body.extend_from_slice(&[5, 0x02, 0, 60, 0]);
    put_str(&mut body, client_id);
    s.write_all(&packet(0x10, &body)).ok()?;
    let (kind, ack) = read_packet(&mut s)?;
    if kind >> 4 != 2 || ack.get(1).copied() != Some(0) {
        return None;
    }
    let mut sub = vec![0, 1, 0];
    put_str(&mut sub, topic);
    sub.push(1);
    s.write_all(&packet(0x82, &sub)).ok()?;
    loop {
        let (kind, ack) = read_packet(&mut s)?;
        if kind >> 4 == 9 {
            return (ack.last().copied().unwrap_or(0x80) < 0x80).then_some(s);
        }
    }
}

/// Waits for a PUBLISH on `s` until `deadline`.
fn probe_hears(s: &mut TcpStream, deadline: Instant) -> bool {
    while Instant::now() < deadline {
        let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
        match read_packet(s) {
            Some((kind, body)) if kind >> 4 == 3 => {
                if kind & 0x06 != 0 {
                    // QoS 1: acknowledge (the packet id follows the topic).
                    let tl = u16::from_be_bytes([body[0], body[1]]) as usize;
                    let id = [body[2 + tl], body[3 + tl]];
                    let _ = s.write_all(&packet(0x40, &[id[0], id[1]]));
                }
                return true;
            }
            Some(_) => {}
            None => {
                if s.peek(&mut [0u8; 1]).is_ok_and(|n| n == 0) {
                    return false;
                }
            }
        }
    }
    false
}

/// The port of the broker the node's log last reported connecting to.
fn connected_port(log: &str) -> Option<u16> {
    log.lines()
        .rev()
        .find_map(|l| l.split("connected to MQTT broker 127.0.0.1:").nth(1))
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|p| p.parse().ok())
}

/// A message published on cluster node `from` reaches a subscriber on node `to` (60 s).
fn routes(c: &Cluster, from: usize, to: usize, tag: &str) -> Option<Duration> {
    let t = Instant::now();
    let topic = format!("bench/route/{tag}");
    let mut s = wait_for(Duration::from_secs(60), || {
        probe_connect(
            c.mqtt[to],
            &format!("route-{tag}"),
            &topic,
            Duration::from_secs(30),
        )
    })?;
    let mut heard = false;
    let pub_client = mqtt5::Client::connect(
        c.mqtt[from],
        &format!("route-pub-{tag}"),
        vec!["bench/unused".into()],
        |_, _| {},
    )
    .ok()?;
    let end = Instant::now() + Duration::from_secs(60);
    while Instant::now() < end {
        let _ = pub_client.publish(&topic, b"route", None);
        if probe_hears(&mut s, Instant::now() + Duration::from_millis(100)) {
            heard = true;
            break;
        }
    }
    pub_client.close();
    heard.then(|| t.elapsed())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn line(name: &str, mut v: Vec<f64>, of: usize) {
    v.sort_by(|a, b| a.total_cmp(b));
    println!(
        "{name:<52} {}/{of}  p50 {:>8.0} ms  p99 {:>8.0} ms  max {:>8.0} ms",
        v.len(),
        pct(&v, 0.5),
        pct(&v, 0.99),
        v.last().copied().unwrap_or(f64::NAN)
    );
}

fn failover(bin: &Path, mode: &str, kills: usize) {
    println!(
        "rmqtt cluster ({mode} plugin), 3 nodes on loopback; {kills} kills of the node's broker"
    );
    let Some(mut cluster) = Cluster::start(bin, mode, NODES) else {
        return;
    };
    if !routes_up(&cluster, mode) {
        return;
    }
    let cp = ControlPlane::start(cluster.mqtt[0], "");
    let setup = node_setup(&cluster, &cp);
    let node = setup.spawn();
    let Some(uuid) = workload_started(mode, &cp, &node, ("fo", "wl-fo")) else {
        return;
    };
    let pinger = mqtt5::Client::connect(
        cluster.mqtt[0],
        &format!("bench-pinger-{mode}"),
        vec!["bench/unused".into()],
        |_, _| {},
    )
    .ok();
    let mut samples = Samples::default();
    for k in 0..kills {
        std::thread::sleep(Duration::from_secs(3));
        let Some(on) =
            connected_port(&node.log()).and_then(|p| cluster.mqtt.iter().position(|&m| m == p))
        else {
            println!("rmqtt {mode}: kill {k}: cannot tell which broker the node is on");
            break;
        };
        let run = Run {
            mode,
            k,
            cp: &cp,
            node: &node,
            uuid: &uuid,
            pinger: pinger.as_ref(),
        };
        let kill = kill_once(&mut cluster, &run, on);
        println!(
            "rmqtt {mode}: kill {k} of node {}: broker recovered {}, node reconnected {}, status answered {}",
            on + 1,
            kill.broker.map_or("never".into(), |d| format!("{:.0} ms", ms(d))),
            kill.reconnected.map_or("never".into(), |d| format!("{:.0} ms", ms(d))),
            kill.node.map_or("never".into(), |d| format!("{:.0} ms", ms(d))),
        );
        samples.add(&kill);
        // The killed node comes back and routes again before the next kill.
        if !cluster.spawn(on) || routes(&cluster, 0, on, &format!("{mode}-back-{k}")).is_none() {
            println!(
                "rmqtt {mode}: cluster node {} did not come back; its log:\n{}",
                on + 1,
                cluster.log(on)
            );
            break;
        }
    }
    samples.print(mode, kills);
    if let Some(p) = pinger {
        p.close();
    }
    delivery(mode, &setup, &cp, &node);
}

/// The cluster routes from node 1 to each other node before anything else runs; prints how
/// long each took, or the logs of the pair that never routed (false).
fn routes_up(cluster: &Cluster, mode: &str) -> bool {
    for to in 1..NODES {
        match routes(cluster, 0, to, &format!("{mode}-up-{to}")) {
            Some(d) => println!(
                "rmqtt {mode}: node 1 → node {} routed after {:.1} s",
                to + 1,
                d.as_secs_f64()
            ),
            None => {
                println!(
                    "rmqtt {mode}: node 1 → node {} never routed; logs:\n{}\n{}",
                    to + 1,
                    cluster.log(0),
                    cluster.log(to)
                );
                return false;
            }
        }
    }
    true
}

/// The node: backend `cp`, cluster nodes 2 and 3 as its endpoints, production timings for
/// what failover is about, and a workload streaming numbered lines until `stop` exists.
fn node_setup(cluster: &Cluster, cp: &ControlPlane) -> NodeSetup {
    let mut setup = NodeSetup::bare();
    setup.set("CYBERWAVE_BASE_URL", &cp.http_url);
    setup.set("CYBERWAVE_API_KEY", TOKEN);
    setup.set(
        "CYBERWAVE_MQTT_HOST",
        &format!(
            "127.0.0.1:{},127.0.0.1:{}",
            cluster.mqtt[1], cluster.mqtt[2]
        ),
    );
    // Plain MQTT (TLS follows port 8883 only); each listed address carries its own port.
    setup.set("CYBERWAVE_MQTT_PORT", &cluster.mqtt[1].to_string());
    // Production timings for what failover is about (back-off, connect timeout).
    for k in [
        "CYBERWAVE_NODE_RECONNECT_MAX_SECONDS",
        "CYBERWAVE_NODE_RECONNECT_BASE_SECONDS",
        "CYBERWAVE_NODE_REQUEST_TIMEOUT_SECONDS",
    ] {
        setup.unset(k);
    }
    setup.set("RUST_LOG", "info");
    // About 20 numbered lines a second until `stop` exists, then the count.
    setup.write(
        "cyberwave.yml",
        "cyberwave:\n  inference: |\n    i=0\n    while [ ! -f stop ]; do i=$((i+1)); echo \"line $i $EPOCHREALTIME 0123456789abcdefghijklmnopqrstuvwxyz\"; sleep 0.05; done\n    echo \"done $i\"\n",
    );
    setup
}

/// Waits for the node to be ready and starts its workload: the node's uuid, or None (and its
/// log printed) when either never happens.
fn workload_started(
    mode: &str,
    cp: &ControlPlane,
    node: &NodeProcess,
    (rid, wl): (&str, &str),
) -> Option<String> {
    if !node.wait_log("node ready", Duration::from_secs(120)) {
        println!(
            "rmqtt {mode}: the node never got ready; its log:\n{}",
            node.log()
        );
        return None;
    }
    let uuid = node.uuid();
    let started = wait_for(Duration::from_secs(60), || {
        cp.command(
            &uuid,
            json!({"command": "inference", "request_id": rid, "params": {"workload_uuid": wl}}),
        );
        cp.wait_reply(rid, Duration::from_secs(2))
    });
    if started.is_none() {
        println!(
            "rmqtt {mode}: the workload start was never answered; node log:\n{}",
            node.log()
        );
        return None;
    }
    Some(uuid)
}

/// What one kill needs besides the cluster: the cluster mode, the kill's number, the backend,
/// the node, and the client on node 1 that pings the probe and carries the `status` commands.
struct Run<'a> {
    mode: &'a str,
    k: usize,
    cp: &'a ControlPlane,
    node: &'a NodeProcess,
    uuid: &'a str,
    pinger: Option<&'a mqtt5::Client>,
}

/// One kill's clocks, each from the kill; None: not within 60 s.
struct Kill {
    /// The probe client heard a ping through the surviving endpoint.
    broker: Option<Duration>,
    /// The node's log reported a new connection.
    reconnected: Option<Duration>,
    /// A `status` command was answered.
    node: Option<Duration>,
}

/// Kills cluster node `on` (the one the node is on) and measures the broker's recovery beside
/// the node's.
fn kill_once(cluster: &mut Cluster, run: &Run, on: usize) -> Kill {
    let (mode, k) = (run.mode, run.k);
    let survivor = if on == 1 { 2 } else { 1 };
    let probe_id = format!("bench-probe-{mode}-{k}");
    let topic = format!("bench/probe/{mode}/{k}");
    let pre = probe_connect(cluster.mqtt[on], &probe_id, &topic, Duration::from_secs(30));
    let connects_before = run.node.log().matches("connected to MQTT broker").count();
    let t0 = Instant::now();
    cluster.kill(on);
    drop(pre);
    // The broker's own recovery, measured beside the node's.
    let probe = broker_probe(cluster.mqtt[survivor], probe_id, topic, t0);
    let ping_topic = format!("bench/probe/{mode}/{k}");
    let command_topic = format!("cyberwave/cloud-node/{}/command", run.uuid);
    let mut answered = None;
    let mut reconnected = None;
    let mut i = 0;
    let end = t0 + Duration::from_secs(60);
    let mut sent = Vec::new();
    while Instant::now() < end && (answered.is_none() || !probe.is_finished()) {
        if let Some(p) = run.pinger {
            let _ = p.publish(&ping_topic, b"ping", None);
        }
        if answered.is_none() {
            let rid = format!("fo-{mode}-{k}-{i}");
            i += 1;
            // Through the pinger, not the backend's own client: node 1 holds a PUBACK while
            // it cannot forward to the dead node, and the backend's sender gives up on it.
            if let Some(p) = run.pinger {
                let body = json!({"command": "status", "request_id": rid}).to_string();
                let _ = p.publish(&command_topic, body.as_bytes(), None);
            }
            sent.push(rid);
            answered = sent.iter().filter_map(|r| run.cp.reply_time(r)).min();
        }
        if reconnected.is_none()
            && run.node.log().matches("connected to MQTT broker").count() > connects_before
        {
            reconnected = Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Kill {
        broker: probe.join().ok().flatten(),
        reconnected,
        node: answered.map(|a| a.saturating_duration_since(t0)),
    }
}

/// A probe client connecting to `port` over and over until the pings reach it: the time from
/// `t0`, or None after 60 s.
fn broker_probe(
    port: u16,
    probe_id: String,
    topic: String,
    t0: Instant,
) -> std::thread::JoinHandle<Option<Duration>> {
    std::thread::spawn(move || -> Option<Duration> {
        let end = t0 + Duration::from_secs(60);
        while Instant::now() < end {
            if let Some(mut s) = probe_connect(port, &probe_id, &topic, Duration::from_secs(30)) {
                // Subscribed: the pings reach it once the cluster routes to it (a
                // dropped connection connects again).
                if probe_hears(&mut s, end) {
                    return Some(t0.elapsed());
                }
            } else {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        None
    })
}

/// Every kill's clocks, in ms, for the summary lines.
#[derive(Default)]
struct Samples {
    broker_ms: Vec<f64>,
    node_ms: Vec<f64>,
    delay_ms: Vec<f64>,
    reconnect_ms: Vec<f64>,
}

impl Samples {
    fn add(&mut self, kill: &Kill) {
        if let Some(b) = kill.broker {
            self.broker_ms.push(ms(b));
        }
        if let Some(n) = kill.node {
            self.node_ms.push(ms(n));
        }
        if let Some(r) = kill.reconnected {
            self.reconnect_ms.push(ms(r));
        }
        if let (Some(b), Some(n)) = (kill.broker, kill.node) {
            self.delay_ms.push(ms(n) - ms(b));
        }
    }

    fn print(self, mode: &str, kills: usize) {
        line(
            &format!("rmqtt {mode}: kill → broker recovered (probe)"),
            self.broker_ms,
            kills,
        );
        line(
            &format!("rmqtt {mode}: kill → node reconnected"),
            self.reconnect_ms,
            kills,
        );
        line(
            &format!("rmqtt {mode}: kill → status answered"),
            self.node_ms,
            kills,
        );
        line(
            &format!("rmqtt {mode}: node-side delay beyond the broker's"),
            self.delay_ms,
            kills,
        );
    }
}

/// Ends the workload and checks every byte of its stdout and its completion arrived once.
fn delivery(mode: &str, setup: &NodeSetup, cp: &ControlPlane, node: &NodeProcess) {
    let _ = std::fs::write(setup.cwd.join("stop"), "");
    let done = cp.wait_status("wl-fo", "completed", Duration::from_secs(120));
    // The last log messages may trail the completion.
    std::thread::sleep(Duration::from_secs(5));
    let file = setup
        .home
        .join(".cyberwave/workload_logs/inference_fo.stdout.log");
    let size = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
    let (covered, twice, messages) = coverage(cp, "wl-fo");
    let completions = cp
        .statuses("wl-fo")
        .iter()
        .filter(|b| b["status"] == "completed")
        .count();
    println!(
        "rmqtt {mode}: log bytes: {covered} of {size} arrived, {} missing, {twice} duplicated ({} messages); completion arrived {completions}× {}",
        size.saturating_sub(covered),
        messages,
        if done.is_some() { "" } else { "(none within 120 s)" }
    );
    let log = node.log();
    let alive = running(node);
    println!(
        "rmqtt {mode}: node {} at the end; {} connects in its log, {} WARN and {} ERROR lines",
        if alive { "running" } else { "DEAD" },
        log.matches("connected to MQTT broker").count(),
        log.matches(" WARN ").count(),
        log.matches(" ERROR ").count()
    );
    for l in log.lines().filter(|l| l.contains(" ERROR ")) {
        println!(
            "rmqtt {mode}: node: {}",
            l.chars().take(240).collect::<String>()
        );
    }
}

/// The stdout bytes of workload `wl` the backend received in log messages: (bytes covered,
/// bytes received again, messages), from each message's `offset` and `length`.
fn coverage(cp: &ControlPlane, wl: &str) -> (u64, u64, usize) {
    let mut chunks: Vec<(u64, u64)> = cp
        .requests("logs")
        .iter()
        .filter(|r| r.body["workload_uuid"] == wl)
        .filter(|r| r.body["log_type"].as_str().is_none_or(|s| s == "stdout"))
        .filter_map(|r| Some((r.body["offset"].as_u64()?, r.body["length"].as_u64()?)))
        .collect();
    chunks.sort_unstable();
    let (mut covered, mut twice, mut at) = (0u64, 0u64, 0u64);
    for (off, len) in &chunks {
        let end = off + len;
        if end > at {
            let fresh_from = at.max(*off);
            covered += end - fresh_from;
            twice += fresh_from - off;
            at = end;
        } else {
            twice += len;
        }
    }
    (covered, twice, chunks.len())
}

/// The node process exists and is neither a zombie nor dead.
fn running(node: &NodeProcess) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", node.pid())).unwrap_or_default();
    stat.rsplit(')')
        .next()
        .and_then(|r| r.split_whitespace().next())
        .is_some_and(|state| state != "Z" && state != "X")
}

// ---- flood: a workload printing 64 KiB lines, on each broker ----------------------------------

/// The flood on every broker available: mosquitto, rumqttd 0.20 (when installed), one rmqtt
/// 0.24 node and the 3-node rmqtt raft cluster (with `CW_RMQTT_BIN`).
fn flood_all(rmqtt: Option<&Path>) {
    let secs: u64 = std::env::var("CW_FLOOD_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    println!(
        "flood: a workload printing one 64 KiB line every ~100 ms for {secs} s, on each broker"
    );
    {
        let b = Broker::start();
        flood("mosquitto", &[b.port], b.port, secs);
    }
    match std::panic::catch_unwind(|| Rumqttd::start(100 * 1024)) {
        Ok(b) => flood(
            "rumqttd 0.20 (max_payload_size 100 KiB)",
            &[b.port],
            b.port,
            secs,
        ),
        Err(_) => println!("flood rumqttd: not installed (scripts/deps.sh installs it)"),
    }
    let Some(bin) = rmqtt else {
        println!("flood rmqtt: no rmqtt build (CW_RMQTT_BIN unset or missing)");
        return;
    };
    if let Some(c) = Cluster::start(bin, "broadcast", 1) {
        flood("rmqtt 0.24, one node", &[c.mqtt[0]], c.mqtt[0], secs);
    }
    // As in the failover case: the backend on node 1, the node on nodes 2 and 3.
    if let Some(c) = Cluster::start(bin, "raft", NODES) {
        if routes_up(&c, "raft") {
            flood(
                "rmqtt 0.24 raft, 3 nodes",
                &[c.mqtt[1], c.mqtt[2]],
                c.mqtt[0],
                secs,
            );
        }
    }
}

/// The node (production back-off and timeouts) on `endpoints`, the backend on `backend`, and a
/// workload printing a 64 KiB line of `z` about every 100 ms (paced: ~640 KiB/s, under the
/// node's 4 MiB-per-interval shipping budget) for `secs` seconds; one line of figures.
fn flood(name: &str, endpoints: &[u16], backend: u16, secs: u64) {
    let cp = ControlPlane::start(backend, "");
    let mut setup = NodeSetup::bare();
    setup.set("CYBERWAVE_BASE_URL", &cp.http_url);
    setup.set("CYBERWAVE_API_KEY", TOKEN);
    let hosts: Vec<String> = endpoints.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    setup.set("CYBERWAVE_MQTT_HOST", &hosts.join(","));
    setup.set("CYBERWAVE_MQTT_PORT", &endpoints[0].to_string());
    for k in [
        "CYBERWAVE_NODE_RECONNECT_MAX_SECONDS",
        "CYBERWAVE_NODE_RECONNECT_BASE_SECONDS",
        "CYBERWAVE_NODE_REQUEST_TIMEOUT_SECONDS",
    ] {
        setup.unset(k);
    }
    setup.set("RUST_LOG", "info");
    setup.write(
        "cyberwave.yml",
        &format!(
            "cyberwave:\n  inference: |\n    end=$((SECONDS+{secs})); n=0\n    while [ $SECONDS -lt $end ]; do head -c 65536 /dev/zero | tr '\\0' z; echo; n=$((n+1)); sleep 0.1; done\n    echo \"flood-done $n\"\n"
        ),
    );
    let node = setup.spawn();
    if workload_started(name, &cp, &node, ("fl", "wl-fl")).is_none() {
        return;
    }
    let t0 = Instant::now();
    let done = cp.wait_status("wl-fl", "completed", Duration::from_secs(secs + 300));
    let minutes = t0.elapsed().as_secs_f64() / 60.0;
    // The last log messages may trail the completion.
    std::thread::sleep(Duration::from_secs(5));
    let file = setup
        .home
        .join(".cyberwave/workload_logs/inference_fl.stdout.log");
    let size = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
    let (covered, twice, messages) = coverage(&cp, "wl-fl");
    let completions = cp
        .statuses("wl-fl")
        .iter()
        .filter(|b| b["status"] == "completed")
        .count();
    let log = node.log();
    let losses = log.matches("MQTT connection problem").count();
    let alive = running(&node);
    println!(
        "flood {name}: {minutes:.2} min, {losses} connection losses ({:.1}/min), node {} (crashes {}); stdout {size} B, log {covered} B arrived, {} missing, {twice} twice ({messages} messages); completion {completions}×{}",
        losses as f64 / minutes.max(1e-9),
        if alive { "running" } else { "DEAD" },
        u8::from(!alive),
        size.saturating_sub(covered),
        if done.is_some() { "" } else { " (none in time)" }
    );
    for l in log
        .lines()
        .filter(|l| l.contains(" ERROR ") || l.contains("MQTT connection problem"))
        .take(5)
    {
        println!(
            "flood {name}: node: {}",
            l.chars().take(240).collect::<String>()
        );
    }
}
