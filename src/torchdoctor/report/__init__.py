"""The HTML report of a recording: ``torchdoctor report FILE`` and :func:`write_report`."""

from torchdoctor.report.data import build_report_data
from torchdoctor.report.html import render_html, write_report

__all__ = ["build_report_data", "render_html", "write_report"]
