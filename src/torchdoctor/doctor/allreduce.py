"""Collective bandwidth, measured the way nccl-tests measures it, with gloo or NCCL.

For every message size S (bytes of the whole buffer) and operation, after warm-up iterations
every rank times K back-to-back operations; the time per operation t is the mean over the K,
taken from the slowest rank. Then

- algbw = S / t;
- busbw = algbw x 2(n-1)/n for all-reduce, algbw x (n-1)/n for all-gather and reduce-scatter
  (S being the gathered output, or the scattered input), n the number of ranks.

busbw is the rate each rank's link carries in a ring algorithm, so it compares directly with
the link's rated speed: across nodes it should reach 85 % of the NIC's rated peak. After the
timed run every size is checked once with known values (all-reduce of rank+1 gives n(n+1)/2
everywhere): ``wrong`` counts the elements that came out different, as nccl-tests' #wrong.

Ways to run: :func:`bench_local` starts N processes on this machine itself; :func:`run_rank`
is one rank of a launch that already exists (torchrun's RANK / WORLD_SIZE / MASTER_ADDR).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.units import fmt_bytes
from torchdoctor.units import parse_size as parse_size_text

OPS = ("all_reduce", "all_gather", "reduce_scatter")
TARGET_RATIO = 0.85  # of the NIC's rated peak, across nodes


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` on ``n`` ranks (nccl-tests' factors)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    raise ValueError(f"unknown operation {op!r}")


def parse_size(text: str) -> int:
    """One buffer size of ``--sizes`` (the one vocabulary: 8K = 8 x 2^10 bytes)."""
    value = parse_size_text(text, "--sizes")
    if value < 1:
        raise UserError(f"size {text!r} must be at least 1 byte")
    return value


def parse_sizes(text: str) -> list[int]:
    """``"8K:256M"`` -> 8 KiB, 16 KiB, ... 256 MiB (doubling, as nccl-tests -f 2); ``"1M,4M"``
    -> those sizes."""
    if ":" in text:
        low_text, _, high_text = text.partition(":")
        low, high = parse_size(low_text), parse_size(high_text)
        if low > high:
            raise UserError(f"--sizes {text}: the first size must not exceed the second")
        sizes = []
        size = low
        while size <= high:
            sizes.append(size)
            size *= 2
        return sizes
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise UserError(
            f"--sizes {text!r} names no size: give LOW:HIGH (8K:256M) or a list (1M,4M)"
        )
    return sizes


# What one rank holds at once, per byte of the buffer (S): the buffer itself, its 1/n block,
# the expected values of the correctness check and the comparison's mask (1/element size),
# and about twice S more inside the collective and the check. Measured with torch 2.13, gloo,
# 2 ranks: a 256 MiB float32 all-reduce and all-gather raised rank 0's peak RSS by 4.75 x S
# (reduce-scatter 3.1 x S); this rule gives 4.75 there and errs high for int8 (5.5).
COPIES_BESIDE_BLOCKS = 4.0


def rank_bytes(size: int, ranks: int, element_size: int) -> float:
    """Peak bytes one rank of ``ranks`` allocates to sweep a ``size``-byte buffer."""
    return size * (COPIES_BESIDE_BLOCKS + 1 / ranks + 1 / element_size)


def check_fits(
    sizes: list[int], ranks: int, local_ranks: int, element_size: int, available: int, where: str
) -> None:
    """Refuse, before any buffer exists, a sweep whose largest size would not fit: the
    ``local_ranks`` ranks that share ``available`` bytes (``where``: RAM, or one GPU's memory
    for each NCCL rank) each hold :func:`rank_bytes`. The message names the largest size that
    fits, in the --sizes notation (a power of two, as the doubling sweep uses)."""
    largest = max(sizes)
    need = local_ranks * rank_bytes(largest, ranks, element_size)
    if need <= available:
        return
    per_byte = local_ranks * rank_bytes(1, ranks, element_size)
    fits = int(available / per_byte)
    advice = (
        f"the largest size that fits is {_size_text(fits)}"
        if fits >= 1
        else "no buffer fits: free some memory first"
    )
    raise UserError(
        f"--sizes: a {fmt_bytes(largest)} buffer needs about {fmt_bytes(need)} "
        f"({local_ranks} rank(s) x {rank_bytes(1, ranks, element_size):.2g} x the buffer) but "
        f"{where} has {fmt_bytes(available)} available; {advice} (or start anyway with --force)"
    )


def _size_text(n: int) -> str:
    """The largest power of two <= ``n`` in the --sizes notation: 4G, 512M, 8K, 7 (bytes)."""
    if n < 1024:
        return str(n)
    power = n.bit_length() - 1
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if power >= shift:
            return f"{2 ** (power - shift)}{unit}"
    raise AssertionError("unreachable")


@dataclass(slots=True)
class BenchConfig:
    backend: str = "gloo"
    sizes: list[int] = field(default_factory=lambda: parse_sizes("8K:256M"))
    dtype: str = "float32"
    iters: int = 20
    warmup: int = 5
    ops: tuple[str, ...] = OPS
    timeout_s: float = 120.0


@dataclass(slots=True)
class Row:
    op: str
    size: int  # bytes of the whole buffer (S)
    count: int  # elements of that buffer
    time_s: float  # per operation, slowest rank
    algbw: float  # bytes/s
    busbw: float  # bytes/s
    wrong: int  # elements that failed the correctness check, all ranks together


@dataclass(slots=True)
class NodeLink:
    """The interface one node's ranks use, as that node sees it."""

    node: str
    interface: str | None
    speed_mbps: int | None
    tc_rate_bps: int | None  # a tc shaping cap, bytes/s
    virtual: bool
    ranks: list[int] = field(default_factory=list)


