"""Runs every rule over one recording and returns the findings, most severe first."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import SEVERITIES, Finding
from torchdoctor.diagnosis.rules import RULE_MODULES
from torchdoctor.recording.reader import Recording
from torchdoctor.thresholds import Thresholds


def rules() -> list[ModuleType]:
    """The rule modules in running order: those that read other findings come last."""
    modules = [importlib.import_module(f"torchdoctor.diagnosis.rules.{m}") for m in RULE_MODULES]
    return sorted(modules, key=lambda m: bool(getattr(m, "AFTER_OTHERS", False)))


def diagnose(recording: Recording, thresholds: Thresholds | None = None) -> list[Finding]:
    """Every rule's findings for ``recording``, sorted by severity, then confidence.

    A rule that fails (a bug, or a recording shaped in a way it did not expect) is reported on
    stderr and skipped: one broken rule must not hide the others' findings.
    """
    ctx = DiagnosisContext(recording, thresholds or Thresholds())
    for module in rules():
        try:
            found = list(module.check(ctx))
        except Exception as exc:  # noqa: BLE001 - isolate rules from each other
            print(
                f"torchdoctor: rule {module.ID} failed on this recording and was skipped: "
                f"{type(exc).__name__}: {exc}",
                file=sys.stderr,
            )
            continue
        ctx.findings.extend(found)
    return sort_findings(ctx.findings)


def sort_findings(findings: list[Finding]) -> list[Finding]:
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (rank.get(f.severity, len(rank)), -f.confidence))
