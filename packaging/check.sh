#!/usr/bin/env bash
# The release check (run by CI): builds the static binary and the .debs, then checks the
# conflicts, the layout and modes in a scratch root, the unit (KillMode=process, systemd-analyze
# verify), that the binary runs and is not dynamic, and runs end-to-end tests against it.
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "FAIL: $*" >&2; exit 1; }
./packaging/build-static.sh
./packaging/build-deb.sh
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
deb=target/debian/cyberwave-cloud-node_${version}_amd64.deb

info=$(dpkg-deb -I "$deb")
grep -q '^ Conflicts: cyberwave-cloud-node-dev, cyberwave-cloud-node-staging$' <<<"$info" || fail "stable Conflicts: $info"
grep -q '^ Replaces: cyberwave-cloud-node-dev, cyberwave-cloud-node-staging$' <<<"$info" || fail "stable Replaces"
for ch in dev staging; do
  ci=$(dpkg-deb -I "target/debian/cyberwave-cloud-node-${ch}_${version}_amd64.deb")
  grep -q '^ Provides: cyberwave-cloud-node$' <<<"$ci" || fail "$ch Provides"
  grep -q '^ Conflicts: cyberwave-cloud-node,' <<<"$ci" || fail "$ch Conflicts"
done
dpkg-deb -f "$deb" Package | grep -qx cyberwave-cloud-node || fail "package name"
dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles | grep -qx /etc/cyberwave/cloud-node.env || fail "conffile"

root=$(mktemp -d)
imgdir=$(mktemp -d)
trap 'rm -rf "$root" "$imgdir"' EXIT
dpkg -x "$deb" "$root"
mode() { stat -c %a "$root/$1"; }
[ "$(mode usr/bin/cyberwave-cloud-node)" = 755 ] || fail "binary mode $(mode usr/bin/cyberwave-cloud-node)"
[ "$(mode lib/systemd/system/cyberwave-cloud-node.service)" = 644 ] || fail "unit mode"
[ "$(mode etc/cyberwave/cloud-node.env)" = 600 ] || fail "env file mode $(mode etc/cyberwave/cloud-node.env)"
[ -s "$root/usr/share/doc/cyberwave-cloud-node/EPL-2.0.txt" ] || fail "EPL-2.0 licence text"
unit="$root/lib/systemd/system/cyberwave-cloud-node.service"
grep -qx 'KillMode=process' "$unit" || fail "KillMode=process"
grep -q 'CYBERWAVE_API_KEY=' "$unit" && fail "the unit holds an API key"
for s in postinst prerm postrm; do dpkg-deb --ctrl-tarfile "$deb" | tar -xO "./$s" | sh -n || fail "$s syntax"; done
"$root/usr/bin/cyberwave-cloud-node" --version
ldd "$root/usr/bin/cyberwave-cloud-node" 2>&1 | grep -Eq 'not a dynamic executable|statically linked' || fail "ldd: $(ldd "$root/usr/bin/cyberwave-cloud-node" 2>&1)"
if command -v systemd-analyze >/dev/null 2>&1; then
  sed "s|/usr/bin/cyberwave-cloud-node|$root/usr/bin/cyberwave-cloud-node|" "$unit" > "$root/cyberwave-cloud-node.service"
  systemd-analyze verify "$root/cyberwave-cloud-node.service" || fail "systemd-analyze verify"
  systemd-analyze security --offline=true "$root/cyberwave-cloud-node.service" 2>/dev/null | tail -1 || true
fi

# The static binary passes the end-to-end workload and TLS tests (no SSL_CERT_FILE help).
env -u SSL_CERT_FILE -u SSL_CERT_DIR CYBERWAVE_NODE_BIN="$PWD/target/static/cyberwave-cloud-node" \
  cargo test --test main -- completions::completions_carry_the_real_exit_code connection::tls_connects_with_the_right_ca_and_refuses_otherwise logs::g4_every_line_is_streamed_once_in_order_and_mirrored
# The OCI image (README "Running in a container"): built from the static binary, read back by
# umoci, its entrypoint and volume as documented, no shell in it; then the node runs from its root
# filesystem as PID 1 of a new PID and mount namespace (tests/containers.rs, with a static busybox
# added there as the workload's shell) and reports its workload on SIGTERM.
./packaging/build-image.sh "$PWD/target/static/cyberwave-cloud-node"
umoci stat --image "target/image/oci:$version" >/dev/null || fail "umoci stat"
umoci unpack --image "target/image/oci:$version" "$imgdir/b" >/dev/null
rootfs="$imgdir/b/rootfs"
python3 - "$imgdir/b/config.json" <<'PY' || fail "image config"
import json, sys
c = json.load(open(sys.argv[1]))
args = c["process"]["args"]
assert args == ["/usr/bin/cyberwave-cloud-node", "start"], args
assert "CYBERWAVE_EDGE_CONFIG_DIR=/var/lib/cyberwave-cloud-node" in c["process"]["env"], c["process"]["env"]
assert c["process"]["cwd"] == "/work", c["process"]["cwd"]
assert (c["process"]["user"]["uid"], c["process"]["user"]["gid"]) == (65534, 65534), c["process"]["user"]
PY
# The name `podman load` and `docker load` give it, read back from the archive: podman and
# containerd read the index's io.containerd.image.name, docker's classic store manifest.json.
python3 - target/image/cyberwave-cloud-node-oci.tar "$version" <<'PY' || fail "image name in the archive"
import json, sys, tarfile
tar, version = tarfile.open(sys.argv[1]), sys.argv[2]
index = json.load(tar.extractfile("./index.json"))
[entry] = index["manifests"]
name = entry["annotations"]["io.containerd.image.name"]
assert name == f"docker.io/library/cyberwave-cloud-node:{version}", name
assert entry["annotations"]["org.opencontainers.image.ref.name"] == version, entry
[archive] = json.load(tar.extractfile("./manifest.json"))
tags = archive["RepoTags"]
assert tags == [f"cyberwave-cloud-node:{version}", "cyberwave-cloud-node:latest"], tags
names = set(tar.getnames())
for blob in [archive["Config"], *archive["Layers"]]:
    assert "./" + blob in names, blob
