"""Run a training script as a job holding memory on a fake GPU (tests/fake_nvml.py).

argv: UUID SCRIPT [ARGS...]. The process takes 1 GiB on the device ``UUID`` of the shared fake
machine (``FAKE_NVML_STATE``) as cudaMalloc would, so NVML lists it as the GPU's user and the
recorder takes that GPU as the job's; then SCRIPT runs in this very process, as ``python
SCRIPT ARGS`` would run it. The training itself stays on the CPU: the GPU is the only fake.
"""

import os
import runpy
import sys
from pathlib import Path

# The repository, not tests/ itself: tests/queue would shadow the standard library's queue.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests import fake_nvml  # noqa: E402

uuid, script, *args = sys.argv[1:]
if not fake_nvml.allocate(os.environ[fake_nvml.STATE_ENV], uuid, fake_nvml.GIB):
    sys.exit("the fake GPU has no GiB free")
sys.path.insert(0, str(Path(script).resolve().parent))  # as `python SCRIPT` puts it first
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
