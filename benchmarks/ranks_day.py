"""64 ranks x 24 h diagnosed as one job, built from a real rank recording (issue 46).

1. A real 2-rank gloo job (tests/launch/jobs/ddp_job.py, CPU) runs under `torchdoctor launch
   --nproc-per-node 2`, rank 1 slowed by 60 ms of data loading per batch (a straggler).
2. Its ranks are the templates: each replayed rank steps as one of them (its steady steps'
   rows over and over at the recorded pace, every rank of a node in lock-step), with that
   rank's events, settings and DataLoader rows (renumbered: rank, node, world size 64).
3. A node is 8 such ranks with 2 forked DataLoader workers each (job_trees.node_job: real
   snapshots of a real tree), replayed through the recording writer at the default 0.5 s
   with compaction on (samples and steps folded as a launch folds them) for --hours, then
   made 24 h long as node_week.py makes its week (node_week.extend_compacted). One node
   holds the straggler (global rank 37); the others are copies of one node renumbered.
4. `torchdoctor diagnose` of the 8 node recordings as one job against `diagnose` of one
   rank x 24 h built the same way, each a child process: peak RSS (getrusage) and wall
   time; the straggler must be named.

Targets: the 64-rank day <= 512 MiB peak RSS, and its time <= 64 x the single rank's + a
constant (the time `diagnose` takes on the real 10-second recording: start-up, imports).

    python benchmarks/ranks_day.py [--hours 0.75] [--nodes 8] [--day-hours 24]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from job_trees import RECORDING_INTERVAL_S, node_job, running, snapshots, stamped
from node_week import extend_compacted
from scorecard import Scorecard
from soak import load, peak_rss_of
from torchdoctor.recording import RecordingWriter, open_recording
from torchdoctor.recording.compaction import CompactionPolicy
from torchdoctor.recording.records import DataLoaderRecord, JobEvent, SettingRecord, StepRecord
from torchdoctor.recording.steps import measured_steps

MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "launch" / "jobs" / "ddp_job.py"
RANKS_PER_NODE = 8
WORKERS = 2
STRAGGLER = 37
SLOW_MS = 60
RSS_TARGET_MIB = 512
# Per-rank rows copied from the template as they are, renumbered (the steps are replayed)
PER_RANK = {"events": JobEvent, "settings": SettingRecord, "dataloaders": DataLoaderRecord}
RANK_SETTINGS = ("distributed.rank", "distributed.local_rank", "distributed.world_size")


@dataclasses.dataclass
class Template:
    """One real rank: its steady steps and its other rows, times relative to its start."""

    steps: list[dict[str, Any]]
    rows: dict[str, list[dict[str, Any]]]


def record_real(folder: Path) -> Path:
    """The real 2-rank job's recording (a second try where a rendezvous port was taken)."""
    for attempt in range(2):
        out = folder / f"real{attempt}"
        res = subprocess.run(
            [sys.executable, "-m", "torchdoctor", "launch", "--nproc-per-node", "2",
             "--out-dir", str(out), "--", str(JOB), "--slow-rank", "1", "--slow-ms",
             str(SLOW_MS), "--samples", "8192", "--batch", "64"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600,
        )  # fmt: skip
        if res.returncode == 0:
            return next(out.glob("*.sqlite"))
        print(f"launch failed ({res.returncode}): {res.stderr.strip()[-400:]}", flush=True)
    raise SystemExit(1)


def templates(path: Path) -> tuple[dict[str, Any], dict[int, Template]]:
    with open_recording(path) as rec:
        meta = dict(rec.meta)
        start = float(meta["started_at"])
        steps = rec.steps()
        out = {}
        for rank in sorted({s["rank"] for s in steps}):
            mine = sorted((s for s in steps if s["rank"] == rank), key=lambda s: s["step"])
            pid = mine[0]["pid"]
            rows = {
                table: [
                    {**r, "t": r["t"] - start}
                    for r in rec.query(f"SELECT * FROM {table} WHERE pid = ?", (pid,))
                ]
                for table in PER_RANK
            }
            out[rank] = Template([dict(s) for s in measured_steps(mine)], rows)
    return meta, out


def node_meta(real: dict[str, Any], node: int, nodes: int, t0: float) -> dict[str, Any]:
    meta = {
        k: copy.deepcopy(v)
        for k, v in real.items()
        if k not in ("compaction", "compacted_through", "totals", "ended_at", "closed_at",
                     "exit_status", "exit_signal", "memory_end", "writer")
    }  # fmt: skip
    meta["started_at"] = t0
    meta["host"]["hostname"] = f"node{node:02d}"
    meta["launch"] = {**meta.get("launch", {}), "node_rank": node, "nnodes": nodes}
    return meta


def renumbered(row: dict[str, Any], rank: int, local: int, world: int, node: int) -> dict:
    """A template rank's event or setting as rank ``rank`` of a ``world``-rank job has it."""
    if row.get("kind") == "rank-info":
        detail = json.loads(row["detail"])
        detail.update(
            rank=rank, local_rank=local, world_size=world, node_rank=node,
            local_world_size=RANKS_PER_NODE, hostname=f"node{node:02d}",
        )  # fmt: skip
        row = {**row, "detail": json.dumps(detail)}
    if row.get("key") in RANK_SETTINGS:
        value = {"distributed.rank": rank, "distributed.local_rank": local}.get(row["key"], world)
        row = {**row, "value": json.dumps(value)}
    return row


def build_node(
    path: Path,
    hours: float,
    tree: tuple[list, list],
    ranks: list[tuple[int, Template]],
    meta: dict[str, Any],
    node: int,
    world: int,
) -> int:
    """Replay ``hours`` of a node whose rank processes step as ``ranks`` (global rank,
    template); returns the steps written per rank."""
    snaps, infos = tree
    root = min(infos, key=lambda p: p.create_time).pid
    pids = sorted(p.pid for p in infos if p.ppid == root)
    assert len(pids) == len(ranks), (len(pids), len(ranks))
    t0 = time.time() - hours * 3600
    writer = RecordingWriter(
        path,
        node_meta(meta, node, world // RANKS_PER_NODE or 1, t0),
        flush_every_s=3600.0,  # flushed below: once per 2 samples (1 s of run time)
        compaction=CompactionPolicy(),
    )
    for local, (pid, (rank, tpl)) in enumerate(zip(pids, ranks, strict=True)):
        for table, record in PER_RANK.items():
            rows = [renumbered(r, rank, local, world, node) for r in tpl.rows[table]]
            add = getattr(writer, f"add_{table}")
            add(record(**{**r, "pid": pid, "rank": rank, "t": t0 + r["t"]}) for r in rows)
    names = [f.name for f in dataclasses.fields(StepRecord)]
    pace = ranks[0][1].steps  # every rank of the node steps together, at this pace
    n = int(hours * 3600 / RECORDING_INTERVAL_S)
    cursor, step = t0 + 1.0, 0
    for i in range(n):
        t = t0 + (i + 1) * RECORDING_INTERVAL_S
        snap = stamped(snaps[i % len(snaps)], t)
        snap.new_processes = [] if i else infos
        batch = []
        while cursor + pace[step % len(pace)]["wall_s"] <= t:
            end = cursor + pace[step % len(pace)]["wall_s"]
            for pid, (rank, tpl) in zip(pids, ranks, strict=True):
                row = tpl.steps[step % len(tpl.steps)]
                fields = {k: row[k] for k in names}
                fields.update(pid=pid, rank=rank, step=step, t_start=cursor, t_end=end)
                batch.append(StepRecord(**fields))
            cursor, step = end, step + 1
        writer.add_steps(batch)
        writer.write_snapshot(snap)
        if i % 2 == 1:
            writer.flush()
    writer.close({"ended_at": t0 + (n + 1) * RECORDING_INTERVAL_S, "exit_status": 0})
    return step


def renumber_copy(src: Path, out: Path, node: int, nodes: int) -> None:
    """Node 0's day as node ``node`` has it: its ranks moved up by 8 a node."""
    shutil.copyfile(src, out)
    db = sqlite3.connect(out, isolation_level=None)
    try:
        shift = node * RANKS_PER_NODE
        host = f"node{node:02d}"
        db.execute("BEGIN")
        for table in ("steps", *PER_RANK):
            db.execute(f"UPDATE {table} SET rank = rank + ? WHERE rank IS NOT NULL", (shift,))
        db.execute(
            "UPDATE events SET detail = json_set(detail, '$.rank', json_extract(detail,"
            " '$.rank') + ?, '$.node_rank', ?, '$.hostname', ?) WHERE kind = 'rank-info'",
            (shift, node, host),
        )
        db.execute(
            "UPDATE settings SET value = CAST(CAST(value AS INTEGER) + ? AS TEXT)"
            " WHERE key = 'distributed.rank'",
            (shift,),
        )
        meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}
        meta["host"]["hostname"] = host
        meta["launch"] = {**meta.get("launch", {}), "node_rank": node, "nnodes": nodes}
        for key in ("host", "launch"):
            db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                (key, json.dumps(meta[key])),
            )
        db.execute("COMMIT")
    finally:
        db.close()


