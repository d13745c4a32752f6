"""The Grafana dashboard shipped with torchdoctor (``grafana-dashboard.json`` beside this file).

It uses a ``datasource`` variable rather than ``${DS_...}`` import placeholders, so it can be
imported as is or provisioned from a file; ``instance``, ``run`` and ``rank`` filter every panel.
"""

from __future__ import annotations

from importlib import resources

FILE_NAME = "grafana-dashboard.json"


def dashboard_text() -> str:
    return resources.files(__package__).joinpath(FILE_NAME).read_text(encoding="utf-8")
