//! `./scripts/bench upload [MiB,MiB,…]`: the GPU's idle gap between two jobs — a workload's
//! result upload. Prints figures; judges nothing.
//!
//! The sink: a discard server on loopback (plain HTTP, and HTTPS with a throwaway certificate
//! made with `openssl`), one thread per connection, 1 MiB reads, keep-alive, chunked or sized
//! bodies; it counts bytes and answers 200. `curl -T` to the same sink is the reference, and the
//! box's single-stream limit is measured by a raw TCP copy of the same bytes with 1 MiB sends.
//! Beside it, the same copy with `sendfile(2)` (what a plain-HTTP upload could gain from it) and
//! the box's **single-stream TLS limit**: a raw TLS copy through the same OpenSSL (native-tls),
//! with a send per record (as every user-space TLS client sends) and with the records gathered
//! into 256 KiB and 1 MiB sends, each with the sender's and the receiver's CPU seconds. The
//! HTTPS sink reads through a 1 MiB buffer under its TLS, so its two reads a record are not the
//! limit.
//!
//! For the node, the **busy window** is from the workload's exit (its last action writes the
//! time) to its completion arriving at the fake backend: noticing the exit, asking for the signed
//! URL, the transfer, the report. Files are real bytes (not sparse), written once and hard-linked
//! into each workload's results folder.
//!
//! Two more cases: one workload with four files of the smallest size,
//! with 1, 2 and 4 upload workers (`CYBERWAVE_NODE_UPLOAD_WORKERS`); and a **slow link**: a
//! sink that paces each connection's reads to `CYBERWAVE_BENCH_LINK_MIBS` MiB/s (default 20),
//! so that one stream is bounded by its window, not the CPU, and parallel streams show their
//! gain. `CYBERWAVE_BENCH_CASES` (comma list of `single`, `together`, `small`, `files`, `slow`;
//! default all) runs only some.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;

use super::support::node::NodeSetup;
use super::support::{Broker, ControlPlane, TempDir};
use super::{epoch, proc_stats};

const MIB: u64 = 1 << 20;
const RUNS: usize = 3;

/// The discard sink: every PUT/POST body read and dropped.
struct Sink {
    port: u16,
    tls: bool,
    bytes: Arc<AtomicU64>,
}

/// Paces one connection's reads to `rate` bytes a second (None: as fast as they come): the
/// receive buffer fills, the window closes, and the sender waits, as over a slow link.
struct Pacer {
    rate: Option<u64>,
    start: Instant,
    read: u64,
}

impl Pacer {
    fn new(rate: Option<u64>) -> Pacer {
        Pacer {
            rate,
            start: Instant::now(),
            read: 0,
        }
    }

    /// The largest read at a time: small when paced, so the pace is smooth.
    fn chunk(&self, buf_len: usize) -> usize {
        if self.rate.is_some() {
            buf_len.min(64 * 1024)
        } else {
            buf_len
        }
    }

    fn after(&mut self, k: u64) {
        self.read += k;
        if let Some(rate) = self.rate {
            let due = Duration::from_secs_f64(self.read as f64 / rate as f64);
            let elapsed = self.start.elapsed();
            if due > elapsed {
                std::thread::sleep(due - elapsed);
            }
        }
    }
}

