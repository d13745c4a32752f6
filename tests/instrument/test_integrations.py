"""The Lightning and Hugging Face callbacks, driving real fits of the real libraries on CPU."""

from __future__ import annotations

import pickle
import sys

import pytest
from torch.utils.data import DataLoader

import torchdoctor
from tests.instrument.fits import (
    _leave_the_process_as_found,  # noqa: F401 (an autouse fixture for this module)
    hf_trainer,
    lightning_fit,
)
from torchdoctor.errors import UserError
from torchdoctor.run import integrations
from torchdoctor.run.integrations import (
    WatchSession,
    torchdoctor_hf_callback,
    torchdoctor_lightning_callback,
)

# Lightning's own use of torch's pytree; nothing these tests do.
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")

BATCHES = 6
BATCH_SIZE = 4
SAMPLES = BATCHES * BATCH_SIZE
WATCH = {"gpus": False, "interval": 0.05}


class Failure(RuntimeError):
    """Raised by the models of tests/instrument/fits.py at their third step."""


def _recording(path):
    with torchdoctor.open_recording(path) as rec:
        return rec.meta, rec.rows("steps"), rec.rows("dataloaders"), rec.rows("settings")


def _settings(rows):
    import json

    return {row["key"]: json.loads(row["value"]) for row in rows}


# -- Lightning ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lightning():
    import lightning

    return lightning


def _lightning_fit(lightning, callback, fail_with=None):
    return lightning_fit(
        lightning, callback, samples=SAMPLES, batch_size=BATCH_SIZE, fail_with=fail_with
    )


def _hf_trainer(transformers, tmp_path, callback, fail_with=None):
    return hf_trainer(
        transformers, tmp_path, callback, samples=SAMPLES, batch_size=BATCH_SIZE,
        fail_with=fail_with,
    )  # fmt: skip


def test_a_lightning_fit_is_recorded_and_a_second_fit_gets_its_own_file(lightning, tmp_path):
    init = DataLoader.__init__
    callback = torchdoctor_lightning_callback(tmp_path / "fit.sqlite", **WATCH)
    assert callback.path is None  # nothing before the fit
    _lightning_fit(lightning, callback)
    assert callback.path == tmp_path / "fit.sqlite"
    assert DataLoader.__init__ is init  # torch is left as it was
    meta, steps, loaders, settings = _recording(callback.path)
    assert meta["mode"] == "watch" and meta["exit_status"] == 0
    assert [s["step"] for s in steps] == list(range(BATCHES))
    assert [(s["batch_size"], s["samples"]) for s in steps] == [(BATCH_SIZE, BATCH_SIZE)] * BATCHES
    assert [(d["batch_size"], d["dataset_len"]) for d in loaders] == [(BATCH_SIZE, SAMPLES)]
    assert _settings(settings)["optimizer.class"] == "torch.optim.sgd.SGD"

    _lightning_fit(lightning, callback)  # the same callback in a new fit: a new recording
    assert callback.path == tmp_path / "fit-2.sqlite"
    meta, steps, _, _ = _recording(callback.path)
    assert meta["exit_status"] == 0 and len(steps) == BATCHES
    assert callback.session.paths == [tmp_path / "fit.sqlite", tmp_path / "fit-2.sqlite"]


def test_a_failing_lightning_fit_is_recorded_as_failed_and_raises_unchanged(lightning, tmp_path):
    init = DataLoader.__init__
    failure = Failure("loss went NaN")
    callback = torchdoctor_lightning_callback(tmp_path / "fail.sqlite", **WATCH)
    with pytest.raises(Failure) as raised:
        _lightning_fit(lightning, callback, fail_with=failure)
    assert raised.value is failure
    assert DataLoader.__init__ is init
    meta, steps, _, _ = _recording(tmp_path / "fail.sqlite")
    assert meta["exit_status"] == 1 and meta["ended_at"] is not None
    assert [s["step"] for s in steps] == [0, 1]  # the steps before the failure


def test_a_recording_that_cannot_start_warns_and_the_fit_goes_on(lightning, tmp_path):
    (tmp_path / "taken").write_text("a file where the output folder should be")
    callback = torchdoctor_lightning_callback(tmp_path / "taken" / "fit.sqlite", **WATCH)
    with pytest.warns(RuntimeWarning, match="this fit is not recorded: .*is a file"):
        trainer = _lightning_fit(lightning, callback)
    assert trainer.global_step == BATCHES and callback.path is None


def test_the_lightning_callback_pickles_for_spawned_ranks(lightning, tmp_path):
    callback = torchdoctor_lightning_callback(tmp_path / "fit.sqlite", **WATCH)
    copy = pickle.loads(pickle.dumps(callback))
    assert type(copy) is type(callback) is integrations.TorchdoctorLightningCallback
    assert isinstance(copy, lightning.pytorch.callbacks.Callback)
    assert copy.session.out == tmp_path / "fit.sqlite" and copy.session.watch_kwargs == WATCH


