"""Drawing a :class:`~torchdoctor.top.model.View` with rich, for any terminal from 80 x 24 up.

The screen is a stack of lines, each cut to the width: header, CPU, cores, memory, GPUs, then
the jobs (or a process's detail, or the help) in what is left, then one line of keys or
prompt. Colours say the level from the threshold table: yellow above the best range, red
above the alert limit; the figure is always printed too, so nothing depends on colour alone.
"""

from __future__ import annotations

import textwrap
import time

from rich.console import Group
from rich.text import Text

from torchdoctor.sampling import roles
from torchdoctor.terminal import make_console
from torchdoctor.top import compact
from torchdoctor.top.keys import HELP, SIGNAL_KEYS
from torchdoctor.top.model import (
    DATA_WAIT_STARVED,
    SORT_LABELS,
    DetailView,
    GpuRow,
    HostView,
    JobView,
    ProcessRow,
    View,
)
from torchdoctor.units import fmt_cpu_list

LEVEL_STYLE = {"ok": "", "warn": "yellow", "alert": "bold red"}
STATE_STYLE = {"user": "green", "system": "red", "iowait": "magenta", "steal": "cyan"}
ROLE_LABEL = {
    roles.TRAINER: "trainer",
    roles.WORKER: "worker",
    roles.LAUNCHER: "launcher",
    roles.OTHER: "other",
}
SELECTED = "reverse"

# Jobs table columns: header, width, right-aligned
_COLUMNS = (
    ("PID", 7, True),
    ("ROLE", 10, False),
    ("CPU%", 6, True),
    ("THR", 4, True),
    ("RSS", 5, True),
    ("PSS", 5, True),
    ("VRAM", 5, True),
)


def render(view: View, width: int, height: int, *, interactive: bool = True) -> Group:
    """The whole screen as rich renderables, ``height`` lines at most, none wider than ``width``.

    ``interactive=False`` (``--once``) leaves out the key hints.
    """
    top = _header(view, width, interactive)
    top += _host(view.host, width, height)
    top += _gpus(view, width)
    footer = _footer(view, width) if interactive else []
    room = max(height - len(top) - len(footer), 3)
    if view.state.mode == "help":
        body = _help(room)
    elif view.detail is not None:
        body = _detail(view.detail, width, room)
    else:
        body = _jobs(view, width, room)
    lines = (top + body)[: max(height - len(footer), 1)] + footer
    for line in lines:
        line.no_wrap = True
        line.overflow = "ellipsis"
        line.truncate(width, overflow="ellipsis")
    return Group(*lines)


def seg(text: str, style: str = "") -> Text:
    """A piece of a line with its own style: ``Text(text, style)`` would pass its style on to
    everything appended to it later."""
    t = Text()
    t.append(text, style)
    return t


# -- sections -------------------------------------------------------------------------------


def _header(view: View, width: int, interactive: bool) -> list[Text]:
    clock = time.strftime("%H:%M:%S", time.localtime(view.t))
    left = Text(f" torchdoctor top  {view.hostname}  {clock}  every {view.interval_s:g}s", "bold")
    right = Text()
    if view.state.filter:
        right.append(f"filter '{view.state.filter}'  ")
    if interactive:
        right.append(f"sort {SORT_LABELS[view.state.sort]} ")
    pad = max(width - left.cell_len - right.cell_len, 1)
    line = left + Text(" " * pad) + right
    line.stylize("reverse")
    return [line]