fn read_head<R: BufRead>(r: &mut R) -> Option<(String, Vec<(String, String)>)> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let request = line.trim_end().to_string();
    let mut headers = Vec::new();
    loop {
        line.clear();
        if r.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let l = line.trim_end();
        if l.is_empty() {
            return Some((request, headers));
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
}

/// Reads and drops `n` bytes; false at end of stream.
fn discard<R: Read>(
    r: &mut R,
    mut n: u64,
    buf: &mut [u8],
    count: &AtomicU64,
    pace: &mut Pacer,
) -> bool {
    while n > 0 {
        let want = pace.chunk(buf.len()).min(n as usize);
        match r.read(&mut buf[..want]) {
            Ok(0) | Err(_) => return false,
            Ok(k) => {
                n -= k as u64;
                count.fetch_add(k as u64, Ordering::Relaxed);
                pace.after(k as u64);
            }
        }
    }
    true
}

fn serve<S: Read + Write>(stream: S, count: &AtomicU64, rate: Option<u64>) {
    let mut pace;
    // Paced: a small user-space buffer too, so the kernel's window is what the sender sees.
    let cap = if rate.is_some() {
        64 * 1024
    } else {
        MIB as usize
    };
    let mut r = BufReader::with_capacity(cap, stream);
    let mut buf = vec![0u8; MIB as usize];
    while let Some((_request, headers)) = read_head(&mut r) {
        // The pace holds while a body is sent: a connection idle between two files banks no
        // credit (a link does not get faster for having been idle).
        pace = Pacer::new(rate);
        let get = |k: &str| headers.iter().find(|(h, _)| h == k).map(|(_, v)| v.clone());
        if get("expect").is_some_and(|e| e.eq_ignore_ascii_case("100-continue")) {
            let _ = r.get_mut().write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
        }
        if let Some(len) = get("content-length").and_then(|l| l.parse::<u64>().ok()) {
            if !discard(&mut r, len, &mut buf, count, &mut pace) {
                return;
            }
        } else if get("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
            loop {
                let mut size = String::new();
                if r.read_line(&mut size).unwrap_or(0) == 0 {
                    return;
                }
                let n = u64::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16)
                    .unwrap_or(0);
                if n == 0 {
                    let mut end = String::new();
                    let _ = r.read_line(&mut end);
                    break;
                }
                if !discard(&mut r, n, &mut buf, count, &mut pace) {
                    return;
                }
                let mut crlf = String::new();
                let _ = r.read_line(&mut crlf);
            }
        }
        let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n";
        if r.get_mut()
            .write_all(ok)
            .and_then(|()| r.get_mut().flush())
            .is_err()
        {
            return;
        }
    }
}

impl Sink {
    /// `rate`: bytes a second each connection is read at (None: as fast as they come).
    fn start(tls: Option<Arc<native_tls::TlsAcceptor>>, rate: Option<u64>) -> Sink {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let bytes = Arc::new(AtomicU64::new(0));
        let count = bytes.clone();
        let is_tls = tls.is_some();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (count, tls) = (count.clone(), tls.clone());
                std::thread::spawn(move || {
                    let _ = stream.set_nodelay(true);
                    match tls {
                        Some(acc) => {
                            if let Ok(s) = acc.accept(ReadBuffered::new(stream)) {
                                serve(s, &count, rate);
                            }
                        }
                        None => serve(stream, &count, rate),
                    }
                });
            }
        });
        Sink {
            port,
            tls: is_tls,
            bytes,
        }
    }

    fn base(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }
}

/// A throwaway certificate for 127.0.0.1 (cert path, acceptor).
fn tls_acceptor(dir: &Path) -> (PathBuf, native_tls::TlsAcceptor) {
    let (key, cert) = (dir.join("key.pem"), dir.join("cert.pem"));
    let ok = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
        ])
        .args(["-addext", "subjectAltName=IP:127.0.0.1"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(ok.status.success(), "openssl: {ok:?}");
    let identity = native_tls::Identity::from_pkcs8(
        &std::fs::read(&cert).unwrap(),
        &std::fs::read(&key).unwrap(),
    )
    .unwrap();
    (cert, native_tls::TlsAcceptor::new(identity).unwrap())
}

/// A file of real (pseudo-random, incompressible) bytes.
fn make_file(path: &Path, mib: u64) {
    if std::fs::metadata(path).is_ok_and(|m| m.len() == mib * MIB) {
        return;
    }
    let mut f = std::fs::File::create(path).unwrap();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut block = vec![0u8; MIB as usize];
    for _ in 0..mib {
        for c in block.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
        }
        f.write_all(&block).unwrap();
    }
    f.sync_all().unwrap();
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// `curl -T` of the file to the sink: (seconds, CPU seconds).
fn curl(sink: &Sink, file: &Path, cert: Option<&Path>) -> Option<(f64, f64)> {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "-o", "/dev/null", "-T"]).arg(file);
    if let Some(c) = cert {
        cmd.arg("--cacert").arg(c);
    }
    cmd.arg(format!("{}/upload/curl.bin", sink.base()));
    let t0 = Instant::now();
    let child = cmd.spawn().ok()?;
    let pid = child.id() as i32;
    let mut status = 0;
    // SAFETY: an rusage struct we own, for our own child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 on our own child with valid out pointers.
    unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    let secs = t0.elapsed().as_secs_f64();
    let cpu = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    std::mem::forget(child);
    Some((secs, cpu(ru.ru_utime) + cpu(ru.ru_stime)))
}

