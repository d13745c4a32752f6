"""The agent's rank part: what each rank of a torchrun job records.

Built by :func:`.hooks.install` in processes that torchrun started (``RANK`` set), once torch
is imported. It adds:

- per step: forward time (``DistributedDataParallel.forward``), backward time
  (``torch.autograd.backward``, which ``Tensor.backward`` calls), optimizer time (the
  optimizer's step pre-hook to the agent's post-hook), and DDP's own figures for the
  iterations DDP samples (1-10, then every 100th): backward communication, its overlap with
  backward compute, backward compute (``_get_ddp_logging_data()``, gloo included); the values
  go in the step in :data:`.contract.RANK_STEP_FIELDS` order, by name;
- events: ``rank-info`` (rank, node, host, rendezvous, affinity), ``rank-device`` (the device
  the model is on), ``ddp-config`` (buckets, static graph...), ``sampler-epoch`` and
  ``sampler-set-epoch`` (DistributedSampler), ``rank-epoch`` (batches per epoch of a rank's
  loader), ``rank-error`` and ``rank-terminated`` (with a flight-recorder dump written to
  ``TORCHDOCTOR_FR_DIR``).
- through :mod:`.pitfalls`: ``ddp-model``, ``ddp-sync-pattern`` and ``data-fingerprint`` (the
  first batches of each training epoch, hashed), for the distributed-mistake rules.

Every hook body runs under the agent's guard (:func:`.hooks.guard`): a failure switches the
agent off and says so once, never reaching the user's code. The SIGTERM handler is installed
only where the job left SIGTERM at its default, and ends the process with the same signal
after the dump.
"""

from __future__ import annotations

import os
import sys
from _weakref import ref as _weakref_ref

from .contract import ENV_FR_DIR, FR_PREFIX, RANK_STEP_FIELDS, env_int, perf_ns
from .hooks import guard
from .pitfalls import DdpChecks
from .sidetable import SideTable

_DDP_POLL_FIRST = 12  # DDP samples its runtime stats on iterations 1-10 ...
_DDP_POLL_EVERY = 100  # ... and every 100th after that
_DDP_CONFIG_KEYS = (
    "backend_name",
    "bucket_cap_bytes",
    "bucket_sizes",
    "rebuilt_bucket_sizes",
    "gradient_as_bucket_view",
    "find_unused_parameters",
    "static_graph",
    "can_set_static_graph",
    "broadcast_buffers",
    "num_parameter_tensors",
    "total_parameter_size_bytes",
    "unused_parameter_size",
    "world_size",
    "gloo_num_threads",
    "device_ids",
)


