"""GPU profiles by name. A board name such as A100-80GB names the board, whose memory is what
nvidia-smi shows (81920 MiB = 80 GiB); sizes typed as figures are read by torchdoctor.units."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torchdoctor.errors import ParameterError, literal
from torchdoctor.units import fmt_bytes

MiB = 1024**2
GiB = 1024**3


@dataclass(frozen=True)
class GpuProfile:
    """A target GPU: the memory nvidia-smi reports as total, and its compute capability."""

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]

    @property
    def is_hopper_or_newer(self) -> bool:
        return self.compute_capability >= (9, 0)


# Memory is the "Total" that nvidia-smi prints for the common board of each name, in MiB.
_PROFILES = [
    GpuProfile("A100-40GB", 40960 * MiB, (8, 0)),
    GpuProfile("A100-80GB", 81920 * MiB, (8, 0)),
    GpuProfile("H100-80GB", 81559 * MiB, (9, 0)),
    GpuProfile("H200", 143771 * MiB, (9, 0)),
    GpuProfile("L4", 23034 * MiB, (8, 9)),
    GpuProfile("T4", 15360 * MiB, (7, 5)),
    GpuProfile("V100", 16384 * MiB, (7, 0)),
    GpuProfile("V100-32GB", 32768 * MiB, (7, 0)),
    GpuProfile("A10G", 23028 * MiB, (8, 6)),
    GpuProfile("RTX 3090", 24576 * MiB, (8, 6)),
    GpuProfile("RTX 4090", 24564 * MiB, (8, 9)),
]
PROFILES: dict[str, GpuProfile] = {p.name: p for p in _PROFILES}

# A GPU given only by its memory size is assumed to be an Ampere-class part (sm80): flash
# attention for half types, 8.1 MiB cuBLAS workspace.
DEFAULT_COMPUTE_CAPABILITY = (8, 0)


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def find_profile(name: str) -> GpuProfile:
    """The profile named ``name`` (case, spaces and dashes do not matter)."""
    wanted = _key(name)
    for profile in _PROFILES:
        if _key(profile.name) == wanted:
            return profile
    aliases = {"a100": "A100-80GB", "h100": "H100-80GB", "4090": "RTX 4090", "3090": "RTX 3090"}
    if wanted in aliases:
        return PROFILES[aliases[wanted]]
    known = ", ".join(PROFILES)
    raise ParameterError(
        literal(f"unknown GPU {name!r}: use one of {known}, or ") + "{} (e.g. 24GiB)", "gpu_memory"
    )


def custom_profile(
    memory_bytes: int, compute_capability: tuple[int, int] | None = None
) -> GpuProfile:
    """A GPU known only by its memory size."""
    cc = compute_capability or DEFAULT_COMPUTE_CAPABILITY
    return GpuProfile(f"GPU with {fmt_bytes(memory_bytes)}", memory_bytes, cc)
