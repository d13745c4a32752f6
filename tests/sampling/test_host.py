"""HostReader and read_host_info against the real /proc of this machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.helpers.engines import not_root, require_engine

from torchdoctor.sampling import procfs
from torchdoctor.sampling.host import HostReader
from torchdoctor.sampling.hostinfo import read_host_info

RATES = (
    "cpu_busy",
    "cpu",
    "per_core",
    "ctx_switches_per_s",
    "swap_in_per_s",
    "swap_out_per_s",
    "major_faults_per_s",
    "disk_read_per_s",
    "disk_write_per_s",
)


def test_first_read_has_levels_but_no_rates():
    host = HostReader()
    s = host.read()
    for name in RATES:
        assert getattr(s, name) is None, name
    assert s.mem_total > 0 and 0 < s.mem_available <= s.mem_total
    assert s.mem_used == s.mem_total - s.mem_available
    assert 0 <= s.swap_used <= s.swap_total
    assert s.load1 >= 0 and s.procs_running >= 1  # this test is running
    host.close()


def test_second_read_has_consistent_rates():
    host = HostReader()
    host.read()
    # Some work between the reads: context switches and CPU time for sure.
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    s = host.read()
    assert s.cpu is not None and s.per_core is not None
    parts = (s.cpu.user, s.cpu.nice, s.cpu.system, s.cpu.idle, s.cpu.iowait, s.cpu.irq)
    total = sum(parts) + s.cpu.softirq + s.cpu.steal
    assert total == pytest.approx(100.0, abs=0.01)
    assert s.cpu_busy == pytest.approx(s.cpu.busy)
    assert len(s.per_core) == len(os.sched_getaffinity(0)) == len(s.per_core_ids)
    assert s.ctx_switches_per_s > 0
    for name in RATES[3:]:
        value = getattr(s, name)
        assert value is not None and value >= 0, name
    host.close()


def test_cpu_busy_sees_a_process_burning_cpu(jobtree):
    tree = jobtree()
    child = tree.fork()
    # Pinned to one core: left free, the scheduler may spread the burn over several cores so
    # that none of them looks busy. On a loaded machine the core is busy either way.
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(child, {core})
    host = HostReader()
    host.read()
    assert tree.ask("burn", child, 0.5) == "done"
    s = host.read()
    # One busy core out of the allowed ones, diluted by whatever else runs: generous bound.
    ncpu = len(os.sched_getaffinity(0))
    assert s.cpu.user + s.cpu.system >= 100.0 / ncpu * 0.3
    busy = s.per_core[s.per_core_ids.index(core)]
    assert busy.user + busy.system >= 30.0


def test_affinity_of_the_followed_process_limits_the_cores():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        first = min(os.sched_getaffinity(0))
        os.sched_setaffinity(proc.pid, {first})
        host = HostReader(pid=proc.pid)
        host.read()
        s = host.read()
        assert s.per_core_ids == [first] and len(s.per_core) == 1
        assert read_host_info(proc.pid).allowed_cpus == [first]
    finally:
        proc.stdin.close()
        proc.wait()


def test_disk_rates_count_whole_disks_only():
    names = set()
    with open("/proc/diskstats") as f:
        for line in f:
            names.add(line.split()[2])
    for name in names:
        whole = procfs.is_whole_physical_disk(name)
        if name.startswith(("loop", "ram", "zram")):
            assert not whole, name
        if os.path.exists(f"/sys/class/block/{name}/partition"):
            assert not whole, f"{name} is a partition"
        if os.path.isdir(f"/sys/block/{name}/slaves") and os.listdir(f"/sys/block/{name}/slaves"):
            assert not whole, f"{name} is stacked on other disks"


def test_pressure_values_or_a_reason():
    host = HostReader()
    s = host.read()
    for name in ("psi_cpu_some", "psi_memory_some", "psi_memory_full", "psi_io_some"):
        value = getattr(s, name)
        if value is None:
            assert name in s.unavailable and s.unavailable[name]
        else:
            assert 0.0 <= value <= 100.0
    if os.path.exists("/proc/pressure/cpu"):
        try:
            with open("/proc/pressure/cpu") as f:
                f.read()
        except OSError:
            return  # PSI compiled in but disabled (psi=0): the reason is checked above
        assert s.psi_cpu_some is not None


def test_cgroup_throttling_measured_or_explained():
    host = HostReader()
    host.read()
    s = host.read()
    if s.cgroup_throttled_per_s is None:
        assert s.unavailable["cgroup_throttled_per_s"]
    else:
        assert s.cgroup_throttled_per_s >= 0 and s.cgroup_nr_throttled >= 0


def test_host_info_describes_this_machine():
    info = read_host_info()
    assert info.hostname == os.uname().nodename
    assert info.kernel == os.uname().release
    assert info.logical_cpus == os.cpu_count()
    assert info.allowed_cpus == sorted(os.sched_getaffinity(0))
    assert info.mem_total > 0 and info.page_size == os.sysconf("SC_PAGE_SIZE")
    assert info.cgroup_version in (1, 2, None)
    if info.cgroup_cpu_quota is not None:
        assert info.cgroup_cpu_quota > 0
        assert info.usable_cpus <= info.cgroup_cpu_quota
    assert info.usable_cpus <= len(info.allowed_cpus)
    if info.cgroup_memory_limit is not None:
        assert info.cgroup_memory_limit > 0
    with open("/proc/cpuinfo") as f:
        if "model name" in f.read():
            assert info.cpu_model


def test_cgroup_limits_follow_the_files_of_our_cgroup():
    paths = procfs.cgroup_paths()
    require_engine(
        "cgroups", "no cgroup cpu controller visible here" if paths.cpu_version is None else None
    )
    own = paths.cpu_dirs[0]
    if paths.cpu_version == 2:
        raw = Path(own, "cpu.max").read_text().split()
        expected = None if raw[0] == "max" else int(raw[0]) / int(raw[1])
    else:
        q = int(Path(own, "cpu.cfs_quota_us").read_text())
        p = int(Path(own, "cpu.cfs_period_us").read_text())
        expected = None if q <= 0 else q / p
    quota = procfs.cgroup_cpu_quota(paths)
    if expected is None:
        # Our own cgroup has no quota; an ancestor's may still apply.
        assert quota is None or quota > 0
    else:
        assert quota is not None and quota <= expected


def test_memory_and_load_agree_with_psutil_and_os():
    import psutil

    # Other programs move these figures while we read: ours must lie between a reading taken
    # just before and one just after (the kernel updates the load averages every 5 s).
    host = HostReader()
    vm0, load0 = psutil.virtual_memory(), os.getloadavg()
    s = host.read()
    vm1, load1 = psutil.virtual_memory(), os.getloadavg()
    sw = psutil.swap_memory()
    assert s.mem_total == vm0.total
    low, high = sorted((vm0.available, vm1.available))
    assert low * 0.99 <= s.mem_available <= high * 1.01
    assert s.swap_total == sw.total
    for ours, before, after in zip((s.load1, s.load5, s.load15), load0, load1, strict=True):
        assert min(before, after) - 0.01 <= ours <= max(before, after) + 0.01


def _make_cpu_cgroup(name: str, cpus: float) -> tuple[Path, str]:
    """A cgroup of our own with a CFS quota of ``cpus`` (root only); (its dir, procs file)."""
    paths = procfs.cgroup_paths()
    if paths.cpu_version == 1:
        mount = next(
            (p for fs, _, p, opts in procfs._mounts() if fs == "cgroup" and "cpu" in opts), None
        )
        if mount is None:
            require_engine("cgroups", "no cgroup v1 cpu mount")
        d = Path(mount, name)
        d.mkdir()
        (d / "cpu.cfs_period_us").write_text("100000")
        (d / "cpu.cfs_quota_us").write_text(str(int(cpus * 100000)))
        return d, "cgroup.procs"
    if paths.cpu_version == 2:
        d = Path(paths.cpu_dirs[0]).parent / name if paths.cpu_dirs else None
        if d is None:
            require_engine("cgroups", "no cgroup v2 cpu directory")
        d.mkdir()
        (d / "cpu.max").write_text(f"{int(cpus * 100000)} 100000")
        return d, "cgroup.procs"
    require_engine("cgroups", "no cgroup cpu controller visible on this machine")
    raise AssertionError("unreachable")


def test_a_cpu_quota_made_here_is_read_and_its_throttling_measured():
    """Make the condition instead of taking the weak branch: a 0.2-CPU cgroup and a busy loop
    in it. The host reader following that process must report the quota and real throttling."""
    require_engine("root", not_root())  # creating a cgroup
    name = f"torchdoctor-test-{os.getpid()}"
    try:
        cg, procs = _make_cpu_cgroup(name, 0.2)
    except OSError as exc:
        require_engine("cgroups", f"cannot create a cpu cgroup here: {exc}")
        raise
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        (cg / procs).write_text(str(burner.pid))
        info = read_host_info(burner.pid)
        assert info.cgroup_cpu_quota == pytest.approx(0.2)
        assert info.usable_cpus == pytest.approx(0.2)
        host = HostReader(pid=burner.pid)
        host.read()
        # CFS throttles a 0.2-CPU group in every 100 ms period the loop runs through: wait
        # for the counter to move (an event), not for a fixed time
        deadline = time.monotonic() + 30
        throttled = 0
        while time.monotonic() < deadline and throttled < 3:
            s = host.read()
            assert "cgroup_throttled_per_s" not in s.unavailable, s.unavailable
            throttled += s.cgroup_nr_throttled or 0
            time.sleep(0.3)  # the sampling interval of the reader, not a synchronisation
        assert throttled >= 3 and s.cgroup_throttled_per_s is not None
        host.close()
    finally:
        burner.kill()
        burner.wait()
        # the group empties once the burner is reaped; then it can go
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.05)
