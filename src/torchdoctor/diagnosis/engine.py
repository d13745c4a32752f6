"""Runs every rule over one recording and returns the findings, most severe first."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType

from torchdoctor.diagnosis.context import DiagnosisContext, JobContext
from torchdoctor.diagnosis.findings import SEVERITIES, Finding
from torchdoctor.diagnosis.rules import RULE_MODULES
from torchdoctor.errors import UserError
from torchdoctor.recording.reader import Recording
from torchdoctor.thresholds import Thresholds


def rules() -> list[ModuleType]:
    """The rule modules in running order: those that read other findings come last."""
    modules = [importlib.import_module(f"torchdoctor.diagnosis.rules.{m}") for m in RULE_MODULES]
    return sorted(modules, key=lambda m: bool(getattr(m, "AFTER_OTHERS", False)))


def rule_ids() -> list[str]:
    """Every finding id the diagnosis can report, sorted."""
    return sorted({m.ID for m in rules()})


def diagnose(
    recording: Recording,
    thresholds: Thresholds | None = None,
    *,
    complain: Callable[[str], None] | None = None,
) -> list[Finding]:
    """Every rule's findings for ``recording``, sorted by severity, then confidence.

    A rule that fails (a bug, or a recording shaped in a way it did not expect) is reported on
    stderr (or to ``complain``: a diagnosis in a thread of its own must not take over the
    process's stderr) and skipped: one broken rule must not hide the others' findings.
    """
    return diagnose_job([recording], thresholds, complain=complain)


def diagnose_job(
    recordings: list[Recording],
    thresholds: Thresholds | None = None,
    *,
    complain: Callable[[str], None] | None = None,
) -> list[Finding]:
    """The findings of one job recorded on several nodes (one recording per node).

    Rules that compare ranks (``SCOPE = "job"``) run once over every node's ranks; the others
    run on each node's recording, their titles naming the node when there are several.
    """
    job = JobContext()  # one view of the ranks for every node's rules
    contexts = [DiagnosisContext(r, thresholds or Thresholds(), job) for r in recordings]
    findings: list[Finding] = []
    for module in rules():
        job_rule = getattr(module, "SCOPE", "recording") == "job"
        for ctx in contexts[:1] if job_rule else contexts:
            try:
                found = list(module.check(ctx))
            except UserError:
                raise  # the recording's fault (damaged or edited), not the rule's: one line
            except Exception as exc:  # noqa: BLE001 - isolate rules from each other
                text = (
                    f"torchdoctor: rule {module.ID} failed on this recording and was skipped: "
                    f"{type(exc).__name__}: {exc}"
                )
                if complain is None:
                    print(text, file=sys.stderr)
                else:
                    complain(text)
                continue
            if len(contexts) > 1 and not job_rule:
                for f in found:
                    f.title = f"{_node_name(ctx)}: {f.title}"
            ctx.findings.extend(found)
            findings.extend(found)
            if job_rule:
                for other in contexts[1:]:
                    other.findings.extend(found)
    return sort_findings(findings)


def _node_name(ctx: DiagnosisContext) -> str:
    node = (ctx.meta.get("launch") or {}).get("node_rank")
    host = (ctx.meta.get("host") or {}).get("hostname")
    name = f"node {node}" if node is not None else ctx.recording.path.name
    return f"{name} ({host})" if host else name


def sort_findings(findings: list[Finding]) -> list[Finding]:
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (rank.get(f.severity, len(rank)), -f.confidence))
