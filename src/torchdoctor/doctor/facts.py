"""Readings shared by several checks, each taken once per doctor run and only when asked for."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from dataclasses import dataclass, field

from torchdoctor.doctor.check import Plan
from torchdoctor.sampling import network
from torchdoctor.sampling.gpu_topology import GpuTopology, read_topology
from torchdoctor.sampling.types import GpuProcessSample, GpuStatus


@dataclass(slots=True)
class TorchFacts:
    """The installed torch and the libraries it was built with (CUDA is never initialised)."""

    version: str | None
    reason: str | None = None  # why torch is not importable
    cuda: str | None = None  # CUDA runtime torch was built for; None: a CPU build
    cudnn: int | None = None  # e.g. 90100 for 9.1.0
    nccl: str | None = None
    gloo: bool = False
    nccl_built: bool = False
    num_threads_default: int | None = None
    notes: list[str] = field(default_factory=list)


def _torch_facts() -> TorchFacts:
    try:
        torch = importlib.import_module("torch")
    except ModuleNotFoundError as exc:
        if exc.name != "torch":  # torch is there but something it imports is not
            return TorchFacts(None, reason=f"torch is not importable: {exc}")
        # Said with the interpreter: under --python it is the training env's, not ours
        return TorchFacts(None, reason=f"torch is not installed in {sys.executable}")
    except Exception as exc:  # ImportError, or a broken install raising anything
        return TorchFacts(None, reason=f"torch is not importable: {type(exc).__name__}: {exc}")
    facts = TorchFacts(str(torch.__version__).split("+")[0])
    facts.cuda = getattr(torch.version, "cuda", None)
    try:
        facts.cudnn = torch.backends.cudnn.version() if facts.cuda else None
    except Exception as exc:  # libcudnn missing or unloadable
        facts.notes.append(f"cuDNN version unreadable: {exc}")
    try:
        import torch.distributed as dist

        facts.gloo = dist.is_available() and dist.is_gloo_available()
        facts.nccl_built = dist.is_available() and dist.is_nccl_available()
    except Exception as exc:
        facts.notes.append(f"torch.distributed unusable: {exc}")
    if facts.nccl_built:
        try:
            version = torch.cuda.nccl.version()
            facts.nccl = (
                ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
            )
        except Exception as exc:
            facts.notes.append(f"NCCL version unreadable: {exc}")
    facts.num_threads_default = torch.get_num_threads()
    return facts


class Facts:
    """Lazily read, cached machine facts for one doctor run."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    @functools.cached_property
    def torch(self) -> TorchFacts:
        return _torch_facts()

    @functools.cached_property
    def _gpus(self) -> tuple[GpuStatus, list[GpuProcessSample]]:
        from torchdoctor.sampling.gpus import GpuReader

        reader = GpuReader(self.plan.nvml_module, pid_namespace=self.plan.pid_namespace)
        try:
            processes: list[GpuProcessSample] = []
            if reader.status.available:
                _samples, processes = reader.read({os.getpid()})
            return reader.status, processes
        finally:
            reader.close()

    @property
    def gpu_status(self) -> GpuStatus:
        if self.plan.gpu_status is not None:
            return self.plan.gpu_status
        return self._gpus[0]

    @property
    def gpu_processes(self) -> list[GpuProcessSample]:
        return self._gpus[1]

    @functools.cached_property
    def topology(self) -> GpuTopology:
        return read_topology(self.plan.nvml_module, cpu_count=os.cpu_count() or 1024)

    @functools.cached_property
    def interfaces(self) -> dict[str, network.Interface]:
        return network.interfaces()

    @functools.cached_property
    def master_ip(self) -> str | None:
        addr = self.plan.master_addr
        return network.resolve_ipv4(addr) if addr else None

    @functools.cached_property
    def route(self) -> network.Route | None:
        """The route to MASTER_ADDR, or (without one) the default route's interface."""
        target = self.master_ip if self.plan.master_addr else "0.0.0.0"
        if target is None:
            return None
        if target == "0.0.0.0":
            # No master named: the interface a peer would most likely be reached through.
            return network.route_to("198.51.100.1", self.interfaces)
        return network.route_to(target, self.interfaces)

    def interface(self, name: str) -> network.Interface | None:
        return self.interfaces.get(name)