@dataclass(slots=True)
class BenchResult:
    backend: str
    world_size: int
    nodes: int
    dtype: str
    iters: int
    warmup: int
    rows: list[Row]
    links: list[NodeLink]
    formula: str = "algbw = S / t; busbw = algbw x 2(n-1)/n (all-reduce), x (n-1)/n (all-gather, reduce-scatter)"
    peak_busbw: float | None = None  # bytes/s, all-reduce
    link_speed_bps: float | None = None  # bytes/s: the slowest node's rated speed
    ratio: float | None = None  # peak_busbw / link_speed_bps, across nodes only
    target: float = TARGET_RATIO
    causes: list[str] = field(default_factory=list)
    verdict: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- running inside a process group -------------------------------------------------------------


def _node_key() -> str:
    # Two containers or network namespaces on one host talk over a virtual network: they count
    # as two nodes, which is what the link comparison needs.
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/netns:{netns}"


def _link_of_this_rank(env: dict[str, str]) -> dict[str, Any]:
    from torchdoctor.sampling import network

    name = None
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = env.get(var, "").split(",")[0].strip().lstrip("=")
        if value and not value.startswith("^"):
            name = value
            break
    if name is None and env.get("MASTER_ADDR"):
        ip = network.resolve_ipv4(env["MASTER_ADDR"])
        route = network.route_to(ip) if ip else None
        name = route.interface if route else None
    speed = cap = None
    if name and name != "lo":
        speed, _ = network.link_speed(name)
        cap, _ = network.tc_rate_cap(name)
    return {
        "node": _node_key(),
        "interface": name,
        "speed_mbps": speed,
        "tc_rate_bps": cap,
        "virtual": bool(name) and network.is_virtual(name),
    }


def _check_values(torch: Any, op: str, out: Any, n: int, rank: int) -> int:
    if op == "all_gather":
        per = out.numel() // n
        expected = torch.arange(1, n + 1, dtype=out.dtype, device=out.device).repeat_interleave(per)
    else:
        expected = torch.full_like(out, n * (n + 1) / 2)
    return int((out != expected).sum().item())


