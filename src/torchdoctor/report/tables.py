"""The tables of a report: process tree, settings, DataLoaders, precision, metadata, events."""

from __future__ import annotations

import json
import shlex
import signal
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torchdoctor.recording.reader import EVERY_INSTANT, Instants, Recording, damaged
from torchdoctor.recording.steps import FoldedSteps, decode_json
from torchdoctor.report.model import (
    EventRow,
    MetaSection,
    ProcessRow,
    SettingRow,
)
from torchdoctor.report.scales import (
    BYTES,
    BYTES_PER_S,
    PERCENT,
    SECONDS,
    fmt_utc,
    fmt_value,
)
from torchdoctor.sampling.roles import TRAINER, WORKER
from torchdoctor.thresholds import Thresholds
from torchdoctor.units import fmt_cpu_list, fmt_duration

# Siblings of one role beyond this many are folded into one row of the process tree.
FOLD_SIBLINGS_OVER = 6
SHOWN_WHEN_FOLDED = 3


def who(pid: int, rank: int | None) -> str:
    """How a process is named in the report: by rank when it has one."""
    return f"rank {rank}, pid {pid}" if rank is not None else f"pid {pid}"


@dataclass(slots=True)
class ProcessStats:
    """One process' samples summed up: the figures of its row in the process tree."""

    first_t: float | None
    last_t: float | None
    cpu_sum: float  # of the measured cpu_percent values, for their mean
    cpu_count: int
    peak_cpu: float | None
    peak_rss: int | None
    peak_pss: int | None
    peak_threads: int | None
    peak_swap: int | None


ProcessKey = tuple[int, float]  # (pid, create_time): a pid is reused, this pair is not


def process_stats(samples: Iterable[Mapping[str, Any]]) -> dict[ProcessKey, ProcessStats]:
    """The stats of each process from its sample rows (in time order)."""
    by_key: dict[ProcessKey, list[Mapping[str, Any]]] = defaultdict(list)
    for s in samples:
        by_key[(s["pid"], s["create_time"])].append(s)
    out = {}
    for key, mine in by_key.items():
        cpu = [s["cpu_percent"] for s in mine if s["cpu_percent"] is not None]
        out[key] = ProcessStats(
            first_t=mine[0]["t"],
            last_t=mine[-1]["t"],
            cpu_sum=sum(cpu),
            cpu_count=len(cpu),
            peak_cpu=max(cpu) if cpu else None,
            peak_rss=peak(s["rss"] for s in mine),
            peak_pss=peak(s["pss"] for s in mine),
            peak_threads=peak(s["threads"] for s in mine),
            peak_swap=peak(s["swap"] for s in mine),
        )
    return out


def read_process_stats(
    rec: Recording, instants: Instants = EVERY_INSTANT
) -> dict[ProcessKey, ProcessStats]:
    """The stats of each process summed up in SQL: one row per process, however many
    samples (a week of 20 processes is 24 million rows), over ``instants``."""
    cols = rec.stored_columns("process_samples")
    q = {c: (f'"{c}"' if c in cols else "NULL") for c in ("cpu_percent", "pss", "swap")}
    sql = (
        f"SELECT pid, create_time, MIN(t), MAX(t), TOTAL({q['cpu_percent']}),"
        f" COUNT({q['cpu_percent']}), MAX({q['cpu_percent']}), MAX(rss), MAX({q['pss']}),"
        f" MAX(threads), MAX({q['swap']}) FROM process_samples{instants.where()}"
        " GROUP BY pid, create_time"
    )
    stats = {}
    for row in rec.iter_query(sql, instants.params):
        # MAX() of a column holding text returns the text (SQLite orders text after numbers):
        # an edited sample reached the report's number formatting (ValueError) unchecked
        bad = next((v for v in row if v is not None and not isinstance(v, (int, float))), None)
        if bad is not None:
            raise damaged(rec.path, f"the process samples hold {str(bad)[:40]!r}, not a number")
        stats[(row[0], row[1])] = ProcessStats(*row[2:])
    return stats


def process_tree(
    infos: list[dict], samples: Iterable[Mapping[str, Any]], t0: float
) -> tuple[list[ProcessRow], int]:
    """The process tree of ``samples`` rows (see :func:`process_tree_of`)."""
    return process_tree_of(infos, process_stats(samples), t0)


