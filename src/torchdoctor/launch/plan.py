"""What ``torchdoctor launch`` runs: the real torchrun, with the settings a distributed job
usually gets wrong filled in (only those the user left unset), and the post-mortem armed.

The plan is a plain dataclass built from the options and the environment; nothing is started
here. torchrun (``python -m torch.distributed.run``) does rendezvous, restarts and teardown.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.instrument.agent.contract import ENV_FR_DIR, FR_PREFIX
from torchdoctor.sampling import network
from torchdoctor.sampling.hostinfo import whole_cpus_here
from torchdoctor.sampling.roles import is_python

# ENV_FR_DIR is read by the agent's rank part (instrument/agent/ranks.py): where ranks write
# their flight-recorder dumps when a collective times out or torchrun stops them.
FR_BUFFER_ENTRIES = 2000  # the tutorial's default; set explicitly (torch's own default is 0)


@dataclass(frozen=True)
class LaunchOptions:
    nproc_per_node: str = "auto"  # a number, or "auto": one rank per GPU (1 without GPUs)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    standalone: bool = False


@dataclass
class LaunchPlan:
    """Everything ``launch`` decided: the command, the environment it adds, and why."""

    argv: list[str]  # python -m torch.distributed.run ... SCRIPT ARGS
    env: dict[str, str]  # the full environment of torchrun
    added: dict[str, str]  # what launch added to the user's environment
    nproc_per_node: int
    nnodes: int
    node_rank: int
    rendezvous: str  # "standalone (free port)" or "static HOST:PORT"
    fr_dir: Path
    notes: list[str] = field(default_factory=list)  # one line per decision, for the user

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def resolve_nproc(value: str, gpu_count: int) -> tuple[int, str | None]:
    """The number of ranks on this node, and a note when it was chosen for the user."""
    if value == "auto":
        if gpu_count:
            return gpu_count, f"--nproc-per-node auto: one rank per GPU ({gpu_count})"
        return 1, (
            "--nproc-per-node auto: no GPU, so one rank that uses every core "
            "(pass --nproc-per-node N for N CPU ranks)"
        )
    try:
        n = int(value)
    except ValueError:
        raise UserError(f"--nproc-per-node {value!r} is not a number; give N or auto") from None
    if n < 1:
        raise UserError(f"--nproc-per-node {n} must be at least 1")
    return n, None


def check_options(opts: LaunchOptions) -> None:
    if opts.nnodes < 1:
        raise UserError(f"--nnodes {opts.nnodes} must be at least 1")
    if not 0 <= opts.node_rank < opts.nnodes:
        raise UserError(
            f"--node-rank {opts.node_rank} is outside 0..{opts.nnodes - 1} (--nnodes {opts.nnodes})"
        )
    if opts.master_port is not None and not 1 <= opts.master_port <= 65535:
        raise UserError(f"--master-port {opts.master_port} is not a TCP port (1-65535)")
    if opts.standalone and (opts.nnodes > 1 or opts.master_addr or opts.master_port):
        raise UserError(
            "--standalone is for one node and picks its own port: drop it, or drop "
            "--nnodes/--master-addr/--master-port"
        )
    if opts.nnodes > 1 and (not opts.master_addr or opts.master_port is None):
        raise UserError(
            f"--nnodes {opts.nnodes} needs --master-addr and --master-port, the same on every "
            "node (the address of node 0 that the others can reach)"
        )
    if opts.nnodes > 1 and opts.master_addr in ("localhost", "127.0.0.1", "::1"):
        raise UserError(
            f"--master-addr {opts.master_addr} is this machine's loopback: the other nodes "
            "cannot reach it; give node 0's routable address"
        )


def plan_launch(
    opts: LaunchOptions,
    script: list[str],
    *,
    env: dict[str, str],
    fr_dir: Path,
    gpu_count: int,
    python: str = sys.executable,
    numa_binding: bool = False,
) -> LaunchPlan:
    """The torchrun command and environment for ``script`` on this node."""
    check_options(opts)
    if not script:
        raise UserError("give the training script after --: torchdoctor launch -- train.py ARGS")
    nproc, note = resolve_nproc(opts.nproc_per_node, gpu_count)
    notes = [note] if note else []
    added: dict[str, str] = {}

    def put(name: str, value: str, why: str | None = None) -> None:
        if name in env:
            notes.append(f"{name}={env[name]} kept (set by you)")
            return
        added[name] = value
        if why:
            notes.append(f"{name}={value}: {why}")

    cores = whole_cpus_here()
    threads = max(1, cores // nproc)
    put("OMP_NUM_THREADS", str(threads), f"{cores} usable cores / {nproc} local ranks")
    # Post-mortem: the flight recorder keeps the last collectives of each rank; gloo records
    # into it natively in torch 2.13 (no durations), NCCL also dumps it on a watchdog timeout.
    put("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER_ENTRIES))
    put("TORCH_FR_DUMP_TEMP_FILE", str(fr_dir / FR_PREFIX))
    added[ENV_FR_DIR] = str(fr_dir)
    if gpu_count:
        put("TORCH_NCCL_TRACE_BUFFER_SIZE", str(FR_BUFFER_ENTRIES))
        put("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        put("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(fr_dir / FR_PREFIX))
        put("NCCL_DEBUG", "WARN")
        put("NCCL_DEBUG_FILE", str(fr_dir / "nccl.%h.%p.log"))
        if "CUDA_VISIBLE_DEVICES" in env and nproc > 1:
            notes.append(
                "every rank sees CUDA_VISIBLE_DEVICES="
                f"{env['CUDA_VISIBLE_DEVICES']} and picks its GPU by LOCAL_RANK"
            )

    args = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if opts.nnodes == 1 and opts.master_port is None:
        # c10d rendezvous on localhost:0: the store takes a free port, no clash on 29500.
        args.append("--standalone")
        rendezvous = "standalone (free port)"
    else:
        addr = opts.master_addr or "127.0.0.1"
        port = opts.master_port if opts.master_port is not None else 29500
        args += [
            f"--nnodes={opts.nnodes}",
            f"--node-rank={opts.node_rank}",
            f"--master-addr={addr}",
            f"--master-port={port}",
        ]
        rendezvous = f"static {addr}:{port}"
        if opts.nnodes > 1:
            ip = network.resolve_ipv4(addr)
            route = network.route_to(ip) if ip is not None else None
            if route is not None:
                # gloo binds the address gethostname() resolves to, which is often loopback.
                put("GLOO_SOCKET_IFNAME", route.interface, f"the interface that reaches {addr}")
                if gpu_count:
                    put("NCCL_SOCKET_IFNAME", route.interface, f"the interface that reaches {addr}")
    if numa_binding and gpu_count:
        args.append("--numa-binding=node")  # each rank's CPUs on its GPU's NUMA node
        notes.append("--numa-binding=node: each rank runs on the cores of its GPU's NUMA node")
    args += script
    full = dict(env)
    full.update(added)
    return LaunchPlan(
        argv=args,
        env=full,
        added=added,
        nproc_per_node=nproc,
        nnodes=opts.nnodes,
        node_rank=opts.node_rank,
        rendezvous=rendezvous,
        fr_dir=fr_dir,
        notes=notes,
    )


def torchrun_supports_numa_binding() -> bool:
    """torch >= 2.8's torchrun has --numa-binding; older ones do not."""
    try:
        import importlib.util

        return importlib.util.find_spec("torch.numa.binding") is not None
    except (ImportError, ValueError):
        return False


