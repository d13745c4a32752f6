"""The ranks of a distributed job, gathered from one recording per node (or from one
recording of ``torchrun`` run by hand): each rank's steps, node, device, events and DDP figures.

Ranks are found from what each rank process reported about itself (the ``rank-info`` event of
instrument/agent/ranks.py: RANK, GROUP_RANK, host), else from the steps' rank column. Rules
that compare ranks (rank-straggler, communication-bound...) read a :class:`RankJob`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdoctor.recording.steps import ProcessSteps, measured_steps

DDP_WARMUP_ITERATIONS = 2  # DDP's first iterations rebuild buckets: their comm is not typical
# The rank rules that compare ranks step by step (rank-straggler's persistence, the
# all-reduce read from the last rank to reach it) read at most about this many steps of each
# rank, the same step numbers on every rank (a hash of the number picks them); every step up
# to that. Their medians and counts are over every step. A day of 64 ranks at 64 ms would
# otherwise be held whole, 10 million rows.
MAX_COMPARED_STEPS = 2048
# Medians the rank rules read over a rank's steady steps; outside_s is derived (own_parts).
MEDIAN_COLUMNS = ("wall_s", "data_wait_s", "forward_s", "optimizer_s", "backward_s")
_HASH = 0x9E3779B1  # Knuth's multiplicative hash: spreads every arithmetic run of numbers


def compared(step: int, share: float) -> bool:
    """Whether step number ``step`` is one the step-by-step comparisons read, when they
    read ``share`` of the steps (1.0: every one)."""
    return share >= 1.0 or ((step * _HASH) & 0xFFFFFFFF) < share * 2**32


def _outside(wall: float, wait: float, fwd: float, bwd: float, opt: float) -> float:
    """A step's time outside its data wait, forward, backward and optimizer step."""
    return wall - wait - fwd - bwd - opt


@dataclass(slots=True)
class RankSteps:
    """What the rank rules read of one rank's steps, from one pass over its rows."""

    count: int  # steps taken (rows and folded ones)
    steady_count: int
    medians: dict[str, float]  # MEDIAN_COLUMNS and outside_s, over the steady steps
    ddp_medians: dict[str, float]  # backward_compute_s over DDP's sampled steps
    span: tuple[float, float] | None  # first steady step's start, last one's end
    sample: ProcessSteps  # the rows at the compared step numbers
    steady: list[int]  # of which steady (indices into sample)
    ddp: list[int]  # of which DDP-sampled past its warm-up iterations

    @classmethod
    def of(cls, proc: ProcessSteps, share: float = 1.0) -> RankSteps:
        """Summarise ``proc``; ``share``: of its steps those compared step by step."""
        col = proc.columns
        steady = proc.measured()
        medians: dict[str, float] = {}
        for name in MEDIAN_COLUMNS:
            values = proc.values(name, steady)
            if values:
                medians[name] = statistics.median(values)
        wall, wait, fwd, bwd, opt = (col[c] for c in _OUTSIDE_PARTS)
        outside = []
        for i in steady:
            if bwd[i] == bwd[i]:  # NaN: not timed (_outside, in its order: the same sum)
                rest = wall[i]
                for part in (wait[i], fwd[i], bwd[i], opt[i]):
                    if part == part:
                        rest -= part
                outside.append(rest)
        if outside:
            medians["outside_s"] = statistics.median(outside)
        comm = col["comm_s"]
        sampled = [i for i in range(len(proc)) if comm[i] == comm[i]]
        ddp = sampled[DDP_WARMUP_ITERATIONS:] if len(sampled) > DDP_WARMUP_ITERATIONS else []
        ddp_medians = {}
        values = proc.values("backward_compute_s", ddp)
        if values:
            ddp_medians["backward_compute_s"] = statistics.median(values)
        span = None
        if steady:
            span = (col["t_start"][steady[0]], col["t_end"][steady[-1]])
        steps = col["step"]
        keep: Sequence[int] = range(len(proc))
        if share < 1.0:
            keep = [i for i in keep if compared(int(steps[i]), share)]
        local = {i: j for j, i in enumerate(keep)}
        return cls(
            count=proc.count,
            steady_count=len(steady),
            medians=medians,
            ddp_medians=ddp_medians,
            span=span,
            sample=proc.take(keep),
            steady=[local[i] for i in steady if i in local],
            ddp=[local[i] for i in ddp if i in local],
        )