def process_tree_of(
    infos: list[dict], stats: dict[ProcessKey, ProcessStats], t0: float
) -> tuple[list[ProcessRow], int]:
    """The job's processes as a tree (depth-first, oldest first), with their peaks.

    Large groups of siblings of one role (DataLoader workers re-created every epoch) are
    folded into one row carrying the peaks over the group, so the tree stays readable.
    """
    rows: dict[ProcessKey, ProcessRow] = {}
    for info in infos:
        key = (info["pid"], info["create_time"])
        mine = stats.get(key)
        rows[key] = ProcessRow(
            depth=0,
            pid=info["pid"],
            ppid=info["ppid"],
            role=info["role"],
            rank=info.get("rank"),
            name=info["name"],
            cmdline=list(info.get("cmdline") or []),
            first_seen=(mine.first_t - t0) if mine and mine.first_t is not None else None,
            last_seen=(mine.last_t - t0) if mine and mine.last_t is not None else None,
            mean_cpu=(mine.cpu_sum / mine.cpu_count) if mine and mine.cpu_count else None,
            peak_cpu=mine.peak_cpu if mine else None,
            peak_rss=mine.peak_rss if mine else None,
            peak_pss=mine.peak_pss if mine else None,
            peak_threads=mine.peak_threads if mine else None,
            peak_swap=mine.peak_swap if mine else None,
        )
    ordered = sorted(rows.items(), key=lambda kv: kv[0][1])
    children: dict[int, list[ProcessRow]] = defaultdict(list)
    roots: list[ProcessRow] = []
    alive_pids = {key[0] for key, _ in ordered}
    for _key, row in ordered:
        if row.ppid in alive_pids and row.ppid != row.pid:
            children[row.ppid].append(row)
        else:
            roots.append(row)
    out: list[ProcessRow] = []
    seen: set[int] = set()

    def visit(row: ProcessRow, depth: int) -> None:
        if id(row) in seen:  # a reused PID could make a cycle; draw each process once
            return
        seen.add(id(row))
        row.depth = depth
        out.append(row)
        kids = [k for k in children.get(row.pid, []) if id(k) not in seen]
        by_role: dict[str, list[ProcessRow]] = defaultdict(list)
        for k in kids:
            by_role[k.role].append(k)
        for group in by_role.values():
            if len(group) > FOLD_SIBLINGS_OVER:
                for k in group[:SHOWN_WHEN_FOLDED]:
                    visit(k, depth + 1)
                rest = group[SHOWN_WHEN_FOLDED:]
                for k in rest:
                    seen.add(id(k))
                out.append(_fold(rest, depth + 1))
            else:
                for k in group:
                    visit(k, depth + 1)

    for root in roots:
        visit(root, 0)
    return out, len(rows)


def _fold(group: list[ProcessRow], depth: int) -> ProcessRow:
    first = group[0]
    return ProcessRow(
        depth=depth,
        pid=first.pid,
        ppid=first.ppid,
        role=first.role,
        rank=None,
        name=first.name,
        cmdline=first.cmdline,
        first_seen=min((r.first_seen for r in group if r.first_seen is not None), default=None),
        last_seen=max((r.last_seen for r in group if r.last_seen is not None), default=None),
        mean_cpu=_mean(r.mean_cpu for r in group),
        peak_cpu=peak(r.peak_cpu for r in group),
        peak_rss=peak(r.peak_rss for r in group),
        peak_pss=peak(r.peak_pss for r in group),
        peak_threads=peak(r.peak_threads for r in group),
        peak_swap=peak(r.peak_swap for r in group),
        folded=len(group),
    )


def peak(values: Iterable[Any]) -> Any:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


# Setting keys are "<group>.<name>"; groups are shown in this order, under these titles.
_GROUP_TITLES = {
    "torch": "PyTorch threads and backends",
    "env": "Environment of the job",
    "process": "Processes",
    "distributed": "Distributed",
    "optimizer": "Optimizer",
    "params": "Model parameters",
    "amp": "Mixed precision",
    "cuda": "CUDA",
    "cudnn": "cuDNN",
    "dataloader": "DataLoader workers",
}


# A setting with more distinct values than this (worker ids...) is shown on one row.
MAX_VALUE_ROWS = 4


