"""A real CPU training loop in a process whose torch.cuda answers as a CUDA build would (the
GPU is the only fake): CUDA initialises (torch's lazy-init queue runs, as _lazy_init runs it),
the allocator's statistics and its memory snapshot are those of a job in torch 2.13's shape
(tests/memory/snapshots.py), the history is recorded where the agent starts it."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository

import torch  # noqa: E402
from tests.memory.snapshots import oom_snapshot  # noqa: E402

cuda = torch.cuda
started = []


def take_snapshot() -> dict:
    """The snapshot's step as if it ran just now: what it made before is before the first
    step the recording saw (the buffer counts as parameters), the rest after."""
    snapshot = oom_snapshot(int(time.time() * 1e6) - 1000)
    history = snapshot["device_traces"][0]
    snapshot["device_traces"][0] = [e for e in history if e["action"] != "oom"]
    return snapshot


cuda.memory._record_memory_history = lambda **kwargs: started.append(kwargs)
cuda.memory._snapshot = take_snapshot
cuda.current_device = lambda: 0
cuda.memory_stats = lambda device=None: {"allocated_bytes.all.current": 5 << 30}
cuda.reset_peak_memory_stats = lambda device=None: None
# CUDA initialises: what torch.cuda._lazy_init does after the driver is up.
cuda._initialized = True
for call, _ in list(cuda._queued_calls):
    call()
assert started, "the agent did not start the history at CUDA's initialisation"

model = torch.nn.Linear(32, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.randn(256, 32), torch.randn(256, 4)), batch_size=16
)
for x, y in data:
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
