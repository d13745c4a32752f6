"""What a diagnosis rule says: a finding, with its evidence and a concrete recommendation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SEVERITIES = ("critical", "warning", "info")  # most severe first


@dataclass(slots=True)
class Evidence:
    """One measured figure that supports a finding."""

    label: str  # what was measured, e.g. "data wait share of step time"
    value: float | int | str
    unit: str  # "%", "B", "B/s", "s", "threads", "" ...
    t_start: float | None = None  # time span the figure covers (UNIX seconds)
    t_end: float | None = None


@dataclass(slots=True)
class Finding:
    id: str  # stable rule id, e.g. "dataloader-bound"
    severity: str  # one of SEVERITIES
    title: str
    evidence: list[Evidence]
    recommendation: str  # concrete values, e.g. "DataLoader(num_workers=6, ...)"
    expected_effect: str
    confidence: float  # 0-1
    settings: dict[str, Any] = field(
        default_factory=dict
    )  # machine-readable fix, e.g. {"num_workers": 6}
    details: str = ""  # longer explanation shown in reports
