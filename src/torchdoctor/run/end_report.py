"""The end report of a recording: its summary, then its findings (end of `run`, `attach`,
`launch`; `show` prints the summary part)."""

from __future__ import annotations

import contextlib
import errno
import signal
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchdoctor.diagnosis.cuda_memory import RecordedSnapshot, phase_split
from torchdoctor.errors import UserError
from torchdoctor.recording.summary import RunSummary
from torchdoctor.terminal import make_console, styled
from torchdoctor.units import fmt_bytes, fmt_duration, fmt_pct, fmt_rate, one_line


def render_summary(summary: RunSummary, console: Console) -> None:
    status = summary.exit_status
    for line in summary.damage:
        console.print(styled(line, "yellow"))
    if not summary.complete:
        ended = summary.state or "recording cut short"
    elif status is not None:
        ended = f"exit status {status}"
    elif summary.stopped_by_signal is not None:
        # `attach` stopped by the user: the job did not end, it runs on unrecorded
        ended = (
            f"recording stopped by the user ({_signal_name(summary.stopped_by_signal)})"
            " while the job still ran"
        )
    else:
        ended = "ended (an attached process' exit status is not visible)"
    console.print(
        Text.assemble(
            ("torchdoctor", "bold"),
            f": {one_line(summary.command) or '(unknown command)'}"
            f" - {fmt_duration(summary.duration_s)}, {ended}, {summary.samples} samples",
        )
    )
    if summary.state_hint:
        console.print(styled(summary.state_hint, "yellow"))
    for line in summary.instrumentation_off:
        console.print(styled(line, "yellow"))
    table = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
    table.add_column("figure")
    table.add_column("mean", justify="right")
    table.add_column("peak", justify="right")
    cpus = f" of {summary.usable_cpus:g} CPUs" if summary.usable_cpus else ""
    rows = [
        (f"job CPU (100 % = 1 core{cpus})", summary.job_cpu_pct, fmt_pct),
        ("job RSS (sum)", summary.job_rss, fmt_bytes),
        ("job PSS (sum, shared pages split)", summary.job_pss, fmt_bytes),
        ("job /dev/shm held (its files)", summary.job_dev_shm, fmt_bytes),
        ("job shared memory (RssShmem sum)", summary.job_rss_shmem, fmt_bytes),
        ("job threads", summary.job_threads, _fmt_count),
        ("job processes", summary.job_processes, _fmt_count),
        ("host CPU busy", summary.host_cpu_busy_pct, fmt_pct),
        ("host I/O wait", summary.host_iowait_pct, fmt_pct),
        ("host RAM used", summary.host_mem_used, fmt_bytes),
        ("host swap traffic", summary.host_swap_traffic, fmt_rate),
    ]
    for gpu in summary.gpus:
        label = f"GPU {gpu.index}" + (f" {gpu.name}" if gpu.name else "")
        rows.append((f"{label} busy (a kernel ran)", gpu.utilization_gpu, fmt_pct))
        rows.append((f"{label} memory used", gpu.memory_used, fmt_bytes))
    for label, stat, fmt in rows:
        if stat.peak is not None:
            table.add_row(label, fmt(stat.mean), fmt(stat.peak))
    console.print(table)
    if summary.job_dev_shm.peak is None and summary.job_rss_shmem.peak is None:
        console.print("shared memory: not measured (the recording predates its sampling)")
    if summary.roles:
        roles = ", ".join(f"{n} {role}" for role, n in sorted(summary.roles.items()))
        console.print(f"processes seen: {roles}")
    if summary.gpu_unavailable:
        console.print(f"GPUs: unavailable ({summary.gpu_unavailable})")
    steps = summary.steps
    if steps and steps.get("step_count"):
        line = (
            f"steps: {steps['step_count']}, median {fmt_duration(steps.get('median_step_s'))},"
            # Beside the median: a data-bound job's steps are often bimodal (most fed at once,
            # every few waiting long), and the median alone hides the slow ones.
            f" mean {fmt_duration(steps.get('mean_step_s'))},"
            f" p90 {fmt_duration(steps.get('p90_step_s'))},"
            f" data wait {fmt_pct(_pct(steps.get('data_wait_fraction')))} of step time"
        )
        if steps.get("samples_per_s"):
            line += f", {steps['samples_per_s']:.1f} samples/s"
        elif steps.get("steps_per_s"):
            line += f", {steps['steps_per_s']:.2f} steps/s"
        if steps.get("boundary") == "backward":
            line += " (no optimizer step seen: each backward() ends a step)"
        if summary.steps_source == "sampled-stacks":
            line += " (estimated from sampled stacks)"
        console.print(line, soft_wrap=True)
        if summary.steps_source_limit:
            console.print(f"  {summary.steps_source_limit}", soft_wrap=True)
    elif summary.steps_source == "none" and summary.steps_source_reason:
        console.print(f"steps: not seen ({summary.steps_source_reason})", soft_wrap=True)
    evaluation = summary.evaluation
    if evaluation and evaluation.get("passes"):
        passes = evaluation["passes"]
        line = (
            f"evaluation: {passes} pass{'es' if passes != 1 else ''},"
            f" {fmt_duration(evaluation.get('seconds'))}"
        )
        if evaluation.get("samples") is not None:
            line += f", {evaluation['samples']} samples"
        console.print(line + ", left out of step figures")
    for window in summary.profiles:
        console.print(profile_line(window), soft_wrap=True)
    console.print(f"recording: {summary.path}")


