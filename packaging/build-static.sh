#!/usr/bin/env bash
# Builds a fully static x86_64 binary into target/static/cyberwave-cloud-node:
# musl with a vendored OpenSSL when the musl target can be had, else static glibc (which can
# resolve names only through `files` and `dns`, so musl is preferred for what ships).
# Prints the path, the size and `file`'s verdict; fails if the result links anything dynamically.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/deps.sh
sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
out=target/static
mkdir -p "$out"

musl_ready() {
  rustup target list --installed 2>/dev/null | grep -qx x86_64-unknown-linux-musl ||
    timeout 180 rustup target add x86_64-unknown-linux-musl >/dev/null 2>&1 || return 1
  command -v musl-gcc >/dev/null 2>&1 ||
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq musl-tools >/dev/null 2>&1 || return 1
}

if [ "${CW_STATIC_KIND:-auto}" != "glibc" ] && musl_ready; then
  kind=musl
  cargo build --profile release-small --target x86_64-unknown-linux-musl --features vendored-openssl
  bin=target/x86_64-unknown-linux-musl/release-small/cyberwave-cloud-node
else
  kind=glibc-static
  OPENSSL_STATIC=1 OPENSSL_LIB_DIR=/usr/lib/x86_64-linux-gnu OPENSSL_INCLUDE_DIR=/usr/include \
  RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --profile release-small --target x86_64-unknown-linux-gnu
  bin=target/x86_64-unknown-linux-gnu/release-small/cyberwave-cloud-node
fi
cp "$bin" "$out/cyberwave-cloud-node"
bin="$out/cyberwave-cloud-node"
verdict=$(file -b "$bin")
size=$(stat -c %s "$bin")
echo "static binary: $bin ($kind)"
echo "size: $size bytes ($(( size / 1024 )) KiB; budget 8 MiB)"
echo "file: $verdict"
case "$verdict" in
  *"statically linked"*|*"static-pie linked"*) ;;
  *) echo "FAIL: $bin is dynamically linked" >&2; exit 1 ;;
esac
if ldd "$bin" 2>&1 | grep -q '=>'; then
  echo "FAIL: ldd lists shared libraries" >&2; ldd "$bin" >&2; exit 1
fi
if [ "$size" -gt $(( 8 * 1024 * 1024 )) ]; then
  echo "FAIL: over the 8 MiB budget" >&2; exit 1
fi
