"""sync-points: the profiled steps synchronise the host with the device - `.item()`, `.cpu()`,
`print` of a tensor, `nonzero`, `torch.cuda.synchronize` - found in a profiled window: on a GPU
trace the runtime calls that wait (cudaStreamSynchronize, cudaDeviceSynchronize, a blocking
cudaMemcpy), on a CPU trace the ops that would wait on a device (`aten::item` /
`_local_scalar_dense`, outside the optimizer's and the DataLoader's own), with the source lines
the agent caught calling them (profile_sync_sites). Warning on a GPU when their wait exceeds
`profile_sync_alert_pct` of the step."""

from __future__ import annotations

import os
from pathlib import Path

import torchdoctor
from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.rules import _profile as wp
from torchdoctor.units import fmt_duration

ID = "sync-points"
_OWN = str(Path(torchdoctor.__file__).resolve().parent) + os.sep
MAX_SITES = 5  # source lines named in the finding


def check(ctx: DiagnosisContext) -> list[Finding]:
    limit = ctx.thresholds.profile_sync_alert_pct
    found = [
        (wp.per_step(w, "sync_s"), w) for w in ctx.profiles if wp.per_step(w, "sync_count") >= 1
    ]
    w = wp.worst(found)
    if w is None:
        return []
    step_s = wp.per_step(w, "dur_s")
    syncs, wait = wp.per_step(w, "sync_count"), wp.per_step(w, "sync_s")
    share = wp.pct(wait, step_s)
    evidence = wp.window_evidence(w) + [
        Evidence("synchronisations per step", round(syncs, 1), ""),
        Evidence("time in them per step", round(wait, 6), "s"),
        Evidence("share of the step", share, "%"),
    ]
    # A frame of torchdoctor's own agent is never the line the user is to change.
    sites = [x for x in w.sync_sites if not str(x["file"]).startswith(_OWN)][:MAX_SITES]
    for site in sites:
        evidence.append(
            Evidence(
                f"{site['file']}:{site['line']} ({site['function']})",
                f"{site['op']} x{site['count']}, {fmt_duration(site['total_s'] or 0.0)}",
                "",
            )
        )
    where = (
        "; ".join(f"{s['file']}:{s['line']} ({s['op']})" for s in sites)
        or "the ops named in the window's trace (no source line was caught)"
    )
    if w.gpu:
        severity = "warning" if share >= limit else "info"
        effect = (
            f"Removing them saves {wp.at_most(wait, step_s)}: a sync costs its wait, and the GPU "
            "work it waited for still has to run."
        )
    else:
        severity = "info"
        effect = (
            f"On this CPU run they cost {wp.at_most(wait, step_s)}; on a GPU each one waits for "
            "the device's queue to drain, and removing it saves at most that wait."
        )
    return [
        Finding(
            id=ID,
            severity=severity,
            title=f"{syncs:.0f} host-device synchronisation(s) per profiled step",
            evidence=evidence,
            recommendation=(
                f"At {where}: keep the value on the device (accumulate `total += loss.detach()`) "
                "and read it every N steps (`if step % 100 == 0: print(total.item() / 100)`); "
                "do not print tensors or branch on their values inside the step."
            ),
            expected_effect=effect,
            confidence=0.8 if sites else 0.6,
            settings={"sync_sites": [f"{s['file']}:{s['line']}" for s in sites]},
        )
    ]
