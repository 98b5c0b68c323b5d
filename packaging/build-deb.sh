#!/usr/bin/env bash
# Builds the .deb packages from the static binary (target/static/, built when missing):
# cyberwave-cloud-node (stable), cyberwave-cloud-node-dev and cyberwave-cloud-node-staging.
# They ship the same /usr/bin/cyberwave-cloud-node, so each Conflicts/Replaces the others and
# the channel packages Provide cyberwave-cloud-node. Output: target/debian/*.deb
# CW_DEB_VERSION, CW_DEB_OUT and CW_DEB_BIN override the version, the output dir and the
# binary (packaging/lifecycle.sh builds a later version from the same binary that way).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${CW_DEB_BIN:-target/static/cyberwave-cloud-node}
[ -x "$bin" ] || ./packaging/build-static.sh
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
if [ -z "${CW_DEB_VERSION:-}" ] && ! grep -qx "## $version" packaging/release-notes.md; then
  echo "packaging/release-notes.md has no '## $version' section" >&2; exit 1
fi
version=${CW_DEB_VERSION:-$version}
out=${CW_DEB_OUT:-target/debian}
rm -rf "$out" && mkdir -p "$out"
all=(cyberwave-cloud-node cyberwave-cloud-node-dev cyberwave-cloud-node-staging)

metadata=$(cargo metadata --all-features --format-version 1 2>/dev/null || true) # once: it waits for cargo's lock
licence() { # the licence text of a bundled C library, from the crate that builds it
  local pkg=$1 rel=$2 dir
  dir=$(grep -o "\"manifest_path\":\"[^\"]*/$pkg-[0-9][^\"]*/Cargo.toml\"" <<<"$metadata" | head -1 | sed 's/.*:"\(.*\)\/Cargo.toml"/\1/')
  [ -n "$dir" ] && [ -f "$dir/$rel" ] && cat "$dir/$rel"
}

