"""The CPU estimate against real CPU runs of the same step (models from the benchmark suite)."""

from __future__ import annotations

import pytest

from torchdoctor.estimate.fitcheck import estimate_workload
from torchdoctor.estimate.measure import measure_cpu_peak
from torchdoctor.estimate.setup import Target, TrainingSetup
from torchdoctor.estimate.spec import load_workload

TOLERANCE = 0.01

CASES = {
    "gpt-sdpa-fp32-adamw": ("gpt_tiny", {"tokens": 64}, TrainingSetup(batch_size=4)),
    "resnet-bn-bf16mixed-sgdm": (
        "resnet",
        {},
        TrainingSetup(batch_size=8, precision="bf16-mixed", optimizer="sgd-momentum"),
    ),
    "lstm-fp32-sgd": ("lstm", {}, TrainingSetup(batch_size=8, optimizer="sgd")),
    "mlp-dropout-bf16-adam-accum": (
        "mlp_dropout",
        {},
        TrainingSetup(batch_size=32, precision="bf16", optimizer="adam", grad_accumulation=2),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_estimate_matches_real_cpu_run(models, case):
    factory, options, setup = CASES[case]
    workload = load_workload(getattr(models, factory), **options)
    estimate = estimate_workload(workload, setup, Target())
    real = measure_cpu_peak(workload, setup)
    # Live tensor bytes, followed on real tensors, and the CPU allocator seen by the profiler.
    assert estimate.tensor_peak == pytest.approx(real.storage_peak, rel=TOLERANCE)
    assert estimate.peak_allocated == pytest.approx(real.allocator_peak, rel=TOLERANCE)
    assert sum(estimate.breakdown.values()) == estimate.peak_allocated


def test_peak_moves_from_optimizer_step_to_backward_as_batch_grows(models):
    """BRIEF: at small batch the peak is in optimizer.step(), at large batch in backward."""
    workload = load_workload(models.mlp_dropout)
    small = estimate_workload(workload, TrainingSetup(batch_size=1), Target())
    large = estimate_workload(workload, TrainingSetup(batch_size=4096), Target())
    assert small.peak_phase == "optimizer"
    assert large.peak_phase in ("forward", "backward")
    assert large.breakdown["activations"] > small.breakdown["activations"]


def test_checkpointing_cuts_activation_memory(models):
    workload = load_workload(models.gpt_tiny, tokens=128)
    plain = estimate_workload(workload, TrainingSetup(batch_size=8), Target())
    checkpointed = estimate_workload(
        workload, TrainingSetup(batch_size=8, checkpointing=True), Target()
    )
    assert checkpointed.activations < plain.activations / 2
    assert any("checkpointing on 4 x Block" in note for note in checkpointed.notes)


def test_a_model_instance_is_estimated_without_touching_it(models):
    import torch

    from torchdoctor.estimate.api import estimate

    model, _ = models.mlp_dropout()
    before = [p.detach().clone() for p in model.parameters()]
    trained = estimate(model, input_shape="1x28x28", batch_size=16)
    inference = estimate(model, input_shape="1x28x28", batch_size=16, inference=True)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    real = measure_cpu_peak(load_workload(lambda: model, input_shape=(1, 28, 28)), trained.setup)
    assert trained.tensor_peak == real.storage_peak
    assert inference.peak_phase == "forward" and inference.peak_allocated < trained.peak_allocated
