"""`make bench`: run every CPU benchmark in turn, then print one table of figures vs targets
(met/MISSED, with the 1-minute load average each figure was measured at).

Each benchmark compares against a baseline run side by side in the same run and reports its
figures through scorecard.Scorecard; none asserts a time. The closing table (figure, value,
target, met/MISSED) is what the README's benchmark table is made from; the exit status is 1
when a benchmark failed or any target was missed. GPU-only checks (gpu_check.sh,
estimate_cuda_check.py) run on a GPU machine by hand and are skipped here.

    python benchmarks/run_all.py [NAME...] [--markdown] [--save]

--save writes the figures to benchmarks/results/latest.jsonl (one JSON line per figure, as the
scorecard wrote them), which the manual's benchmark page renders with ``table`` below. The
figures of the benchmarks this run ran replace their saved ones; the others' saved figures
stay, each with the time and load it was measured at.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from scorecard import RESULTS_ENV, Figure, read_results

HERE = Path(__file__).resolve().parent
SAVED = HERE / "results" / "latest.jsonl"
ORDER = [
    "snapshot_cost.py",
    "nvml_read_cost.py",
    "instrument_overhead.py",
    "estimate_accuracy.py",
    "estimate_loops.py",
    "estimate_speed.py",
    "advice_works.py",
    "tune_vs_grid.py",
    "compare_power.py",
    "top_overhead.py",
    "attach_overhead.py",
    "soak.py",
    "node_week.py",
    "ranks_day.py",
    "queue_contention.py",
    "scrape_cost.py",
    "many_jobs.py",
    "allreduce_two_nodes.py",
    "handoff_overhead.py",
    "distributed_pitfalls.py",
]


def main(argv: list[str]) -> int:
    markdown = "--markdown" in argv
    only = {a for a in argv if not a.startswith("--")}
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "figures.jsonl")
        env = {**os.environ, RESULTS_ENV: results}
        for name in ORDER:
            script = HERE / name
            if not script.exists() or (only and name not in only and script.stem not in only):
                continue
            print(f"\n=== {name} ===", flush=True)
            start = time.monotonic()
            code = subprocess.call([sys.executable, str(script)], cwd=HERE.parent, env=env)
            print(f"--- {name}: exit {code}, {time.monotonic() - start:.0f} s", flush=True)
            if code != 0:
                failed.append(name)
        figures = read_results(results)
        if "--save" in argv:
            SAVED.parent.mkdir(exist_ok=True)
            ran = {f.benchmark for f in figures}
            kept = [f for f in read_results(str(SAVED)) if f.benchmark not in ran]
            by_order = {Path(n).stem: i for i, n in enumerate(ORDER)}
            merged = sorted([*kept, *figures], key=lambda f: by_order.get(f.benchmark, len(ORDER)))
            SAVED.write_text("".join(json.dumps(asdict(f)) + "\n" for f in merged))
            print(f"figures saved to {SAVED.relative_to(HERE.parent)}")
    print()
    print(table(figures, markdown))
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    missed = [f for f in figures if f.met is False]
    if failed or missed:
        if missed:
            print("targets missed: " + "; ".join(f"{f.benchmark}: {f.figure}" for f in missed))
        if failed:
            print("benchmarks that exited non-zero: " + ", ".join(failed))
        return 1
    return 0


def table(figures: list[Figure], markdown: bool) -> str:
    header = ("benchmark", "figure", "value", "target", "load", "measured (UTC)", "")
    rows = [
        (f.benchmark, f.figure, f.value, f.target or "-", _load(f), f.at or "?", f.verdict)
        for f in figures
    ]
    if markdown:
        lines = ["| " + " | ".join(header[:-1]) + " | met |", "|---|---|---|---|---|---|---|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    )


def _load(figure: Figure) -> str:
    """The 1-minute load average the figure was measured at ("?" from an older scorecard)."""
    return "?" if figure.load is None else f"{figure.load:.1f}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
