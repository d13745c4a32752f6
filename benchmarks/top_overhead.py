"""Overhead of `torchdoctor top` at a 1 s refresh with 300 processes on the machine.

Goal (issue 7): <= 2 % of one core. Measured as the CPU time (utime + stime from
/proc/<pid>/stat) a monitor process spends over a wall-clock window, after a warm-up that
leaves its imports and first scans out, in the same run and under the same 300 processes as
the baselines:

- ``torchdoctor``: the interactive refresh path, once a second: TopCollector.read() (host,
  NVML, discovery of PyTorch processes, JobReader per job, registry), build_view() and the rich
  rendering of an 120 x 40 screen to a terminal console writing to /dev/null;
- ``psutil-scan``: an htop-like psutil loop: per-core CPU, memory, swap, load and, for every
  process, cpu_percent, memory_info, num_threads and cmdline;
- ``glances``: ``glances -q`` (all plugins, no display);
- ``nvitop-host``: the calls nvitop's host panel makes each refresh (``nvitop.host`` cpu/memory/
  swap/load). nvitop looks at GPU processes only, so it scans no process table: a lower bound,
  not a like-for-like.
glances and nvitop are installed by this benchmark into a throwaway venv (PyPI), unless
``--glances PATH`` / ``--nvitop-python PATH`` name existing ones; where that install fails the
row is skipped and the reason printed.

Monitors run one after the other, twice, alternating, so machine noise hits all of them.
Usage: ``python benchmarks/top_overhead.py [--processes 300] [--window 15]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from scorecard import Scorecard

CLK_TCK = os.sysconf("SC_CLK_TCK")

TORCHDOCTOR_LOOP = """
import io, sys, time
from rich.console import Console
from torchdoctor.top.collect import TopCollector
from torchdoctor.top.model import UiState, build_view
from torchdoctor.top.render import render
from torchdoctor.thresholds import Thresholds

th = Thresholds()
collector = TopCollector(th, interval_s=1.0)
console = Console(file=open("/dev/null", "w"), force_terminal=True, width=120, height=40,
                  color_system="truecolor")
state = UiState()
# Ready after the first refresh: it classifies every process on the machine and diagnoses
# every recorded job once (later runs are on the diagnosis' CPU budget), a start-up the
# measured window leaves out. The line says how many jobs top found, how many recorded.
readings = collector.read()
print("ready", len(readings.jobs), sum(j.recording is not None for j in readings.jobs),
      flush=True)
next_t = time.monotonic()
while True:
    readings = collector.read()
    console.print(render(build_view(readings, th, state), 120, 40))
    next_t += 1.0
    time.sleep(max(0.0, next_t - time.monotonic()))
"""

PSUTIL_LOOP = """
import time, psutil
attrs = ["cpu_percent", "memory_info", "num_threads", "cmdline", "name", "ppid"]
print("ready", flush=True)
next_t = time.monotonic()
while True:
    psutil.cpu_times_percent(percpu=True)
    psutil.virtual_memory(); psutil.swap_memory(); psutil.getloadavg()
    rows = [p.info for p in psutil.process_iter(attrs)]
    next_t += 1.0
    time.sleep(max(0.0, next_t - time.monotonic()))
"""

NVITOP_HOST_LOOP = """
import time
from nvitop import host
print("ready", flush=True)
next_t = time.monotonic()
while True:
    host.cpu_percent(percpu=True); host.virtual_memory(); host.swap_memory()
    host.load_average()
    next_t += 1.0
    time.sleep(max(0.0, next_t - time.monotonic()))
"""

TORCH_JOB = """
import os, sys, torch, torch.utils.data as tud
torch.set_num_threads(1)
class D(tud.Dataset):
    def __len__(self): return 1000
    def __getitem__(self, i): return os.getpid()
