"""The demo (examples/train.py) as it is, with a fixed delay added to every optimizer step (spun on the clock) when
COMPARE_POWER_DELAY_S is set: a slowdown of a known size for benchmarks/compare_power.py.

Both runs of a pair go through this file, so ``torchdoctor compare`` sees one workload (the
script it checks is this one) and the only difference is the delay. The delay is spent inside
``AdamW.step`` (the demo's optimizer), so it lies inside the step the agent times, whatever the
step's other phases do.

    COMPARE_POWER_DELAY_S=0.008 python benchmarks/compare_power_job.py --steps 200
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

DEMO = Path(__file__).resolve().parent.parent / "examples" / "train.py"


def main() -> None:
    delay = float(os.environ.get("COMPARE_POWER_DELAY_S") or 0)
    if delay > 0:
        import torch

        original = torch.optim.AdamW.step

        # Patched on the class before the demo builds its optimizer: torch wraps the class's
        # step with its hooks at construction, so the agent's step timing includes the delay.
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            # Spun, not slept: a spin adds its own length to the step and no more; a sleep adds
            # its length plus what waking costs (the vCPU given back to the host, cold caches),
            # which on this VM came out above the sleep (a 10 % sleep: median ratio 1.127 over
            # 13 pairs; a 5 % one 1.145 and 1.151 in one round), so the slowdown was not known.
            until = time.perf_counter() + delay
            while time.perf_counter() < until:
                pass
            return original(self, *args, **kwargs)

        torch.optim.AdamW.step = step  # type: ignore[method-assign]
    sys.argv = [str(DEMO), *sys.argv[1:]]
    runpy.run_path(str(DEMO), run_name="__main__")


if __name__ == "__main__":
    main()
