"""gpu-hardware-errors: the GPU reported Xid errors or uncorrectable ECC errors while the job ran
(NVML critical-error events and volatile ECC counters).

An Xid is the driver's code for what went wrong; the fix depends on whose fault it is. Some
are the program's (an illegal memory access, a kernel killed), some the memory's (ECC, row
remapping), some the board's, bus's or driver's (fallen off the bus, GSP firmware, NVLink).
An uncorrectable ECC error means data on the device may be wrong: the run's results are suspect.
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding

ID = "gpu-hardware-errors"

# Xid codes by cause, from NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors).
PROGRAM = {13: "graphics engine exception", 31: "GPU memory page fault (MMU)",
           43: "GPU stopped processing", 45: "preemptive cleanup (a context was killed)"}  # fmt: skip
MEMORY = {48: "double-bit ECC error", 63: "ECC page retirement / row remapping",
          64: "ECC page retirement / row remapper failure", 92: "high single-bit ECC rate",
          94: "contained ECC error", 95: "uncontained ECC error"}  # fmt: skip
HARDWARE = {61: "internal micro-controller breakpoint", 62: "internal micro-controller halt",
            74: "NVLink error", 79: "GPU has fallen off the bus", 119: "GSP RPC timeout",
            120: "GSP error"}  # fmt: skip

FIX_PROGRAM = (
    "The program touched memory it should not or its kernel was killed: rerun with "
    "`CUDA_LAUNCH_BLOCKING=1` to get the failing call in the traceback, then "
    "`compute-sanitizer --tool memcheck python train.py` to find the out-of-range access "
    "(an index past a tensor's end, a wrong custom kernel or extension)."
)
FIX_MEMORY = (
    "The GPU's memory is failing: do not trust this run's results. Check "
    "`nvidia-smi -q -d ECC,ROW_REMAPPER` (pending remaps need a reset), reset the GPU when "
    "nothing runs on it (`nvidia-smi -r -i <index>`) or reboot; if the errors come back, drain "
    "the GPU and have it replaced."
)
FIX_HARDWARE = (
    "The board, its PCIe/NVLink connection or the driver failed: collect `nvidia-bug-report.sh`, "
    "check `dmesg` for the Xid lines, the GPU's seating, power cables and temperature, update the "
    "driver; a GPU that fell off the bus needs a reboot. Drain the node from schedulers meanwhile."
)


def _label(code: int) -> str:
    for table in (PROGRAM, MEMORY, HARDWARE):
        if code in table:
            return f"Xid {code} ({table[code]})"
    return f"Xid {code}"


def check(ctx: DiagnosisContext) -> list[Finding]:
    findings = []
    for index in ctx.job_gpus:
        samples = ctx.gpu_samples.get(index, [])
        xids: dict[int, int] = {}
        first_t: float | None = None
        for s in samples:
            for code in s.get("xid_errors") or []:
                xids[code] = xids.get(code, 0) + 1
                first_t = s["t"] if first_t is None else first_t
        uncorrected = [s.get("ecc_uncorrected") for s in samples]
        uncorrected = [n for n in uncorrected if n is not None]  # None: no ECC on this GPU
        ecc_new = (max(uncorrected) - min(uncorrected)) if uncorrected else 0
        ecc_total = max(uncorrected, default=0)
        if not xids and not ecc_total:
            continue
        evidence = []
        if xids:
            listed = ", ".join(f"{_label(c)} x{n}" for c, n in sorted(xids.items()))
            evidence.append(Evidence("Xid errors", listed, "", first_t, first_t))
        if ecc_total:
            evidence.append(Evidence("uncorrectable ECC errors since the driver loaded",
                                     ecc_total, ""))  # fmt: skip
            evidence.append(Evidence("of them during the recording", ecc_new, ""))
        causes = []
        if set(xids) & set(MEMORY) or ecc_total:
            causes.append(("memory", FIX_MEMORY))
        if set(xids) & set(HARDWARE) or set(xids) - set(PROGRAM) - set(MEMORY) - set(HARDWARE):
            causes.append(("hardware", FIX_HARDWARE))
        if set(xids) & set(PROGRAM):
            causes.append(("program", FIX_PROGRAM))
        only_program = [c for c, _ in causes] == ["program"]
        what = ", ".join(_label(c) for c in sorted(xids)) if xids else "uncorrectable ECC errors"
        findings.append(
            Finding(
                id=ID,
                severity="warning" if only_program else "critical",
                title=f"GPU {index} reported {what}",
                evidence=evidence,
                recommendation=" ".join(fix for _, fix in causes),
                expected_effect=(
                    "A run that completes on a healthy GPU, with results that can be trusted."
                ),
                confidence=0.9,
                settings={"xid": sorted(xids), "causes": [c for c, _ in causes]},
            )
        )
    return findings
