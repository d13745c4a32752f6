"""A trainer whose 2 DataLoader workers copy a Python list data set (copy-on-access) until the
memory cgroup named on the command line stops them.

``loader_hog.py CGROUP_PROCS``: once torch is imported, the trainer builds a list of Python
floats worth 45 % of what its cgroup has left (before forking: the workers share its pages),
then iterates a DataLoader with 2 workers that read every item. Reading updates each object's
reference count, which writes its page and so copies it into the worker: trainer and list fit,
the two workers' copies do not.
"""

import os
import sys
from pathlib import Path

with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

cgroup = os.path.dirname(sys.argv[1])
names = (
    ("memory.current", "memory.max")
    if os.path.exists(f"{cgroup}/memory.max")
    else ("memory.usage_in_bytes", "memory.limit_in_bytes")
)
used, limit = (int(Path(cgroup, name).read_text()) for name in names)
ITEM_BYTES = 40  # a float object (24 B, pymalloc-rounded) and its list slot (8 B)
n_items = int(0.45 * (limit - used) / ITEM_BYTES)


class ListDataset(Dataset):
    def __init__(self, n: int) -> None:
        # Distinct float objects, one per item, held by a list (not an array).
        self.items = [float(i) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        # A window of items per sample, so each read touches many objects' pages.
        start = i * 128 % len(self.items)
        window = self.items[start : start + 128]
        return torch.tensor(sum(window))


data = ListDataset(n_items)
model = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _epoch in range(1000):
    loader = DataLoader(data, batch_size=256, num_workers=2, persistent_workers=True)
    for batch in loader:
        loss = model(batch.float().unsqueeze(1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
