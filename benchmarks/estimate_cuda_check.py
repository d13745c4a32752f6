"""Compare ``torchdoctor estimate --device cuda`` with a real GPU (run it where one exists).

For every case (the CPU suite's models, plus GPT-2 small) and precision (fp32, bf16-mixed,
fp16-mixed) a fresh child process runs the same two training steps on the GPU and reports
``torch.cuda.max_memory_allocated()``, ``torch.cuda.max_memory_reserved()`` and the process's
memory as NVML (nvidia-smi) sees it; the parent estimates the same step for a profile built from
the real device (its total memory and compute capability) and prints the errors. Targets of
issue 5: within 5 % of max_memory_allocated and 8 % of max_memory_reserved. The last column,
NVML minus reserved, is the CUDA context (plus library memory) to calibrate
``torchdoctor/estimate/cuda_costs.py`` with.

    python benchmarks/estimate_cuda_check.py [--cases NAME,...] [--precisions fp32,bf16-mixed]

The ``loop-*`` cases (fp32) run the training loops people write, as examples/estimate_loops.py
writes them: nanoGPT's ``logits, loss = model(X, Y)``, a classic ``out = model(x)`` loop, 4
accumulated micro-batches each holding its output, a model returning a dict, the real
``transformers.Trainer.train()`` and ``lightning.Trainer.fit()``; each is estimated under the
``--loop`` it is (the other cases run ``frees-output``, the loop their worker writes).

Takes a few minutes on one GPU; exits with status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
ALLOCATED_TARGET = 0.05
RESERVED_TARGET = 0.08


def cases() -> dict:
    """The single-loop cases: their worker writes ``loss_fn(model(x), y).backward()``."""
    import estimate_models as models
    from torchdoctor.estimate.setup import TrainingSetup

    plain = {
        "cnn-adamw": (models.plain_cnn, {}, TrainingSetup(batch_size=64)),
        "resnet-bn-sgdm": (models.resnet, {}, TrainingSetup(batch_size=64, optimizer="sgd-momentum")),
        "encoder-dropout-adamw": (models.transformer_encoder, {}, TrainingSetup(batch_size=32)),
        "gpt-sdpa-adamw": (models.gpt_tiny, {"tokens": 256}, TrainingSetup(batch_size=16)),
        "gpt-dropout-ckpt-adam": (models.gpt_tiny_dropout, {"tokens": 256}, TrainingSetup(batch_size=16, optimizer="adam", checkpointing=True)),
        "vit-mha-adamw": (models.vit_tiny, {}, TrainingSetup(batch_size=64)),
        "lstm-sgd": (models.lstm, {}, TrainingSetup(batch_size=64, optimizer="sgd")),
        "mlp-dropout-adamw": (models.mlp_dropout, {}, TrainingSetup(batch_size=256)),
        "gpt2-small-adamw": (models.gpt2_small, {"tokens": 1024}, TrainingSetup(batch_size=8)),
    }  # fmt: skip
    return {
        name: (factory, options, setup.with_(loop="frees-output"))
        for name, (factory, options, setup) in plain.items()
    }


def loop_cases() -> dict:
    """name -> (factory, workload options, set-up, build), where build() puts the model and
    batch on the GPU and returns the loop's train() (examples/estimate_loops.py)."""
    import torch

    import estimate_loops as loops
    import estimate_models as models
    from torchdoctor.estimate.setup import TrainingSetup

    cuda = torch.device("cuda")

    def tokens(vocab: int, rows: int, seq: int, device=cuda):
        return (torch.randint(0, vocab, (rows, seq), device=device),
                torch.randint(0, vocab, (rows, seq), device=device))  # fmt: skip

    def nanogpt():
        model, make_batch = models.nanogpt()
        (x, y), _ = make_batch(8)
        return loops.nanogpt_loop(model.to(cuda), x.to(cuda), y.to(cuda))

    def classic(accumulation: int):
        return lambda: loops.classic_loop(
            models.gpt_tiny().to(cuda), *tokens(2048, 16, 256), accumulation=accumulation
        )

    def dict_output():
        model, make_batch, loss = models.dict_output()
        x, y = make_batch(256)
        return loops.classic_loop(model.to(cuda), x.to(cuda), y.to(cuda), loss_fn=loss)

    def hf_trainer():
        ids, _ = tokens(8192, 4 * 16, 128, device="cpu")
        return loops.hf_trainer_loop(models.hf_gpt2_tiny(), ids, 16, use_cpu=False)

    def lightning():
        module, make_batch = models.lightning_lm()
        ids, targets = make_batch(4 * 16)
        return loops.lightning_loop(module, ids, targets, 16, accelerator="gpu")

    return {
        "loop-nanogpt-b8": (models.nanogpt, {}, TrainingSetup(batch_size=8), nanogpt),
        "loop-classic-gpt": (models.gpt_tiny, {"tokens": 256}, TrainingSetup(batch_size=16), classic(1)),
        "loop-accum4-gpt": (models.gpt_tiny, {"tokens": 256}, TrainingSetup(batch_size=16, grad_accumulation=4), classic(4)),
        "loop-dict-mlp": (models.dict_output, {}, TrainingSetup(batch_size=256), dict_output),
        "loop-hf-trainer": (models.hf_gpt2_tiny, {"tokens": 128}, TrainingSetup(batch_size=16, loop="hf-trainer"), hf_trainer),
        "loop-lightning": (models.lightning_lm, {}, TrainingSetup(batch_size=16, loop="lightning"), lightning),
    }  # fmt: skip