it = iter(tud.DataLoader(D(), batch_size=1, num_workers=2))
next(it); next(it)
print("ready", flush=True)
sys.stdin.read()
"""


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_count() -> int:
    return sum(1 for n in os.listdir("/proc") if n.isdigit())


def torch_jobs() -> str:
    from torchdoctor.recording import registry
    from torchdoctor.top.discover import TorchProcessFinder

    found = TorchProcessFinder().scan()
    return f"{len(found.roots)} ({len(registry.active())} recorded by `torchdoctor run`)"


def measure(
    argv: list[str],
    window: float,
    warmup: float,
    wait_ready: bool,
    tick: Callable[[], None] | None = None,
) -> tuple[float, str]:
    """Percent of one core the monitor used over ``window`` seconds after ``warmup``, and
    what its ready line said after "ready". ``tick``, when given, runs once a second all the
    while (what the machine's recorders add to the recordings meanwhile)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    said = ""
    try:
        if wait_ready:
            line = proc.stdout.readline().split(maxsplit=1)
            if not line or line[0] != "ready":
                raise RuntimeError(f"{argv[0]} did not start")
            said = line[1].strip() if len(line) > 1 else ""
        # benchmark timing, not synchronisation: leave start-up out
        _pace(warmup, tick)
        c0, t0 = cpu_seconds(proc.pid), time.monotonic()
        _pace(window, tick)
        c1, t1 = cpu_seconds(proc.pid), time.monotonic()
        return 100.0 * (c1 - c0) / (t1 - t0), said
    finally:
        proc.kill()
        proc.wait()


def _pace(seconds: float, tick: Callable[[], None] | None) -> None:
    """Let ``seconds`` pass, running ``tick`` once a second meanwhile."""
    end = next_tick = time.monotonic()
    end += seconds
    while (now := time.monotonic()) < end:
        if tick is not None and now >= next_tick:
            tick()
            next_tick += 1.0
        wake = min(end, next_tick) if tick is not None else end
        time.sleep(max(0.0, wake - time.monotonic()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=300)
    parser.add_argument("--window", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--glances", default=None, help="default: installed in a throwaway venv")
    parser.add_argument("--nvitop-python", default=None, help="default: the same throwaway venv")
    args = parser.parse_args()

    extra: list[subprocess.Popen] = []
    job = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            glances, nvitop_python = peer_tools(tmp, args.glances, args.nvitop_python)
            # One real PyTorch job (trainer + 2 DataLoader workers) for top to find and group.
            script = Path(tmp) / "train.py"
            script.write_text(TORCH_JOB)
            job = subprocess.Popen(
                [sys.executable, str(script)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            assert job.stdout.readline().strip() == "ready"
            while process_count() < args.processes:
                extra.append(subprocess.Popen(["sleep", "3600"]))
            print(f"processes on the machine: {process_count()} (spawned {len(extra)} + 1 job)")
            print(f"PyTorch jobs on the machine for top to follow: {torch_jobs()}")

            monitors: dict[str, tuple[list[str], bool]] = {
                "torchdoctor top": ([sys.executable, "-c", TORCHDOCTOR_LOOP], True),
                "psutil-scan": ([sys.executable, "-c", PSUTIL_LOOP], True),
            }
            if os.access(glances, os.X_OK):
                monitors["glances -q"] = ([glances, "-q", "-t", "1"], False)
            else:
                print(f"glances not found at {glances}: skipped")
            nvitop_ok = os.access(nvitop_python, os.X_OK) and (
                subprocess.run(
                    [nvitop_python, "-c", "import nvitop"], capture_output=True
                ).returncode
                == 0
            )
            if nvitop_ok:
                monitors["nvitop-host"] = ([nvitop_python, "-c", NVITOP_HOST_LOOP], True)
            else:
                print(f"nvitop not importable with {nvitop_python}: skipped")

            results: dict[str, list[float]] = {name: [] for name in monitors}
            for _ in range(args.rounds):
                for name, (argv, ready) in monitors.items():
                    results[name].append(measure(argv, args.window, args.warmup, ready)[0])
    finally:
        for p in extra:
            p.kill()
        for p in extra:
            p.wait()
        if job is not None:
            with contextlib.suppress(OSError):
                job.stdin.close()
            job.kill()
            job.wait()

    base = sum(results["psutil-scan"]) / len(results["psutil-scan"])
    print(f"\n{'monitor':<18}{'% of one core (per round)':<30}{'mean':>7}{'vs psutil-scan':>16}")
    for name, values in results.items():
        mean = sum(values) / len(values)
        rounds = "  ".join(f"{v:.2f}" for v in values)
        print(f"{name:<18}{rounds:<30}{mean:>6.2f}%{mean / base:>15.2f}x")
    td = sum(results["torchdoctor top"]) / len(results["torchdoctor top"])
    card = Scorecard("top_overhead")
    card.check(
        f"torchdoctor top, {args.processes} processes, 1 s refresh, % of one core",
        td,
        f"{td:.2f} %",
        at_most=2.0,
        target="<= 2 %",
    )
    for name, values in results.items():
        if name != "torchdoctor top":
            card.info(f"{name}, same machine and window", f"{sum(values) / len(values):.2f} %")
    return card.exit_code()


def peer_tools(tmp: str, glances: str | None, nvitop_python: str | None) -> tuple[str, str]:
    """Paths of glances and of a Python that imports nvitop: given, or installed into a
    throwaway venv under ``tmp`` (the peers are measured as users install them)."""
    if glances and nvitop_python:
        return glances, nvitop_python
    venv = os.path.join(tmp, "peers")
    made = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True)
    if made.returncode == 0:
        pip = subprocess.run(
            [os.path.join(venv, "bin", "pip"), "install", "-q", "glances", "nvitop"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if pip.returncode != 0:
            print(f"could not install glances/nvitop: {pip.stderr.strip()[-300:]}")
    return (
        glances or os.path.join(venv, "bin", "glances"),
        nvitop_python or os.path.join(venv, "bin", "python"),
    )


if __name__ == "__main__":
    sys.exit(main())