/// The box's single-stream limit: the file over one raw TCP connection, 1 MiB sends.
fn raw_tcp(sink_port: u16, file: &Path) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let _ = sink_port;
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = vec![0u8; MIB as usize];
        while s.read(&mut buf).unwrap_or(0) > 0 {}
    });
    let mut f = std::fs::File::open(file).unwrap();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut buf = vec![0u8; MIB as usize];
    let t0 = Instant::now();
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        s.write_all(&buf[..n]).unwrap();
    }
    drop(s);
    reader.join().unwrap();
    t0.elapsed().as_secs_f64()
}

/// A TCP stream whose reads go through a 1 MiB buffer, under the sink's TLS: OpenSSL reads
/// each record's 5-byte header and then its body, two `read`s a 16 KiB record, which made the
/// sink (not the sender) the limit of an HTTPS upload. Writes go straight through.
#[derive(Debug)]
struct ReadBuffered {
    inner: BufReader<TcpStream>,
}

impl ReadBuffered {
    fn new(s: TcpStream) -> ReadBuffered {
        ReadBuffered {
            inner: BufReader::with_capacity(MIB as usize, s),
        }
    }
}

impl Read for ReadBuffered {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.inner.read(buf)
    }
}

impl Write for ReadBuffered {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.get_mut().write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.get_mut().flush()
    }
}

/// A TCP stream whose writes gather in a buffer of `cap` bytes (0: none), under a sender's TLS:
/// the records of a 1 MiB write leave in one `send` instead of one each. A read flushes first
/// (the handshake), and so does the end of the body.
#[derive(Debug)]
struct WriteBuffered(std::io::BufWriter<TcpStream>);

impl Read for WriteBuffered {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.flush()?;
        self.0.get_mut().read(buf)
    }
}

impl Write for WriteBuffered {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// CPU seconds of the calling thread.
fn thread_cpu() -> f64 {
    // SAFETY: a timespec we own, filled by the kernel.
    let mut t: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid clock id and out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

/// The box's single-stream TLS limit: the file over one TLS connection (the same OpenSSL
/// through native-tls, the sink's certificate), 1 MiB writes, to a reader that drops what it
/// decrypts: (seconds, sender's CPU seconds, receiver's CPU seconds).
fn raw_tls(
    acceptor: &Arc<native_tls::TlsAcceptor>,
    cert: &Path,
    file: &Path,
    wbuf: usize,
) -> (f64, f64, f64) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let acc = acceptor.clone();
    let reader = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let mut s = acc.accept(ReadBuffered::new(s)).unwrap();
        let c0 = thread_cpu();
        let mut buf = vec![0u8; MIB as usize];
        while s.read(&mut buf).unwrap_or(0) > 0 {}
        thread_cpu() - c0
    });
    let ca = native_tls::Certificate::from_pem(&std::fs::read(cert).unwrap()).unwrap();
    let connector = native_tls::TlsConnector::builder()
        .add_root_certificate(ca)
        .build()
        .unwrap();
    let tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut s = connector
        .connect(
            "127.0.0.1",
            WriteBuffered(std::io::BufWriter::with_capacity(wbuf, tcp)),
        )
        .unwrap();
    let mut f = std::fs::File::open(file).unwrap();
    let mut buf = vec![0u8; MIB as usize];
    let (t0, c0) = (Instant::now(), thread_cpu());
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        s.write_all(&buf[..n]).unwrap();
    }
    s.flush().unwrap();
    let _ = s.shutdown();
    drop(s);
    let sender = thread_cpu() - c0;
    let receiver = reader.join().unwrap();
    (t0.elapsed().as_secs_f64(), sender, receiver)
}

