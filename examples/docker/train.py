"""A stand-in training job: reads its params, prints progress, writes a result file."""
import json
import os
import sys
import time

params = json.load(open(sys.argv[1]))
steps = int(params.get("steps", 5))
print("visible GPUs:", os.environ.get("CUDA_VISIBLE_DEVICES", "(none)"), flush=True)
for step in range(steps):
    print(f"step {step + 1}/{steps}", flush=True)
    time.sleep(1)
results = os.environ.get("CYBERWAVE_RESULTS_DIR")
if results:
    with open(os.path.join(results, "metrics.json"), "w") as f:
        json.dump({"steps": steps}, f)
