"""Does torchdoctor's advice work? Each scenario runs, is diagnosed, gets the recommended fix
from ``Finding.settings`` applied, and runs again; throughput before and after, side by side.

    python benchmarks/advice_works.py                 # every scenario, default lengths
    python benchmarks/advice_works.py --only data_bound --repeats 3

The fix applied is the scenario's finding's ``settings`` merged with those of the other
warnings (a user follows all of them). A recommendation that does not make its scenario
faster (ratio < --min-ratio) is a bug in the rule: the script exits 1. The leak scenario's fix is a code change the recommendation names
(``--fixed``); its figure is the memory growth per step, which must vanish.
Throughput is samples per second over the steady steps the instrumentation recorded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.engine import diagnose
from torchdoctor.diagnosis.findings import Finding
from torchdoctor.diagnosis.rules.host_memory_leak import check_process
from torchdoctor.recording.reader import open_recording
from torchdoctor.thresholds import Thresholds

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = REPO / "examples" / "scenarios"


@dataclass
class Scenario:
    script: str
    finding: str | None  # the finding the diagnosis must make (None: a clean bill)
    args: list[str] = field(default_factory=list)
    code_fix: list[str] = field(default_factory=list)  # flags for a fix that is a code change


CASES = [
    Scenario("data_bound", "dataloader-bound", ["--steps", "200"]),
    Scenario("io_bound", "dataloader-bound", ["--steps", "250"]),
    Scenario("thread_oversubscribed", "thread-oversubscription", ["--steps", "1000"]),
    Scenario("leaking", "host-memory-leak", ["--steps", "400"], code_fix=["--fixed"]),
    Scenario("healthy", None, ["--steps", "200"]),
]


def record(script: str, args: list[str], env: dict[str, str], out: Path) -> Path:
    cmd = [sys.executable, "-m", "torchdoctor", "run", "--quiet", "--interval", "0.25"]
    cmd += ["--out", str(out), "--", sys.executable, str(SCENARIOS / f"{script}.py"), *args]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return out


def measure(path: Path) -> tuple[list[Finding], float | None, float | None]:
    """(findings, samples per second, trainer memory growth in bytes per step or None)."""
    with open_recording(path) as rec:
        findings = diagnose(rec, Thresholds())
        ctx = DiagnosisContext(rec, Thresholds(leak_min_growth_bytes=0))
        summary = ctx.step_summary
        rate = summary.samples_per_s if summary else None
        leak = None
        for pid in ctx.compute_pids:
            f = check_process(ctx, pid)
            if f is not None:
                leak = next(e.value for e in f.evidence if e.label == "growth per step")
        return findings, rate, leak


def fix_args(settings: dict[str, object]) -> tuple[list[str], dict[str, str], list[str]]:
    """Script flags and environment that apply a finding's settings; the keys left unused."""
    flags: list[str] = []
    env: dict[str, str] = {}
    unused: list[str] = []
    for key, value in settings.items():
        if key == "num_workers":
            flags += ["--num-workers", str(value)]
        elif key == "persistent_workers" and value:
            flags.append("--persistent-workers")
        elif key == "prefetch_factor":
            flags += ["--prefetch-factor", str(value)]
        elif key == "torch.num_threads":
            flags += ["--threads", str(value)]
        elif key.startswith("env."):
            env[key[4:]] = str(value)
        else:
            unused.append(key)  # GPU-only knobs (pin_memory, device...) on a CPU scenario
    return flags, env, unused


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", help="scenario name (repeatable)")
    p.add_argument("--repeats", type=int, default=2, help="before/after pairs per scenario")
    p.add_argument("--min-ratio", type=float, default=1.1)
    opts = p.parse_args()
    cases = [c for c in CASES if not opts.only or c.script in opts.only]
    failures = []
    rows = []
    with tempfile.TemporaryDirectory(prefix="td-advice-") as tmp:
        for case in cases:
            base_env = dict(os.environ)
            findings, before, leak_before = measure(
                record(case.script, case.args, base_env, Path(tmp, f"{case.script}-0.sqlite"))
            )
            alarms = [f.id for f in findings if f.severity in ("warning", "critical")]
            if case.finding is None:
                own = [a for a in alarms if a != "cpu-contention"]
                rows.append(
                    (
                        case.script,
                        "clean bill" if not own else ",".join(own),
                        "-",
                        before,
                        None,
                        None,
                    )
                )
                if own:
                    failures.append(f"{case.script}: false alarm {own}")
                continue
            match = [f for f in findings if f.id == case.finding]
            if not match:
                failures.append(f"{case.script}: no {case.finding} (got {alarms})")
                continue
            finding = match[0]
            # The user follows every warning's fix; the scenario's own finding comes first.
            settings = dict(finding.settings)
            for other in findings:
                if other.severity in ("warning", "critical"):
                    for key, value in other.settings.items():
                        settings.setdefault(key, value)
            flags, env, unused = fix_args(settings)
            if not flags and not env and not case.code_fix:
                rows.append(
                    (case.script, finding.id, "(no setting: see its advice)", before, None, None)
                )
                print(f"{case.script}: {finding.recommendation}", file=sys.stderr)
                continue
            flags += case.code_fix
            fixed_env = {**base_env, **env}
            befores, afters, leaks_after = [before], [], []
            for i in range(opts.repeats):
                if i:
                    befores.append(
                        measure(
                            record(
                                case.script,
                                case.args,
                                base_env,
                                Path(tmp, f"{case.script}-b{i}.sqlite"),
                            )
                        )[1]
                    )
                _, after, leak_after = measure(
                    record(
                        case.script,
                        case.args + flags,
                        fixed_env,
                        Path(tmp, f"{case.script}-a{i}.sqlite"),
                    )
                )
                afters.append(after)
                leaks_after.append(leak_after)
            b = statistics.median(x for x in befores if x)
            a = statistics.median(x for x in afters if x)
            fix_text = " ".join(flags + [f"{k}={v}" for k, v in env.items()])
            ratio = a / b if b else None
            if case.script == "leaking":
                after_leak = max((x or 0.0) for x in leaks_after)
                rows.append(
                    (case.script, finding.id, fix_text, b, a, ratio, leak_before, after_leak)
                )
                if after_leak > 0.1 * (leak_before or 0):
                    failures.append(f"leaking: still grows {after_leak:.0f} B/step after the fix")
            else:
                rows.append((case.script, finding.id, fix_text, b, a, ratio))
                if ratio is None or ratio < opts.min_ratio:
                    failures.append(f"{case.script}: {fix_text} gave x{ratio:.2f}")
            if unused:
                print(f"{case.script}: settings not applicable here: {unused}", file=sys.stderr)

    print(
        f"{'scenario':<22} {'finding':<24} {'fix applied':<44} {'before':>9} {'after':>9} "
        f"{'ratio':>6}"
    )
    for row in rows:
        script, fid, fix, b, a, ratio = row[:6]
        line = (
            f"{script:<22} {fid:<24} {fix:<44} {_rate(b):>9} {_rate(a):>9} "
            f"{(f'x{ratio:.2f}' if ratio else '-'):>6}"
        )
        if len(row) > 6:
            line += f"   memory growth {row[6] / 2**20:.2f} -> {row[7] / 2**20:.2f} MiB/step"
        print(line)
    print("throughput in samples/s over the steady steps; medians of", opts.repeats, "runs")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


if __name__ == "__main__":
    sys.exit(main())
