"""What handing a job to Ray costs: the same 2-rank gloo job plainly under torchrun, under
`torchdoctor launch`, and handed to a local Ray cluster with `torchdoctor handoff --to ray
--submit`.

Goal (issue 45): the step time under Ray within 3 % of torchrun's (the job is the same torchrun,
started by Ray's job supervisor); the whole Ray round trip (submit to SUCCEEDED) and each route's
wall time are reported beside it. The step time is the job's own: rank 0 times its steps after
a warm-up and prints the median. Routes alternate, ``--rounds`` times, so machine noise hits all
of them; the medians are compared.

The Ray head is started here (``ray start --head --block``, 2 CPUs, 80 MB object store, the
dashboard on 127.0.0.1 for the job API) in a process group of its own and stopped by it.
Usage: ``python benchmarks/handoff_overhead.py [--rounds 2] [--steps 300]``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scorecard import Scorecard

BIN = Path(sys.executable).parent
JOB = """
import os, statistics, sys, time
import torch, torch.distributed as dist
from torch import nn
steps = int(sys.argv[1])
torch.set_num_threads(1)
dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(64, 256)
times = []
for i in range(steps):
    t0 = time.perf_counter()
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    print(f"step_ms {statistics.median(times[10:]) * 1000:.4f}", flush=True)
dist.destroy_process_group()
"""
STEP = re.compile(r"step_ms ([0-9.]+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step_ms(text: str) -> float:
    m = STEP.search(text)
    if not m:
        raise SystemExit(f"no step time in the job's output:\n{text[-2000:]}")
    return float(m.group(1))


def plain(script: Path, steps: int) -> tuple[float, float]:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(steps)],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    return time.monotonic() - t0, _step_ms(out.stdout)


def launch(script: Path, steps: int, runs: Path) -> tuple[float, float]:
    t0 = time.monotonic()
    out = subprocess.run(
        [str(BIN / "torchdoctor"), "launch", "--quiet", "--out-dir", str(runs),
         "--nproc-per-node", "2", "--", str(script), str(steps)],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    return time.monotonic() - t0, _step_ms(out.stdout)


def on_ray(address: str, script: Path, steps: int, rec: Path, runs: Path) -> tuple[float, float]:
    from ray.job_submission import JobSubmissionClient

    t0 = time.monotonic()
    job_id = subprocess.run(
        [str(BIN / "torchdoctor"), "handoff", "--to", "ray", "--from", str(rec),
         "--address", address, "--recordings", str(runs), "--submit", "--",
         sys.executable, str(script), str(steps)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout.strip()  # fmt: skip
    client = JobSubmissionClient(address)
    while str(client.get_job_status(job_id)) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        time.sleep(0.2)
    wall = time.monotonic() - t0
    status = str(client.get_job_status(job_id))
    if status != "SUCCEEDED":
        raise SystemExit(f"Ray job {job_id}: {status}")
    return wall, _step_ms(client.get_job_logs(job_id))


def start_ray(temp: str) -> tuple[subprocess.Popen, str]:
    dashboard = _free_port()
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus", "2",
         "--object-store-memory", "80000000", "--node-ip-address", "127.0.0.1",
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
         "--port", str(_free_port()), "--ray-client-server-port", str(_free_port()),
         "--dashboard-agent-listen-port", str(_free_port()), "--temp-dir", temp,
         "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )  # fmt: skip
    from ray.job_submission import JobSubmissionClient

    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.monotonic() + 120
    while True:
        try:
            JobSubmissionClient(address).list_jobs()
            return head, address
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline or head.poll() is not None:
                stop_ray(head)
                raise SystemExit("the Ray head did not come up in 120 s") from None
            time.sleep(1)


def stop_ray(head: subprocess.Popen) -> None:
    """The head's process group: `ray stop` would stop every Ray on the machine."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and head.poll() is None:
            time.sleep(0.5)
    head.wait(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    card = Scorecard("handoff_overhead")
    with tempfile.TemporaryDirectory(prefix="tdho-", dir="/tmp") as tmp:
        work = Path(tmp)
        script = work / "job.py"
        script.write_text(JOB)
        runs = work / "runs"
        rec = work / "job.sqlite"
        subprocess.run(
            [str(BIN / "torchdoctor"), "run", "--quiet", "--out", str(rec), "--",
             sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", str(script), "30"],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        head, address = start_ray(str(work / "ray"))
        try:
            results: dict[str, list[tuple[float, float]]] = {
                "torchrun": [],
                "launch": [],
                "ray": [],
            }
            for _ in range(args.rounds):
                results["torchrun"].append(plain(script, args.steps))
                results["launch"].append(launch(script, args.steps, runs))
                results["ray"].append(on_ray(address, script, args.steps, rec, runs))
        finally:
            stop_ray(head)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(s for _, s in v))
           for k, v in results.items()}  # fmt: skip
    for route, (wall, step) in med.items():
        card.info(f"{route}: wall, step", f"{wall:.1f} s, {step:.3f} ms per step")
    ratio = med["ray"][1] / med["torchrun"][1]
    card.check("step time under Ray / under torchrun", ratio, f"{ratio:.3f}", at_most=1.03)
    card.info("Ray round trip (submit to SUCCEEDED)", f"{med['ray'][0]:.1f} s")
    card.info("launch / torchrun step time", f"{med['launch'][1] / med['torchrun'][1]:.3f}")
    return card.exit_code()


if __name__ == "__main__":
    sys.exit(main())