def settings_rows(settings: list[dict], roles: dict[int, str] | None = None) -> list[SettingRow]:
    """The last value of each setting per process; processes that agree share one row.

    ``roles`` (pid -> role) lets a row say "trainer (pid 12)" or "4 DataLoader workers"
    instead of a list of PIDs.
    """
    roles = roles or {}
    total_pids = {r["pid"] for r in settings}
    latest: dict[tuple[str, int], dict] = {}
    for r in settings:
        latest[(r["key"], r["pid"])] = r
    by_key: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for (key, _pid), r in latest.items():
        by_key[key][_setting_text(r["value"])].append(r)
    rows = []
    for key in sorted(by_key, key=lambda k: (_group_of(k)[0], k)):
        values = by_key[key]
        if len(values) > MAX_VALUE_ROWS:
            shown = sorted(values, key=_natural)
            text = ", ".join(shown[:MAX_VALUE_ROWS]) + f", … ({len(shown)} values)"
            holders = sum(len(h) for h in values.values())
            rows.append(
                SettingRow(_group_of(key)[1], key, text, f"one per process, {holders} processes")
            )
            continue
        for value, holders in sorted(values.items(), key=lambda kv: -len(kv[1])):
            if len(values) == 1 and len(holders) == len(total_pids) > 1:
                where = "all processes"
            else:
                where = _holders_text(holders, roles)
            rows.append(SettingRow(_group_of(key)[1], key, value, where))
    return rows


def _holders_text(holders: list[dict], roles: dict[int, str]) -> str:
    """ "trainer (pid 12)", "2 DataLoader workers", "rank 0, pid 7" ... for a set of processes."""
    by_role: dict[str, list[dict]] = defaultdict(list)
    for h in sorted(holders, key=lambda h: (h["rank"] is None, h["rank"], h["pid"])):
        by_role[roles.get(h["pid"], "")].append(h)
    parts = []
    for role, group in by_role.items():
        if role == WORKER:
            n = len(group)
            parts.append(f"{n} DataLoader worker{'s' if n != 1 else ''}")
        elif role == TRAINER and len(group) == 1:
            parts.append(f"trainer (pid {group[0]['pid']})")
        else:
            parts.extend(who(h["pid"], h["rank"]) for h in group)
    return ", ".join(parts)


def _setting_text(value: Any) -> str:
    decoded = decode_json(value)
    return "not set" if decoded is None else pretty_json(value)


def _natural(text: str) -> tuple[int, float | str]:
    try:
        return 0, float(text)
    except ValueError:
        return 1, text


def _group_of(key: str) -> tuple[int, str]:
    prefix = key.split(".", 1)[0]
    order = list(_GROUP_TITLES)
    if prefix in _GROUP_TITLES:
        return order.index(prefix), _GROUP_TITLES[prefix]
    return len(order), "Other settings"


def dataloader_rows(loaders: list[dict]) -> list[dict[str, str]]:
    out = []
    for d in loaders:
        dataset = _short_type(d["dataset_type"])
        if d.get("dataset_len") is not None:
            dataset += f" ({d['dataset_len']:,} items)"
        out.append(
            {
                "process": who(d["pid"], d["rank"]),
                "loader": str(d["loader_id"]),
                "batch_size": text_or_na(d["batch_size"]),
                "num_workers": str(d["num_workers"]),
                "prefetch_factor": text_or_na(d["prefetch_factor"]),
                "pin_memory": yes_no(d["pin_memory"]),
                "persistent_workers": yes_no(d["persistent_workers"]),
                "drop_last": yes_no(d["drop_last"]),
                "context": d["multiprocessing_context"] or "default",
                "dataset": dataset,
                "sampler": _short_type(d["sampler_type"]) if d["sampler_type"] else "n/a",
                "first_batch": fmt_value(d["first_batch_s"], SECONDS),
            }
        )
    return out


def _short_type(name: str) -> str:
    """``torch.utils.data.dataset.TensorDataset`` -> ``TensorDataset``: the name people know."""
    return name.rsplit(".", 1)[-1]


