"""CPU and response size of one Prometheus scrape: the job endpoint and the host exporter.

The machine gets 20 running jobs of 15 processes each (a shell and 14 children: 300
processes), each recorded by torchdoctor's own Sampler and RecordingWriter and announced in a
private registry, as `torchdoctor run` does. Each recording starts with 60 s of history (120
samples at the default 0.5 s interval, 100 steps/s of step records); before every round each
job gets what one more second adds (2 samples, 100 steps), so a scrape does what it does in
a real 1 s scrape loop: it reads what was recorded since the previous one.

Side by side in one run, interleaved round by round, CPU time of the scraping thread per
scrape (building the families and encoding the text as the endpoint's server does, with
torchdoctor's own encoder for its two, with prometheus_client's generate_latest for the
psutil ones; HTTP framing is left out, it is the same for every variant):

  job endpoint       `torchdoctor run --prometheus`: JobCollector over one recording;
  host exporter      `torchdoctor exporter`: HostCollector reading the host from /proc and
                     all 20 recordings (no GPU here);
  psutil node        node_exporter-style collection with psutil: cpu_times per CPU,
                     virtual_memory, swap_memory, disk_io_counters and net_io_counters per
                     device, getloadavg, PSI read raw, encoded the same way;
  psutil processes   a per-process exporter with psutil (process-exporter style):
                     process_iter over every process with cpu_times, memory_info,
                     num_threads, io_counters, summed per command name.

`--prometheus-client` encodes torchdoctor's families with prometheus_client's generate_latest
too (what the endpoints did before they had their own encoder), for comparison.

Targets: steady scrape of one job <= 3 ms CPU, of the host exporter with 20 jobs <= 40 ms.

The first scrape of each collector reads the whole 60 s history: it is reported apart
(target <= 250 ms). The diagnosis (findings) runs beside the scrapes in a thread of its own,
never inside one, so the scraping thread's CPU time leaves it out. Its first run of every
job starts with the first scrape and takes a few seconds of CPU; the steady rounds are
those after it, when every job's findings are in the scrapes (as on a machine whose
exporter has run a minute: on its budget, 0.5 % of a core, the diagnosis is then rarely
running). The rounds before are reported apart: the thread beside the scrape costs them
more CPU of their own (the GIL handed back and forth, caches shared).

    python benchmarks/scrape_cost.py [--rounds 40] [--jobs 20] [--prometheus-client]
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from job_trees import RecordedJob
from scorecard import Scorecard

CHILDREN = 14
HISTORY_S = 60
STEPS_PER_S = 100
TARGET_JOB_MS = 3.0  # steady scrape of one job, CPU
TARGET_HOST_MS = 40.0  # steady scrape of the host exporter with --jobs (20) jobs, CPU
TARGET_FIRST_MS = 250.0  # the first scrape (whole history; the diagnosis runs beside it)
MAX_WARMUP_ROUNDS = 400  # rounds waited for the first findings of every job at most


class _Job:
    """One running job tree and the recording torchdoctor keeps of it."""

    def __init__(self, folder: Path, index: int) -> None:
        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", f"for i in $(seq {CHILDREN}); do sleep 3600 & done; wait"],
            start_new_session=True,
        )
        while len(psutil.Process(self.proc.pid).children()) < CHILDREN:
            time.sleep(0.01)  # the shell is still forking: wait for its tree to be complete
        self.path = folder / f"bench-job-{index:02d}.sqlite"
        self.recorded = RecordedJob(
            self.proc.pid, self.path, history_s=HISTORY_S, steps_per_s=STEPS_PER_S
        )

    def advance(self, seconds: float) -> None:
        self.recorded.advance(seconds)

    def close(self) -> None:
        self.recorded.close()
        os.killpg(self.proc.pid, 15)
        self.proc.wait()


def _psutil_node():
    """node_exporter's main host collectors, with psutil."""
    fams = []
    cpu = CounterMetricFamily("node_cpu_seconds", "CPU seconds.", labels=["cpu", "mode"])
    for i, times in enumerate(psutil.cpu_times(percpu=True)):
        for mode, value in times._asdict().items():
            cpu.add_metric([str(i), mode], value)
    fams.append(cpu)
    for name, value in psutil.virtual_memory()._asdict().items():
        if name != "percent":
            fams.append(GaugeMetricFamily(f"node_memory_{name}_bytes", "Memory.", value=value))
    for name, value in psutil.swap_memory()._asdict().items():
        if name != "percent":
            fams.append(GaugeMetricFamily(f"node_swap_{name}_bytes", "Swap.", value=value))
    disk = CounterMetricFamily("node_disk_read_bytes", "Disk.", labels=["device"])
    for dev, io in psutil.disk_io_counters(perdisk=True).items():
        disk.add_metric([dev], io.read_bytes)
    fams.append(disk)
    net = CounterMetricFamily("node_network_receive_bytes", "Net.", labels=["device"])
    for dev, io in psutil.net_io_counters(pernic=True).items():
        net.add_metric([dev], io.bytes_recv)
    fams.append(net)
    for i, value in enumerate(os.getloadavg()):
        fams.append(GaugeMetricFamily(f"node_load{(1, 5, 15)[i]}", "Load.", value=value))
    for name in ("cpu", "memory", "io"):
        try:
            with open(f"/proc/pressure/{name}") as fh:
                total = int(fh.readline().rsplit("total=", 1)[1])
            fams.append(CounterMetricFamily(f"node_pressure_{name}_waiting_seconds",
                                            "PSI.", value=total / 1e6))  # fmt: skip
        except (OSError, IndexError, ValueError):
            pass
    return fams


