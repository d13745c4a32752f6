"""What a profiler window costs the job (issue 42): step time before, inside and after a window
armed by `torchdoctor run --profile-steps A-B`, the stall of the step that closes it (the
export), and the trace's size per step.

A small CPU MLP (256-512-512-10, batch 64, OMP_NUM_THREADS=1) runs STEPS steps under
`torchdoctor run`; the figures come from the recording's own steps (the agent's step times):

  before   median of the steps from 20 to A-2 (past start-up, before the warm-up step)
  inside   median of the active steps A..B (torch.profiler's overhead on every op)
  after    median of the steps from B+2 on (the window gone: the same as before, within noise)
  warm-up  step A-1: the profiler's start and the warm-up cycle that sizes the window
  closing  step B+1 minus `before`: the export of the trace, on the training thread

Target: after / before <= 1.10 (the window leaves nothing behind).

    python benchmarks/profile_cost.py [--steps 400] [--window 150-159] [--pure-python]
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from scorecard import Scorecard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from torchdoctor.recording import open_recording  # noqa: E402

TARGET_AFTER_RATIO = 1.10
LOOP = textwrap.dedent(
    """
    import sys, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    for _ in range(int(sys.argv[1])):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    """
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--window", default="150-159")
    parser.add_argument("--pure-python", action="store_true", help="the agent's Python path")
    args = parser.parse_args()
    first, last = map(int, args.window.split("-"))
    card = Scorecard("profile_cost")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHDOCTOR_")}
    env["OMP_NUM_THREADS"] = "1"
    if args.pure_python:
        env["TORCHDOCTOR_AGENT_PURE_PYTHON"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        loop = Path(folder) / "loop.py"
        loop.write_text(LOOP)
        out = Path(folder) / "run.sqlite"
        command = [sys.executable, "-m", "torchdoctor", "run", "--quiet", "--out", str(out)]
        command += ["--profile-steps", args.window, "--", sys.executable, str(loop)]
        subprocess.run([*command, str(args.steps)], env=env, check=True, capture_output=True)
        with open_recording(out) as rec:
            walls = {r["step"]: r["wall_s"] for r in rec.steps()}
            (window,) = rec.profile_windows()
        if window.trace_path is None:
            print(f"no trace: {window.reason}")
            return 1
        with gzip.open(window.trace_path, "rb") as fh:
            json_bytes = sum(len(chunk) for chunk in iter(lambda: fh.read(1 << 20), b""))
    before = statistics.median(walls[s] for s in range(20, first - 1))
    inside = statistics.median(walls[s] for s in range(first, window.last_step + 1))
    after = statistics.median(walls[s] for s in range(window.last_step + 2, args.steps))
    active = window.last_step - first + 1
    path = "python" if args.pure_python else "compiled"
    card.info("agent path", path)
    card.info("step before the window", f"{before * 1e3:.2f} ms")
    card.info("step inside the window", f"{inside * 1e3:.2f} ms ({inside / before:.2f}x)")
    card.check(
        "step after / before the window",
        after / before,
        f"{after * 1e3:.2f} ms ({after / before:.3f}x)",
        at_most=TARGET_AFTER_RATIO,
    )
    card.info("warm-up step (start, sizing)", f"{walls[first - 1] * 1e3:.1f} ms")
    card.info(
        "closing step stall (export)", f"{(walls[window.last_step + 1] - before) * 1e3:.1f} ms"
    )
    card.info(
        "trace per active step",
        f"{window.trace_bytes / active / 1024:.1f} KiB gzipped, "
        f"{json_bytes / active / 1024:.1f} KiB of JSON ({active} steps, {window.state})",
    )
    return card.exit_code()


if __name__ == "__main__":
    sys.exit(main())