/// The file over one raw TCP connection with `sendfile(2)`: no copy through user space
/// (what a plain-HTTP upload could gain from it): (seconds, sender's CPU seconds).
fn raw_sendfile(file: &Path) -> (f64, f64) {
    use std::os::fd::AsRawFd;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = vec![0u8; MIB as usize];
        while s.read(&mut buf).unwrap_or(0) > 0 {}
    });
    let f = std::fs::File::open(file).unwrap();
    let len = f.metadata().unwrap().len();
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let (t0, c0) = (Instant::now(), thread_cpu());
    let mut sent: u64 = 0;
    while sent < len {
        let want = (len - sent).min(1 << 30) as usize;
        // SAFETY: two descriptors we own; a null offset uses (and moves) the file's position.
        let n = unsafe { libc::sendfile(s.as_raw_fd(), f.as_raw_fd(), std::ptr::null_mut(), want) };
        if n <= 0 {
            break;
        }
        sent += n as u64;
    }
    let cpu = thread_cpu() - c0;
    drop(s);
    reader.join().unwrap();
    (t0.elapsed().as_secs_f64(), cpu)
}

struct NodeRun {
    busy: Vec<f64>,
    cpu: f64,
    rss_mib: f64,
}

/// Runs `workloads` workloads at once, each with `files` (name, source) hard-linked into its
/// results folder; returns each one's busy window and the node's CPU and peak RSS.
fn node_run(
    broker: &Broker,
    sink: &Sink,
    cert: Option<&Path>,
    files: &[PathBuf],
    workloads: usize,
    multipart: bool,
    upload_workers: Option<usize>,
) -> NodeRun {
    let mut behaviour = super::support::control_plane::Behaviour {
        upload_base: Some(sink.base()),
        ..Default::default()
    };
    if multipart {
        behaviour.multipart_url = Some(format!("{}/multipart", sink.base()));
        for f in files {
            let name = f.file_name().unwrap().to_string_lossy().to_string();
            behaviour.upload_methods.insert(name, json!("multipart"));
        }
    }
    let cp = ControlPlane::start_with(broker.port, "", behaviour);
    let mut setup = NodeSetup::new(broker, &cp);
    setup.set("RUST_LOG", "info");
    if let Some(n) = upload_workers {
        setup.set("CYBERWAVE_NODE_UPLOAD_WORKERS", &n.to_string());
    }
    if let Some(c) = cert {
        setup.set("SSL_CERT_FILE", &c.display().to_string());
    }
    let links: Vec<String> = files
        .iter()
        .map(|f| format!("ln {} \"$CYBERWAVE_RESULTS_DIR/\"", f.display()))
        .collect();
    setup.write(
        "cyberwave.yml",
        &format!(
            "cloud_node:\n  max_concurrent_workloads: {workloads}\ncyberwave:\n  training: |\n    while [ ! -f go ]; do sleep 0.01; done\n    {}\n    echo $EPOCHREALTIME > \"t/$CYBERWAVE_REQUEST_ID.end\"\n  results_folder: out\n",
            links.join("\n    ")
        ),
    );
    std::fs::create_dir_all(setup.cwd.join("t")).unwrap();
    let node = setup.spawn();
    node.wait_ready(Duration::from_secs(20));
    let pid = node.pid();
    let ids: Vec<String> = (0..workloads).map(|i| format!("up{i}")).collect();
    for id in &ids {
        cp.command(
            &node.uuid(),
            json!({"command": "training", "request_id": id, "params": {"workload_uuid": format!("wl-{id}")}}),
        );
        cp.wait_reply(id, Duration::from_secs(10))
            .expect("start reply");
    }
    let (_, _, cpu0) = proc_stats(pid);
    std::fs::write(setup.cwd.join("go"), "").unwrap();
    let mut busy = Vec::new();
    for id in &ids {
        let wl = format!("wl-{id}");
        super::support::wait_for(Duration::from_secs(1800), || {
            cp.statuses(&wl)
                .iter()
                .any(|s| s["status"] == "completed")
                .then_some(())
        })
        .expect("completion");
        let arrived = epoch(SystemTime::now());
        let ended = std::fs::read_to_string(setup.cwd.join(format!("t/{id}.end")))
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .unwrap_or(arrived);
        busy.push(arrived - ended);
    }
    let (peak_kib, _, cpu1) = proc_stats(pid);
    NodeRun {
        busy,
        cpu: cpu1 - cpu0,
        rss_mib: peak_kib as f64 / 1024.0,
    }
}

