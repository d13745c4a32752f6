"""dataloader-bound: the data-wait share decides; the worker count comes from the figures."""

from __future__ import annotations

from tests.diagnosis.builders import Job, Proc, const, loader, make_steps
from tests.diagnosis.conftest import by_id, evidence, serious
from torchdoctor.diagnosis.rules.dataloader_bound import size_workers
from torchdoctor.thresholds import Thresholds


def job(wait: float, wall: float = 0.1, cpus: int = 8, workers: int = 0, **kw) -> Job:
    procs = [Proc(1000, cpu=kw.pop("trainer_cpu", const(95.0)))]
    procs += [
        Proc(2000 + i, role="dataloader-worker", cpu=const(kw.get("worker_cpu", 90.0)))
        for i in range(workers)
    ]
    kw.pop("worker_cpu", None)
    return Job(
        cpus=cpus,
        procs=procs,
        steps=make_steps(n=300, wall=wall, wait=wait),
        dataloaders=[loader(num_workers=workers, persistent_workers=workers > 0)],
        settings={1000: {"torch.num_threads": cpus}},
        **kw,
    )


def test_below_the_limit_is_silent(run_rules):
    findings = run_rules(job(wait=0.009))  # 9 % < 10 %
    assert "dataloader-bound" not in [f.id for f in findings]
    assert serious(findings) == []


def test_just_above_the_limit_warns(run_rules):
    f = by_id(run_rules(job(wait=0.011)), "dataloader-bound")
    assert f.severity == "warning"
    assert evidence(f, "data wait share") == 11.0


def test_workers_sized_from_load_and_compute(run_rules):
    # 60 ms of 100 ms waits with num_workers=0: one batch takes 60 ms to load, the model
    # computes 40 ms, so 60/40 * 1.2 -> 2 workers keep ahead on 8 idle CPUs.
    f = by_id(run_rules(job(wait=0.06)), "dataloader-bound")
    assert f.severity == "critical"
    assert f.settings == {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 2}
    assert "DataLoader(num_workers=2" in f.recommendation
    assert "60.0 ms of 100 ms" in f.recommendation
    assert "2.4x" in f.expected_effect  # 100 ms -> max(40, 60 / 2) * 1.05 = 42 ms


def test_cgroup_quota_limits_the_workers(run_rules):
    # Loading 300 ms of CPU work per batch against 50 ms of compute: 8 CPUs would take
    # 8 workers, a 1.5-CPU quota only feeds 2.
    wide = by_id(run_rules(job(wait=0.3, wall=0.35)), "dataloader-bound")
    quota = by_id(run_rules(job(wait=0.3, wall=0.35, quota=1.5)), "dataloader-bound")
    assert wide.settings["num_workers"] == 8
    assert quota.settings["num_workers"] == 2
    assert "cgroup quota" in quota.recommendation


def test_existing_workers_that_fall_behind_get_more(run_rules):
    # Two workers, still 40 % waiting: a batch takes 2 * (40 + 60) = 200 ms in one worker,
    # and each worker uses a third of a core (I/O-bound), so 200/60*1.2 -> 4 workers.
    f = by_id(run_rules(job(wait=0.04, workers=2, worker_cpu=33.0)), "dataloader-bound")
    assert f.settings["num_workers"] == 4
    assert evidence(f, "CPU per loading worker") == 33.0


def test_workers_already_use_every_cpu(run_rules):
    f = by_id(run_rules(job(wait=0.05, cpus=2, workers=2, worker_cpu=95.0)), "dataloader-bound")
    assert f.settings == {}
    assert "no CPU to run on" in f.recommendation


def test_a_worker_beside_threads_that_fill_the_cpus_is_not_advised(run_rules):
    # pytorch/examples' vae on 2 CPUs: 2 torch threads, num_workers=0, 4 of 10 ms waiting on
    # data, the trainer on 1.6 CPUs. One worker was predicted 1.3x faster from the unchanged
    # 6 ms of compute and made training 16 % slower: beside a half-busy worker the 2 threads no
    # longer fit in 2 CPUs, and 1 thread may take 2 x 6 ms. Bounded, no worker fix is faster.
    vae = job(wait=0.004, wall=0.01, cpus=2, trainer_cpu=const(160.0))
    f = by_id(run_rules(vae), "dataloader-bound")
    assert f.settings == {}
    assert "x more steps per second" not in f.expected_effect


def test_a_bounded_fix_names_its_threads_and_keeps_its_gain(run_rules):
    # 2 CPUs, 2 threads on 1.6 CPUs, but loading takes 80 of 100 ms: one worker beside one
    # thread (compute at most 2 x 20 ms) still cuts the step to about 42 ms.
    f = by_id(run_rules(job(wait=0.08, cpus=2, trainer_cpu=const(160.0))), "dataloader-bound")
    assert f.settings["num_workers"] >= 1
    assert f.settings["torch.num_threads"] == 1
    assert "compute at its bound beside the workers, 40.0 ms (measured 20.0 ms" in (
        f.recommendation
    )
    predicted = evidence(f, "predicted step time after the fix")
    assert 0.04 <= predicted < 0.09


