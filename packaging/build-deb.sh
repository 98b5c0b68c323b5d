#!/usr/bin/env bash
# Builds the .deb packages from the static binary (target/static/, built when missing):
# cyberwave-cloud-node (stable), cyberwave-cloud-node-dev and cyberwave-cloud-node-staging.
# They ship the same /usr/bin/cyberwave-cloud-node, so each Conflicts/Replaces the others and
# the channel packages Provide cyberwave-cloud-node. Output: target/debian/*.deb
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/static/cyberwave-cloud-node
[ -x "$bin" ] || ./packaging/build-static.sh
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
out=target/debian
rm -rf "$out" && mkdir -p "$out"
all=(cyberwave-cloud-node cyberwave-cloud-node-dev cyberwave-cloud-node-staging)

licence() { # the licence text of a bundled C library, from the crate that builds it
  local pkg=$1 rel=$2 dir
  dir=$(cargo metadata --all-features --format-version 1 2>/dev/null | grep -o "\"manifest_path\":\"[^\"]*/$pkg-[0-9][^\"]*/Cargo.toml\"" | head -1 | sed 's/.*:"\(.*\)\/Cargo.toml"/\1/')
  [ -n "$dir" ] && [ -f "$dir/$rel" ] && cat "$dir/$rel"
}

for pkg in "${all[@]}"; do
  root=$(mktemp -d)
  others=$(printf '%s\n' "${all[@]}" | grep -vx "$pkg" | paste -sd, - | sed 's/,/, /g')
  install -D -m 0755 "$bin" "$root/usr/bin/cyberwave-cloud-node"
  install -d -m 0755 "$root/lib/systemd/system"
  "$bin" __print-unit > "$root/lib/systemd/system/cyberwave-cloud-node.service"
  chmod 0644 "$root/lib/systemd/system/cyberwave-cloud-node.service"
  install -D -m 0600 packaging/cloud-node.env "$root/etc/cyberwave/cloud-node.env"
  doc="$root/usr/share/doc/$pkg"
  install -D -m 0644 README.md "$doc/README.md"
  {
    echo "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/"
    echo "Upstream-Name: cyberwave-cloud-node"
    echo
    echo "Files: *"
    echo "License: MIT"
    echo
    echo "Files: bundled Eclipse Paho MQTT C client (statically linked)"
    echo "License: EPL-2.0 (text below). Its source is available at https://github.com/eclipse/paho.mqtt.c"
    echo
    echo "Files: bundled OpenSSL (statically linked)"
    echo "License: Apache-2.0 (text below)"
    echo
    echo "Files: Rust crates (serde, serde_json, ureq, crossbeam-channel, libc, log, env_logger, serde_norway, paho-mqtt)"
    echo "License: MIT or Apache-2.0 (paho-mqtt: EPL-2.0 or EDL-1.0)"
  } > "$doc/copyright"
  licence paho-mqtt-sys paho.mqtt.c/epl-v20 > "$doc/EPL-2.0.txt" || echo "see https://www.eclipse.org/legal/epl-2.0/" > "$doc/EPL-2.0.txt"
  licence openssl-src openssl/LICENSE.txt > "$doc/OpenSSL-LICENSE.txt" || cp /usr/share/doc/libssl3/copyright "$doc/OpenSSL-LICENSE.txt" 2>/dev/null || true
  chmod 0644 "$doc"/*
  install -d -m 0755 "$root/DEBIAN"
  provides=""
  [ "$pkg" != cyberwave-cloud-node ] && provides="Provides: cyberwave-cloud-node"$'\n'
  cat > "$root/DEBIAN/control" <<CONTROL
Package: $pkg
Version: $version
Architecture: amd64
Maintainer: Cyberwave <info@cyberwave.com>
Section: utils
Priority: optional
Homepage: https://cyberwave.com
Recommends: ca-certificates
Conflicts: $others
Replaces: $others
${provides}Description: Cyberwave cloud node: runs Cyberwave workloads on this host
 Connects out to the Cyberwave MQTT broker, registers this host, and runs inference,
 simulation and training workloads as independent processes that survive restarts
 and upgrades of the node. One static binary and a hardened systemd unit.
CONTROL
  echo "/etc/cyberwave/cloud-node.env" > "$root/DEBIAN/conffiles"
  install -m 0755 packaging/deb/postinst packaging/deb/prerm packaging/deb/postrm "$root/DEBIAN/"
  dpkg-deb --root-owner-group -Zgzip --build "$root" "$out/${pkg}_${version}_amd64.deb" >/dev/null
  rm -rf "$root"
  echo "built $out/${pkg}_${version}_amd64.deb"
done
