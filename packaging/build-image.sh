#!/usr/bin/env bash
# Builds the node's OCI image (no Docker daemon needed) as an OCI image layout in
# target/image/oci (tag: the version) and as an archive target/image/cyberwave-cloud-node-oci.tar
# that `podman load -i …` and `docker load -i …` name cyberwave-cloud-node:VERSION (docker also
# :latest); `skopeo copy oci-archive:…:VERSION docker://REGISTRY/cyberwave-cloud-node:VERSION`
# pushes it.
#
# Contents: the static binary (packaging/build-static.sh, or BIN given as $1), the CA bundle,
# a minimal /etc/passwd and /etc/group (root, nobody), an empty /tmp and the state dir
# /var/lib/cyberwave-cloud-node as a volume. It runs as nobody (65534:65534), who owns the state
# dir and /work. Entrypoint `cyberwave-cloud-node start`; the node then runs as PID 1 and stops
# and reports its workloads on `docker stop` (README, "Running in a container"). There is no
# shell in it: workloads need an image of their own that adds the node
# (examples/docker/Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/static/cyberwave-cloud-node}
[ -x "$bin" ] || ./packaging/build-static.sh
if ! command -v umoci >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends umoci >/dev/null
fi
ca=/etc/ssl/certs/ca-certificates.crt
[ -s "$ca" ] || { echo "FAIL: no CA bundle at $ca (install ca-certificates)" >&2; exit 1; }
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
out=target/image
layout=$out/oci
rm -rf "$out"
mkdir -p "$out"
umoci init --layout "$layout"
umoci new --image "$layout:$version"
bundle=$(mktemp -d)
trap 'rm -rf "$bundle"' EXIT
umoci unpack --image "$layout:$version" "$bundle/b"
root="$bundle/b/rootfs"
install -D -m 0755 "$bin" "$root/usr/bin/cyberwave-cloud-node"
install -D -m 0644 "$ca" "$root/etc/ssl/certs/ca-certificates.crt"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n' > "$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' > "$root/etc/group"
chmod 0644 "$root/etc/passwd" "$root/etc/group"
install -d -m 0700 "$root/root"
# The node's user owns its state dir (D30: the node refuses a dir of another user's); a new
# volume mounted there takes the owner and mode from the image.
install -d -m 0700 -o 65534 -g 65534 "$root/var/lib/cyberwave-cloud-node"
install -d -m 1777 "$root/tmp"
install -d -m 0755 "$root/dev"
install -d -m 0755 -o 65534 -g 65534 "$root/work"
# Mount points a container runtime fills (proc, sys; /dev gets its nodes from the runtime).
install -d -m 0555 "$root/proc" "$root/sys"
umoci repack --image "$layout:$version" "$bundle/b"
umoci config --image "$layout:$version" \
  --author "Cyberwave" \
  --config.entrypoint /usr/bin/cyberwave-cloud-node --config.entrypoint start \
  --config.user 65534:65534 \
  --config.env CYBERWAVE_EDGE_CONFIG_DIR=/var/lib/cyberwave-cloud-node \
  --config.env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
  --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.volume /var/lib/cyberwave-cloud-node \
  --config.workingdir /work \
  --config.stopsignal SIGTERM \
  --config.label "org.opencontainers.image.title=cyberwave-cloud-node" \
  --config.label "org.opencontainers.image.version=$version" \
  --config.label "org.opencontainers.image.source=https://github.com/cyberwave-os/cyberwave-cloud-node"
umoci gc --layout "$layout"
# The image's name as the runtimes read it from the archive: podman and containerd (docker's
# containerd store) from the index's `io.containerd.image.name`, docker's classic store from a
# docker-archive `manifest.json` (`RepoTags`), as `docker save` writes both. The index keeps
# umoci's `org.opencontainers.image.ref.name` (the version) for `oci-archive:…:VERSION`.
python3 - "$layout" "$version" <<'PY'
import json, os, sys
layout, version = sys.argv[1], sys.argv[2]
name = "cyberwave-cloud-node"
with open(os.path.join(layout, "index.json")) as f:
    index = json.load(f)
[entry] = index["manifests"]
entry.setdefault("annotations", {})["io.containerd.image.name"] = f"docker.io/library/{name}:{version}"
blob = lambda d: "blobs/" + d["digest"].replace(":", "/")
with open(os.path.join(layout, blob(entry))) as f:
    manifest = json.load(f)
archive = [{"Config": blob(manifest["config"]),
            "RepoTags": [f"{name}:{version}", f"{name}:latest"],
            "Layers": [blob(l) for l in manifest["layers"]]}]
for fname, doc in (("index.json", index), ("manifest.json", archive)):
    with open(os.path.join(layout, fname), "w") as f:
        json.dump(doc, f)
PY
tar -C "$layout" -cf "$out/cyberwave-cloud-node-oci.tar" .
umoci stat --image "$layout:$version" >/dev/null
echo "image: $layout:$version ($(du -sh "$out/cyberwave-cloud-node-oci.tar" | cut -f1) archive: $out/cyberwave-cloud-node-oci.tar)"
