"""The node's `simulate` workload: hands its params to the simulation service and streams back
what the service answers (its output reaches the backend as the workload's log)."""
import json
import os
import sys
import urllib.request

params = json.load(open(sys.argv[1]))
url = os.environ.get("CYBERWAVE_SIM_URL", "http://sim:8080") + "/run"
req = urllib.request.Request(url, data=json.dumps(params).encode(), headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=600) as resp:
    for line in resp:
        print(line.decode().rstrip(), flush=True)
