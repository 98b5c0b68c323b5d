#!/bin/sh
# A scratch virtualenv with the platform's CLI (`cyberwave-cli` from PyPI), for the tests that
# drive `cyberwave compute …` against the real node (tests/install.rs). Cached: a venv that
# already holds the pinned version is reused. Prints the venv's path.
#
#   scripts/cyberwave-cli-venv.sh [DIR]     (default: target/cyberwave-cli-venv)
#
# Exit 0: ready; 75 (EX_TEMPFAIL): PyPI could not be reached and nothing is cached (the test
# skips, loudly); anything else: a real failure.
set -eu
VERSION="${CYBERWAVE_CLI_VERSION:-0.12.7}"
cd "$(dirname "$0")/.."
DIR="${1:-target/cyberwave-cli-venv}"
if [ -f "$DIR/.complete" ] && [ -x "$DIR/bin/cyberwave" ] &&
    "$DIR/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('cyberwave-cli') != '$VERSION')" 2>/dev/null; then
    echo "$DIR"
    exit 0
fi
# A venv cannot be moved (its scripts name their interpreter by path): built in place, marked
# complete last.
rm -rf "$DIR"
python3 -m venv "$DIR"
if ! "$DIR/bin/pip" install --quiet --disable-pip-version-check --timeout 30 \
    "cyberwave-cli==$VERSION" >"$DIR/pip.log" 2>&1; then
    cat "$DIR/pip.log" >&2
    if grep -qiE "connection|resolve|network|timed out|No matching distribution" "$DIR/pip.log"; then
        rm -rf "$DIR"
        exit 75
    fi
    exit 1
fi
touch "$DIR/.complete"
echo "$DIR"
