"""``torchdoctor.estimate``: peak memory of a training step, without a GPU.

The public entry points: :func:`estimate` (one set-up), :func:`max_batch` (the largest batch
that fits) and :func:`prepare` (a loaded model to estimate set-up after set-up). Errors name
the Python parameters (``batch_size must be at least 1``); the CLI words them as its flags.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchdoctor.errors import ParameterError, UserError, literal, require_torch
from torchdoctor.estimate.fitcheck import DEFAULT_MARGIN, FitCheck, alternatives, other_loops
from torchdoctor.estimate.loops import HAND_WRITTEN, HF_TRAINER
from torchdoctor.estimate.max_batch import find_max_batch
from torchdoctor.estimate.profiles import GpuProfile, custom_profile, find_profile
from torchdoctor.estimate.result import Estimate, MaxBatch
from torchdoctor.estimate.setup import Target, TrainingSetup
from torchdoctor.estimate.workload import Workload
from torchdoctor.units import SIZE_HINT, parse_size

ModelSpec = Any  # "file.py:factory" | "pkg.mod:factory" | "torchvision:NAME" | "hf:TYPE" | callable | nn.Module

__all__ = ["alternatives", "estimate", "max_batch", "prepare", "FitCheck", "DEFAULT_MARGIN"]

# Every keyword of the entry points, documented once. estimate(), max_batch() and prepare()
# spell their parameters out in their signatures (help() and IDEs show them); the Args:
# section of each docstring is built from this table, in signature order (_documented).
_ARGS: dict[str, str] = {
    "model": (
        'A spec string (``"file.py:factory"``, ``"package.module:factory"``,\n'
        '``"torchvision:resnet50"``, ``"hf:gpt2"``), a factory callable returning a model,\n'
        "``(model, make_batch)`` or ``(model, make_batch, loss)``, or a model instance\n"
        "(copied, never touched)."
    ),
    "batch_size": "The batch size (at least 1).",
    "input_shape": 'One sample\'s shape (``"3x224x224"`` or a tuple) of float inputs.',
    "tokens": "Sequence length of token-id inputs (the vocabulary is the model's).",
    "optimizer": '``"sgd"``, ``"sgd-momentum"``, ``"adam"`` or ``"adamw"``.',
    "optimizer_impl": (
        '``"auto"`` (what torch, or the loop\'s framework, picks),\n'
        '``"for-loop"``, ``"foreach"`` or ``"fused"``.'
    ),
    "precision": '``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"`` or ``"bf16"``.',
    "grad_accumulation": "Micro-batches per optimizer step (at least 1).",
    "inference": "One forward pass under ``torch.no_grad()`` instead of training.",
    "checkpointing": "Wrap the repeated blocks in activation checkpointing.",
    "loop": (
        "The training loop whose memory to estimate (see torchdoctor.estimate.loops):\n"
        '``"hand-written"`` keeps the model\'s output through backward and optimizer.step,\n'
        '``"frees-output"`` drops it before backward, ``"hf-trainer"`` and\n'
        '``"lightning"`` do what those trainers do. None: ``"hf-trainer"`` for ``hf:``\n'
        "specs, for a file.py:factory the loop its file uses (the Estimate's loop_reason\n"
        'says which and why), else ``"hand-written"``.'
    ),
    "factory_timeout": (
        "Seconds that importing the spec's module, and each call of its factory, may take\n"
        "before a UserError says it did not return (None: no bound). Enforced with SIGALRM\n"
        "when called from the main thread; a progress line on a terminal stderr meanwhile."
    ),
    "device": '``"cpu"`` or ``"cuda"``; None: cuda when ``gpu`` or ``gpu_memory`` is given.',
    "gpu": (
        'A GPU profile name (``"A100-80GB"``, ``"H100-80GB"``, ``"L4"``, ...) or a\n'
        "GpuProfile (a recorded GPU: torchdoctor.estimate.recorded)."
    ),
    "gpu_memory": (
        'The memory to fit instead of a profile (``"24GiB"`` or bytes); with\n'
        '``device="cpu"`` the CPU peak is checked against it.'
    ),
    "margin": "The fraction of the memory kept free when deciding what fits, in [0, 1).",
    "fallback": "Allow a real CPU run when fake tensors cannot trace the model.",
    "on_probe": "Called as ``on_probe(batch, bytes, fits)`` after each probe (progress).",
    "compare_loops": (
        "Also estimate the step under the other training loops\n"
        "(``Estimate.other_loops``), so that a loop choice that matters shows."
    ),
    "memory_snapshot": (
        "Write the step's allocations to this file as a pickle for\nhttps://pytorch.org/memory_viz."
    ),
}


def _documented(fn: Any) -> Any:
    """Fill the ``{args}`` line of ``fn``'s docstring with its parameters' entries of _ARGS
    (a parameter without one fails at import: every public keyword is documented)."""
    entries = []
    for name in inspect.signature(fn).parameters:
        first, *rest = _ARGS[name].split("\n")
        entries.append("\n            ".join([f"{name}: {first}", *rest]))
    fn.__doc__ = fn.__doc__.replace("{args}", "\n        ".join(entries))
    return fn


def _forwarded(values: dict[str, Any]) -> dict[str, Any]:
    """prepare()'s keyword arguments among an entry point's own (its ``locals()`` on entry):
    they are handed on as given, never re-listed."""
    return {name: values[name] for name in _PREPARE_KEYWORDS if name in values}


@_documented
def estimate(
    model: ModelSpec,
    *,
    batch_size: int = 1,
    input_shape: str | tuple[int, ...] | None = None,
    tokens: int | None = None,
    optimizer: str = "adamw",
    optimizer_impl: str = "auto",
    precision: str = "fp32",
    grad_accumulation: int = 1,
    inference: bool = False,
    checkpointing: bool = False,
    loop: str | None = None,
    device: str | None = None,
    gpu: str | GpuProfile | None = None,
    gpu_memory: str | int | None = None,
    margin: float = DEFAULT_MARGIN,
    fallback: bool = True,
    factory_timeout: float | None = None,
    compare_loops: bool = True,
    memory_snapshot: str | Path | None = None,
) -> Estimate:
    """Estimate the peak memory of training ``model`` for two steps on its target.

    The step is traced under fake tensors on the CPU: nothing is allocated, no GPU is needed.

    Args:
        {args}

    Returns:
        An Estimate: peak allocated (on CUDA also reserved and nvidia-smi's total), its
        breakdown, the phase of the peak, whether it fits, and the peak under other loops.

    Raises:
        torchdoctor.errors.ParameterError: an argument out of range or two that exclude each
            other (the message names the parameter).
        torchdoctor.errors.UserError: a spec that cannot be loaded, a model that fails on its
            batch, or PyTorch not importable (exit code 3).
    """
    check, setup = prepare(model, **_forwarded(locals()))
    result = check.estimate(setup, memory_snapshot)
    if compare_loops and not setup.inference:
        result.other_loops = other_loops(check, setup, result)
    return result


@_documented
def max_batch(
    model: ModelSpec,
    *,
    input_shape: str | tuple[int, ...] | None = None,
    tokens: int | None = None,
    optimizer: str = "adamw",
    optimizer_impl: str = "auto",
    precision: str = "fp32",
    grad_accumulation: int = 1,
    inference: bool = False,
    checkpointing: bool = False,
    loop: str | None = None,
    device: str | None = None,
    gpu: str | GpuProfile | None = None,
    gpu_memory: str | int | None = None,
    margin: float = DEFAULT_MARGIN,
    fallback: bool = True,
    factory_timeout: float | None = None,
    on_probe: Callable[[int, int, bool], None] | None = None,
) -> MaxBatch:
    """The largest batch whose step fits the target with ``margin`` of its memory kept free.

    The batch size is what is searched, over simulated steps of the same loop.

    Args:
        {args}

    Returns:
        A MaxBatch: the batch (0 when not even batch 1 fits, with what would make it fit), its
        estimate and the probes of the search.

    Raises:
        torchdoctor.errors.ParameterError: an argument out of range or two that exclude each
            other (the message names the parameter), or neither gpu nor gpu_memory given.
        torchdoctor.errors.UserError: a spec that cannot be loaded, a model that fails on its
            batch, or PyTorch not importable (exit code 3).
    """
    check, setup = prepare(model, **_forwarded(locals()))
    if check.capacity is None:
        raise ParameterError(
            "{} needs a memory to fit: pass {} or {}", "max_batch()", "gpu", "gpu_memory"
        )
    return find_max_batch(check, setup, on_probe)


@_documented
def prepare(
    model: ModelSpec,
    *,
    batch_size: int = 1,
    input_shape: str | tuple[int, ...] | None = None,
    tokens: int | None = None,
    optimizer: str = "adamw",
    optimizer_impl: str = "auto",
    precision: str = "fp32",
    grad_accumulation: int = 1,
    inference: bool = False,
    checkpointing: bool = False,
    loop: str | None = None,
    device: str | None = None,
    gpu: str | GpuProfile | None = None,
    gpu_memory: str | int | None = None,
    margin: float = DEFAULT_MARGIN,
    fallback: bool = True,
    factory_timeout: float | None = None,
) -> tuple[FitCheck, TrainingSetup]:
    """Check the arguments and load the model spec, for set-up after set-up to be estimated
    (``check.estimate(setup.with_(batch_size=64))``).

    Args:
        {args}

    Returns:
        The FitCheck that estimates a set-up of the loaded model on its target, and the
        TrainingSetup the arguments describe.

    Raises:
        torchdoctor.errors.ParameterError: as :func:`estimate`.
        torchdoctor.errors.UserError: as :func:`estimate`.
    """
    device = device or ("cuda" if gpu is not None or gpu_memory is not None else "cpu")
    require_torch("torchdoctor estimate")
    from torchdoctor.estimate.spec import load_workload, parse_shape
    from torchdoctor.estimate.trace import fake_copy_factory

    asked_loop = loop
    if loop is None:  # provisional: the spec's module may show its loop (see below)
        loop = HF_TRAINER if isinstance(model, str) and model.startswith("hf:") else HAND_WRITTEN
    setup = TrainingSetup(
        batch_size=batch_size,
        optimizer=optimizer,
        optimizer_impl=optimizer_impl,
        precision=precision,
        grad_accumulation=grad_accumulation,
        inference=inference,
        checkpointing=checkpointing,
        loop=loop,
    )
    profile = None
    if gpu is not None:
        profile = gpu if isinstance(gpu, GpuProfile) else find_profile(gpu)
        if gpu_memory is not None:
            raise ParameterError("give either {} or {}, not both", "gpu", "gpu_memory")
    elif gpu_memory is not None and device == "cuda":
        profile = custom_profile(_size(gpu_memory))
    target = Target(device, profile if device == "cuda" else None)
    if device == "cpu" and gpu is not None:
        raise ParameterError("{} describes a CUDA target: add {}", ("gpu", gpu), ("device", "cuda"))
    if input_shape is not None and tokens is not None:
        raise ParameterError("give either {} or {}, not both", "input_shape", "tokens")
    if tokens is not None and tokens < 1:
        raise ParameterError(f"{{}} must be at least 1, not {tokens}", "tokens")
    shape = parse_shape(input_shape) if isinstance(input_shape, str) else input_shape
    import torch

    spec: Any = model
    if isinstance(model, torch.nn.Module):
        spec = fake_copy_factory(model)
        spec.__qualname__ = type(model).__name__
    elif not isinstance(model, str) and not callable(model):
        raise UserError(
            f"cannot estimate a {type(model).__name__}: pass a spec string, factory or model"
        )
    if target.gpu is not None:
        capacity = target.gpu.memory_bytes
    else:
        capacity = _size(gpu_memory) if gpu_memory is not None else None
    if factory_timeout is not None and not 0 < factory_timeout <= _LONGEST_TIMEOUT_S:
        # NaN and inf too (SIGALRM's timer takes neither)
        raise ParameterError(
            f"{{}} must be above 0 and at most a year of seconds, not {factory_timeout}",
            "factory_timeout",
        )
    workload = load_workload(spec, shape, tokens, factory_timeout)
    if asked_loop is None and isinstance(model, str):
        workload.default_loop = _default_loop(model, workload, setup.loop)
        setup = setup.with_(loop=workload.default_loop[0])
    return FitCheck(workload, target, capacity, margin, fallback), setup


def _default_loop(spec: str, workload: Workload, provisional: str) -> tuple[str, str]:
    """The loop a spec's estimate assumes when none is asked for, and the reason said beside
    it: the HF Trainer for hf: models; for file.py:factory, the Trainer or Lightning the file
    uses (a Trainer user's peak under the hand-written loop was 30 % high, issue 48); else the
    hand-written loop, saying so, since nothing in the file told which loop trains it."""
    choose = "--loop chooses another"
    if spec.startswith("hf:"):
        return provisional, f"assumed for hf: models ({choose})"
    if workload.trains_with is not None:
        found, why = workload.trains_with
        return found, f"{why} ({choose})"
    if spec.startswith("torchvision:"):
        return provisional, f"assumed ({choose})"
    file = spec.partition(":")[0]
    return provisional, (
        f"assumed: {file} uses neither transformers' Trainer nor Lightning "
        "(--loop hf-trainer or lightning if it is trained by one)"
    )


_LONGEST_TIMEOUT_S = 365 * 86400

_PREPARE_KEYWORDS = list(inspect.signature(prepare).parameters)[1:]


def _size(value: str | int) -> int:
    if isinstance(value, int):
        size = value
    else:
        try:
            size = parse_size(value)
        except UserError:
            # named as the caller knows it: gpu_memory here, --gpu-memory on the command line
            raise ParameterError(
                "cannot read {} " + literal(f"{value!r}: {SIZE_HINT}"), "gpu_memory"
            ) from None
    if size <= 0:
        # a GPU of 0 B fits nothing: every answer about it would be a non-answer
        raise ParameterError(
            "{} must be above 0 " + literal(f"(got {value!r}): give the GPU's memory, e.g. 24GiB"),
            "gpu_memory",
        )
    return size
