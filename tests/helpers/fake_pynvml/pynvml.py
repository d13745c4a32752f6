"""``import pynvml`` in a process of a queue test: the shared fake machine of tests/fake_nvml.py.

Tests put this folder first on PYTHONPATH and name the machine file in FAKE_NVML_STATE, so the
scheduler, the recorders and the jobs they start all see the same simulated GPUs.
"""

import importlib.util
import os
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "fake_nvml", Path(__file__).resolve().parents[2] / "fake_nvml.py"
)
_fake = importlib.util.module_from_spec(_spec)
sys.modules["fake_nvml"] = _fake
_spec.loader.exec_module(_fake)

sys.modules[__name__] = _fake.SharedFakeNvml(os.environ[_fake.STATE_ENV])
