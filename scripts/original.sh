#!/bin/sh
# Installs the Python original (github.com/cyberwave-os/cyberwave-cloud-node) from a checkout of
# it into a scratch virtualenv outside the repository, with its dependencies from PyPI, so that
# the benchmarks can run it beside this node. Nothing of it enters this repository. Prints the
# launcher to give the benchmarks:
#
#   scripts/original.sh PATH-TO-CHECKOUT [VENV]   (default VENV: ~/.cache/cyberwave-bench/original-venv)
#   CYBERWAVE_BENCH_ORIGINAL=$(scripts/original.sh ~/src/cyberwave-cloud-node) ./scripts/bench start
#
# The venv is rebuilt each time (a venv cannot be moved; its scripts name their interpreter by
# path). What was installed (version, commit, date) is written to VENV/ORIGIN.
set -eu
if [ $# -lt 1 ] || [ ! -f "$1/pyproject.toml" ]; then
    echo "usage: $0 PATH-TO-CHECKOUT-OF-THE-ORIGINAL [VENV]  (a folder with its pyproject.toml)" >&2
    exit 2
fi
SRC="$(cd "$1" && pwd)"
DIR="${2:-${XDG_CACHE_HOME:-$HOME/.cache}/cyberwave-bench/original-venv}"
case "$DIR" in
    "$(cd "$(dirname "$0")/.." && pwd)"/*) echo "$0: the venv goes outside this repository" >&2; exit 2 ;;
esac
rm -rf "$DIR"
mkdir -p "$(dirname "$DIR")"
python3 -m venv "$DIR"
# A copy of the checkout, so that a build inside it leaves the checkout as it was.
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
cp -R "$SRC/." "$BUILD/"
if ! "$DIR/bin/pip" install --quiet --disable-pip-version-check --timeout 60 "$BUILD" \
    >"$DIR/pip.log" 2>&1; then
    cat "$DIR/pip.log" >&2
    exit 1
fi
COMMIT="$(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo unknown)"
VERSION="$("$DIR/bin/cyberwave-cloud-node" --version)"
{
    echo "source: $SRC"
    echo "commit: $COMMIT"
    echo "version: $VERSION"
    echo "installed: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    "$DIR/bin/pip" freeze --disable-pip-version-check 2>/dev/null | sed 's/^/  /'
} >"$DIR/ORIGIN"
echo "$VERSION (commit $COMMIT) installed in $DIR" >&2
echo "$DIR/bin/cyberwave-cloud-node"
