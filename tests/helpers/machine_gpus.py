"""What the real NVML of this machine reports, read once per test session.

Tests that record the real machine assert what it has: no GPU here (and on CI) means
"unavailable, with a reason"; on a GPU machine it means every device NVML sees, recorded.
Asking the project's own reader is deliberate: the test then checks that the recording (or
the screen) says the same as a fresh read of the machine, not that the machine has no GPU.
"""

from __future__ import annotations

import functools

from torchdoctor.sampling.gpus import GpuReader
from torchdoctor.sampling.types import GpuStatus


@functools.cache
def machine_gpus() -> GpuStatus:
    with GpuReader() as reader:
        return reader.status


def assert_gpu_status_matches(available: bool, reason: str | None, count: int) -> None:
    """``available``/``reason``/``count`` as a recording or a view reports them, against NVML."""
    real = machine_gpus()
    assert available is real.available
    if real.available:
        assert count == len(real.gpus) and count >= 1
    else:
        assert reason, "an unavailable GPU reader must say why"
        assert count == 0
