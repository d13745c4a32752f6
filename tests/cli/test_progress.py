"""Progress is shown on a terminal and never in a pipe (or with --quiet): the same command,
its stderr a pty (python's pty module) or a pipe."""

from __future__ import annotations

import os
import pty
import select
import subprocess

import pytest

from tests.conftest import REPO, TORCHDOCTOR
from tests.helpers.dependencies import require

GPT = f"{REPO / 'examples' / 'estimate_models.py'}:gpt_tiny"
MAX_BATCH = ["estimate", GPT, "--tokens", "16", "--gpu-memory", "64MiB", "--max-batch"]
SWEEP = [
    "bench", "allreduce", "--backend", "gloo", "--nproc", "2", "--sizes", "4K:64K",
    "--ops", "all_reduce", "--iters", "2", "--warmup", "0",
]  # fmt: skip


def _stderr_on_a_pty(args: list[str]) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal (stdout a pipe): status, stdout, the terminal's text."""
    controller, terminal = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen([*TORCHDOCTOR, *args], stdout=subprocess.PIPE, stderr=terminal, env=env)
    os.close(terminal)
    seen = b""
    while True:  # read until the child closes its end (EOF or EIO on Linux)
        ready, _, _ = select.select([controller], [], [], 120)
        if not ready:
            proc.kill()
            raise AssertionError("no output within 120 s")
        try:
            chunk = os.read(controller, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    out = proc.stdout.read().decode()
    proc.wait(timeout=60)
    os.close(controller)
    return proc.returncode, out, seen.decode(errors="replace")


@pytest.mark.parametrize(
    ("args", "says"),
    [(MAX_BATCH, "probing batch sizes: batch 1"), (SWEEP, "all-reduce sweep")],
)
def test_progress_on_a_terminal_and_not_in_a_pipe(args, says):
    require("torch")
    code, out, terminal = _stderr_on_a_pty(args)
    assert code == 0, terminal
    assert says in terminal
    piped = subprocess.run([*TORCHDOCTOR, *args], capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert says.split(":")[0] not in piped.stderr
    assert piped.stdout and says.split(":")[0] not in piped.stdout + out  # stdout: the result


def test_quiet_silences_progress_on_a_terminal():
    require("torch")
    code, out, terminal = _stderr_on_a_pty([*SWEEP, "--quiet"])
    assert code == 0, terminal
    assert "all-reduce sweep" not in terminal and "busbw" in out


def test_bench_rows_show_as_they_finish_on_a_terminal():
    require("torch")
    _, out, terminal = _stderr_on_a_pty(SWEEP)
    # Each size's row was printed on the terminal before the table went to stdout.
    for size in ("4K", "8K", "16K", "32K", "64K"):
        rows = [line.split() for line in terminal.splitlines() if "all_reduce" in line]
        assert any(row[1:2] == [size] for row in rows), terminal
    assert "busbw" in out
