#!/usr/bin/env bash
# The package life-cycle test: install -> upgrade -> downgrade -> channel switch (-dev replaces
# stable) -> remove -> purge of the real .debs from target/debian (build-deb.sh), with a later
# version (VERSION+lc1) built here from the same binary.
#
# The throwaway root: an overlay of the host's own / (its packages, dpkg database, perl,
# init-system-helpers, passwd) with a tmpfs upper layer, mounted in a private mount namespace
# (unshare --mount) and entered with chroot. Every write lands in the tmpfs and vanishes with the
# namespace: the host's / is never written. No systemd runs in it, so this also proves the
# maintainer scripts work without one. Needs root, util-linux (unshare) and overlayfs.
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "FAIL: lifecycle: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || fail "needs root (a mount namespace and chroot)"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
next="$version+lc1"
debs=target/debian
next_debs=target/debian-lc

if [ -z "${CW_LIFECYCLE_INNER:-}" ]; then
  for p in cyberwave-cloud-node cyberwave-cloud-node-dev; do
    [ -f "$debs/${p}_${version}_amd64.deb" ] || fail "$debs/${p}_${version}_amd64.deb missing (run build-deb.sh)"
  done
  ./scripts/deps.sh
  CW_DEB_VERSION="$next" CW_DEB_OUT="$next_debs" ./packaging/build-deb.sh >/dev/null
  base=$(mktemp -d)
  rc=0
  unshare --mount --propagation private env CW_LIFECYCLE_INNER="$base" "$0" "$@" || rc=$?
  rmdir "$base" # its mounts went with the namespace
  exit "$rc"
fi

