"""`torchdoctor top` and the host exporter on a box with 100 recorded jobs (issue 46).

Every job is a real PyTorch process tree (a trainer and --workers DataLoader workers, forked
from one process that imported torch, so that each maps libtorch as top's discovery requires
and the box holds 100 of them in the memory of one), recorded as `torchdoctor run` records it
(job_trees.RecordedJob: real snapshots of its tree and steps through the recording writer,
compaction on, a minute of history) and announced in a registry of the benchmark's own. The
benchmark is the jobs' subreaper: it starts and ends them by PID and reaps them.

Side by side in one run, 1 job, then 100, then 1 again (the 99 ended: half withdrawn by their
recorder, half killed without a word, as a recorder killed leaves them):

  top       the refresh `torchdoctor top` runs once a second (top_overhead.TORCHDOCTOR_LOOP:
            read, model, rendering), its CPU from /proc over --window s after its first
            refresh (which diagnoses every job once; later diagnoses are on their CPU budget)
            and --warmup s, the recordings growing meanwhile as their recorders write;
  exporter  `torchdoctor exporter`'s HostCollector scraped as scrape_cost.py scrapes it (each
            round one more second of every recording), CPU of the scraping thread per scrape
            in the rounds after every job's first findings are in.

Targets: top <= 5 % of one core and the exporter's steady scrape <= 100 ms with 100 jobs; the
registry lists exactly the jobs running after each change.

    python benchmarks/many_jobs.py [--jobs 100] [--workers 2] [--window 30] [--rounds 20]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from job_trees import RecordedJob
from scorecard import Scorecard
from top_overhead import TORCHDOCTOR_LOOP, measure

HISTORY_S = 60
STEPS_PER_S = 10
TARGET_TOP_PCT = 5.0
TARGET_SCRAPE_MS = 100.0
PR_SET_CHILD_SUBREAPER = 36
MAX_WARMUP_S = 300  # for every job's first findings

# Imports torch once, forks each job's trainer (a session of its own, its workers forked from
# it as a DataLoader forks them), says "trainer worker..." per job and exits: the trainers are
# then the benchmark's children (its subreaper), each the topmost PyTorch process of its tree.
ZYGOTE = r"""
import os, sys, time
import torch
torch.ones(1)
jobs, workers = int(sys.argv[1]), int(sys.argv[2])
for _ in range(jobs):
    if os.fork() == 0:
        os.setsid()
        kids = []
        for _ in range(workers):
            pid = os.fork()
            if pid == 0:
                while True: time.sleep(1.0)
            kids.append(pid)
        # one write, atomic on a pipe: the trainers write their lines at the same time
        os.write(1, " ".join(map(str, [os.getpid(), *kids])).encode() + b"\n")
        while True: time.sleep(1.0)
"""


# `torchdoctor exporter`'s collector over the registry, scraped at each line read: it answers
# the scraping thread's CPU and the wall time (s) of the scrape and how many jobs' findings
# (their first diagnosis, in its thread beside) the scrape carried.
EXPORTER_LOOP = """
import sys, time
sys.path.insert(0, sys.argv[1])
from scrape_cost import _diagnosed
from torchdoctor.exporters.prometheus import HostCollector
from torchdoctor.recording.registry import active
from torchdoctor.sampling.host import HostReader

host = HostCollector(HostReader(), None, lambda: [e.recording_path for e in active()])
for _ in sys.stdin:
    t0, w0 = time.thread_time(), time.perf_counter()
    body = host.expose()
    spent, took = time.thread_time() - t0, time.perf_counter() - w0
    print(spent, took, len(_diagnosed(body)), flush=True)
