"""A trainer whose 2 DataLoader workers copy a Python list data set (copy-on-access) until the
memory cgroup named on the command line stops them.

``loader_hog.py CGROUP_PROCS``: once torch is imported, the trainer builds a list of Python
floats worth 45 % of the room its anonymous memory leaves in the cgroup (before forking: the
workers share its pages), then iterates a DataLoader with 2 workers. Reading an item updates its reference count, which
writes its page and so copies it into the worker that read it. The list is read in CHUNKS
chunks, batch b reading chunk b % CHUNKS; batches go to the workers in turn and CHUNKS is odd,
so each worker reads every chunk: trainer and list fit, the two workers' copies (2 x 45 %) do
not, whatever the machine. A short sleep per sample spreads the copying over a few seconds,
so that the recorder's samples see the workers grow.
"""

import os
import sys
import time
from pathlib import Path

with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

cgroup = os.path.dirname(sys.argv[1])
# Sized against what the cgroup cannot reclaim (anonymous memory), not its usage: the page
# cache of torch's libraries, charged here on a cold start, is given back under pressure.
v2 = os.path.exists(f"{cgroup}/memory.max")
limit = int(Path(cgroup, "memory.max" if v2 else "memory.limit_in_bytes").read_text())
stat = dict(line.split() for line in Path(cgroup, "memory.stat").read_text().splitlines())
used = int(stat["anon" if v2 else "rss"])
ITEM_BYTES = 40  # a float object (24 B, pymalloc-rounded) and its list slot (8 B)
BATCH = 256
CHUNKS = 7
EPOCHS = 20  # each copies the list twice over: never reached unless the limit holds it all


class ListDataset(Dataset):
    def __init__(self, n: int) -> None:
        # Distinct float objects, one per item, held by a list (not an array).
        self.items = [float(i) for i in range(n)]
        self.window = n // (CHUNKS * BATCH)

    def __len__(self) -> int:
        return 2 * CHUNKS * BATCH

    def __getitem__(self, i: int):
        batch, slot = divmod(i, BATCH)
        start = ((batch % CHUNKS) * BATCH + slot) * self.window
        time.sleep(0.002)
        return torch.tensor(sum(self.items[start : start + self.window]))


data = ListDataset(int(0.45 * (limit - used) / ITEM_BYTES))
model = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(data, batch_size=BATCH, num_workers=2, persistent_workers=True)
for _epoch in range(EPOCHS):
    for batch in loader:
        loss = model(batch.float().unsqueeze(1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
