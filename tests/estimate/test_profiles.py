"""GPU profiles by name and memory sizes as users write them."""

from __future__ import annotations

import pytest

from torchdoctor.errors import UserError
from torchdoctor.estimate.profiles import PROFILES, find_profile
from torchdoctor.units import fmt_bytes as format_bytes
from torchdoctor.units import parse_size


def test_required_profiles_exist_with_memory_and_compute_capability():
    for name in ("A100-40GB", "A100-80GB", "H100-80GB", "H200", "L4", "T4", "V100", "RTX 4090"):
        profile = PROFILES[name]
        assert profile.memory_bytes >= 15 * 1024**3
        assert (7, 0) <= profile.compute_capability <= (9, 0)
    assert PROFILES["H100-80GB"].is_hopper_or_newer and not PROFILES["A100-80GB"].is_hopper_or_newer


def test_profile_names_ignore_case_spaces_and_dashes():
    assert find_profile("a100 80gb") is PROFILES["A100-80GB"]
    assert find_profile("rtx4090") is PROFILES["RTX 4090"]
    assert find_profile("h100") is PROFILES["H100-80GB"]


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("24GiB", 24 * 1024**3),
        ("80GB", 80 * 10**9),
        ("16384MiB", 16 * 1024**3),
        ("1.5 TiB", int(1.5 * 1024**4)),
        ("4096", 4096),
    ],
)
def test_memory_sizes(text, size):
    assert parse_size(text) == size


def test_bad_sizes_and_names_say_how_to_write_them():
    with pytest.raises(UserError, match="write a size like 16G"):
        parse_size("24 gigs")
    with pytest.raises(UserError, match="use one of A100-40GB"):
        find_profile("B300")


def test_format_bytes():
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(80 * 1024**3) == "80.0 GiB"
    assert format_bytes(100) == "100 B"
