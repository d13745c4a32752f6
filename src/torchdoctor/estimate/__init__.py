"""VRAM estimates of a training step without a GPU (``torchdoctor estimate``).

The step is traced under fake tensors on the CPU, storage by storage; CUDA's kernel choices and
caching allocator are modelled on top. Importing this package does not import torch.

``torchdoctor.estimate(...)`` is :func:`torchdoctor.estimate.api.estimate`: once this package
is imported, the attribute ``torchdoctor.estimate`` is the package itself, so the package is
made callable and forwards to the function. ``estimate``, ``max_batch`` and the result types are
importable from here too.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_LAZY = {
    "estimate": "torchdoctor.estimate.api",
    "max_batch": "torchdoctor.estimate.api",
    "Estimate": "torchdoctor.estimate.result",
    "MaxBatch": "torchdoctor.estimate.result",
    "PROFILES": "torchdoctor.estimate.profiles",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torchdoctor.estimate.api import estimate

        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