def test_threshold_is_configurable(run_rules):
    findings = run_rules(job(wait=0.011), Thresholds(data_wait_alert_pct=20.0))
    assert "dataloader-bound" not in [f.id for f in findings]


def short_job(wait_fn) -> Job:
    """20 steps of about 100 ms: under 3 s of steady steps, less than a verdict over time needs."""
    return Job(
        duration=4.0,
        procs=[Proc(1000, cpu=const(95.0))],
        steps=make_steps(n=20, start=1.0, wall=0.1, wait_fn=wait_fn),
        dataloaders=[loader(num_workers=0)],
        settings={1000: {"torch.num_threads": 8}},
    )


def test_a_few_long_waits_in_a_short_run_are_not_a_verdict(run_rules):
    # Three 300 ms stalls (a preempted load on a busy machine) among 20 quick steps: their
    # mean share is well over 10 %, yet the typical step does not wait at all.
    findings = run_rules(short_job(lambda i: 0.3 if i in (5, 10, 15) else 0.001))
    assert "dataloader-bound" not in [f.id for f in findings]
    note = by_id(findings, "short-recording")
    assert "data loading" in note.title
    assert "median step only 1%" in evidence(note, "data loading")


def test_a_short_run_whose_every_step_waits_is_data_bound(run_rules):
    f = by_id(run_rules(short_job(lambda i: 0.06)), "dataloader-bound")
    assert f.severity == "warning"  # 60 of 155 ms
    assert f.settings["num_workers"] >= 1


def test_without_steps_the_rule_is_silent(run_rules):
    findings = run_rules(Job(procs=[Proc(1000, cpu=const(50.0))]))
    assert findings == []


def test_size_workers_model():
    # Compute is the floor: 20 % headroom over load / compute.
    assert size_workers(0.06, 0.04, cpu_per_step=0.1, cpus=8)[0] == 2
    # CPU is the floor: 350 ms of CPU per step on 2 CPUs is 175 ms per step at best.
    workers, predicted = size_workers(0.3, 0.05, cpu_per_step=0.35, cpus=2)
    assert workers == 2
    assert abs(predicted - 0.175 * 1.05) < 1e-9
    # Loading that waits on storage costs little CPU: more workers than CPUs.
    assert size_workers(0.05, 0.015, cpu_per_step=0.02, cpus=2)[0] == 4
    # Other processes leave 0.5 CPU: one worker is all the CPU allows.
    assert size_workers(0.3, 0.05, cpu_per_step=0.35, cpus=0.5)[0] == 1


MERGED = (
    "the work between data waits got 1.09 samples a step, 5 ms apart: steps this short go"
    " unseen and merge into the next, so the step count and rate are lower bounds"
)


def test_merged_sampled_steps_keep_the_fix_and_claim_no_time_per_step(run_rules):
    # An attach whose steps merge: every figure per step is k steps' worth, so the workers,
    # sized from ratios, stay those of the same job seen step by step; no time is quoted.
    plain = by_id(run_rules(job(wait=0.3, wall=0.35)), "dataloader-bound")
    merged = by_id(
        run_rules(job(wait=0.3, wall=0.35, end={"steps_source_limit": MERGED})), "dataloader-bound"
    )
    assert merged.settings == plain.settings and merged.settings["num_workers"] == 8
    assert "300 ms" in plain.recommendation and " ms" not in merged.recommendation
    assert "Loading a batch takes about 6x the compute" in merged.recommendation
    speedup = plain.expected_effect.split(" (")[0]  # "About 6.2x more steps per second"
    assert merged.expected_effect.startswith(speedup) and "per step" not in merged.expected_effect
    assert MERGED in merged.details and merged.confidence == 0.7
    labels = {e.label for e in merged.evidence}
    assert "predicted step time after the fix" not in labels


def test_merged_sampled_steps_without_a_cpu_for_workers_quote_no_step_cost(run_rules):
    kw = {"wait": 0.05, "cpus": 2, "workers": 2, "worker_cpu": 95.0}
    plain = by_id(run_rules(job(**kw)), "dataloader-bound")
    merged = by_id(run_rules(job(**kw, end={"steps_source_limit": MERGED})), "dataloader-bound")
    assert "each step already costs" in plain.recommendation
    assert merged.recommendation.startswith(
        "More workers would have no CPU to run on: the steps' CPU time already fills the"
    )
    assert " ms" not in merged.recommendation and merged.settings == {}
