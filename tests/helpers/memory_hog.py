"""A job that joins the memory cgroup named on its command line, then grows until killed.

``memory_hog.py CGROUP_PROCS [STEP_MIB] [PAUSE_S]``: each step keeps STEP_MIB more of touched
memory (bytes filled, so the pages are really charged), like a trainer that keeps its losses
as tensors with their graphs.
"""

import os
import sys
import time

procs, step_mib, pause_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
if procs != "-":
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
kept = []
while True:
    kept.append(b"x" * (step_mib << 20))
    time.sleep(pause_s)
