"""Parse time and peak memory of a profile window's trace, per trace size (issue 42).

GPU-shaped traces (tests/helpers/chrome_traces.py: kernels, runtime launches, correlation ids,
syncs, pageable copies, NCCL on its own stream, pretty-printed and gzipped as torch writes them)
are generated streaming to a temporary folder at each size (MB of JSON text, uncompressed).
Each parse runs in a fresh child process, which reports its wall time and the growth of its
peak RSS (ru_maxrss after minus before: imports excluded). Side by side on the same file:

  ours       torchdoctor.recording.profiles.analyse_trace (the whole analysis);
  json.load  the naive baseline: the file loaded whole, then one pass over its events (only up
             to --naive-up-to MB: it needs several times the file's size in memory);
  HTA        HolisticTraceAnalysis's TraceAnalysis(trace_dir=...) parse, when --hta-python
             names a Python that has it installed (HTA 0.5.0 needs pandas < 3), up to
             --hta-up-to MB (it takes ~6x the file's size in memory).

Targets (issue 42): ours within 64 MiB of peak RSS growth at every size (1 GB included); beside
HTA, at least 5x faster (CPU time) and at most a tenth of its memory.

    python benchmarks/profile_parse.py [--sizes 50,200,1000] [--naive-up-to 200]
                                       [--hta-python /path/to/venv/bin/python] [--hta-up-to 200]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from scorecard import Scorecard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.chrome_traces import GpuModel, Scenario, TraceFile  # noqa: E402

MIB = 2**20
TARGET_MIB = 64.0
TARGET_MEMORY_RATIO = 0.1  # issue 42: at most a tenth of HTA's memory on the same trace
TARGET_SPEEDUP = 5.0  # and at least 5x faster
# One step: 2000 kernels of a mixed model, a sync, a pageable batch copy, an all-reduce.
STEP = Scenario(
    kernels_per_step=2000,
    kernel_us=(40.0, 12.0, 200.0, 6.0),
    sync_per_step=1,
    pageable_h2d_bytes=4_000_000,
    nccl_us=800.0,
)

OURS = """
import resource, sys, time
from torchdoctor.recording.profiles import analyse_trace
usage = resource.getrusage(resource.RUSAGE_SELF)
before, cpu0 = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
t0 = time.perf_counter()
steps = len(analyse_trace(sys.argv[1]).steps)
wall = time.perf_counter() - t0
usage = resource.getrusage(resource.RUSAGE_SELF)
after, cpu = usage.ru_maxrss, usage.ru_utime + usage.ru_stime - cpu0
print(wall, cpu, (after - before) * 1024, steps)
"""
NAIVE = """
import gzip, json, resource, sys, time
usage = resource.getrusage(resource.RUSAGE_SELF)
before, cpu0 = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
t0 = time.perf_counter()
with gzip.open(sys.argv[1], "rt") as f:
    events = json.load(f)["traceEvents"]
