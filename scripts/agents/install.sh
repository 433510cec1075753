#!/usr/bin/env bash
# Installs the coding agents kvc is checked with — Claude Code (@anthropic-ai/claude-code) and
# Codex CLI (@openai/codex), pinned versions from npm — under a cache directory this script
# owns, reused across runs and clones: $KVC_AGENTS_CACHE, default ~/.cache/kvc/agents. Both
# packages carry a native binary for the platform (npm fetches it as an optional dependency);
# nothing is installed system-wide. Prints the directory of the `claude` and `codex`
# commands on its last line. Exits 3 when npm is absent, so callers can skip with a notice.
set -euo pipefail
claude_version="2.1.197"
codex_version="0.171.0"
cache="${KVC_AGENTS_CACHE:-$HOME/.cache/kvc/agents}"
prefix="$cache/claude-$claude_version-codex-$codex_version"
stamp="$prefix/.kvc-installed"

command -v npm >/dev/null || { echo "agents: npm not found" >&2; exit 3; }

mkdir -p "$cache"
# One installer at a time.
exec 9>"$cache/.lock"
flock 9

if [ -f "$stamp" ] && [ -x "$prefix/node_modules/.bin/claude" ] && [ -x "$prefix/node_modules/.bin/codex" ]; then
  echo "agents: already installed in $prefix" >&2
  echo "$prefix/node_modules/.bin"
  exit 0
fi

echo "agents: installing Claude Code $claude_version and Codex CLI $codex_version into $prefix (about 400 MB)" >&2
rm -rf "$prefix"
mkdir -p "$prefix"
npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error \
  "@anthropic-ai/claude-code@$claude_version" "@openai/codex@$codex_version" >&2
for bin in claude codex; do
  "$prefix/node_modules/.bin/$bin" --version >&2 \
    || { echo "agents: $bin does not run on this machine" >&2; exit 1; }
done
echo "claude-code==$claude_version codex==$codex_version" >"$stamp"
echo "$prefix/node_modules/.bin"