def diagnosed(paths: list[Path], folder: Path, runs: int) -> tuple[int, float, list[dict]]:
    """Peak RSS (highest), wall time (fastest) of `torchdoctor diagnose --json PATHS`, and
    its findings."""
    got = []
    out = folder / "diagnose.json"
    for _ in range(runs):
        with open(out, "w") as fh:
            got.append(peak_rss_of("diagnose", "--json", *map(str, paths), stdout=fh))
    findings = json.loads(out.read_text())["findings"]
    return max(p for p, _ in got), min(s for _, s in got), findings


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=0.75, help="replayed per node (>= 0.6)")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--day-hours", type=float, default=24.0)
    ap.add_argument("--runs", type=int, default=1, help="diagnose runs of each")
    args = ap.parse_args()
    world = args.nodes * RANKS_PER_NODE
    straggler = min(STRAGGLER, world - 1)
    card = Scorecard("ranks_day")
    print(f"load before: {load()}")
    with tempfile.TemporaryDirectory(prefix="td-ranks-") as tmp:
        folder = Path(tmp)
        started = time.monotonic()
        real = record_real(folder)
        meta, tpl = templates(real)
        normal, slow = tpl[0], tpl[1]
        print(
            f"real 2-rank gloo job recorded in {time.monotonic() - started:.0f} s: steady steps"
            f" {len(normal.steps)} + {len(slow.steps)}, a step"
            f" {1e3 * normal.steps[0]['wall_s']:.0f} ms",
            flush=True,
        )
        with running(node_job(RANKS_PER_NODE, WORKERS)) as node:
            node_tree = snapshots(node.pid, 20, 0.1)
        with running(node_job(1, WORKERS)) as one:
            one_tree = snapshots(one.pid, 20, 0.1)
        days = args.day_hours / 24
        built: dict[str, Path] = {}
        slow_node = straggler // RANKS_PER_NODE
        plans = {
            "one": (one_tree, [(0, normal)], 0, 1),
            "node": (node_tree, [(r, normal) for r in range(RANKS_PER_NODE)], 0, world),
            "slow": (
                node_tree,
                [
                    (r, slow if r == straggler else normal)
                    for r in range(slow_node * RANKS_PER_NODE, (slow_node + 1) * RANKS_PER_NODE)
                ],
                slow_node,
                world,
            ),
        }
        for name, (tree, ranks, node_rank, size) in plans.items():
            started = time.monotonic()
            short = folder / f"{name}-short.sqlite"
            steps = build_node(short, args.hours, tree, ranks, meta, node_rank, size)
            built[name] = folder / f"{name}.sqlite"
            extend_compacted(short, built[name], days)
            short.unlink()
            with open_recording(built[name]) as rec:
                counted = rec.step_stats().step_count
                span = (rec.ended_at - rec.started_at) / 3600
            if counted < 0.9 * len(ranks) * steps * span / args.hours:
                raise SystemExit(f"{name}: the steps were not made {span:.1f} h long")
            print(
                f"{name}: {len(ranks)} rank(s), {args.hours:g} h replayed ({steps:,} steps a rank)"
                f" and made {span:.1f} h: {counted:,} steps, {built[name].stat().st_size / MIB:.1f}"
                f" MiB, in {time.monotonic() - started:.0f} s",
                flush=True,
            )
        nodes = []
        for k in range(args.nodes):
            if k == slow_node:
                nodes.append(built["slow"])
            elif k == 0:
                nodes.append(built["node"])
            else:
                nodes.append(folder / f"node{k:02d}.sqlite")
                renumber_copy(built["node"], nodes[-1], k, args.nodes)
        size = sum(p.stat().st_size for p in nodes)
        print(
            f"{world} ranks x {args.day_hours:g} h: {len(nodes)} recordings, {size / MIB:.0f} MiB"
        )
        base_peak, base_s, _ = diagnosed([real], folder, args.runs)
        one_peak, one_s, _ = diagnosed([built["one"]], folder, args.runs)
        print(
            f"`torchdoctor diagnose`: 1 rank {one_s:.1f} s, {one_peak / MIB:.0f} MiB;"
            f" the real 2-rank job {base_s:.1f} s, {base_peak / MIB:.0f} MiB",
            flush=True,
        )
        job_peak, job_s, findings = diagnosed(nodes, folder, args.runs)
        print(f"`torchdoctor diagnose`: {world} ranks {job_s:.1f} s, {job_peak / MIB:.0f} MiB")
        named = [f for f in findings if f["id"] == "rank-straggler"]
        ranks_named = [f["settings"].get("rank") for f in named]
        card.check(
            f"`torchdoctor diagnose` of {world} ranks x {args.day_hours:g} h as one job, peak RSS",
            job_peak / MIB,
            f"{job_peak / MIB:.0f} MiB ({len(nodes)} node recordings, {size / MIB:.0f} MiB;"
            f" 1 rank x {args.day_hours:g} h: {one_peak / MIB:.0f} MiB)",
            at_most=RSS_TARGET_MIB,
            target=f"<= {RSS_TARGET_MIB} MiB",
        )
        bound = world * one_s + base_s
        card.check(
            f"`torchdoctor diagnose` of {world} ranks x {args.day_hours:g} h, wall time",
            job_s,
            f"{job_s:.1f} s = {job_s / one_s:.1f}x the 1 rank's {one_s:.1f} s (load {load()})",
            at_most=bound,
            target=f"<= {world} x 1 rank + {base_s:.1f} s (the real job's diagnose) = {bound:.0f} s",
        )
        card.verdict(
            f"the straggler of {world} ranks x {args.day_hours:g} h named",
            f"rank-straggler names rank(s) {ranks_named or 'none'} (slowed: {straggler})",
            ranks_named == [straggler],
            f"rank {straggler}, alone",
        )
    print(f"load after: {load()}")
    return card.exit_code()


if __name__ == "__main__":
    sys.exit(main())
