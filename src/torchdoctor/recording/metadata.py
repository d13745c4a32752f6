"""Run metadata: what was run, where, on which machine, with which settings in the environment."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import time
from typing import Any

import torchdoctor

# Environment variables that change how a PyTorch job uses the machine.
ENV_OF_INTEREST = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "TORCH_NUM_THREADS",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_JOB_ID",
)
ENV_PREFIXES = ("NCCL_", "TORCHELASTIC_", "GLOO_")


def env_of_interest(env: dict[str, str]) -> dict[str, str]:
    return {
        k: v for k, v in sorted(env.items()) if k in ENV_OF_INTEREST or k.startswith(ENV_PREFIXES)
    }


def installed_torch_version() -> str | None:
    """The torch version installed beside us, read from package metadata (no import: it is slow)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _working_directory() -> str | None:
    """Where the job starts; None when that folder was deleted (the job still runs there, as
    a shell left in a removed folder runs commands: nothing to record, no reason to fail)."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        return None


def run_metadata(
    *,
    mode: str,
    command: list[str],
    root_pid: int | None,
    interval_s: float,
    env: dict[str, str],
    host_info: Any,
    gpu_status: Any,
    instrumented: bool,
) -> dict[str, Any]:
    """The metadata written when a recording starts (the end adds ended_at and exit status)."""
    return {
        "torchdoctor_version": torchdoctor.__version__,
        "mode": mode,
        "command": command,
        "cwd": _working_directory(),
        "root_pid": root_pid,
        "started_at": time.time(),
        "interval_s": interval_s,
        "instrumented": instrumented,
        "host": _plain(host_info),
        "gpus": _plain(gpu_status),
        "torch_version": installed_torch_version(),
        "env": env_of_interest(env),
    }


def _plain(value: Any) -> Any:
    if value is None:
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value
