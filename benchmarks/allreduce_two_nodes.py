"""All-reduce between two "nodes": two network namespaces joined by a veth pair, shaped with tc.

    sudo .venv/bin/python benchmarks/allreduce_two_nodes.py [--rate 200] [--sizes 1M:8M]

One torchrun node per namespace, one rank each, gloo over the veth (GLOO_SOCKET_IFNAME set per
side), `torchdoctor bench allreduce` as the rank's program. Prints rank 0's table: busbw per
size, the ratio against the veth's rated speed (sysfs says 10000 Mbit/s) with the 85 % target,
the likely cause, and busbw as a share of the tc cap (what the link really allows). Needs root;
without it, says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers.netns import netns_unavailable, torchrun_pair, veth_pair  # noqa: E402

PORT = 29518


def run(rate: float | None, sizes: str, iters: int) -> dict:
    with veth_pair(rate_mbit=rate) as pair:
        ranks = torchrun_pair(
            pair, PORT, "-m", "torchdoctor", "bench", "allreduce", "--backend", "gloo",
            "--sizes", sizes, "--iters", str(iters), "--warmup", "2", "--ops", "all_reduce",
            "--json", timeout=600,
        )  # fmt: skip
    for done in ranks:
        if done.returncode != 0:
            raise SystemExit(f"a rank failed: {done.stderr[-1500:]}")
    return json.loads(ranks[0].stdout)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, action="append", help="Mbit/s (repeatable)")
    parser.add_argument("--sizes", default="1M:8M")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    reason = netns_unavailable()
    if reason:
        print(f"skipped: {reason}")
        return 0
    from torchdoctor.doctor.allreduce import result_from_dict
    from torchdoctor.doctor.allreduce_report import format_result

    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    for rate in args.rate or [200.0]:
        doc = run(rate, args.sizes, args.iters)
        print(f"\n--- veth pair shaped to {rate:g} Mbit/s each way ---")
        print(format_result(result_from_dict(doc)))
        cap = rate * 1e6 / 8
        print(f"busbw / tc cap: {doc['peak_busbw'] / cap:.1%} (the share of what the link allows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
