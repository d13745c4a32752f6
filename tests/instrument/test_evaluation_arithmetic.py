"""The agent's evaluation arithmetic with plain numbers (the real loops are in
test_evaluation.py): what an evaluation counts, and how batches move between it and a step."""

from __future__ import annotations

from types import SimpleNamespace

from torchdoctor.instrument.agent.evaluation import _RESTORED, Evaluation, PassStart, rewind

MS = 1_000_000


def _counter(**figures):
    base = dict(
        step=3, samples=0, batches=0, data_wait=0, boundary=None, last_batch_size=None,
        loader_batch_size=None, loader_seen=False,
    )  # fmt: skip
    base.update(figures)
    return SimpleNamespace(**base)


def test_an_evaluation_counts_its_batches_waits_and_samples():
    ev = Evaluation(100 * MS, "grad-disabled")
    ev.add_batch(8, 2 * MS, 103 * MS)
    ev.add_batch(5, 1 * MS, 110 * MS)
    ev.add_wait(1 * MS, 112 * MS)  # the end of its loader's pass
    assert (ev.batches, ev.samples, ev.wait, ev.last, ev.last_size) == (2, 13, 4 * MS, 112 * MS, 5)
    detail = ev.detail(step=3, t_end=120 * MS, ended_by="training-data")
    assert detail == {
        "step": 3,
        "seconds": 0.02,
        "batches": 2,
        "samples": 13,
        "data_wait_s": 0.004,
        "detected_by": "grad-disabled",
        "ended_by": "training-data",
    }
    ev.add_batch(None, 0, 121 * MS)  # a batch of unknown size: the samples are unknown
    assert ev.detail(3, 121 * MS, "process-end")["samples"] is None


def test_only_the_part_after_the_step_boundary_leaves_the_step():
    ev = Evaluation(100 * MS, "grad-disabled")
    assert ev.time_in_step(boundary=90 * MS, t_end=130 * MS) == 30 * MS
    assert ev.time_in_step(boundary=110 * MS, t_end=130 * MS) == 20 * MS
    assert ev.time_in_step(boundary=140 * MS, t_end=130 * MS) == 0


def test_a_pass_that_trained_nothing_is_rewound_out_of_the_step():
    counter = _counter(samples=16, batches=2, data_wait=3 * MS, boundary=50 * MS, last_batch_size=8)
    started = PassStart(counter, t_iter=60 * MS)
    counter.loader_batch_size = 4  # the evaluation loader's
    counter.samples, counter.batches, counter.data_wait, counter.last_batch_size = 28, 5, 9 * MS, 4
    ev = rewind(counter, started, t_end=80 * MS)
    assert (ev.start, ev.detected_by, ev.last) == (60 * MS, "loader-pass", 80 * MS)
    assert (ev.batches, ev.samples, ev.wait, ev.last_size) == (3, 12, 6 * MS, 4)
    assert (counter.samples, counter.batches, counter.data_wait) == (16, 2, 3 * MS)
    assert (counter.boundary, counter.last_batch_size, counter.loader_batch_size) == (
        50 * MS,
        8,
        None,
    )


def test_a_pass_start_keeps_every_figure_a_rewind_restores():
    counter = _counter(**{name: 100 + i for i, name in enumerate(_RESTORED)})
    started = PassStart(counter, t_iter=60 * MS)
    assert {name: getattr(started, name) for name in _RESTORED} == {
        name: 100 + i for i, name in enumerate(_RESTORED)
    }
    assert (started.step, started.t_iter) == (3, 60 * MS)


def test_an_evaluation_no_training_data_followed_is_counted_into_the_step():
    counter = _counter(samples=8, batches=1, data_wait=1 * MS)
    ev = Evaluation(100 * MS, "grad-disabled")
    ev.add_batch(4, 2 * MS, 102 * MS)
    ev.settle_into(counter)
    assert (counter.samples, counter.batches, counter.data_wait) == (12, 2, 3 * MS)
    assert counter.boundary == 100 * MS  # the step began with the evaluation's first call
    assert counter.last_batch_size == 4 and counter.loader_seen
