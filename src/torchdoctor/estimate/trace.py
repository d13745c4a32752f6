"""Trace a training step on the CPU, under fake tensors (no memory) or for real."""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from torchdoctor.errors import ParameterError, UserError, literal
from torchdoctor.estimate.real_sizes import (
    LOW_PRECISION_SCRATCH_OPS,
    PROBED_OPS,
    SCRATCH_OPS,
    STAT_SIZE_RULES,
    real_output_sizes,
    scratch_rule,
)
from torchdoctor.estimate.setup import Target, TrainingSetup
from torchdoctor.estimate.step import (
    apply_checkpointing,
    apply_loop_settings,
    low_precision_dtype,
    make_batches,
    make_optimizer,
    run_training,
)
from torchdoctor.estimate.tracker import LiveStorageTracker, ModuleStack, Transient
from torchdoctor.estimate.workload import Workload, is_hf_model, is_lightning_module

PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer state"
INPUTS = "inputs"
ACTIVATIONS = "activations"
TEMPORARIES = "temporaries"


class DataDependentOp(Exception):
    """Fake tensors cannot run an op whose result depends on tensor values."""

    def __init__(self, op: str, where: str, parameter_bytes: int = 0) -> None:
        super().__init__(op)
        self.op = op
        self.where = where
        self.parameter_bytes = parameter_bytes

    def describe(self) -> str:
        op = self.op
        if "_local_scalar_dense" in op:
            op = f".item() ({op})"
        return f"the model calls {op}{self.where}, whose result depends on tensor values"


@dataclass
class Trace:
    """Every storage of two traced steps, in order, with what each one is."""

    sizes: list[int]
    categories: list[str]
    events: list[int]
    phase_marks: list[tuple[int, str, int]]
    transients: list[Transient]
    alloc_module: list[int]
    alloc_ops: list[str]
    module_names: list[str]
    module_classes: list[str]
    host_tokens: set[int]
    first_matmul_event: int | None
    uses_convolution: bool
    uses_rnn: bool
    parameter_count: int
    parameter_bytes: int
    real: bool
    seconds: float
    notes: list[str] = field(default_factory=list)
    attention_backends: dict[str, int] = field(default_factory=dict)
    model_kind: str = ""  # "hf" (a transformers model), "lightning" (a LightningModule), ""


