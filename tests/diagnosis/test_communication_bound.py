"""communication-bound's figure: each sampled all-reduce read from the rank that reached it
last, so a peer's wait (a straggler, a rank the scheduler preempted) is not the network's."""

from __future__ import annotations

import pytest

from torchdoctor.diagnosis.ranks import RankSeries
from torchdoctor.diagnosis.rules.communication_bound import exposed_communication


def rank(number: int, exposed_ms: list[float], wall_s: float = 0.02) -> RankSeries:
    # DDP samples iterations 1-10; the first two are its bucket rebuild and are left out.
    steps = [
        {"step": i, "wall_s": wall_s, "comm_s": (2.0 + ms) / 1e3, "comm_overlap_s": 0.002}
        for i, ms in enumerate([0.0, 0.0, *exposed_ms], start=1)
    ]
    return RankSeries(number, 100 + number, 0, None, "rec.sqlite", None, steps=steps)


def test_ranks_taking_turns_to_wait_for_each_other_leave_the_all_reduce_cheap():
    # Each iteration one rank was preempted and its peer waited 8 ms for it: both ranks'
    # own figures are 40 % of a 20 ms step, the all-reduce itself 0.5 ms (2.5 %).
    waits = [8.0, 0.5] * 4
    figures = exposed_communication([rank(0, waits), rank(1, waits[1:] + waits[:1])])
    assert figures is not None and figures.iterations == 8
    assert figures.exposed_s == pytest.approx(0.0005)
    assert figures.share < 0.10


def test_an_all_reduce_every_rank_waits_for_is_exposed():
    figures = exposed_communication([rank(0, [5.0] * 8), rank(1, [5.5] * 8)])
    assert figures is not None
    assert figures.exposed_s == pytest.approx(0.005) and figures.share == pytest.approx(0.25)
    assert (figures.comm_s, figures.overlap_s) == pytest.approx((0.007, 0.002))


def test_too_few_iterations_reached_by_two_ranks_give_no_figure():
    assert exposed_communication([rank(0, [5.0] * 8)]) is None  # one rank
    assert exposed_communication([rank(0, [5.0, 5.0]), rank(1, [5.0, 5.0])]) is None