# --- inside the private mount namespace ---
base=$CW_LIFECYCLE_INNER
mount -t tmpfs -o size=1g,mode=0700 tmpfs "$base"
mkdir "$base/upper" "$base/work" "$base/root"
mount -t overlay overlay -o "lowerdir=/,upperdir=$base/upper,workdir=$base/work" "$base/root"
R="$base/root"
mount --rbind /dev "$R/dev"
mount -t proc proc "$R/proc"
mount -t tmpfs tmpfs "$R/run"
mount -t tmpfs tmpfs "$R/tmp"
workload=""
trap '[ -z "$workload" ] || kill "$workload" 2>/dev/null || true' EXIT
log="$R/tmp/dpkg.log"
inroot() { chroot "$R" "$@"; }
dpkg_in() { # a dpkg operation in the root; its output goes to the log, shown on failure
  echo "== dpkg $*" >>"$log"
  inroot dpkg "$@" </dev/null >>"$log" 2>&1 || { cat "$log" >&2; fail "dpkg $* failed"; }
}
status() { inroot dpkg-query -W -f '${db:Status-Status} ${Version}' "$1" 2>/dev/null || echo not-installed; }
# Docker-style path-excludes (man pages, docs) would hide what the packages install.
rm -f "$R"/etc/dpkg/dpkg.cfg.d/*
mkdir -p "$R/tmp/debs" "$R/tmp/debs-next"
cp "$debs"/*.deb "$R/tmp/debs/"
cp "$next_debs"/*.deb "$R/tmp/debs-next/"
stable=/tmp/debs/cyberwave-cloud-node_${version}_amd64.deb
dev=/tmp/debs/cyberwave-cloud-node-dev_${version}_amd64.deb
stable_next=/tmp/debs-next/cyberwave-cloud-node_${next}_amd64.deb

# A clean start even on a host where the node is installed: none of it in the root.
for p in cyberwave-cloud-node cyberwave-cloud-node-dev cyberwave-cloud-node-staging; do
  [ "$(status "$p")" = not-installed ] || dpkg_in --purge "$p"
done
inroot getent passwd cyberwave >/dev/null && inroot userdel cyberwave
inroot getent group cyberwave >/dev/null && inroot groupdel cyberwave
rm -rf "$R/var/lib/cyberwave-cloud-node"
state="$R/var/lib/cyberwave-cloud-node"
env_file="$R/etc/cyberwave/cloud-node.env"
wants="$R/etc/systemd/system/multi-user.target.wants/cyberwave-cloud-node.service"
mask="$R/etc/systemd/system/cyberwave-cloud-node.service"

echo "lifecycle: install $version"
dpkg_in -i "$stable"
[ "$(status cyberwave-cloud-node)" = "installed $version" ] || fail "status: $(status cyberwave-cloud-node)"
inroot getent passwd cyberwave | grep -q ':/var/lib/cyberwave-cloud-node:/usr/sbin/nologin$' || fail "no cyberwave system user"
owner=$(inroot stat -c '%a %U %G' /var/lib/cyberwave-cloud-node 2>&1) || true
[ "$owner" = "700 cyberwave cyberwave" ] || fail "state dir: $owner"
[ "$(stat -c %a "$env_file")" = 600 ] || fail "env file mode"
[ -L "$wants" ] || fail "the unit is not enabled (no $wants)"
inroot cyberwave-cloud-node --version | grep -qx "cyberwave-cloud-node $version" || fail "--version"
inroot env MANPAGER=cat MANWIDTH=80 man cyberwave-cloud-node 2>/dev/null | grep -q 'cyberwave-cloud-node - turns this host' ||
  fail "man cyberwave-cloud-node"
complete_in() { # what bash completion offers for the words given, the last one being completed
  inroot bash -c 'source /usr/share/bash-completion/completions/cyberwave-cloud-node
    COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); _cyberwave_cloud_node; echo "${COMPREPLY[*]}"' _ "$@"
}
[ "$(complete_in cyberwave-cloud-node dr)" = drain ] || fail "bash completion of 'dr': $(complete_in cyberwave-cloud-node dr)"
[ "$(complete_in cyberwave-cloud-node logs --st)" = --stderr ] || fail "bash completion of 'logs --st'"
[ -s "$R/usr/share/zsh/vendor-completions/_cyberwave-cloud-node" ] || fail "zsh completion"
[ -s "$R/usr/share/fish/vendor_completions.d/cyberwave-cloud-node.fish" ] || fail "fish completion"

# A running workload (a process of the cyberwave user, as the node starts them), local edits
# to the env conffile, and state the node keeps.
echo "CYBERWAVE_MQTT_HOST=edited.example" >>"$env_file"
echo '{"uuid":"lifecycle"}' >"$state/identity.json"
chroot --userspec=cyberwave:cyberwave "$R" /bin/sleep 600 </dev/null >/dev/null 2>&1 &
workload=$!
alive() { # a zombie is dead too (kill -0 would still succeed)
  [ -r "/proc/$workload/stat" ] && [ "$(cut -d' ' -f3 "/proc/$workload/stat")" != Z ]
}
kept() { # after each step: the workload runs, the edit and the state are still there
  alive || fail "$1: the running workload was killed"
  grep -qx "CYBERWAVE_MQTT_HOST=edited.example" "$env_file" || fail "$1: the env file lost its local edit"
  [ "$(stat -c %a "$env_file")" = 600 ] || fail "$1: env file mode $(stat -c %a "$env_file")"
  [ -f "$state/identity.json" ] || fail "$1: the state dir lost the identity"
  [ ! -e "$env_file.dpkg-new" ] && [ ! -e "$env_file.dpkg-dist" ] || fail "$1: conffile left .dpkg-new/.dpkg-dist"
}

echo "lifecycle: upgrade to $next"
dpkg_in -i "$stable_next"
[ "$(status cyberwave-cloud-node)" = "installed $next" ] || fail "upgrade: $(status cyberwave-cloud-node)"
kept upgrade
[ -L "$wants" ] || fail "upgrade: the unit is no longer enabled"

echo "lifecycle: downgrade to $version"
dpkg_in -i "$stable"
[ "$(status cyberwave-cloud-node)" = "installed $version" ] || fail "downgrade: $(status cyberwave-cloud-node)"
kept downgrade

echo "lifecycle: switch channel: -dev replaces stable"
dpkg_in -i "$dev"
[ "$(status cyberwave-cloud-node-dev)" = "installed $version" ] || fail "-dev: $(status cyberwave-cloud-node-dev)"
case "$(status cyberwave-cloud-node)" in
  installed*) fail "stable is still installed next to -dev" ;;
esac
kept "channel switch"
[ -x "$R/usr/bin/cyberwave-cloud-node" ] || fail "channel switch: no binary"
[ -L "$wants" ] || fail "channel switch: the unit is no longer enabled"
[ -e "$mask" ] && fail "channel switch: the unit is left masked"
echo "lifecycle: stable after the switch: $(status cyberwave-cloud-node)"
# Purging what is left of stable must not take the state -dev now runs on.
[ "$(status cyberwave-cloud-node)" = not-installed ] || dpkg_in --purge cyberwave-cloud-node
kept "purge of the replaced stable package"
[ -L "$wants" ] || fail "purge of the replaced stable: the unit is no longer enabled"

echo "lifecycle: remove"
dpkg_in -r cyberwave-cloud-node-dev
[ ! -e "$R/usr/bin/cyberwave-cloud-node" ] || fail "remove: the binary is still there"
kept remove

echo "lifecycle: purge while a workload runs: its state is kept"
# Its record as the node's supervisor writes it: the pid and its start time (field 22), plus
# one of a workload that ended and one whose pid was recycled (neither holds the state back).
ticks=$(sed 's/.*) //' "/proc/$workload/stat" | cut -d' ' -f20)
mkdir -p "$state/workloads/w-run" "$state/workloads/w-done" "$state/workloads/w-recycled"
echo "{\"pid\":$workload,\"start_ticks\":$ticks,\"shim_pid\":$workload,\"shim_start_ticks\":$ticks}" >"$state/workloads/w-run/started.json"
cp "$state/workloads/w-run/started.json" "$state/workloads/w-done/started.json"
echo '{"exit_code":0}' >"$state/workloads/w-done/exit.json"
echo "{\"pid\":$workload,\"start_ticks\":$((ticks + 1))}" >"$state/workloads/w-recycled/started.json"
mkfifo "$state/workloads/w-fifo" 2>/dev/null || true # a planted FIFO never hangs the script
mkdir -p "$state/workloads/w-fifo2" && mkfifo "$state/workloads/w-fifo2/started.json"
dpkg_in -P cyberwave-cloud-node-dev
[ "$(status cyberwave-cloud-node-dev)" = not-installed ] || fail "purge: $(status cyberwave-cloud-node-dev)"
[ -f "$state/identity.json" ] || fail "purge deleted the state of a running workload"
grep -q "not removing /var/lib/cyberwave-cloud-node: workloads still run there (pid $workload)" "$log" ||
  fail "purge did not say why it kept the state dir: $(tail -5 "$log")"
[ ! -e "$env_file" ] || fail "purge left the env file"
[ ! -e "$wants" ] && [ ! -e "$mask" ] || fail "purge left enablement or mask links"
alive || fail "purge killed the workload"

echo "lifecycle: purge"
dpkg_in -i "$dev"
kill "$workload" && wait "$workload" 2>/dev/null || true
workload=""
dpkg_in -P cyberwave-cloud-node-dev
[ "$(status cyberwave-cloud-node-dev)" = not-installed ] || fail "purge: $(status cyberwave-cloud-node-dev)"
[ ! -e "$state" ] || fail "purge left the state dir"
[ ! -e "$env_file" ] || fail "purge left the env file"
[ ! -e "$wants" ] && [ ! -e "$mask" ] || fail "purge left enablement or mask links"
echo "lifecycle: OK (install, upgrade, downgrade, -dev replaces stable, remove, purge with a running workload, purge)"