def trace_step(
    workload: Workload, setup: TrainingSetup, target: Target, real: bool = False
) -> Trace:
    """Run the step of ``setup`` under fake tensors (or real ones) and record its storages."""
    with _quiet_torch():
        return _trace_step(workload, setup, target, real)


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """Fake tensors log a traceback for every failing meta kernel and warn about data
    pointers; the user gets one line from us instead."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = logger.disabled
    logger.disabled = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
            # A LightningModule's self.log() outside a Trainer warns and does nothing.
            warnings.filterwarnings("ignore", message=".*self.log.*")
            yield
    finally:
        logger.disabled = disabled


def _trace_step(workload: Workload, setup: TrainingSetup, target: Target, real: bool) -> Trace:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
        UnsupportedOperatorException,
    )

    started = time.perf_counter()
    fake_mode = None if real else FakeTensorMode()
    notes: list[str] = []
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        with _SameModeDeepcopy() if fake_mode is not None else contextlib.nullcontext():
            model = workload.build_model()
        if setup.precision == "bf16":
            _cast_floating_state(model, torch.bfloat16)
        if setup.checkpointing:
            notes.append("activation checkpointing on " + apply_checkpointing(model))
        model.train(not setup.inference)
        apply_loop_settings(model, setup)
        batches = make_batches(workload, model, setup)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params and not setup.inference:
            raise ParameterError(
                literal(f"{workload.name} has no trainable parameters: ") + "use {}",
                ("inference", True),
            )
        optimizer = None if setup.inference else make_optimizer(params, setup, target)

        tracker = LiveStorageTracker()
        if fake_mode is not None:
            for op in PROBED_OPS:
                tracker.size_probes[op] = real_output_sizes
            tracker.size_probes.update(STAT_SIZE_RULES)
            if not target.is_cuda:
                for op in (*SCRATCH_OPS, *LOW_PRECISION_SCRATCH_OPS):
                    tracker.transient_rules[op] = scratch_rule(op)
        for tensor in model.parameters():
            tracker.register_existing(tensor, PARAMETERS)
        for tensor in model.buffers():
            tracker.register_existing(tensor, PARAMETERS)
        for tensor in _tensors(batches):
            tracker.register_existing(tensor, INPUTS)
        stack = ModuleStack(tracker)
        stack.add_model(model)
        gradients: set[int] = set()
        states: set[int] = set()
        host: set[int] = set()
        steps_on_host = target.is_cuda and setup.optimizer_impl_used() != "fused"

        def on_grads() -> None:
            for p in params:
                if p.grad is not None and (token := tracker.token_of(p.grad)) is not None:
                    gradients.add(token)

        def on_state() -> None:
            assert optimizer is not None
            for state in optimizer.state.values():
                for key, value in state.items():
                    if (
                        isinstance(value, torch.Tensor)
                        and (token := tracker.token_of(value)) is not None
                    ):
                        states.add(token)
                        if key == "step" and steps_on_host:
                            host.add(token)  # foreach/for-loop keep `step` on the CPU

        emulation: Any = contextlib.nullcontext()
        if target.is_cuda:
            from torchdoctor.estimate.cuda_emulation import emulate_cuda

            assert target.gpu is not None
            emulation = emulate_cuda(target.gpu, low_precision_dtype(setup), tracker)
        try:
            unpacked = (
                _hf_positions_unpacked()
                if fake_mode is not None and not _has_position_ids(batches)
                else contextlib.nullcontext()
            )
            with (
                stack,
                emulation as emulated,
                _rng_states_tracked(tracker, host),
                unpacked,
                tracker,
            ):
                run_training(
                    model, batches, workload.loss_fn, optimizer, setup, tracker, on_grads, on_state
                )
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise DataDependentOp(
                _op_name(exc), _where(stack, tracker, False), _bytes(model)
            ) from exc
        except UnsupportedOperatorException as exc:
            raise DataDependentOp(
                _op_name(exc), _where(stack, tracker, False), _bytes(model)
            ) from exc
        except UserError:
            raise
        except RuntimeError as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "data-dependent" in message or "DataDependent" in type(exc).__name__:
                raise DataDependentOp(
                    tracker.failed_op or tracker.last_op,
                    _where(stack, tracker, False),
                    _bytes(model),
                ) from exc
            failed = f"{workload.name} failed on a batch of {setup.batch_size} from "
            detail = f"{_where(stack, tracker)}: {message}"
            if workload.batch_option is None:
                raise UserError(f"{failed}the factory's batch maker{detail}") from exc
            # The batch came from tokens= or input_shape=: name it as the caller does.
            template = literal(failed) + "{}" + literal(detail)
            raise ParameterError(template, workload.batch_option) from exc
        backends = dict(getattr(emulated, "backends", {}) or {})
        events = list(tracker.events)
        parameter_count = sum(p.numel() for p in model.parameters())
        model_kind = (
            "lightning" if is_lightning_module(model) else "hf" if is_hf_model(model) else ""
        )
        parameter_bytes = _bytes(model)

    storages = tracker.storages
    if tracker.unprobed_ops:
        notes.append(
            "the CPU could not run " + ", ".join(sorted(tracker.unprobed_ops)) + " for real to "
            "measure its workspace or scratch: their meta kernels' sizes are used"
        )
    categories = _categorize(tracker, events, gradients, states)
    return Trace(
        sizes=[s.nbytes for s in storages],
        categories=categories,
        events=events,
        phase_marks=[(m.event, m.phase, m.step) for m in tracker.phases],
        transients=list(tracker.transients),
        alloc_module=[s.module for s in storages],
        alloc_ops=[s.op for s in storages],
        module_names=stack.names,
        module_classes=stack.classes,
        host_tokens=host,
        first_matmul_event=tracker.first_matmul_event,
        uses_convolution=tracker.uses_convolution,
        uses_rnn=tracker.uses_rnn,
        parameter_count=parameter_count,
        parameter_bytes=parameter_bytes,
        real=real,
        seconds=time.perf_counter() - started,
        notes=notes,
        attention_backends=backends,
        model_kind=model_kind,
    )


def _categorize(
    tracker: LiveStorageTracker, events: list[int], gradients: set[int], states: set[int]
) -> list[str]:
    """Parameters, inputs, gradients, optimizer state; else activations when the storage was
    made in a forward pass and outlived it (saved for backward), else temporaries."""
    storages = tracker.storages
    freed_at = [len(events)] * len(storages)
    allocated_at = [0] * len(storages)
    for index, event in enumerate(events):
        if event >= 0:
            allocated_at[event] = index
        else:
            freed_at[~event] = index
    forward_ranges: list[tuple[int, int]] = []
    marks = tracker.phases
    for i, mark in enumerate(marks):
        if mark.phase == "forward":
            end = marks[i + 1].event if i + 1 < len(marks) else len(events)
            forward_ranges.append((mark.event, end))
    categories: list[str] = []
    for token, info in enumerate(storages):
        if info.kind:
            categories.append(info.kind)
        elif token in gradients:
            categories.append(GRADIENTS)
        elif token in states:
            categories.append(OPTIMIZER_STATE)
        else:
            at = allocated_at[token]
            category = TEMPORARIES
            for start, end in forward_ranges:
                if start <= at < end:
                    if freed_at[token] >= end:
                        category = ACTIVATIONS
                    break
            categories.append(category)
    return categories


@contextlib.contextmanager
def _rng_states_tracked(tracker: LiveStorageTracker, host: set[int]) -> Iterator[None]:
    """Activation checkpointing saves the CPU generator's state (5,056 B per checkpointed call)
    with ``torch.get_rng_state()``, which makes its tensor without any op a dispatch mode sees:
    count it. It lives in host memory, so a CUDA estimate leaves it out."""
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        tracker.note_new(state, "get_rng_state")
        token = tracker.token_of(state)
        if token is not None:
            host.add(token)
        return state

    torch.get_rng_state = get_rng_state  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.get_rng_state = original  # type: ignore[assignment]


@contextlib.contextmanager
def _hf_positions_unpacked() -> Iterator[None]:
    """transformers reads the position ids to find packed sequences (and then skips the causal
    mask for SDPA): under fake tensors it cannot read them and builds a full mask per layer,
    which a real run does not. Without ``position_ids`` in the batch the model makes them
    itself, ``arange(T)`` in every row, which holds one sequence: the real answer, None."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking.find_packed_sequence_indices = lambda position_ids: None  # type: ignore[union-attr]
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original  # type: ignore[union-attr]


