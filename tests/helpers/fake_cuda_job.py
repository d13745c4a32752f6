"""A queued "GPU job" for the queue tests: allocates memory on the fake GPUs it was given.

It takes its devices from CUDA_VISIBLE_DEVICES as CUDA would (UUIDs of the shared fake machine,
tests/fake_nvml.py), allocates ``--gib`` on each like cudaMalloc (failing as CUDA does when it
does not fit), holds it for ``--hold`` seconds and exits with ``--exit``. It prints what a test
checks: its devices, the device order, its thread variables and its CPU affinity.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fake_nvml

parser = argparse.ArgumentParser()
parser.add_argument("--gib", type=float, default=0.0)
parser.add_argument("--hold", type=float, default=0.0)
parser.add_argument("--exit", type=int, default=0)
parser.add_argument("--say-allocated", action="store_true", help="print 'allocated' once it is")
args = parser.parse_args()

visible = os.environ.get("CUDA_VISIBLE_DEVICES")
print(
    json.dumps(
        {
            "CUDA_VISIBLE_DEVICES": visible,
            "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
            "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
            "MASTER_PORT": os.environ.get("MASTER_PORT"),
            "affinity": sorted(os.sched_getaffinity(0)),
        }
    ),
    flush=True,
)
state = os.environ[fake_nvml.STATE_ENV]
for uuid in [u for u in (visible or "").split(",") if u] if args.gib else []:
    try:
        ok = fake_nvml.allocate(state, uuid, int(args.gib * fake_nvml.GIB))
    except KeyError:
        print(f"CUDA error: invalid device {uuid!r}", flush=True)
        sys.exit(4)
    if not ok:
        print(f"torch.OutOfMemoryError: CUDA out of memory on {uuid}", flush=True)
        sys.exit(3)
if args.say_allocated:
    print("allocated", flush=True)
time.sleep(args.hold)
sys.exit(args.exit)
