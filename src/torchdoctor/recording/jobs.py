"""Which recordings make one job: the node recordings of a distributed run.

Each rank reports its rendezvous (``rank-info``: MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID);
recordings whose ranks share a rendezvous and whose runs overlap in time are one job. A folder
stands for the recordings in it.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.recording.reader import open_recording, require_regular_file


def job_recording_paths(args: list[str]) -> list[Path]:
    """The recordings named by ``args`` (files, or folders holding ``*.sqlite``), checked to
    be one job; raises UserError otherwise."""
    paths: list[Path] = []
    for arg in args:
        p = Path(arg)
        if os.path.isdir(p):  # False for a name too long, where Path.is_dir raises (3.11)
            # as `ls` lists them: a FIFO or folder named *.sqlite is not a recording
            found = sorted(f for f in p.glob("*.sqlite") if f.is_file())
            if not found:
                raise UserError(f"{arg!r} holds no recording (*.sqlite)")
            paths.extend(found)
        else:
            require_regular_file(p)  # before any read: opening a FIFO waits forever
            paths.append(p)
    unique = list(dict.fromkeys(paths))
    if len(unique) > 1:
        _check_one_job(unique)
    return unique


def rendezvous_of(path: Path) -> tuple[str, tuple | None, tuple[float, float]]:
    """(name, rendezvous key, (start, end)) of a recording, read without opening it fully."""
    try:
        db = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)
        try:
            meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}
            row = db.execute(
                "SELECT detail FROM events WHERE kind = 'rank-info' ORDER BY t LIMIT 1"
            ).fetchone()
        finally:
            db.close()
        key = None
        if row is not None:
            info = json.loads(row[0])
            key = (info.get("master_addr"), info.get("master_port"), info.get("run_id"))
        start = float(meta.get("started_at") or 0.0)
        end = float(meta.get("ended_at") or start)
    except (sqlite3.Error, ValueError, TypeError, AttributeError):
        # Say what is wrong with this file, not that it holds no ranks (which would blame
        # whichever good recording was named first); one salvage can read is kept.
        open_recording(path).close()
        return str(path), None, (0.0, 0.0)
    return str(path), key, (start, end)


def _check_one_job(paths: list[Path]) -> None:
    described = [rendezvous_of(p) for p in paths]
    alone = [name for name, key, _ in described if key is None]
    if alone:
        raise UserError(
            f"{alone[0]!r} holds no distributed ranks: only the node recordings of one "
            "distributed job can be diagnosed together; diagnose it on its own"
        )
    keys = {key for _, key, _ in described}
    if len(keys) > 1:
        raise UserError(
            f"these recordings hold {len(keys)} different jobs (rendezvous "
            f"{', '.join(f'{k[0]}:{k[1]}' for k in sorted(keys, key=str))}): pass the "
            "recordings of one job (one per node)"
        )
    start = max(s for _, _, (s, _) in described)
    end = min(e for _, _, (_, e) in described)
    if start > end + 60:
        raise UserError(
            "these recordings share a rendezvous but ran at different times: they are "
            "separate runs; pass the recordings of one run"
        )
