#!/usr/bin/env bash
# Builds the kvc-router wheel: `pip install kvc_router-*.whl` puts the `kvc-router` and
# `kvc-replay` binaries on PATH (a venv's bin/, or ~/.local/bin), as `pip install
# vllm-router` does for its router. Prints the wheel's path on its last line.
#
#   scripts/wheel/build.sh [--release | --debug | --profile NAME] [--out DIR]
#
#   --release        the release profile, binaries stripped (the default)
#   --debug          the dev profile, not stripped: the debug build `cargo build` made is
#                    packaged as it is (tests/tests/wheel.rs)
#   --profile NAME   any Cargo profile; stripped unless it is `dev`
#   --out DIR        where the wheel goes (default target/wheel/dist)
#
# How two crates' binaries make one wheel: maturin's `bindings = "bin"` packages the binaries
# of one crate, and builds and audits that crate itself. kvc-router is that crate
# (crates/kvc-router/Cargo.toml, named as `manifest-path`); kvc-replay, a crate of its own,
# is built first by cargo with the same profile and the same stripping, and handed to maturin
# as wheel data: a `kvc_router.data/scripts/` folder, which the wheel format installs into
# bin/ like any script (PEP 427). The packaging manifest, scripts/wheel/pyproject.toml, is
# copied into a staging folder under target/ beside that data folder, with the two keys that
# name paths of this machine appended. This keeps both crates as they are: no packaging
# crate re-declaring their dependencies, no binary compiled twice.
#
# Platform tag: maturin gives the lowest manylinux tag the binary's glibc symbol versions
# allow, and `--auditwheel check` fails the build if it links any library outside the
# manylinux set (it links libc, libm, libgcc_s and the loader only). On a glibc 2.34 or newer
# build machine (Debian 12: 2.36) every binary needs GLIBC_2.34 (`__libc_start_main` and
# the pthread functions moved into libc.so.6 there), so the tag is manylinux_2_34: pip
# installs it on glibc 2.34 and later (Debian 12, Ubuntu 22.04, RHEL 9). An older tag needs
# a build on an older glibc (a manylinux_2_28 build image). maturin audits only the binary
# it built, so this script also reads kvc-replay's glibc version needs
# (scripts/wheel/glibc.py) and fails if they exceed the wheel's tag.
#
# maturin comes from PyPI, pinned, into target/wheel-tools/venv (a venv this script owns).
# Exits 3 when python3 is absent (callers then skip what needs the wheel).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
maturin_version="1.16.0"
profile="release"
out="$target/wheel/dist"
while [ $# -gt 0 ]; do
  case "$1" in
    --release) profile="release" ;;
    --debug) profile="dev" ;;
    --profile) profile="${2:?--profile needs a name}"; shift ;;
    --out) out="${2:?--out needs a folder}"; shift ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
command -v python3 >/dev/null 2>&1 || { echo "python3 not found" >&2; exit 3; }
cargo="${CARGO:-cargo}"
# Nothing of the package a calling `cargo run` or `cargo test` names (CARGO_PKG_NAME, ...):
# build scripts take those variables for inputs (ring's), and a value other than the last
# build's would rebuild ring and everything above it.
unset OUT_DIR CARGO_CRATE_NAME CARGO_BIN_NAME CARGO_PRIMARY_PACKAGE CARGO_TARGET_TMPDIR \
  "${!CARGO_PKG_@}" "${!CARGO_MANIFEST_@}" "${!CARGO_CFG_@}" "${!CARGO_BIN_EXE_@}"
mkdir -p "$target/wheel" "$out"
out="$(cd "$out" && pwd)"
tools="$target/wheel-tools"
mkdir -p "$tools"
# One installer at a time, and one build per profile (tests may run in parallel; the venv and
# each profile's staging folder are shared).
(
  flock 9
  if [ ! -x "$tools/venv/bin/python" ]; then
    python3 -m venv "$tools/venv"
  fi
  if [ "$("$tools/venv/bin/maturin" --version 2>/dev/null)" != "maturin $maturin_version" ]; then
    "$tools/venv/bin/pip" install --quiet --disable-pip-version-check \
      "maturin==$maturin_version" >&2
  fi
) 9>"$tools/.lock"
maturin="$tools/venv/bin/maturin"

case "$profile" in
  dev) dir="debug"; strip=false ;;
  *) dir="$profile"; strip=true ;;
esac

# kvc-replay, built as maturin builds kvc-router: stripped with rustc's own `-C strip`.
if $strip; then
  "$cargo" rustc --quiet --locked --profile "$profile" -p kvc-replay --bin kvc-replay \
    --manifest-path "$root/Cargo.toml" -- -C strip=symbols >&2
else
  "$cargo" build --quiet --locked --profile "$profile" -p kvc-replay \
    --manifest-path "$root/Cargo.toml" >&2
fi

stage="$target/wheel/stage-$profile"
exec 9>"$stage.lock"
flock 9
rm -rf "$stage"
mkdir -p "$stage/kvc_router.data/scripts" "$stage/dist"
cp "$target/$dir/kvc-replay" "$stage/kvc_router.data/scripts/kvc-replay"
{
  cat "$here/pyproject.toml"
  echo "manifest-path = \"$root/crates/kvc-router/Cargo.toml\""
  echo "data = \"kvc_router.data\""
  echo "strip = $strip"
} > "$stage/pyproject.toml"

(cd "$stage" && "$maturin" build --quiet --profile "$profile" --auditwheel check \
  --out "$stage/dist" >&2)
wheels=("$stage"/dist/*.whl)
[ "${#wheels[@]}" -eq 1 ] && [ -f "${wheels[0]}" ] || {
  echo "build.sh: maturin made ${#wheels[@]} wheels: ${wheels[*]}" >&2
  exit 1
}
wheel="$out/$(basename "${wheels[0]}")"
mv -f "${wheels[0]}" "$wheel"

# What the wheel holds, and whether both binaries fit its platform tag.
python3 - "$wheel" "$here/glibc.py" "$stage" <<'PY' >&2
import os, re, subprocess, sys, zipfile
wheel, glibc, stage = sys.argv[1:]
name = os.path.basename(wheel)
m = re.fullmatch(r"kvc_router-([^-]+)-py3-none-(.+)\.whl", name)
assert m, f"unexpected wheel name {name}"
version, platform = m.groups()
z = zipfile.ZipFile(wheel)
scripts = sorted(n for n in z.namelist() if "/scripts/" in n)
want = [f"kvc_router-{version}.data/scripts/{b}" for b in ("kvc-replay", "kvc-router")]
assert scripts == want, f"the wheel's scripts are {scripts}, not {want}"
os.makedirs(f"{stage}/check", exist_ok=True)
paths = [z.extract(n, f"{stage}/check") for n in want]
newest = subprocess.run([sys.executable, glibc, *paths], check=True, capture_output=True,
                        text=True).stdout.split()[-1]
tag = re.match(r"manylinux_(\d+)_(\d+)_", platform)
if tag:
    need = tuple(map(int, newest.split(".")))
    assert need <= tuple(map(int, tag.groups())), \
        f"the binaries need glibc {newest}, more than the tag {platform} allows"
size = os.path.getsize(wheel)
print(f"wheel {name}: {size / 2**20:.1f} MiB, {', '.join(os.path.basename(p) for p in paths)}"
      f" need glibc {newest} ({platform})")
PY
echo "$wheel"
