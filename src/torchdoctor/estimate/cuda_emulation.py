"""What CUDA does differently from the CPU trace, applied while tracing on the CPU.

A step traced on the CPU allocates what the CPU kernels allocate. For a CUDA target the trace
runs with these differences in place, so that the timeline holds what CUDA would allocate:

- attention: ``scaled_dot_product_attention`` on CUDA picks flash attention (fp16/bf16 on
  sm80+, no explicit mask) or memory-efficient attention; both keep only the output and a
  float32 logsumexp for backward, which the CPU flash kernel reproduces. Only when neither
  applies (head dim not a multiple of 8 or above 256) the math path materializes L x L scores.
  Flash attention's backward also allocates a float32 ``dq`` accumulator and ``softmax_d``;
  memory-efficient attention's backward a float32 ``delta``. They are added as transients.
- dropout: CUDA's fused dropout keeps a 1-byte mask; the CPU path keeps a mask of the input's
  dtype. ``F.dropout`` runs as ``aten.native_dropout`` (bool mask) instead.
- autocast: CUDA's op lists differ from the CPU's. The trace runs under CPU autocast (which
  lowers the same matmul/convolution/attention ops) and this module adds CUDA's float32 ops
  (layer_norm, group_norm, exp, log, pow, ...), its float32-accumulating reductions (softmax,
  log_softmax, sum, cumsum, ...) and the lower-precision ops CPU autocast leaves out (mv, addmv,
  addr, linalg_multi_dot, chain_matmul).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torchdoctor.estimate.profiles import GpuProfile
from torchdoctor.estimate.tracker import LiveStorageTracker

_ORIGINAL_SDPA = F.scaled_dot_product_attention
_ORIGINAL_DROPOUT = F.dropout
_LOW = (torch.float16, torch.bfloat16)

_FP32_NAMES = [
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "softplus",
    "layer_norm",
    "group_norm",
    "frobenius_norm",
    "nuclear_norm",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
]
_FP32_DTYPE_NAMES = ["prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "vector_norm"]
_LOWER_EXTRA_NAMES = ["mv", "addmv", "addr", "chain_matmul", "multi_dot"]


def _functions(names: list[str]) -> frozenset[Any]:
    owners = (torch, torch.Tensor, F, torch.special, torch.linalg)
    found = {getattr(owner, name) for owner in owners for name in names if hasattr(owner, name)}
    return frozenset(found)


_FP32 = _functions(_FP32_NAMES)
_FP32_DTYPE = _functions(_FP32_DTYPE_NAMES)
_LOWER_EXTRA = _functions(_LOWER_EXTRA_NAMES)


def sdpa_backend(gpu: GpuProfile, dtype: torch.dtype, head_dim: int, has_mask: bool) -> str:
    """The attention kernel PyTorch's CUDA dispatcher picks: flash, efficient or math."""
    if head_dim % 8 != 0 or head_dim > 256:
        return "math"
    if dtype in _LOW and gpu.compute_capability >= (8, 0) and not has_mask:
        return "flash"
    return "efficient"


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class CudaEmulation(TorchFunctionMode):
    """Apply CUDA's kernel choices and autocast lists to a CPU trace."""

    def __init__(self, gpu: GpuProfile, low_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.gpu = gpu
        self.low_dtype = low_dtype
        self.backends: dict[str, int] = {}

    # -- replacements --------------------------------------------------------------------------
    def sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale)
        autocast = torch.is_autocast_enabled("cpu")
        dtype = torch.get_autocast_dtype("cpu") if autocast else query.dtype
        backend = sdpa_backend(self.gpu, dtype, query.shape[-1], attn_mask is not None)
        self.backends[backend] = self.backends.get(backend, 0) + 1
        if backend == "math" or query.dim() != 4 or enable_gqa or key.shape[-3] != query.shape[-3]:
            return torch.ops.aten._scaled_dot_product_attention_math(*args[:6], scale=scale)[0]
        if torch.is_autocast_enabled("cpu"):
            query, key, value = (t.to(dtype) for t in (query, key, value))
        out, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out

    @staticmethod
    def dropout(
        input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if training and 0.0 < p < 1.0 and not inplace and input.is_floating_point():
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return _ORIGINAL_DROPOUT(input, p, training, inplace)

    def attention_backward_transients(
        self, func: Any, args: tuple, kwargs: dict, out: Any
    ) -> list[tuple[int, str]]:
        query = args[1]
        mask = kwargs.get("attn_mask", args[8] if len(args) > 8 else None)
        batch, heads, length, head_dim = query.shape
        backend = sdpa_backend(self.gpu, query.dtype, head_dim, mask is not None)
        if backend == "flash":
            rounded = _round_up(length, 128)
            dim = _round_up(head_dim, 32) if head_dim <= 192 else 256
            accum = batch * rounded * heads * dim * 4
            return [(accum + batch * heads * rounded * 4, "flash attention backward buffers")]
        return [(batch * heads * _round_up(length, 32) * 4, "efficient attention backward delta")]

    # -- torch function hook -------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is _ORIGINAL_SDPA:
            return self.sdpa(*args, **kwargs)
        if func is _ORIGINAL_DROPOUT:
            return self.dropout(*args, **kwargs)
        if self.low_dtype is not None and torch.is_autocast_enabled("cpu"):
            if func in _FP32:
                args, kwargs = _cast_floating(args, kwargs, _LOW, torch.float32)
            elif func in _FP32_DTYPE:
                first = args[0] if args else None
                if (
                    isinstance(first, torch.Tensor)
                    and first.dtype in _LOW
                    and "dtype" not in kwargs
                ):
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif func in _LOWER_EXTRA:
                args, kwargs = _cast_floating(args, kwargs, (torch.float32,), self.low_dtype)
        return func(*args, **kwargs)


def _cast_floating(
    args: tuple, kwargs: dict, sources: tuple[torch.dtype, ...], dtype: torch.dtype
) -> tuple[tuple, dict]:
    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype in sources:
            return value.to(dtype)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return type(value)(cast(v) for v in value)
        return value

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


@contextlib.contextmanager
def emulate_cuda(
    gpu: GpuProfile, low_dtype: torch.dtype | None, tracker: LiveStorageTracker
) -> Iterator[CudaEmulation]:
    """Trace as CUDA would run: patched attention and dropout, CUDA's autocast lists."""
    mode = CudaEmulation(gpu, low_dtype)
    tracker.transient_rules["_scaled_dot_product_flash_attention_for_cpu_backward"] = (
        mode.attention_backward_transients
    )
    # Patching the module attributes reaches callers inside torch (multi_head_attention_forward)
    # that a torch function mode cannot see; the mode catches direct references to the originals.
    F.scaled_dot_product_attention = mode.sdpa
    F.dropout = mode.dropout
    try:
        with mode:
            yield mode
    finally:
        F.scaled_dot_product_attention = _ORIGINAL_SDPA
        F.dropout = _ORIGINAL_DROPOUT
