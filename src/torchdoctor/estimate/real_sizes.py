"""Real output sizes of ops whose fake (meta) kernels cannot know them.

oneDNN's LSTM/GRU layer (``aten.mkldnn_rnn_layer``) returns a workspace whose size oneDNN
decides at run time; its meta kernel reports a different one. For such ops the tracer runs the
real kernel once on zero tensors of the same shapes and takes the real sizes (cached by shape).
"""

from __future__ import annotations

from typing import Any

import torch

_cache: dict[tuple, list[int]] = {}


def _key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), tuple(value.stride()), value.dtype, value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    return value


def _real(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        real = torch.zeros(value.shape, dtype=value.dtype).as_strided(value.shape, value.stride())
        # Kernels decide on workspaces by whether gradients will be needed.
        return real.requires_grad_(value.requires_grad) if real.is_floating_point() else real
    if isinstance(value, (list, tuple)):
        return type(value)(_real(v) for v in value)
    return value


def real_output_sizes(func: Any, args: tuple, kwargs: dict) -> list[int]:
    """Storage bytes of each output of ``func`` when run for real on the CPU."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    key = (str(func), _key(args), _key(tuple(sorted(kwargs.items()))))
    if key not in _cache:
        with unset_fake_temporarily():
            out = func(*_real(args), **_real(kwargs))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        _cache[key] = [
            t.untyped_storage().nbytes() if isinstance(t, torch.Tensor) else 0 for t in outputs
        ]
    return _cache[key]


PROBED_OPS = ("mkldnn_rnn_layer",)