class RankInstrument:
    """Per-process state of the distributed hooks; one per rank process."""

    def __init__(self, agent, torch) -> None:
        self.agent = agent
        self.torch = torch
        self.forward_ns = 0
        self.backward_ns = 0
        self.optimizer_start: int | None = None
        self.seen_forward = False
        self.seen_backward = False
        self.ddp = None  # weakref to the first DistributedDataParallel that ran forward
        self.ddp_iteration = -1
        self.comm_step = -1  # the step whose DDP figures ``comm`` holds
        self.comm = None
        self.device_sent = False
        self.depth = 0  # nested forward calls (a DDP inside a DDP wrapper counts once)
        self.next_sampler_id = 0
        self.sampler_ids = SideTable()  # DistributedSampler -> its id in the events
        self.fr_dir = os.environ.get(ENV_FR_DIR) or None
        self.dumped = False
        # Counters and events of the distributed-mistake rules (see pitfalls.py).
        self.checks = DdpChecks(agent, torch)

    # -- installation -------------------------------------------------------------------------

    def install(self) -> None:
        torch = self.torch
        agent = self.agent
        import torch.optim.optimizer as optimizer_mod
        import torch.utils.data.dataloader as dataloader_mod

        ddp_mod = sys.modules.get("torch.nn.parallel.distributed")
        if ddp_mod is None:
            import torch.nn.parallel.distributed as ddp_mod
        ddp_cls = ddp_mod.DistributedDataParallel
        agent.patch(ddp_cls, "forward", _make_forward(self, ddp_cls.forward))
        agent.patch(torch.autograd, "backward", _make_backward(self, torch.autograd.backward))
        self.pre_handle = optimizer_mod.register_optimizer_step_pre_hook(_make_pre_step(self))
        sampler_mod = sys.modules.get("torch.utils.data.distributed")
        if sampler_mod is None:
            import torch.utils.data.distributed as sampler_mod
        sampler_cls = sampler_mod.DistributedSampler
        agent.patch(sampler_cls, "__iter__", _make_sampler_iter(self, sampler_cls.__iter__))
        agent.patch(sampler_cls, "set_epoch", _make_set_epoch(self, sampler_cls.set_epoch))
        dl_cls = dataloader_mod.DataLoader
        agent.patch(dl_cls, "__iter__", _make_loader_iter(self, dl_cls.__iter__))
        agent.patch(sys, "excepthook", _make_excepthook(self, sys.excepthook))
        self._install_sigterm()
        agent.event("rank-info", self._rank_info())

    def uninstall(self) -> None:
        handle, self.pre_handle = getattr(self, "pre_handle", None), None
        if handle is not None:
            handle.remove()

    def _install_sigterm(self) -> None:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the job handles SIGTERM itself: leave it alone
        signal.signal(signal.SIGTERM, _make_sigterm(self))

    def _rank_info(self) -> dict:
        try:
            affinity = sorted(os.sched_getaffinity(0))
        except OSError:
            affinity = None
        return {
            "rank": env_int("RANK"),
            "local_rank": env_int("LOCAL_RANK"),
            "world_size": env_int("WORLD_SIZE"),
            "local_world_size": env_int("LOCAL_WORLD_SIZE"),
            "node_rank": env_int("GROUP_RANK"),
            "hostname": os.uname().nodename,
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "master_addr": os.environ.get("MASTER_ADDR"),
            "master_port": env_int("MASTER_PORT"),
            "restart_count": env_int("TORCHELASTIC_RESTART_COUNT"),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": self.torch.get_num_threads(),
            "affinity": affinity,
            "fr_dir": self.fr_dir,
        }

    # -- per step -----------------------------------------------------------------------------

    def step_values(self, now: int) -> list | None:
        """The extra values of the step under way (perf_counter_ns ``now``), in
        RANK_STEP_FIELDS order; None when this rank showed nothing of its own (no DDP forward,
        no backward). Reading does not reset: the agent may read a candidate step before the
        real one ends (:meth:`step_closed` starts the next)."""
        if not (self.seen_forward or self.seen_backward or self.optimizer_start is not None):
            return None
        values = {
            "forward_ns": self.forward_ns if self.seen_forward else None,
            "backward_ns": self.backward_ns if self.seen_backward else None,
            "optimizer_ns": (
                now - self.optimizer_start if self.optimizer_start is not None else None
            ),
            "comm_ns": None,
            "comm_overlap_ns": None,
            "backward_compute_ns": None,
        }
        step = self.agent.step
        if self.comm_step != step:
            self.comm_step = step
            self.comm = None
            ddp = self.ddp() if self.ddp is not None else None
            if ddp is not None and (step < _DDP_POLL_FIRST or step % _DDP_POLL_EVERY < 2):
                self.comm = self._ddp_runtime(ddp)
        if self.comm is not None:
            values.update(self.comm)
        # By name: a field the contract names and this does not fill is an error (the guard
        # switches the agent off and says so), never a value in another field's column.
        return [values[name] for name in RANK_STEP_FIELDS]

    def step_closed(self) -> None:
        self.forward_ns = self.backward_ns = 0
        self.optimizer_start = None
        self.checks.step_closed()

    def _ddp_runtime(self, ddp):
        data = ddp._get_ddp_logging_data()
        iteration = data.get("iteration", -1)
        if iteration == self.ddp_iteration or "backward_comm_time" not in data:
            return None
        first = self.ddp_iteration < 0
        self.ddp_iteration = iteration
        if first or data.get("has_rebuilt_buckets") and not getattr(self, "_rebuilt", False):
            self._rebuilt = bool(data.get("has_rebuilt_buckets"))
            self.agent.event("ddp-config", {k: data[k] for k in _DDP_CONFIG_KEYS if k in data})
        return {
            "comm_ns": data.get("backward_comm_time"),
            "comm_overlap_ns": data.get("backward_compute_comm_overlap_time"),
            "backward_compute_ns": data.get("backward_compute_time"),
        }

    def on_forward(self, module) -> None:
        if self.ddp is None:
            self.ddp = _weakref_ref(module)
        if not self.device_sent:
            self.device_sent = True
            self.agent.event("rank-device", self._device_of(module))
        self.checks.on_forward(module)

    def _device_of(self, module) -> dict:
        detail = {"rank": self.agent.rank, "local_rank": env_int("LOCAL_RANK")}
        try:
            param = next(module.parameters())
            detail["device"] = str(param.device)
        except StopIteration:
            detail["device"] = None
        device_ids = getattr(module, "device_ids", None)
        detail["device_ids"] = [str(d) for d in device_ids] if device_ids else None
        torch = self.torch
        if detail["device"] and detail["device"].startswith("cuda"):
            index = torch.device(detail["device"]).index
            index = torch.cuda.current_device() if index is None else index
            detail["cuda_index"] = index
            props = torch.cuda.get_device_properties(index)
            detail["gpu_name"] = props.name
            detail["gpu_uuid"] = str(getattr(props, "uuid", "")) or None
            detail["pci_bus_id"] = getattr(props, "pci_bus_id", None)
        return detail

    # -- samplers and loaders ----------------------------------------------------------------

    def sampler_id(self, sampler) -> int:
        sid = self.sampler_ids.get(sampler)
        if sid is None:
            sid = self.next_sampler_id
            self.next_sampler_id += 1
            self.sampler_ids.set(sampler, sid)
        return sid

    def on_sampler_iter(self, sampler) -> None:
        try:
            dataset_len = len(sampler.dataset)
        except Exception:
            dataset_len = None
        self.agent.event(
            "sampler-epoch",
            {
                "sampler_id": self.sampler_id(sampler),
                "epoch": sampler.epoch,
                "shuffle": bool(sampler.shuffle),
                "seed": sampler.seed,
                "num_samples": sampler.num_samples,
                "total_size": sampler.total_size,
                "num_replicas": sampler.num_replicas,
                "sampler_rank": sampler.rank,
                "dataset_len": dataset_len,
                "drop_last": bool(sampler.drop_last),
                "step": self.agent.step,
            },
        )

    def on_set_epoch(self, sampler, epoch) -> None:
        self.agent.event(
            "sampler-set-epoch",
            {"sampler_id": self.sampler_id(sampler), "epoch": epoch, "step": self.agent.step},
        )

    def on_loader_iter(self, loader, it) -> None:
        import warnings

        info = self.agent.loader_state.info_of.get(loader)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # len() of an IterableDataset loader may warn
            try:
                batches = len(loader)
            except Exception:
                batches = None
            try:
                samples = len(loader.sampler)
            except Exception:
                samples = None
        self.agent.event(
            "rank-epoch",
            {
                "loader_id": info.loader_id if info is not None else None,
                "epoch": info.epochs - 1 if info is not None else None,
                "batches": batches,
                "samples": samples,
                "training": bool(self.torch.is_grad_enabled()),
                "step": self.agent.step,
            },
        )
        if info is not None:
            self.checks.tap_loader(
                it, info.loader_id, info.epochs - 1, bool(self.torch.is_grad_enabled())
            )

    # -- post-mortem --------------------------------------------------------------------------

    def dump_flight_recorder(self, reason: str) -> str | None:
        """Write this rank's flight-recorder buffer next to the recording (once)."""
        if self.dumped or not self.fr_dir:
            return None
        dist = getattr(self.torch, "distributed", None)
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        self.dumped = True
        c10d = self.torch._C._distributed_c10d
        rank = self.agent.rank if self.agent.rank is not None else dist.get_rank()
        base = os.path.join(self.fr_dir, f"{FR_PREFIX}{rank}")
        os.makedirs(self.fr_dir, exist_ok=True)
        with open(base + ".json", "wb") as fh:
            fh.write(c10d._dump_fr_trace_json())
        with open(base, "wb") as fh:  # the pickle torchfrtrace reads
            fh.write(c10d._dump_fr_trace())
        return base + ".json"

    def on_uncaught(self, exc_type, exc) -> None:
        text = f"{exc_type.__name__}: {exc}"[:800]
        dumped = self.dump_flight_recorder("error")
        lowered = text.lower()
        kind = "timeout" if "timed out" in lowered or "timeout" in lowered else "error"
        if "connection closed by peer" in lowered or "connection reset" in lowered:
            kind = "peer-gone"
        self.agent.event(
            "rank-error",
            {"rank": self.agent.rank, "step": self.agent.step, "kind": kind, "error": text,
             "fr_dump": dumped},
        )  # fmt: skip
        self.agent.flush(final=True)

    def on_sigterm(self, frame) -> None:
        dumped = self.dump_flight_recorder("sigterm")
        import traceback

        # Where the rank was when torchrun stopped it: for a rank that never joined a
        # collective, this is the code it was stuck in.
        stack = [
            f"{f.filename}:{f.lineno} in {f.name}" for f in traceback.extract_stack(frame)[-4:]
        ]
        self.agent.event(
            "rank-terminated",
            {"rank": self.agent.rank, "step": self.agent.step, "signal": "SIGTERM",
             "fr_dump": dumped, "stack": stack},
        )  # fmt: skip
        self.agent.flush(final=True)


