"""The launch plan: what `torchdoctor launch` sets, keeps and refuses (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchdoctor.errors import UserError
from torchdoctor.launch.plan import LaunchOptions, plan_launch
from torchdoctor.launch.preflight import preflight

SCRIPT = [__file__]


def plan(opts=None, env=None, gpus=0):
    opts = opts or LaunchOptions(nproc_per_node="2")
    return plan_launch(
        opts, SCRIPT, env=env or {}, fr_dir=Path("/tmp/x.fr"), gpu_count=gpus, python="py"
    )


def test_one_node_is_standalone_with_threads_per_rank(monkeypatch) -> None:
    monkeypatch.setattr("torchdoctor.launch.plan.whole_cpus_here", lambda: 8)
    p = plan()
    assert p.argv[:5] == ["py", "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    assert p.argv[5:] == SCRIPT
    assert p.added["OMP_NUM_THREADS"] == "4"
    assert p.added["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert p.added["TORCH_FR_DUMP_TEMP_FILE"] == "/tmp/x.fr/fr_trace_rank_"
    assert "CUDA_VISIBLE_DEVICES" not in p.env
    assert not any(k.startswith("NCCL") for k in p.added)


def test_user_settings_are_kept() -> None:
    p = plan(env={"OMP_NUM_THREADS": "3", "TORCH_FR_BUFFER_SIZE": "10"})
    assert "OMP_NUM_THREADS" not in p.added and p.env["OMP_NUM_THREADS"] == "3"
    assert p.env["TORCH_FR_BUFFER_SIZE"] == "10"
    assert "OMP_NUM_THREADS=3 kept (set by you)" in p.notes


def test_gpus_arm_nccl_post_mortem_and_every_rank_sees_every_gpu() -> None:
    p = plan(LaunchOptions(nproc_per_node="auto"), env={"CUDA_VISIBLE_DEVICES": "0,1"}, gpus=2)
    assert p.nproc_per_node == 2
    assert p.added["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert p.added["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert p.added["NCCL_DEBUG_FILE"] == "/tmp/x.fr/nccl.%h.%p.log"
    assert p.env["CUDA_VISIBLE_DEVICES"] == "0,1"  # the same for every rank


def test_auto_without_gpus_is_one_rank() -> None:
    p = plan(LaunchOptions(nproc_per_node="auto"))
    assert p.nproc_per_node == 1
    assert "no GPU" in p.notes[0]


def test_multi_node_is_static_rendezvous_on_the_master() -> None:
    opts = LaunchOptions(
        nproc_per_node="1", nnodes=2, node_rank=1, master_addr="198.18.0.1", master_port=29400
    )
    p = plan(opts)
    assert "--nnodes=2" in p.argv and "--node-rank=1" in p.argv
    assert "--master-addr=198.18.0.1" in p.argv and "--master-port=29400" in p.argv
    assert p.rendezvous == "static 198.18.0.1:29400"


@pytest.mark.parametrize(
    "opts, message",
    [
        (LaunchOptions(nnodes=2), "--nnodes 2 needs --master-addr and --master-port"),
        (
            LaunchOptions(nnodes=2, master_addr="127.0.0.1", master_port=1),
            "is this machine's loopback",
        ),
        (LaunchOptions(nnodes=2, node_rank=2, master_addr="a", master_port=1), "--node-rank 2"),
        (LaunchOptions(standalone=True, master_port=5), "--standalone is for one node"),
        (LaunchOptions(nproc_per_node="x"), "is not a number"),
    ],
)
def test_bad_options(opts, message) -> None:
    with pytest.raises(UserError, match=message):
        plan(opts)


def test_preflight_refuses_a_taken_port_and_too_many_ranks_per_gpu() -> None:
    import socket

    from torchdoctor.sampling.types import GpuInfo, GpuStatus

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        p = plan(LaunchOptions(nproc_per_node="2", master_addr="127.0.0.1", master_port=port))
        gpus = GpuStatus(True, None, gpus=[GpuInfo(0, "A100", "GPU-0", 1, "8.0", 1.0)])
        report = preflight(p, gpu_status=gpus)
    assert any(
        e.startswith("network.rendezvous: ") and "the port is in use by PID" in e
        for e in report.errors
    )
    # the doctor's own check, on the GPUs the launcher read
    assert any(
        e.startswith("gpus.visible: ") and "2 ranks per node planned on 1 visible GPU(s)" in e
        for e in report.errors
    )