def precision_rows(steps: list[dict], folded: Iterable[FoldedSteps] = ()) -> list[tuple[str, str]]:
    """How the recorded steps ran: autocast dtype, gradient scaler, CUDA allocator figures;
    ``folded``: the steps the writer folded (their CUDA peaks count; the shares are those of
    the rows, an evenly spread sample of the steps)."""
    if not steps:
        return []
    n = len(steps)
    dtypes: dict[str, int] = defaultdict(int)
    for s in steps:
        dtypes[s["autocast_dtype"] or "off (float32)"] += 1
    rows = [
        (
            "autocast",
            ", ".join(
                f"{k} in {100 * v / n:.0f} % of steps"
                for k, v in sorted(dtypes.items(), key=lambda kv: -kv[1])
            ),
        ),
    ]
    scaler = [s["grad_scaler"] for s in steps if s["grad_scaler"] is not None]
    if scaler:
        rows.append(("gradient scaler", "used" if any(scaler) else "not used"))
    folded = list(folded)
    allocated = peak(
        [*(s["cuda_max_allocated"] for s in steps), *(f.cuda_max_allocated for f in folded)]
    )
    if allocated is not None:
        rows.append(("CUDA peak allocated in a step", fmt_value(allocated, BYTES)))
    reserved = peak([*(s["cuda_reserved"] for s in steps), *(f.cuda_reserved for f in folded)])
    if reserved is not None:
        rows.append(("CUDA reserved (peak)", fmt_value(reserved, BYTES)))
    retries = peak(s["cuda_alloc_retries"] for s in steps)
    if retries is not None:
        rows.append(("CUDA allocation retries", str(retries)))
    ooms = peak(s["cuda_ooms"] for s in steps)
    if ooms:
        rows.append(("CUDA out-of-memory errors", str(ooms)))
    return rows


def exit_text(status: Any) -> str:
    if status is None:
        return "exit status not recorded"
    if status == 0:
        return "exited with status 0 (success)"
    if isinstance(status, int) and status > 128:
        try:
            name = signal.Signals(status - 128).name
            return f"exited with status {status} (ended by {name})"
        except ValueError:
            pass
    return f"exited with status {status}"


def threshold_rows(th: Thresholds) -> list[tuple[str, str, str]]:
    return [
        (
            "GPU memory in use",
            f"> {fmt_value(th.gpu_memory_alert_pct, PERCENT)}",
            f"{fmt_value(th.gpu_memory_best_low_pct, '')}-{fmt_value(th.gpu_memory_best_high_pct, PERCENT)}",
        ),
        (
            "CPU load (mean)",
            f"> {fmt_value(th.cpu_load_alert_pct, PERCENT)} sustained",
            f"≤ {fmt_value(th.cpu_load_best_pct, PERCENT)}",
        ),
        (
            "Swap traffic",
            f"> {fmt_value(th.swap_alert_bytes_per_s, BYTES_PER_S)} sustained",
            f"≈ {fmt_value(th.swap_best_bytes_per_s, BYTES_PER_S)}",
        ),
        (
            "I/O wait",
            f"> {fmt_value(th.iowait_alert_pct, PERCENT)} of CPU time",
            f"≤ {fmt_value(th.iowait_best_pct, PERCENT)}",
        ),
    ]


