"""short-recording: what the other rules could not judge, for want of evidence.

A verdict on a condition over time (CPU saturation or contention, GPU throttling, memory
growth) needs the steady part of the run, sampled long enough (diagnosis.context:
MIN_EVIDENCE_S, MIN_EVIDENCE_SAMPLES; host_memory_leak: MIN_STEPS). A short run, a recording
cut short, or a live recording in a job's first seconds gets this note instead of a guess.
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding

ID = "short-recording"
AFTER_OTHERS = True


def check(ctx: DiagnosisContext) -> list[Finding]:
    if not ctx.not_judged:
        return []
    complete = ctx.recording.complete
    t0, t1 = ctx.steady_window
    what = "Too little recorded yet" if not complete else "The run is too short"
    evidence = [Evidence(name, reason, "") for name, reason in ctx.not_judged.items()]
    evidence.append(Evidence("steady running recorded", round(max(t1 - t0, 0.0), 1), "s", t0, t1))
    return [
        Finding(
            id=ID,
            severity="info",
            title=f"{what} to judge {', '.join(ctx.not_judged)}",
            evidence=evidence,
            recommendation=(
                "Record a longer stretch of training (tens of seconds of steps) to have these "
                "judged"
                + (
                    "; this recording ended before the job did (recorder stopped or the "
                    "job is still running)."
                    if not complete
                    else "."
                )
            ),
            expected_effect="Nothing changes in the job; the diagnosis gains evidence.",
            confidence=1.0,
        )
    ]