_OUTSIDE_PARTS = ("wall_s", "data_wait_s", "forward_s", "backward_s", "optimizer_s")


class RankSeries:
    """One rank: where it ran and what it recorded.

    Read from a recording, its steps are summarised as they are read (:class:`RankSteps`):
    counts and medians over every step, and the rows of the compared step numbers
    (``steps``, ``steady``, ``ddp_steps``: every row unless the recording is long). Made by
    hand (tests), from ``steps`` as rows."""

    def __init__(
        self,
        rank: int,
        pid: int,
        node_rank: int | None,
        hostname: str | None,
        recording: str,
        # The node's DiagnosisContext. Not imported: the context builds its job's ranks from
        # this module, so this module names no type of the context's (no import circle).
        ctx: Any,
        info: dict[str, Any] | None = None,
        steps: list[dict[str, Any]] | None = None,
        events: list[dict[str, Any]] | None = None,
        folded_steps: int = 0,  # steps whose rows the writer folded away
        summary: RankSteps | None = None,
    ) -> None:
        self.rank = rank
        self.pid = pid
        self.node_rank = node_rank
        self.hostname = hostname
        self.recording = recording
        self.ctx = ctx
        self.info = info or {}
        self.events = events or []
        self._rows = sorted(steps or [], key=lambda s: s["step"])
        self._folded = folded_steps
        self.summary = summary

    @property
    def steps(self) -> list[dict[str, Any]]:
        """Its step rows (those of the compared step numbers where summarised)."""
        if self.summary is None:
            return self._rows
        sample = self.summary.sample
        return [sample.row(i) for i in range(len(sample))]

    @property
    def step_count(self) -> int:
        """Steps the rank took (its rows and the folded ones)."""
        if self.summary is not None:
            return self.summary.count
        return len(self._rows) + self._folded

    @property
    def steady_count(self) -> int:
        """Its steady steps (past the warm-up, not profiled), every one counted."""
        if self.summary is not None:
            return self.summary.steady_count
        return len(self.steady)

    @property
    def steady_span(self) -> tuple[float, float] | None:
        """(start of its first steady step, end of its last one)."""
        if self.summary is not None:
            return self.summary.span
        steady = self.steady
        return (steady[0]["t_start"], steady[-1]["t_end"]) if steady else None

    @property
    def node(self) -> str:
        """How findings name the node: "node 1 (host-b)"."""
        n = f"node {self.node_rank}" if self.node_rank is not None else "node ?"
        return f"{n} ({self.hostname})" if self.hostname else n

    @property
    def label(self) -> str:
        return f"rank {self.rank} on {self.node}"

    @property
    def steady(self) -> list[dict[str, Any]]:
        """Its steady steps' rows (those of the compared step numbers where summarised)."""
        if self.summary is not None:
            return [self.summary.sample.row(i) for i in self.summary.steady]
        return measured_steps(self._rows, self.step_count)

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    def first_event(self, kind: str) -> dict[str, Any] | None:
        found = self.events_of(kind)
        return found[-1]["detail"] if found else None

    @property
    def device(self) -> dict[str, Any] | None:
        return self.first_event("rank-device")

    @property
    def ddp_config(self) -> dict[str, Any] | None:
        return self.first_event("ddp-config")

    def median(self, column: str, steps: list[dict[str, Any]] | None = None) -> float | None:
        """The median of ``column`` over its steady steps (every one), or over ``steps``;
        ``outside_s`` is a step's time outside its own parts, over the steps that timed
        their backward pass."""
        if steps is None and self.summary is not None:
            return self.summary.medians.get(column)
        rows = self.steady if steps is None else steps
        if column == "outside_s":
            values = [
                _outside(*(s.get(c) or 0.0 for c in _OUTSIDE_PARTS))
                for s in rows
                if s.get("backward_s") is not None
            ]
        else:
            values = [v for s in rows if (v := s.get(column)) is not None]
        return statistics.median(values) if values else None

    def ddp_median(self, column: str) -> float | None:
        """The median of ``column`` over DDP's sampled steps (every one)."""
        if self.summary is not None:
            return self.summary.ddp_medians.get(column)
        values = [v for s in self.ddp_steps() if (v := s.get(column)) is not None]
        return statistics.median(values) if values else None

    def ddp_steps(self) -> list[dict[str, Any]]:
        """Steps that carry DDP's sampled figures, past DDP's bucket-rebuild iterations
        (those of the compared step numbers where summarised)."""
        if self.summary is not None:
            return [self.summary.sample.row(i) for i in self.summary.ddp]
        sampled = [s for s in self._rows if s.get("comm_s") is not None]
        return sampled[DDP_WARMUP_ITERATIONS:] if len(sampled) > DDP_WARMUP_ITERATIONS else []


