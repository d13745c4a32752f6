"""How small a slowdown does `torchdoctor compare` detect, and how often does it call equal runs
different? The demo (examples/train.py: data-bound, num_workers=0, one torch thread by default
here, --job-args) is recorded in
runs of about --seconds each, as a baseline A and as copies B slowed by a known share of A's
step (a sleep inside every optimizer step, benchmarks/compare_power_job.py; share 0 is an equal
run), and each B is compared with its round's A by compare's own code (verdict, ratio and
interval).

    python benchmarks/compare_power.py                        # 2 rounds of 30 s runs (~6 min)
    python benchmarks/compare_power.py --rounds 20 --levels 0,0.025,0.05,0.1

Figures: per slowdown, the share of pairs compare called slower (its power) and the median of
the measured ratios; on the equal pairs, the share called slower or faster (false positives).
Targets (issue 43): a 5 % slowdown detected in >= 95 % of pairs, false positives <= 5 %. A
round runs A and the copies one after the other, in the opposite order each round (A B0 B5
B10, then B10 B5 B0 A), so that a drift in the machine's load falls alike on each. With the
default 2 rounds a rate is 0/2, 1/2 or 2/2: enough to see a detector that misses, not to
measure 95 %; the issue's figure wants 20 rounds or more (about an hour on 2 CPUs).

Why one torch thread: on a shared 2-CPU machine the demo's default two intra-op threads wait
for each other behind other programs' processes; at load 10 its steps took 6 to 31 s instead
of ~0.15 s, and a 30 s run held too few steps to compare. One thread keeps the step a step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scorecard import Scorecard
from torchdoctor.compare.runs import STEP, RunFigures, run_figures
from torchdoctor.compare.stats import typical_step
from torchdoctor.compare.verdict import FASTER, NO_CHANGE, SLOWER, compare
from torchdoctor.recording.reader import open_recording

HERE = Path(__file__).resolve().parent
JOB = HERE / "compare_power_job.py"
DETECT_LEVEL = 0.05  # the target: a 5 % slowdown ...
DETECT_RATE = 0.95  # ... detected in this share of pairs
FALSE_RATE = 0.05  # equal runs called different in at most this share
CALIBRATION_STEPS = 30
MIN_STEPS = 40  # a run holds at least this many steps (compare needs 20 steady ones)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def record(out: Path, steps: int, delay_s: float, job_args: list[str]) -> RunFigures:
    """One run of the demo under `torchdoctor run`, with ``delay_s`` added to every step."""
    env = {**os.environ, "COMPARE_POWER_DELAY_S": f"{delay_s:.6f}"}
    cmd = [sys.executable, "-m", "torchdoctor", "run", "--quiet", "--interval", "0.25"]
    cmd += ["--out", str(out), "--", sys.executable, str(JOB), "--steps", str(steps), *job_args]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open_recording(out) as rec:
        return run_figures(rec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="pairs per slowdown (default 2)")
    p.add_argument("--seconds", type=float, default=30.0, help="length of a run (default 30)")
    p.add_argument(
        "--levels",
        default="0,0.05,0.1",
        help="slowdowns as shares of the step, 0 for equal runs (default 0,0.05,0.1)",
    )
    p.add_argument(
        "--job-args",
        default="--threads 1",
        help="the demo's options for every run (default --threads 1, see above)",
    )
    opts = p.parse_args()
    job_args = opts.job_args.split()
    levels = sorted({float(x) for x in opts.levels.split(",")})
    card = Scorecard("compare_power")
    with tempfile.TemporaryDirectory(prefix="td-power-") as tmp:
        folder = Path(tmp)
        calibration = record(folder / "calibration.sqlite", CALIBRATION_STEPS, 0.0, job_args)
        step_s = typical_step(calibration.series[STEP])
        steps = max(MIN_STEPS, round(opts.seconds / step_s))
        log(f"demo step {step_s * 1e3:.1f} ms: {steps} steps a run (~{opts.seconds:.0f} s)")
        verdicts: dict[float, list[str]] = {level: [] for level in levels}
        ratios: dict[float, list[float]] = {level: [] for level in levels}
        # per pair: neither run on CPUs saturated by other programs (compare's `contended`)
        quiet: dict[float, list[bool]] = {level: [] for level in levels}
        for r in range(opts.rounds):
            order = [None, *levels] if r % 2 == 0 else [*levels[::-1], None]
            runs: dict[float | None, RunFigures] = {}
            for level in order:
                delay = 0.0 if level is None else level * step_s
                name = "A" if level is None else f"B{level * 100:g}"
                log(f"round {r + 1}/{opts.rounds}: {name} (delay {delay * 1e3:.2f} ms a step)")
                runs[level] = record(folder / f"r{r}-{name}.sqlite", steps, delay, job_args)
            for level in levels:
                c = compare(runs[None], runs[level])
                verdicts[level].append(c.verdict)
                ratios[level].append(c.ratio.estimate)
                quiet[level].append(not c.contended)
                # Other programs' CPU use in each run (host samples): a verdict that a busier
                # machine explains reads differently from one the runs themselves make.
                busy = (
                    f", other programs {c.a_other_cpus:.1f} -> {c.b_other_cpus:.1f} CPUs"
                    if c.a_other_cpus is not None and c.b_other_cpus is not None
                    else ""
                )
                log(
                    f"  +{level * 100:g} %: {c.verdict}, ratio {c.ratio.estimate:.3f} "
                    f"[{c.ratio.low:.3f}-{c.ratio.high:.3f}]{busy}"
                )
    n = opts.rounds
    # The targets are read on the quiet pairs: those in which neither run had its CPUs
    # saturated by other programs (compare names such runs first among its reasons; on them
    # a compute-bound step moves with the neighbours, see compare.verdict.CONTENDED_OTHER_CPUS).
    # All pairs are shown beside them.
    print(
        f"{'slowdown':>9} {'quiet pairs: slower':>20} {'faster':>7} {'no change':>10} "
        f"{'all pairs: slower':>18} {'faster':>7} {'ratio':>7}"
    )
    kept: dict[float, list[str]] = {}
    for level in levels:
        v = verdicts[level]
        kept[level] = [x for x, q in zip(v, quiet[level], strict=True) if q]
        k = kept[level]
        print(
            f"{level * 100:>8g}% {k.count(SLOWER):>16}/{len(k):<3} {k.count(FASTER):>7} "
            f"{k.count(NO_CHANGE):>10} {v.count(SLOWER):>14}/{n:<3} {v.count(FASTER):>7} "
            f"{statistics.median(ratios[level]):>7.3f}"
        )
    busy = sum(q.count(False) for q in quiet.values())
    card.info(
        "pairs with a run on CPUs saturated by other programs",
        f"{busy}/{n * len(levels)} (left out of the two targets)",
    )
    if 0.0 in verdicts:
        k = kept[0.0]
        wrong = sum(1 for v in k if v != NO_CHANGE)
        every = sum(1 for v in verdicts[0.0] if v != NO_CHANGE)
        card.check(
            "false positives on equal runs",
            wrong / len(k) if k else float("nan"),
            f"{wrong}/{len(k)} quiet pairs called slower or faster (all pairs: {every}/{n})",
            at_most=FALSE_RATE,
            target=f"<= {FALSE_RATE * 100:g} %",
        )
    if DETECT_LEVEL in verdicts:
        k = kept[DETECT_LEVEL]
        hit = k.count(SLOWER)
        card.check(
            f"{DETECT_LEVEL * 100:g} % slowdown detected",
            hit / len(k) if k else float("nan"),
            f"{hit}/{len(k)} quiet pairs called slower (all pairs: "
            f"{verdicts[DETECT_LEVEL].count(SLOWER)}/{n}; median ratio "
            f"{statistics.median(ratios[DETECT_LEVEL]):.3f})",
            at_least=DETECT_RATE,
            target=f">= {DETECT_RATE * 100:g} % of pairs",
        )
    detected = [
        level
        for level in levels
        if level > 0 and kept[level] and kept[level].count(SLOWER) >= DETECT_RATE * len(kept[level])
    ]
    card.info(
        "smallest slowdown detected in >= 95 % of pairs",
        (f"{min(detected) * 100:g} %" if detected else "none of " + opts.levels)
        + f" ({n} pairs each, {opts.seconds:g} s runs, over the quiet pairs)",
    )
    print(
        f"{n} pairs per slowdown, runs of ~{opts.seconds:g} s ({steps} steps of the demo "
        f"{opts.job_args}, {step_s * 1e3:.1f} ms); load average at the end: "
        + " ".join(f"{x:.1f}" for x in os.getloadavg())
    )
    return card.exit_code()


if __name__ == "__main__":
    sys.exit(main())
