"""torchdoctor bench allreduce on this machine: real gloo ranks started by the command itself."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_td
from torchdoctor.cli import main
from torchdoctor.doctor.allreduce import bus_factor, parse_sizes
from torchdoctor.errors import UserError


def sweep(*args: str) -> dict:
    result = run_td("bench", "allreduce", "--backend", "gloo", "--json", *args, timeout=240)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def check_rows(doc: dict, n: int, ops: list[str], sizes: list[int]) -> None:
    assert doc["world_size"] == n and doc["nodes"] == 1
    assert [(r["op"], r["size"]) for r in doc["rows"]] == [(op, s) for op in ops for s in sizes]
    for r in doc["rows"]:
        # The buffers were really reduced / gathered: every element had the expected value.
        assert r["wrong"] == 0, r
        assert r["count"] * 4 == r["size"]  # float32
        assert r["time_s"] > 0
        assert r["algbw"] == pytest.approx(r["size"] / r["time_s"], rel=1e-12)
        assert r["busbw"] == pytest.approx(r["algbw"] * bus_factor(r["op"], n), rel=1e-12)


def test_two_local_ranks_sweep_all_three_collectives():
    doc = sweep("--nproc", "2", "--sizes", "64K:256K", "--iters", "3", "--warmup", "1")
    check_rows(doc, 2, ["all_reduce", "all_gather", "reduce_scatter"], [65536, 131072, 262144])
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_gather", 2) == 0.5
    assert doc["peak_busbw"] == max(r["busbw"] for r in doc["rows"] if r["op"] == "all_reduce")
    assert doc["ratio"] is None and "one node" in doc["verdict"]  # no NIC between local ranks


def test_four_local_ranks_table_states_the_formula():
    result = run_td(
        "bench", "allreduce", "--backend", "gloo", "--nproc", "4", "--sizes", "32K,1M",
        "--iters", "2", "--warmup", "1", "--ops", "all_reduce,reduce_scatter", timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "4 ranks on 1 node(s)" in out
    assert "all-reduce (busbw = algbw x 2(n-1)/n = x 1.5)" in out
    assert "reduce-scatter (busbw = algbw x (n-1)/n = x 0.75)" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("32K", "1M"))]
    assert len(rows) == 4
    for size, count, time_us, algbw, busbw, wrong in rows:
        assert wrong == "0"
        assert int(count) * 4 == parse_sizes(size)[0]
        factor = 1.5 if rows.index([size, count, time_us, algbw, busbw, wrong]) < 2 else 0.75
        # Printed to 4 decimals: the relation holds to the printed precision.
        assert float(busbw) == pytest.approx(float(algbw) * factor, abs=1.5e-4)


def test_the_correctness_check_counts_wrong_elements():
    from torchdoctor.doctor.allreduce import _check_values

    n = 4
    out = torch.full((8,), n * (n + 1) / 2)
    assert _check_values(torch, "all_reduce", out, n, 0) == 0
    out[3] = 0.0
    assert _check_values(torch, "all_reduce", out, n, 0) == 1
    gathered = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(2)
    assert _check_values(torch, "all_gather", gathered, n, 0) == 0
    assert _check_values(torch, "all_gather", gathered.flip(0), n, 0) == 8


def test_sizes_and_bad_input(capsys):
    assert parse_sizes("8K:64K") == [8192, 16384, 32768, 65536]
    assert parse_sizes("1M,3M") == [1 << 20, 3 << 20]
    with pytest.raises(UserError):
        parse_sizes("8Q")
    for args, message in (
        (["--sizes", "1M:8K"], "torchdoctor: error: --sizes 1M:8K: the first size"),
        (["--backend", "nccl"], "torchdoctor: error: --backend nccl needs CUDA GPUs"),
        (["--ops", "all_to_all"], "torchdoctor: error: --ops: unknown operation(s) all_to_all"),
        (["--dtype", "float33"], "torchdoctor: error: --dtype float33: not a torch dtype"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "allreduce", *args])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.startswith(message), args


def _size_option(n: int) -> str:
    """``n`` bytes (a power of two of at least 1 KiB) in the --sizes notation."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n >> shift}{unit}"
    raise AssertionError(n)


def test_sizes_beyond_the_memory_available_are_refused_before_any_buffer_exists(td):
    from torchdoctor.sampling.hostinfo import available_ram

    # 2 ranks of int8: each holds 5.5 x the buffer (allreduce.rank_bytes), 11 x in all. The
    # size asked is 2-4 x what fits, taken from MemAvailable now: refused on any machine,
    # and a machine that allocated it would be out of memory; nothing is allocated.
    available = available_ram()
    fits = available / 11
    asked = 1 << (int(fits).bit_length() + 1)
    for sizes in (_size_option(asked), "1T"):
        res = td("bench", "allreduce", "--quiet", "--dtype", "int8", "--sizes", sizes)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr
        assert lines[0].startswith("torchdoctor: error: --sizes: a "), lines
        assert "RAM has" in lines[0] and "--force" in lines[0]
        # The largest power of two that fits, as --sizes takes it (MemAvailable moves a
        # little between here and there: either side of a boundary is right).
        told = {_size_option(1 << (int(fits * k).bit_length() - 1)) for k in (0.95, 1.05)}
        assert any(f"the largest size that fits is {t} " in lines[0] for t in told), lines
    res = td("bench", "allreduce", "--quiet", "--sizes", ",")
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "torchdoctor: error: --sizes ',' names no size: give LOW:HIGH (8K:256M) or a list (1M,4M)"
    )


def test_int8_all_gather_leaks_no_torch_warning(td):
    res = td(
        "bench", "allreduce", "--quiet", "--dtype", "int8", "--ops", "all_gather,reduce_scatter",
        "--sizes", "8K", "--iters", "1", "--warmup", "0",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "Warning" not in res.stderr, res.stderr
    assert res.stderr == ""