def all_cases() -> dict:
    found = {name: (*case, None) for name, case in cases().items()}
    found.update(loop_cases())
    return found


def worker(case: str, precision: str) -> dict:
    """Run the step for real on the GPU in this (fresh) process."""
    import torch

    from torchdoctor.estimate.spec import load_workload
    from torchdoctor.estimate.step import STEPS, apply_checkpointing
    from torchdoctor.estimate.workload import call_model

    factory, options, setup, build = all_cases()[case]
    torch.manual_seed(0)
    torch.cuda.init()
    if build is not None:
        train = build()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        train()
        return _stats(torch)
    setup = setup.with_(precision=precision)
    workload = load_workload(factory, **options)
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats()
    model = workload.build_model().to(device)
    if setup.checkpointing:
        apply_checkpointing(model)
    model.train()
    inputs, target = workload.make_batch(model, setup.batch_size)
    inputs = _to(inputs, device)
    target = _to(target, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = {
        "sgd": lambda: torch.optim.SGD(params, lr=1e-3),
        "sgd-momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
        "adam": lambda: torch.optim.Adam(params, lr=1e-3),
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-3),
    }[setup.optimizer]()
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16-mixed" else None
    for _ in range(STEPS):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = workload.loss_fn(call_model(model, inputs), target)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _stats(torch)


def _stats(torch) -> dict:
    torch.cuda.synchronize()
    props = torch.cuda.get_device_properties(0)
    return {
        "allocated": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.max_memory_reserved(),
        "nvml": _nvml_process_bytes(),
        "gpu_name": props.name,
        "total_memory": props.total_memory,
        "capability": [props.major, props.minor],
    }


def _to(value, device):
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def _nvml_process_bytes() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid():
                return int(proc.usedGpuMemory)
    except Exception:
        return None
    return None


def estimate_for(case: str, precision: str, real: dict):
    from torchdoctor.estimate.fitcheck import estimate_workload
    from torchdoctor.estimate.profiles import GpuProfile
    from torchdoctor.estimate.setup import Target
    from torchdoctor.estimate.spec import load_workload

    factory, options, setup, _build = all_cases()[case]
    gpu = GpuProfile(real["gpu_name"], real["total_memory"], tuple(real["capability"]))
    workload = load_workload(factory, **options)
    return estimate_workload(workload, setup.with_(precision=precision), Target("cuda", gpu))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "PRECISION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("estimate_cuda_check: no CUDA GPU here; run it on a machine with one")
    names = args.cases.split(",") if args.cases else list(all_cases())
    worst_allocated = worst_reserved = 0.0
    print(
        f"{'case':<24} {'precision':<11} {'allocated err':>13} {'reserved err':>13} {'nvml - reserved':>16}  estimate s"
    )
    for name in names:
        precisions = ["fp32"] if name.startswith("loop-") else args.precisions.split(",")
        for precision in precisions:
            child = subprocess.run(
                [sys.executable, __file__, "--worker", name, precision],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            if child.returncode != 0:
                print(
                    f"{name:<24} {precision:<11} failed: {child.stderr.strip().splitlines()[-1:]}"
                )
                continue
            real = json.loads(child.stdout.strip().splitlines()[-1])
            started = time.perf_counter()
            est = estimate_for(name, precision, real)
            seconds = time.perf_counter() - started
            err_allocated = (est.peak_allocated - real["allocated"]) / real["allocated"]
            err_reserved = (est.peak_reserved - real["reserved"]) / real["reserved"]
            worst_allocated = max(worst_allocated, abs(err_allocated))
            worst_reserved = max(worst_reserved, abs(err_reserved))
            context = (real["nvml"] - real["reserved"]) / 2**20 if real["nvml"] else float("nan")
            print(
                f"{name:<24} {precision:<11} {err_allocated:+13.2%} {err_reserved:+13.2%} "
                f"{context:13.0f} MiB  {seconds:8.1f}",
                flush=True,
            )
    print(
        f"worst |error|: allocated {worst_allocated:.2%} (target 5%), reserved {worst_reserved:.2%} (target 8%)"
    )
    if worst_allocated > ALLOCATED_TARGET or worst_reserved > RESERVED_TARGET:
        sys.exit(1)


if __name__ == "__main__":
    main()
