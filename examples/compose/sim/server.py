"""A stand-in simulation service: POST /run with JSON params streams a few lines of 'steps'."""
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Sim(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)) or 0)
        params = json.loads(body or b"{}")
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        for step in range(int(params.get("steps", 3))):
            self.wfile.write(f"sim step {step + 1}\n".encode())
            self.wfile.flush()
            time.sleep(0.5)


ThreadingHTTPServer(("0.0.0.0", 8080), Sim).serve_forever()
