"""collective-timeout: a collective timed out because a rank never joined it.

The ranks that waited raise the backend's timeout (gloo: "Timed out waiting ... for recv";
NCCL: the watchdog); the rank that did not arrive raises nothing: it is elsewhere (rank-only
work, a data stall, a hang). Each rank's flight recorder (dumped by the rank hooks next to the
recording, ``fr_trace_rank_<rank>.json``) gives the last collective it entered; the rank whose
last collective is behind the one that timed out is the one that did not arrive. Without
dumps, the rank that raised no timeout and stepped least is named.
"""

from __future__ import annotations

import json
from pathlib import Path

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.instrument.agent.contract import FR_PREFIX

ID = "collective-timeout"
SCOPE = "job"


def last_collectives(fr_dirs: list[Path]) -> dict[int, dict]:
    """Per rank, the last entry of the default process group in its flight-recorder dump."""
    out: dict[int, dict] = {}
    for folder in fr_dirs:
        for path in sorted(folder.glob(f"{FR_PREFIX}*.json")):
            try:
                rank = int(path.name[len(FR_PREFIX) : -len(".json")])
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            entries = [e for e in data.get("entries") or [] if str(e.get("pg_id", 0)) == "0"]
            if entries:
                last = max(entries, key=lambda e: int(e.get("collective_seq_id") or 0))
                out[rank] = {**last, "dump": str(path)}
            else:
                out[rank] = {"collective_seq_id": 0, "dump": str(path)}
    return out


def check(ctx: DiagnosisContext) -> list[Finding]:
    job = ctx.job
    timeouts = {
        r.rank: e["detail"]
        for r in job.ranks.values()
        for e in r.events_of("rank-error")
        if e["detail"].get("kind") == "timeout"
    }
    if not timeouts:
        return []
    world = job.world_size or len(job.ranks)
    last = last_collectives(job.fr_dirs)
    waited = {r: last[r] for r in timeouts if r in last}
    evidence: list[Evidence] = []
    if waited:
        target_rank = max(waited, key=lambda r: int(waited[r].get("collective_seq_id") or 0))
        target = waited[target_rank]
        seq = int(target.get("collective_seq_id") or 0)
        missing = [
            r
            for r in range(world)
            if r not in timeouts
            and (r not in last or int(last[r].get("collective_seq_id") or 0) < seq)
        ]
        evidence.append(
            Evidence(
                f"rank {target_rank} waited in collective #{seq}",
                f"{target.get('profiling_name', '?')}, timeout {target.get('timeout_ms', '?')} ms",
                "",
            )
        )
        for r in missing:
            if r in last:
                evidence.append(
                    Evidence(
                        f"rank {r}'s last collective (flight recorder)",
                        f"#{last[r].get('collective_seq_id')} {last[r].get('profiling_name', '')}",
                        "",
                    )
                )
    else:
        seq = None
        top = max((r.step_count for r in job.ranks.values()), default=0)
        missing = [
            r.rank for r in job.ranks.values() if r.rank not in timeouts and r.step_count < top
        ]
    if not missing:
        return []
    for r in missing:
        series = job.ranks.get(r)
        if series is None:
            continue
        steps = series.step_count
        evidence.append(Evidence(f"rank {r} steps completed", steps, "steps"))
        stopped = series.first_event("rank-terminated")
        if stopped and stopped.get("stack"):
            evidence.append(Evidence(f"rank {r} was in", stopped["stack"][-1], ""))
    first = next(iter(timeouts.values()))
    evidence.append(Evidence("error", first.get("error", "")[:200], ""))
    names = ", ".join(f"rank {r}" for r in missing)
    where = _where(job, missing[0])
    dumps = ", ".join(str(d) for d in job.fr_dirs) or "the flight-recorder folder"
    return [
        Finding(
            id=ID,
            severity="critical",
            title=(
                f"{names} did not arrive at collective "
                f"{'#' + str(seq) if seq else ''} and the others timed out waiting".replace(
                    "  ", " "
                )
            ),
            evidence=evidence,
            recommendation=(
                f"Look at what {names} does after its last step{where}: code only some ranks "
                "run (evaluation, checkpointing, logging on one rank), a data stall, or a "
                "collective inside a rank-conditional branch. Every rank must make the same "
                f"collectives in the same order. Full match of the dumps: `python -m "
                f"torch.distributed.flight_recorder.fr_trace {dumps}`."
            ),
            expected_effect="Every rank joins each collective; no timeout.",
            confidence=0.85 if seq else 0.6,
            settings={"missing_ranks": missing},
        )
    ]


def _where(job, rank: int) -> str:
    series = job.ranks.get(rank)
    if series is None:
        return ""
    stopped = series.first_event("rank-terminated")
    if stopped and stopped.get("stack"):
        return f" (it was in {stopped['stack'][-1]} when it was stopped)"
    return ""
