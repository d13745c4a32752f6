"""The raw cumulative counters the readers keep beside their rates (what Prometheus needs)."""

from __future__ import annotations

import os
import time

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


def _cpu_total(sample) -> float:
    cpu = sample.cpu_seconds
    return 0.0 if cpu is None else sum(getattr(cpu, m) for m in _MODES)


_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def test_host_counters_go_forward_and_agree_with_the_cpu_split() -> None:
    reader = HostReader()
    try:
        b = reader.read()
        deadline = time.monotonic() + 10
        while True:
            # Some CPU time between two consecutive reads, until the kernel's tick counters
            # have moved: /proc/stat counts in ticks of 1/CLK_TCK s, which a fast CPU can
            # finish a fixed amount of work inside (CI saw two equal reads).
            a = b
            sum(i * i for i in range(300_000))
            b = reader.read()
            if _cpu_total(b) > _cpu_total(a) or time.monotonic() > deadline:
                break
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
    modes = _MODES
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
