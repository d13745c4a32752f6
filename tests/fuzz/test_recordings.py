"""Damaged and edited recordings into every reader: a real recording cut at each SQLite page
boundary, bytes flipped, tables dropped, a newer schema, meta values and row values edited.
The bar: success (a damaged file is read as far as it can be), or one line and a non-zero
exit; never a traceback, never a hang, and the file left exactly as it was."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz.conftest import invoke, unchanged
from torchdoctor.recording.schema import TABLES

PAGE = 512  # the smallest SQLite page: every boundary of any page size is one of these

READERS = [
    ["show"],
    ["show", "--json"],
    ["diagnose"],
    ["diagnose", "--json"],
    ["report", "-o", "out.html"],
    ["export", "--format", "csv", "--out-dir", "exported"],
    ["export", "--format", "jsonl", "--out-dir", "exported"],
    ["compare", "--json", "last"],  # against the newest recording of the sandbox: none there
]

META_KEYS = ["schema_version", "started_at", "ended_at", "command", "host", "gpus", "mode",
             "interval_s", "exit_status", "exit_signal", "env", "totals", "writer", "root_pid",
             "instrumented", "torch_version", "no-such-key"]  # fmt: skip
VALUES = st.one_of(
    st.none(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.sampled_from(["{not json", "abc", '"abc"', "[]", "{}", "null", "-1", "1e309", "[1,2]",
                     '{"hostname": 5}', "true", '"[/x]"']),
)  # fmt: skip
COLUMNS = [(table, column) for table, spec in TABLES.items() for column in spec.column_names]


def _edit(path: Path, data) -> str:
    """One damage or edit of the file at ``path``, drawn from ``data``; what it was."""
    kind = data.draw(
        st.sampled_from(["truncate", "flip", "drop", "version", "meta", "meta-delete", "row"])
    )
    raw = path.read_bytes()
    if kind == "truncate":
        cut = data.draw(st.integers(0, len(raw) // PAGE)) * PAGE
        path.write_bytes(raw[:cut])
        return f"truncated at {cut}"
    if kind == "flip" and raw:
        flips = data.draw(
            st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(1, 255)), max_size=8)
        )
        buf = bytearray(raw)
        for offset, mask in flips:
            buf[offset] ^= mask
        path.write_bytes(bytes(buf))
        return f"flipped {flips}"
    if kind == "flip":
        return "flip: nothing left to flip"
    db = sqlite3.connect(path)
    try:
        return _edit_sql(db, kind, data)
    except (sqlite3.Error, ValueError):
        return f"{kind}: not possible on this file (already damaged)"
    finally:
        db.close()


def _edit_sql(db: sqlite3.Connection, kind: str, data) -> str:
    if True:
        if kind == "drop":
            table = data.draw(st.sampled_from(["meta", *TABLES]))
            db.execute(f"DROP TABLE {table}")
            what = f"dropped {table}"
        elif kind == "version":
            version = data.draw(st.integers(-(2**31), 2**31 - 1))
            db.execute(f"PRAGMA user_version = {version}")
            what = f"user_version {version}"
        elif kind == "meta":
            key, value = data.draw(st.sampled_from(META_KEYS)), data.draw(VALUES)
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))
            what = f"meta {key} = {value!r}"
        elif kind == "meta-delete":
            key = data.draw(st.sampled_from(META_KEYS))
            db.execute("DELETE FROM meta WHERE key = ?", (key,))
            what = f"meta {key} deleted"
        else:
            (table, column), value = data.draw(st.sampled_from(COLUMNS)), data.draw(VALUES)
            db.execute(f'UPDATE {table} SET "{column}" = ?', (value,))
            what = f"{table}.{column} = {value!r}"
        db.commit()
    return what


def _read_everywhere(folder: Path, path: Path, env: dict[str, str], readers) -> None:
    with unchanged(path):
        for command in readers:
            invoke([*command, str(path)], folder, env).check()
        invoke(["ls", str(path.parent)], folder, env).check()


@pytest.fixture
def workdir(sandbox, real_recording: bytes):
    """A fresh copy of the real recording, in a folder of its own, for each example."""
    root, env = sandbox
    count = iter(range(10**9))

    def fresh() -> Path:
        folder = root / f"case{next(count)}"
        (folder / "runs").mkdir(parents=True)
        path = folder / "runs" / "rec.sqlite"
        path.write_bytes(real_recording)
        return path

    return fresh, env


@given(data=st.data())
@example(data=None)  # the recording as it was written: every reader succeeds on it
def test_a_damaged_recording_is_read_or_refused_in_one_line(workdir, data) -> None:
    fresh, env = workdir
    path = fresh()
    if data is not None:
        edits = [_edit(path, data) for _ in range(data.draw(st.integers(1, 3)))]
        note = f"{path}: {'; '.join(edits)}"
        data.draw(st.just(note), label="edits")
    readers = READERS if data is None else [data.draw(st.sampled_from(READERS), label="reader")]
    _read_everywhere(path.parent.parent, path, env, readers)


@pytest.mark.parametrize("reader", [["show"], ["diagnose"]], ids=" ".join)
def test_a_recording_cut_at_every_page_boundary(workdir, real_recording: bytes, reader) -> None:
    fresh, env = workdir
    page = int.from_bytes(real_recording[16:18], "big")
    for cut in range(0, len(real_recording), page):
        path = fresh()
        path.write_bytes(real_recording[:cut])
        with unchanged(path):
            invoke([*reader, str(path)], path.parent, env).check()


def _non_utf8_table_name(raw: bytes) -> bytes:
    at = raw.index(b"CREATE TABLE host_samples") + len(b"CREATE TABLE ")
    return raw[:at] + bytes([raw[at] ^ 0x80]) + raw[at + 1 :]


# Inputs the fuzzer found that crashed a reader, each fixed at its cause.
FOUND: dict[str, object] = {
    # UnicodeDecodeError from SQLite's schema text while opening (reader.open_recording)
    "schema text not UTF-8": _non_utf8_table_name,
    # a blob in a number column reached show --json's json.dumps (TypeError): rows() checks
    "blob in dataloaders.t": "UPDATE dataloaders SET t = x'61f642e234'",
    # diagnose: every rule reading settings 'failed and was skipped' on the recording's damage
    "blob in settings.pid": "UPDATE settings SET pid = x'0a53776170'",
    "text in steps.wall_s": "UPDATE steps SET wall_s = 'abc'",
    "NULL steps.data_wait_s": "UPDATE steps SET data_wait_s = NULL",
    # ls and report printed it as a date: OverflowError / OSError EOVERFLOW from localtime
    "started_at in year 2e9": "UPDATE meta SET value = '67767976233532800' WHERE key = 'started_at'",
    "ended_at NaN": "UPDATE meta SET value = 'NaN' WHERE key = 'ended_at'",
    # report's process table added None + str (TypeError): rows() refuses NULL where the
    # record's field is never None
    "NULL processes.role": "UPDATE processes SET role = NULL",
    # a schema flipped past UTF-8 (flip 6485 ^ 128): every rule failed apart on table_info
    # show formatted AVG(cpu_busy), text, as a number after the file was closed (ValueError)
    "text in host_samples.cpu_busy": "UPDATE host_samples SET cpu_busy = ''",
    "blob in host_samples.cpu_busy": "UPDATE host_samples SET cpu_busy = x''",
    "schema type not UTF-8": lambda raw: raw.replace(b"INTEGER", b"\xc9NTEGER", 1),
    # show and ls joined the command's words as text (TypeError): the reader checks its items
    "command of numbers": "UPDATE meta SET value = '[0]' WHERE key = 'command'",
    # report's process table: MAX(rss) of text is the text, formatted as bytes (ValueError)
    "text in process_samples.rss": "UPDATE process_samples SET rss = ''",
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_inputs_the_fuzzer_found(workdir, name: str) -> None:
    fresh, env = workdir
    path = fresh()
    edit = FOUND[name]
    if callable(edit):
        path.write_bytes(edit(path.read_bytes()))
    else:
        db = sqlite3.connect(path)
        db.execute(edit)
        db.commit()
        db.close()
    _read_everywhere(path.parent.parent, path, env, READERS)
