"""Host-side rules: threads, CPU load, I/O wait, swap, memory growth."""

from __future__ import annotations

from tests.diagnosis.builders import GiB, Gpu, Job, MiB, Proc, const, loader, make_steps
from tests.diagnosis.conftest import by_id, evidence, serious


def ids(findings):
    return [f.id for f in findings]


# -- thread-oversubscription ------------------------------------------------------------------
def threads_job(threads: int, cpus: int = 2, run_queue: float = 14.0, invol: float = 3000.0, **kw):
    extra_host = kw.pop("host", {})
    return Job(
        cpus=cpus,
        procs=[Proc(1000, cpu=const(190.0), threads=threads + 4, involuntary=const(invol))],
        host=lambda t: {"procs_running": run_queue, **extra_host},
        steps=make_steps(n=200, wall=0.05, wait=0.0005),
        settings={1000: {"torch.num_threads": threads}},
        **kw,
    )


def test_32_threads_on_2_cpus_with_contention(run_rules):
    f = by_id(run_rules(threads_job(32)), "thread-oversubscription")
    assert f.severity == "critical"  # 16x more threads than CPUs
    assert f.settings == {"torch.num_threads": 2, "env.OMP_NUM_THREADS": "2"}
    assert f.recommendation.startswith("torch.set_num_threads(2)")
    assert evidence(f, "runnable tasks") == 14.0


def test_many_threads_without_contention_is_silent(run_rules):
    # An idle process with many threads harms nobody: no run queue, no preemption.
    findings = run_rules(threads_job(32, run_queue=1.0, invol=5.0))
    assert "thread-oversubscription" not in ids(findings)


def test_threads_equal_to_cpus_is_silent_even_on_a_busy_machine(run_rules):
    findings = run_rules(threads_job(2, run_queue=14.0))
    assert "thread-oversubscription" not in ids(findings)


def test_cgroup_quota_sets_the_thread_count(run_rules):
    # 8 CPUs in the affinity mask but a 2-CPU quota: 8 threads get throttled.
    job = threads_job(
        8, cpus=8, run_queue=3.0, invol=50.0, quota=2.0, host={"cgroup_throttled_per_s": 0.45}
    )
    f = by_id(run_rules(job), "thread-oversubscription")
    assert f.settings["torch.num_threads"] == 2
    assert "throttled by the cgroup quota" in f.recommendation


def test_busy_workers_count_against_the_threads(run_rules):
    # 4 CPUs: trainer 4 threads + 2 busy workers = 6 compute threads; the workers use 1.8 CPUs,
    # which leaves floor(4 - 1.8) = 2, but the trainer's threads ran on 3 CPUs: 2 threads
    # would take parallelism it used, so the advice keeps 3 (one fewer than it has).
    job = Job(
        cpus=4,
        procs=[
            Proc(1000, cpu=const(300.0), involuntary=const(2000.0)),
            Proc(1001, role="dataloader-worker", cpu=const(90.0)),
            Proc(1002, role="dataloader-worker", cpu=const(90.0)),
        ],
        host=lambda t: {"procs_running": 7.0},
        steps=make_steps(n=200, wall=0.05, wait=0.001),
        dataloaders=[loader(num_workers=2, persistent_workers=True)],
        settings={1000: {"torch.num_threads": 4}},
    )
    f = by_id(run_rules(job), "thread-oversubscription")
    assert f.settings["torch.num_threads"] == 3
    assert evidence(f, "busy DataLoader workers at once") == 2
    assert evidence(f, "CPUs used by the threads of pid 1000") == 3.0
    assert "3 and not fewer: the threads ran on 3.0 CPUs" in f.recommendation
    assert f.expected_effect.startswith("Not slower, by this run's figures")


def test_workers_restarted_each_epoch_count_as_they_overlapped(run_rules):
    # 2 CPUs, 2 trainer threads on 1.5 CPUs, 2 workers an epoch for 9 epochs of 4 s: 18 busy
    # workers in all, never more than 2 at once (the issue: "18 busy workers use 4.5 CPUs").
    # 4 threads on 2 CPUs is contention, but 1 thread would not cover the 1.5 CPUs the
    # trainer used: a note, with no thread count.
    workers = [
        Proc(2000 + 2 * e + w, role="dataloader-worker", cpu=const(25.0), start=e * 4 + 0.2,
             end=e * 4 + 3.8)
        for e in range(9) for w in range(2)
    ]  # fmt: skip
    job = Job(
        cpus=2,
        duration=36.0,
        procs=[Proc(1000, cpu=const(150.0), involuntary=const(400.0)), *workers],
        host=lambda t: {"procs_running": 4.0},
        steps=make_steps(n=300, wall=0.1, wait=0.001),
        dataloaders=[loader(num_workers=2, persistent_workers=False)],
        settings={1000: {"torch.num_threads": 2}},
    )
    f = by_id(run_rules(job), "thread-oversubscription")
    assert evidence(f, "busy DataLoader workers at once") == 2
    # the steady steps' window leaves out the first epoch's warm-up
    assert evidence(f, "busy DataLoader workers in all") >= 16
    assert evidence(f, "compute threads in the job") == 4
    assert f.severity == "info" and f.settings == {}
    assert f.recommendation.startswith("No thread count to advise from this run")