copyright() { # DEP-5: the node, and what is statically linked into it
  cat <<'DEP5'
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: cyberwave-cloud-node
Upstream-Contact: Cyberwave <info@cyberwave.com>
Source: https://cyberwave.com

Files: *
Copyright: 2025-2026 Cyberwave <info@cyberwave.com>
License: Expat

Files: paho.mqtt.c/*
Copyright: 2009-2024 IBM Corp., Ian Craggs and other Eclipse Paho contributors
License: EPL-2.0 or BSD-3-Clause
Comment: The Eclipse Paho MQTT C client, built by the paho-mqtt-sys crate and
 statically linked into /usr/bin/cyberwave-cloud-node.

Files: openssl/*
Copyright: 1998-2024 The OpenSSL Project Authors
License: Apache-2.0
Comment: OpenSSL 3, statically linked into /usr/bin/cyberwave-cloud-node
 (vendored by openssl-src, or Debian's libssl-dev). Its licence text is also in
 OpenSSL-LICENSE.txt.

Files: rust-crates/*
Copyright: the authors of each crate, listed in the project's Cargo.lock
License: Expat or Apache-2.0
Comment: The Rust crates compiled into the binary (serde, serde_json,
 serde_norway with unsafe-libyaml-norway, ureq, native-tls, openssl,
 crossbeam-channel, libc, log, env_logger, paho-mqtt and their dependencies)
 are available under the MIT (Expat) or Apache-2.0 licence, paho-mqtt under
 EPL-2.0 or BSD-3-Clause (EDL-1.0).

License: Expat
 Permission is hereby granted, free of charge, to any person obtaining a copy
 of this software and associated documentation files (the "Software"), to deal
 in the Software without restriction, including without limitation the rights
 to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
 copies of the Software, and to permit persons to whom the Software is
 furnished to do so, subject to the following conditions:
 .
 The above copyright notice and this permission notice shall be included in
 all copies or substantial portions of the Software.
 .
 THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
 IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
 FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
 AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
 LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
 OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
 SOFTWARE.

License: Apache-2.0
 On Debian systems, the full text of the Apache License, Version 2.0 can be
 found in /usr/share/common-licenses/Apache-2.0.

License: EPL-2.0
 The full text of the Eclipse Public License 2.0 is in EPL-2.0.txt next to
 this file, and at https://www.eclipse.org/legal/epl-2.0/.

License: BSD-3-Clause
 Copyright (c) 2007 Eclipse Foundation, Inc. (Eclipse Distribution License 1.0)
 .
 Redistribution and use in source and binary forms, with or without
 modification, are permitted provided that the following conditions are met:
 .
 1. Redistributions of source code must retain the above copyright notice,
 this list of conditions and the following disclaimer.
 .
 2. Redistributions in binary form must reproduce the above copyright notice,
 this list of conditions and the following disclaimer in the documentation
 and/or other materials provided with the distribution.
 .
 3. Neither the name of the Eclipse Foundation, Inc. nor the names of its
 contributors may be used to endorse or promote products derived from this
 software without specific prior written permission.
 .
 THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS"
 AND ANY EXPRESS OR IMPLIED WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE
 IMPLIED WARRANTIES OF MERCHANTABILITY AND FITNESS FOR A PARTICULAR PURPOSE
 ARE DISCLAIMED. IN NO EVENT SHALL THE COPYRIGHT OWNER OR CONTRIBUTORS BE
 LIABLE FOR ANY DIRECT, INDIRECT, INCIDENTAL, SPECIAL, EXEMPLARY, OR
 CONSEQUENTIAL DAMAGES (INCLUDING, BUT NOT LIMITED TO, PROCUREMENT OF
 SUBSTITUTE GOODS OR SERVICES; LOSS OF USE, DATA, OR PROFITS; OR BUSINESS
 INTERRUPTION) HOWEVER CAUSED AND ON ANY THEORY OF LIABILITY, WHETHER IN
 CONTRACT, STRICT LIABILITY, OR TORT (INCLUDING NEGLIGENCE OR OTHERWISE)
 ARISING IN ANY WAY OUT OF THE USE OF THIS SOFTWARE, EVEN IF ADVISED OF THE
 POSSIBILITY OF SUCH DAMAGE.
DEP5
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
  # The README links these reference pages as docs/…: they go beside it, links intact.
  for page in docs/*.md; do
    install -D -m 0644 "$page" "$doc/$page"
  done
  copyright > "$doc/copyright"
  ./packaging/changelog.sh "$pkg" "$version" | gzip -9n > "$doc/changelog.gz"
  licence paho-mqtt-sys paho.mqtt.c/epl-v20 > "$doc/EPL-2.0.txt" || echo "see https://www.eclipse.org/legal/epl-2.0/" > "$doc/EPL-2.0.txt"
  licence openssl-src openssl/LICENSE.txt > "$doc/OpenSSL-LICENSE.txt" || cp /usr/share/doc/libssl3/copyright "$doc/OpenSSL-LICENSE.txt" 2>/dev/null || true
  find "$doc" -type f -exec chmod 0644 {} +
  # The man page and the completions come from the binary, so they match its --help.
  install -d -m 0755 "$root/usr/share/man/man1" "$root/usr/share/bash-completion/completions" \
    "$root/usr/share/zsh/vendor-completions" "$root/usr/share/fish/vendor_completions.d" \
    "$root/usr/share/lintian/overrides"
  "$bin" __man | gzip -9n > "$root/usr/share/man/man1/cyberwave-cloud-node.1.gz"
  "$bin" __completions bash > "$root/usr/share/bash-completion/completions/cyberwave-cloud-node"
  "$bin" __completions zsh > "$root/usr/share/zsh/vendor-completions/_cyberwave-cloud-node"
  "$bin" __completions fish > "$root/usr/share/fish/vendor_completions.d/cyberwave-cloud-node.fish"
  sed "s/^cyberwave-cloud-node:/$pkg:/" packaging/deb/lintian-overrides > "$root/usr/share/lintian/overrides/$pkg"
  find "$root/usr/share" -type f -exec chmod 0644 {} +
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
 Connects out to the Cyberwave MQTT broker, registers this host, and runs
 inference, simulation and training workloads as independent processes that
 survive restarts and upgrades of the node. One static binary and a hardened
 systemd unit.
CONTROL
  echo "/etc/cyberwave/cloud-node.env" > "$root/DEBIAN/conffiles"
  install -m 0755 packaging/deb/postinst packaging/deb/prerm packaging/deb/postrm "$root/DEBIAN/"
  # md5sums of every file but the conffile (dpkg tracks that one itself), as dh_md5sums does.
  (cd "$root" && find . -path ./DEBIAN -prune -o -path ./etc -prune -o -type f -printf '%P\0' |
    LC_ALL=C sort -z | xargs -0 md5sum) > "$root/DEBIAN/md5sums"
  chmod 0644 "$root/DEBIAN/md5sums"
  dpkg-deb --root-owner-group -Zgzip --build "$root" "$out/${pkg}_${version}_amd64.deb" >/dev/null
  rm -rf "$root"
  echo "built $out/${pkg}_${version}_amd64.deb"
done
