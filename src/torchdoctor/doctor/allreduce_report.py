"""The all-reduce sweep as a table in nccl-tests' layout, and its comparison with the link."""

from __future__ import annotations

from torchdoctor.doctor.allreduce import BenchResult, Row

_TITLES = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
}
_FACTORS = {"all_reduce": "2(n-1)/n", "all_gather": "(n-1)/n", "reduce_scatter": "(n-1)/n"}


def _size(n: int) -> str:
    for unit, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def format_row(r: Row) -> str:
    """One row, in the columns of the table below its operation's heading."""
    return (
        f"{_size(r.size):>8} {r.count:>11} {r.time_s * 1e6:>11.1f} {r.algbw / 1e9:>11.4f} "
        f"{r.busbw / 1e9:>11.4f} {r.wrong:>7}"
    )


def format_result(result: BenchResult) -> str:
    lines = [
        f"# {result.backend}, {result.world_size} ranks on {result.nodes} node(s), {result.dtype}, "
        f"{result.iters} timed iterations after {result.warmup} warm-up; t = mean per op on the "
        "slowest rank",
        "# algbw = S / t; busbw = algbw x factor; GB/s = 1e9 bytes/s",
    ]
    for op in dict.fromkeys(r.op for r in result.rows):
        n = result.world_size
        lines.append("")
        lines.append(f"{_TITLES[op]} (busbw = algbw x {_FACTORS[op]} = x {_factor(op, n):.3g})")
        lines.append(
            f"{'size':>8} {'count':>11} {'time (us)':>11} {'algbw GB/s':>11} {'busbw GB/s':>11} {'#wrong':>7}"
        )
        for r in (r for r in result.rows if r.op == op):
            lines.append(format_row(r))
    lines.append("")
    for link in result.links:
        if link.interface == "lo":
            speed = "loopback, no link"
        else:
            speed = f"{link.speed_mbps} Mbit/s" if link.speed_mbps else "rated speed unknown"
        cap = f", tc cap {link.tc_rate_bps * 8 / 1e6:g} Mbit/s" if link.tc_rate_bps else ""
        lines.append(
            f"node {link.node} (ranks {','.join(map(str, link.ranks))}): "
            f"{link.interface or 'interface unknown'}, {speed}{cap}"
        )
    if result.peak_busbw is not None:
        peak = f"peak all-reduce busbw {result.peak_busbw / 1e9:.4g} GB/s ({result.peak_busbw * 8 / 1e6:.4g} Mbit/s)"
        if result.ratio is not None and result.link_speed_bps:
            peak += (
                f" = {result.ratio:.1%} of the link's {result.link_speed_bps * 8 / 1e6:g} Mbit/s "
                f"(target {result.target:.0%})"
            )
        lines.append(peak)
    lines.append(result.verdict)
    for cause in result.causes:
        lines.append(f"  likely cause: {cause}")
    return "\n".join(lines)


def _factor(op: str, n: int) -> float:
    from torchdoctor.doctor.allreduce import bus_factor

    return bus_factor(op, n)