steps = sum(1 for e in events if str(e.get("name", "")).startswith("ProfilerStep#"))
wall = time.perf_counter() - t0
usage = resource.getrusage(resource.RUSAGE_SELF)
after, cpu = usage.ru_maxrss, usage.ru_utime + usage.ru_stime - cpu0
print(wall, cpu, (after - before) * 1024, steps)
"""
HTA = """
import resource, sys, time
import hta.trace_analysis  # imported before the first measure: HTA's imports are not its parse
usage = resource.getrusage(resource.RUSAGE_SELF)
before, cpu0 = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
t0 = time.perf_counter()
analysis = hta.trace_analysis.TraceAnalysis(trace_dir=sys.argv[2])
wall = time.perf_counter() - t0
usage = resource.getrusage(resource.RUSAGE_SELF)
after, cpu = usage.ru_maxrss, usage.ru_utime + usage.ru_stime - cpu0
print(wall, cpu, (after - before) * 1024, 0)
"""


def generate(path: Path, megabytes: float) -> tuple[int, int]:
    """A trace of about ``megabytes`` MB of JSON text: (events, characters)."""
    out = TraceFile(path)
    model = GpuModel(out)
    step = 1
    while out.chars < megabytes * 1e6:
        model.step(STEP, step)
        step += 1
    out.close()
    return out.count, out.chars


def measure(python: str, code: str, *args: str) -> tuple[float, float, float, int] | str:
    """(wall s, CPU s, peak RSS growth MiB, steps) of ``code`` in a fresh child; on failure
    its last line. CPU time is the figure to compare: the wall time of a shared machine is
    mostly other people's work."""
    done = subprocess.run(
        [python, "-c", textwrap.dedent(code), *args], capture_output=True, text=True
    )
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["failed"])[-1]
    wall, cpu, grown, steps = done.stdout.split()[-4:]
    return float(wall), float(cpu), float(grown) / MIB, int(steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,200,1000", help="MB of trace JSON, uncompressed")
    parser.add_argument("--naive-up-to", type=float, default=200.0)
    parser.add_argument("--hta-python", default=None, help="a Python with HTA installed")
    parser.add_argument("--hta-up-to", type=float, default=200.0)
    args = parser.parse_args()
    card = Scorecard("profile_parse")
    results = []
    with tempfile.TemporaryDirectory(prefix="td-profile-parse-") as tmp:
        for size in (float(s) for s in args.sizes.split(",")):
            folder = Path(tmp) / f"{size:g}"
            folder.mkdir()
            trace = folder / "rank0-steps1-9.pt.trace.json.gz"
            t0 = time.perf_counter()
            events, chars = generate(trace, size)
            made = time.perf_counter() - t0
            row = {"mb": chars / 1e6, "events": events, "gz_mb": trace.stat().st_size / 1e6}
            print(
                f"[profile_parse] {row['mb']:.0f} MB trace ({events} events, "
                f"{row['gz_mb']:.1f} MB gzipped) generated in {made:.0f} s",
                flush=True,
            )
            ours = measure(sys.executable, OURS, str(trace))
            if isinstance(ours, str):
                card.verdict(f"ours, {size:g} MB", ours, False, "parses")
                continue
            row["ours"] = ours
            card.check(
                f"ours, {row['mb']:.0f} MB trace: peak RSS growth",
                ours[2],
                f"{ours[2]:.1f} MiB; CPU {ours[1]:.1f} s ({row['mb'] / max(ours[1], 1e-9):.0f} MB/s), "
                f"wall {ours[0]:.1f} s",
                at_most=TARGET_MIB,
                target=f"<= {TARGET_MIB:g} MiB",
            )
            if size <= args.naive_up_to:
                naive = measure(sys.executable, NAIVE, str(trace))
                if not isinstance(naive, str):
                    row["json.load"] = naive
                    card.info(
                        f"json.load, {row['mb']:.0f} MB",
                        f"{naive[2]:.0f} MiB, CPU {naive[1]:.1f} s (it only decodes); ours "
                        f"{ours[2] / naive[2]:.3f} of its memory",
                    )
            if args.hta_python and size <= args.hta_up_to:
                hta = measure(args.hta_python, HTA, str(trace), str(folder))
                if isinstance(hta, str):
                    card.info(f"HTA, {row['mb']:.0f} MB", f"failed: {hta[:200]}")
                else:
                    row["hta"] = hta
                    card.info(f"HTA, {row['mb']:.0f} MB", f"{hta[2]:.0f} MiB, CPU {hta[1]:.1f} s")
                    card.check(
                        f"ours vs HTA speed (CPU), {row['mb']:.0f} MB",
                        hta[1] / max(ours[1], 1e-9),
                        f"{hta[1] / max(ours[1], 1e-9):.1f}x",
                        at_least=TARGET_SPEEDUP,
                    )
                    card.check(
                        f"ours / HTA memory, {row['mb']:.0f} MB",
                        ours[2] / hta[2],
                        f"{ours[2] / hta[2]:.3f}",
                        at_most=TARGET_MEMORY_RATIO,
                    )
            results.append(row)
            trace.unlink()
    print(json.dumps(results, indent=1))
    return card.exit_code()


if __name__ == "__main__":
    sys.exit(main())
