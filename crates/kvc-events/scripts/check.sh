#!/usr/bin/env bash
# The KV-cache event decoder against the engines' own Python stack: installs msgspec and pyzmq
# (pinned) into target/kv-events-py/venv (needs PyPI), regenerates the fixtures with
# fixtures.py and fails if any byte differs from crates/kvc-events/tests/fixtures/, then runs
# the ignored test tests/python.rs: a pyzmq PUB + replay ROUTER (live_publisher.py) feeding the
# Rust subscriber over loopback. Run by `cargo xtask test`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
work="${CARGO_TARGET_DIR:-$root/target}/kv-events-py"
mkdir -p "$work"
cargo="${CARGO:-cargo}"
# Nothing of the package a calling `cargo run` or `cargo test` names (CARGO_PKG_NAME, ...):
# build scripts take those variables for inputs (ring's), and a value other than the last
# build's would rebuild ring and everything above it.
unset OUT_DIR CARGO_CRATE_NAME CARGO_BIN_NAME CARGO_PRIMARY_PACKAGE CARGO_TARGET_TMPDIR \
  "${!CARGO_PKG_@}" "${!CARGO_MANIFEST_@}" "${!CARGO_CFG_@}" "${!CARGO_BIN_EXE_@}"

if [ ! -x "$work/venv/bin/python" ]; then
  python3 -m venv "$work/venv"
fi
"$work/venv/bin/pip" install --quiet --disable-pip-version-check msgspec==0.22.0 pyzmq==27.3.0

rm -rf "$work/fixtures"
"$work/venv/bin/python" "$here/fixtures.py" "$work/fixtures"
committed="$here/../tests/fixtures"
status=0
for f in "$work"/fixtures/*.msgpack; do
  name="$(basename "$f")"
  if ! cmp -s "$f" "$committed/$name"; then
    echo "kv-events fixtures: $name differs from what msgspec writes (rerun scripts/fixtures.py)" >&2
    status=1
  fi
done
for f in "$committed"/*.msgpack; do
  [ -f "$work/fixtures/$(basename "$f")" ] || { echo "kv-events fixtures: $(basename "$f") is not written by fixtures.py" >&2; status=1; }
done
[ "$status" -eq 0 ] || exit "$status"
echo "kv-events fixtures: $(ls "$work"/fixtures/*.msgpack | wc -l) payloads identical to msgspec's"

# `--workspace` (only kvc-events has a test named python): the features `cargo test --workspace`
# builds with, so after it nothing is compiled again.
KVC_EVENTS_PYTHON="$work/venv/bin/python" "$cargo" test --quiet --locked --workspace \
  --manifest-path "$root/Cargo.toml" --test python -- --ignored
