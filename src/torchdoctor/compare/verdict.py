"""Two runs side by side: the verdict, the phases, the differences and what explains them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from torchdoctor.compare.runs import COMPUTE, DATA_WAIT, PHASE_LABELS, STEP, RunFigures
from torchdoctor.compare.stats import (
    CONFIDENCE,
    Interval,
    PairedSeries,
    bootstrap,
    runs_step_ratio,
    typical_step,
    welch_interval,
)
from torchdoctor.errors import UserError
from torchdoctor.thresholds import Thresholds

# The names of the runs of a comparison: A is the baseline, B, C... are compared with it.
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

FASTER = "faster"
SLOWER = "slower"
NO_CHANGE = "no significant change"

# The practical band: a verdict of faster or slower needs the whole interval beyond 1 -+ 3 %.
# The interval measures the noise *within* the two runs, but two runs of the same command on a
# shared machine also differ *between* them (the machine's load, where the job's threads land,
# caches), by a few percent with tight intervals each (measured: 20 ms data-bound steps on a
# loaded 2-CPU box, same command four times, medians within 1 %, intervals out to +8 %). So
# "no significant change" is an interval that holds 1, lies within the band, or reaches into it:
# a change is called only when it is beyond the band with 95 % confidence (a minimum-effect
# test). It still detects a 5 % change once the interval is narrower than +-2 %.
NO_CHANGE_BAND = 0.03
# With several runs a side the interval holds the noise between runs too (stats: Welch's t over
# the runs' figures), so the band need not stand in for it: it only keeps a change smaller than
# 1 % from being called, which no one acts on and which a CI gate should not fail on.
RUNS_BAND = 0.01
# How a comparison's interval was made: from blocks of steps of one run a side, or from several
# runs a side (each run one observation).
BY_BLOCKS = "blocks of steps, one run a side"
BY_RUNS = "runs, several a side"
# One run a side cannot see the spread between runs of the same command; a change called
# from one run a side and smaller than this is said to want several runs a side. Measured
# (compare_power, 12 runs of the demo on a shared 2-vCPU VM): equal runs spread by 3.6 %
# (s.d.), so two of them differ by 10 % about once in 20, and 4 equal pairs in 11 were
# called different; with 5 runs a side 4 draws in 200.
ONE_RUN_CAUTION = 0.10
# A run needs this many steady steps (5 blocks of 4) for its figure and interval to mean something.
MIN_STEADY_STEPS = 20
# Other programs used this many more CPUs on average during B than during A: "busier".
BUSIER_MARGIN_CPUS = 0.5
# A run is "contended" when the CPUs it was allowed were saturated (busy at least the
# cpu-contention rule's alert level on average) and other programs, not the job, held at least
# this many of them. The verdict still stands (a job that waits on sleeps or I/O measures the
# same on such a machine), but a compute-bound step's figure moves with the neighbours far
# beyond one run's interval (compare_power on a 2-CPU VM whose other programs used 1.2-1.4
# CPUs: equal runs at 0.66x and 1.47x), so compare says so first among the reasons.
CONTENDED_OTHER_CPUS = 0.5
# Where the recording has it, the job's own measure decides instead of the host's: its model
# processes' main threads waited on a run queue for a CPU at least this share of the run
# (/proc/<pid>/schedstat), while other programs held CONTENDED_OTHER_CPUS. A job that sleeps
# (waits for data, I/O) on a saturated machine waits little there and is not contended; one
# whose own threads outnumber the CPUs waits, but not because of other programs.
CONTENDED_WAIT_SHARE = 0.10

# Which recorded differences can move which phase. A difference "explains" a phase when its
# key starts with one of these.
_DATA_KEYS = ("dataloader", "torch.num_threads", "torch.num_interop_threads")
_DATA_ENV = ("logical CPUs", "allowed CPUs", "cgroup CPU quota", "env OMP_NUM_THREADS")
_COMPUTE_KEYS = (
    "torch.",
    "amp.",
    "matmul.",
    "cudnn.",
    "params.",
    "optimizer.",
    "distributed.",
    "dataloader.batch_size",
    "dataloader[",
)
_COMPUTE_ENV = ("torch", "logical CPUs", "allowed CPUs", "cgroup CPU quota", "GPUs", "env ")
_EXPLAINS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    DATA_WAIT: (_DATA_KEYS, _DATA_ENV),
    COMPUTE: (_COMPUTE_KEYS, _COMPUTE_ENV),
    "forward": (_COMPUTE_KEYS, _COMPUTE_ENV),
    "backward": (_COMPUTE_KEYS, _COMPUTE_ENV),
    "optimizer": (("optimizer.", "torch.", "params."), ("torch",)),
}


@dataclass(slots=True)
class Difference:
    key: str
    a: Any
    b: Any


@dataclass(slots=True)
class PhaseChange:
    phase: str
    label: str
    a_per_step_s: float
    b_per_step_s: float
    delta: Interval  # B - A, seconds, with its interval
    moved: bool  # the interval excludes 0 and the change is beyond the band of A's step


@dataclass(slots=True)
class Comparison:
    a: str
    b: str
    verdict: str  # FASTER, SLOWER or NO_CHANGE
    ratio: Interval  # B's step time / A's (each stats.typical_step), with its interval
    confidence: float
    band: float
    a_steps: int  # steady steps compared
    b_steps: int
    a_step_count: int
    b_step_count: int
    warmup_rule: str
    phases: list[PhaseChange]
    settings: list[Difference]
    environment: list[Difference]
    command: Difference | None
    explanations: list[str]
    a_peak_rss: int | None
    b_peak_rss: int | None
    a_peak_pss: int | None
    b_peak_pss: int | None
    a_peak_vram: int | None
    b_peak_vram: int | None
    a_other_cpus: float | None
    b_other_cpus: float | None
    busier: bool
    contended: list[str]  # the runs ("A", "B") whose CPUs other programs saturated
    findings_appeared: list[str]
    findings_disappeared: list[str]
    mismatch: list[str] = field(default_factory=list)  # why not the same workload (--force)
    notes: list[str] = field(default_factory=list)
    # Every run of each side; ``a`` and ``b`` are the first. One each unless several runs a
    # side were compared (``method`` BY_RUNS).
    a_runs: list[str] = field(default_factory=list)
    b_runs: list[str] = field(default_factory=list)
    method: str = BY_BLOCKS

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = _interval_dict(self.ratio)
        for p, phase in zip(d["phases"], self.phases, strict=True):
            p["delta"] = _interval_dict(phase.delta)
        return d

    @property
    def slowdown(self) -> Interval:
        """B's step time over A's, less one: 0.10 is 10 % slower."""
        return Interval(self.ratio.estimate - 1, self.ratio.low - 1, self.ratio.high - 1)


def _interval_dict(iv: Interval) -> dict[str, float | None]:
    return {k: (v if math.isfinite(v) else None) for k, v in asdict(iv).items()}


def workload_mismatch(a: RunFigures, b: RunFigures) -> list[str]:
    """Why A and B are not the same workload, one reason each; empty when they are."""
    why = []
    if a.workload != b.workload:
        why.append(
            f"A runs {a.workload or ' '.join(a.command)!r}, B {b.workload or ' '.join(b.command)!r}"
        )
    if a.batch_size is not None and b.batch_size is not None and a.batch_size != b.batch_size:
        why.append(f"batch size {a.batch_size} vs {b.batch_size}")
    if (
        a.params_count is not None
        and b.params_count is not None
        and a.params_count != b.params_count
    ):
        why.append(f"model parameters {a.params_count} vs {b.params_count}")
    return why


def is_contended(run: RunFigures) -> bool:
    """Other programs took the CPUs ``run`` needed: its model processes waited for a CPU
    (CONTENDED_WAIT_SHARE) where that was measured, else the CPUs it was allowed were
    saturated; and other programs held CONTENDED_OTHER_CPUS of them either way."""
    if run.other_cpus is None or run.other_cpus < CONTENDED_OTHER_CPUS:
        return False
    if run.run_queue_wait is not None:
        return run.run_queue_wait >= CONTENDED_WAIT_SHARE
    return (
        run.host_cpu_busy_pct is not None
        and run.host_cpu_busy_pct >= Thresholds().cpu_load_alert_pct
    )


def _contended_line(name: str, run: RunFigures) -> str:
    """Why ``run`` (named ``name``) counts as contended, in one line."""
    if run.run_queue_wait is not None:
        return (
            f"during {name} the job waited for a CPU {run.run_queue_wait * 100:.0f} % of its "
            f"time while other programs used {run.other_cpus:.1f} CPUs: a step that computes "
            "moves with them"
        )
    return (
        f"during {name} the CPUs were {run.host_cpu_busy_pct:.0f} % busy and other programs "
        f"used {run.other_cpus:.1f} of them: a step that computes moves with them"
    )


def verdict_of(ratio: Interval, band: float = NO_CHANGE_BAND) -> str:
    """faster / slower / no significant change from the ratio B / A and its interval: slower
    when the whole interval lies above 1 + band, faster when it lies below 1 - band, else no
    significant change (an interval that holds 1 or lies within the band is always that)."""
    if not (math.isfinite(ratio.low) and math.isfinite(ratio.high)):
        return NO_CHANGE
    if ratio.low > 1 + band:
        return SLOWER
    if ratio.high < 1 - band:
        return FASTER
    return NO_CHANGE


def _diff(a: dict[str, Any], b: dict[str, Any]) -> list[Difference]:
    return [
        Difference(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
    ]


def compare(
    a: RunFigures,
    b: RunFigures,
    findings_a: list[str] | None = None,
    findings_b: list[str] | None = None,
    *,
    force: bool = False,
    band: float = NO_CHANGE_BAND,
) -> Comparison:
    """Compare run B with run A (the baseline). Raises UserError, one line, when the two are
    not the same workload (unless ``force``) or one has too few steady steps."""
    return compare_runs([a], [b], [findings_a or []], [findings_b or []], force=force, band=band)


def compare_runs(
    a: list[RunFigures],
    b: list[RunFigures],
    findings_a: list[list[str]] | None = None,
    findings_b: list[list[str]] | None = None,
    *,
    force: bool = False,
    band: float | None = None,
) -> Comparison:
    """Compare side B with side A (the baseline), each one run or several runs of the same
    command. One run a side: the block bootstrap of :mod:`.stats` and the band NO_CHANGE_BAND.
    Several a side (at least 2 each): each run is one observation (Welch's t interval over the
    runs' figures) and the band RUNS_BAND. ``findings_a[i]`` are the finding ids of ``a[i]``;
    a finding belongs to a side when any of its runs has it.

    Raises UserError, one line, when the runs are not all the same workload (unless
    ``force``), one has too few steady steps, or a side of several has only one run."""
    if not a or not b:
        raise ValueError("each side needs a run")
    by_runs = len(a) > 1 or len(b) > 1
    if by_runs and min(len(a), len(b)) < 2:
        raise UserError(
            f"{len(a)} run(s) against {len(b)}: with several runs a side each side needs at "
            "least 2 (the spread between a side's runs is what the interval is made of)"
        )
    band = band if band is not None else (RUNS_BAND if by_runs else NO_CHANGE_BAND)
    names_a = run_names("A", len(a))
    names_b = run_names("B", len(b))
    mismatch: list[str] = []
    for name, run in zip(names_a[1:] + names_b, a[1:] + b, strict=True):
        why = workload_mismatch(a[0], run)
        if by_runs:
            why = [f"{name}: {w}" for w in why]
        mismatch += why
    if mismatch and not force:
        raise UserError(
            "not the same workload: " + "; ".join(mismatch) + " (--force compares them anyway)"
        )
    for name, run in zip(names_a + names_b, a + b, strict=True):
        if run.steady_steps < MIN_STEADY_STEPS:
            raise UserError(
                f"{name} ({run.path}) has {run.steady_steps} steady steps of {run.step_count} "
                f"recorded; a comparison needs at least {MIN_STEADY_STEPS}: record a longer run"
            )
    phases = [p for p in a[0].series if all(p in run.series for run in a + b)]
    if by_runs:
        per_run_a = {p: [typical_step(run.series[p]) for run in a] for p in phases}
        per_run_b = {p: [typical_step(run.series[p]) for run in b] for p in phases}
        ratio = runs_step_ratio(per_run_a[STEP], per_run_b[STEP])
        deltas = {p: welch_interval(per_run_a[p], per_run_b[p]) for p in phases}
        a_figure = {p: sum(v) / len(v) for p, v in per_run_a.items()}
    else:
        ratio, deltas = bootstrap(
            PairedSeries({p: a[0].series[p] for p in phases}, {p: b[0].series[p] for p in phases}),
            STEP,
        )
        a_figure = {p: typical_step(a[0].series[p]) for p in phases}
    # A phase "moved" when its whole interval lies beyond the band as a share of A's step (the
    # verdict's rule), not of the phase itself: a data wait from 0.1 ms to 0.2 ms doubles and
    # matters to no one.
    margin = band * a_figure[STEP]
    changes = [
        PhaseChange(
            phase=p,
            label=PHASE_LABELS.get(p, p),
            a_per_step_s=a_figure[p],
            b_per_step_s=a_figure[p] + deltas[p].estimate,
            delta=deltas[p],
            moved=deltas[p].low > margin or deltas[p].high < -margin,
        )
        for p in phases
    ]
    notes = [
        f"{name}: {n}"
        for name, run in zip(names_a + names_b, a + b, strict=True)
        for n in run.notes
    ]
    for side, runs in (("A", a), ("B", b)):
        inside = sorted({d.key for run in runs[1:] for d in _diff(runs[0].settings, run.settings)})
        if inside:
            notes.append(f"{side}'s runs differ among themselves in {', '.join(inside)}")
    first_a, first_b = a[0], b[0]
    # A run without settings (recorded with --no-instrument, or a damaged file that lost the
    # table) would show every setting of the other as changed: not compared, and said so.
    unset = [name for name, run in zip(names_a + names_b, a + b, strict=True) if not run.settings]
    settings = _diff(first_a.settings, first_b.settings) if not unset else []
    if unset:
        notes.append(f"{' and '.join(unset)} holds no captured settings: settings not compared")
    environment = _diff(first_a.environment, first_b.environment)
    command = (
        Difference("command", first_a.command, first_b.command)
        if first_a.command != first_b.command
        else None
    )
    other_a, other_b = _mean_of(a, "other_cpus"), _mean_of(b, "other_cpus")
    busier = other_a is not None and other_b is not None and other_b - other_a > BUSIER_MARGIN_CPUS
    contended = [
        (name, run) for name, run in zip(names_a + names_b, a + b, strict=True) if is_contended(run)
    ]
    verdict = verdict_of(ratio, band)
    if (
        not by_runs
        and verdict != NO_CHANGE
        and abs(math.log(ratio.estimate)) < math.log1p(ONE_RUN_CAUTION)
    ):
        notes.append(
            "one run a side: runs of the same command also differ between them (3.6 % s.d. "
            "on a shared 2-vCPU VM), which this interval cannot show; before acting on a "
            f"change under {ONE_RUN_CAUTION * 100:g} %, record 3-5 runs a side and compare "
            "them as A1 A2 A3 vs B1 B2 B3"
        )
    fa = {f for found in findings_a or [] for f in found}
    fb = {f for found in findings_b or [] for f in found}
    return Comparison(
        a=first_a.path,
        b=first_b.path,
        verdict=verdict,
        ratio=ratio,
        confidence=CONFIDENCE,
        band=band,
        a_steps=sum(run.steady_steps for run in a),
        b_steps=sum(run.steady_steps for run in b),
        a_step_count=sum(run.step_count for run in a),
        b_step_count=sum(run.step_count for run in b),
        warmup_rule=first_a.warmup_rule,
        phases=changes,
        settings=settings,
        environment=environment,
        command=command,
        explanations=[_contended_line(name, run) for name, run in contended]
        + _explain(verdict, changes, settings, environment, other_a, other_b, busier),
        a_peak_rss=_max_of(a, "peak_rss"),
        b_peak_rss=_max_of(b, "peak_rss"),
        a_peak_pss=_max_of(a, "peak_pss"),
        b_peak_pss=_max_of(b, "peak_pss"),
        a_peak_vram=_max_of(a, "peak_vram"),
        b_peak_vram=_max_of(b, "peak_vram"),
        a_other_cpus=other_a,
        b_other_cpus=other_b,
        busier=busier,
        contended=[name for name, _ in contended],
        findings_appeared=sorted(fb - fa),
        findings_disappeared=sorted(fa - fb),
        mismatch=mismatch,
        notes=notes,
        a_runs=[run.path for run in a],
        b_runs=[run.path for run in b],
        method=BY_RUNS if by_runs else BY_BLOCKS,
    )


def run_names(side: str, n: int) -> list[str]:
    """A side's runs as the lines name them: "A" for one run, "A1", "A2"... for several."""
    return [side] if n == 1 else [f"{side}{i}" for i in range(1, n + 1)]


def _mean_of(runs: list[RunFigures], name: str) -> float | None:
    """The mean of a figure over a side's runs; None unless every run has it."""
    values = [getattr(run, name) for run in runs]
    return None if any(v is None for v in values) else sum(values) / len(values)


def _max_of(runs: list[RunFigures], name: str) -> int | None:
    """A side's peak: the highest of its runs' (memory peaks: the worst run decides)."""
    values = [v for v in (getattr(run, name) for run in runs) if v is not None]
    return max(values) if values else None


def _explain(
    verdict: str,
    phases: list[PhaseChange],
    settings: list[Difference],
    environment: list[Difference],
    a_other_cpus: float | None,
    b_other_cpus: float | None,
    busier: bool,
) -> list[str]:
    """One line per phase that moved: which recorded difference can explain it, or that the
    machine was busier, or that nothing recorded does."""
    lines = []
    moved = [p for p in phases if p.moved and p.phase != STEP]
    moved.sort(key=lambda p: -abs(p.delta.estimate))
    busy_line = (
        f"the machine was busier: other programs used {b_other_cpus:.1f} CPUs on average "
        f"during B vs {a_other_cpus:.1f} during A"
        if busier and a_other_cpus is not None and b_other_cpus is not None
        else None
    )
    for p in moved:
        keys, env_keys = _EXPLAINS.get(p.phase, ((), ()))
        causes = [d for d in settings if d.key.startswith(keys)]
        causes += [d for d in environment if d.key.startswith(env_keys)]
        direction = "rose" if p.delta.estimate > 0 else "fell"
        what = f"{p.label} {direction} by {abs(p.delta.estimate) * 1e3:.3g} ms a step"
        if causes:
            named = ", ".join(f"{d.key} {_show(d.a)} -> {_show(d.b)}" for d in causes)
            lines.append(f"{what}: {named} changed")
        elif busy_line:
            lines.append(f"{what}: no setting changed, but {busy_line}")
        else:
            lines.append(f"{what}: no recorded setting or environment difference explains it")
    if busy_line and not any(busy_line in line for line in lines):
        lines.append(busy_line[0].upper() + busy_line[1:])
    if verdict != NO_CHANGE and not moved:
        lines.append("no single phase moved beyond its interval; the change is spread over them")
    return lines


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def headline(c: Comparison, a: str = "A", b: str = "B") -> str:
    """The verdict in one line, as `torchdoctor compare` and the report print it; ``a`` and
    ``b`` name the two runs (C, D... when more than two are compared with A)."""
    r = c.ratio
    if not math.isfinite(r.estimate):
        return f"{c.verdict}: {a}'s step time is zero"
    if c.method == BY_RUNS:
        a = f"{a} ({len(c.a_runs)} runs)"
        b = f"{b} ({len(c.b_runs)} runs)"
    ratio = f"{b}'s step takes {r.estimate:.3f}x {a}'s (95 % interval {r.low:.3f} to {r.high:.3f})"
    if c.verdict == FASTER:
        return f"faster: {ratio}, {1 / r.estimate:.2f}x the speed"
    if c.verdict == SLOWER:
        return f"slower: {ratio}, {(r.estimate - 1) * 100:.1f} % slower"
    return (
        f"no significant change: {ratio}; a change is called when the whole interval lies "
        f"beyond 1 -+ {c.band * 100:g} %"
    )
