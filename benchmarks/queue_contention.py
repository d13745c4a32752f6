"""The same CPU training jobs started all at once by hand vs through `torchdoctor submit`.

Four small torch jobs (an MLP, torch's default threads) on this machine:
1. each alone, once with the machine's default threads and once pinned to one core as the
   queue runs it (the per-job baseline);
2. all four started at once by hand: every job runs as many threads as there are CPUs;
3. all four submitted to a private queue (`--cpus 1`): each gets its own core and one thread,
   and the queue runs as many at a time as there are cores.

Targets (issue 13): the queue's makespan is not longer than by hand (ratio <= 1), each queued
job's step time stays within 20 % of the same job alone with the same core; on an idle queue
submit-to-start latency <= 0.5 s and the idle scheduler uses <= 0.1 % of a core.

Shared machine (issue 25, as root only): two real users (made with useradd, removed after)
submit 3 jobs each (`--cpus 1`) at once to the machine-wide queue (`queue serve --system`),
beside the same six jobs started at once by hand. Their jobs run /usr/bin/python3 with the
venv's packages on PYTHONPATH (the users cannot execute an interpreter under /root); the
baselines run the same interpreter. Same targets.

    python benchmarks/queue_contention.py [--steps N] [--no-shared | --shared-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scorecard import Scorecard

JOBS = 4
JOB = """
import json, sys, time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(256, 256), torch.randn(256, 256)
steps = int(sys.argv[1])
times = []
for _ in range(steps):
    t = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    times.append(time.perf_counter() - t)
