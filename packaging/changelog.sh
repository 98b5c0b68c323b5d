#!/usr/bin/env bash
# Prints a Debian-format changelog for PACKAGE at VERSION from packaging/release-notes.md:
#   packaging/changelog.sh PACKAGE VERSION [MAINTAINER]
# Every `## X` section becomes an entry (newest first). A VERSION without a section of its own (a
# test rebuild such as 0.3.0+lc1) gets an entry saying it is a rebuild. The date of every entry
# is that of the last commit (or SOURCE_DATE_EPOCH), so rebuilding gives the same bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
pkg=$1 version=$2 maint=${3:-"Cyberwave <info@cyberwave.com>"}
notes=packaging/release-notes.md
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
when=$(LC_ALL=C date -u -R -d "@$epoch")
entry() { # VERSION, then the items on stdin
  echo "$pkg ($1) unstable; urgency=medium"
  echo
  sed -e 's/^- /  * /' -e 's/^  \([^ *]\)/    \1/'
  echo
  echo " -- $maint  $when"
}
if ! grep -qx "## $version" "$notes"; then
  echo "- Rebuild of the latest release as version $version." | entry "$version"
  echo
fi
first=1
for v in $(sed -n 's/^## //p' "$notes"); do
  [ $first -eq 1 ] || echo
  first=0
  awk -v v="$v" '$0 == "## " v {on=1; next} /^## /{on=0} on && NF' "$notes" | entry "$v"
done
