#!/usr/bin/env bash
# Builds the kvc-router container image without a registry or a container daemon: an OCI
# image layout archive, target/image/kvc-router-oci.tar, image kvc-router:<version> (the
# crate's version). Load it where the cluster's runtime is:
#
#   podman load -i target/image/kvc-router-oci.tar     # or: docker load -i ...
#
#   scripts/image/build.sh [--release | --debug | --profile NAME] [--bins DIR] [--out FILE]
#                          [--check]
#
#   --release        the release profile, binaries stripped (the default)
#   --debug          the dev profile's binaries as `cargo build` made them (a test image)
#   --profile NAME   any Cargo profile; stripped unless it is `dev`
#   --bins DIR       kvc-router and kvc-replay as they are in DIR, nothing built (the tests
#                    pass the binaries `cargo test` just built: a build of its own would
#                    compile them again, with the test build's features left out)
#   --out FILE       the archive (default target/image/kvc-router-oci.tar)
#   --check          then read the archive back and run it (scripts/image/oci.py check):
#                    digests, entrypoint and user, and kvc-router and kvc-replay run from the
#                    unpacked root filesystem (chroot, or `unshare -r chroot` when not root)
#
# The image is made by hand, `FROM scratch` in effect (scripts/image/oci.py): kvc-router and
# kvc-replay in /usr/local/bin, exactly the shared libraries they link and the dynamic
# loader (libc, libm, libgcc_s, ld-linux: what ldd resolves, checked against the ELF's NEEDED
# entries), the non-root user kvc (65532:65532) it runs as, entrypoint kvc-router. No CA
# certificates: kvc-router's TLS (rustls) trusts only the CA files its configuration names
# (the Kubernetes API's is the service account's mounted ca.crt) and never the system store;
# the build fails if Cargo.lock ever brings in a crate that reads system or bundled roots.
#
# With registry access, scripts/image/Containerfile builds an equivalent image the usual way
# (`podman build -f scripts/image/Containerfile -t kvc-router:<version> .`).
# Exits 3 when python3 is absent.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
profile="release"
out="$target/image/kvc-router-oci.tar"
check=false
bins=""
while [ $# -gt 0 ]; do
  case "$1" in
    --release) profile="release" ;;
    --debug) profile="dev" ;;
    --profile) profile="${2:?--profile needs a name}"; shift ;;
    --out) out="${2:?--out needs a file}"; shift ;;
    --bins) bins="${2:?--bins needs a directory}"; shift ;;
    --check) check=true ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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

roots="$(grep -E '^name = "(webpki-roots|rustls-native-certs|openssl-probe|native-tls)"$' \
  "$root/Cargo.lock" || true)"
if [ -n "$roots" ]; then
  echo "build.sh: Cargo.lock now has $roots: the image needs CA certificates" >&2
  exit 1
fi

case "$profile" in
  dev) dir="debug"; strip=false ;;
  *) dir="$profile"; strip=true ;;
esac
if [ -n "$bins" ]; then
  for b in kvc-router kvc-replay; do
    [ -x "$bins/$b" ] || { echo "build.sh: --bins $bins has no executable $b" >&2; exit 2; }
  done
else
  bins="$target/$dir"
  # Each binary built on its own, as scripts/wheel/build.sh and maturin build them, so a
  # release build serves both packages.
  for crate in kvc-replay kvc-router; do
    if $strip; then
      "$cargo" rustc --quiet --locked --profile "$profile" -p "$crate" --bin "$crate" \
        --manifest-path "$root/Cargo.toml" -- -C strip=symbols >&2
    else
      "$cargo" build --quiet --locked --profile "$profile" -p "$crate" --bin "$crate" \
        --manifest-path "$root/Cargo.toml" >&2
    fi
  done
fi
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/crates/kvc-router/Cargo.toml" | head -n 1)"
mkdir -p "$(dirname "$out")"
python3 "$here/oci.py" build --name kvc-router --tag "$version" --out "$out" \
  "$bins/kvc-router" "$bins/kvc-replay"
if $check; then
  python3 "$here/oci.py" check "$out" --version "$version"
fi
