"""Evaluation between training steps stays out of the step figures and is reported on its own.

Real torch loops on CPU with real DataLoaders under ``torchdoctor.watch`` (real recordings), and
real Lightning and Hugging Face fits. Timing is only ever compared within one run: the loop
measures its own training steps and evaluation passes with ``time.perf_counter`` and the
recording must agree with it. The validation set is made slow on purpose (a fixed amount of
hashing per sample) so that an evaluation counted into a step could not go unnoticed.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import torchdoctor
from tests.conftest import run_td
from tests.instrument.fits import (
    _leave_the_process_as_found,  # noqa: F401 (an autouse fixture: HF seeds the global RNGs)
    hf_trainer,
    lightning_fit,
)
from torchdoctor.recording.steps import evaluation_stats, step_stats
from torchdoctor.run.integrations import (
    torchdoctor_hf_callback,
    torchdoctor_lightning_callback,
)

pytestmark = pytest.mark.filterwarnings(
    # Lightning's own use of torch's pytree and its hints about this small setup.
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated",
    "ignore:.*does not have many workers:UserWarning",
    "ignore:.*number of training batches.*:UserWarning",
)


BATCH = 4
STEPS = 16
EVERY = 4  # a validation pass after every 4th step, the last one after the last step
VAL_SAMPLES = 8
VAL_BATCH = 4
WATCH = {"gpus": False, "interval": 0.05}


class SlowValidation(Dataset):
    """Each sample costs a fixed amount of work (milliseconds): a pass is much longer than a
    training step, whose data is ready in memory."""

    def __init__(self, n: int = VAL_SAMPLES) -> None:
        self.x = torch.randn(n, 4)
        self.y = torch.randn(n, 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        hashlib.pbkdf2_hmac("sha256", b"sample", b"fixed work", 20_000)
        return self.x[i], self.y[i]


class OwnTimes:
    """What the loop measured itself: each training step's time and each evaluation pass'."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.evaluations: list[float] = []


def _evaluate(model, loader, times: OwnTimes, *, no_grad: bool = True) -> None:
    t0 = time.perf_counter()
    model.eval()
    if no_grad:
        with torch.no_grad():
            for x, y in loader:
                torch.nn.functional.mse_loss(model(x), y)
    else:  # as the Hugging Face Trainer does: autograd on while fetching
        for x, y in loader:
            with torch.no_grad():
                torch.nn.functional.mse_loss(model(x), y)
    model.train()
    times.evaluations.append(time.perf_counter() - t0)


