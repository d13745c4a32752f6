"""Time and peak memory of reading a CUDA memory snapshot's history, per number of entries
(issue 42: what was live at the peak, in bounded memory).

Histories shaped like torch's (tests/memory/snapshots.py long_history: 50 source lines, frame
dicts and the empty frames list shared as torch's py_symbolize shares them, at most 1,000
blocks live) are pickled with protocol 4, as the agent writes them. Side by side, traced by
tracemalloc (Python allocations; the figure is the peak while each runs):

  ours         torchdoctor.diagnosis.cuda_memory.analyse_snapshot: the safe streaming reader
               and the replay (the whole analysis);
  pickle.load  the naive baseline: the file loaded whole with the C unpickler (no analysis,
               and unsafe on a file a job wrote).

Target: ours flat whatever the history's length (it keeps the live blocks and the sums per
line, never the history). Time is reported, not a target: the reader is pure Python.

    python benchmarks/memory_snapshot_read.py [--entries 50000,200000]
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.memory.snapshots import long_history  # noqa: E402

from torchdoctor.diagnosis.cuda_memory import analyse_snapshot  # noqa: E402

MIB = 2**20


def traced(work) -> tuple[float, float]:
    """(seconds, peak MiB of Python allocations) of ``work()``."""
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        work()
        seconds = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return seconds, peak / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", default="50000,200000")
    args = parser.parse_args()
    print("| entries | file | ours: peak, time | pickle.load: peak, time |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for entries in (int(n) for n in args.entries.split(",")):
            path = Path(folder) / f"history-{entries}.pickle"
            path.write_bytes(pickle.dumps(long_history(entries), protocol=4))
            ours_s, ours_mib = traced(lambda p=path: analyse_snapshot(p))
            with open(path, "rb") as f:
                naive_s, naive_mib = traced(lambda f=f: pickle.load(f))
            size = path.stat().st_size / MIB
            print(
                f"| {entries:,} | {size:.1f} MiB | {ours_mib:.1f} MiB, {ours_s:.1f} s "
                f"| {naive_mib:.1f} MiB, {naive_s:.1f} s |"
            )


if __name__ == "__main__":
    main()