# -- the hooks --------------------------------------------------------------------------------


def _make_forward(inst: RankInstrument, original):
    agent = inst.agent
    on_forward = guard(agent, "ddp-forward", inst.on_forward)

    def forward(self, *args, **kwargs):
        if not agent.active or inst.depth:
            return original(self, *args, **kwargs)
        on_forward(self)
        if not agent.active:  # it failed: switched off, the call goes on untimed
            return original(self, *args, **kwargs)
        inst.depth += 1
        t0 = perf_ns()
        try:
            return original(self, *args, **kwargs)
        finally:
            inst.depth -= 1
            inst.forward_ns += perf_ns() - t0
            inst.seen_forward = True

    forward.__wrapped__ = original
    return forward


def _make_backward(inst: RankInstrument, original):
    def backward(*args, **kwargs):
        if not inst.agent.active:
            return original(*args, **kwargs)
        t0 = perf_ns()
        try:
            return original(*args, **kwargs)
        finally:
            inst.backward_ns += perf_ns() - t0
            inst.seen_backward = True

    backward.__wrapped__ = original
    backward.__doc__ = original.__doc__
    return backward


def _make_pre_step(inst: RankInstrument):
    def torchdoctor_pre_step_hook(optimizer, args, kwargs):
        if inst.agent.active and inst.optimizer_start is None:
            inst.optimizer_start = perf_ns()

    return torchdoctor_pre_step_hook