/// One row of the table: busy seconds, the MiB/s they make of `mib`, CPU seconds, peak RSS.
fn row(name: &str, busy: f64, mib: f64, cpu: f64, rss: f64) {
    println!(
        "{name:<34} {busy:>10.3} {:>10.0} {cpu:>9.2} {rss:>9.1}",
        if busy > 0.0 { mib / busy } else { f64::NAN }
    );
}

/// The row of RUNS node runs: the medians of the first workload's busy time and of the CPU,
/// and the peak RSS.
fn node_row(name: &str, runs: &[NodeRun], mib: f64) {
    let busy = median(runs.iter().map(|r| r.busy[0]).collect());
    let cpu = median(runs.iter().map(|r| r.cpu).collect());
    let rss = runs.iter().map(|r| r.rss_mib).fold(0.0, f64::max);
    row(name, busy, mib, cpu, rss);
}

/// One `mib` MiB file on one stream: the raw TCP limit, then the node (signed-URL PUT and
/// multipart POST) and curl, over plain HTTP and over TLS.
fn single(
    broker: &Broker,
    (http, https): (&Sink, &Sink),
    (cert, acceptor): (&Path, &Arc<native_tls::TlsAcceptor>),
    file: &Path,
    mib: u64,
) {
    let limit = median((0..RUNS).map(|_| raw_tcp(http.port, file)).collect());
    println!(
        "-- {mib} MiB: single-stream limit (raw TCP, 1 MiB sends) {:.0} MiB/s",
        mib as f64 / limit
    );
    let sf: Vec<(f64, f64)> = (0..RUNS).map(|_| raw_sendfile(file)).collect();
    println!(
        "   raw TCP with sendfile(2): {:.0} MiB/s, sender CPU {:.2} s",
        mib as f64 / median(sf.iter().map(|r| r.0).collect()),
        median(sf.iter().map(|r| r.1).collect())
    );
    for (wbuf, how) in [
        (0, "a send per record"),
        (256 * 1024, "records gathered into 256 KiB sends"),
        (MIB as usize, "records gathered into 1 MiB sends"),
    ] {
        let tls: Vec<(f64, f64, f64)> = (0..RUNS)
            .map(|_| raw_tls(acceptor, cert, file, wbuf))
            .collect();
        println!(
            "   single-stream TLS limit (raw TLS, same OpenSSL, {how}): {:.0} MiB/s, sender CPU {:.2} s, receiver CPU {:.2} s",
            mib as f64 / median(tls.iter().map(|r| r.0).collect()),
            median(tls.iter().map(|r| r.1).collect()),
            median(tls.iter().map(|r| r.2).collect())
        );
    }
    let file = file.to_path_buf();
    for (label, sink, c) in [("http", http, None), ("https", https, Some(cert))] {
        for multipart in [false, true] {
            let runs: Vec<NodeRun> = (0..RUNS)
                .map(|_| {
                    node_run(
                        broker,
                        sink,
                        c,
                        std::slice::from_ref(&file),
                        1,
                        multipart,
                        None,
                    )
                })
                .collect();
            let how = if multipart {
                "multipart POST"
            } else {
                "signed-URL PUT"
            };
            node_row(&format!("node {label} {how}"), &runs, mib as f64);
        }
        let curls: Vec<(f64, f64)> = (0..RUNS).filter_map(|_| curl(sink, &file, c)).collect();
        if curls.is_empty() {
            println!("curl {label}: not installed");
        } else {
            row(
                &format!("curl -T {label}"),
                median(curls.iter().map(|c| c.0).collect()),
                mib as f64,
                median(curls.iter().map(|c| c.1).collect()),
                f64::NAN,
            );
        }
        super::original::upload(broker, &sink.base(), c, &file, mib, RUNS);
    }
}

/// 200 files of 64 KiB in one workload.
fn small_files(broker: &Broker, http: &Sink, data: &TempDir) {
    let small = data.join("small");
    std::fs::create_dir_all(&small).unwrap();
    let files: Vec<PathBuf> = (0..200)
        .map(|i| {
            let p = small.join(format!("f{i:03}.bin"));
            std::fs::write(&p, vec![i as u8; 64 * 1024]).unwrap();
            p
        })
        .collect();
    let many = node_run(broker, http, None, &files, 1, false, None);
    println!(
        "-- 200 files of 64 KiB: busy {:.3} s ({:.1} ms a file), node CPU {:.2} s",
        many.busy[0],
        many.busy[0] * 1000.0 / 200.0,
        many.cpu
    );
}

