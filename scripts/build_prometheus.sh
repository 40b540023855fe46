#!/usr/bin/env bash
# Debian's Prometheus server and promtool, unpacked (not installed: no service, no root needed beyond
# apt's download) into a directory outside the clone, once per version, like vLLM's environment:
#   scripts/build_prometheus.sh DIR VERSION     (VERSION: the Debian package's, e.g. 2.42.0+ds-5+deb12u1)
# The tests that scrape a stack with a real Prometheus and check the shipped alert rules use
# DIR/usr/bin/prometheus and DIR/usr/bin/promtool. Where apt cannot fetch it (not Debian 12, no
# network), it says so and exits 0: those tests skip with the reason (fail under CI=true).
set -euo pipefail
dir=$1 version=$2
mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
if [ -x "$dir/usr/bin/prometheus" ] && [ "$(cat "$dir/.complete" 2>/dev/null)" = "$version" ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  echo "prometheus: no apt-get/dpkg-deb here: the Prometheus tests will skip (see docs/setup.md)"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetching Debian's prometheus $version into $dir (once: ~20 MB)"
if ! (cd "$tmp" && apt-get download -q "prometheus=$version" >/dev/null 2>"$tmp/err"); then
  echo "prometheus: apt-get download prometheus=$version failed ($(tail -1 "$tmp/err")): the Prometheus tests will skip"
  exit 0
fi
rm -rf "$dir"
dpkg-deb -x "$tmp"/prometheus_*.deb "$dir"
"$dir/usr/bin/prometheus" --version 2>&1 | head -1
echo "$version" > "$dir/.complete"
