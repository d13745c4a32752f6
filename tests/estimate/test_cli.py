"""`torchdoctor estimate` as a user runs it: a real child process, text and JSON output."""

from __future__ import annotations

import json

from tests.conftest import run_td
from tests.estimate.conftest import MODELS_FILE

GPT = f"{MODELS_FILE}:gpt_tiny"


def test_cpu_estimate_prints_peak_breakdown_modules_and_baselines():
    res = run_td("estimate", GPT, "--tokens", "64", "--batch", "4")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "batch 4, fp32, adamw on CPU" in out
    assert "live tensor bytes on the CPU" in out
    for item in ("parameters", "optimizer state", "activations", "at the peak (step 2, backward)"):
        assert item in out
    assert "blocks.* (Block) x4" in out or "blocks.*." in out  # repeated blocks grouped
    assert "naive formula" in out and "accelerate" in out


def test_json_for_a_cuda_target_adds_up(estimate_cli):
    code, out, err = estimate_cli(
        GPT, "--tokens", "128", "--batch", "8", "--gpu", "A100-80GB",
        "--precision", "bf16-mixed", "--json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert data["target"] == {
        "device": "cuda",
        "gpu": "A100-80GB",
        "gpu_memory_bytes": 81920 * 1024**2,
        "compute_capability": "8.0",
    }
    breakdown = data["breakdown_bytes"]
    allocated_part = sum(
        v for k, v in breakdown.items() if k not in ("allocator overhead", "CUDA context")
    )
    assert allocated_part == data["peak_allocated_bytes"]
    assert (
        data["peak_allocated_bytes"] + breakdown["allocator overhead"]
        == data["peak_reserved_bytes"]
    )
    assert data["peak_reserved_bytes"] + breakdown["CUDA context"] == data["total_bytes"]
    # Every caching-allocator block is a multiple of 512 B.
    assert data["peak_allocated_bytes"] % 512 == 0
    assert data["peak_reserved_bytes"] % (2 * 1024**2) == 0
    assert data["fits"] is True
    assert data["setup"]["precision"] == "bf16-mixed"
    assert any("flash" in note for note in data["notes"])


def test_gpu_memory_size_selects_a_cuda_target(estimate_cli):
    code, out, err = estimate_cli(GPT, "--tokens", "64", "--gpu-memory", "24GiB", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["target"]["device"] == "cuda"
    assert data["target"]["gpu_memory_bytes"] == 24 * 1024**3


def test_help_lists_spec_forms_and_gpus(estimate_cli):
    code, out, _err = estimate_cli("--help")
    assert code == 0
    for text in ("file.py:factory", "torchvision:NAME", "hf:MODEL_TYPE", "H100-80GB", "RTX 4090"):
        assert text in out


def test_python_api_is_torchdoctor_estimate_and_importing_it_does_not_import_torch():
    import subprocess
    import sys

    # As the README uses it: only `import torchdoctor`, and max_batch reached through the
    # attribute before anything else imported the estimate package.
    code = (
        "import sys, torchdoctor\n"
        "print(torchdoctor.estimate.max_batch.__name__)\n"
        "assert 'torch' not in sys.modules\n"
        f"sys.path.insert(0, {str(MODELS_FILE.parent)!r})\n"
        "import estimate_models\n"
        "first = torchdoctor.estimate(estimate_models.mlp_dropout, batch_size=2)\n"
        "again = torchdoctor.estimate(estimate_models.mlp_dropout, batch_size=2)\n"
        "assert first.peak_allocated == again.peak_allocated > 0\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "max_batch"


def test_kernel_probes_print_nothing():
    """Convolutions are probed with torch.profiler, whose C++ backend logs to fd 2."""
    res = run_td("estimate", f"{MODELS_FILE}:plain_cnn", "--batch", "2", "--json")
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert json.loads(res.stdout)["breakdown_bytes"]["kernel scratch"] >= 0
