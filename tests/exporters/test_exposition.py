"""Our exposition encoder writes byte for byte what prometheus_client writes for the same
families (0.0.4 text and OpenMetrics): odd label values, NaN, infinities, large integers; and
the HTTP endpoint serves text Prometheus' own parsers read."""

from __future__ import annotations

import gzip
import math
import os
import random
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from torchdoctor.exporters.exposition import LabelTexts, choose_format, format_value
from torchdoctor.exporters.metrics import Families
from torchdoctor.exporters.prometheus import JobCollector, registry_for, serve, stop
from torchdoctor.recording import RecordingWriter
from torchdoctor.sampling.job import JobReader
from torchdoctor.sampling.sampler import Sampler

ODD = ["", 'a "quoted" word', "back\\slash", "two\nlines", "ünïcødé ✓", "\\n literal", "}{,="]
VALUES = [
    0, 1, -1, 999_999, 1_000_000, 1_234_567, 10**15, 10**16 + 1, 2**53 + 1, 2**63, -(10**18),
    0.0, -0.0, 0.1, 1e-9, 5e-324, 123456.75, 1234567.5, 1e21, 1.5e300, -1234567.5,
    math.nan, math.inf, -math.inf, True, False, 6.029999999999997,
]  # fmt: skip


class _Fixed:
    def __init__(self, families: Families) -> None:
        self.families = families

    def collect(self):
        return iter(list(self.families))


def _odd_families() -> Families:
    f = Families()
    for i, value in enumerate(VALUES):
        f.gauge("odd_gauge", "A gauge; doc with a \\ and a\nnewline and \"quotes\".",
                {"run_id": ODD[i % len(ODD)], "i": str(i)}, value)  # fmt: skip
        f.counter("odd_total", "A counter.", {"zeta": "z", "alpha": ODD[-i % len(ODD)],
                                              "i": str(i)}, value)  # fmt: skip
    f.gauge("no_labels", "No label at all.", {}, 3)
    f.counter("ecc_errors", "A counter named without _total.", {"kind": "x"}, 2)
    f.gauge("skipped", "Never measured.", {}, None)
    for text in ODD:
        f.info("thing", "An info.", {"run_id": text}, {"version": text, "empty": "", "b": "1"})
    return f


def test_the_text_is_prometheus_clients_byte_for_byte() -> None:
    families = _odd_families()
    ours = families.encode()
    assert ours == generate_latest(registry_for(_Fixed(families)))
    assert families.encode(openmetrics=True) == generate_openmetrics(registry_for(_Fixed(families)))
    # Kept label texts give the same text, scrape after scrape.
    texts = LabelTexts()
    assert [families.encode(texts) for _ in range(3)] == [ours] * 3
    # The series parse back to what was added.
    parsed = {f.name: f for f in text_string_to_metric_families(ours.decode())}
    samples = parsed["torchdoctor_odd_gauge"].samples
    assert [s.labels["run_id"] for s in samples[: len(ODD)]] == ODD
    assert samples[VALUES.index(2**63)].value == float(2**63)
    assert math.isnan(samples[VALUES.index(math.nan)].value)
    assert "torchdoctor_skipped" not in parsed


def test_values_are_formatted_as_prometheus_client_formats_them() -> None:
    rng = random.Random(29)
    values = list(VALUES)
    for _ in range(20_000):
        values.append(rng.randint(-(2**64), 2**64) >> rng.randint(0, 64))
        values.append(rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30))
        values.append(float(rng.randint(0, 10**9)))
    for value in values:
        assert format_value(value) == floatToGoString(value), value


def test_label_texts_drop_sets_unused_for_a_scrape() -> None:
    texts = LabelTexts()
    for scrape in range(5):
        texts.next_scrape()
        texts.text((("run_id", "always"),))
        texts.text((("run_id", f"job-{scrape}"),))
    assert len(texts._now) + len(texts._before) <= 4


@pytest.mark.parametrize(
    ("accept", "openmetrics"),
    [
        (None, False),
        ("text/plain;version=0.0.4;q=0.3,*/*;q=0.2", False),
        ("application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4", True),
        ("application/openmetrics-text; version=0.0.1,text/plain;version=0.0.4;q=0.5", False),
        ("application/openmetrics-text", True),
    ],
)
def test_the_format_follows_the_accept_header(accept, openmetrics: bool) -> None:
    assert choose_format(accept)[0] is openmetrics


def _recording(path: Path) -> Path:
    writer = RecordingWriter(path, {"started_at": 0.0, "mode": "run"})
    sampler = Sampler(None, JobReader(os.getpid()), None)
    try:
        for _ in range(2):
            writer.write_snapshot(sampler.snapshot())
            writer.flush()
    finally:
        sampler.close()
        writer.close()
    return path


def test_a_collectors_text_is_what_prometheus_client_writes_of_its_families(
    tmp_path: Path,
) -> None:
    collector = JobCollector(_recording(tmp_path / "job.sqlite"), findings=False)
    try:
        collector.expose()  # the first read; nothing changes after it
        assert collector.expose() == generate_latest(registry_for(collector))
        assert collector.expose(openmetrics=True) == generate_openmetrics(registry_for(collector))
    finally:
        collector.close()


def _get(url: str, **headers: str) -> tuple[bytes, dict[str, str]]:
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read(), dict(resp.headers)


def test_the_endpoint_serves_text_openmetrics_and_gzip(tmp_path: Path) -> None:
    collector = JobCollector(_recording(tmp_path / "job.sqlite"), findings=False)
    server = serve(collector, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        body, headers = _get(url)
        assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        names = {s.name for f in text_string_to_metric_families(body.decode()) for s in f.samples}
        assert "torchdoctor_job_processes" in names and "torchdoctor_job_info" in names
        accept = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;q=0.3"
        body, headers = _get(url, Accept=accept)
        assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
        assert {s.name for f in parse_openmetrics(body.decode()) for s in f.samples} == names
        body, headers = _get(url, **{"Accept-Encoding": "gzip"})
        assert headers["Content-Encoding"] == "gzip"
        assert b"torchdoctor_job_processes{" in gzip.decompress(body)
        body, _ = _get(url + "?name[]=torchdoctor_job_processes")
        assert {f.name for f in text_string_to_metric_families(body.decode())} == {
            "torchdoctor_job_processes"
        }
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, data=b"x"), timeout=10)
        assert refused.value.code == 405
    finally:
        stop(server)
        collector.close()


class _Broken:
    def expose(self, **options) -> bytes:
        raise RuntimeError("no metrics today")


def test_a_scrape_that_fails_answers_500() -> None:
    server = serve(_Broken(), "127.0.0.1", 0)
    try:
        with pytest.raises(urllib.error.HTTPError) as failed:
            _get(f"http://127.0.0.1:{server.server_address[1]}/metrics")
        assert failed.value.code == 500
    finally:
        stop(server)


def test_the_endpoint_binds_ipv6(tmp_path: Path) -> None:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    collector = JobCollector(_recording(tmp_path / "job.sqlite"), findings=False)
    server = serve(collector, "::1", 0)
    try:
        body, _ = _get(f"http://[::1]:{server.server_address[1]}/")
        assert b"torchdoctor_job_recording_up" in body
    finally:
        stop(server)
        collector.close()


def test_a_taken_port_raises_address_in_use() -> None:
    import errno

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError) as exc:
            serve(_Fixed(Families()), "127.0.0.1", taken.getsockname()[1])
    assert exc.value.errno == errno.EADDRINUSE
