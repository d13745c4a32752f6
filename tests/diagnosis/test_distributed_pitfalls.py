"""The distributed-mistake rules on built recordings, for the shapes a CPU test machine cannot
run (a CUDA float16 job), for the figures of the fixes, and for recordings made before the
agent sent these events (nothing claimed, no error). The real 2-rank jobs are in
tests/launch/test_pitfalls.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tests.diagnosis.builders import T0, GiB, Job, Proc, make_steps
from torchdoctor import open_recording
from torchdoctor.diagnosis.engine import diagnose
from torchdoctor.recording.records import JobEvent
from torchdoctor.thresholds import Thresholds

PITFALLS = {
    "data-not-sharded",
    "sampler-seed-mismatch",
    "dataparallel-used",
    "batchnorm-not-synced",
    "accumulation-without-no-sync",
    "unused-parameters-search",
    "fp16-without-scaler",
    "grad-scale-falling",
    "scaling-no-gain",
}


def event(pid: int, rank: int | None, kind: str, detail: dict, t: float = 3.0) -> JobEvent:
    return JobEvent(pid, rank, T0 + t, kind, json.dumps(detail))


def two_ranks(extra: dict[int, list[tuple[str, dict]]] | None = None, **step_kw) -> Job:
    """A 2-rank job (pids 1000, 1001): rank-info, steps, and ``extra`` events per rank."""
    events, steps = [], []
    for rank in (0, 1):
        pid = 1000 + rank
        events.append(event(pid, rank, "rank-info", {"rank": rank, "world_size": 2}, 1.0))
        for kind, detail in (extra or {}).get(rank, []):
            events.append(event(pid, rank, kind, detail))
        steps += [dataclasses.replace(s, rank=rank) for s in make_steps(pid, n=60, **step_kw)]
    return Job(procs=[Proc(1000, role="rank"), Proc(1001, role="rank")], steps=steps, events=events)


def found(job: Job, tmp_path: Path) -> dict[str, dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    with open_recording(job.write(tmp_path / "job.sqlite")) as rec:
        findings = diagnose(rec, Thresholds(), complain=_raise)
    return {f.id: dataclasses.asdict(f) for f in findings if f.id in PITFALLS}


def _raise(message: str) -> None:
    raise AssertionError(message)  # a rule that failed: never silent here


def test_a_recording_without_the_new_events_gets_none_and_no_error(tmp_path: Path) -> None:
    # What the agent sent before these rules: rank-info, steps with DDP figures, no
    # fingerprints, no ddp-model, no sync pattern.
    job = two_ranks(forward_s=0.02, backward_s=0.05, comm_s=0.004, backward_compute_s=0.03)
    assert found(job, tmp_path) == {}


def test_fp16_on_cuda_without_a_scaler_and_with_one(tmp_path: Path) -> None:
    kw = {"autocast_dtype": "float16", "cuda_reserved": 8 * GiB, "cuda_allocated": 6 * GiB}
    job = Job(steps=make_steps(n=50, grad_scaler=False, **kw))
    f = found(job, tmp_path / "a")["fp16-without-scaler"]
    assert 'torch.amp.GradScaler("cuda")' in f["recommendation"]
    assert {e["label"]: e["value"] for e in f["evidence"]}["steps under float16 autocast"] == 50
    assert found(Job(steps=make_steps(n=50, grad_scaler=True, **kw)), tmp_path / "b") == {}
    bf16 = {**kw, "autocast_dtype": "bfloat16"}
    assert found(Job(steps=make_steps(n=50, grad_scaler=False, **bf16)), tmp_path / "c") == {}


def test_distributed_sampler_built_for_one_replica_is_not_sharded(tmp_path: Path) -> None:
    sampler = {"sampler_id": 0, "epoch": 0, "shuffle": True, "seed": 0, "num_replicas": 1,
               "drop_last": False}  # fmt: skip
    job = two_ranks({r: [("sampler-epoch", {**sampler, "sampler_rank": 0})] for r in (0, 1)})
    f = found(job, tmp_path)["data-not-sharded"]
    labels = [e["value"] for e in f["evidence"] if e["label"] == "sampler built for another world"]
    assert "rank 1: DistributedSampler(num_replicas=1, rank=0)" in labels


def test_fingerprints_that_differ_are_sharded(tmp_path: Path) -> None:
    prints = {
        r: [("data-fingerprint", {"loader_id": 0, "epoch": 0, "kind": "indices",
                                  "digest": f"d{r}", "batches": 4, "samples": 256})]
        for r in (0, 1)
    }  # fmt: skip
    assert "data-not-sharded" not in found(two_ranks(prints), tmp_path)


def test_accumulation_saving_is_the_synchronised_time_beyond_compute(tmp_path: Path) -> None:
    # 4 micro-steps per step, each synchronised: backward 40 ms a step (10 ms a micro-step),
    # of which DDP counts 4 ms of compute: 6 ms of synchronisation per micro-step, 3 skipped.
    pattern = {"steps": 60, "accumulating_steps": 60, "micro_steps": 240,
               "synced_micro_steps": 240}  # fmt: skip
    job = two_ranks(
        {r: [("ddp-sync-pattern", pattern)] for r in (0, 1)},
        wall=0.1, backward_s=0.04, comm_s=0.005, backward_compute_s=0.004,
    )  # fmt: skip
    f = found(job, tmp_path)["accumulation-without-no-sync"]
    assert abs(f["settings"]["saving_s_per_step"] - 0.018) < 1e-9
    assert "% 4" in f["recommendation"]


def test_unused_parameters_needed_somewhere_is_not_flagged(tmp_path: Path) -> None:
    model = {"find_unused_parameters": True, "static_graph": False, "batchnorm_layers": 0}
    used = {"steps": 32, "search_ns": 3_200_000, "searches": 32}
    job = two_ranks({
        0: [("ddp-model", model), ("ddp-sync-pattern", {**used, "unused_parameter_size": 0})],
        1: [("ddp-model", model), ("ddp-sync-pattern", {**used, "unused_parameter_size": 288})],
    })  # fmt: skip
    assert "unused-parameters-search" not in found(job, tmp_path / "a")
    job = two_ranks(
        {r: [("ddp-model", model), ("ddp-sync-pattern", {**used, "unused_parameter_size": 0})]
         for r in (0, 1)}
    )  # fmt: skip
    f = found(job, tmp_path / "b")["unused-parameters-search"]
    assert abs(f["settings"]["saving_s_per_step"] - 0.0001) < 1e-9  # 3.2 ms over 32 steps


def test_batchnorm_with_a_large_batch_or_synced_is_not_flagged(tmp_path: Path) -> None:
    model = {"batchnorm_layers": 3, "syncbatchnorm_layers": 0, "batchnorm_names": ["bn1"]}
    small = two_ranks({r: [("ddp-model", model)] for r in (0, 1)}, batch=8)
    assert "batchnorm-not-synced" in found(small, tmp_path / "a")
    large = two_ranks({r: [("ddp-model", model)] for r in (0, 1)}, batch=64)
    assert "batchnorm-not-synced" not in found(large, tmp_path / "b")
    synced = {**model, "syncbatchnorm_layers": 3}
    job = two_ranks({r: [("ddp-model", synced)] for r in (0, 1)}, batch=8)
    assert "batchnorm-not-synced" not in found(job, tmp_path / "c")


def test_bench_scaling_trial_no_faster_than_one_rank(tmp_path: Path) -> None:
    # 2 ranks of 64 samples a step at 0.1 s: 1280 samples/s together, against 1000 for the
    # 1-rank trial: E(2) = 0.64, 1.28x.
    baseline = {"nproc": 1, "samples_per_s": 1000.0, "step_s": 0.064, "cores_per_rank": 2.0}
    bench = {"nproc": 2, "steps": 60, "warmup": 3, "baseline": baseline}
    job = two_ranks(wall=0.1)
    job.end = {"bench_scaling": bench}
    f = found(job, tmp_path / "a")["scaling-no-gain"]
    evidence = {e["label"]: e["value"] for e in f["evidence"]}
    assert evidence["E(2) = speed-up / 2"] == 0.64 and f["severity"] == "info"
    assert f["title"] == "2 ranks are only 1.28x one rank (E(2) = 0.64)"
    job.end = {"bench_scaling": {**bench, "baseline": {**baseline, "samples_per_s": 600.0}}}
    assert "scaling-no-gain" not in found(job, tmp_path / "b")  # E(2) = 1.07
    job.end = {"bench_scaling": {**bench, "baseline": None}}  # the 1-rank trial itself
    assert "scaling-no-gain" not in found(job, tmp_path / "c")