def _sweep_one(dist: Any, torch: Any, op: str, size: int, cfg: BenchConfig, device: Any) -> Row:
    n, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, cfg.dtype)
    elt = torch.tensor([], dtype=dtype).element_size()
    count = max(n, size // elt)
    if op != "all_reduce":
        count -= count % n  # the buffer splits into n equal blocks
    size = count * elt
    big = torch.zeros(count, dtype=dtype, device=device)
    small = torch.zeros(count // n, dtype=dtype, device=device)
    # The *_single names where torch has them: the older ones warn (FutureWarning) in torch
    # 2.13 on every call site, which the bench would leak onto the user's terminal.
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def run() -> None:
        if op == "all_reduce":
            dist.all_reduce(big)
        elif op == "all_gather":
            all_gather(big, small)
        else:
            reduce_scatter(small, big)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(cfg.warmup):
        run()
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(cfg.iters):
        run()
    sync()
    elapsed = (time.perf_counter() - start) / cfg.iters
    slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    t = float(slowest.item())
    # Correctness: known values in, the exact expected values out.
    if op == "all_reduce":
        big.fill_(rank + 1)
        run()
        out = big
    elif op == "all_gather":
        small.fill_(rank + 1)
        run()
        out = big
    else:
        big.fill_(rank + 1)
        run()
        out = small
    wrong = torch.tensor([_check_values(torch, op, out, n, rank)], dtype=torch.int64, device=device)
    dist.all_reduce(wrong)
    algbw = size / t
    return Row(op, size, count, t, algbw, algbw * bus_factor(op, n), int(wrong.item()))


def sweep(
    cfg: BenchConfig,
    env: dict[str, str] | None = None,
    on_row: Callable[[Row], None] | None = None,
) -> BenchResult | None:
    """Run the sweep in the current process group; the result on rank 0, None elsewhere.
    ``on_row`` hears of each row as it finishes, on rank 0 (nccl-tests prints them so)."""
    import torch
    import torch.distributed as dist

    env = dict(os.environ) if env is None else env
    rank, n = dist.get_rank(), dist.get_world_size()
    if cfg.backend == "nccl":
        local = int(env.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    # The same sizes on every rank, or the collectives would hang or mismatch.
    plans: list[Any] = [None] * n
    dist.all_gather_object(plans, (cfg.sizes, cfg.dtype, list(cfg.ops), cfg.iters))
    if any(p != plans[0] for p in plans):
        raise UserError("the ranks were started with different --sizes/--dtype/--ops/--iters")
    links: list[Any] = [None] * n
    dist.all_gather_object(links, _link_of_this_rank(env))
    rows = []
    for op in cfg.ops:
        for size in cfg.sizes:
            rows.append(_sweep_one(dist, torch, op, size, cfg, device))
            if on_row is not None and rank == 0:
                on_row(rows[-1])
    if rank != 0:
        return None
    by_node: dict[str, NodeLink] = {}
    for r, link in enumerate(links):
        entry = by_node.setdefault(link["node"], NodeLink(**link))
        entry.ranks.append(r)
    result = BenchResult(
        backend=cfg.backend,
        world_size=n,
        nodes=len(by_node),
        dtype=cfg.dtype,
        iters=cfg.iters,
        warmup=cfg.warmup,
        rows=rows,
        links=list(by_node.values()),
    )
    judge(result, env)
    return result


# -- the verdict ---------------------------------------------------------------------------------


def judge(result: BenchResult, env: dict[str, str]) -> None:
    """Compare busbw with the link across nodes, and name the likely causes when it falls short."""
    from torchdoctor.doctor.settings import stale_settings

    reduce_rows = [r for r in result.rows if r.op == "all_reduce"]
    result.peak_busbw = max((r.busbw for r in reduce_rows), default=None)
    wrong = sum(r.wrong for r in result.rows)
    if wrong:
        result.verdict = f"{wrong} element(s) came out wrong: the collective itself is broken"
        return
    if result.nodes < 2:
        result.verdict = (
            f"{result.world_size} rank(s) on one node: no network link involved, "
            "so there is no link speed to compare with"
        )
        return
    speeds = [link.speed_mbps for link in result.links if link.speed_mbps]
    if result.peak_busbw is None:
        result.verdict = "no all-reduce measured: nothing to compare with the link"
        return
    if len(speeds) < len(result.links):
        unknown = [link.node for link in result.links if not link.speed_mbps]
        result.verdict = f"link speed unknown on {', '.join(unknown)} (no rated speed in sysfs)"
    if not speeds:
        return
    result.link_speed_bps = min(speeds) * 1e6 / 8
    result.ratio = result.peak_busbw / result.link_speed_bps
    if result.ratio >= result.target:
        result.verdict = f"busbw reaches {result.ratio:.0%} of the link's rated speed (target {result.target:.0%})"
        return
    causes = []
    capped = [
        link
        for link in result.links
        if link.tc_rate_bps and link.tc_rate_bps < (link.speed_mbps or 0) * 1e6 / 8
    ]
    if capped:
        cap = min(link.tc_rate_bps or 0 for link in capped)
        share = result.peak_busbw / cap
        names = ", ".join(sorted({link.interface or "?" for link in capped}))
        causes.append(
            f"tc qdisc(s) on {names} cap the link at {cap * 8 / 1e6:g} Mbit/s: busbw is "
            f"{share:.0%} of that cap"
        )
        if share >= result.target:
            # The shaping explains the shortfall by itself: the rest would be noise.
            result.causes = causes
            result.verdict = (
                f"busbw is {result.ratio:.1%} of the link's rated speed, short of the "
                f"{result.target:.0%} target, because the link is shaped"
            )
            return
    virtual = sorted({link.interface for link in result.links if link.virtual and link.interface})
    if virtual:
        causes.append(f"traffic goes through virtual interface(s) {', '.join(virtual)}")
    if (
        result.backend == "nccl"
        and (env.get("NCCL_IB_DISABLE", "0") not in ("", "0") or env.get("NCCL_NET") == "Socket")
        and os.path.isdir("/sys/class/infiniband")
    ):
        causes.append(
            "NCCL uses TCP sockets although InfiniBand is present (NCCL_IB_DISABLE / NCCL_NET)"
        )
    caps = [f"{name}={value}" for name, value, _ in stale_settings(env)]
    if caps:
        causes.append(f"NCCL settings cap it: {', '.join(caps)}")
    if result.backend == "gloo":
        causes.append("gloo is a CPU/TCP backend and seldom fills fast links; GPUs use nccl")
    if not causes:
        causes.append(
            "no known cause found: measure the raw link (iperf3) and check NCCL_DEBUG=INFO"
        )
    result.causes = causes
    result.verdict = (
        f"busbw is {result.ratio:.1%} of the link's rated speed, short of the "
        f"{result.target:.0%} target"
    )


# -- launching -----------------------------------------------------------------------------------


def _init(cfg: BenchConfig, env: dict[str, str], store: Any = None) -> None:
    import torch.distributed as dist

    rank, n = int(env["RANK"]), int(env["WORLD_SIZE"])
    timeout = timedelta(seconds=cfg.timeout_s)
    if store is not None:
        dist.init_process_group(cfg.backend, store=store, rank=rank, world_size=n, timeout=timeout)
    else:
        dist.init_process_group(
            cfg.backend, init_method="env://", rank=rank, world_size=n, timeout=timeout
        )


def under_launcher(env: dict[str, str] | None = None) -> bool:
    """Whether this process is a rank of an existing launch (torchrun or the like)."""
    env = dict(os.environ) if env is None else env
    return all(env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_rank(
    cfg: BenchConfig,
    env: dict[str, str] | None = None,
    on_row: Callable[[Row], None] | None = None,
) -> BenchResult | None:
    """Be one rank of an existing launch: sweep, and return the result on rank 0."""
    import torch.distributed as dist

    env = dict(os.environ) if env is None else env
    _init(cfg, env)
    try:
        return sweep(cfg, env, on_row)
    finally:
        dist.destroy_process_group()


def result_from_dict(data: dict[str, Any]) -> BenchResult:
    """A result read back from its JSON form (``BenchResult.to_dict``)."""
    data = dict(data)
    data["rows"] = [Row(**r) for r in data["rows"]]
    data["links"] = [NodeLink(**link) for link in data["links"]]
    return BenchResult(**data)


def _local_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return env


def _child(rank: int, nproc: int, cfg: BenchConfig, port_pipe: Any) -> None:
    """Ranks 1..n-1 of a local run: wait for the store's port, join, sweep, leave."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    port = port_pipe.recv()
    if port is None:
        return  # the parent gave up before the store existed
    env = _local_env(rank, nproc, port)
    store = dist.TCPStore(
        "127.0.0.1", port, nproc, is_master=False, timeout=timedelta(seconds=cfg.timeout_s)
    )
    port_pipe.send("joined")  # torch imported and the store reached: only the group is left
    port_pipe.close()
    _init(cfg, env, store)
    try:
        sweep(cfg, env)
    finally:
        dist.destroy_process_group()


def _wait_joined(children: list[Any], pipes: list[Any], timeout_s: float) -> None:
    """Wait until every child reached the store, and fail at once when one dies first (rather
    than wait out the process group's timeout)."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout_s
    for rank, (proc, pipe) in enumerate(zip(children, pipes, strict=True), 1):
        while not pipe.poll():
            left = deadline - time.monotonic()
            if left <= 0:
                raise UserError(f"benchmark rank {rank} did not start within {timeout_s:g} s")
            wait([pipe, proc.sentinel], timeout=left)
            if not pipe.poll() and proc.exitcode is not None:
                raise UserError(
                    f"benchmark rank {rank} exited with status {proc.exitcode} before joining "
                    "(its error is printed above)"
                )
        pipe.recv()


def bench_local(
    cfg: BenchConfig, nproc: int, on_row: Callable[[Row], None] | None = None
) -> BenchResult:
    """Run ``nproc`` ranks on this machine: this process is rank 0 and starts the others.

    gloo ranks are forked from this process (torch is imported once, not once per rank);
    NCCL ranks are spawned fresh, as CUDA cannot be used in a forked child. A TCP store on
    127.0.0.1, on a port the kernel picks, joins them: no race for a free port.
    """
    import multiprocessing

    import torch
    import torch.distributed as dist

    if nproc < 2:
        raise UserError("--nproc must be at least 2: a collective needs two ranks")
    ctx = multiprocessing.get_context("fork" if cfg.backend == "gloo" else "spawn")
    children = []
    pipes = []
    for rank in range(1, nproc):
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(rank, nproc, cfg, child_end), daemon=True)
        proc.start()
        child_end.close()
        children.append(proc)
        pipes.append(parent_end)
    threads = torch.get_num_threads()
    try:
        store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
        for pipe in pipes:
            pipe.send(store.port)
        _wait_joined(children, pipes, cfg.timeout_s)
        env = _local_env(0, nproc, store.port)
        torch.set_num_threads(1)  # as the children: n ranks share this machine's cores
        _init(cfg, env, store)
        try:
            result = sweep(cfg, env, on_row)
        finally:
            dist.destroy_process_group()
    except BaseException:
        failed_here = True
        for pipe in pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        raise
    else:
        failed_here = False
    finally:
        torch.set_num_threads(threads)
        for proc in children:
            # After a failure here the others may be stuck waiting for the group: no wait.
            proc.join(timeout=0 if failed_here else cfg.timeout_s)
            if proc.is_alive():  # ours, started above: stopped by its PID
                proc.kill()
                proc.join()
        for pipe in pipes:
            pipe.close()
    failed = [(rank, proc.exitcode) for rank, proc in enumerate(children, 1) if proc.exitcode]
    if failed:
        raise UserError(
            "benchmark rank(s) failed: "
            + ", ".join(f"rank {rank} exit status {code}" for rank, code in failed)
        )
    assert result is not None
    return result
