"""A /proc of a test's making: PID folders with a stat file, and loadavg's last PID."""

from __future__ import annotations

from pathlib import Path


def fake_stat(pid: int, *, ppid: int = 1, starttime: int = 100, comm: str = "python") -> str:
    # pid (comm) state ppid, then fields 5..24 of proc(5): utime 14, stime 15, threads 20,
    # starttime 22, rss 24.
    fields = ["0"] * 21
    fields[14 - 4], fields[15 - 4], fields[20 - 4] = "5", "3", "1"
    fields[22 - 4], fields[24 - 4] = str(starttime), "100"
    return f"{pid} ({comm}) S {ppid} " + " ".join(fields[1:]) + "\n"


def fake_proc(root: Path, last_pid: int, stats: dict[int, str]) -> Path:
    root.mkdir(exist_ok=True)
    (root / "loadavg").write_text(f"0.10 0.20 0.30 1/300 {last_pid}\n")
    for pid, text in stats.items():
        (root / str(pid)).mkdir(exist_ok=True)
        (root / str(pid) / "stat").write_text(text)
    return root