def profile_line(window: dict) -> str:
    """One line per profiler window: where, how many steps, what the mean step is made of."""
    where = f"rank {window['rank']}, " if window.get("rank") is not None else ""
    first, last = window.get("first_step"), window.get("last_step")
    where += f"steps {first}-{last}" if first is not None else f"window {window['id']}"
    head = f"profile ({where})"
    if window.get("state") == "failed" or not window.get("steps_parsed"):
        why = window.get("reason") or "its trace was not parsed"
        return f"{head}: no figures ({why})"
    step = window.get("median_step_s") or 0.0
    parts = window["parts_s"]

    def share(seconds: float | None) -> str:
        return fmt_pct(100.0 * (seconds or 0.0) / step) if step > 0 else "n/a"

    body = ", ".join(
        f"{name} {share(parts.get(name))}" for name in ("ops", "Python", "data", "runtime")
    )
    line = (
        f"{head}: {window['steps_judged']} steps judged, median {fmt_duration(step)}: {body};"
        f" syncs {_fmt_count(window.get('syncs_per_step'))}/step ({share(parts.get('syncs'))}),"
        f" copies {share(parts.get('copies'))}, communication {share(parts.get('communication'))}"
    )
    gpu = window.get("gpu_s")
    if gpu:
        span = sum(v or 0.0 for v in gpu.values())
        idle = ", ".join(
            f"{name} {fmt_pct(100.0 * (gpu.get(name) or 0.0) / span) if span else 'n/a'}"
            for name in ("host wait", "kernel wait", "other idle")
        )
        busy = fmt_pct(100.0 * (gpu.get("busy") or 0.0) / span) if span else "n/a"
        line += f"; GPU busy {busy} ({idle})"
    if window.get("state") == "cut" and window.get("reason"):
        line += f" (cut: {window['reason']})"
    return line


def memory_line(snapshot: RecordedSnapshot) -> str:
    """One line per memory snapshot (run --memory-history): the peak, reserved against
    allocated, its phases, the line that held the most, the free memory, the failed request."""
    when = "at the OOM" if snapshot.kind == "oom" else "at its end"
    head = f"CUDA memory (pid {snapshot.pid}, snapshot {when})"
    peak = snapshot.peak
    if peak is None:
        return f"{head}: not read: {snapshot.error}"
    line = f"{head}: {fmt_bytes(peak.peak_allocated)} allocated"
    if peak.peak_reserved is not None:
        line += f", {fmt_bytes(peak.peak_reserved)} reserved"
    line += f" at the peak; {phase_split(peak)}"
    if peak.sites:
        top = peak.sites[0]
        line += f"; top: {top.where} {fmt_bytes(top.bytes)} ({top.phase})"
    if peak.fragmentation is not None:
        line += (
            f"; at the snapshot {fmt_bytes(peak.fragmentation)} reserved but free, largest"
            f" free block {fmt_bytes(peak.largest_free_block)}"
        )
    if peak.failed is not None:
        line += f"; failed request {fmt_bytes(peak.failed.bytes)}"
        if peak.failed.device_free is not None:
            line += f" ({fmt_bytes(peak.failed.device_free)} free on the device)"
    return f"{line}; {snapshot.path}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _pct(fraction: float | None) -> float | None:
    return None if fraction is None else 100.0 * fraction


def _fmt_count(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"


def print_end_report(
    path: Path, console: Console | None, thresholds_path: str | None
) -> tuple[object, list] | None:
    """The summary, then the findings, on stderr (``console``; None: print nothing); problems
    here never change the exit status. Returns (summary, findings), None when unreadable
    (`run --json` and `torchdoctor ls` use them: nothing is computed twice)."""
    from torchdoctor.recording import open_recording
    from torchdoctor.recording.summary import summarize

    try:
        with open_recording(path) as rec:
            summary = summarize(rec)
            if console is not None:
                render_summary(summary, console)
            findings = _print_findings(rec, console, thresholds_path)
        return summary, findings
    except UserError as exc:
        problem = exc.message
    except Exception as exc:  # noqa: BLE001 - the report is a courtesy; never fail the run
        if isinstance(exc, OSError) and exc.errno in _BROKEN_OUTPUT:
            return None  # our own stream broke: a line saying so would fail the same way
        problem = f"({type(exc).__name__}: {exc})"
    with contextlib.suppress(OSError):  # the stream may break on this very line
        (console or make_console(stderr=True, soft_wrap=True)).print(
            f"torchdoctor: could not summarize the recording: {problem}"
        )
    return None


# A write to our stream failed for good: the reader went away, the disk is full, it is closed.
_BROKEN_OUTPUT = frozenset({errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EBADF})


def _print_findings(rec, console: Console | None, thresholds_path: str | None) -> list:
    try:
        from torchdoctor.diagnosis.engine import diagnose
        from torchdoctor.diagnosis.render import render_findings
    except ImportError:
        return []
    from torchdoctor.thresholds import load_thresholds

    findings = diagnose(rec, load_thresholds(thresholds_path))
    if console is not None:
        render_findings(findings, console)
    return findings