/// Four files of `mib` MiB, named after `tag`.
fn parts(data: &TempDir, tag: &str, mib: u64) -> Vec<PathBuf> {
    (0..4)
        .map(|i| {
            let p = data.join(&format!("{tag}{i}-{mib}.bin"));
            make_file(&p, mib);
            p
        })
        .collect()
}

/// One workload uploading `files` (each `mib` MiB) with 1, 2 and 4 upload workers: a row each.
fn by_workers(broker: &Broker, sink: &Sink, files: &[PathBuf], mib: u64, label: &str) {
    for workers in [1, 2, 4] {
        let runs: Vec<NodeRun> = (0..RUNS)
            .map(|_| node_run(broker, sink, None, files, 1, false, Some(workers)))
            .collect();
        node_row(
            &format!("{label}, {workers} worker(s)"),
            &runs,
            (mib * files.len() as u64) as f64,
        );
    }
}

pub fn run(sizes_mib: &[u64]) {
    let broker = Broker::start();
    let data = TempDir::new("upload-bench");
    let (cert, acceptor) = tls_acceptor(data.path());
    let acceptor = Arc::new(acceptor);
    let cases = std::env::var("CYBERWAVE_BENCH_CASES").ok();
    let case = |c: &str| {
        cases
            .as_deref()
            .is_none_or(|l| l.split(',').any(|x| x.trim() == c))
    };
    let http = Sink::start(None, None);
    let https = Sink::start(Some(acceptor.clone()), None);
    println!(
        "upload benchmark: sizes {sizes_mib:?} MiB, {RUNS} runs each (median), discard sink on loopback"
    );
    super::original::say_if_not_run();
    println!(
        "{:<34} {:>10} {:>10} {:>9} {:>9}",
        "case", "busy s", "MiB/s", "CPU s", "RSS MiB"
    );
    for &mib in sizes_mib.iter().filter(|_| case("single")) {
        let file = data.join(&format!("result-{mib}.bin"));
        make_file(&file, mib);
        single(&broker, (&http, &https), (&cert, &acceptor), &file, mib);
    }
    // Two workloads ending together, each with the smallest size; and one with 200 small files.
    let mib = sizes_mib.iter().copied().min().unwrap_or(256);
    let file = data.join(&format!("result-{mib}.bin"));
    if case("together") {
        make_file(&file, mib);
        let one = std::slice::from_ref(&file);
        let alone = node_run(&broker, &http, None, one, 1, false, None);
        let together = node_run(&broker, &http, None, one, 2, false, None);
        println!(
            "-- two workloads ending together ({mib} MiB each): busy alone {:.3} s; together {:.3} s and {:.3} s",
            alone.busy[0], together.busy[0], together.busy[1]
        );
    }
    if case("small") {
        small_files(&broker, &http, &data);
    }
    // One workload, four files: its files side by side on the pool.
    if case("files") {
        println!("-- one workload, 4 files of {mib} MiB, plain HTTP, signed-URL PUT:");
        by_workers(
            &broker,
            &http,
            &parts(&data, "part", mib),
            mib,
            &format!("node 4x{mib} MiB"),
        );
    }
    // A slow link: each connection read at a fixed pace, so one stream is
    // bounded by its window and the pace, not the CPU.
    if case("slow") {
        let link = std::env::var("CYBERWAVE_BENCH_LINK_MIBS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|v| *v > 0)
            .unwrap_or(20);
        let slow = Sink::start(None, Some(link * MIB));
        let mib = 16;
        println!(
            "-- slow link: each connection read at {link} MiB/s; one workload, 4 files of {mib} MiB:"
        );
        by_workers(
            &broker,
            &slow,
            &parts(&data, "slow", mib),
            mib,
            &format!("node {link} MiB/s link"),
        );
    }
    println!(
        "-- the sink received {} MiB plain and {} MiB over TLS in all",
        http.bytes.load(Ordering::Relaxed) / MIB,
        https.bytes.load(Ordering::Relaxed) / MIB
    );
}
