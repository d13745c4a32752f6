"""Several nodes on Ray: one torchrun per node, placed by Ray, each node recorded.

Run as the entrypoint of a Ray job (``python -m torchdoctor.handoff.ray_nodes ...``, which
reserves nothing itself): a STRICT_SPREAD placement group holds one bundle per node (the
sized CPUs, GPUs and memory), one actor per bundle runs ``torchdoctor launch --nnodes N
--node-rank i`` with the rendezvous on the first actor's node. The script runs unchanged, each
node writes its own recording into the job's folder, and the job's exit status is the first
failing node's (SkyPilot's pattern, with Ray as the placer).

Why not Ray Train: its TorchTrainer has already called ``init_process_group`` when the script
runs, so a torchrun script's own call fails ("initialize ... twice"); and it groups workers by
node IP, which gives no node ranks on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    parser = argparse.ArgumentParser(prog="torchdoctor.handoff.ray_nodes")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--bundle", required=True, help="JSON: the resources of one node")
    parser.add_argument("--timeout", type=float, default=300.0, help="to place every node")
    parser.add_argument("launch", nargs=argparse.REMAINDER, help="-- torchdoctor launch ARGS")
    args = parser.parse_args(argv)
    launch = args.launch[1:] if args.launch[:1] == ["--"] else args.launch
    bundle: dict[str, float] = json.loads(args.bundle)
    ray.init()  # the job's cluster (RAY_ADDRESS, set by the job supervisor)
    group = placement_group([dict(bundle)] * args.nodes, strategy="STRICT_SPREAD")
    try:
        ray.get(group.ready(), timeout=args.timeout)
    except Exception:  # noqa: BLE001 - GetTimeoutError and its kin: say it in one line
        sys.stderr.write(
            f"torchdoctor: error: Ray could not place {args.nodes} nodes of {bundle} on "
            f"distinct machines in {args.timeout:g} s\n"
        )
        return 1

    @ray.remote
    class Node:
        def address(self) -> tuple[str, int]:
            return ray.util.get_node_ip_address(), _free_port()

        def run(self, words: list[str]) -> int:
            # No shell: the words as they are; the node's GPUs are those Ray gave the actor.
            return subprocess.run(words, check=False).returncode

    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
    if "memory" in bundle:
        options["memory"] = bundle["memory"]
    actors = [
        Node.options(
            **options,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i
            ),
        ).remote()
        for i in range(args.nodes)
    ]
    master_addr, master_port = ray.get(actors[0].address.remote())
    runs = [
        actor.run.remote(
            [
                launch[0],
                "launch",
                "--nnodes",
                str(args.nodes),
                "--node-rank",
                str(i),
                "--master-addr",
                master_addr,
                "--master-port",
                str(master_port),
                *launch[1:],
            ]
        )
        for i, actor in enumerate(actors)
    ]
    statuses = ray.get(runs)
    for i, status in enumerate(statuses):
        print(f"torchdoctor: node {i} exited {status}", flush=True)
    return next((s for s in statuses if s != 0), 0)


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sys.exit(main())
