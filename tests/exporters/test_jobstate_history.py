"""The first scrape starts from the totals the writer saved beside the rows (or, in a
recording from before them, from the history summed in SQL): the same counters, gauges and
step figures as reading every row one by one, on a recording that has every case the crediting rules name
(processes that exit and start, change role, counters unread or read lower, PSS refreshed
now and then, two ranks with CUDA figures, GPUs, events), and on from there: from the totals
the writer goes on saving (or, without them, row by row)."""

from __future__ import annotations

import dataclasses
import random
import sqlite3
from pathlib import Path

import pytest

from tests.top.builders import gpu, gpu_proc, host, proc
from torchdoctor.exporters.jobstate import JobState
from torchdoctor.recording import RecordingWriter
from torchdoctor.recording.records import JobEvent, StepRecord
from torchdoctor.recording.tail import RecordingTail
from torchdoctor.sampling.types import Snapshot

T = 1_796_000_000.0


def _snapshot(i: int, rng: random.Random, gaps: bool) -> Snapshot:
    t = T + 0.5 * i
    procs = []
    # pid 10: trainer, a launcher once its children appear (from sample 40)
    # pids 20+k: a worker per epoch of 25 samples, each starting from zero
    for pid, role, start in (
        (10, "trainer" if i < 40 else "launcher", 0),
        (20 + i // 25, "dataloader-worker", 25 * (i // 25)),
    ):
        p = dataclasses.replace(proc(pid, 1, role=role), t=t, create_time=T + start)
        user = 0.3 * (i - start) + rng.random() * 0.01
        read = 4096 * (i - start)
        if gaps and pid == 10:
            read = None  # the trainer's io is unreadable
        if gaps and rng.random() < 0.1:
            user = None  # a reading that failed this once
        elif rng.random() < 0.05:
            user = 0.0  # read lower than before: adds nothing
        p = dataclasses.replace(
            p, cpu_user_s=user, cpu_system_s=0.01 * i, read_bytes=read, write_bytes=read,
            pss=(1000 + i) if i % 10 == 0 else None, uss=(900 + i) if i % 10 == 0 else None,
            threads=3, rss=1 << 20,
        )  # fmt: skip
        procs.append(p)
    gpus = [dataclasses.replace(gpu(index, used=(i + index) << 20), t=t) for index in (0, 1)]
    used = [dataclasses.replace(gpu_proc(10, (i + 1) << 20, index=0), t=t)]
    h = dataclasses.replace(host(), t=t)
    return Snapshot(t=t, host=h, processes=procs, gpus=gpus, gpu_processes=used)


def _steps(i: int, ranks: tuple) -> list[StepRecord]:
    out = []
    for rank in ranks:
        t = T + 0.5 * i
        cuda = (i % 3 != 0) or None
        out.append(
            StepRecord(
                pid=100 + (rank or 0), rank=rank, step=i, t_start=t, t_end=t + 0.4, wall_s=0.4,
                data_wait_s=0.5 if i % 7 == 0 else 0.1,  # more than the wall: capped
                batch_size=32, samples=None if i % 4 == 0 else 30,
                cuda_allocated=i << 20 if cuda else None,
                cuda_reserved=(i + 1) << 20 if cuda else None,
                cuda_max_allocated=(i + 2) << 20 if cuda else None,
                cuda_alloc_retries=i // 10 if cuda else None, cuda_ooms=0 if cuda else None,
            )
        )  # fmt: skip
    return out


def _record(
    writer: RecordingWriter, i: int, rng: random.Random, gaps: bool = True, ranks=(0, 1)
) -> None:
    writer.write_snapshot(_snapshot(i, rng, gaps))
    writer.add_steps(_steps(i, ranks))
    if i % 25 == 0:
        writer.add_events([JobEvent(pid=10, rank=None, t=T + 0.5 * i, kind="epoch-start",
                                    detail="{}")])  # fmt: skip
    writer.flush()


def _figures(state: JobState) -> dict:
    def approx(d: dict) -> dict:
        return {k: pytest.approx(v, rel=1e-12) if isinstance(v, float) else v for k, v in d.items()}

    return {
        "totals": {r: approx(dataclasses.asdict(v)) for r, v in state.totals.items()},
        "now": {r: dataclasses.asdict(v) for r, v in state.now.items()},
        "sample_t": state.sample_t,
        "steps": {r: approx(dataclasses.asdict(v)) for r, v in state.steps.items()},
        "events": state.events,
        "host": state.host,
        "gpus": state.gpus,
        "gpu_memory": state.gpu_memory,
    }


# With gaps: counters unread now and then (credited counter by counter); without: every
# counter read in every row (credited in one pass).
# Steps of two ranks are summed per rank; of one job not distributed, in one pass.
@pytest.mark.parametrize("gaps", [True, False], ids=["unread-counters", "all-read"])
@pytest.mark.parametrize("ranks", [(0, 1), (None,)], ids=["two-ranks", "no-rank"])
@pytest.mark.parametrize("saved", [True, False], ids=["saved-totals", "summed-in-sql"])
def test_the_first_scrape_of_a_long_history_equals_reading_it_row_by_row(
    tmp_path: Path, gaps: bool, ranks: tuple, saved: bool
) -> None:
    path = tmp_path / "job.sqlite"
    writer = RecordingWriter(path, {"started_at": T})
    rng = random.Random(7)
    one_by_one = JobState(RecordingTail(path), saved_totals=False)
    for i in range(120):
        _record(writer, i, rng, gaps, ranks)
        one_by_one.update()  # the history arrives a sample at a time
    if not saved:  # as a recording written before the writer kept totals
        db = sqlite3.connect(path)
        db.execute("DELETE FROM meta WHERE key = 'totals'")
        db.commit()
        db.close()
    first_scrape = JobState(RecordingTail(path))
    assert ("totals" in first_scrape.meta) is saved
    first_scrape.update()  # all of it at once: from the saved totals, or summed in SQL
    assert (first_scrape.sums.through["steps"] > 0) is saved  # which way it started
    assert first_scrape.tail.position("process_samples") > 0
    assert _figures(first_scrape) == _figures(one_by_one)
    # The per-process state it goes on from is the same: the next rows credit the same
    # (from the totals the writer goes on saving, or else row by row).
    for i in range(120, 160):
        _record(writer, i, rng, gaps, ranks)
        first_scrape.update()
        one_by_one.update()
        # The writer saves its totals at every commit (again, where they were deleted):
        # the later updates take them and read no step row.
        assert first_scrape.sums.through["steps"] == first_scrape.tail.position("steps")
        assert _figures(first_scrape) == _figures(one_by_one)
    assert first_scrape.totals["dataloader-worker"].io_known
    assert first_scrape.totals["trainer"].io_known is not gaps
    assert set(first_scrape.steps) == {"" if r is None else str(r) for r in ranks}
    writer.close()


def test_an_empty_recording_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "empty.sqlite"
    writer = RecordingWriter(path, {"started_at": T})
    writer.flush()
    state = JobState(RecordingTail(path))
    state.update()
    assert state.totals == {} and state.steps == {} and state.events == {} and state.host is None
    _record(writer, 0, random.Random(1))
    state.update()
    assert state.totals["trainer"].cpu_system_s == 0.0 and state.steps["0"].steps == 1
    writer.close()