# -- cpu-saturated / cpu-contention -----------------------------------------------------------
def test_cpu_training_using_all_cpus_is_only_a_note(run_rules):
    job = Job(cpus=2, procs=[Proc(1000, cpu=const(196.0))], steps=make_steps(n=200))
    f = by_id(run_rules(job), "cpu-saturated")
    assert f.severity == "info"
    assert serious(run_rules(job)) == []


def test_gpu_job_with_saturated_cpu_warns(run_rules):
    job = Job(
        cpus=4,
        procs=[Proc(1000, cpu=const(390.0))],
        gpus=[Gpu(util=const(35.0))],
        steps=make_steps(
            n=200,
            cuda_reserved=40 * GiB,
            cuda_allocated=10 * GiB,
            cuda_max_allocated=30 * GiB,
            autocast_dtype="bfloat16",
        ),
        dataloaders=[loader(num_workers=3, pin_memory=True, persistent_workers=True)],
        settings={1000: {"torch.num_threads": 1}},
    )
    findings = run_rules(job)
    f = by_id(findings, "cpu-saturated")
    assert f.severity == "warning"
    under = by_id(findings, "gpu-underused")
    assert "cpu-saturated" in under.recommendation


def test_cpu_load_just_below_the_limit_is_silent(run_rules):
    job = Job(cpus=2, procs=[Proc(1000, cpu=const(154.0))], steps=make_steps(n=200))  # 77 %
    assert "cpu-saturated" not in ids(run_rules(job))


def test_other_processes_saturating_the_cpus(run_rules):
    job = Job(cpus=4, procs=[Proc(1000, cpu=const(60.0))], host=lambda t: {"cpu_busy": 97.0})
    f = by_id(run_rules(job), "cpu-contention")
    assert f.severity == "warning"
    assert "cpu-saturated" not in ids(run_rules(job))


def test_one_busy_sample_is_not_sustained(run_rules):
    job = Job(cpus=4, procs=[Proc(1000, cpu=lambda t: 395.0 if 10 <= t < 10.5 else 50.0)])
    assert ids(run_rules(job)) == []


# -- io-wait -----------------------------------------------------------------------------------
def io_job(iowait, read=60 * MiB):
    return Job(
        cpus=4,
        procs=[Proc(1000, cpu=const(40.0), read=const(read))],
        host=lambda t: {"iowait": iowait(t), "procs_blocked": 2, "psi_io_some": 30.0},
        steps=make_steps(n=200, wall=0.15, wait=0.1),
        dataloaders=[loader(num_workers=0)],
    )


def test_io_wait_above_the_limit(run_rules):
    findings = run_rules(io_job(const(18.0)))
    f = by_id(findings, "io-wait")
    assert f.severity == "warning"
    assert evidence(f, "I/O wait share") == 18.0
    assert "pid 1000 (trainer" in f.recommendation
    # 60 MiB/s for 40 s fits in the free RAM: preload it.
    assert "preload the data set into memory" in f.recommendation
    loader_fix = by_id(findings, "dataloader-bound")
    assert f.settings["num_workers"] == loader_fix.settings["num_workers"]


def test_io_wait_just_below_the_limit_is_silent(run_rules):
    assert "io-wait" not in ids(run_rules(io_job(const(4.8))))


def test_io_wait_spike_is_not_sustained(run_rules):
    spike = lambda t: 40.0 if 20 <= t < 21 else 0.5  # noqa: E731
    assert "io-wait" not in ids(run_rules(io_job(spike)))


def test_io_wait_from_other_processes(run_rules):
    job = io_job(const(12.0), read=0.0)
    job.host = lambda t: {"iowait": 12.0, "disk_read_per_s": 300 * MiB}
    f = by_id(run_rules(job), "io-wait")
    assert "other processes" in f.title


# -- swap-thrash -------------------------------------------------------------------------------
def swap_job(rate: float):
    return Job(
        cpus=8,
        mem_total=16 * GiB,
        swap_total=8 * GiB,
        procs=[
            Proc(1000, cpu=const(100.0), rss=const(6 * GiB), uss=const(5 * GiB)),
            *[
                Proc(
                    2000 + i,
                    role="dataloader-worker",
                    cpu=const(50.0),
                    rss=const(3 * GiB),
                    uss=const(1 * GiB),
                )
                for i in range(4)
            ],
        ],
        host=lambda t: {
            "swap_in_per_s": rate / 2,
            "swap_out_per_s": rate / 2,
            "swap_used": int(1.5 * GiB),
            "mem_available": 200 * MiB,
            "major_faults_per_s": 400.0,
        },
        steps=make_steps(n=200),
        dataloaders=[loader(num_workers=4, persistent_workers=True)],
    )