def _psutil_processes():
    """A per-process exporter: every process, summed per command name."""
    by_name: dict[str, list[float]] = {}
    attrs = ["name", "cpu_times", "memory_info", "num_threads", "io_counters"]
    for p in psutil.process_iter(attrs):
        info = p.info
        acc = by_name.setdefault(info["name"] or "?", [0.0, 0.0, 0.0, 0.0])
        if info["cpu_times"] is not None:
            acc[0] += info["cpu_times"].user + info["cpu_times"].system
        if info["memory_info"] is not None:
            acc[1] += info["memory_info"].rss
        acc[2] += info["num_threads"] or 0
        if info["io_counters"] is not None:
            acc[3] += info["io_counters"].read_bytes
    cpu = CounterMetricFamily("namedprocess_cpu_seconds", "CPU.", labels=["groupname"])
    rss = GaugeMetricFamily("namedprocess_memory_bytes", "RSS.", labels=["groupname"])
    for name, (c, m, _threads, _io) in by_name.items():
        cpu.add_metric([name], c)
        rss.add_metric([name], m)
    return [cpu, rss]


def _encoded_by_client(collector):
    """A scrape encoded by prometheus_client (collect, then generate_latest)."""
    from torchdoctor.exporters.prometheus import registry_for

    registry = registry_for(collector)
    return lambda: generate_latest(registry)


def _diagnosed(body: bytes) -> set[bytes]:
    """The run ids whose findings a scrape carries (their first diagnosis has ended)."""
    return set(re.findall(rb'^torchdoctor_finding_active\{[^}]*run_id="([^"]+)"', body, re.M))


