"""How much a job needs, and where the figure came from: asked, the last recording of the same
command in this queue (its measured peak plus a margin), or ``torchdoctor estimate``."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.queue.model import ASKED, Job
from torchdoctor.units import fmt_bytes, parse_size

AUTO = "auto"
HISTORY_MARGIN = 0.10  # measured peaks vary a little from run to run
ESTIMATE_TIMEOUT_S = 600.0


def resolve_need(
    kind: str,
    value: str | None,
    argv: list[str],
    history: Any,
    estimate_args: str | None = None,
) -> tuple[int | None, str | None]:
    """``--vram``/``--mem`` (``kind``) as bytes and the source of the figure; ``history`` is
    the queue (its ``last_finished(argv)``)."""
    if value is None:
        return None, None
    if value.strip().lower() != AUTO:
        need = parse_size(value, f"--{kind}")
        if need <= 0:
            # 0 B asked would place the job anywhere and then let it use anything
            raise UserError(
                f"--{kind} {value}: give a size above 0 (e.g. --{kind} 8GiB), or leave --{kind} out"
            )
        return need, ASKED
    option = f"--{kind}"
    past: Job | None = history.last_finished(argv)
    peak = None
    if past is not None:
        peak = past.used_vram if kind == "vram" else past.used_rss
    if peak:
        need = int(peak * (1 + HISTORY_MARGIN))
        return need, (
            f"job {past.id}'s recording: peak {fmt_bytes(peak)} + {HISTORY_MARGIN * 100:.0f} %"
        )
    if kind == "vram" and estimate_args:
        return _from_estimate(estimate_args, argv)
    hint = " or --estimate 'SPEC --batch N ...'" if kind == "vram" else ""
    raise UserError(
        f"{option} auto: this queue has no finished run of this command to size it from; "
        f"give {option} SIZE (e.g. {option} 8GiB){hint}"
    )


def _from_estimate(estimate_args: str, argv: list[str]) -> tuple[int, str]:
    from torchdoctor.run.interpreter import find_job_python

    words = shlex.split(estimate_args)  # split like a shell would; nothing runs in one
    command = [sys.executable, "-m", "torchdoctor", "estimate", *words, "--json"]
    job_python = find_job_python(argv)  # the job's torch sizes the job
    if not job_python.is_ours:
        command += ["--python", job_python.executable]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=ESTIMATE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise UserError(f"--estimate {estimate_args!r} did not finish in time") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"--estimate {estimate_args!r} failed: {last}")
    result = json.loads(done.stdout)
    need = int(result["total_bytes"])
    return need, f"torchdoctor estimate {estimate_args}: {fmt_bytes(need)} with its margin"