def test_swap_traffic_above_the_limit_frees_memory_with_fewer_workers(run_rules):
    f = by_id(run_rules(swap_job(5e6)), "swap-thrash")
    assert f.severity == "warning"
    # 1.5 GiB in swap, 1 GiB private per worker: two workers fewer.
    assert f.settings == {"num_workers": 2}
    assert "1.50 GiB less memory" in f.recommendation


def test_swap_traffic_below_the_limit_is_silent(run_rules):
    assert "swap-thrash" not in ids(run_rules(swap_job(0.9e6)))


def test_heavy_swapping_is_critical(run_rules):
    assert by_id(run_rules(swap_job(50e6)), "swap-thrash").severity == "critical"


# -- host-memory-leak --------------------------------------------------------------------------
def leak_job(growth_per_s: float, *, noise: float = 0.0, duration: float = 40.0, steps=None):
    import math

    def rss(t: float) -> float:
        return 1.5 * GiB + growth_per_s * t + noise * math.sin(t * 7.3)

    return Job(
        duration=duration,
        procs=[Proc(1000, cpu=const(100.0), rss=rss)],
        steps=steps if steps is not None else make_steps(n=380, wall=0.1, start=1.0),
    )


def test_steady_growth_is_a_leak_with_rate_and_time_to_exhaustion(run_rules):
    f = by_id(run_rules(leak_job(10 * MiB)), "host-memory-leak")  # 10 MiB/s = 1 MiB/step
    assert f.severity == "critical"  # 32 GiB machine: ~28 GiB left / 10 MiB/s < 1 h
    per_step = evidence(f, "growth per step")
    assert abs(per_step - 1 * MiB) < 0.05 * MiB
    assert "1.00 MiB per step" in f.title
    assert "runs out in" in f.recommendation
    assert "loss.item()" in f.recommendation


def test_slow_growth_below_the_minimum_is_silent(run_rules):
    # 1 MiB/s over the 32 s after warm-up: 32 MiB < 64 MiB.
    assert "host-memory-leak" not in ids(run_rules(leak_job(1 * MiB)))


def test_noise_without_a_trend_is_silent(run_rules):
    assert "host-memory-leak" not in ids(run_rules(leak_job(0.0, noise=200 * MiB)))


def test_warm_up_growth_then_flat_is_not_a_leak(run_rules):
    def rss(t: float) -> float:
        return 1 * GiB + min(t, 6.0) * 200 * MiB  # allocator and caches fill, then flat

    job = Job(procs=[Proc(1000, rss=rss)], steps=make_steps(n=380, start=1.0))
    assert "host-memory-leak" not in ids(run_rules(job))


def test_growth_without_steps_is_reported_per_second(run_rules):
    f = by_id(run_rules(leak_job(10 * MiB, steps=[])), "host-memory-leak")
    assert "/s" in f.title


def test_workers_copy_on_access_is_not_a_leak(run_rules):
    def worker_uss(t: float) -> float:
        return 100 * MiB + min(t, 30.0) * 15 * MiB

    job = Job(
        procs=[
            Proc(1000, cpu=const(100.0), rss=const(2 * GiB), uss=const(1.5 * GiB)),
            *[
                Proc(
                    2000 + i,
                    role="dataloader-worker",
                    rss=lambda t: 2 * GiB + t * 15 * MiB,
                    uss=worker_uss,
                )
                for i in range(2)
            ],
        ],
        steps=make_steps(n=380, start=1.0),
        dataloaders=[loader(num_workers=2, persistent_workers=True)],
    )
    findings = run_rules(job)
    assert "host-memory-leak" not in ids(findings)
    f = by_id(findings, "dataloader-copy-on-access")
    assert f.severity == "info"
    assert "NumPy arrays" in f.recommendation


def test_other_processes_leave_fewer_cpus_for_threads(run_rules):
    # 4 CPUs, 16 threads, but other programs keep 2.5 CPUs busy: 1 thread fits what is left,
    # yet the threads ran on 1.5 CPUs: 2 keep that parallelism (cpu-contention says 1).
    job = threads_job(16, cpus=4, run_queue=20.0, host={"cpu_busy": 100.0})
    job.procs = [Proc(1000, cpu=const(150.0), involuntary=const(3000.0))]
    f = by_id(run_rules(job), "thread-oversubscription")
    assert f.settings["torch.num_threads"] == 2
    assert evidence(f, "CPU used by other processes") == 2.5
    contention = by_id(run_rules(job), "cpu-contention")
    assert contention.settings["torch.num_threads"] == 1
