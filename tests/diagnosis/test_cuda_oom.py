"""CUDA out-of-memory events, one per cause, recorded by the agent's own OOM code from the
statistics shapes a CUDA build of torch returns (every key torch.cuda.memory_stats documents,
segments and blocks as memory_snapshot gives them), then diagnosed from a real recording.

No GPU is needed: the allocator is replaced by its figures, nothing else."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from tests.diagnosis.conftest import by_id
from tests.diagnosis.test_gpu_rules import gpu_job
from torchdoctor.instrument.agent.cuda import CudaMemory, parse_oom_message, phase_of
from torchdoctor.recording.records import JobEvent
from torchdoctor.units import BINARY_UNITS

GiB = 2**30
TOTAL = 80 * GiB  # an A100 80GB, as the observer is told
BUDGET = 0.85 * TOTAL  # the threshold table's best range tops out at 85 %
PARAMS = 2 * GiB


def memory_stats(allocated: int, reserved: int) -> dict:
    """A dict with every key torch.cuda.memory_stats returns (torch/cuda/memory.py)."""
    stats = {}
    for metric in (
        "allocated", "allocated_bytes", "segment", "reserved_bytes", "active", "active_bytes",
        "inactive_split", "inactive_split_bytes", "requested_bytes",
    ):  # fmt: skip
        for pool in ("all", "large_pool", "small_pool"):
            for kind in ("current", "peak", "allocated", "freed"):
                stats[f"{metric}.{pool}.{kind}"] = 0
    for kind in ("current", "peak", "allocated", "freed"):
        stats[f"oversize_allocations.{kind}"] = stats[f"oversize_segments.{kind}"] = 0
    for name in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                 "num_device_free", "max_split_size"):  # fmt: skip
        stats[name] = 0
    for pool, share in (("all", 1.0), ("large_pool", 0.98), ("small_pool", 0.02)):
        stats[f"allocated_bytes.{pool}.current"] = int(allocated * share)
        stats[f"active_bytes.{pool}.current"] = int(allocated * share)
        stats[f"reserved_bytes.{pool}.current"] = int(reserved * share)
        stats[f"inactive_split_bytes.{pool}.current"] = int((reserved - allocated) * share)
    stats["allocated_bytes.all.peak"] = allocated
    stats["num_alloc_retries"] = 3
    stats["num_ooms"] = 1
    return stats


def segments(allocated: int, free_blocks: list[int]) -> list[dict]:
    """memory_snapshot()'s segments: one holding the allocations, one per free block."""
    out = [
        {
            "device": 0, "address": 0x7F0000000000, "total_size": allocated, "stream": 0,
            "segment_type": "large", "segment_pool_id": (0, 0), "allocated_size": allocated,
            "active_size": allocated, "requested_size": allocated,
            "blocks": [{"address": 0x7F0000000000, "size": allocated,
                        "requested_size": allocated, "state": "active_allocated"}],
        }
    ]  # fmt: skip
    for i, size in enumerate(free_blocks):
        used = 20 * 2**20
        out.append({
            "device": 0, "address": 0x7E0000000000 + i * 2**36, "total_size": size + used,
            "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
            "allocated_size": used, "active_size": used, "requested_size": used,
            "blocks": [
                {"address": 0, "size": used, "requested_size": used, "state": "active_allocated"},
                {"address": 0, "size": size, "requested_size": 0, "state": "inactive"},
            ],
        })  # fmt: skip
    return out


class _Agent:
    """What CudaMemory asks of the agent: its step counter, events and flush."""

    def __init__(self, step: int, batch: int, in_backward: bool) -> None:
        self.counter = SimpleNamespace(
            step=step, last_batch_size=batch, backward_depth=int(in_backward)
        )
        self.events: list[tuple[str, dict]] = []

    def event(self, kind: str, detail: dict) -> None:
        self.events.append((kind, detail))

    def flush(self, final: bool = False) -> None:
        pass


def recorded_oom(
    *,
    step,
    allocated,
    reserved,
    requested,
    free_blocks,
    in_backward=False,
    in_optimizer=False,
    total=TOTAL,
    batch=64,
    free=None,
) -> dict:
    """The detail the agent records when the allocator's observer fires."""
    cuda_module = SimpleNamespace(
        is_initialized=lambda: True,
        memory_stats=lambda device=None: memory_stats(allocated, reserved),
        memory=SimpleNamespace(
            memory_snapshot=lambda include_traces=True: segments(allocated, free_blocks)
        ),
    )
    agent = _Agent(step, batch, in_backward)
    cuda = CudaMemory(agent, SimpleNamespace(cuda=cuda_module, _C=SimpleNamespace()))
    free = total - reserved if free is None else free  # None: nothing outside PyTorch
    call = "cuda.on_oom(0, requested, TOTAL, free)"
    # The optimizer's step runs in torch/optim/: the observer sees it on the Python stack.
    where = "/venv/lib/torch/optim/adamw.py" if in_optimizer else "train.py"
    exec(compile(call, where, "exec"), {"cuda": cuda, "requested": requested, "TOTAL": total,
                                        "free": free})  # fmt: skip
    ((kind, detail),) = agent.events
    assert kind == "cuda-oom"
    return detail


