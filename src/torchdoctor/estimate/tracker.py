"""Follows live storage bytes op by op, under fake tensors or real ones alike.

A ``TorchDispatchMode`` sees every aten op below autograd, so it sees every tensor the step
creates (activations, gradients, optimizer state, temporaries) as an op output. A storage is
counted once, when it first appears, and uncounted when it dies: PyTorch keeps one Python object
per storage for as long as the storage lives, so a weak reference to it fires exactly when the
memory is released. This is the same accounting for fake tensors (whose meta storages have the
real sizes) and for real ones, which is what makes the CPU estimate exact.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ATTR = "_torchdoctor_token"
_tracker_ids = itertools.count(1)

# Ops that create cuBLAS work on CUDA: the first one allocates the cuBLAS workspace.
_MATMUL_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "_scaled_mm"}
)
_CONV_OPS = frozenset({"convolution", "convolution_backward", "_convolution", "cudnn_convolution"})
_RNN_OPS = frozenset({"mkldnn_rnn_layer", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell"})


@dataclass
class PhaseMark:
    """From event ``event`` on, the step is in ``phase`` of step number ``step`` (0-based)."""

    event: int
    phase: str
    step: int


@dataclass
class StorageInfo:
    """What a tracked storage is: bytes, the op that made it and where."""

    nbytes: int
    op: str
    module: int
    kind: str = ""  # set for storages that existed before the step: parameters, buffers, inputs


@dataclass
class Transient:
    """Memory a CUDA kernel would allocate and release inside one op, after event ``event``."""

    event: int
    nbytes: int
    what: str


class LiveStorageTracker(TorchDispatchMode):
    """Record storage allocations and frees as a timeline of events."""

    def __init__(self) -> None:
        super().__init__()
        self._id = next(_tracker_ids)
        self.storages: list[StorageInfo] = []
        # token >= 0: storage ``token`` allocated; ``~token`` (< 0): storage freed.
        self.events: list[int] = []
        self.phases: list[PhaseMark] = []
        self.transients: list[Transient] = []
        self.first_matmul_event: int | None = None
        self.uses_convolution = False
        self.uses_rnn = False
        self.live = 0
        self.peak = 0
        self.module = 0
        self.last_op = ""
        self.failed_op: str | None = None
        self.failed_module = 0
        self._refs: dict[weakref.ref, int] = {}
        # Callbacks by op name: fn(func, args, kwargs, outputs) -> [(nbytes, what)] transient memory.
        self.transient_rules: dict[str, Any] = {}
        # Callbacks by op name: fn(func, args, kwargs) -> real output sizes, for ops whose meta
        # kernels cannot know them (oneDNN workspaces).
        self.size_probes: dict[str, Any] = {}
        self.unprobed_ops: set[str] = set()

    # -- registration ----------------------------------------------------------------------------
    def token_of(self, tensor: torch.Tensor) -> int | None:
        """The token of ``tensor``'s storage, or None when it is not tracked."""
        mark = getattr(tensor.untyped_storage(), _ATTR, None)
        if mark is not None and mark[0] == self._id:
            return mark[1]
        return None

    def register_existing(self, tensor: torch.Tensor, kind: str) -> None:
        """Count a storage that exists before the step (parameters, buffers, the batch)."""
        if self.token_of(tensor) is None:
            self._track(tensor.untyped_storage(), "", kind)

    def note_new(self, tensor: torch.Tensor, op: str) -> None:
        """Count a tensor the step made without an op (e.g. ``torch.get_rng_state()``)."""
        self._note(tensor, op, False)

    def set_phase(self, phase: str, step: int) -> None:
        self.phases.append(PhaseMark(len(self.events), phase, step))

    def _track(self, storage: Any, op: str, kind: str = "") -> None:
        token = len(self.storages)
        nbytes = storage.nbytes()
        setattr(storage, _ATTR, (self._id, token))
        self.storages.append(StorageInfo(nbytes, op, self.module, kind))
        self.events.append(token)
        self._refs[weakref.ref(storage, self._on_free)] = token
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live

    def _on_free(self, ref: weakref.ref) -> None:
        token = self._refs.pop(ref, None)
        if token is None:
            return
        self.live -= self.storages[token].nbytes
        self.events.append(~token)

    def _resized(self, storage: Any, token: int) -> None:
        # An op grew or shrank a tracked storage in place (resize_, out= with a wrong size).
        self.live -= self.storages[token].nbytes
        self.events.append(~token)
        for ref, tok in list(self._refs.items()):
            if tok == token:
                del self._refs[ref]
        self._track(storage, self.last_op)

    # -- dispatch --------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = func._opname
        self.last_op = name
        try:
            out = func(*args, **kwargs)
        except Exception:
            if self.failed_op is None:
                self.failed_op, self.failed_module = str(func), self.module
            raise
        if isinstance(out, torch.Tensor):
            self._note(out, name, "out" in kwargs or name.endswith("_"))
        elif isinstance(out, (tuple, list)):
            for item in out:
                if isinstance(item, torch.Tensor):
                    self._note(item, name, "out" in kwargs)
                elif isinstance(item, (tuple, list)):
                    for sub in item:
                        if isinstance(sub, torch.Tensor):
                            self._note(sub, name, "out" in kwargs or name.endswith("_"))
        if name in _MATMUL_OPS and self.first_matmul_event is None:
            self.first_matmul_event = len(self.events)
        elif name in _CONV_OPS:
            self.uses_convolution = True
        elif name in _RNN_OPS:
            self.uses_rnn = True
        probe = self.size_probes.get(name)
        if probe is not None:
            try:
                self._correct_sizes(out, probe(func, args, kwargs))
            except Exception:
                # The CPU cannot run this kernel for real (an fp16 oneDNN RNN, say): keep the
                # meta kernel's sizes and say so.
                self.unprobed_ops.add(name)
        rule = self.transient_rules.get(name)
        if rule is not None:
            try:
                found = rule(func, args, kwargs, out)
            except Exception:
                self.unprobed_ops.add(name)
                found = []
            for nbytes, what in found:
                self.transients.append(Transient(len(self.events), nbytes, what))
        return out

    def _correct_sizes(self, out: Any, sizes: list[int | None]) -> None:
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for tensor, nbytes in zip(outputs, sizes, strict=False):
            if nbytes is None or not isinstance(tensor, torch.Tensor):
                continue
            token = self.token_of(tensor)
            if token is not None and self.storages[token].nbytes != nbytes:
                self.live += nbytes - self.storages[token].nbytes
                self.peak = max(self.peak, self.live)
                self.storages[token].nbytes = nbytes

    def _note(self, tensor: torch.Tensor, op: str, may_resize: bool) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # sparse or otherwise storage-less tensors
        mark = getattr(storage, _ATTR, None)
        if mark is None or mark[0] != self._id:
            self._track(storage, op)
        elif may_resize and storage.nbytes() != self.storages[mark[1]].nbytes:
            self._resized(storage, mark[1])


@dataclass
class ModuleStack:
    """Names the module whose forward is running, via global module hooks."""

    tracker: LiveStorageTracker
    names: list[str] = field(default_factory=lambda: ["(outside modules)"])
    classes: list[str] = field(default_factory=lambda: [""])

    def __post_init__(self) -> None:
        self._index: dict[int, int] = {}
        self._stack: list[int] = []
        self._handles: list[Any] = []

    def add_model(self, model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            self._index[id(module)] = len(self.names)
            self.names.append(name or "(model)")
            self.classes.append(type(module).__name__)

    def __enter__(self) -> ModuleStack:
        from torch.nn.modules import module as module_mod

        self._handles = [
            module_mod.register_module_forward_pre_hook(self._pre),
            module_mod.register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self.tracker.module = 0

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self._stack.append(self.tracker.module)
        self.tracker.module = self._index.get(id(module), self.tracker.module)

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.tracker.module = self._stack.pop() if self._stack else 0
