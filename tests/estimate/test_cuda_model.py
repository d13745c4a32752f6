"""What a CUDA estimate models differently from the CPU trace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchdoctor.estimate.api import estimate
from torchdoctor.estimate.cuda_emulation import emulate_cuda, sdpa_backend
from torchdoctor.estimate.profiles import find_profile
from torchdoctor.estimate.tracker import LiveStorageTracker


def test_cuda_dropout_keeps_a_one_byte_mask(models):
    cpu = estimate(models.mlp_dropout, batch_size=64)
    cuda = estimate(models.mlp_dropout, batch_size=64, gpu="A100-80GB", device="cuda")
    # Two dropout layers over 64 x 1024 activations: 4-byte float masks on the CPU, bool on CUDA.
    assert cpu.activations - cuda.activations == 3 * 64 * 1024 * 2


@pytest.mark.parametrize(
    ("gpu", "dtype", "head_dim", "mask", "backend"),
    [
        ("A100-80GB", torch.bfloat16, 64, False, "flash"),
        ("H100-80GB", torch.float16, 128, False, "flash"),
        ("A100-80GB", torch.bfloat16, 64, True, "efficient"),
        ("A100-80GB", torch.float32, 64, False, "efficient"),
        ("T4", torch.float16, 64, False, "efficient"),
        ("V100", torch.float16, 64, False, "efficient"),
        ("A100-80GB", torch.bfloat16, 60, False, "math"),
    ],
)
def test_attention_backend_choice(gpu, dtype, head_dim, mask, backend):
    assert sdpa_backend(find_profile(gpu), dtype, head_dim, mask) == backend


def test_fused_attention_on_cuda_saves_no_score_matrix(models):
    cpu = estimate(models.gpt_tiny_dropout, tokens=256, batch_size=4)
    flash = estimate(
        models.gpt_tiny_dropout, tokens=256, batch_size=4, gpu="A100-80GB", device="cuda",
        precision="bf16-mixed",
    )  # fmt: skip
    # The CPU runs attention with dropout on the math path: 4 layers keep 4 x 4 heads x 256 x 256
    # float scores and as many dropout masks; flash attention keeps none of them.
    scores = 4 * 4 * 4 * 256 * 256 * 4
    assert cpu.activations - flash.activations > 2 * scores
    assert any("8 x flash" in note for note in flash.notes)


def test_cuda_autocast_lists_apply_on_top_of_cpu_autocast():
    tracker = LiveStorageTracker()
    x = torch.randn(4, 8)
    weight = torch.randn(8, 8)
    gpu = find_profile("A100-80GB")
    with emulate_cuda(gpu, torch.bfloat16, tracker), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = F.linear(x, weight)
        assert hidden.dtype == torch.bfloat16  # lower-precision list: as CPU autocast
        assert F.layer_norm(hidden, (8,)).dtype == torch.float32  # CUDA's fp32 list
        assert torch.softmax(hidden, -1).dtype == torch.float32  # fp32 accumulation
        assert hidden.exp().dtype == torch.float32
        assert torch.mv(weight, x[0]).dtype == torch.bfloat16  # lowered on CUDA only
    assert F.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"  # restored


def test_foreach_adamw_peaks_in_the_optimizer_step_at_20_bytes_per_parameter(models):
    """BRIEF section 4: foreach AdamW briefly holds ~20 B/param at small batch, fused less."""
    common = dict(tokens=8, batch_size=1, gpu="A100-80GB", device="cuda")
    foreach = estimate(models.gpt2_small, **common)
    fused = estimate(models.gpt2_small, optimizer_impl="fused", **common)
    assert foreach.peak_phase == "optimizer"
    assert 19.5 < foreach.peak_allocated / foreach.parameter_count < 21
    assert fused.peak_allocated < foreach.peak_allocated
    # The foreach temporaries: one parameter-sized list (exp_avg_sq's sqrt).
    assert foreach.breakdown["temporaries"] == pytest.approx(4 * foreach.parameter_count, rel=0.02)


def test_cublas_workspace_is_allocated_and_bigger_on_hopper(models):
    a100 = estimate(models.gpt_tiny, tokens=64, gpu="A100-80GB", device="cuda")
    h100 = estimate(models.gpt_tiny, tokens=64, gpu="H100-80GB", device="cuda")
    assert a100.breakdown["workspaces"] == 8_519_680
    assert h100.breakdown["workspaces"] == 32 * 1024**2
    assert a100.peak_reserved >= a100.peak_allocated
    assert a100.total == a100.peak_reserved + a100.breakdown["CUDA context"]
