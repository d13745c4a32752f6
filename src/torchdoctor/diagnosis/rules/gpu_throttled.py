"""gpu-throttled: a busy GPU runs with lowered clocks for thermal or power reasons (NVML
clock-event reasons), sustained."""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.series import mean

ID = "gpu-throttled"
# NVML clock-event reasons that slow a busy GPU down; gpu_idle, applications clocks, sync
# boost and display clocks are not throttling.
HARD = {"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
SOFT = {"sw_power_cap"}
BUSY_PCT = 50.0


def check(ctx: DiagnosisContext) -> list[Finding]:
    findings = []
    for index in ctx.job_gpus:
        samples = [
            s
            for s in ctx.gpu_samples.get(index, [])
            if s["clock_event_reasons"] is not None and (s["utilization_gpu"] or 0) >= BUSY_PCT
        ]
        if len(samples) < 3:
            continue
        series = [
            (s["t"], 1.0 if set(s["clock_event_reasons"]) & (HARD | SOFT) else 0.0) for s in samples
        ]
        span = ctx.sustained(series, 0.5, what=f"GPU {index} throttling")
        if span is None:
            continue
        within = [s for s in samples if span.t_start <= s["t"] <= span.t_end]
        reasons: dict[str, int] = {}
        for s in within:
            for r in s["clock_event_reasons"]:
                if r in HARD | SOFT:
                    reasons[r] = reasons.get(r, 0) + 1
        hard = bool(set(reasons) & HARD)
        temp = max(
            (s["temperature_c"] for s in within if s["temperature_c"] is not None), default=None
        )
        power = mean([s["power_w"] for s in within if s["power_w"] is not None])
        limit = mean([s["power_limit_w"] for s in within if s["power_limit_w"] is not None])
        clock = mean([s["sm_clock_mhz"] for s in within if s["sm_clock_mhz"] is not None])
        evidence = [
            Evidence(
                "busy time with lowered clocks",
                round(span.mean * 100),
                "%",
                span.t_start,
                span.t_end,
            ),
            Evidence("reasons", ", ".join(sorted(reasons, key=reasons.get, reverse=True)), ""),
        ]
        if clock is not None:
            evidence.append(Evidence("SM clock", round(clock), "MHz", span.t_start, span.t_end))
        if temp is not None:
            evidence.append(Evidence("peak temperature", temp, "C", span.t_start, span.t_end))
        if power is not None and limit:
            evidence.append(Evidence("power draw / limit", f"{power:.0f} / {limit:.0f}", "W"))
        if hard:
            rec = (
                "The GPU slows itself down to protect the hardware (thermal or power brake): "
                "check cooling and airflow, fan curves and the data-centre inlet temperature; "
                "`nvidia-smi -q -d PERFORMANCE` shows the active reasons."
            )
        else:
            rec = (
                "The GPU hits its software power cap: expected at full load; if the power limit "
                "was lowered (`nvidia-smi -q -d POWER`), raising it back restores clocks."
            )
        findings.append(
            Finding(
                id=ID,
                severity="warning" if hard else "info",
                title=f"GPU {index} runs throttled ({', '.join(sorted(reasons))})",
                evidence=evidence,
                recommendation=rec,
                expected_effect="Full clocks under load: step time falls with the clock.",
                confidence=0.8,
            )
        )
    return findings
