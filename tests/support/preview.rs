//! Stand-ins of the platform's own inference pattern (its SmolVLA compute repository): a model
//! server kept warm between requests, and the preview entry point that starts it when none
//! answers. Shared by the end-to-end tests (`tests/services.rs`) and the benchmark
//! (`./scripts/bench preview`). Written into a node's working dir as `server.py` and
//! `preview.py`; the template is `python3 preview.py {body} PORT LOAD_SECONDS`.

/// A model server: counts its starts in `server.starts`, "loads its model" for `LOAD` seconds,
/// then answers `/health` and `/predict` (which waits the request's `delay`) on `PORT`.
pub const SERVER: &str = r#"import http.server, json, os, socketserver, sys, time
port, load = int(sys.argv[1]), float(sys.argv[2])
with open("server.starts", "a") as f:
    f.write(f"{os.getpid()}\n")
time.sleep(load)
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def send(self, obj):
        b = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def do_GET(self):
        self.send({"service_id": "stand-in", "ready": True, "pid": os.getpid()})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        time.sleep(float(req.get("delay", 0)))
        self.send({"pid": os.getpid(), "action": [0.1, 0.2], "tag": req.get("tag")})
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
S(("127.0.0.1", port), H).serve_forever()
"#;

/// The preview entry point, as the platform's SmolVLA repository has it: if nothing answers
/// `/health`, start the server (once: a lock and a pid file, so concurrent previews start one)
/// detached with `start_new_session=True`, its output to a log file; poll `/health`; post the
/// params; print the answer; exit.
pub const PREVIEW: &str = r#"import fcntl, json, os, subprocess, sys, time, urllib.request
params = json.load(open(sys.argv[1]))
port, load = int(sys.argv[2]), sys.argv[3]
base = f"http://127.0.0.1:{port}"
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def health():
    try:
        with opener.open(base + "/health", timeout=2) as r:
            return json.loads(r.read())
    except Exception:
        return None
def claimed():
    try:
        os.kill(int(open("server.pid").read()), 0)
        return True
    except Exception:
        return False
if health() is None:
    with open("server.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if health() is None and not claimed():
            log = open("server.log", "a")
            p = subprocess.Popen([sys.executable, "server.py", str(port), load],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 start_new_session=True)
            with open("server.pid", "w") as f:
                f.write(str(p.pid))
deadline = time.time() + 60
while health() is None:
    if time.time() > deadline:
        sys.exit("the server never answered")
    time.sleep(0.02)
req = urllib.request.Request(base + "/predict", data=json.dumps(params).encode(),
                             headers={"Content-Type": "application/json"}, method="POST")
with opener.open(req, timeout=60) as r:
    print(json.dumps(json.loads(r.read())))
"#;
