"""--max-batch: the largest batch that fits a GPU profile, and what to change when none does."""

from __future__ import annotations

import json

from torchdoctor.estimate.api import estimate, max_batch


def test_max_batch_is_the_boundary_between_fitting_and_not(models):
    found = max_batch(models.gpt_tiny, tokens=256, gpu="T4", margin=0.1)
    assert found.batch_size > 1
    # Re-estimated independently: the batch found fits, one more does not.
    fits = estimate(
        models.gpt_tiny,
        tokens=256,
        batch_size=found.batch_size,
        gpu="T4",
        device="cuda",
        margin=0.1,
    )
    over = estimate(
        models.gpt_tiny,
        tokens=256,
        batch_size=found.batch_size + 1,
        gpu="T4",
        device="cuda",
        margin=0.1,
    )
    assert fits.fits is True and over.fits is False
    limit = 15360 * 1024**2 * 0.9
    assert fits.total <= limit < over.total
    # Interpolating on near-linear memory needs a handful of simulated steps, not a bisection.
    assert len(found.probes) <= 8
    assert found.estimate.setup.batch_size == found.batch_size


def test_when_batch_1_does_not_fit_each_alternative_is_re_estimated(models):
    found = max_batch(models.gpt2_small, tokens=64, gpu_memory="3GiB")
    assert found.batch_size == 0
    assert found.estimate is not None and found.estimate.fits is False
    changes = {alt.change.split(" (")[0]: alt.estimate for alt in found.alternatives}
    assert {"bf16 mixed precision", "activation checkpointing", "fused adamw"} <= set(changes)
    sgd = changes["SGD with momentum instead of Adam"]
    assert sgd.setup.optimizer == "sgd-momentum" and sgd.fits is True
    # Adam's two states cost more than SGD's one momentum buffer: 4 B per parameter here.
    assert found.estimate.total - sgd.total >= 4 * found.estimate.parameter_count * 0.9
    for alt in found.alternatives:
        limit = 3 * 1024**3 * (1 - found.estimate.margin)
        assert alt.estimate.fits == (alt.estimate.total <= limit)
    json.dumps(found.to_dict())


def test_gradient_accumulation_is_offered_for_a_batch_that_does_not_fit(models, estimate_cli):
    from tests.estimate.conftest import MODELS_FILE

    code, out, err = estimate_cli(
        f"{MODELS_FILE}:gpt_tiny", "--tokens", "256", "--batch", "2048", "--gpu", "T4", "--json"
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["fits"] is False
    accumulation = [
        a for a in data["alternatives"] if a["change"].startswith("gradient accumulation")
    ]
    assert accumulation and accumulation[0]["fits"] is True
    setup = accumulation[0]["setup"]
    assert setup["batch_size"] * setup["grad_accumulation"] == 2048
