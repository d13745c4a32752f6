"""The job's settings as the agent records them: at the first step (threads, precision, AMP,
the optimizer and its parameters, distributed), the changeable ones again at flushes, the
process itself (role, rank), and tune's thread override. Loaded once torch is imported."""

from __future__ import annotations

import os
import sys

from .contract import LAUNCHER, MULTIPROCESSING_CHILD, RANK, TRAINER, WORKER, env_int, qualname
from .sidetable import SideTable

# Settings that can change while the job runs: re-read at every flush, sent when they change.
VOLATILE_SETTINGS = (
    "torch.num_threads",
    "torch.num_interop_threads",
    "matmul.float32_precision",
    "matmul.allow_tf32",
    "cudnn.allow_tf32",
    "cudnn.benchmark",
    "cudnn.deterministic",
)


def capture_settings(agent, optimizer) -> None:
    """The job's settings at its first step; ``optimizer`` is None when backward passes end
    the steps."""
    torch = agent.torch
    counter = agent.counter
    refresh_rank(agent)
    agent.setting("process.role", agent.role)
    agent.setting("torch.version", torch.__version__)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        agent.setting(f"env.{name}", os.environ.get(name))
    capture_volatile(agent)
    if optimizer is not None:
        counter.optimizers.add(agent, optimizer)
    agent.setting("amp.autocast", counter.autocast_dtype)
    agent.setting("amp.grad_scaler", counter.scaler_used)
    agent.setting("distributed.rank", agent.rank)
    agent.setting("distributed.local_rank", env_int("LOCAL_RANK"))
    agent.setting("distributed.world_size", env_int("WORLD_SIZE"))
    agent.setting("distributed.backend", dist_backend(torch))


class Optimizers:
    """Every optimizer the job steps, each recorded once: the first one's settings as
    ``optimizer.*``, every one of them in ``optimizers`` once there are several (a GAN's
    generator and discriminator, multi-task heads), and ``params.*`` over the parameters of
    all of them (each counted once)."""

    __slots__ = ("seen", "described", "params")

    def __init__(self) -> None:
        self.seen = SideTable()  # optimizer -> True, once recorded
        self.described: list[dict] = []
        self.params: dict[int, tuple[int, int, str, str]] = {}  # id -> numel, bytes, device, dtype

    def add(self, agent, optimizer) -> None:
        if optimizer in self.seen:
            return
        self.seen.set(optimizer, True)
        defaults = getattr(optimizer, "defaults", {}) or {}
        own: set[int] = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                own.add(id(p))
                if id(p) not in self.params:
                    numel = p.numel()
                    dtype = str(p.dtype).replace("torch.", "")
                    self.params[id(p)] = (numel, numel * p.element_size(), str(p.device), dtype)
        described = {
            "class": qualname(optimizer),
            "foreach": defaults.get("foreach"),
            "fused": defaults.get("fused"),
            "param_groups": len(optimizer.param_groups),
            "params": sum(self.params[i][0] for i in own),
        }
        self.described.append(described)
        if len(self.described) == 1:
            agent.setting("optimizer.class", described["class"])
            agent.setting("optimizer.foreach", described["foreach"])
            agent.setting("optimizer.fused", described["fused"])
            agent.setting("optimizer.param_groups", described["param_groups"])
        else:
            agent.setting("optimizers", self.described)
        values = self.params.values()
        agent.setting("params.count", sum(v[0] for v in values))
        agent.setting("params.bytes", sum(v[1] for v in values))
        agent.setting("params.devices", sorted({v[2] for v in values}))
        agent.setting("params.dtypes", sorted({v[3] for v in values}))


def capture_volatile(agent) -> None:
    import warnings

    torch = agent.torch
    backends = torch.backends
    # Reading some flags warns about their successors in newer torch: the user's stderr must
    # not change, so warnings are silenced for these reads only.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = {
            "torch.num_threads": torch.get_num_threads(),
            "torch.num_interop_threads": torch.get_num_interop_threads(),
            "matmul.float32_precision": torch.get_float32_matmul_precision(),
            "matmul.allow_tf32": bool(backends.cuda.matmul.allow_tf32),
            "cudnn.allow_tf32": bool(backends.cudnn.allow_tf32),
            "cudnn.benchmark": bool(backends.cudnn.benchmark),
            "cudnn.deterministic": bool(backends.cudnn.deterministic),
        }
    for key in VOLATILE_SETTINGS:
        agent.setting(key, values[key])


def refresh_rank(agent) -> None:
    if agent.rank is not None:
        return
    dist = getattr(agent.torch, "distributed", None)
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            agent.rank = dist.get_rank()
    except Exception:
        pass


def dist_backend(torch) -> str | None:
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return str(dist.get_backend())


def process_detail(agent) -> dict:
    """The ``process-start`` event's detail."""
    argv = [a[:200] for a in sys.argv[:32]]
    return {
        "argv": argv,
        "executable": sys.executable,
        "ppid": os.getppid(),
        "role": agent.role,
        "rank": agent.rank,
        "local_rank": env_int("LOCAL_RANK"),
        "world_size": env_int("WORLD_SIZE"),
        "torch_version": getattr(agent.torch, "__version__", None),
        "python_version": sys.version.split()[0],
    }


def in_multiprocessing_child() -> bool:
    import multiprocessing

    parent = getattr(multiprocessing, "parent_process", None)
    return parent is not None and parent() is not None


def guess_role() -> str:
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if argv0 == "torchrun" or sys.argv[0].endswith(os.path.join("distributed", "run.py")):
        return LAUNCHER
    if in_multiprocessing_child():
        return MULTIPROCESSING_CHILD  # a spawned DataLoader worker says so when it starts
    if env_int("RANK") is not None:
        return RANK
    return TRAINER


def apply_threads_override(agent) -> None:
    """tune's ``num_threads`` override, in a process that is not a DataLoader worker."""
    agent.threads_override_pending = False
    if agent.role == WORKER:
        return
    n = agent.overrides["num_threads"]
    agent.original(agent.torch, "set_num_threads")(n)
    agent.event("override-applied", {"num_threads": n})


def threads_for(agent, requested: int) -> int:
    """What ``torch.set_num_threads(requested)`` sets under tune's thread override."""
    wanted = agent.overrides.get("num_threads")
    if wanted is None or agent.role == WORKER:
        return requested
    if requested != wanted:
        agent.event("override-applied", {"num_threads": wanted, "requested": requested})
    return wanted


def on_set_num_threads(agent) -> None:
    agent.setting("torch.num_threads", agent.torch.get_num_threads())
    if agent.role == WORKER:
        agent.flush(final=True)  # a worker's settings are all it ever sends