def split_script(argv: list[str]) -> list[str]:
    """The script and its arguments as torchrun takes them (``-m module`` kept; a leading
    ``python`` dropped here: it becomes torchrun's own interpreter, which starts every rank;
    see :func:`torchdoctor.run.interpreter.find_job_python`)."""
    args = list(argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        raise UserError("give the training script after --: torchdoctor launch -- train.py ARGS")
    if is_python(args[0]):
        args = args[1:]
        if not args:
            raise UserError("give the training script after python: launch -- python train.py")
    if args[0] == "-m" and len(args) < 2:
        raise UserError("-m needs a module name: torchdoctor launch -- -m package.train")
    if args[0] != "-m" and args[0].startswith("-"):
        raise UserError(
            f"{args[0]!r} is not a script; torchdoctor launch options go before --, "
            "the script and its arguments after it"
        )
    # os.path.isfile: False for a name the system refuses (too long), where Path.is_file raises
    if args[0] != "-m" and not os.path.isfile(args[0]):
        raise UserError(f"no such script: {args[0]!r}")
    return args


def launch_meta(plan: LaunchPlan, preflight_report, started: float) -> dict:
    """What the recording keeps about the launch: enough to join the nodes of one job."""
    return {
        "nproc_per_node": plan.nproc_per_node,
        "nnodes": plan.nnodes,
        "node_rank": plan.node_rank,
        "world_size": plan.world_size,
        "rendezvous": plan.rendezvous,
        "added_env": plan.added,
        "notes": plan.notes,
        "flight_recorder_dir": str(plan.fr_dir),
        "preflight": preflight_report.as_dict(),
        "started_at": started,
    }
