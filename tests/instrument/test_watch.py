"""torchdoctor.watch() and the callbacks' shared session, in this process, into real files."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchdoctor
from torchdoctor.errors import UserError
from torchdoctor.recording.steps import step_stats
from torchdoctor.run.integrations import WatchSession


def _fit(steps=10):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(steps * 2, 4), torch.randn(steps * 2, 1))
    for x, y in DataLoader(data, batch_size=2):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _open_descriptors() -> dict[int, str]:
    names = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listdir itself used is gone
            names[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
    return names


def test_repeated_watches_leave_no_descriptors_open(tmp_path):
    # A notebook watches one fit after another in the same kernel: each must give back what
    # it opened (host, job and recording files), or the kernel runs out after a few hundred.
    with torchdoctor.watch(tmp_path / "warm.sqlite", interval=0.05, gpus=False):
        _fit(2)
    before = _open_descriptors()
    for i in range(3):
        with torchdoctor.watch(tmp_path / f"w{i}.sqlite", interval=0.05, gpus=False):
            _fit(2)
    after = _open_descriptors()
    assert {fd: after[fd] for fd in after.keys() - before.keys()} == {}


def test_watch_records_samples_and_steps_then_restores_torch(tmp_path):
    init = DataLoader.__init__
    with torchdoctor.watch(tmp_path / "w.sqlite", interval=0.05, gpus=False) as w:
        _fit(10)
    assert DataLoader.__init__ is init
    with torchdoctor.open_recording(w.path) as rec:
        assert rec.meta["mode"] == "watch" and rec.meta["exit_status"] == 0
        assert len(rec.rows("host_samples")) >= 1 and len(rec.rows("process_samples")) >= 1
        steps = rec.rows("steps")
        stats = step_stats(steps, rec.rows("dataloaders"), rec.rows("settings"))
    assert [s["step"] for s in steps] == list(range(10))
    assert stats.batch_size == 2 and stats.settings["optimizer.class"] == "torch.optim.sgd.SGD"


def test_a_failing_block_is_recorded_as_failed(tmp_path):
    with pytest.raises(ZeroDivisionError), torchdoctor.watch(tmp_path / "f.sqlite", gpus=False):
        _fit(2)
        1 / 0  # noqa: B018
    with torchdoctor.open_recording(tmp_path / "f.sqlite") as rec:
        assert rec.meta["exit_status"] == 1 and len(rec.rows("steps")) == 2


def test_watch_refuses_a_bad_interval_and_an_existing_file(tmp_path):
    with pytest.raises(UserError, match="out of range"):
        torchdoctor.watch(tmp_path / "x.sqlite", interval=0.001)
    (tmp_path / "old.sqlite").write_text("")
    # The message names what a Python caller can change, not the CLI's --out.
    with pytest.raises(UserError, match="already exists; choose a new name with the out argument"):
        torchdoctor.watch(tmp_path / "old.sqlite").start()


def test_callback_session_starts_and_stops_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    session = WatchSession(tmp_path / "fit.sqlite", gpus=False, interval=0.05)
    session.train_end()  # before start: nothing to do
    session.train_start()
    session.train_start()  # Lightning and HF may call twice (fit after tune, resume)
    _fit(3)
    session.train_end(failed=False)
    session.train_end(failed=True)
    assert session.path == tmp_path / "fit.rank1.sqlite"  # one file per rank
    with torchdoctor.open_recording(session.path) as rec:
        assert rec.meta["exit_status"] == 0
        assert [
            json.loads(e["detail"]).get("role")
            for e in rec.rows("events")
            if e["kind"] == "process-start"
        ] == ["rank"]
        assert len(rec.rows("steps")) == 3


def test_a_process_that_exits_inside_watch_still_finishes_the_recording(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "exit.sqlite"
    code = (
        "import os, torchdoctor\n"
        f"torchdoctor.watch({str(out)!r}, gpus=False, instrument=False).start()\n"
        "raise SystemExit(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    with torchdoctor.open_recording(out) as rec:
        assert rec.meta["ended_at"] is not None and rec.meta["exit_status"] is None
