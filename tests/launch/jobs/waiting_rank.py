"""A rank that joins its gloo group, writes its PID into the folder it is given (a file named
after its rank), and waits for good: the test decides how it ends."""

import os
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
folder = sys.argv[1]
tmp = os.path.join(folder, f".rank{dist.get_rank()}")
with open(tmp, "w") as fh:
    fh.write(str(os.getpid()))
os.replace(tmp, os.path.join(folder, f"rank{dist.get_rank()}"))  # whole, or not there
while True:
    time.sleep(3600)
