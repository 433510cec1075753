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
