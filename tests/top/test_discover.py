"""Discovery's memory of the processes it classified, on a /proc of the test's making: what it
knows of a PID holds only while that PID names the same process."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.fakeproc import fake_proc, fake_stat
from torchdoctor.sampling import procfs
from torchdoctor.top.discover import TorchProcessFinder

TORCH_MAPS = "7f00-7f01 r-xp 0 08:01 1 /usr/lib/python3/site-packages/torch/lib/libtorch_cpu.so\n"
PYTHON_MAPS = "5500-5501 r-xp 0 08:01 2 /usr/bin/python3.11\n"


class Box:
    """A /proc: PIDs with their stat and maps, and the last PID the kernel handed out."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.last_pid = 100
        self.procs: dict[int, tuple[str, str]] = {}

    def start(self, pid: int, maps: str, *, ppid: int = 1, starttime: int = 100) -> None:
        self.last_pid = pid
        self.procs[pid] = (fake_stat(pid, ppid=ppid, starttime=starttime), maps)
        self._write()

    def end(self, pid: int) -> None:
        del self.procs[pid]
        for name in ("stat", "maps"):
            (self.root / str(pid) / name).unlink()
        (self.root / str(pid)).rmdir()
        self._write()

    def _write(self) -> None:
        fake_proc(self.root, self.last_pid, {pid: stat for pid, (stat, _) in self.procs.items()})
        for pid, (_, maps) in self.procs.items():
            (self.root / str(pid) / "maps").write_text(maps)

    def scan(self, finder: TorchProcessFinder):
        return finder.scan(procfs.ProcTable(str(self.root)))


def test_jobs_come_and_go_at_the_next_scan(tmp_path):
    box = Box(tmp_path / "proc")
    box.start(200, TORCH_MAPS)
    box.start(201, TORCH_MAPS, ppid=200)  # its DataLoader worker: part of job 200
    finder = TorchProcessFinder(proc=str(box.root))
    assert box.scan(finder).roots == [200]
    box.start(300, PYTHON_MAPS + TORCH_MAPS)
    found = box.scan(finder)
    assert found.roots == [200, 300] and found.torch_pids == {200, 201, 300}
    box.end(201)
    box.end(200)
    assert box.scan(finder).roots == [300]


def test_a_pid_handed_to_another_program_is_not_taken_for_the_job_it_named(tmp_path):
    box = Box(tmp_path / "proc")
    box.start(200, TORCH_MAPS, starttime=100)
    box.start(210, PYTHON_MAPS)
    finder = TorchProcessFinder(proc=str(box.root))
    assert box.scan(finder).roots == [200]
    # Between two scans the trainer ends and the kernel, wrapping around pid_max, hands its
    # PID to a shell: the PID is listed at both scans, the process is another one.
    box.start(200, "5500-5501 r-xp 0 08:01 3 /usr/bin/bash\n", starttime=5000)
    box.start(205, PYTHON_MAPS)  # the last PID handed out: 210 -> pid_max -> 205
    assert box.scan(finder).roots == []


def test_a_known_pid_not_handed_out_again_is_not_read_again(tmp_path):
    box = Box(tmp_path / "proc")
    box.start(200, TORCH_MAPS)
    finder = TorchProcessFinder(proc=str(box.root))
    assert box.scan(finder).roots == [200]
    # Its files unreadable now (its folder still listed): it is still known, as nothing was
    # handed out since.
    del box.procs[200]
    (box.root / "200" / "maps").unlink()
    (box.root / "200" / "stat").unlink()
    assert box.scan(finder).roots == [200]
    # Other PIDs handed out since, below and above it, leave it as it was.
    box.last_pid = 150
    assert box.scan(finder).roots == [200]
    box.start(160, PYTHON_MAPS)
    assert box.scan(finder).roots == [200]
    # Once its PID may have been handed out again, it is looked at: now gone.
    box.start(205, PYTHON_MAPS)  # 160 < 200 <= 205
    assert box.scan(finder).roots == []
