"""Capture a real example of every command's output for the manual: docs/examples/NAME.txt.

Each command runs for real, on the bundled example job (examples/train.py, a few steps) in a
scratch folder /tmp/td-example, and its output (stdout and stderr as a terminal would show
them) is written below the command line as it was typed. Nothing is typed by hand: re-run this
script and the pages follow.

    python docs/capture_examples.py            # every command (a few minutes on 2 CPUs)
    python docs/capture_examples.py run show   # some of them (run is captured first when needed)

A command that cannot run on this machine (slurm without a Slurm cluster) is skipped and says
why; its page then says it has no captured example.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
OUT = DOCS / "examples"
WORK = Path("/tmp/td-example")
# A small job: the example with small batches, so every capture takes seconds, not minutes.
TRAIN = ["python", "train.py", "--batch-size", "4"]


def _env() -> dict[str, str]:
    src = str(ROOT / "src")
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "PYTHONPATH": f"{src}:{path}" if path else src,
        "XDG_STATE_HOME": str(WORK / "state"),
        # the queue's scheduler leaves soon after its last job
        "TORCHDOCTOR_QUEUE_IDLE_EXIT_S": "5",
        "COLUMNS": "100",
        "NO_COLOR": "1",
    }


def _argv(shown: list[str]) -> list[str]:
    """The command as typed -> the command run: torchdoctor and python are this interpreter."""
    real = []
    for word in shown:
        if word == "torchdoctor":
            real += [sys.executable, "-m", "torchdoctor"]
        elif word == "python":
            real.append(sys.executable)
        else:
            real.append(word)
    return real


def _clean(text: str) -> str:
    return text.replace(sys.executable, "python").replace(str(ROOT / "src"), "<src>")


def run(shown: list[str], timeout: float = 900) -> str:
    # A session of its own: on a timeout the whole tree goes (the job under `torchdoctor run`
    # would outlive its recorder otherwise).
    proc = subprocess.Popen(
        _argv(shown),
        cwd=WORK,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    status = "" if proc.returncode == 0 else f"[exit status {proc.returncode}]\n"
    return f"$ {' '.join(shown)}\n" + _clean(output) + status


def _recording() -> str:
    """The recording of the example job, made by `run` when it is not there yet."""
    found = sorted((WORK / "torchdoctor-runs").glob("*.sqlite"))
    if not found:
        capture("run")
        found = sorted((WORK / "torchdoctor-runs").glob("*.sqlite"))
    return str(found[0].relative_to(WORK))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[str], limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)  # polling a port that is not open yet: there is no event to wait on
    raise RuntimeError(f"nothing listens on port {port}")


def ex_run() -> str:
    return run(["torchdoctor", "run", "--", *TRAIN, "--steps", "6"])


def ex_show() -> str:
    return run(["torchdoctor", "show", _recording()])


def ex_diagnose() -> str:
    return run(["torchdoctor", "diagnose", _recording()])


def ex_compare() -> str:
    """The example job before and after the advice on 2 CPUs (workers, one trainer thread),
    recorded side by side, then compared: `last~1` is the first, `last` the second."""
    steps = ["--steps", "40"]
    for extra in ([], ["--num-workers", "2", "--threads", "1"]):
        run(["torchdoctor", "run", "--quiet", "--", *TRAIN, *steps, *extra])
    return run(["torchdoctor", "compare", "last~1", "last"])


def ex_export() -> str:
    out = run(["torchdoctor", "export", _recording(), "--format", "csv", "--to", "export"])
    listing = sorted(p.name for p in (WORK / "export").iterdir())
    return out + "$ ls export\n" + "\n".join(listing) + "\n"


def ex_report() -> str:
    return run(["torchdoctor", "report", _recording(), "-o", "report.html"])


def ex_attach() -> str:
    # The demo at its own batch size, long enough (about 15 s) for its steps to be sampled.
    job = subprocess.Popen(_argv(["python", "train.py", "--steps", "200"]), cwd=WORK, env=_env())
    try:
        return run(["torchdoctor", "attach", str(job.pid)]).replace(str(job.pid), "PID")
    finally:
        job.wait()


def ex_estimate() -> str:
    shutil.copy(ROOT / "examples" / "estimate_models.py", WORK / "estimate_models.py")
    return run(["torchdoctor", "estimate", "estimate_models.py:gpt_tiny", "--tokens", "256"])


def ex_tune() -> str:
    return run(
        [
            "torchdoctor",
            "tune",
            "--budget",
            "300",
            "--trial-steps",
            "5",
            "--",
            *TRAIN,
            "--steps",
            "30",
        ]
    )


def ex_top() -> str:
    job = subprocess.Popen(_argv([*TRAIN, "--steps", "12"]), cwd=WORK, env=_env())
    try:
        time.sleep(5)  # let the job start its steps: top shows what runs now
        return run(["torchdoctor", "top", "--once"])
    finally:
        job.wait()


def ex_submit() -> str:
    out = run(["torchdoctor", "submit", "--cpus", "1", "--", *TRAIN, "--steps", "4"])
    return out + run(["torchdoctor", "queue", "wait", "1"], timeout=600)


def ex_queue() -> str:
    if not (WORK / "state").exists():
        capture("submit")
    return run(["torchdoctor", "queue"]) + run(["torchdoctor", "queue", "show", "1"])


def ex_doctor() -> str:
    return run(["torchdoctor", "doctor"])


def ex_bench() -> str:
    return run(
        ["torchdoctor", "bench", "allreduce", "--nproc", "2", "--sizes", "64K:4M", "--iters", "5"]
    )


def ex_launch() -> str:
    return run(
        [
            "torchdoctor",
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "train.py",
            "--batch-size",
            "4",
            "--steps",
            "3",
        ]
    )


def ex_sbatch() -> str:
    return run(["torchdoctor", "sbatch", "--from", _recording(), "--", *TRAIN])


def ex_handoff() -> str:
    """A TrainJob manifest sized from the example's recording (no cluster is needed to write
    one; every manifest is checked against the published API models)."""
    return run(
        [
            "torchdoctor",
            "handoff",
            "--to",
            "trainjob",
            "--from",
            _recording(),
            "--image",
            "registry.example.com/team/train:1.0",
            "--",
            *TRAIN,
        ]
    )


def ex_slurm() -> str | None:
    """`slurm status` reads a job a Slurm cluster ran: none is captured on a machine without
    one (the tests start a one-node cluster of their own; see tests/slurm/)."""
    return None


def ex_exporter() -> str:
    port = _free_port()
    shown = ["torchdoctor", "exporter", "--listen", f"127.0.0.1:{port}"]
    server = subprocess.Popen(
        _argv(shown), cwd=WORK, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        _wait_listening(port, server)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
            body = r.read().decode()
    finally:
        server.terminate()
        server.wait()
    lines = body.splitlines()
    shown_lines = lines[:40]
    more = f"... ({len(lines) - 40} more lines)\n" if len(lines) > 40 else ""
    return (
        f"$ {' '.join(shown)} &\n$ curl -s 127.0.0.1:{port}/metrics | head -40\n"
        + "\n".join(shown_lines)
        + "\n"
        + more
    )


EXAMPLES: dict[str, Callable[[], str | None]] = {
    "run": ex_run,
    "attach": ex_attach,
    "show": ex_show,
    "export": ex_export,
    "diagnose": ex_diagnose,
    "compare": ex_compare,
    "report": ex_report,
    "estimate": ex_estimate,
    "tune": ex_tune,
    "top": ex_top,
    "submit": ex_submit,
    "queue": ex_queue,
    "doctor": ex_doctor,
    "bench": ex_bench,
    "launch": ex_launch,
    "sbatch": ex_sbatch,
    "slurm": ex_slurm,
    "handoff": ex_handoff,
    "exporter": ex_exporter,
}
_done: set[str] = set()


def capture(name: str) -> None:
    if name in _done:
        return
    _done.add(name)
    print(f"capturing {name}", flush=True)
    text = EXAMPLES[name]()
    if text is None:
        print(f"  skipped: {name} cannot run here", flush=True)
        return
    (OUT / f"{name}.txt").write_text(text, encoding="utf-8")


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        print(f"capture_examples: unknown command(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "train.py", WORK / "train.py")
    OUT.mkdir(exist_ok=True)
    for name in names or list(EXAMPLES):
        capture(name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