def _make_sampler_iter(inst: RankInstrument, original):
    on_iter = guard(inst.agent, "distributed-sampler", inst.on_sampler_iter)

    def __iter__(self):
        if inst.agent.active:
            on_iter(self)
        return original(self)

    __iter__.__wrapped__ = original
    return __iter__


def _make_set_epoch(inst: RankInstrument, original):
    on_set_epoch = guard(inst.agent, "distributed-sampler", inst.on_set_epoch)

    def set_epoch(self, epoch):
        result = original(self, epoch)
        if inst.agent.active:
            on_set_epoch(self, epoch)
        return result

    set_epoch.__wrapped__ = original
    return set_epoch


def _make_loader_iter(inst: RankInstrument, original):
    on_loader_iter = guard(inst.agent, "rank-epoch", inst.on_loader_iter)

    def __iter__(self):
        it = original(self)  # the agent's own hook runs inside: loader info and epoch count
        if inst.agent.active:
            on_loader_iter(self, it)
        return it

    __iter__.__wrapped__ = original
    return __iter__


def _make_excepthook(inst: RankInstrument, previous):
    def excepthook(exc_type, exc, tb):
        if inst.agent.active:
            import contextlib

            with contextlib.suppress(Exception):
                inst.on_uncaught(exc_type, exc)
        return previous(exc_type, exc, tb)

    excepthook.__wrapped__ = previous
    return excepthook


def _make_sigterm(inst: RankInstrument):
    def torchdoctor_sigterm(signum, frame):
        import contextlib
        import signal

        with contextlib.suppress(Exception):
            if inst.agent.active:
                inst.on_sigterm(frame)
        # End the way the default disposition would have: killed by SIGTERM.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    return torchdoctor_sigterm


def install(agent, torch) -> RankInstrument | None:
    """Install the distributed hooks into a rank process; None when it is not a rank."""
    if env_int("RANK") is None:
        return None
    inst = RankInstrument(agent, torch)
    inst.install()
    return inst