def _has_position_ids(batches: list[Any]) -> bool:
    return any(isinstance(inputs, dict) and "position_ids" in inputs for inputs, _ in batches)


def _cast_floating_state(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` that works on fake parameters too (and keeps tied weights tied)."""
    converted: dict[int, Any] = {}
    with torch.no_grad():
        for module in model.modules():
            for store, is_param in ((module._parameters, True), (module._buffers, False)):
                for name, value in store.items():
                    if value is None or not value.is_floating_point():
                        continue
                    if id(value) not in converted:
                        cast = value.detach().to(dtype)
                        if is_param:
                            cast = torch.nn.Parameter(cast, requires_grad=value.requires_grad)
                        converted[id(value)] = cast
                    store[name] = converted[id(value)]


class _SameModeDeepcopy(TorchFunctionMode):
    """Deep copies of fake tensors stay in the current fake mode (nn.TransformerEncoder clones
    its layer with copy.deepcopy, which would otherwise give each copy a fake mode of its own)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is torch.Tensor.__deepcopy__:
            tensor, memo = args
            if id(tensor) in memo:
                return memo[id(tensor)]
            with torch.no_grad():
                copied = tensor.clone(memory_format=torch.preserve_format)
            if getattr(tensor, "_is_param", False) or isinstance(tensor, torch.nn.Parameter):
                copied = torch.nn.Parameter(copied, requires_grad=tensor.requires_grad)
            else:
                copied.requires_grad_(tensor.requires_grad)
            memo[id(tensor)] = copied
            return copied
        return func(*args, **(kwargs or {}))


def _bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def _op_name(exc: Exception) -> str:
    func = getattr(exc, "func", None)
    if func is not None:
        return str(func)
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _where(stack: ModuleStack, tracker: LiveStorageTracker, with_op: bool = True) -> str:
    module = tracker.failed_module if tracker.failed_op is not None else tracker.module
    where = f" in module '{stack.names[module]}' ({stack.classes[module]})" if module > 0 else ""
    if with_op and tracker.failed_op is not None:
        where += f" at op {tracker.failed_op}"
    return where


def fake_copy_factory(model: torch.nn.Module) -> Any:
    """A factory that copies an existing model: as fake tensors under a fake mode, else real."""

    def build() -> torch.nn.Module:
        fake_mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        if fake_mode is None:
            return copy.deepcopy(model)
        # Pre-seed deepcopy's memo with fake twins of every parameter and buffer, so the copy
        # never touches real storage (tied weights stay tied: one twin per tensor).
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        memo: dict[int, Any] = {}
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) in memo:
                continue
            with unset_fake_temporarily():
                detached = tensor.detach()
            twin = fake_mode.from_tensor(detached)
            if isinstance(tensor, torch.nn.Parameter):
                twin = torch.nn.Parameter(twin, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = twin
        return copy.deepcopy(model, memo)

    return build