def diagnose_oom(run_rules, detail: dict, env: dict | None = None):
    job = gpu_job(used_gib=79.0, autocast=None)
    job.settings[1000].update(
        {"params.bytes": PARAMS, "optimizer.class": "torch.optim.adamw.AdamW"}
    )
    job.settings[1000].update(env or {})
    job.events = [JobEvent(1000, None, job.steps[-1].t_end + 0.1, "cuda-oom", json.dumps(detail))]
    return by_id(run_rules(job), "cuda-oom")


def size(text: str) -> float:
    value, unit = re.fullmatch(r"([0-9.]+) (\w+)", text).groups()
    return float(value) * 1024 ** BINARY_UNITS.index(unit)


def test_activations_get_micro_batches_with_accumulation_that_fit(run_rules):
    # AdamW on 2 GiB of weights: 2 + 2 (grads) + 4 (moments) = 8 GiB; 68 GiB of activations.
    detail = recorded_oom(step=3, allocated=76 * GiB, reserved=77 * GiB, requested=4 * GiB,
                          free_blocks=[GiB // 2], in_backward=True)  # fmt: skip
    assert detail["phase"] == "backward" and detail["largest_free_block_bytes"] == GiB // 2
    assert detail["inactive_split_bytes"] == GiB
    f = diagnose_oom(run_rules, detail)
    assert f.severity == "critical" and "activations held the memory" in f.title
    micro, steps = f.settings["batch_size"], f.settings["gradient_accumulation_steps"]
    assert micro * steps == 64 and micro < 64  # the same global batch
    peak = size(re.search(r"about ([0-9.]+ \w+), within", f.recommendation).group(1))
    assert peak <= BUDGET
    # It is the largest that fits: twice the micro-batch would not.
    per_sample = (72 * GiB) / 64
    assert 8 * GiB + per_sample * micro * 2 > BUDGET or micro * 2 >= 64
    # says how it was sized, and the command that checks it with the estimator
    assert "per-step CUDA memory the job recorded" in f.recommendation
    assert re.search(r"torchdoctor estimate --from \S+job\d+\.sqlite SPEC", f.recommendation)
    assert "bf16 autocast" in f.recommendation


def test_memory_outside_pytorch_comes_off_the_budget(run_rules):
    # 40 GiB held outside PyTorch's reservation (the CUDA context, another process): the
    # observer's free figure says so, and the micro-batch is sized in what is left of 68 GiB.
    outside = 40 * GiB
    detail = recorded_oom(step=3, allocated=36 * GiB, reserved=37 * GiB, requested=4 * GiB,
                          free_blocks=[GiB // 2], in_backward=True,
                          free=TOTAL - 37 * GiB - outside)  # fmt: skip
    f = diagnose_oom(run_rules, detail)
    assert "activations held the memory" in f.title
    held = [e.value for e in f.evidence if e.label.startswith("outside PyTorch")]
    assert held == [outside]
    budget = size(re.search(r"within the ([0-9.]+ \w+) best range", f.recommendation)[1])
    assert budget == pytest.approx(BUDGET - outside, rel=0.01)
    peak = size(re.search(r"about ([0-9.]+ \w+), within", f.recommendation)[1])
    assert peak <= BUDGET - outside


def test_optimizer_state_at_the_first_step_gets_a_lighter_state_that_fits(run_rules):
    detail = recorded_oom(step=0, allocated=60 * GiB, reserved=61 * GiB, requested=8 * GiB,
                          free_blocks=[GiB // 4], in_optimizer=True)  # fmt: skip
    assert detail["phase"] == "optimizer"
    f = diagnose_oom(run_rules, detail)
    assert "optimizer state held the memory" in f.title
    assert f.settings["optimizer"] == "bitsandbytes.optim.AdamW8bit"
    light = size(re.search(r"keeps a quarter of it: about ([0-9.]+ \w+)", f.recommendation)[1])
    assert light <= BUDGET
    assert "PYTORCH_CUDA_ALLOC_CONF" not in f.recommendation


def test_fragmentation_gets_expandable_segments_only_when_off(run_rules):
    # 18 GiB reserved but free, in 1 GiB pieces; 2 GiB asked: the memory is there, in pieces.
    detail = recorded_oom(step=40, allocated=60 * GiB, reserved=78 * GiB, requested=2 * GiB,
                          free_blocks=[GiB] * 18, in_backward=True)  # fmt: skip
    f = diagnose_oom(run_rules, detail)
    assert "fragmentation held the memory" in f.title
    assert f.settings == {"env.PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert "not in one piece" in f.recommendation
    on = diagnose_oom(
        run_rules, detail, {"env.PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    )
    assert "fragmentation" in on.title and on.settings == {}
    assert "already on" in on.recommendation


def test_the_error_message_gives_the_sizes_when_the_observer_did_not_fire():
    message = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
        "of which 1.23 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB "
        "memory in use. Of the allocated memory 75.00 GiB is allocated by PyTorch, and 1.50 GiB "
        "is reserved by PyTorch but unallocated."
    )
    sizes = parse_oom_message(message)
    assert sizes["requested_bytes"] == 2 * GiB
    assert sizes["total_bytes"] == int(79.15 * GiB)
    assert sizes["allocated_bytes"] == 75 * GiB
    assert sizes["reserved_unallocated_bytes"] == int(1.5 * GiB)
    assert phase_of(["/v/torch/autograd/__init__.py", "train.py"]) == "backward"
    assert phase_of(["/v/torch/nn/modules/linear.py", "train.py"]) == "forward"
