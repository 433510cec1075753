"""Gives NIXL's progress thread a pause between polls in the harness's engines.

NIXL's Python agent (nixl/_api.py) builds its agent configuration with `pthrDelay = 0`: the
UCX backend's progress thread polls without pausing, and each NixlConnector engine keeps a
core busy with it even when idle (docs/calibration.md). On a GPU server that core is one of
many; on the harness's two cores it is a third of the machine per engine, taken from the
engines' own compute and from everything run beside them. up.sh puts this directory on the
engines' PYTHONPATH with KVC_NIXL_PROGRESS_DELAY_US set: the configuration's `pthrDelay`
(the pause between polls, in microseconds) is then at least that. Unset or 0, nothing is
changed. vLLM itself is not touched.
"""

import os

_DELAY_US = int(os.environ.get("KVC_NIXL_PROGRESS_DELAY_US", "0") or 0)


def _patch(bindings):
    base = bindings.nixlAgentConfig

    class PausedProgressConfig(base):
        def __setattr__(self, name, value):
            if name == "pthrDelay":
                value = max(int(value), _DELAY_US)
            super().__setattr__(name, value)

    bindings.nixlAgentConfig = PausedProgressConfig


if _DELAY_US > 0:
    import importlib.abc
    import importlib.util
    import sys

    class _NixlBindingsFinder(importlib.abc.MetaPathFinder):
        """Patches NIXL's compiled bindings (`nixl*._bindings`) as they are imported."""

        def find_spec(self, fullname, path, target=None):
            if not (fullname.startswith("nixl") and fullname.endswith("._bindings")):
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(fullname)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                _patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _NixlBindingsFinder())
