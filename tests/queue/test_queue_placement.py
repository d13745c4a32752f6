"""Where waiting jobs go (the pure planner): VRAM promises, line order, backfill, NUMA."""

from __future__ import annotations

import os
import time

from torchdoctor.queue.machine import GpuState, MachineState
from torchdoctor.queue.model import Job
from torchdoctor.queue.placement import Usage, plan
from torchdoctor.units import parse_cpu_list

GIB = 1024**3


def machine(cpus=4, nodes=None, gpus=None) -> MachineState:
    return MachineState(
        gpus=gpus or [],
        gpu_reason=None,
        cpus=list(range(cpus)),
        max_cores=cpus,
        cpu_node=nodes or dict.fromkeys(range(cpus), 0),
        mem_total=64 * GIB,
        mem_available=60 * GIB,
    )


def gpu(index, free_gib=39.5, total_gib=40, numa=None, processes=None) -> GpuState:
    return GpuState(
        index, f"GPU-{index}", "A100", total_gib * GIB, int(free_gib * GIB), numa, processes or {}
    )


def job(job_id, **kw) -> Job:
    return Job(
        id=job_id, name=f"j{job_id}", argv=["x"], env={}, cwd="/", submitted_at=time.time(), **kw
    )


def test_a_starting_job_s_declared_vram_counts_until_nvml_shows_it():
    m = machine(gpus=[gpu(0, free_gib=39.5)])
    starting = job(1, gpus=1, vram=30 * GIB, assigned_gpus=["GPU-0"], assigned_cpus=[0])
    # NVML still shows the GPU free: the promise alone keeps the second job out.
    (d,) = plan(m, [starting], {1: Usage()}, [job(2, gpus=1, vram=30 * GIB)])
    assert not d.start and "GPU 0" in d.reason
    # Once the job holds its memory, NVML's free figure carries it and the promise is spent.
    m = machine(gpus=[gpu(0, free_gib=9.5)])
    (d,) = plan(m, [starting], {1: Usage(vram={"GPU-0": 30 * GIB})}, [job(2, gpus=1, vram=8 * GIB)])
    assert d.start and d.gpus == ["GPU-0"]


def test_whole_gpu_jobs_need_a_gpu_no_one_uses_and_take_the_roomiest():
    m = machine(gpus=[gpu(0, processes={4242: GIB}), gpu(1)])
    (d,) = plan(m, [], {}, [job(1, gpus=1)])
    assert d.gpus == ["GPU-1"]
    (d,) = plan(m, [], {}, [job(1, gpus=2)])
    assert not d.start


def test_priority_then_first_come_first_served():
    m = machine(cpus=2)
    decisions = plan(m, [], {}, [job(1, cpus=1), job(2, cpus=1), job(3, cpus=1, priority=5)])
    started = [d.job_id for d in decisions if d.start]
    assert started == [3, 1]


def test_backfill_never_delays_the_head_of_the_line():
    m = machine(cpus=4)
    running = [job(1, cpus=2, assigned_cpus=[0, 1])]
    # The head needs 3 cores, 2 are free: a 1-core job behind it would take one it waits for.
    decisions = plan(m, running, {}, [job(2, cpus=3), job(3, cpus=1)])
    assert [d.start for d in decisions] == [False, False]
    assert "held for a job ahead" in decisions[1].reason
    # A GPU job waits for its GPU; a CPU job behind it may use cores the head does not need.
    m = machine(cpus=4, gpus=[gpu(0, free_gib=5)])
    decisions = plan(m, [], {}, [job(2, gpus=1, vram=20 * GIB, cpus=1), job(3, cpus=2)])
    assert [d.start for d in decisions] == [False, True]
    assert 0 not in decisions[1].cpus or len(set(decisions[1].cpus)) == 2
    # ... but not the GPU it waits for.
    decisions = plan(m, [], {}, [job(2, gpus=1, vram=20 * GIB), job(3, gpus=1, vram=GIB)])
    assert [d.start for d in decisions] == [False, False]


def test_cores_are_disjoint_and_prefer_the_gpu_s_numa_node():
    nodes = {c: (0 if c < 4 else 1) for c in range(8)}
    m = machine(cpus=8, nodes=nodes, gpus=[gpu(0, numa=1)])
    a, b = plan(m, [], {}, [job(1, gpus=1, vram=GIB, cpus=2), job(2, cpus=3)])
    assert set(a.cpus) <= {4, 5, 6, 7} and len(a.cpus) == 2
    assert not set(a.cpus) & set(b.cpus) and len(b.cpus) == 3
    assert set(b.cpus) <= {0, 1, 2, 3}  # one node when one can hold it


def test_ram_admission_counts_promises_of_running_jobs():
    m = machine()
    running = [job(1, mem=40 * GIB, assigned_cpus=[0])]
    (d,) = plan(m, running, {1: Usage(rss=10 * GIB)}, [job(2, mem=30 * GIB)])
    assert not d.start and "RAM" in d.reason
    (d,) = plan(m, running, {1: Usage(rss=38 * GIB)}, [job(2, mem=30 * GIB)])
    assert d.start  # what the running job holds is already off MemAvailable


def test_cpu_list_format():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


def test_a_free_core_kept_busy_outside_the_queue_is_not_promised():
    m = machine(cpus=2)
    m.cpu_busy = {0: 0.97, 1: 0.05}
    (one,) = plan(m, [], {}, [job(1, cpus=1)], busy_outside=0.9)
    assert one.cpus == [1]
    (two,) = plan(m, [], {}, [job(2, cpus=2)], busy_outside=0.9)
    assert not two.start
    assert "needs 2 core(s), 1 free (CPU 0 (97 %) busy with processes outside the queue)" in (
        two.reason
    )
    (anyway,) = plan(m, [], {}, [job(3, cpus=2)], busy_outside=None)  # a per-user queue
    assert anyway.cpus == [0, 1]
    held = job(4, cpus=1, state="running", assigned_cpus=[0])  # its own job keeps CPU 0 busy
    (beside,) = plan(m, [held], {}, [job(5, cpus=1)], busy_outside=0.9)
    assert beside.cpus == [1]


def test_the_machine_reader_measures_each_cpus_busy_share_between_reads():
    from torchdoctor.queue.machine import MachineReader

    reader = MachineReader()
    try:
        assert reader.read().cpu_busy == {}  # nothing to compare with yet
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            pass  # some work for the CPUs to show
        busy = reader.read().cpu_busy
    finally:
        reader.close()
    assert set(busy) <= set(range(os.cpu_count() or 1)) and busy
    assert all(0.0 <= share <= 1.0 for share in busy.values())
    assert max(busy.values()) > 0.0


def test_the_admins_busy_outside_setting(tmp_path):
    import pytest

    from torchdoctor.errors import UserError
    from torchdoctor.queue.system import load_config

    path = tmp_path / "queue.toml"
    assert load_config(str(tmp_path / "none.toml")).busy_outside == 0.9
    path.write_text("[cores]\nbusy_outside = false\n")
    assert load_config(str(path)).busy_outside is None
    path.write_text("[cores]\nbusy_outside = 0.5\n[limits.users.alice]\ngpus = 1\n")
    config = load_config(str(path))
    assert config.busy_outside == 0.5 and config.limit("alice").gpus == 1
    assert config.limit("bob").gpus is None
    path.write_text("[cores]\nbusy_outside = 3\n")
    with pytest.raises(UserError, match="busy_outside must be a share"):
        load_config(str(path))
    with pytest.raises(UserError, match="queue configuration '/dev/zero' is a character device"):
        load_config("/dev/zero")  # read whole before: a settings file is read as one
