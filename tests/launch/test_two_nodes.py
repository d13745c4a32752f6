"""Two nodes for real: `torchdoctor launch --nnodes 2` in each of two network namespaces joined
by a veth pair (198.18.0.0/15), one recording per node, and `diagnose` of both as one job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.engines import engine
from tests.helpers.netns import netns_unavailable, veth_pair
from torchdoctor import open_recording

pytestmark = engine("network namespaces", netns_unavailable())

JOB = str(Path(__file__).resolve().parent / "jobs" / "ddp_job.py")
PORT = 29555


def test_two_namespaces_one_recording_each_read_as_one_job(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    with veth_pair() as pair:
        procs = []
        for node, end in enumerate((pair.a, pair.b)):
            procs.append(
                pair.popen(
                    end,
                    sys.executable,
                    "-m",
                    "torchdoctor",
                    "launch",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(node),
                    "--master-addr",
                    pair.a.address,
                    "--master-port",
                    str(PORT),
                    "--nproc-per-node",
                    "1",
                    "--out-dir",
                    str(out),
                    "--",
                    JOB,
                    "--samples",
                    "4096",
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )  # fmt: skip
            )
        results = [p.communicate(timeout=300) for p in procs]
        codes = [p.returncode for p in procs]
    for node, (code, (_, err)) in enumerate(zip(codes, results, strict=True)):
        if code != 0:  # in full, under the failure's captured output: an assert's is cut short
            print(f"node {node} exited {code}; its stderr:\n{err}")
    assert codes == [0, 0]
    for node, (end, (_, err)) in enumerate(zip((pair.a, pair.b), results, strict=True)):
        assert (
            f"on node {node} of 2 (world size 2), rendezvous static {pair.a.address}:{PORT}" in err
        )
        assert (
            f"GLOO_SOCKET_IFNAME={end.ifname}: the interface that reaches {pair.a.address}" in err
        )
    # Named <UTC start>-<script>-node<rank>: the nodes start in either order.
    recordings = sorted(out.glob("*.sqlite"), key=lambda r: r.name.split("-")[-1])
    assert [r.name.split("-")[-1] for r in recordings] == ["node0.sqlite", "node1.sqlite"]
    for node, path in enumerate(recordings):
        with open_recording(path) as r:
            ranks = {s["rank"] for s in r.steps()}
            assert ranks == {node}  # each node recorded its own rank's steps
            assert r.meta["launch"]["node_rank"] == node

    from torchdoctor.diagnosis.context import DiagnosisContext
    from torchdoctor.diagnosis.ranks import RankJob
    from torchdoctor.thresholds import Thresholds

    recs = [open_recording(p) for p in recordings]
    try:
        job = RankJob.from_contexts([DiagnosisContext(r, Thresholds()) for r in recs])
    finally:
        for r in recs:
            r.close()
    assert sorted(job.ranks) == [0, 1] and job.world_size == 2
    assert [job.ranks[r].node_rank for r in (0, 1)] == [0, 1]
    assert [len(job.ranks[r].steps) for r in (0, 1)] == [4, 4]  # 4096 samples / 512 / 2 ranks

    for args in ([str(p) for p in recordings], [str(out)]):
        res = subprocess.run(
            [sys.executable, "-m", "torchdoctor", "diagnose", "--json", *args],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        ids = {f["id"] for f in json.loads(res.stdout)["findings"]}
        assert not ids & {"uneven-inputs", "collective-timeout", "ranks-share-gpu"}
