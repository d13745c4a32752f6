"""Scaling efficiency of the user's own script: short trials at 1, 2, 4... ranks.

Each trial is ``torchdoctor launch`` of the script on this node with N ranks, recorded, and
stopped by the agent after ``warm-up + K`` optimizer steps on every rank (tune's stop rule:
``TORCHDOCTOR_STOP_AFTER_STEPS``). Throughput is the samples per second of all ranks over
their measured steps; E(N) = throughput(N) / (N x throughput(1)). Where the loss goes is read
from each rank's step figures against the 1-rank trial: exposed communication (DDP's own
figures), data wait, straggling (the slowest rank's own work beyond the others'), and the
rank's own compute (forward, backward, optimizer), which grows when N ranks share the cores.
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from torchdoctor.errors import UserError

KEEP_CHOICES = ("per-rank-batch", "global-batch")
BATCH_PLACEHOLDER = "{per_rank_batch}"
STOP_GRACE_S = 3.0  # from TERM to KILL for a trial past its time limit
WORTH_EFFICIENCY = 0.7  # below this, N ranks give less than 70 % of N times one rank


@dataclass
class Trial:
    nproc: int
    recording: str
    exit_status: int | None
    samples_per_s: float | None = None
    steps_per_s: float | None = None  # per rank
    step_s: float | None = None
    data_wait_s: float | None = None
    exposed_comm_s: float | None = None
    compute_s: float | None = None  # forward + backward compute + optimizer, slowest rank
    straggle_s: float | None = None
    cores_per_rank: float | None = None
    per_rank_batch: int | None = None
    others_cpu: float | None = None  # % of the usable CPUs other processes took meanwhile
    measured_steps: int = 0
    error: str | None = None
    efficiency: float | None = None


@dataclass
class ScalingResult:
    keep: str
    trials: list[Trial] = field(default_factory=list)
    explanation: list[str] = field(default_factory=list)
    recommendation: str = ""


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(
            f"--nproc {text!r}: give rank counts separated by commas, e.g. 1,2,4"
        ) from None
    if not sizes or sizes[0] < 1:
        raise UserError(f"--nproc {text!r}: rank counts start at 1")
    if sizes[0] != 1:
        sizes.insert(0, 1)  # E(N) is relative to one rank
    return sizes


def trial_args(script: list[str], keep: str, global_batch: int | None, nproc: int) -> list[str]:
    """The script's arguments for N ranks: ``{per_rank_batch}`` becomes global_batch / N."""
    if keep == "per-rank-batch":
        if any(BATCH_PLACEHOLDER in a for a in script):
            raise UserError(
                f"{BATCH_PLACEHOLDER} in the script's arguments needs --keep global-batch "
                "--global-batch B"
            )
        return list(script)
    if global_batch is None or not any(BATCH_PLACEHOLDER in a for a in script):
        raise UserError(
            "--keep global-batch needs --global-batch B and the script's batch-size argument "
            f"written as {BATCH_PLACEHOLDER} (e.g. -- train.py --batch {BATCH_PLACEHOLDER}): "
            "each trial gets B / N"
        )
    if global_batch % nproc:
        raise UserError(f"--global-batch {global_batch} does not split evenly over {nproc} ranks")
    per_rank = str(global_batch // nproc)
    return [a.replace(BATCH_PLACEHOLDER, per_rank) for a in script]


def run_trial(
    script: list[str],
    nproc: int,
    steps: int,
    folder: Path,
    *,
    warmup: int = 3,
    limit_s: float = 600.0,
    interval: float = 0.5,
    python: str = sys.executable,
    baseline: Trial | None = None,
) -> Trial:
    """One recorded trial of ``script`` at ``nproc`` ranks, stopped after warm-up + steps.
    ``baseline`` (the 1-rank trial, measured) goes into the recording's meta, so that
    `diagnose` of this trial alone can say whether N ranks gained (rule scaling-no-gain)."""
    from torchdoctor.instrument.agent import ENV_STOP_AFTER_STEPS
    from torchdoctor.launch.plan import LaunchOptions, plan_launch
    from torchdoctor.run.process import ProcessTree, TreeStopper, resolve_command
    from torchdoctor.run.session import record_command

    path = folder / f"scaling-{nproc}.sqlite"
    fr_dir = folder / f"scaling-{nproc}.fr"
    fr_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != ENV_STOP_AFTER_STEPS}
    plan = plan_launch(
        LaunchOptions(nproc_per_node=str(nproc)),
        script,
        env=env,
        fr_dir=fr_dir,
        gpu_count=0,
        python=python,
    )
    plan.env[ENV_STOP_AFTER_STEPS] = str(warmup + steps)
    limit: list[TreeStopper] = []

    def on_started(pid: int) -> None:
        limit.append(TreeStopper(ProcessTree(pid), STOP_GRACE_S))
        limit[0].start(delay_s=limit_s)  # a trial that outlives its time limit is stopped

    try:
        status = record_command(
            resolve_command(list(plan.argv)),
            plan.argv,
            path,
            interval,
            instrument=True,
            env=plan.env,
            mode="bench-scaling",
            log=folder / f"scaling-{nproc}.log",
            new_group=True,
            on_started=on_started,
            meta={
                "bench_scaling": {
                    "nproc": nproc,
                    "steps": steps,
                    "warmup": warmup,
                    "baseline": _baseline_meta(baseline),
                }
            },
        )
    finally:
        if limit:
            limit[0].cancel()
    trial = Trial(nproc=nproc, recording=str(path), exit_status=status)
    measure_trial(trial, warmup)
    if not any(fr_dir.iterdir()):
        fr_dir.rmdir()
    return trial