class _Fixed:
    def __init__(self, build) -> None:
        self.build = build

    def collect(self):
        return iter(self.build())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--prometheus-client", action="store_true",
                    help="encode torchdoctor's families with generate_latest")  # fmt: skip
    args = ap.parse_args()
    card = Scorecard("scrape_cost")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        runtime = folder / "runtime"
        runtime.mkdir(mode=0o700)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)  # a registry of our own
        from torchdoctor.exporters.prometheus import HostCollector, JobCollector
        from torchdoctor.recording.registry import active, register
        from torchdoctor.sampling.host import HostReader

        jobs: list[_Job] = []
        collectors: list[JobCollector | HostCollector] = []
        try:
            for i in range(args.jobs):
                jobs.append(_Job(folder, i))
                register(jobs[-1].proc.pid, jobs[-1].path)
            procs = len(psutil.pids())
            print(f"{len(jobs)} jobs, {len(jobs) * (CHILDREN + 1)} job processes, "
                  f"{procs} processes on the machine", flush=True)  # fmt: skip
            host_reader = HostReader()
            job_collector = JobCollector(jobs[0].path)
            host = HostCollector(host_reader, None, lambda: [e.recording_path for e in active()])
            collectors += [job_collector, host]
            if args.prometheus_client:
                ours = {"job endpoint": job_collector, "host exporter": host}
                scrape = {k: _encoded_by_client(c) for k, c in ours.items()}
            else:
                scrape = {"job endpoint": job_collector.expose, "host exporter": host.expose}
            variants = {
                **scrape,
                "psutil node": _encoded_by_client(_Fixed(_psutil_node)),
                "psutil processes": _encoded_by_client(_Fixed(_psutil_processes)),
            }
            cpu: dict[str, list[float]] = {k: [] for k in variants}
            warmup: dict[str, list[float]] = {k: [] for k in variants}
            first: dict[str, float] = {}
            size: dict[str, tuple[int, int]] = {}
            r = steady = 0
            warm = False  # every job's first findings are in the scrapes
            while steady < args.rounds:
                for job in jobs:
                    job.advance(1.0)  # what one second of recording adds (not measured)
                diagnosed = True
                for name, scrape_once in variants.items():
                    t0 = time.thread_time()
                    body = scrape_once()
                    spent = time.thread_time() - t0
                    if name in scrape:
                        expected = 1 if name == "job endpoint" else len(jobs)
                        diagnosed &= len(_diagnosed(body)) == expected
                    if r == 0:
                        first[name] = spent
                    elif warm:
                        cpu[name].append(spent)
                    else:
                        warmup[name].append(spent)
                    size[name] = (len(body), len(gzip.compress(body)))
                if warm:
                    steady += 1
                elif diagnosed:
                    warm = True
                elif r >= MAX_WARMUP_ROUNDS:
                    print(f"the first findings of every job did not come in {r} rounds",
                          file=sys.stderr)  # fmt: skip
                    return 1
                r += 1
            load = os.getloadavg()
        finally:
            for collector in collectors:
                collector.close()  # the diagnosis thread stopped first: it reads the files
            for job in jobs:
                job.close()
    med = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    p90 = {k: sorted(v)[int(0.9 * len(v))] * 1e3 for k, v in cpu.items()}
    card.check(
        "job endpoint CPU per scrape (median, steady)", med["job endpoint"],
        f"{med['job endpoint']:.2f} ms (p90 {p90['job endpoint']:.2f} ms)",
        at_most=TARGET_JOB_MS, target=f"<= {TARGET_JOB_MS:g} ms",
    )  # fmt: skip
    card.check(
        f"host exporter CPU per scrape, {len(jobs)} jobs (median, steady)", med["host exporter"],
        f"{med['host exporter']:.2f} ms (p90 {p90['host exporter']:.2f} ms)",
        at_most=TARGET_HOST_MS, target=f"<= {TARGET_HOST_MS:g} ms",
    )  # fmt: skip
    for name in variants:
        if name not in ("job endpoint", "host exporter"):
            card.info(f"{name} CPU per scrape (median)",
                      f"{med[name]:.2f} ms (p90 {p90[name]:.2f} ms)")  # fmt: skip
    for name in ("job endpoint", "host exporter"):
        card.check(
            f"{name} first scrape (whole history; the diagnosis runs beside it)",
            first[name] * 1e3, f"{first[name] * 1e3:.0f} ms",
            at_most=TARGET_FIRST_MS, target=f"<= {TARGET_FIRST_MS:g} ms",
        )  # fmt: skip
    if warmup["host exporter"]:
        card.info(
            "host exporter CPU per scrape while the first diagnoses ran beside (median)",
            f"{statistics.median(warmup['host exporter']) * 1e3:.2f} ms "
            f"({len(warmup['host exporter'])} rounds before every job's findings were in)",
        )  # fmt: skip
    for name, (plain, gz) in size.items():
        card.info(f"{name} response size", f"{plain / 1024:.1f} KiB ({gz / 1024:.1f} KiB gzip)")
    card.info("load average during the run", f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    return card.exit_code()


if __name__ == "__main__":
    sys.exit(main())