def _host(host: HostView | None, width: int, height: int) -> list[Text]:
    if host is None:
        return [Text("host: not read")]
    lines = []
    cpu = seg("CPU ", "bold")
    if host.cpu_busy is None:
        cpu.append("  - (first reading)")
    else:
        cpu.append(f"{host.cpu_busy:4.0f}%", LEVEL_STYLE[host.cpu_level])
        cpu.append("  usr ", STATE_STYLE["user"])
        cpu.append(f"{host.user:.0f}")
        cpu.append(" sys ", STATE_STYLE["system"])
        cpu.append(f"{host.system:.0f}")
        cpu.append(" io ", STATE_STYLE["iowait"])
        cpu.append(f"{host.iowait:.1f}", LEVEL_STYLE[host.iowait_level])
        if host.steal is not None and host.steal >= 0.5:
            cpu.append(" st ", STATE_STYLE["steal"])
            cpu.append(f"{host.steal:.0f}")
    load = " ".join(f"{v:.1f}" if v >= 10 else f"{v:.2f}" for v in host.load)
    cpu.append(f"  load {load}/{host.usable_cpus}cpu")
    cpu.append(f"  runq {host.run_queue}")
    if host.blocked:
        cpu.append(f" D {host.blocked}", "yellow")
    if host.cgroup_throttled is not None and host.cgroup_throttled >= 0.01:
        # The container's CPU quota, not the machine, is what holds the job back.
        cpu.append(f"  throttled {100 * host.cgroup_throttled:.0f}%", "yellow")
    lines.append(cpu)
    lines += _cores(host, width, max_lines=4 if height >= 24 else 2)

    mem = seg("MEM ", "bold")
    pct = 100.0 * host.mem_used / host.mem_total if host.mem_total else 0.0
    mem.append(f"{compact.size(host.mem_used)}/{compact.size(host.mem_total)} {pct:.0f}%")
    mem.append("  swap ")
    mem.append(f"{compact.size(host.swap_used)}/{compact.size(host.swap_total)}")
    if host.swap_in_per_s is not None and host.swap_out_per_s is not None:
        style = LEVEL_STYLE[host.swap_level]
        mem.append(" in ")
        mem.append(compact.rate(host.swap_in_per_s), style)
        mem.append(" out ")
        mem.append(compact.rate(host.swap_out_per_s), style)
    mem.append("  PSI ")
    psi = [f"{k} {v:.1f}" for k, v in host.psi.items() if v is not None]
    mem.append(" ".join(psi) if psi else "n/a", "" if psi else "dim")
    lines.append(mem)
    return lines