def _baseline_meta(base: Trial | None) -> dict | None:
    if base is None or not base.samples_per_s:
        return None
    return {"nproc": base.nproc, "samples_per_s": base.samples_per_s, "step_s": base.step_s,
            "per_rank_batch": base.per_rank_batch, "cores_per_rank": base.cores_per_rank,
            "recording": base.recording}  # fmt: skip


def measure_trial(trial: Trial, warmup: int) -> None:
    """Fill the trial's figures from its recording."""
    from torchdoctor.diagnosis.context import DiagnosisContext
    from torchdoctor.diagnosis.rules.communication_bound import exposed_communication
    from torchdoctor.diagnosis.rules.rank_straggler import own_parts
    from torchdoctor.recording import open_recording
    from torchdoctor.thresholds import Thresholds

    with open_recording(trial.recording) as rec:
        ctx = DiagnosisContext(rec, Thresholds())
        ranks = list(ctx.job.ranks.values())
        if not ranks:
            # one rank without a process group: the trainer's steps
            ranks = []
        trial.cores_per_rank = round(ctx.usable_cpus / trial.nproc, 2)
        busy = [v for _, v in ctx.host_series("cpu_busy")]
        job = [v for _, v in ctx.job_cpu_series]
        if busy and job:
            trial.others_cpu = round(max(statistics.mean(busy) - statistics.mean(job), 0.0), 1)
        rate = 0.0
        step_times, waits, computes, owns = [], [], [], []
        by_pid: dict[int, list[dict]] = {}
        for s in ctx.steps:
            by_pid.setdefault(s["pid"], []).append(s)
        measured = []
        for rows in by_pid.values():
            rows.sort(key=lambda r: r["step"])
            window = rows[warmup:]
            if len(window) < 2:
                continue
            measured.append(len(window))
            span = window[-1]["t_end"] - window[0]["t_start"]
            samples = [r["samples"] or r["batch_size"] or 0 for r in window]
            if span > 0 and all(samples):
                rate += sum(samples) / span
            step_times.append(statistics.median(r["wall_s"] for r in window))
            waits.append(statistics.median(r["data_wait_s"] or 0.0 for r in window))
            trial.per_rank_batch = trial.per_rank_batch or window[-1]["batch_size"]
        if len(measured) < trial.nproc:
            trial.error = f"{len(measured)} of {trial.nproc} ranks stepped ({_tail(trial)})"
            return
        trial.measured_steps = min(measured)
        trial.samples_per_s = rate or None
        trial.step_s = max(step_times)
        trial.steps_per_s = 1 / trial.step_s if trial.step_s else None
        trial.data_wait_s = max(waits)
        for r in ranks:
            parts = own_parts(r)
            own = sum(parts.values())
            owns.append(own)
            computes.append(
                sum(parts.get(k, 0.0) for k in ("forward_s", "backward_compute_s", "optimizer_s"))
            )
        if computes and any(computes):
            trial.compute_s = max(computes)
        exposed = exposed_communication(ranks)
        if exposed is not None:
            trial.exposed_comm_s = exposed.exposed_s
        if len(owns) >= 2:
            trial.straggle_s = max(owns) - statistics.median(owns)


def _tail(trial: Trial) -> str:
    log = Path(trial.recording).with_suffix(".log")
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"exit status {trial.exit_status}"
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or [f"exit status {trial.exit_status}"])[-1][:200]


def analyse(result: ScalingResult) -> None:
    """E(N) per trial, where the loss goes against one rank, and the recommendation."""
    base = next((t for t in result.trials if t.nproc == 1 and t.samples_per_s), None)
    if base is None:
        result.recommendation = "The 1-rank trial did not measure: no efficiency to compute."
        return
    for t in result.trials:
        if t.samples_per_s:
            t.efficiency = t.samples_per_s / (t.nproc * base.samples_per_s)
    best = base
    for t in result.trials:
        if t.nproc == 1 or t.efficiency is None:
            continue
        result.explanation.append(_explain(t, base, result.keep))
        if t.efficiency >= WORTH_EFFICIENCY and t.samples_per_s > best.samples_per_s:
            best = t
    failed = [t for t in result.trials if t.error]
    for t in failed:
        result.explanation.append(f"{t.nproc} ranks: not measured: {t.error}")
    measured = [t for t in result.trials if t.efficiency is not None and t.nproc > 1]
    if best.nproc > 1 and best.efficiency > 1.05:
        result.recommendation = (
            f"{best.nproc} ranks measured faster than {best.nproc}x one rank (E = "
            f"{best.efficiency:.2f}): the 1-rank trial was disturbed; measure again before "
            "deciding."
        )
    elif best.nproc > 1:
        result.recommendation = (
            f"Run {best.nproc} ranks: {best.samples_per_s:.0f} samples/s, "
            f"E({best.nproc}) = {best.efficiency:.2f}."
        )
    elif measured:
        worst = min(measured, key=lambda t: t.efficiency)
        result.recommendation = (
            f"Stay at 1 rank on this node: {worst.nproc} ranks give E({worst.nproc}) = "
            f"{worst.efficiency:.2f} ({worst.samples_per_s / base.samples_per_s:.2f}x one rank's "
            f"throughput). Fix first: {_main_loss(worst, base)}."
        )


