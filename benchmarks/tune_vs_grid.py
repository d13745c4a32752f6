"""`torchdoctor tune` against an exhaustive grid over the same space, on the scenario scripts.

For each scenario (examples/scenarios/):
1. tune runs as `torchdoctor tune` does (same trial runner, budget, trial length);
2. the grid runs every configuration of the same space once, with the same trial runner;
3. tune's pick and the grid's best are re-measured side by side, interleaved (A B A B A B), so
   that the grid's best is not flattered by the luck of one run among many.

Targets (issue 6): tuned >= 95 % of the grid's best throughput in <= 1/3 of the grid's time;
on the data-bound scenario a verified gain >= 1.3x; the healthy scenario keeps its settings.

    python benchmarks/tune_vs_grid.py                       # all three, about 45 min on 2 CPUs
    python benchmarks/tune_vs_grid.py --scenarios data_bound --budget 3m --json out.json
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scorecard import Scorecard
from torchdoctor.sampling.hostinfo import whole_cpus_here
from torchdoctor.tune.result import Measurement
from torchdoctor.tune.space import Config
from torchdoctor.tune.trial import TrialLimits, TrialRunner
from torchdoctor.tune.tuner import (
    available_memory,
    limits_after,
    space_for,
    tune_command,
)
from torchdoctor.units import parse_duration

SCENARIOS = Path(__file__).resolve().parent.parent / "examples" / "scenarios"


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_grid(argv: list[str], folder: Path, trial_steps: int | None) -> dict:
    """Every configuration of the space tune would search, measured once each."""
    runner = TrialRunner(
        executable=argv[0],
        argv=argv,
        folder=folder,
        env=_env(),
        memory_budget=int(available_memory() * 0.5),
        measured_steps=trial_steps,
        limits=TrialLimits(startup_s=300, stall_s=60),
    )
    started = time.monotonic()
    try:
        first = runner(Config(0, 1), "original", None)
        original = runner.observed.config
        first.config = original
        runner.limits = limits_after(first)
        space = space_for(runner.observed, whole_cpus_here())
        grid = space.grid()
        results: dict[Config, Measurement] = {original: first}
        for i, config in enumerate(grid):
            if config in results:
                continue
            m = runner(config, "search", None)
            results[config] = m
            log(f"  grid {i + 1:>2}/{len(grid)} {config.label():<22} {_fmt(m)}")
    finally:
        runner.close()
    elapsed = time.monotonic() - started
    ok = {c: m.throughput for c, m in results.items() if m.ok}
    best = max(ok, key=ok.get)
    return {
        "original": original,
        "configs": len(results),
        "elapsed_s": elapsed,
        "best": best,
        "best_throughput": ok[best],
        "throughput": ok,
    }


def side_by_side(argv: list[str], folder: Path, a: Config, b: Config, steps: int, rounds=3):
    """Interleaved runs of two configurations: (mean a, mean b, per-round b/a)."""
    runner = TrialRunner(
        executable=argv[0],
        argv=argv,
        folder=folder,
        env=_env(),
        measured_steps=steps,
        limits=TrialLimits(startup_s=300, stall_s=60),
    )
    ra, rb = [], []
    try:
        for _ in range(rounds):
            ma = runner(a, "search", None)
            mb = runner(b, "search", None)
            if ma.ok and mb.ok:
                ra.append(ma.throughput)
                rb.append(mb.throughput)
    finally:
        runner.close()
    return statistics.fmean(ra), statistics.fmean(rb), [y / x for x, y in zip(ra, rb, strict=True)]


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("TORCHDOCTOR_")}


def _fmt(m: Measurement) -> str:
    return f"{m.throughput:8.2f} steps/s" if m.ok else f"{m.status}: {m.reason}"


def bench(name: str, budget_s: float, trial_steps: int | None, work: Path) -> dict:
    argv = [sys.executable, str(SCENARIOS / f"{name}.py")]
    log(f"== {name}: tune (budget {budget_s:.0f} s, trial steps {trial_steps or 'auto'})")
    tuned = tune_command(
        argv,
        budget_s=budget_s,
        trial_steps=trial_steps,
        folder=work / name / "tune",
        env=_env(),
        on_trial=lambda m: log(
            f"  tune {m.index:>2} {m.purpose:<16} {m.config.label():<22} {_fmt(m)}"
        ),
    )
    pick = tuned.candidate or tuned.original
    # The grid runs trials as long as tune's (calibrated on the first trial when auto).
    trial_steps = tuned.trial_steps or trial_steps
    log(f"== {name}: grid ({trial_steps} measured steps per trial)")
    grid = run_grid(argv, work / name / "grid", trial_steps)
    if pick == grid["best"]:
        share, rounds = 1.0, []
    else:
        log(f"== {name}: tune's pick {pick.label()} vs grid's best {grid['best'].label()}")
        grid_best, picked, rounds = side_by_side(
            argv, work / name / "check", grid["best"], pick, trial_steps
        )
        share = picked / grid_best
    v = tuned.verification
    return {
        "scenario": name,
        "original": tuned.original.label(),
        "tune_pick": pick.label(),
        "tune_recommended": tuned.recommended.label(),
        "tune_changed": tuned.changed,
        "tune_trials": len(tuned.trials),
        "tune_search_s": round(tuned.search_s, 1),
        "tune_total_s": round(tuned.elapsed_s, 1),
        "tune_stopped": tuned.stopped,
        "noise": round(tuned.noise, 3),
        "verified_gain": None if tuned.gain is None else round(tuned.gain, 3),
        "gain_spread": None if v is None or v.gain_spread is None else round(v.gain_spread, 3),
        "verification_ratios": [round(r, 3) for r in v.ratios] if v else [],
        "grid_configs": grid["configs"],
        "grid_s": round(grid["elapsed_s"], 1),
        "grid_best": grid["best"].label(),
        "pick_vs_grid_best": round(share, 3),
        "pick_vs_grid_rounds": [round(r, 3) for r in rounds],
        "search_time_vs_grid": round(tuned.search_s / grid["elapsed_s"], 3),
        "total_time_vs_grid": round(tuned.elapsed_s / grid["elapsed_s"], 3),
    }


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default="data_bound,thread_oversubscribed,healthy")
    p.add_argument("--budget", default="5m", help="tune's budget per scenario")
    p.add_argument("--trial-steps", type=int, default=None, help="default: auto, as tune")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    # A SIGTERM must stop the running trial's processes too: turn it into KeyboardInterrupt,
    # which the trial runner cleans up after.
    signal.signal(signal.SIGTERM, _interrupt)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tune-bench-") as tmp:
        for name in args.scenarios.split(","):
            rows.append(bench(name, parse_duration(args.budget), args.trial_steps, Path(tmp)))
    print(
        f"{'scenario':<22} {'as written':<14} {'tuned':<18} {'verified gain':<16} "
        f"{'vs grid best':>12} {'tune/grid time':>16} {'grid':>14}"
    )
    for r in rows:
        gain = (
            f"{r['verified_gain']:.2f}x ± {r['gain_spread'] or 0:.2f}"
            if r["verified_gain"]
            else "none (kept)"
        )
        print(
            f"{r['scenario']:<22} {r['original']:<14} {r['tune_recommended']:<18} {gain:<16} "
            f"{r['pick_vs_grid_best']:>11.0%} "
            f"{r['tune_search_s']:>6.0f}/{r['grid_s']:.0f} s ({r['search_time_vs_grid']:.2f}) "
            f"{r['grid_configs']:>4} configs"
        )
    for r in rows:
        print(
            f"{r['scenario']}: tune {r['tune_trials']} trials, {r['tune_total_s']:.0f} s with "
            f"verification ({r['total_time_vs_grid']:.2f} of the grid's time), stopped: "
            f"{r['tune_stopped']}, noise ±{r['noise']:.0%}, pairs {r['verification_ratios']}; "
            f"grid best {r['grid_best']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    card = Scorecard("tune_vs_grid")
    for r in rows:
        name = r["scenario"]
        if name == "healthy":
            # nothing to gain: tune must keep the script's own settings
            card.verdict(
                "tune on the healthy scenario",
                "kept the script's settings" if not r["tune_changed"] else r["tune_recommended"],
                not r["tune_changed"],
                "no change",
            )
            continue
        card.check(
            f"tune's pick vs an exhaustive grid's best, {name}",
            100 * r["pick_vs_grid_best"],
            f"{r['pick_vs_grid_best']:.0%}",
            at_least=95,
            target=">= 95 %",
        )
        # The time the user waits is the whole of tune, verification included; the search
        # alone is the kinder figure, shown beside it.
        card.check(
            f"tune's whole time (search + verification) vs the grid's, {name}",
            r["total_time_vs_grid"],
            f"{r['total_time_vs_grid']:.2f} ({r['tune_total_s']:.0f} s vs {r['grid_s']:.0f} s;"
            f" search alone {r['search_time_vs_grid']:.2f})",
            at_most=1 / 3,
            target="<= 0.33",
        )
        if r["verified_gain"]:
            card.info(
                f"tune's verified gain, {name}",
                f"{r['verified_gain']:.2f}x ± {r['gain_spread'] or 0:.2f} ({r['tune_recommended']})",
            )
    return card.exit_code()


if __name__ == "__main__":
    sys.exit(main())
