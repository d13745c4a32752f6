"""Terminal rendering: readable units, every finding's fix shown, a clean bill when quiet."""

from __future__ import annotations

from rich.console import Console

from torchdoctor.diagnosis.findings import Evidence, Finding
from torchdoctor.diagnosis.render import findings_to_dict, format_value, render_findings


def finding(severity: str, rid: str = "io-wait") -> Finding:
    return Finding(
        id=rid,
        severity=severity,
        title="CPUs wait 18 % of the time on storage while the job runs",
        evidence=[Evidence("job reads", 62_914_560, "B/s"), Evidence("peak I/O wait", 31.5, "%")],
        recommendation="Preload the data set into memory " + "and train from RAM. " * 8 + "Done.",
        expected_effect="I/O wait back under 2 %.",
        confidence=0.8,
        settings={"num_workers": 3},
    )


def render(findings, soft_wrap: bool = False) -> str:
    console = Console(width=80, record=True, soft_wrap=soft_wrap, color_system=None)
    render_findings(findings, console)
    return console.export_text()


def test_units_are_readable():
    assert format_value(Evidence("x", 62_914_560, "B/s")) == "60.0 MiB/s"
    assert format_value(Evidence("x", 3 * 2**30, "B")) == "3.00 GiB"
    assert format_value(Evidence("x", 0.0421, "s")) == "42.1 ms"
    assert format_value(Evidence("x", 31.5, "%")) == "31.5 %"
    assert format_value(Evidence("x", 1458, "/s")) == "1,458 /s"


def test_findings_show_evidence_fix_and_settings_even_on_soft_wrap_consoles():
    # `torchdoctor run` prints on a soft-wrapping console; panels must still wrap, not crop.
    text = render([finding("warning")], soft_wrap=True)
    assert "WARNING io-wait" in text
    assert "60.0 MiB/s" in text
    assert "Done." in text  # the end of a long recommendation is not cropped
    assert "Settings: num_workers=3" in text
    assert "confidence 80%" in text


def test_clean_bill_and_notes():
    assert "no problems found in this job" in render([])
    notes = render([finding("info", "cpu-saturated")])
    assert "no problems found; notes for this job" in notes
    assert "INFO cpu-saturated" in notes


def test_json_form_keeps_every_field():
    data = findings_to_dict([finding("critical")])
    (f,) = data["findings"]
    assert f["settings"] == {"num_workers": 3}
    assert f["evidence"][0] == {
        "label": "job reads",
        "value": 62_914_560,
        "unit": "B/s",
        "t_start": None,
        "t_end": None,
    }