def _losses(t: Trial, base: Trial) -> dict[str, float]:
    """Seconds per step each cause adds at N ranks over one rank (slowest rank)."""
    out = {}
    if t.exposed_comm_s is not None:
        out["exposed communication"] = t.exposed_comm_s
    if t.data_wait_s is not None and base.data_wait_s is not None:
        out["data wait"] = max(t.data_wait_s - base.data_wait_s, 0.0)
    if t.straggle_s is not None:
        out["straggling"] = t.straggle_s
    if t.compute_s is not None and base.compute_s is not None:
        scale = 1.0
        if t.per_rank_batch and base.per_rank_batch:
            scale = t.per_rank_batch / base.per_rank_batch
        out["slower compute per rank"] = max(t.compute_s - base.compute_s * scale, 0.0)
    return out


def _main_loss(t: Trial, base: Trial) -> str:
    losses = _losses(t, base)
    if not losses:
        return "measure again with DDP so the step can be split"
    cause = max(losses, key=losses.get)
    if cause == "slower compute per rank":
        return (
            f"each rank computes slower: {t.cores_per_rank:g} cores per rank against "
            f"{base.cores_per_rank:g} for one rank; more ranks than this node has cores for "
            "buy nothing on CPU (use GPUs, or more nodes)"
        )
    if cause == "exposed communication":
        return "the gradient all-reduce (see the communication-bound advice of `diagnose`)"
    if cause == "data wait":
        return "the input pipeline (more DataLoader workers per rank)"
    return "the slowest rank (see rank-straggler in `diagnose` of its recording)"


def _explain(t: Trial, base: Trial, keep: str) -> str:
    losses = _losses(t, base)
    ideal = base.step_s * (1 if keep == "per-rank-batch" else 1 / t.nproc)
    parts = ", ".join(
        f"{k} {v * 1000:.1f} ms" for k, v in sorted(losses.items(), key=lambda kv: -kv[1])
    )
    note = ""
    if t.efficiency > 1.05:
        note = (
            f" E above 1: one rank with {base.cores_per_rank:g} threads computed slower per "
            f"sample than each of {t.nproc} single-thread ranks"
            + (
                f" (other processes took {base.others_cpu:g} % of the CPUs during that trial)"
                if base.others_cpu
                else ""
            )
            + "; the 1-rank baseline is the outlier, measure again on a quiet machine."
        )
    return (
        f"{t.nproc} ranks: E = {t.efficiency:.2f}; step {t.step_s * 1000:.1f} ms against "
        f"{ideal * 1000:.1f} ms ideal ({keep} kept); per step: {parts or 'no split available'}; "
        f"{t.cores_per_rank:g} cores per rank. Main loss: {_main_loss(t, base)}.{note}"
    )


def bench_scaling(
    script: list[str],
    sizes: list[int],
    steps: int,
    folder: Path,
    *,
    keep: str = "per-rank-batch",
    global_batch: int | None = None,
    limit_s: float = 600.0,
    on_trial=None,
    python: str = sys.executable,
) -> ScalingResult:
    if keep not in KEEP_CHOICES:
        raise UserError(f"--keep {keep!r}: choose {' or '.join(KEEP_CHOICES)}")
    if steps < 3:
        raise UserError(f"--steps {steps}: measure at least 3 steps per trial")
    for n in sizes:
        trial_args(script, keep, global_batch, n)  # bad arguments fail before any trial
    # A folder of an earlier bench: its recordings are never overwritten, and saying so before
    # the first trial spares the trials that would run before the clash.
    taken = [folder / f"scaling-{n}.sqlite" for n in sizes]
    taken = [path for path in taken if path.exists()]
    if taken:
        raise UserError(
            f"{str(folder)!r} already holds {taken[0].name} of an earlier bench: choose a new "
            "folder with --out-dir (without it, each bench makes its own scaling-<time> folder)"
        )
    result = ScalingResult(keep=keep)
    for n in sizes:
        args = trial_args(script, keep, global_batch, n)
        base = next((b for b in result.trials if b.nproc == 1), None)
        t = run_trial(args, n, steps, folder, limit_s=limit_s, python=python, baseline=base)
        result.trials.append(t)
        if on_trial is not None:
            on_trial(t)
    analyse(result)
    return result
