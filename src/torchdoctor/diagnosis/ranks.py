"""The ranks of a distributed job, gathered from one recording per node (or from one
recording of ``torchrun`` run by hand): each rank's steps, node, device, events and DDP figures.

Ranks are found from what each rank process reported about itself (the ``rank-info`` event of
instrument/agent/ranks.py: RANK, GROUP_RANK, host), else from the steps' rank column. Rules
that compare ranks (rank-straggler, communication-bound...) read a :class:`RankJob`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchdoctor.recording.steps import measured_steps

DDP_WARMUP_ITERATIONS = 2  # DDP's first iterations rebuild buckets: their comm is not typical


@dataclass
class RankSeries:
    """One rank: where it ran and what it recorded."""

    rank: int
    pid: int
    node_rank: int | None
    hostname: str | None
    recording: str
    # The node's DiagnosisContext. Not imported: the context builds its job's ranks from this
    # module, so this module names no type of the context's (no import circle).
    ctx: Any
    info: dict[str, Any] = field(default_factory=dict)
    # its step rows; where the writer folded steps (recording.compaction) a few a bucket
    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    folded_steps: int = 0  # steps whose rows the writer folded away

    @property
    def step_count(self) -> int:
        """Steps the rank took (its rows and the folded ones)."""
        return len(self.steps) + self.folded_steps

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
        return measured_steps(self.steps, self.step_count)

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
        values = [s[column] for s in (self.steady if steps is None else steps)]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def ddp_steps(self) -> list[dict[str, Any]]:
        """Steps that carry DDP's sampled figures, past DDP's bucket-rebuild iterations."""
        sampled = [s for s in self.steps if s.get("comm_s") is not None]
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
        return [r for r in self.ranks.values() if len(r.steady) >= minimum]

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


def _ranks_of(ctx: Any) -> list[RankSeries]:
    infos: dict[int, dict[str, Any]] = {}
    for e in ctx.events_of("rank-info"):
        if isinstance(e["detail"], dict):
            infos[e["pid"]] = e["detail"]
    steps_by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in ctx.steps:
        steps_by_pid[s["pid"]].append(s)
    events_by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in ctx.events:
        events_by_pid[e["pid"]].append(e)
    host = (ctx.meta.get("host") or {}).get("hostname")
    launch = ctx.meta.get("launch") or {}
    out = []
    for pid in sorted(set(infos) | set(steps_by_pid)):
        info = infos.get(pid, {})
        steps = sorted(steps_by_pid.get(pid, []), key=lambda s: s["step"])
        rank = info.get("rank")
        if rank is None:
            rank = next((s["rank"] for s in steps if s["rank"] is not None), None)
        if rank is None:
            continue
        node_rank = info.get("node_rank", launch.get("node_rank"))
        out.append(
            RankSeries(
                rank=int(rank),
                pid=pid,
                node_rank=node_rank,
                hostname=info.get("hostname") or host,
                recording=str(ctx.recording.path),
                ctx=ctx,
                info=info,
                steps=steps,
                events=events_by_pid.get(pid, []),
                folded_steps=ctx.folded(pid).count,
            )
        )
    return out


def ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds to a hundredth, for evidence."""
    return None if seconds is None else round(seconds * 1000, 2)