@dataclass
class RankJob:
    """Every rank of one job, across the recordings of its nodes."""

    ranks: dict[int, RankSeries]
    contexts: list[Any]  # every node's DiagnosisContext

    @classmethod
    def from_contexts(cls, contexts: list[Any]) -> RankJob:
        ranks: dict[int, RankSeries] = {}
        for ctx in contexts:
            for series in _ranks_of(ctx):
                old = ranks.get(series.rank)
                # A restarted rank (torchrun --max-restarts): the latest attempt stands.
                if old is None or _restarts(series) >= _restarts(old):
                    ranks[series.rank] = series
        return cls(dict(sorted(ranks.items())), contexts)

    @property
    def distributed(self) -> bool:
        return len(self.ranks) >= 2

    @property
    def world_size(self) -> int | None:
        sizes = [r.info.get("world_size") for r in self.ranks.values() if r.info]
        sizes = [s for s in sizes if s]
        return max(sizes) if sizes else (len(self.ranks) or None)

    def stepping(self, minimum: int = 3) -> list[RankSeries]:
        return [r for r in self.ranks.values() if r.steady_count >= minimum]

    def by_node(self) -> dict[tuple[str, int | None], list[RankSeries]]:
        out: dict[tuple[str, int | None], list[RankSeries]] = defaultdict(list)
        for r in self.ranks.values():
            out[(r.recording, r.node_rank)].append(r)
        return dict(out)

    @property
    def fr_dirs(self) -> list[Path]:
        found: list[Path] = []
        for ctx in self.contexts:
            folder = (ctx.meta.get("launch") or {}).get("flight_recorder_dir")
            if folder:
                found.append(Path(folder))
        for r in self.ranks.values():
            folder = r.info.get("fr_dir")
            if folder and Path(folder) not in found:
                found.append(Path(folder))
        return found


def _restarts(series: RankSeries) -> int:
    return int(series.info.get("restart_count") or 0)


def compared_share(contexts: list[Any]) -> float:
    """The share of step numbers compared step by step: every one unless a process of the
    job recorded more than MAX_COMPARED_STEPS rows."""
    most = max((max(ctx.step_rows.values(), default=0) for ctx in contexts), default=0)
    return min(1.0, MAX_COMPARED_STEPS / most) if most else 1.0


def _ranks_of(ctx: Any) -> list[RankSeries]:
    """The ranks of one node's recording, from the figures its context read of each
    process's steps (one process's rows in memory at a time)."""
    infos: dict[int, dict[str, Any]] = {}
    for e in ctx.events_of("rank-info"):
        if isinstance(e["detail"], dict):
            infos[e["pid"]] = e["detail"]
    events_by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in ctx.events:
        events_by_pid[e["pid"]].append(e)
    summaries = ctx.rank_steps()
    stepped = list(summaries)
    host = (ctx.meta.get("host") or {}).get("hostname")
    launch = ctx.meta.get("launch") or {}
    out = []
    for pid in sorted(set(infos) | set(stepped)):
        info = infos.get(pid, {})
        first, summary = summaries.get(pid, (None, None))
        rank = info.get("rank")
        if rank is None:
            rank = first
        if rank is None:
            continue
        node_rank = info.get("node_rank", launch.get("node_rank"))
        if summary is None:  # reported its rank, took no step
            summary = RankSteps.of(ProcessSteps.from_rows(pid, [], ctx.folded(pid)))
        out.append(
            RankSeries(
                rank=int(rank),
                pid=pid,
                node_rank=node_rank,
                hostname=info.get("hostname") or host,
                recording=str(ctx.recording.path),
                ctx=ctx,
                info=info,
                events=events_by_pid.get(pid, []),
                summary=summary,
            )
        )
    return out


def ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds to a hundredth, for evidence."""
    return None if seconds is None else round(seconds * 1000, 2)