def train_with_evaluation(*, no_grad: bool = True) -> OwnTimes:
    """STEPS training steps of batch BATCH, a validation pass after every EVERY-th."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train = DataLoader(
        TensorDataset(torch.randn(STEPS * BATCH, 4), torch.randn(STEPS * BATCH, 1)),
        batch_size=BATCH,
    )
    val = DataLoader(SlowValidation(), batch_size=VAL_BATCH)
    times = OwnTimes()
    mark = time.perf_counter()  # end of the previous training step
    evaluated = 0.0  # evaluation time since then
    for i, (x, y) in enumerate(train):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        now = time.perf_counter()
        times.steps.append(now - mark - evaluated)
        mark, evaluated = now, 0.0
        if (i + 1) % EVERY == 0:
            _evaluate(model, val, times, no_grad=no_grad)
            evaluated = times.evaluations[-1]
    return times


def _rows(path):
    with torchdoctor.open_recording(path) as rec:
        return rec.rows("steps"), rec.rows("dataloaders"), rec.rows("settings"), rec.rows("events")


def _evaluations(events) -> list[dict]:
    return [json.loads(e["detail"]) for e in events if e["kind"] == "evaluation"]


@pytest.mark.parametrize("no_grad", [True, False], ids=["no-grad", "autograd-on"])
def test_validation_between_steps_is_left_out_of_the_steps_and_reported(tmp_path, no_grad):
    with torchdoctor.watch(tmp_path / "w.sqlite", **WATCH) as w:
        own = train_with_evaluation(no_grad=no_grad)
    steps, loaders, settings, events = _rows(w.path)

    # Exactly the training batches, whatever came between them.
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert [(s["batch_size"], s["samples"]) for s in steps] == [(BATCH, BATCH)] * STEPS

    # Each step's time is what the loop measured for that step itself (the recorded step ends
    # inside opt.step(), the loop's own mark just after it: the same boundaries), never the
    # evaluation before it: a pass is tens of times longer than a step.
    shortest_pass = min(own.evaluations)
    for record, measured in zip(steps[1:], own.steps[1:], strict=True):
        assert abs(record["wall_s"] - measured) < 0.5 * shortest_pass, (record, measured)
        # The slow validation data was never waited for in a training step.
        assert record["data_wait_s"] < 0.5 * shortest_pass
    stats = step_stats(steps, loaders, settings)
    skip = STEPS - stats.measured_steps
    own_mean = sum(own.steps[skip:]) / stats.measured_steps
    # Three passes over 15 measured steps would add a fifth of a pass to the mean.
    assert 1 / stats.steps_per_s == pytest.approx(own_mean, abs=0.05 * shortest_pass)
    assert stats.samples_per_s == pytest.approx(BATCH * stats.steps_per_s)

    # Every pass is reported: the step it came before, its batches, samples and duration.
    passes = _evaluations(events)
    assert [p["step"] for p in passes] == [4, 8, 12, 16]
    assert [(p["batches"], p["samples"]) for p in passes] == [(2, VAL_SAMPLES)] * 4
    assert {p["detected_by"] for p in passes} == {"grad-disabled" if no_grad else "loader-pass"}
    # The last pass came after the last step; the loop's next() on its training data, which
    # ran out, still tells where it ended.
    assert [p["ended_by"] for p in passes] == ["training-data"] * 4
    for reported, measured in zip(passes, own.evaluations, strict=True):
        assert reported["seconds"] == pytest.approx(measured, abs=0.5 * shortest_pass)
    total = evaluation_stats(events)
    assert (total.passes, total.batches, total.samples) == (4, 8, 4 * VAL_SAMPLES)


def test_show_mentions_the_evaluation(tmp_path):
    with torchdoctor.watch(tmp_path / "w.sqlite", **WATCH) as w:
        own = train_with_evaluation()
    shown = run_td("show", "--json", str(w.path))
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)
    assert summary["steps"]["step_count"] == STEPS
    evaluation = summary["evaluation"]
    assert (evaluation["passes"], evaluation["samples"]) == (4, 4 * VAL_SAMPLES)
    assert evaluation["seconds"] == pytest.approx(sum(own.evaluations), rel=0.5)
    text = run_td("show", str(w.path)).stdout
    assert f"steps: {STEPS}, median" in text
    assert "evaluation: 4 passes, " in text
    assert f", {4 * VAL_SAMPLES} samples, left out of step figures" in text


def test_a_run_without_evaluation_says_nothing_about_it(tmp_path):
    with torchdoctor.watch(tmp_path / "w.sqlite", **WATCH) as w:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
        for x, y in DataLoader(data, batch_size=BATCH):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    steps, _, _, events = _rows(w.path)
    assert [s["samples"] for s in steps] == [BATCH] * 4
    assert evaluation_stats(events) is None
    shown = run_td("show", str(w.path))
    assert shown.returncode == 0 and "\nevaluation:" not in shown.stdout


def test_training_batches_fetched_under_no_grad_are_still_the_steps_own(tmp_path):
    # Some loops fetch (and preprocess) their batch inside no_grad: nothing of it is evaluation.
    with torchdoctor.watch(tmp_path / "w.sqlite", **WATCH) as w:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
        batches = iter(DataLoader(data, batch_size=BATCH))
        for _ in range(6):
            with torch.no_grad():
                x, y = next(batches)
                x = (x - x.mean()) / (x.std() + 1e-6)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    steps, _, _, events = _rows(w.path)
    assert [(s["batch_size"], s["samples"]) for s in steps] == [(BATCH, BATCH)] * 6
    assert all(s["data_wait_s"] > 0 for s in steps)
    assert _evaluations(events) == []


def test_training_without_a_dataloader_keeps_its_validation_out_of_its_steps(tmp_path):
    # Batches made in the loop (no DataLoader), validation from a DataLoader under no_grad.
    with torchdoctor.watch(tmp_path / "w.sqlite", **WATCH) as w:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        val = DataLoader(SlowValidation(), batch_size=VAL_BATCH)
        times = OwnTimes()
        for i in range(8):
            x, y = torch.randn(BATCH, 4), torch.randn(BATCH, 1)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if i in (2, 5):
                _evaluate(model, val, times)
    steps, _, _, events = _rows(w.path)
    assert [s["samples"] for s in steps] == [None] * 8
    shortest_pass = min(times.evaluations)
    # The passes after steps 2 and 5 are not in steps 3 and 6.
    assert max(s["wall_s"] for s in steps[1:]) < 0.5 * shortest_pass
    passes = _evaluations(events)
    assert [(p["step"], p["batches"], p["samples"]) for p in passes] == [
        (3, 2, VAL_SAMPLES),
        (6, 2, VAL_SAMPLES),
    ]
    assert {p["ended_by"] for p in passes} == {"last-evaluation-batch"}


# -- the libraries' own evaluation loops --------------------------------------------------------


def test_a_lightning_fit_with_validation_records_training_batches_only(tmp_path):
    import lightning

    callback = torchdoctor_lightning_callback(tmp_path / "fit.sqlite", **WATCH)
    lightning_fit(
        lightning, callback, samples=24, batch_size=BATCH, val_samples=20,
        val_check_interval=3, limit_val_batches=3, num_sanity_val_steps=2,
    )  # fmt: skip
    steps, _, _, events = _rows(callback.path)
    assert [(s["step"], s["samples"]) for s in steps] == [(i, BATCH) for i in range(6)]
    assert {s["batch_size"] for s in steps} == {BATCH}
    # The sanity check (2 batches) before the first step, then 3 batches after steps 3 and 6.
    passes = _evaluations(events)
    assert [(p["step"], p["batches"], p["samples"]) for p in passes] == [
        (0, 2, 2 * BATCH),
        (3, 3, 3 * BATCH),
        (6, 3, 3 * BATCH),
    ]
    assert {p["detected_by"] for p in passes} == {"grad-disabled"}
    # Lightning asks for no more training data after the last step: the last pass ends with
    # the fit, at its last batch.
    assert [p["ended_by"] for p in passes] == ["training-data"] * 2 + ["process-end"]


def test_a_hugging_face_fit_with_evaluation_records_training_batches_only(tmp_path):
    import transformers

    callback = torchdoctor_hf_callback(tmp_path / "hf.sqlite", **WATCH)
    trainer = hf_trainer(
        transformers, tmp_path, callback, samples=7 * BATCH, batch_size=BATCH, eval_samples=20,
        eval_strategy="steps", eval_steps=3,
    )  # fmt: skip
    trainer.train()
    steps, _, _, events = _rows(callback.path)
    assert [s["step"] for s in steps] == list(range(7))
    # accelerate fetches one batch ahead: samples land one step early, and none is evaluation
    # (the last step asks only for the end of the training data, after the second pass).
    assert sum(s["samples"] or 0 for s in steps) == 7 * BATCH
    assert all((s["samples"] or 0) <= 2 * BATCH for s in steps)
    # The Trainer fetches its evaluation batches with autograd on: whole passes, no step.
    passes = _evaluations(events)
    # Every 3 steps, and once more at the end of training.
    assert [(p["step"], p["batches"], p["samples"]) for p in passes] == [
        (3, 5, 20),
        (6, 5, 20),
        (7, 5, 20),
    ]
    assert {p["detected_by"] for p in passes} == {"loader-pass"}
    assert [p["ended_by"] for p in passes] == ["training-data"] * 2 + ["process-end"]
