"""input_files.read_small_file: a settings file the user named is read only when it is a
regular file of at most the limit; every other case is one UserError line naming the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchdoctor.errors import UserError
from torchdoctor.input_files import read_small_file


def test_a_regular_file_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_bytes(b"a = 1\n")
    assert read_small_file(path, "thresholds file") == b"a = 1\n"


def test_a_file_at_the_limit_is_read_and_one_byte_more_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_bytes(b"x" * 100)
    assert len(read_small_file(path, "f", limit=100)) == 100
    path.write_bytes(b"x" * 101)
    with pytest.raises(UserError, match="is larger than"):
        read_small_file(path, "f", limit=100)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("/dev/zero", "is a character device, not a file"),  # was read to its end
        (".", "is a folder, not a file"),
        ("missing.toml", "no such thresholds file"),
        ("x" * 300, "File name too long"),
    ],
)
def test_anything_else_is_one_line(tmp_path: Path, name: str, says: str) -> None:
    os.chdir(tmp_path)
    with pytest.raises(UserError, match=says) as caught:
        read_small_file(name, "thresholds file")
    assert "\n" not in caught.value.message


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match=r"a FIFO \(named pipe\), not a file"):
        read_small_file(fifo, "thresholds file")