def meta_sections(meta: dict, rec: Recording) -> list[MetaSection]:
    started, ended = meta.get("started_at"), rec.ended_at
    run = [
        ("command", shlex.join(str(a) for a in meta.get("command") or []) or "n/a"),
        ("working directory", text_or_na(meta.get("cwd"))),
        ("mode", text_or_na(meta.get("mode"))),
        ("started", fmt_utc(started)),
        (
            "ended",
            fmt_utc(ended)
            + ("" if rec.complete else f" (recording {rec.state.kind}: last sample)"),
        ),
        ("duration", fmt_duration(ended - started) if started and ended else "n/a"),
        ("exit status", exit_text(meta.get("exit_status"))),
        ("root process", f"pid {meta['root_pid']}" if meta.get("root_pid") else "n/a"),
        ("sampling interval", fmt_value(meta.get("interval_s"), SECONDS)),
        ("instrumented (steps, settings)", yes_no(meta.get("instrumented"))),
        *_steps_source_rows(meta),
        ("torch version", text_or_na(meta.get("torch_version"))),
        ("torchdoctor version", text_or_na(meta.get("torchdoctor_version"))),
        ("recording", str(rec.path)),
    ]
    sections = [MetaSection("Run", run)]
    info = meta.get("host") or {}
    if info:
        quota = info.get("cgroup_cpu_quota")
        limit = info.get("cgroup_memory_limit")
        sections.append(
            MetaSection(
                "Machine",
                [
                    ("host name", text_or_na(info.get("hostname"))),
                    ("kernel", text_or_na(info.get("kernel"))),
                    ("CPU model", text_or_na(info.get("cpu_model"))),
                    ("logical CPUs", text_or_na(info.get("logical_cpus"))),
                    ("physical cores", text_or_na(info.get("physical_cores"))),
                    ("allowed CPUs (affinity)", _cpu_list(info.get("allowed_cpus"))),
                    (
                        "cgroup",
                        f"v{info['cgroup_version']}"
                        if info.get("cgroup_version")
                        else "none readable",
                    ),
                    ("cgroup CPU quota", f"{fmt_value(quota, '')} CPUs" if quota else "no limit"),
                    ("cgroup memory limit", fmt_value(limit, BYTES) if limit else "no limit"),
                    ("RAM", fmt_value(info.get("mem_total"), BYTES)),
                    (
                        "swap",
                        fmt_value(info.get("swap_total"), BYTES)
                        if info.get("swap_total")
                        else "none",
                    ),
                ],
            )
        )
    status = meta.get("gpus")
    if isinstance(status, dict):
        rows = [
            (
                "NVML",
                "available"
                if status.get("available")
                else f"unavailable: {status.get('reason') or 'no reason given'}",
            ),
        ]
        for key, label in (
            ("driver_version", "driver"),
            ("cuda_driver_version", "CUDA driver"),
            ("nvml_version", "NVML version"),
        ):
            if status.get(key):
                rows.append((label, str(status[key])))
        for g in status.get("gpus") or []:
            parts = [g.get("name") or "unknown model"]
            if g.get("memory_total"):
                parts.append(fmt_value(g["memory_total"], BYTES))
            if g.get("compute_capability"):
                parts.append(f"compute capability {g['compute_capability']}")
            if g.get("power_limit_w"):
                parts.append(f"power limit {fmt_value(g['power_limit_w'], 'W')}")
            rows.append((f"GPU {g.get('index', '?')}", ", ".join(parts)))
        sections.append(MetaSection("GPUs", rows))
    env = meta.get("env")
    if isinstance(env, dict):
        rows = [(k, str(v)) for k, v in sorted(env.items())]
        sections.append(
            MetaSection(
                "Environment",
                rows or [("(none set)", "no thread, CUDA or distributed variables were set")],
            )
        )
    known = {
        "command",
        "cwd",
        "mode",
        "started_at",
        "ended_at",
        "exit_status",
        "interval_s",
        "instrumented",
        "steps_source",
        "steps_source_detail",
        "steps_source_reason",
        "steps_source_limit",
        "torch_version",
        "torchdoctor_version",
        "root_pid",
        "host",
        "gpus",
        "env",
        "schema_version",
        "totals",  # the writer's running sums for late readers (recording.totals), not facts
    }
    other = [(k, pretty_json(json.dumps(v))) for k, v in sorted(meta.items()) if k not in known]
    if other:
        sections.append(MetaSection("Other metadata", other))
    return sections


def event_rows(events: list[dict], t0: float) -> list[EventRow]:
    out = []
    for e in events:
        kind = e["kind"]
        level = (
            "alert"
            if kind in ("cuda-oom",)
            else "warn"
            if "disabled" in kind or "error" in kind
            else "info"
        )
        out.append(
            EventRow(e["t"] - t0, who(e["pid"], e["rank"]), kind, pretty_json(e["detail"]), level)
        )
    return out


def _cpu_list(cpus: list[int] | None) -> str:
    """``[0, 1, 2, 3, 8]`` as ``"0-3,8 (5 CPUs)"``, the way taskset and cgroups write it."""
    if not cpus:
        return "n/a"
    return f"{fmt_cpu_list(cpus)} ({len(cpus)} CPUs)"


def pretty_json(text: Any) -> str:
    value = decode_json(text)
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return ", ".join(f"{k}={pretty_json(json.dumps(v))}" for k, v in value.items()) or "{}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def text_or_na(value: Any) -> str:
    return "n/a" if value is None else str(value)


def yes_no(value: Any) -> str:
    if value is None:
        return "n/a"
    return "yes" if value else "no"


def _steps_source_rows(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """How an attached job's steps were seen (sampled stacks), or why they were not."""
    source = meta.get("steps_source")
    if source is None:
        return []
    text = meta.get("steps_source_detail") or meta.get("steps_source_reason") or ""
    rows = [("steps seen by", f"{source}: {text}" if text else str(source))]
    if meta.get("steps_source_limit"):
        rows.append(("steps counted", str(meta["steps_source_limit"])))
    return rows
