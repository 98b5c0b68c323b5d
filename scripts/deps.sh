#!/usr/bin/env bash
# Installs, on Debian/Ubuntu, what is missing of one of two sets:
#
#   scripts/deps.sh run    building and running the node (examples/quickstart.sh): cmake (Paho C),
#                          a C toolchain, pkg-config and the OpenSSL headers, mosquitto and its
#                          clients (the quickstart's local broker, mosquitto_pub / _sub)
#   scripts/deps.sh test   (the default) the above and what the tests and packaging checks need
#                          (scripts/test, .ci/run): openssl (test CA), CA certificates, file and
#                          lintian (the packaging check; lintian brings man-db), python3 and
#                          python3-venv (module-mode, workload and wheel tests), umoci and a
#                          static busybox (the OCI image and its test), and rumqttd (a second
#                          MQTT broker for the tests, built with cargo once: a few minutes)
set -euo pipefail
set_=${1:-test}
case "$set_" in
  run | test) ;;
  *) echo "usage: $0 [run|test]" >&2; exit 2 ;;
esac
need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v cc >/dev/null 2>&1 || need+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
pkg-config --exists openssl 2>/dev/null || need+=(libssl-dev)
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
command -v mosquitto_pub >/dev/null 2>&1 || need+=(mosquitto-clients)
if [ "$set_" = test ]; then
  command -v openssl >/dev/null 2>&1 || need+=(openssl)
  [ -f /etc/ssl/certs/ca-certificates.crt ] || need+=(ca-certificates)
  command -v file >/dev/null 2>&1 || need+=(file)
  command -v lintian >/dev/null 2>&1 || need+=(lintian)
  command -v python3 >/dev/null 2>&1 || need+=(python3)
  # The wheel test's scratch virtualenv.
  python3 -c 'import ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
  # The OCI image (packaging/build-image.sh) and the image test's workload shell (packaging/check.sh).
  command -v umoci >/dev/null 2>&1 || need+=(umoci)
  file -b /bin/busybox 2>/dev/null | grep -q 'statically linked' || need+=(busybox-static)
fi
# A second real MQTT v5 broker for the tests of tests/brokers.rs: built once with cargo (a few
# minutes) and kept in ~/.cargo/bin.
install_rumqttd() {
  [ "$set_" = test ] || return 0
  if ! command -v rumqttd >/dev/null 2>&1 && [ ! -x "${CARGO_HOME:-$HOME/.cargo}/bin/rumqttd" ]; then
    echo "installing rumqttd 0.20.0 (once; a few minutes)"
    cargo install rumqttd --version 0.20.0
  fi
}
if [ ${#need[@]} -eq 0 ]; then
  install_rumqttd
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "missing: ${need[*]} (install them with your package manager)" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
echo "installing: ${need[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
install_rumqttd
