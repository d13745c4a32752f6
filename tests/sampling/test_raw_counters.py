"""The raw cumulative counters the readers keep beside their rates (what Prometheus needs)."""

from __future__ import annotations

import os

import pytest

from torchdoctor.sampling import procfs
from torchdoctor.sampling.host import HostReader
from torchdoctor.sampling.job import JobReader

PRESSURE = b"""some avg10=1.50 avg60=0.80 avg300=0.20 total=123456789
full avg10=0.10 avg60=0.05 avg300=0.01 total=4567
"""


def test_pressure_totals_are_seconds() -> None:
    assert procfs.parse_pressure_totals(PRESSURE) == (123.456789, 0.004567)
    assert procfs.parse_pressure_totals(PRESSURE.splitlines()[0]) == (123.456789, None)


def test_host_counters_go_forward_and_agree_with_the_cpu_split() -> None:
    reader = HostReader()
    try:
        a = reader.read()
        sum(i * i for i in range(300_000))  # some CPU time between the two reads
        b = reader.read()
    finally:
        reader.close()
    for name in ("ctx_switches", "swap_in_bytes", "swap_out_bytes", "major_faults",
                 "disk_read_bytes", "disk_written_bytes", "psi_cpu_some_s"):  # fmt: skip
        before, after = getattr(a, name), getattr(b, name)
        if before is None:
            assert name in a.unavailable
            continue
        assert after >= before, name
    assert a.cpu_seconds is not None and b.cpu_seconds is not None
    modes = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    delta = {m: getattr(b.cpu_seconds, m) - getattr(a.cpu_seconds, m) for m in modes}
    assert all(d >= 0 for d in delta.values())
    total = sum(delta.values())
    assert total > 0
    if len(reader.allowed_cpus) != os.cpu_count():
        pytest.skip("the split covers the allowed CPUs only; the raw counters the machine")
    # The same ticks: the split's shares are the counters' deltas, up to the tick per CPU by
    # which the kernel's "cpu" line and the sum of its per-CPU lines can differ.
    tick = 1 / procfs.CLK_TCK
    slack = 2 * 100 * len(reader.allowed_cpus) * tick / total
    for m in modes:
        assert getattr(b.cpu, m) == pytest.approx(100 * delta[m] / total, abs=slack + 1e-6)


def test_process_io_bytes_are_cumulative() -> None:
    reader = JobReader(os.getpid())
    try:
        (first,) = [p for p in reader.read()[0] if p.pid == os.getpid()]
        (second,) = [p for p in reader.read()[0] if p.pid == os.getpid()]
    finally:
        reader.close()
    if first.read_bytes is None:
        assert "read_bytes" in first.unavailable
        pytest.skip(first.unavailable["read_bytes"])
    assert second.read_bytes >= first.read_bytes >= 0
    assert second.write_bytes >= first.write_bytes >= 0
    assert first.read_bytes_per_s is None  # no rate at the first sample, the counter is there
