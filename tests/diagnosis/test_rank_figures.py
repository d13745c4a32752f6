"""The rank rules over long, folded recordings of several nodes (issue 46): each rank's steps
are read once, one process at a time, into counts and medians over every step and the rows of
a bounded set of step numbers (diagnosis.ranks.MAX_COMPARED_STEPS, the same numbers on every
rank); the findings are those of comparing every step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.diagnosis.builders import T0, Job, Proc, const
from tests.recording.test_compaction import DURATION, POLICY, write
from torchdoctor.diagnosis import ranks
from torchdoctor.diagnosis.engine import diagnose_job
from torchdoctor.diagnosis.findings import Finding
from torchdoctor.recording.reader import Recording, open_recording
from torchdoctor.recording.records import StepRecord

WALL = 0.1
STRAGGLER = 3  # its data wait is a third of every step; the others' a fiftieth


def node_steps(pids: list[int], first_rank: int, n: int) -> list[StepRecord]:
    """``n`` lock-step steps of a node's ranks: walls spread +-10 %, forward, backward and
    optimizer timed on every step, DDP's figures on its sampled iterations (1-10, then every
    100th), all-reduce exposed for 15-20 % of the step."""
    rng = random.Random(first_rank)
    out, t = [], T0 + 2.0
    for i in range(n):
        w = WALL * (0.9 + 0.2 * rng.random())
        for k, pid in enumerate(pids):
            rank = first_rank + k
            wait = w / 3 if rank == STRAGGLER else w / 50
            ddp = {}
            if i <= 10 or i % 100 == 0:
                exposed = 0.015 + 0.005 * rng.random()  # 15-20 % of the step
                ddp = {"comm_s": 0.008 + exposed, "comm_overlap_s": 0.008,
                       "backward_compute_s": 0.02 + 0.002 * rng.random()}  # fmt: skip
            # the others wait for the straggler in backward's all-reduce: what is left of
            # the step after their own work (the loop's own code a twentieth of it)
            fwd, opt = 0.2 * w, 0.05 * w
            out.append(
                StepRecord(
                    pid, rank, i, t, t + w, w, wait, 32, 32, forward_s=fwd,
                    backward_s=w - wait - fwd - opt - w / 20, optimizer_s=opt, **ddp,
                )
            )  # fmt: skip
        t += w
    return out


def nodes(tmp_path: Path) -> list[Path]:
    """Two nodes of two ranks each, folded as a writer folds a long run."""
    n = int((DURATION - 4) / (WALL * 1.1))
    paths = []
    for node, pids in enumerate(([1000, 1001], [2000, 2001])):
        job = Job(
            procs=[Proc(p, cpu=const(100.0)) for p in pids],
            steps=node_steps(pids, 2 * node, n),
            duration=DURATION,
        )
        paths.append(write(job, tmp_path / f"node{node}.sqlite", POLICY))
    return paths


def job_findings(paths: list[Path]) -> list[Finding]:
    recordings = [open_recording(p) for p in paths]
    try:
        return diagnose_job(recordings)
    finally:
        for rec in recordings:
            rec.close()


def test_rank_rules_compare_a_bounded_sample_of_steps_and_find_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = nodes(tmp_path)
    with open_recording(paths[0]) as rec:
        kept = rec.count("steps")
        assert sum(f.count for f in rec.folded_steps.values()) > kept  # folded, mostly
    every = job_findings(paths)
    straggler = [f for f in every if f.id == "rank-straggler"]
    assert [f.settings["rank"] for f in straggler] == [STRAGGLER]
    assert "communication-bound" in [f.id for f in every]

    # Compared on a few dozen step numbers: the step rows are never held as one object per
    # row (a frame's row views or dicts), and the findings are the same.
    monkeypatch.setattr(ranks, "MAX_COMPARED_STEPS", 64)
    read = Recording.frame

    def frame(self: Recording, table: str, *args, **kwargs):
        assert table != "steps", "the step rows were read as a frame"
        return read(self, table, *args, **kwargs)

    monkeypatch.setattr(Recording, "frame", frame)
    sampled = job_findings(paths)
    assert [(f.id, f.severity, f.settings) for f in sampled] == [
        (f.id, f.severity, f.settings) for f in every
    ]
    for a, b in zip(every, sampled, strict=True):
        assert [e.label for e in a.evidence] == [e.label for e in b.evidence], a.id
        for x, y in zip(a.evidence, b.evidence, strict=True):
            if a.id == "communication-bound" and x.label == "figures from":
                continue  # the sampled iterations it read: fewer
            if isinstance(x.value, int | float) and not isinstance(x.value, bool):
                # medians over every step; DDP's all-reduce from its sampled iterations
                assert y.value == pytest.approx(x.value, rel=0.1), (a.id, x.label)
            else:
                assert y.value == x.value, (a.id, x.label)


def test_each_rank_counts_every_step_and_holds_only_its_kept_rows(tmp_path: Path) -> None:
    paths = nodes(tmp_path)
    with open_recording(paths[0]) as rec:
        ctx_ranks = ranks.RankJob.from_contexts([_context(rec)])
        assert sorted(ctx_ranks.ranks) == [0, 1]
        r = ctx_ranks.ranks[0]
        assert r.step_count == r.summary.count > len(r.steps)
        assert r.steady_count > 0 and r.steady_span is not None


def _context(rec: Recording):
    from torchdoctor.diagnosis.context import DiagnosisContext
    from torchdoctor.thresholds import Thresholds

    return DiagnosisContext(rec, Thresholds())