host.close()
"""


class Box:
    """The recorded jobs on the machine, by their trainer's PID."""

    def __init__(self, folder: Path, workers: int) -> None:
        self.folder = folder
        self.workers = workers
        self.jobs: dict[int, tuple[list[int], RecordedJob]] = {}
        self.made = 0

    def start(self, n: int) -> None:
        from torchdoctor.recording.compaction import CompactionPolicy
        from torchdoctor.recording.registry import register

        zygote = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, str(n), str(self.workers)],
            stdout=subprocess.PIPE,
            text=True,
        )
        trees = [[int(p) for p in zygote.stdout.readline().split()] for _ in range(n)]
        zygote.stdout.close()
        if zygote.wait() != 0 or any(len(t) != self.workers + 1 for t in trees):
            raise SystemExit("the jobs did not start")
        for root, *kids in trees:
            path = self.folder / f"job-{self.made:03d}.sqlite"
            self.made += 1
            recorded = RecordedJob(
                root,
                path,
                history_s=HISTORY_S,
                steps_per_s=STEPS_PER_S,
                compaction=CompactionPolicy(),
            )
            self.jobs[root] = (kids, recorded)
            register(root, path)

    def stop(self, roots: list[int]) -> None:
        """End these jobs: every other one withdrawn by its recorder first, the rest killed
        without a word; each reaped (the trainer first: its workers are then ours)."""
        from torchdoctor.recording.registry import withdraw

        for n, root in enumerate(roots):
            kids, recorded = self.jobs.pop(root)
            recorded.close()
            if n % 2 == 0:
                withdraw(root)
            os.killpg(root, signal.SIGKILL)
            os.waitpid(root, 0)
            for kid in kids:
                os.waitpid(kid, 0)

    def advance(self) -> None:
        """What one more second of recording adds to every job's recording."""
        for _, recorded in self.jobs.values():
            recorded.advance(1.0)

    def processes(self) -> int:
        return len(self.jobs) * (self.workers + 1)


def registry_matches(box: Box) -> tuple[bool, str]:
    """Whether the registry lists exactly the running jobs, each with its recording."""
    from torchdoctor.recording.registry import active

    listed = {e.pid: e.recording_path for e in active()}
    live = {root: recorded.path.resolve() for root, (_, recorded) in box.jobs.items()}
    text = f"{len(listed)} listed of {len(live)} running"
    if listed != live:
        ended, missing = len(listed.keys() - live.keys()), len(live.keys() - listed.keys())
        wrong = sum(1 for pid in listed.keys() & live.keys() if listed[pid] != live[pid])
        text += f" ({ended} ended, {missing} missing, {wrong} with another recording)"
    return listed == live, text


def top_share(box: Box, window: float, warmup: float) -> tuple[float, str]:
    return measure([sys.executable, "-c", TORCHDOCTOR_LOOP], window, warmup, True, tick=box.advance)


