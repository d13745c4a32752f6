"""The figures every command prints: one spelling of a size, a rate, a share or a duration."""

from torchdoctor.top.compact import size
from torchdoctor.units import (
    fmt_bytes,
    fmt_cpu_list,
    fmt_duration,
    fmt_mem_option,
    fmt_pct,
    fmt_rate,
    parse_cpu_list,
)

MiB = 1024**2
GiB = 1024**3


def test_sizes_have_three_significant_figures_in_binary_units():
    assert fmt_bytes(100) == "100 B"
    assert fmt_bytes(1536) == "1.50 KiB"
    assert fmt_bytes(812 * MiB) == "812 MiB"
    assert fmt_bytes(1.54 * GiB) == "1.54 GiB"
    assert fmt_bytes(80 * GiB) == "80.0 GiB"
    assert fmt_bytes(-1.5 * GiB) == "-1.50 GiB"  # a shrinking figure keeps its sign
    # A value that rounds up to the next decade gets the digits of that decade, not four.
    assert fmt_bytes(9.999 * MiB) == "10.0 MiB"
    assert fmt_bytes(4 * 1024**5) == "4.00 PiB"


def test_missing_figures_say_so():
    assert fmt_bytes(None) == "n/a"
    assert fmt_rate(None) == "n/a"
    assert fmt_pct(None) == "n/a"
    assert fmt_duration(None) == "n/a"
    assert fmt_bytes(None, missing="-") == "-"


def test_rates_and_shares():
    assert fmt_rate(60 * MiB) == "60.0 MiB/s"
    assert fmt_pct(42.4) == "42 %"
    assert fmt_pct(42.44, digits=1) == "42.4 %"


def test_durations_read_as_a_person_says_them():
    assert fmt_duration(0) == "0 s"
    assert fmt_duration(350e-6) == "350 µs"
    assert fmt_duration(0.0421) == "42.1 ms"
    assert fmt_duration(0.5) == "500 ms"
    assert fmt_duration(1.2449) == "1.24 s"  # three significant figures, as sizes have
    assert fmt_duration(42.14) == "42.1 s"
    assert fmt_duration(59.97) == "1 min 00 s"  # never "60.0 s"
    assert fmt_duration(185) == "3 min 05 s"
    assert fmt_duration(3720) == "1 h 02 min"
    assert fmt_duration(4.2 * 86400) == "4.2 days"


def test_the_live_view_writes_the_same_sizes_in_five_characters():
    assert size(512) == "512B"
    assert size(3.4 * 1024) == "3.4K"
    assert size(12 * MiB) == "12M"
    assert size(1.2 * GiB) == "1.2G"
    assert size(None) == "-"


def test_cpu_lists_read_and_written_in_the_kernels_format():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("") == []
    assert fmt_cpu_list([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    assert fmt_cpu_list([5]) == "5" and fmt_cpu_list([]) == "-"
    assert parse_cpu_list(fmt_cpu_list([0, 2, 3, 4, 7])) == [0, 2, 3, 4, 7]


def test_mem_options_read_back_as_the_same_size_by_slurm_and_by_submit():
    from torchdoctor.slurm.notation import parse_memory
    from torchdoctor.units import parse_size

    for n in (400 * 2**20, 400_000_000, 64 * 2**30, 1):
        slurm, submit = fmt_mem_option(n, slurm=True), fmt_mem_option(n, slurm=False)
        # Rounded up to whole MiB, never below what was asked.
        assert n <= parse_memory(slurm) < n + 2**20
        assert parse_size(submit) == parse_memory(slurm)
    assert fmt_mem_option(400 * 2**20, slurm=True) == "400M"
    assert fmt_mem_option(64 * 2**30, slurm=False) == "64GiB"
