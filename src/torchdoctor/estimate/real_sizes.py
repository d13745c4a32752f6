"""Real output sizes of ops whose fake (meta) kernels cannot know them.

oneDNN's LSTM/GRU layer (``aten.mkldnn_rnn_layer``) returns a workspace whose size oneDNN
decides at run time; its meta kernel reports a different one. For such ops the tracer runs the
real kernel once on zero tensors of the same shapes and takes the real sizes (cached by shape).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
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


def batch_norm_stat_sizes(func: Any, args: tuple, kwargs: dict) -> list[int | None]:
    """Batch norm keeps its saved mean and inverse std in float32 for half/bfloat16 inputs (on
    the CPU and in cuDNN), where the meta kernel gives them the input's dtype."""
    del func, kwargs
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16):
        return []
    channels = x.shape[1] if x.dim() > 1 else 1
    return [None, channels * 4, channels * 4]


STAT_SIZE_RULES = {
    "native_batch_norm": batch_norm_stat_sizes,
    "_native_batch_norm_legit": batch_norm_stat_sizes,
    "_native_batch_norm_legit_functional": batch_norm_stat_sizes,
}


# CPU kernels that allocate scratch memory inside one call: oneDNN convolutions and RNN layers
# (reordered weights, scratchpads), and low-precision matmuls (packed operands).
SCRATCH_OPS = (
    "convolution",
    "convolution_backward",
    "mkldnn_convolution",
    "mkldnn_rnn_layer",
    "mkldnn_rnn_layer_backward",
)
LOW_PRECISION_SCRATCH_OPS = ("mm", "addmm", "bmm", "baddbmm")
# Probing runs the real kernel; above this many input bytes it is skipped (scratch unmodelled).
SCRATCH_PROBE_LIMIT = 256 * 1024 * 1024

_scratch_cache: dict[tuple, int] = {}


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """torch.profiler's kineto backend writes a line to the process's stderr at every start and
    stop, below Python; a probe must not print, so file descriptor 2 points at /dev/null while
    the profiler runs."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _input_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_input_bytes(v) for v in value)
    return 0


def cpu_scratch(func: Any, args: tuple, kwargs: dict) -> int:
    """Bytes a real CPU kernel holds above its outputs at its peak inside one call.

    The kernel runs once, for real, on zero tensors of the same shapes under
    ``torch.profiler`` with ``profile_memory=True`` (cached by shapes).
    """
    from torch._C._profiler import _EventType
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.profiler import ProfilerActivity, profile

    if _input_bytes(args) > SCRATCH_PROBE_LIMIT:
        return 0
    key = (str(func), _key(args), _key(tuple(sorted(kwargs.items()))))
    if key not in _scratch_cache:
        with unset_fake_temporarily():
            real_args, real_kwargs = _real(args), _real(kwargs)
            if func._opname == "mkldnn_rnn_layer_backward":
                real_args = _with_real_rnn_workspace(real_args)
            with (
                quiet_profiler(),
                profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
            ):
                out = func(*real_args, **real_kwargs)
            del out
        allocations: list[tuple[int, int]] = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                allocations.append((node.start_time_ns, node.extra_fields.alloc_size))
        allocations.sort(key=lambda item: item[0])
        live = peak = 0
        for _, size in allocations:
            live += size
            peak = max(peak, live)
        _scratch_cache[key] = max(peak - max(live, 0), 0)
    return _scratch_cache[key]


def _with_real_rnn_workspace(args: tuple) -> tuple:
    """mkldnn_rnn_layer_backward needs the workspace of a real forward (the fake one has the
    meta kernel's size): run that forward on the same zero tensors."""
    (input, w1, w2, w3, w4, hx, cx, _out, _hy, _cy, _go, _ghy, _gcy, reverse, mode, hidden_size,
     num_layers, has_biases, train, bidirectional, batch_sizes, batch_first, _ws) = args  # fmt: skip
    # oneDNN keeps a workspace only when gradients are wanted (and backward runs without them).
    input, w1, w2, w3, w4 = (t.detach().requires_grad_() for t in (input, w1, w2, w3, w4))
    with torch.enable_grad():
        forward = torch.ops.aten.mkldnn_rnn_layer(
            input, w1, w2, w3, w4, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers,
            has_biases, bidirectional, batch_first, train,
        )  # fmt: skip
    return (*args[:-1], forward[3].detach())


def scratch_rule(func_name: str) -> Any:
    """A tracker transient rule adding ``func_name``'s CPU scratch after its outputs."""
    low_precision_only = func_name in LOW_PRECISION_SCRATCH_OPS

    def rule(func: Any, args: tuple, kwargs: dict, out: Any) -> list[tuple[int, str]]:
        if low_precision_only:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is None or first.dtype not in (torch.bfloat16, torch.float16):
                return []
        nbytes = cpu_scratch(func, args, kwargs)
        return [(nbytes, f"{func_name} scratch")] if nbytes else []

    return rule
