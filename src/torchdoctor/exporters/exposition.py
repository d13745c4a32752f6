"""The Prometheus text formats (0.0.4 and OpenMetrics 1.0), written from plain rows.

prometheus_client's encoder builds a Sample per series and checks and escapes every label
name and value again at every scrape: about a quarter of a 20-job scrape of the host
exporter (1,050 series). Here a family is a list of (label pairs, value) rows; the text of a
label set is made once and kept while it is in use (a job's labels never change between
scrapes), and the HELP and TYPE lines of a family once per process (names and docs are
literals). The output is byte for byte what prometheus_client writes for the same families,
labels sorted by name as it sorts them (tests/exporters/test_exposition.py compares them).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"

LabelPairs = tuple[tuple[str, str], ...]

# What a sample of each kind adds to the family's name, and the type the 0.0.4 text gives it
# (it has no info type: an info family is a gauge of value 1 there).
_SUFFIX = {"gauge": "", "counter": "_total", "info": "_info"}
_TEXT_TYPE = {"gauge": "gauge", "counter": "counter", "info": "gauge"}
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_ESCAPINGS = ("allow-utf-8", "underscores", "dots", "values")


class Family:
    """One metric family: ``kind`` gauge, counter or info; ``name`` without the counter's
    ``_total`` or the info's ``_info``; rows of (label pairs, value)."""

    __slots__ = ("doc", "kind", "name", "rows")

    def __init__(self, kind: str, name: str, doc: str) -> None:
        self.kind = kind
        self.name = name
        self.doc = doc
        self.rows: list[tuple[LabelPairs, float]] = []

    @property
    def sample_name(self) -> str:
        return self.name + _SUFFIX[self.kind]


def format_value(value: float) -> str:
    """A sample value as prometheus_client writes it: as a float (``5.0``), ``+Inf``,
    ``-Inf``, ``NaN``, and positive values of seven integer digits or more with an exponent
    (``1.234567e+06``), as Go's formatting does and Python's repr does not."""
    if type(value) is int and -1_000_000_000_000_000 < value < 1_000_000:
        return f"{value}.0"  # most values: exact as a float, repr would add ".0"
    v = float(value)
    if v != v:
        return "NaN"
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    text = repr(v)
    point = text.find(".")
    if v > 0 and point > 6:
        digits = (text[:point] + text[point + 1 :]).rstrip("0")
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{mantissa}e+{point - 1:02d}"
    return text


def _escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def label_text(pairs: LabelPairs) -> str:
    """``{a="1",b="2"}`` for ``pairs``, sorted by label name; "" for none."""
    if not pairs:
        return ""
    for name, _ in pairs:
        if not _LABEL_NAME.fullmatch(name):
            raise ValueError(f"not a Prometheus label name: {name!r}")
    inner = ",".join(f'{k}="{_escape_label_value(str(v))}"' for k, v in sorted(pairs))
    return "{" + inner + "}"


class LabelTexts:
    """The text of each label set, kept from one scrape to the next: a set not used in a
    scrape (a job that ended) is dropped at the one after, so it stays as large as two."""

    def __init__(self) -> None:
        self._now: dict[LabelPairs, str] = {}
        self._before: dict[LabelPairs, str] = {}

    def next_scrape(self) -> None:
        self._before, self._now = self._now, {}

    def text(self, pairs: LabelPairs) -> str:
        text = self._now.get(pairs)
        if text is None:
            text = self._before.pop(pairs, None)
            if text is None:
                text = label_text(pairs)
            self._now[pairs] = text
        return text


_HEADERS: dict[tuple[str, str, str, bool], str] = {}


def _header(family: Family, openmetrics: bool) -> str:
    key = (family.kind, family.name, family.doc, openmetrics)
    header = _HEADERS.get(key)
    if header is None:
        if not _METRIC_NAME.fullmatch(family.name):
            raise ValueError(f"not a Prometheus metric name: {family.name!r}")
        doc = family.doc.replace("\\", "\\\\").replace("\n", "\\n")
        if openmetrics:
            name, kind = family.name, family.kind
            doc = doc.replace('"', '\\"')  # OpenMetrics escapes quotes in HELP too
        else:
            name, kind = family.sample_name, _TEXT_TYPE[family.kind]
        header = _HEADERS[key] = f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"
    return header


def encode(
    families: Iterable[Family],
    labels: LabelTexts | None = None,
    *,
    openmetrics: bool = False,
    names: set[str] | None = None,
) -> bytes:
    """The families in the 0.0.4 text format, or OpenMetrics 1.0 (with its ``# EOF``).
    ``labels`` keeps label texts between calls; ``names``, if given, keeps only the series
    of those names (Prometheus' ``name[]`` query parameter)."""
    texts = labels if labels is not None else LabelTexts()
    if labels is not None:
        texts.next_scrape()
    text_of = texts.text
    out: list[str] = []
    for family in families:
        sample = family.sample_name
        if names is not None and sample not in names:
            continue
        out.append(_header(family, openmetrics))
        if family.kind == "info":
            for pairs, _ in family.rows:
                out.append(f"{sample}{text_of(pairs)} 1.0\n")
            continue
        for pairs, value in family.rows:
            out.append(f"{sample}{text_of(pairs)} {format_value(value)}\n")
    if openmetrics:
        out.append("# EOF\n")
    return "".join(out).encode()


def choose_format(accept: str | None) -> tuple[bool, str]:
    """(OpenMetrics or not, content type) for a request's Accept header: OpenMetrics 1.0 where
    it is asked for (Prometheus asks for it first), else the 0.0.4 text."""
    for entry in (accept or "").split(","):
        kind, *params = (p.strip() for p in entry.split(";"))
        if kind != "application/openmetrics-text":
            continue
        version = next((p[8:] for p in params if p.startswith("version=")), None)
        if version is None:
            return True, OPENMETRICS_CONTENT_TYPE
        if _version(version) >= (1, 0, 0):
            # Our names need no escaping: the output is the same under every scheme.
            escaping = next((p[9:] for p in params if p.startswith("escaping=")), None)
            if escaping not in _ESCAPINGS:
                escaping = "underscores"
            return True, f"{OPENMETRICS_CONTENT_TYPE}; escaping={escaping}"
    return False, TEXT_CONTENT_TYPE


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        return (0,)
