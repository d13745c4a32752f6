"""torchdoctor: record, diagnose and tune the resource use of PyTorch training jobs.

The public Python API is re-exported here lazily so that ``import torchdoctor`` stays cheap
and never imports torch:

- :func:`open_recording` - load a recording (``torchdoctor.recording``).
- :func:`watch` - record and instrument the current process (``torchdoctor.instrument``).
- :func:`estimate` - VRAM estimate of a training step (``torchdoctor.estimate``).
- :func:`tune_dataloader` - measure DataLoader settings in a notebook (``torchdoctor.tune``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY: dict[str, tuple[str, str | None]] = {
    "open_recording": ("torchdoctor.recording", "open_recording"),
    "Recording": ("torchdoctor.recording", "Recording"),
    "watch": ("torchdoctor.run.watch", "watch"),
    # The callable package: torchdoctor.estimate(...) and torchdoctor.estimate.max_batch(...)
    "estimate": ("torchdoctor.estimate", None),
    "tune_dataloader": ("torchdoctor.tune.notebook", "tune_dataloader"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'torchdoctor' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)
