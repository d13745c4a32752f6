"""`torchdoctor estimate --from RECORDING SPEC`: the recorded step re-estimated on the recorded
GPU, with the cuda-oom finding's fix checked by the estimator.

The recording is the one a CUDA OOM leaves: written by the real RecordingWriter, its OOM event
recorded by the agent's own CudaMemory.on_oom (tests/diagnosis/test_cuda_oom.py's builders).
The GPU is a small fake one, 640 MiB, so that gpt_tiny at 64 tokens does not fit at batch 64
(the estimator: 710 MiB with the CUDA context) while micro-batches of 32 do (584 MiB).
"""

from __future__ import annotations

import json

from tests.diagnosis.builders import T0, Gpu, Job, Proc, const
from tests.diagnosis.test_cuda_oom import recorded_oom
from tests.estimate.conftest import MODELS_FILE
from tests.helpers.dependencies import require
from tests.helpers.schemas import assert_valid
from torchdoctor.recording.records import JobEvent

MiB = 2**20
GPU_NAME = "NVIDIA Fake 640MiB"
GPU_MEMORY = 640 * MiB
CONTEXT = 400 * MiB  # what the CUDA context holds outside PyTorch's allocator
GPT = f"{MODELS_FILE}:gpt_tiny"
PARAMS_BYTES = 4_353_024  # gpt_tiny's fp32 weights, as the agent records params.bytes


def oom_recording(path, *, oom: bool = True, gpus: bool = True):
    """A job whose first backward at batch 64 ran out of the 640 MiB: 200 MiB allocated,
    220 MiB reserved, 32 MiB asked, the context's 400 MiB outside the allocator."""
    job = Job(
        procs=[Proc(1000)],
        gpus=[Gpu(name=GPU_NAME, total=GPU_MEMORY, capability="8.0", used=const(GPU_MEMORY - MiB))]
        if gpus
        else [],
        settings={
            1000: {
                "params.bytes": PARAMS_BYTES,
                "params.dtypes": ["float32"],
                "params.devices": ["cuda:0"],
                "optimizer.class": "torch.optim.adamw.AdamW",
                "amp.autocast": None,
            }
        },
    )
    if oom:
        detail = recorded_oom(
            step=0,
            allocated=200 * MiB,
            reserved=220 * MiB,
            requested=32 * MiB,
            free_blocks=[4 * MiB],
            in_backward=True,
            total=GPU_MEMORY,
            free=GPU_MEMORY - CONTEXT - 220 * MiB,
            batch=64,
        )
        job.events = [JobEvent(1000, None, T0 + 5.0, "cuda-oom", json.dumps(detail))]
    return job.write(path)


def test_the_recorded_batch_does_not_fit_the_recorded_gpu_and_the_fix_does(
    estimate_cli, tmp_path, monkeypatch
):
    oom_recording(tmp_path / "oom.sqlite")
    monkeypatch.setenv("TORCHDOCTOR_RUNS_DIR", str(tmp_path))  # @last: the newest there
    code, out, err = estimate_cli("--from", "@last", GPT, "--tokens", "64")
    assert code == 0, err
    assert f"the recorded loop of {tmp_path / 'oom.sqlite'} re-estimated" in out
    assert f"{GPU_NAME} (640 MiB, sm80), from the recording" in out
    assert "batch 64 (recording), fp32 (recording), adamw (recording), auto implementation" in out
    assert "activations held the memory" in out  # the cuda-oom finding it checks
    assert "figures from the estimator" in out
    lines = {line.split("  peak")[0].strip(): line for line in out.splitlines() if " peak " in line}
    assert "of 640 MiB  does NOT fit" in lines["the recorded step (batch 64)"]
    fix = lines["cuda-oom fix: micro-batches of 32 accumulated over 2"]
    assert fix.endswith("of 640 MiB  fits")
    assert "cuda-oom alternative: bf16 autocast at batch 64" in lines  # also re-estimated


def test_json_validates_and_gives_each_check_on_the_recorded_gpu(estimate_cli, tmp_path):
    require("jsonschema")
    rec = oom_recording(tmp_path / "oom.sqlite")
    code, out, err = estimate_cli("--from", str(rec), GPT, "--tokens", "64", "--json")
    assert code == 0, err
    data = assert_valid("estimate-from", out)
    assert data["gpu"] == {
        "name": GPU_NAME,
        "memory_bytes": GPU_MEMORY,
        "compute_capability": "8.0",
    }
    assert data["sized_by"] == "estimator" and data["sources"]["gpu"] == "recording"
    assert data["cuda_oom"]["settings"] == {"batch_size": 32, "gradient_accumulation_steps": 2}
    recorded, fix = data["checks"][0], data["checks"][1]
    assert recorded["kind"] == "recorded" and recorded["setup"]["batch_size"] == 64
    assert recorded["fits"] is False and recorded["total_bytes"] > 0.95 * GPU_MEMORY
    assert fix["kind"] == "fix" and fix["fits"] is True
    assert (fix["setup"]["batch_size"], fix["setup"]["grad_accumulation"]) == (32, 2)
    assert fix["total_bytes"] <= 0.95 * GPU_MEMORY < recorded["total_bytes"]
    for check in data["checks"]:
        assert check["gpu_memory_bytes"] == GPU_MEMORY
        assert check["estimate"]["target"]["gpu"] == GPU_NAME


def test_without_an_oom_the_recorded_step_is_estimated_and_options_given_win(
    estimate_cli, tmp_path
):
    rec = oom_recording(tmp_path / "ok.sqlite", oom=False)
    code, out, err = estimate_cli(
        "--from", str(rec), GPT, "--tokens", "64", "--batch", "8", "--json"
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["cuda_oom"] is None
    assert [c["kind"] for c in data["checks"]] == ["recorded"]
    assert data["sources"]["batch_size"] == "command line"
    assert data["sources"]["optimizer"] == "recording"
    assert data["checks"][0]["setup"]["batch_size"] == 8 and data["checks"][0]["fits"] is True


def test_a_recording_without_gpu_information_is_one_line_and_exit_2(estimate_cli, tmp_path):
    rec = oom_recording(tmp_path / "cpu.sqlite", oom=False, gpus=False)
    code, out, err = estimate_cli("--from", str(rec), GPT, "--tokens", "64")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "has no GPU information" in lines[0]
    assert "--gpu" in lines[0]
