"""Opening the queue's state while other processes open or write it: a lock is waited out,
never taken for a damaged file (whose advice is to set the state aside)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from torchdoctor.errors import UserError
from torchdoctor.queue import store
from torchdoctor.queue.store import CorruptStateError, QueueStore


def _locked() -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError("database is locked")
    exc.sqlite_errorcode = sqlite3.SQLITE_BUSY
    exc.sqlite_errorname = "SQLITE_BUSY"
    return exc


def test_a_lock_is_told_from_damage() -> None:
    assert store._is_lock(_locked())
    assert store._is_lock(sqlite3.OperationalError("database table is locked"))
    assert not store._is_lock(sqlite3.DatabaseError("file is not a database"))


def test_an_open_that_meets_a_lock_is_tried_again(tmp_path: Path, monkeypatch) -> None:
    # SQLite answers "locked" at once, without its busy handler, in a few places (the switch
    # to WAL, a read upgraded to a write): 1 in 150 rounds of 8 processes opening and writing
    # one fresh state file together, and CI once told a submitter to discard the queue.
    real, tries = QueueStore._open, []

    def first_two_locked(self: QueueStore) -> None:
        tries.append(1)
        if len(tries) <= 2:
            raise store._Busy from _locked()
        real(self)

    monkeypatch.setattr(QueueStore, "_open", first_two_locked)
    state = QueueStore(tmp_path / "queue.sqlite")
    try:
        assert len(tries) == 3 and state.jobs() == []
    finally:
        state.close()


def test_a_lock_that_stays_says_so_and_is_not_called_damage(tmp_path: Path, monkeypatch) -> None:
    def always_locked(self: QueueStore) -> None:
        raise store._Busy from _locked()

    monkeypatch.setattr(QueueStore, "_open", always_locked)
    monkeypatch.setattr(store, "OPEN_BUSY_S", 0.2)
    with pytest.raises(UserError) as err:
        QueueStore(tmp_path / "queue.sqlite")
    assert not isinstance(err.value, CorruptStateError)
    assert "stayed locked" in str(err.value) and "recover" not in str(err.value)


def test_a_damaged_file_is_still_called_damaged(tmp_path: Path) -> None:
    path = tmp_path / "queue.sqlite"
    path.write_bytes(b"not a database at all, but long enough to be read as one" * 20)
    with pytest.raises(CorruptStateError, match="is unreadable"):
        QueueStore(path)
