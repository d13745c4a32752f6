"""``doctor --bench``: a short all-reduce sweep on this node as one more check.

NCCL over the visible GPUs when torch has CUDA and there are two or more, gloo otherwise; a
few sizes of 1-16 MiB, so the check takes seconds. Wrong results are an error; the figures are
in ``details`` for the launcher and for a comparison across nodes (``torchdoctor bench
allreduce`` under torchrun measures between nodes).
"""

from __future__ import annotations

from torchdoctor.doctor.check import ERROR, OK, SKIPPED, Check, Plan
from torchdoctor.errors import UserError

SIZES = "1M:16M"
ITERS = 5
WARMUP = 2
TIMEOUT_S = 60.0


def check_bench(plan: Plan) -> Check:
    try:
        import torch
    except ImportError as exc:
        return Check("bench.allreduce", SKIPPED, f"torch is not importable: {exc}")
    from torchdoctor.doctor.allreduce import BenchConfig, bench_local, parse_sizes

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus >= 2 else "gloo"
    nproc = plan.nproc_per_node or (gpus if backend == "nccl" else 2)
    if backend == "nccl":
        nproc = min(nproc, gpus)
    nproc = max(nproc, 2)
    cfg = BenchConfig(
        backend=backend,
        sizes=parse_sizes(SIZES),
        iters=ITERS,
        warmup=WARMUP,
        ops=("all_reduce",),
        timeout_s=TIMEOUT_S,
    )
    try:
        result = bench_local(cfg, nproc)
    except (UserError, RuntimeError, OSError) as exc:
        message = exc.message if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
        return Check(
            "bench.allreduce",
            ERROR,
            f"a {backend} all-reduce between {nproc} local ranks failed: {message}",
            "run `torchdoctor bench allreduce` to see the failing rank's error; with NCCL, "
            "rerun with NCCL_DEBUG=WARN",
        )
    rows = "; ".join(f"{r.size >> 20} MiB: {r.busbw / 1e9:.3g} GB/s" for r in result.rows)
    details = {
        "backend": backend,
        "nproc": nproc,
        "peak_busbw": result.peak_busbw,
        "rows": [{"size": r.size, "time_s": r.time_s, "busbw": r.busbw} for r in result.rows],
    }
    wrong = sum(r.wrong for r in result.rows)
    if wrong:
        return Check(
            "bench.allreduce",
            ERROR,
            f"{backend} all-reduce on {nproc} local ranks gave {wrong} wrong element(s)",
            "the collective is broken here: rerun with NCCL_DEBUG=WARN and check P2P "
            "(gpus.p2p) and the settings checks",
            details,
        )
    return Check(
        "bench.allreduce",
        OK,
        f"{backend} all-reduce on {nproc} local ranks, busbw per size: {rows} "
        f"(busbw = algbw x 2(n-1)/n; results checked)",
        details=details,
    )