print(json.dumps({"step_s": sorted(times)[len(times) // 2], "threads": torch.get_num_threads()}))
"""


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def step_of(output: str) -> float:
    return json.loads(output.strip().splitlines()[-1])["step_s"]


def alone(script: Path, steps: int, pinned: bool) -> float:
    env = dict(os.environ)
    kwargs = {}
    if pinned:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        cpu = min(os.sched_getaffinity(0))
        kwargs["preexec_fn"] = lambda: os.sched_setaffinity(0, {cpu})
    done = subprocess.run(
        [sys.executable, str(script), str(steps)], capture_output=True, text=True, env=env,
        check=True, **kwargs,
    )  # fmt: skip
    return step_of(done.stdout)


def by_hand(script: Path, steps: int) -> tuple[float, list[float]]:
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(steps)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(JOBS)
    ]
    outs = [p.communicate()[0] for p in procs]
    return time.monotonic() - start, [step_of(o) for o in outs]


def td(env: dict[str, str], *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "torchdoctor", *args], capture_output=True, text=True, env=env,
        check=True,
    ).stdout  # fmt: skip


def jobs(env: dict[str, str]) -> list[dict]:
    return json.loads(td(env, "queue", "--json"))["jobs"]


def through_queue(script: Path, steps: int, env: dict[str, str]) -> tuple[float, list[float]]:
    start = time.monotonic()
    ids = [td(env, "submit", "-q", "--cpus", "1", "--", sys.executable, str(script), str(steps)).strip()
           for _ in range(JOBS)]  # fmt: skip
    for job_id in ids:
        td(env, "queue", "wait", job_id)
    makespan = time.monotonic() - start
    steps_s = [step_of(td(env, "queue", "logs", job_id)) for job_id in ids]
    return makespan, steps_s


def latency(env: dict[str, str], rounds: int = 5) -> list[float]:
    """Submit-to-start of a trivial job on an idle queue whose scheduler already runs."""
    out = []
    for _ in range(rounds):
        job_id = td(env, "submit", "-q", "--", "true").strip()
        td(env, "queue", "wait", job_id)
        job = next(j for j in jobs(env) if str(j["id"]) == job_id)
        out.append(job["started_at"] - job["submitted_at"])
    return out


def scheduler_cpu(env: dict[str, str], seconds: float) -> float:
    """Share of one core the idle scheduler used over ``seconds``."""
    from torchdoctor.queue.paths import queue_paths
    from torchdoctor.queue.store import QueueStore

    store = QueueStore(queue_paths(env).db)
    pid = int(store.meta("scheduler_pid"))
    store.close()

    def cpu() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before, t0 = cpu(), time.monotonic()
    time.sleep(seconds)
    return (cpu() - before) / (time.monotonic() - t0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--no-shared", action="store_true", help="Skip the two-user part.")
    parser.add_argument("--shared-only", action="store_true", help="Only the two-user part.")
    args = parser.parse_args()
    card = Scorecard("queue_contention")
    if not args.no_shared:
        shared_machine(card, args.steps)
    if args.shared_only:
        return card.exit_code()
    with tempfile.TemporaryDirectory(prefix="tdq-bench-") as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(JOB)
        env = {
            **os.environ,
            "XDG_STATE_HOME": f"{tmp}/state",
            "XDG_RUNTIME_DIR": f"{tmp}/run",
            "TORCHDOCTOR_QUEUE_IDLE_EXIT_S": "120",
        }
        try:
            log("alone...")
            alone_default = alone(script, args.steps, pinned=False)
            log("by hand...")
            hand_span, hand_steps = by_hand(script, args.steps)
            log("through the queue, between two runs alone on one core...")
            # The per-job baseline is taken right before and right after the queued jobs, so
            # that other load on the machine weighs on both sides alike.
            before = alone(script, args.steps, pinned=True)
            queue_span, queue_steps = through_queue(script, args.steps, env)
            alone_core = (before + alone(script, args.steps, pinned=True)) / 2
            waits = latency(env)
            idle = scheduler_cpu(env, args.idle_seconds)
        finally:
            _stop_scheduler(env)
    ratio = queue_span / hand_span
    card.check(
        "makespan, queue / by hand", ratio,
        f"{ratio:.2f} ({queue_span:.1f} s vs {hand_span:.1f} s)", at_most=1.0,
    )  # fmt: skip
    worst = max(queue_steps) / alone_core
    card.check(
        "queued job step time / alone on the same core (worst of 4)", worst,
        f"{worst:.2f} ({max(queue_steps) * 1e3:.1f} ms vs {alone_core * 1e3:.1f} ms)", at_most=1.2,
    )  # fmt: skip
    card.info(
        "by hand: job step time / alone with default threads (worst of 4)",
        f"{max(hand_steps) / alone_default:.2f} ({max(hand_steps) * 1e3:.1f} ms vs "
        f"{alone_default * 1e3:.1f} ms)",
    )
    card.check(
        "submit-to-start on an idle queue (median of 5)", statistics.median(waits),
        f"{statistics.median(waits):.3f} s (max {max(waits):.3f} s)", at_most=0.5,
    )  # fmt: skip
    card.check(
        "idle scheduler CPU", idle * 100, f"{idle * 100:.3f} % of one core", at_most=0.1,
    )  # fmt: skip
    load = os.getloadavg()
    card.info("load average at the end", f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    return card.exit_code()


SHARED_USERS, SHARED_JOBS_EACH = 2, 3
SYSTEM_PYTHON = "/usr/bin/python3"


def shared_machine(card: Scorecard, steps: int) -> None:
    """2 users x 3 jobs through the machine-wide queue vs by hand vs alone (root only)."""
    import shutil
    import sysconfig

    if os.getuid() != 0 or shutil.which("useradd") is None or not os.access(SYSTEM_PYTHON, os.X_OK):
        card.info(
            "shared machine (2 users x 3 jobs)", "skipped: needs root, useradd and /usr/bin/python3"
        )
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import signal

    from tests.queue.shared import SharedMachine, preload

    preload()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still removes the users
    base = Path(tempfile.mkdtemp(prefix="tdq-bench-shared-", dir="/tmp"))
    os.chmod(base, 0o755)
    machine = SharedMachine(base, [])
    machine.config.write_text("")
    site = sysconfig.get_paths()["purelib"]  # the venv's torch, importable by anyone
    machine.pythonpath = os.pathsep.join([machine.pythonpath, site])
    script = base / "job.py"
    script.write_text(JOB)
    script.chmod(0o644)
    n = SHARED_USERS * SHARED_JOBS_EACH
    env = {**os.environ, "PYTHONPATH": site}
    command = [SYSTEM_PYTHON, str(script), str(steps)]
    try:
        users = [machine.add_user() for _ in range(SHARED_USERS)]
        machine.start_scheduler()
        log("shared machine: alone on one core...")
        pinned = {
            **env,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
        }
        cpu = min(os.sched_getaffinity(0))

        def one_alone() -> float:
            done = subprocess.run(command, capture_output=True, text=True, env=pinned, check=True,
                                  preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))  # fmt: skip
            return step_of(done.stdout)

        before = one_alone()
        log(f"shared machine: {n} jobs by hand...")
        start = time.monotonic()
        procs = [
            subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)
        ]
        hand_steps = [step_of(p.communicate()[0]) for p in procs]
        hand_span = time.monotonic() - start
        log(f"shared machine: {SHARED_USERS} users x {SHARED_JOBS_EACH} jobs through the queue...")
        import threading

        ids: list[int] = []
        t0 = time.time()

        def submit(user) -> None:
            for _ in range(SHARED_JOBS_EACH):
                ids.append(machine.submit(user, "--cpus", "1", "--", *command))

        threads = [threading.Thread(target=submit, args=(u,)) for u in users]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        jobs = [machine.ended(i) for i in ids]
        queue_span = max(j.ended_at for j in jobs) - t0
        bad = [j for j in jobs if j.state != "done"]
        if bad:
            raise RuntimeError(f"queued jobs failed: {[(j.id, j.reason) for j in bad]}")
        queue_steps = [step_of(Path(j.log).read_text()) for j in jobs]
        alone_core = (before + one_alone()) / 2
        overlaps = sum(
            1
            for a in jobs
            for b in jobs
            if a.id < b.id
            and set(a.assigned_cpus) & set(b.assigned_cpus)
            and not (a.ended_at <= b.started_at or b.ended_at <= a.started_at)
        )
    finally:
        machine.close()
        shutil.rmtree(base, ignore_errors=True)
    ratio = queue_span / hand_span
    card.check(
        "shared machine: makespan, queue / by hand (2 users x 3 jobs)", ratio,
        f"{ratio:.2f} ({queue_span:.1f} s vs {hand_span:.1f} s)", at_most=1.0,
    )  # fmt: skip
    worst = max(queue_steps) / alone_core
    card.check(
        "shared machine: queued job step time / alone on one core (worst of 6)", worst,
        f"{worst:.2f} ({max(queue_steps) * 1e3:.1f} ms vs {alone_core * 1e3:.1f} ms)", at_most=1.2,
    )  # fmt: skip
    card.info(
        "shared machine: by hand, job step time / alone on one core (worst of 6)",
        f"{max(hand_steps) / alone_core:.2f} ({max(hand_steps) * 1e3:.1f} ms)",
    )
    card.check(
        "shared machine: two users' jobs on the same core at the same time", overlaps,
        str(overlaps), at_most=0,
    )  # fmt: skip


def _stop_scheduler(env: dict[str, str]) -> None:
    import signal

    from torchdoctor.queue.paths import queue_paths
    from torchdoctor.queue.processes import is_alive
    from torchdoctor.queue.store import QueueStore

    db = queue_paths(env).db
    if not db.exists():
        return
    store = QueueStore(db)
    pid, start = store.meta("scheduler_pid"), store.meta("scheduler_start")
    store.close()
    if pid and start and start != "None" and is_alive(int(pid), int(start)):
        os.kill(int(pid), signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
