"""Versions: Python, torch and the CUDA / cuDNN / NCCL it was built with, the NVIDIA driver.

The minimums are the ones the distributed-training documents name (torch >= 1.6 for DDP as it
is used today, cuDNN >= 8.0). A torch built for a newer CUDA than the driver supports fails at
the first CUDA call when the major version differs; within one major version CUDA's
minor-version compatibility runs most programs but cannot JIT-compile PTX.
"""

from __future__ import annotations

import platform
import sys

from torchdoctor.doctor.check import ERROR, OK, SKIPPED, WARNING, Check
from torchdoctor.doctor.facts import Facts

TORCH_MINIMUM = (1, 6)
CUDNN_MINIMUM = 8000  # torch.backends.cudnn.version() encoding: 8.0.0
PYTHON_MINIMUM = (3, 8)


def _numbers(text: str, count: int = 2) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:count]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _cudnn_text(version: int) -> str:
    # 8.x encodes as major*1000 + minor*100 + patch; 9.x as major*10000 + minor*100 + patch.
    if version >= 10000:
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"


def check_python(facts: Facts) -> Check:
    version = platform.python_version()
    saw = f"Python {version} ({sys.executable})"
    if sys.version_info[:2] < PYTHON_MINIMUM:
        return Check("versions.python", ERROR, saw, "use Python 3.10 or newer")
    return Check("versions.python", OK, saw, details={"version": version})


def check_torch(facts: Facts) -> Check:
    t = facts.torch
    if t.version is None:
        return Check(
            "versions.torch",
            ERROR,
            t.reason or "torch is not importable",
            f"install PyTorch into it: `{sys.executable} -m pip install torch` (a CUDA build on "
            "GPU machines)",
        )
    built = (
        f"CUDA {t.cuda}, cuDNN {_cudnn_text(t.cudnn) if t.cudnn else 'n/a'}, NCCL {t.nccl or 'n/a'}"
        if t.cuda
        else "CPU-only build"
    )
    backends = ", ".join(b for b, on in (("gloo", t.gloo), ("nccl", t.nccl_built)) if on)
    saw = f"torch {t.version} ({built}); distributed backends: {backends or 'none'}"
    details = {
        "torch": t.version,
        "cuda": t.cuda,
        "cudnn": t.cudnn,
        "nccl": t.nccl,
        "gloo": t.gloo,
        "nccl_built": t.nccl_built,
    }
    if t.notes:
        saw += "; " + "; ".join(t.notes)
    if _numbers(t.version) < TORCH_MINIMUM:
        return Check(
            "versions.torch", ERROR, saw, "upgrade to torch 1.6 or newer (2.x recommended)", details
        )
    if not t.gloo and not t.nccl_built:
        return Check(
            "versions.torch",
            ERROR,
            saw,
            "this torch has no distributed backend: install a build from pytorch.org",
            details,
        )
    if t.cuda and t.cudnn is not None and t.cudnn < CUDNN_MINIMUM:
        return Check(
            "versions.torch",
            ERROR,
            saw,
            "cuDNN is older than 8.0: install a torch wheel that ships cuDNN 8 or newer",
            details,
        )
    gpus = facts.gpu_status
    if not t.cuda and gpus.available and gpus.gpus:
        return Check(
            "versions.torch",
            ERROR,
            saw + f"; NVML sees {len(gpus.gpus)} NVIDIA GPU(s)",
            "install a CUDA build of torch (pip install torch --index-url "
            "https://download.pytorch.org/whl/cu124, or the CUDA version your driver supports)",
            details,
        )
    return Check("versions.torch", OK, saw, details=details)


def check_driver(facts: Facts) -> Check:
    status = facts.gpu_status
    if not status.available:
        return Check("versions.driver", SKIPPED, f"NVML unavailable: {status.reason}")
    saw = (
        f"NVIDIA driver {status.driver_version or '?'}, supports CUDA up to "
        f"{status.cuda_driver_version or '?'} (NVML {status.nvml_version or '?'})"
    )
    details = {
        "driver": status.driver_version,
        "cuda_driver": status.cuda_driver_version,
        "nvml": status.nvml_version,
    }
    torch_cuda = facts.torch.cuda
    if not torch_cuda or not status.cuda_driver_version:
        return Check("versions.driver", OK, saw, details=details)
    built, supported = _numbers(torch_cuda), _numbers(status.cuda_driver_version)
    saw += f"; torch built for CUDA {torch_cuda}"
    if built[0] > supported[0]:
        return Check(
            "versions.driver",
            ERROR,
            saw,
            f"the driver is too old for CUDA {torch_cuda}: upgrade the NVIDIA driver, or install "
            f"a torch built for CUDA {status.cuda_driver_version} or older",
            details,
        )
    if built > supported:
        return Check(
            "versions.driver",
            WARNING,
            saw + " (newer minor version: runs through CUDA minor-version compatibility, "
            "without PTX JIT)",
            f"upgrade the driver to one supporting CUDA {torch_cuda}, or use a torch built for "
            f"CUDA {status.cuda_driver_version}",
            details,
        )
    return Check("versions.driver", OK, saw, details=details)


CHECKS = (check_python, check_torch, check_driver)


def check_agent(facts: Facts) -> Check:
    """The fast path the in-job agent takes in this Python: the compiled one (built from
    ``_fast.c`` when torchdoctor was installed with a C compiler and Python's headers) or the
    pure-Python one, which records the same rows at a few µs more per step."""
    from torchdoctor.instrument.agent import compiled
    from torchdoctor.instrument.agent.contract import ENV_PURE_PYTHON

    saw = f"the in-job agent's per-step path in Python {platform.python_version()}: "
    saw += compiled.FAST_PATH
    details = {"fast_path": "compiled" if compiled.fast is not None else "python"}
    if compiled.fast is not None or ENV_PURE_PYTHON in compiled.FAST_PATH:
        return Check("versions.agent", OK, saw, details=details)
    return Check(
        "versions.agent",
        WARNING,
        saw,
        "install a C compiler and Python's headers (Debian: `apt-get install gcc python3-dev`),"
        " then `pip install --force-reinstall --no-deps torchdoctor` to build the compiled path",
        details,
    )