PY
if command -v podman >/dev/null 2>&1 && podman info >/dev/null 2>&1; then
  loaded=$(podman load -q -i target/image/cyberwave-cloud-node-oci.tar) || fail "podman load"
  grep -q "cyberwave-cloud-node:$version" <<<"$loaded" || fail "podman load named it: $loaded"
  podman rmi "docker.io/library/cyberwave-cloud-node:$version" >/dev/null || true
fi
[ -e "$rootfs/bin/sh" ] && fail "the image holds a shell"
[ "$(stat -c %u:%a "$rootfs/var/lib/cyberwave-cloud-node")" = 65534:700 ] || fail "the state dir is not nobody's, 0700"
[ -s "$rootfs/etc/ssl/certs/ca-certificates.crt" ] || fail "the image lacks the CA bundle"
cmp -s "$rootfs/usr/bin/cyberwave-cloud-node" target/static/cyberwave-cloud-node || fail "the image's binary is not the static one"
if [ ! -x /bin/busybox ] || ! file -b /bin/busybox | grep -q 'statically linked'; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends busybox-static >/dev/null
fi
install -D -m 0755 /bin/busybox "$rootfs/bin/busybox"
chroot "$rootfs" /bin/busybox --install -s /bin
# What a container runtime gives every container: /dev/null, /dev/urandom.
mknod -m 0666 "$rootfs/dev/null" c 1 3
mknod -m 0444 "$rootfs/dev/urandom" c 1 9
CYBERWAVE_TEST_IMAGE_ROOTFS="$rootfs" CYBERWAVE_NODE_BIN="$PWD/target/static/cyberwave-cloud-node" \
  cargo test --test main -- --ignored containers::d58_the_image_runs_the_node_as_pid_1_and_reports_its_workload_on_stop

# Debian's own package checker: nothing to say about any of the three packages (overrides, each
# with its reason, are in packaging/deb/lintian-overrides).
lint=$(lintian --allow-root target/debian/*_"${version}"_amd64.deb 2>&1) || true
[ -z "$lint" ] || fail "lintian:"$'\n'"$lint"

# The man page and the completions the package ships name every command and flag of --help and
# of each command's --help (they are generated from the same data; this checks the shipped files).
bin="$root/usr/bin/cyberwave-cloud-node"
man=$(zcat "$root/usr/share/man/man1/cyberwave-cloud-node.1.gz" | sed 's/\\-/-/g')
comp_bash=$(cat "$root/usr/share/bash-completion/completions/cyberwave-cloud-node")
comp_zsh=$(cat "$root/usr/share/zsh/vendor-completions/_cyberwave-cloud-node")
comp_fish=$(cat "$root/usr/share/fish/vendor_completions.d/cyberwave-cloud-node.fish")
help=$("$bin" --help)
cmds=$(sed -n '/^Commands:/,/^$/p' <<<"$help" | sed -e '1d' -e '/^$/d' -e 's/^ *//' -e 's/  .*//' -e 's/, /\n/g')
[ "$(wc -l <<<"$cmds")" -ge 11 ] || fail "--help lists too few commands: $cmds"
texts="$help"
for c in $cmds; do texts+=$'\n'$("$bin" "$c" --help); done
flags=$(grep -oE -- '(^|[^A-Za-z0-9-])--?[A-Za-z][A-Za-z0-9-]*' <<<"$texts" | sed -E 's/^[^-]//' | sort -u)
grep -qx -- --mqtt-port <<<"$flags" && grep -qx -- -f <<<"$flags" || fail "no flags found in --help: $flags"
for c in $cmds; do
  grep -qx "\.SS $c" <<<"$man" || fail "the man page lacks the command $c"
  for sh in bash zsh fish; do
    v="comp_$sh"; grep -qE "(^|[ (|])$c([ )|]|$)" <<<"${!v}" || fail "the $sh completion lacks the command $c"
  done
done
for f in $flags; do
  grep -qF -- "$f" <<<"$man" || fail "the man page lacks $f"
  grep -qE -- "(^|[ \"(|])$f([ \")|]|$)" <<<"$comp_bash" || fail "the bash completion lacks $f"
  grep -qE -- "(^|[ (|])$f([ )|]|$)" <<<"$comp_zsh" || fail "the zsh completion lacks $f"
  name=${f#-}; name=${name#-}
  grep -qE -- " -[lso] $name( |$)" <<<"$comp_fish" || fail "the fish completion lacks $f"
done
bash -n <<<"$comp_bash" || fail "bash completion syntax"
if command -v zsh >/dev/null 2>&1; then zsh -n <<<"$comp_zsh" || fail "zsh completion syntax"; fi
if command -v fish >/dev/null 2>&1; then fish --no-execute <<<"$comp_fish" || fail "fish completion syntax"; fi
echo "man page and completions: $(wc -w <<<"$cmds") commands, $(wc -w <<<"$flags") flags of --help, all present"

echo "release check: OK"