def _cores(host: HostView, width: int, max_lines: int) -> list[Text]:
    cores = host.cores
    if not cores:
        return []
    idw = len(str(max(c.index for c in cores)))
    bar = 6
    cell = idw + 1 + bar + 5  # "12 ██████ 100%"
    per_line = max(1, (width + 1) // (cell + 1))
    if (len(cores) + per_line - 1) // per_line <= max_lines:
        out = []
        for start in range(0, len(cores), per_line):
            line = Text()
            for c in cores[start : start + per_line]:
                if line:
                    line.append(" ")
                line.append(f"{c.index:>{idw}} ", "dim")
                line += _stacked_bar(c, bar)
                line.append(f"{c.user + c.system + c.iowait + c.steal:4.0f}%")
            out.append(line)
        return out
    # Too many cores for a bar each: one character per core, its height the busy share.
    per_line = max(1, width - 6)
    out = []
    for start in range(0, len(cores), per_line):
        line = Text("cores " if start == 0 else "      ", "dim")
        for c in cores[start : start + per_line]:
            busy = c.user + c.system + c.iowait + c.steal
            dominant = max(
                ("user", c.user), ("system", c.system), ("iowait", c.iowait), key=lambda kv: kv[1]
            )[0]
            line.append(compact.sparkline([busy], 1, top=100.0), STATE_STYLE[dominant])
        out.append(line)
    return out[:max_lines]


def _stacked_bar(c, width: int) -> Text:
    """A bar of ``width`` cells split user / system / iowait / steal, htop-style."""
    bar = Text()
    used = 0
    for state, value in (
        ("user", c.user),
        ("system", c.system),
        ("iowait", c.iowait),
        ("steal", c.steal),
    ):
        n = min(round(value * width / 100.0), width - used)
        if n > 0:
            bar.append("█" * n, STATE_STYLE[state])
            used += n
    bar.append("·" * (width - used), "dim")
    return bar


def _gpus(view: View, width: int) -> list[Text]:
    if view.gpu_unavailable is not None:
        # The reason is the point of this line: let it wrap (4 lines at most), not be cut.
        wrapped = Text(view.gpu_unavailable, "dim").wrap(make_console(width=width), width)
        return list(wrapped)[:4]
    lines = []
    for g in view.gpus:
        line, slow = _gpu_line(g)
        if slow is not None and line.cell_len + slow.cell_len > width:
            lines += [line, Text(" " * 5) + slow]  # under the name, when it does not fit
        else:
            lines.append(line + slow if slow is not None else line)
    if view.gpu_processes:
        line = seg("  on GPU: ", "dim")
        for i, gp in enumerate(view.gpu_processes):
            if i:
                line.append("  ")
            if gp.local_pid is None:
                line.append(f"[{gp.gpu_index}] host pid {gp.pid} ", "")
                line.append("unresolved", "yellow")
            else:
                line.append(f"[{gp.gpu_index}] {gp.local_pid} {compact.printable(gp.name or '?')}")
            line.append(f" {compact.size(gp.used_memory)}")
        lines.append(line)
    return lines


# Clock-event (throttle) reasons in a few characters; the JSON keeps NVML's full names.
THROTTLE_LABEL = {
    "applications_clocks_setting": "app-clocks",
    "sw_power_cap": "pwr-cap",
    "hw_slowdown": "hw-slow",
    "sync_boost": "sync-boost",
    "sw_thermal_slowdown": "thermal",
    "hw_thermal_slowdown": "hw-thermal",
    "hw_power_brake_slowdown": "pwr-brake",
    "display_clock_setting": "display",
}


def _gpu_line(g: GpuRow) -> tuple[Text, Text | None]:
    """The device's line, and its throttle reasons (``None``: not slowed) to append."""
    name = g.name.removeprefix("NVIDIA ").removeprefix("GeForce ")
    line = seg(f"GPU{g.index} ", "bold")
    line.append(f"{name[:14]:<14} ")
    if "*" in g.unavailable or (g.utilization is None and g.memory_used is None):
        line.append(next(iter(g.unavailable.values()), "not readable"), "bold red")
        return line, None
    line.append(f"{compact.pct(g.utilization):>4} util")
    style = LEVEL_STYLE[g.memory_level]
    line.append("  VRAM ")
    line.append(
        f"{compact.size(g.memory_used)}/{compact.size(g.memory_total)} {compact.pct(g.memory_pct)}",
        style,
    )
    if g.power_w is not None:
        limit = f"/{g.power_limit_w:.0f}" if g.power_limit_w else ""
        line.append(f"  {g.power_w:.0f}{limit}W")
    if g.temperature_c is not None:
        line.append(f" {g.temperature_c:.0f}°C")
    throttle = [THROTTLE_LABEL.get(r, r) for r in (g.throttle or []) if r != "gpu_idle"]
    if throttle:
        return line, seg("  slow: " + ",".join(throttle), "yellow")
    return line, None


def _role(row: ProcessRow) -> str:
    label = ROLE_LABEL.get(row.role, row.role)
    if row.rank is not None:
        label = f"rank {row.rank}"
    indent = "" if row.depth == 0 else " " * (row.depth - 1) + "└"
    return indent + label


def _cells(values: list[str]) -> Text:
    line = Text()
    for (_, width, right), value in zip(_COLUMNS, values, strict=False):
        text = value[:width]
        line.append((text.rjust(width) if right else text.ljust(width)) + " ")
    return line


def _jobs(view: View, width: int, room: int) -> list[Text]:
    header = _cells([c[0] for c in _COLUMNS])
    header.append("COMMAND")
    header.stylize("bold reverse")
    header.pad_right(max(width - header.cell_len, 0))
    header.stylize("bold reverse")
    lines = [header]
    if not view.jobs:
        if view.state.filter:
            lines.append(Text(f"no PyTorch process matches '{view.state.filter}'", "dim"))
        else:
            lines.append(Text("no PyTorch process running on this machine", "dim"))
        lines += [Text(n, "dim") for n in view.notes]
        return lines
    # A process's line is made only if it is shown (a box of 100 jobs has ten times the lines
    # a screen holds): the body holds its row until then, and its PID.
    body: list[tuple[Text | ProcessRow, int | None]] = []
    for job in view.jobs:
        body += [(line, None) for line in _job_lines(job)]
        body += [(row, row.pid) for row in job.rows]
    for note in view.notes:
        body.append((Text(note, "dim"), None))
    selected_pid = view.state.selected_pid

    def made(item: Text | ProcessRow) -> Text:
        return item if isinstance(item, Text) else _process_line(item, item.pid == selected_pid)

    space = room - 1
    if len(body) > space:
        # Keep the selected row on screen: scroll just enough.
        selected = next((i for i, (_, pid) in enumerate(body) if pid == selected_pid), 0)
        start = max(0, min(selected - space + 2, len(body) - space + 1))
        shown = body[start : start + space - 1]
        hidden = len(body) - len(shown)
        lines += [made(item) for item, _ in shown]
        lines.append(Text(f"… {hidden} more lines (up/down to scroll)", "dim"))
    else:
        lines += [made(item) for item, _ in body]
    return lines


def _job_lines(job: JobView) -> list[Text]:
    line = seg("▸ ", "bold")
    line.append(f"job {job.root_pid}", "bold")
    parts = []
    if job.ranks:
        parts.append(f"{len(job.ranks)} rank{'s' if len(job.ranks) > 1 else ''}")
    if job.workers:
        parts.append(f"{job.workers} worker{'s' if job.workers != 1 else ''}")
    if not parts:
        n = job.process_count
        parts.append("1 process" if n == 1 else f"{n} processes")
    line.append(f" {', '.join(parts)}")
    line.append(f"  CPU {job.cpu_percent:.0f}%  {job.threads} thr")
    line.append(f"  PSS {compact.size(job.pss if job.pss is not None else job.rss)}")
    if job.gpu_memory:
        line.append(f"  VRAM {compact.size(job.gpu_memory)}")
    lines = [line]
    rec = job.recording
    if rec is not None or job.status:
        second = seg("  │ ", "dim")
        # A stalled job has no recent step to give figures for: its status says so instead.
        if rec is not None and rec.stalled_s is None and rec.step_rate_per_s is not None:
            at_least = "≥ " if rec.rate_lower_bound else ""  # merged sampled steps
            second.append(at_least + _step_rate(rec.step_rate_per_s), "bold")
            if rec.data_wait_share is not None:
                second.append("  data wait ")
                second.append(
                    f"{100 * rec.data_wait_share:.0f}%",
                    "bold red" if rec.data_wait_share > DATA_WAIT_STARVED else "",
                )
            second.append("  ")
        if job.status:
            second.append(job.status, LEVEL_STYLE[job.status_level] or "green")
        if rec is not None and rec.recording_note:
            second.append(("  " if job.status else "") + rec.recording_note, "yellow")
        lines.append(second)
    return lines


def _step_rate(rate: float) -> str:
    """Steps per second, or seconds per step for slow steps (0.04 step/s reads badly)."""
    if rate == 0.0:
        return "0 step/s"
    if rate >= 1.0:
        return f"{rate:.1f} step/s"
    return f"{1.0 / rate:.1f} s/step"


def _process_line(row: ProcessRow, selected: bool) -> Text:
    line = _cells(
        [
            str(row.pid),
            _role(row),
            "-" if row.cpu_percent is None else f"{row.cpu_percent:.1f}",
            str(row.threads),
            compact.size(row.rss),
            compact.size(row.pss),
            compact.size(row.gpu_memory),
        ]
    )
    line.append(row.command)
    if not row.matched:
        line.stylize("dim")
    if selected:
        line.stylize(SELECTED)
    return line


def _detail(d: DetailView, width: int, room: int) -> list[Text]:
    row = d.row
    title = Text(f" process {row.pid}  {_role(row).strip('└ ')}  of job {d.job_root} ", "bold")
    title.stylize("reverse")
    lines = [title]
    info = d.detail
    if info is None:
        lines.append(Text("process details not readable (it may have just exited)", "dim"))
    else:
        lines.append(
            Text(f"user {info.username}  state {info.state}  threads {row.threads}  ")
            + Text(
                f"CPUs allowed {fmt_cpu_list(info.cpu_affinity)}"
                if info.cpu_affinity
                else "CPUs allowed ?"
            )
        )
        cmd = compact.printable(" ".join(info.cmdline)) or f"[{row.name}]"
        lines += _wrapped("cmd ", cmd, width, max_lines=4)
        if info.env is not None:
            env = "  ".join(f"{k}={v}" for k, v in info.env.items()) or "none of interest set"
            lines += _wrapped("env ", compact.printable(env), width, max_lines=4)
        else:
            lines.append(seg("env ", "bold") + Text(info.env_unavailable or "?", "dim"))
    spark_w = max(width - 24, 10)
    h = d.history
    lines.append(
        seg("CPU% ", "bold")
        + Text(f"{row.cpu_percent or 0:7.1f} ")
        + Text(compact.sparkline(h.cpu_percent, spark_w), "green")
    )
    lines.append(
        seg("RSS  ", "bold")
        + Text(f"{compact.size(row.rss):>7} ")
        + Text(compact.sparkline(h.rss, spark_w), "cyan")
    )
    if any(v for v in h.gpu_memory):
        lines.append(
            seg("VRAM ", "bold")
            + Text(f"{compact.size(row.gpu_memory):>7} ")
            + Text(compact.sparkline(h.gpu_memory, spark_w), "magenta")
        )
    ctx = row.ctx_involuntary_per_s
    lines.append(
        Text(
            f"PSS {compact.size(row.pss)}  USS {compact.size(row.uss)}  swap {compact.size(row.swap)}"
            f"  I/O r {compact.rate(row.read_bytes_per_s)} w {compact.rate(row.write_bytes_per_s)}"
            f"  preempted {'-' if ctx is None else f'{ctx:.0f}'}/s"
        )
    )
    lines.append(Text(f"history: last {len(h.cpu_percent)} refreshes", "dim"))
    return lines[:room]


def _wrapped(label: str, text: str, width: int, max_lines: int) -> list[Text]:
    """``label`` then ``text`` cut into lines of the width, indented under the label."""
    room = max(width - len(label), 10)
    # Break between arguments where one fits, so a path is not cut in two and copies back whole;
    # only an argument longer than the line is cut.
    chunks = textwrap.wrap(text, room, break_on_hyphens=False) or [""]
    if len(chunks) > max_lines:
        chunks = chunks[:max_lines]
        chunks[-1] = chunks[-1][:-1] + "…"
    out = [seg(label, "bold") + Text(chunks[0])]
    out += [Text(" " * len(label) + c) for c in chunks[1:]]
    return out


def _help(room: int) -> list[Text]:
    lines = [Text(" keys ", "bold reverse")]
    for key, what in HELP:
        lines.append(seg(f"  {key:<9}", "bold") + Text(what))
    lines.append(Text("  colours: yellow above the best range, red above the alert limit", "dim"))
    lines.append(Text("  (threshold table; override with --thresholds FILE)", "dim"))
    lines.append(Text("  GPU util = share of time a kernel ran (NVML), not SM occupancy", "dim"))
    lines.append(Text("  any key closes this help", "dim"))
    return lines[:room]


def _footer(view: View, width: int) -> list[Text]:
    s = view.state
    if s.mode == "filter":
        return [
            seg("filter: ", "bold") + Text(s.filter + "▏") + Text("  enter apply  esc clear", "dim")
        ]
    if s.mode == "signal":
        choices = "  ".join(f"{k} {n.removeprefix('SIG')}" for k, n in SIGNAL_KEYS.items())
        return [
            seg(f"signal to {s.selected_pid}: ", "bold yellow") + Text(choices + "  esc cancel")
        ]
    if s.mode == "confirm":
        row = next((r for r in view.rows() if r.pid == s.selected_pid), None)
        what = f"{s.selected_pid} ({row.command[:30]})" if row else str(s.selected_pid)
        return [Text(f"send {s.pending_signal} to {what}? y/n", "bold yellow")]
    if s.message:
        return [Text(s.message, "bold")]
    if view.detail is not None:
        return [Text("esc/enter close  k signal  ? help  q quit", "dim")]
    return [
        Text(
            "↑↓ select  enter detail  s sort  / filter  k signal  ? help  q quit",
            "dim",
        )
    ]
