# Shared by the side-by-side scripts (sourced, not run).

# log MESSAGE...: a line on stderr, prefixed with the script's name ($tag).
log() { echo "${tag:-side-by-side}: $*" >&2; }

# install VENV PACKAGE VERSION EXECUTABLE: PACKAGE==VERSION from PyPI into its own virtual
# environment, unless it is there already at that version. (Installed together,
# sglang-router shadows SMG's argument parser, so each peer has a venv of its own.)
install() {
  local venv="$1" package="$2" version="$3" exe="$4"
  if ! "$venv/bin/$exe" --help >/dev/null 2>&1 \
     || [ "$("$venv/bin/pip" show "$package" 2>/dev/null | sed -n 's/^Version: //p')" != "$version" ]; then
    log "installing $package==$version into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$package==$version"
  fi
}

# port_busy PORT: something on 127.0.0.1 accepts connections at PORT.
port_busy() {
  python3 -c 'import socket,sys; s=socket.socket(); sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)' "$1"
}

# build_release: kvc-replay and kvc-router of the tree at $root (release); sets replay and
# kvc_router to the binaries.
build_release() {
  log "building kvc-replay and kvc-router (release)"
  (cd "$root" && cargo build --release --locked --quiet -p kvc-replay -p kvc-router)
  local target="${CARGO_TARGET_DIR:-$root/target}"
  replay="$target/release/kvc-replay"
  kvc_router="$target/release/kvc-router"
}

# scaled_trace DIR SEED SESSIONS FACTOR TURNS [SPAN]: the SWE-agent generator's sessions
# (started within SPAN seconds, default 30) cut down to a CPU engine by scale_trace.py (token counts divided by FACTOR, the
# first TURNS turns, outputs of at most 64 tokens) into DIR/trace.jsonl; sets block to the
# scaled trace's block size.
scaled_trace() {
  "$replay" gen swe --seed "$2" --sessions "$3" --start-span "${6:-30}" --out "$1/swe.jsonl" --quiet
  block="$(python3 "$root/scripts/side-by-side/scale_trace.py" "$1/swe.jsonl" "$1/trace.jsonl" \
    --factor "$4" --turns "$5" --max-output 64)"
}
