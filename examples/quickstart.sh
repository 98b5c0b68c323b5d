#!/usr/bin/env bash
# Runs the node locally against a local mosquitto, sends it a command and prints the reply.
# Needs only Rust; installs what building and running need when missing (Debian/Ubuntu:
# `scripts/deps.sh run`: cmake, a C toolchain, pkg-config, libssl-dev, mosquitto and its clients).
#
#   ./examples/quickstart.sh
#
# Standalone mode: no Cyberwave account or backend is needed. The node's state goes to a
# temporary folder, which is removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/deps.sh run
echo "== building the node"
cargo build --quiet
BIN=target/debug/cyberwave-cloud-node

PORT=${MQTT_PORT:-1883}
STATE=$(mktemp -d)
cleanup() {
  [ -n "${NODE_PID:-}" ] && kill "$NODE_PID" 2>/dev/null && wait "$NODE_PID" 2>/dev/null
  [ -n "${BROKER_PID:-}" ] && kill "$BROKER_PID" 2>/dev/null
  rm -rf "$STATE"
}
trap cleanup EXIT

if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
  echo "== using the MQTT broker already listening on 127.0.0.1:$PORT"
else
  echo "== starting mosquitto on 127.0.0.1:$PORT"
  MOSQ=$(command -v mosquitto || echo /usr/sbin/mosquitto)
  printf 'listener %s 127.0.0.1\nallow_anonymous true\n' "$PORT" > "$STATE/mosquitto.conf"
  "$MOSQ" -c "$STATE/mosquitto.conf" >/dev/null 2>&1 &
  BROKER_PID=$!
  sleep 0.5
fi

echo "== starting the node (standalone) on examples/cyberwave.yml"
CYBERWAVE_EDGE_CONFIG_DIR="$STATE/node" "$BIN" start --standalone --slug quickstart \
    --config examples/cyberwave.yml --mqtt-host 127.0.0.1 --mqtt-port "$PORT" 2> "$STATE/node.log" &
NODE_PID=$!
for _ in $(seq 50); do grep -q "node ready" "$STATE/node.log" 2>/dev/null && break; sleep 0.1; done
grep "node ready" "$STATE/node.log" || { cat "$STATE/node.log"; exit 1; }
UUID=$(sed -n 's/.*"uuid": *"\([^"]*\)".*/\1/p' "$STATE/node/instance_identity.json")

ask() { # ask COMMAND-JSON REQUEST-ID: publish a command, print the reply
  mosquitto_sub -h 127.0.0.1 -p "$PORT" -t "cyberwave/cloud-node/$UUID/response" -C 1 -W 10 > "$STATE/reply.json" &
  local sub=$!
  sleep 0.3
  echo "-> $1"
  mosquitto_pub -h 127.0.0.1 -p "$PORT" -q 1 -t "cyberwave/cloud-node/quickstart/command" -m "$1"
  wait "$sub" || true
  echo "<- $(cat "$STATE/reply.json")"
}
echo "== sending commands to cyberwave/cloud-node/quickstart/command"
ask '{"command":"status","request_id":"quickstart-1"}'

echo "== starting an inference workload (examples/cyberwave.yml runs it as its own process)"
mosquitto_sub -h 127.0.0.1 -p "$PORT" -t "cyberwave/cloud-workload/wl-quickstart/update-status" -C 2 -W 10 > "$STATE/statuses.json" &
STATUSES=$!
sleep 0.3
ask '{"command":"inference","request_id":"quickstart-2","params":{"workload_uuid":"wl-quickstart","prompt":"hello"}}'
wait "$STATUSES" || true
echo "== what the backend would receive about it (running, then the completion)"
cat "$STATE/statuses.json"
echo "== the node's status command"
CYBERWAVE_EDGE_CONFIG_DIR="$STATE/node" "$BIN" status


echo "== stopping the node (SIGTERM)"
kill -TERM "$NODE_PID"; wait "$NODE_PID"; NODE_PID=""
echo "== node log (the workload's output is mirrored on the node's stdout, tagged [workload …])"
cat "$STATE/node.log"
