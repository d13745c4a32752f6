"""The leak rule fits fresh memory readings only: slow-tier values carried between refreshes
would turn a smooth growth into a staircase and hide the leak."""

from __future__ import annotations

from torchdoctor.diagnosis.rules.host_memory_leak import memory_series

MIB = 2**20


def _sample(t: float, rss: int, uss: int | None) -> dict:
    return {"t": t, "rss": rss, "uss": uss}


def test_carried_uss_falls_back_to_rss() -> None:
    # RSS read at every sample; USS refreshed twice and carried in between
    samples = [
        _sample(i * 0.1, (100 + i) * MIB, 4 * MIB if i < 50 else 150 * MIB) for i in range(60)
    ]
    label, series = memory_series(samples)
    assert label == "resident memory (RSS)"
    assert len(series) == 60 and series[-1][1] == 159 * MIB


def test_frequently_refreshed_uss_is_used_at_its_fresh_points() -> None:
    samples = [_sample(i * 0.5, (300 + 2 * i) * MIB, (50 + i // 2) * MIB) for i in range(20)]
    label, series = memory_series(samples)
    assert label == "private memory (USS)"
    assert [v for _, v in series] == [(50 + k) * MIB for k in range(10)]


def test_flat_private_memory_read_throughout_is_used() -> None:
    # RSS grows through shared pages while the private memory stays put: not a leak
    samples = [_sample(i * 0.5, (3000 + 10 * i) * MIB, 1500 * MIB) for i in range(40)]
    label, series = memory_series(samples)
    assert label == "private memory (USS)"
    assert {v for _, v in series} == {1500 * MIB}