def scrapes(box: Box, rounds: int) -> dict[str, float]:
    """The host exporter's scrapes, one a second as the recordings grow: the first, then
    ``rounds`` steady ones (CPU of the scraping thread and wall time, ms). The exporter runs
    in a process of its own, as on a real box: a process that opens a recording while it
    writes it would lose its SQLite locks when that reader closes the file."""
    exporter = subprocess.Popen(
        [sys.executable, "-c", EXPORTER_LOOP, str(Path(__file__).resolve().parent)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    cpu: list[float] = []
    wall: list[float] = []
    first = None
    warm = False
    warmup = 0  # rounds before every job's first findings were in
    deadline = time.monotonic() + MAX_WARMUP_S
    try:
        next_round = time.monotonic()
        while len(cpu) < rounds:
            box.advance()  # what one second of recording adds (not measured)
            exporter.stdin.write("scrape\n")
            exporter.stdin.flush()
            spent, took, diagnosed = (float(x) for x in exporter.stdout.readline().split())
            if first is None:
                first = spent
            elif warm:
                cpu.append(spent)
                wall.append(took)
            elif diagnosed == len(box.jobs):
                warm = True  # every job's first findings are in: steady from the next round
            elif time.monotonic() > deadline:
                raise SystemExit(
                    f"the first findings of every job did not come in {MAX_WARMUP_S} s"
                )
            else:
                warmup += 1
            next_round += 1.0  # a scrape a second, the recordings a second longer each
            time.sleep(max(0.0, next_round - time.monotonic()))
    finally:
        exporter.stdin.close()
        exporter.wait(60)
    return {
        "first": first * 1e3,
        "cpu": statistics.median(cpu) * 1e3,
        "p90": sorted(cpu)[int(0.9 * len(cpu))] * 1e3,
        "wall": statistics.median(wall) * 1e3,
        "warmup_rounds": warmup,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers per job")
    ap.add_argument("--window", type=float, default=30.0, help="top's measured window, s")
    ap.add_argument("--warmup", type=float, default=8.0, help="after top's first refresh, s")
    ap.add_argument("--rounds", type=int, default=20, help="steady scrapes measured")
    args = ap.parse_args()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit(f"cannot become the jobs' subreaper: {os.strerror(ctypes.get_errno())}")
    card = Scorecard("many_jobs")
    results: list[tuple[int, tuple[float, str], dict[str, float]]] = []
    registry_ok: list[tuple[bool, str]] = []
    with tempfile.TemporaryDirectory(prefix="td-many-") as tmp:
        folder = Path(tmp)
        runtime = folder / "runtime"
        runtime.mkdir(mode=0o700)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)  # a registry of our own, top's too
        box = Box(folder, args.workers)
        try:
            for want in (1, args.jobs, 1):
                if want > len(box.jobs):
                    started = time.monotonic()
                    box.start(want - len(box.jobs))
                    print(
                        f"{len(box.jobs)} jobs running and recorded ({box.processes()} job"
                        f" processes), set up in {time.monotonic() - started:.0f} s",
                        flush=True,
                    )
                elif want < len(box.jobs):
                    box.stop(list(box.jobs)[want:])
                    print(f"ended all but {want} job(s)", flush=True)
                registry_ok.append(registry_matches(box))
                print(f"registry: {registry_ok[-1][1]}", flush=True)
                top = top_share(box, args.window, args.warmup)
                print(f"top: {top[0]:.2f} % of one core (PyTorch jobs found, recorded: {top[1]})")
                scrape = scrapes(box, args.rounds)
                print(
                    f"exporter: first scrape {scrape['first']:.0f} ms, steady"
                    f" {scrape['cpu']:.1f} ms CPU (p90 {scrape['p90']:.1f}, wall"
                    f" {scrape['wall']:.1f}; {scrape['warmup_rounds']} rounds before every"
                    " job's findings were in)",
                    flush=True,
                )
                results.append((len(box.jobs), top, scrape))
        finally:
            box.stop(list(box.jobs))
    (_, top1a, scrape1a), (n, top_n, scrape_n), (_, top1b, scrape1b) = results
    top1 = (top1a[0] + top1b[0]) / 2
    scrape1 = (scrape1a["cpu"] + scrape1b["cpu"]) / 2
    procs = n * (args.workers + 1)
    card.check(
        f"`torchdoctor top` refresh, {n} recorded jobs ({procs} processes), % of one core",
        top_n[0],
        f"{top_n[0]:.2f} % (1 job: {top1:.2f} %, the mean of before and after)",
        at_most=TARGET_TOP_PCT,
        target=f"<= {TARGET_TOP_PCT:g} %",
    )
    card.check(
        f"host exporter CPU per scrape, {n} recorded jobs (median, steady)",
        scrape_n["cpu"],
        f"{scrape_n['cpu']:.1f} ms (p90 {scrape_n['p90']:.1f} ms, wall {scrape_n['wall']:.1f} ms;"
        f" 1 job: {scrape1:.2f} ms)",
        at_most=TARGET_SCRAPE_MS,
        target=f"<= {TARGET_SCRAPE_MS:g} ms",
    )
    card.info(
        f"host exporter first scrape, {n} recorded jobs (every job's history)",
        f"{scrape_n['first']:.0f} ms (1 job: {scrape1a['first']:.0f} ms)",
    )
    found, recorded = (int(x) for x in top_n[1].split())
    card.verdict(
        f"`torchdoctor top` shows every recorded job with its recording, {n} jobs",
        f"{recorded} of {n} ({found} PyTorch jobs on the machine)",
        recorded == n,
        "every one",
    )
    card.verdict(
        f"registry as {n} jobs start and {n - 1} end (half withdrawn, half killed)",
        ", then ".join(text for _, text in registry_ok),
        all(ok for ok, _ in registry_ok),
        "exactly the jobs running",
    )
    return card.exit_code()


if __name__ == "__main__":
    sys.exit(main())