# -- Hugging Face -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers():
    import transformers

    return transformers


def _hf_steps_are_the_fit(steps):
    assert [s["step"] for s in steps] == list(range(BATCHES))
    assert {s["batch_size"] for s in steps} == {BATCH_SIZE}
    # accelerate fetches one batch ahead, so samples land one step early; none are lost.
    assert sum(s["samples"] or 0 for s in steps) == SAMPLES


def test_a_hugging_face_fit_is_recorded_and_a_second_train_gets_its_own_file(
    transformers, tmp_path
):
    callback = torchdoctor_hf_callback(tmp_path / "hf.sqlite", **WATCH)
    trainer = _hf_trainer(transformers, tmp_path, callback)
    output = trainer.train()
    assert output.global_step == BATCHES and callback.path == tmp_path / "hf.sqlite"
    meta, steps, loaders, settings = _recording(callback.path)
    assert meta["mode"] == "watch" and meta["exit_status"] == 0
    _hf_steps_are_the_fit(steps)
    assert [d["dataset_len"] for d in loaders] == [SAMPLES]
    assert _settings(settings)["optimizer.class"] == "torch.optim.adamw.AdamW"
    assert not (tmp_path / "hf-out").exists() or not any((tmp_path / "hf-out").iterdir())

    trainer.train()
    assert callback.path == tmp_path / "hf-2.sqlite"
    meta, steps, _, _ = _recording(callback.path)
    assert meta["exit_status"] == 0
    _hf_steps_are_the_fit(steps)


def test_a_failing_hugging_face_fit_is_recorded_as_failed_and_raises_unchanged(
    transformers, tmp_path
):
    failure = Failure("loss went NaN")
    callback = torchdoctor_hf_callback(tmp_path / "fail.sqlite", **WATCH)
    trainer = _hf_trainer(transformers, tmp_path, callback, fail_with=failure)
    with pytest.raises(Failure) as raised:
        trainer.train()
    assert raised.value is failure
    meta, steps, _, _ = _recording(tmp_path / "fail.sqlite")
    assert meta["exit_status"] == 1 and meta["ended_at"] is not None
    assert [s["step"] for s in steps] == [0, 1]


def test_the_hf_callback_pickles(transformers, tmp_path):
    callback = torchdoctor_hf_callback(tmp_path / "hf.sqlite", **WATCH)
    copy = pickle.loads(pickle.dumps(callback))
    assert type(copy) is integrations.TorchdoctorTrainerCallback
    assert isinstance(copy, transformers.TrainerCallback)


# -- both ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("factory", "modules", "hint"),
    [
        (
            torchdoctor_lightning_callback,
            ["lightning.pytorch.callbacks", "pytorch_lightning.callbacks"],
            "pip install lightning",
        ),
        (torchdoctor_hf_callback, ["transformers"], "pip install transformers"),
    ],
)
def test_a_missing_library_says_how_to_install_it(monkeypatch, tmp_path, factory, modules, hint):
    monkeypatch.setattr(integrations, "_CLASSES", {})  # forget classes built by other tests
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # import now fails as if not installed
    with pytest.raises(UserError, match=hint):
        factory(tmp_path / "fit.sqlite")


@pytest.mark.parametrize("factory", [torchdoctor_lightning_callback, torchdoctor_hf_callback])
def test_bad_arguments_fail_when_the_callback_is_made(factory, tmp_path):
    (tmp_path / "old.sqlite").write_text("")
    with pytest.raises(UserError, match="already exists"):
        factory(tmp_path / "old.sqlite")
    with pytest.raises(UserError, match="out of range"):
        factory(tmp_path / "new.sqlite", interval=0.0001)


def test_each_rank_gets_its_own_file_without_a_rank_variable(monkeypatch, tmp_path):
    # Lightning's own launcher sets no RANK: the trainer's rank names the file.
    monkeypatch.delenv("RANK", raising=False)
    session = WatchSession(tmp_path / "fit.sqlite", instrument=False, **WATCH)
    session.train_start(rank=1, world_size=2)
    session.train_end()
    # With RANK set (torchrun), watch() names the file; the rank is not added twice.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    session.train_start(rank=1, world_size=2)
    session.train_end()
    assert session.paths == [tmp_path / "fit.rank1.sqlite", tmp_path / "fit-2.rank1.sqlite"]
    for path in session.paths:
        assert _recording(path)[0]["exit_status"] == 0


@pytest.mark.parametrize(
    ("exc", "status"),
    [(RuntimeError("x"), 1), (KeyboardInterrupt(), 130), (SystemExit(75), 75), (SystemExit(), 0)],
)
def test_a_failure_is_recorded_with_the_status_it_gives_the_process(tmp_path, exc, status):
    session = WatchSession(tmp_path / "fit.sqlite", instrument=False, **WATCH)
    session.train_start()
    session.train_failed(exc)
    session.train_failed(exc)  # a second report changes nothing
    assert _recording(session.path)[0]["exit_status"] == status
