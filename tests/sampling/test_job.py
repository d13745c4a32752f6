"""JobReader against real process trees: discovery, identity, rates, roles."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time

import pytest
from tests.helpers.engines import engine

from torchdoctor.sampling import procfs
from torchdoctor.sampling.job import JobReader


def by_pid(samples):
    return {s.pid: s for s in samples}


def test_finds_the_tree_and_reports_new_processes_once(jobtree):
    tree = jobtree()
    a, b = tree.fork(), tree.fork()
    job = JobReader(tree.pid)

    samples, new, ended = job.read()
    assert set(by_pid(samples)) == {tree.pid, a, b}
    assert {i.pid for i in new} == {tree.pid, a, b}
    assert ended == []
    assert job.pids == {tree.pid, a, b}
    info = {i.pid: i for i in new}
    assert info[a].ppid == tree.pid
    assert info[tree.pid].cmdline[-1].endswith("jobtree.py")
    for s in samples:
        # Rates need a previous reading of the same process.
        assert s.cpu_percent is None
        assert s.ctx_voluntary_per_s is None and s.read_bytes_per_s is None
        assert s.rss > 0 and s.threads >= 1
        assert s.pss is not None and s.uss is not None and s.uss <= s.pss <= s.rss

    samples, new, ended = job.read()
    assert new == [] and ended == []
    assert set(by_pid(samples)) == {tree.pid, a, b}
    for s in samples:
        assert s.cpu_percent is not None and s.cpu_percent >= 0
        assert s.ctx_voluntary_per_s is not None and s.read_bytes_per_s is not None
    job.close()


def test_workers_started_later_are_found_and_exited_ones_reported(jobtree):
    tree = jobtree()
    job = JobReader(tree.pid)
    assert set(by_pid(job.read()[0])) == {tree.pid}

    late = tree.fork()
    spawned = tree.fork("spawn")
    samples, new, ended = job.read()
    assert {late, spawned} <= set(by_pid(samples))
    assert {i.pid for i in new} >= {late, spawned}
    assert ended == []

    assert tree.ask("exit", late) == "gone"
    samples, new, ended = job.read()
    assert late not in by_pid(samples)
    assert ended == [late]
    assert late not in job.pids
    job.close()


def test_a_job_beyond_the_descriptor_budget_is_still_followed_whole(jobtree):
    import resource

    tree = jobtree()
    kids = [tree.fork() for _ in range(20)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # 300 descriptors: the reader keeps 3 per process for 44 // 3 = 14 of the 21 processes
    # and reads the others by path.
    resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
    try:
        job = JobReader(tree.pid)
        job.read()
        assert tree.ask("exit", kids[-1]) == "gone"  # one read by path, as the last found
        samples, _, ended = job.read()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert ended == [kids[-1]]
    assert set(by_pid(samples)) == {tree.pid, *kids[:-1]}
    assert all(s.cpu_percent is not None and s.rss > 0 for s in samples)
    job.close()


def test_a_reader_out_of_descriptors_follows_the_job_by_path(jobtree):
    import resource

    tree = jobtree()
    kids = [tree.fork() for _ in range(5)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Above every descriptor this pytest process holds already (earlier tests may have left
    # some open), so the hoard below, not their number, decides what is left.
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(300, highest + 50), hard))
    # The process already holds more descriptors than the reader's budget assumes: only a few
    # are left, so keeping three per process runs out part-way through the job.
    hoard = []
    try:
        with contextlib.suppress(OSError):
            while True:
                hoard.append(os.open("/dev/null", os.O_RDONLY))
        for _ in range(6):
            os.close(hoard.pop())
        job = JobReader(tree.pid)
        samples, new, _ = job.read()
        assert set(by_pid(samples)) == {tree.pid, *kids}
        assert {i.pid for i in new} == {tree.pid, *kids}
        assert tree.ask("exit", kids[-1]) == "gone"
        samples, _, ended = job.read()
        assert ended == [kids[-1]]
        assert set(by_pid(samples)) == {tree.pid, *kids[:-1]}
        assert all(s.cpu_percent is not None and s.rss > 0 for s in samples)
        job.close()
    finally:
        for fd in hoard:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_zombie_children_count_as_ended(jobtree):
    tree = jobtree()
    child = tree.fork()
    job = JobReader(tree.pid)
    job.read()
    assert tree.ask("zombie", child) == "zombie"
    samples, _, ended = job.read()
    assert child not in by_pid(samples)
    assert ended == [child]
    # Still a zombie at the next read: not rediscovered as a new process.
    samples, new, ended = job.read()
    assert child not in by_pid(samples) and new == [] and ended == []
    assert tree.ask("reap", child) == "gone"


def _exit_during_read(monkeypatch, tree, victim: int, path_part: bytes):
    """Make ``victim`` exit (and be reaped) right before JobReader reads one of its files."""
    real = procfs.pread_single
    fired = []

    def pread_single(fd, size=4096):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if not fired and target == f"/proc/{victim}/{path_part.decode()}":
            fired.append(True)
            assert tree.ask("exit", victim) == "gone"
        return real(fd, size)

    monkeypatch.setattr(procfs, "pread_single", pread_single)
    return fired


@pytest.mark.parametrize("file", [b"stat", b"status", b"io"])
def test_child_exiting_in_the_middle_of_a_read_just_disappears(jobtree, monkeypatch, file):
    tree = jobtree()
    victim, other = tree.fork(), tree.fork()
    job = JobReader(tree.pid)
    job.read()
    job.read()

    fired = _exit_during_read(monkeypatch, tree, victim, file)
    samples, new, ended = job.read()
    assert fired, "the read never touched the victim's file"
    assert victim not in by_pid(samples)
    assert ended == [victim]
    assert set(by_pid(samples)) == {tree.pid, other}
    for s in samples:
        assert s.cpu_percent is not None


def test_new_child_exiting_before_its_first_sample_is_never_reported(jobtree, monkeypatch):
    tree = jobtree()
    job = JobReader(tree.pid)
    job.read()
    victim = tree.fork()
    fired = _exit_during_read(monkeypatch, tree, victim, b"status")
    samples, new, ended = job.read()
    assert fired
    assert victim not in by_pid(samples)
    assert victim not in {i.pid for i in new}
    assert ended == []  # it was never reported, so it does not "end" either


def test_cpu_percent_of_a_busy_child_is_near_a_full_core_and_idle_near_zero(jobtree):
    tree = jobtree()
    busy, idle = tree.fork(), tree.fork()
    job = JobReader(tree.pid)
    first = by_pid(job.read()[0])
    assert tree.ask("burn", busy, 0.6) == "done"  # 0.6 s of CPU, however long that takes
    second = by_pid(job.read()[0])
    b0, b1, i1 = first[busy], second[busy], second[idle]
    used = (b1.cpu_user_s + b1.cpu_system_s) - (b0.cpu_user_s + b0.cpu_system_s)
    assert used >= 0.55
    # The percentage is the CPU time over the wall time between the two samples (100 = one
    # core). Other jobs on a loaded machine stretch the wall time (at a load of 13 on 2 CPUs
    # the burner gets ~15 % of a core), so no lower bound beyond telling busy from idle.
    assert b1.cpu_percent == pytest.approx(100.0 * used / (b1.t - b0.t), rel=0.1, abs=2.0)
    assert b1.cpu_percent <= 110.0
    assert i1.cpu_percent <= 2.0
    assert b1.cpu_percent > 10 * max(i1.cpu_percent, 0.5)


def test_rss_and_uss_grow_after_a_child_allocates(jobtree):
    tree = jobtree()
    child = tree.fork()
    job = JobReader(tree.pid, slow_refresh_s=0.0, slow_budget=None)  # PSS/USS at every read
    before = by_pid(job.read()[0])[child]
    assert tree.ask("alloc", child, 64) == "done"
    after = by_pid(job.read()[0])[child]
    mib = 1 << 20
    assert after.rss - before.rss >= 56 * mib
    assert after.uss - before.uss >= 56 * mib
    assert after.pss - before.pss >= 56 * mib


def test_pss_is_carried_over_between_slow_refreshes(jobtree):
    tree = jobtree()
    child = tree.fork()
    job = JobReader(tree.pid, slow_refresh_s=3600.0)
    before = by_pid(job.read()[0])[child]
    assert tree.ask("alloc", child, 8) == "done"
    after = by_pid(job.read()[0])[child]
    assert after.rss - before.rss >= 6 << 20  # fast tier: fresh
    assert after.pss == before.pss  # slow tier: the last value, not a None or a zero


def test_pss_of_a_process_that_grew_is_withheld_until_refreshed(jobtree):
    # A trainer importing torch grows by hundreds of MiB within seconds: its start-up PSS
    # must not stand for it until the next slow refresh.
    tree = jobtree()
    child = tree.fork()
    job = JobReader(tree.pid, slow_refresh_s=3600.0, slow_budget=None)
    before = by_pid(job.read()[0])[child]
    assert before.pss is not None
    assert tree.ask("alloc", child, 64) == "done"
    grown = by_pid(job.read()[0])[child]
    assert grown.pss is None and grown.uss is None
    assert "stale" in grown.unavailable["pss"]
    refreshed = by_pid(job.read()[0])[child]  # first in line at the next read
    assert refreshed.pss - before.pss >= 56 << 20


def test_pss_waits_for_the_cpu_budget_and_says_so(jobtree, monkeypatch):
    from torchdoctor.sampling import job as job_module

    tree = jobtree()
    child = tree.fork()
    monkeypatch.setattr(job_module, "_SLOW_BURST_S", 0.0)  # no budget to start with
    job = JobReader(tree.pid, slow_budget=1e-9)
    s = by_pid(job.read()[0])[child]
    assert s.pss is None and s.uss is None  # unknown, not zero
    assert "slower tier" in s.unavailable["pss"]
    assert s.rss > 0  # the fast tier does not wait


def test_fork_and_spawn_children_of_a_trainer_are_workers(jobtree):
    tree = jobtree()
    forked, spawned = tree.fork(), tree.fork("spawn")
    job = JobReader(tree.pid)
    samples, new, _ = job.read()
    roles = {s.pid: s.role for s in samples}
    assert roles[tree.pid] == "trainer"
    assert roles[forked] == "dataloader-worker"
    assert roles[spawned] == "dataloader-worker"
    # spawn starts multiprocessing's resource tracker: a helper, not a worker.
    others = [s for s in samples if s.pid not in (tree.pid, forked, spawned)]
    assert others and all(s.role == "other" for s in others)
    assert {i.pid: i.role for i in new} == roles


def test_forkserver_children_are_workers_and_the_server_a_helper(jobtree):
    tree = jobtree()
    worker = tree.fork("forkserver")
    job = JobReader(tree.pid)
    samples = by_pid(job.read()[0])
    server = samples[samples[worker].ppid]
    assert server.ppid == tree.pid
    assert server.role == "other"
    assert samples[worker].role == "dataloader-worker"
    assert samples[tree.pid].role == "trainer"


def test_figures_agree_with_psutil(jobtree):
    import psutil

    tree = jobtree()
    ours = {tree.pid, tree.fork(), tree.fork("spawn")}  # not the resource tracker: it may
    job = JobReader(tree.pid)  # still be starting, its memory moving between the reads
    job.read()
    samples = [s for s in job.read()[0] if s.pid in ours]
    assert len(samples) == 3
    for s in samples:
        p = psutil.Process(s.pid)
        with p.oneshot():
            assert s.create_time == pytest.approx(p.create_time(), abs=0.01)
            assert s.ppid == p.ppid() and s.threads == p.num_threads()
            assert s.name == p.name()
            times = p.cpu_times()
            assert s.cpu_user_s == pytest.approx(times.user, abs=0.02)
            assert s.cpu_system_s == pytest.approx(times.system, abs=0.02)
            # Idle processes, but the kernel's RSS counters are per-CPU approximations (and
            # a few pages move as a process settles): same figure, not the same byte.
            assert s.rss == pytest.approx(p.memory_info().rss, rel=0.05)
            assert s.swap == p.memory_full_info().swap


def test_real_torch_dataloader_workers(jobtree):
    tree = jobtree()
    workers = [int(p) for p in tree.ask("loader").split()]
    assert len(workers) == 2
    job = JobReader(tree.pid)
    samples = by_pid(job.read()[0])
    assert samples[tree.pid].role == "trainer"
    for w in workers:
        assert samples[w].role == "dataloader-worker"
        assert samples[w].ppid == tree.pid


def test_a_child_that_execs_is_described_again(jobtree):
    tree = jobtree()
    child = int(tree.ask("preexec"))
    job = JobReader(tree.pid, slow_refresh_s=0.0, slow_budget=None)
    _, new, _ = job.read()
    before = {i.pid: i for i in new}[child]
    # Between fork and exec it runs its parent's program: a fork worker by every sign.
    assert before.role == "dataloader-worker"
    assert tree.ask("exec", child) == "execd"
    samples, new, ended = job.read()
    assert ended == []
    after = {i.pid: i for i in new}[child]
    assert (after.pid, after.create_time) == (before.pid, before.create_time)
    assert after.cmdline[1] == "-c" and "signal.pause()" in after.cmdline[2]
    assert after.role == "other" and by_pid(samples)[child].role == "other"
    assert job.read()[1] == []  # described once per exec, not at every read


def test_renamed_process_with_parentheses_in_its_name(jobtree):
    tree = jobtree()
    child = tree.fork()
    assert tree.ask("comm", child, "we)(ird)") == "done"
    job = JobReader(tree.pid)
    s = by_pid(job.read()[0])[child]
    assert s.name == "we)(ird)"
    assert s.ppid == tree.pid and s.threads >= 1


def test_launcher_shell_with_ranked_trainers(tmp_path):
    # A hand-rolled distributed launch: a shell starts two Python ranks with RANK set.
    script = tmp_path / "rank.py"
    script.write_text(
        # One write(2) per rank, so the two lines cannot interleave on the shared pipe.
        "import os, sys\nos.write(1, b'ready ' + os.environ['RANK'].encode() + b'\\n')\n"
        "sys.stdin.read()\n"
    )
    # A non-interactive shell gives background commands /dev/null for stdin; hand the ranks
    # the test's pipe explicitly so they stay alive until the test closes it.
    shell = (
        "exec 3<&0; "
        f"RANK=0 LOCAL_RANK=0 {sys.executable} {script} <&3 & "
        f"RANK=1 LOCAL_RANK=1 {sys.executable} {script} <&3 & "
        "wait"
    )
    proc = subprocess.Popen(
        ["/bin/sh", "-c", shell], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        # Each rank says so once it runs the script: past exec, with its final cmdline.
        ready = {proc.stdout.readline().split()[1] for _ in range(2)}
        assert ready == {"0", "1"}
        job = JobReader(proc.pid)
        samples, new, _ = job.read()
        infos = {i.pid: i for i in new}
        ranks = {s.rank: s for s in samples if s.role == "trainer"}
        assert set(ranks) == {0, 1}
        assert by_pid(samples)[proc.pid].role == "launcher"
        assert all(s.ppid == proc.pid for s in ranks.values())
        for rank, s in ranks.items():
            assert infos[s.pid].local_rank == rank
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()


def test_torchrun_agent_is_the_launcher_and_each_worker_a_ranked_trainer(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            # One write(2): two ranks share the pipe, and print() may split a line.
            os.write(1, f"ready {os.environ['RANK']}\\n".encode())
            sys.stdin.read()
            """
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--monitor-interval=0.1",
        str(script),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        ready = set()
        while len(ready) < 2:
            line = proc.stdout.readline()
            assert line, "torchrun ended before its workers were ready"
            if line.startswith("ready "):
                ready.add(line.split()[1])
        assert ready == {"0", "1"}
        job = JobReader(proc.pid)
        samples, new, _ = job.read()
        seen = [(s.pid, s.ppid, s.role, s.rank, s.name) for s in samples]
        assert by_pid(samples)[proc.pid].role == "launcher", seen
        trainers = [s for s in samples if s.role == "trainer"]
        assert sorted(s.rank for s in trainers) == [0, 1], seen
        infos = {i.pid: i for i in new}
        assert sorted(infos[s.pid].local_rank for s in trainers) == [0, 1]
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        proc.stdout.close()


def test_root_excluded_but_its_tree_followed(jobtree):
    tree = jobtree()
    child = tree.fork()
    job = JobReader(tree.pid, include_root=False)
    samples, new, _ = job.read()
    assert set(by_pid(samples)) == {child}
    assert {i.pid for i in new} == {child}
    assert job.pids == {child}
    assert job.root_alive()


def test_root_exit_is_seen(jobtree):
    tree = jobtree()
    job = JobReader(tree.pid)
    job.read()
    assert job.root_alive()
    tree.close()  # the root exits and is reaped by the test
    assert not job.root_alive()
    samples, _, ended = job.read()
    assert samples == [] and ended == [tree.pid]


def test_missing_root_reads_empty():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    job = JobReader(proc.pid)
    assert not job.root_alive()
    assert job.read() == ([], [], [])


def test_descriptor_of_an_exited_process_fails_so_a_reused_pid_cannot_feed_it():
    # JobReader re-reads each process through descriptors opened once; this is what makes
    # PID reuse harmless: the old descriptor refuses to read whoever gets the PID next.
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    fd = procfs.open_ro(f"/proc/{proc.pid}/stat")
    try:
        assert procfs.parse_pid_stat(procfs.pread_single(fd)).ppid == os.getpid()
        proc.stdin.close()
        proc.wait()
        with pytest.raises(ProcessLookupError):
            procfs.pread_single(fd)
    finally:
        os.close(fd)


def _can_steer_pids() -> bool:
    return os.access("/proc/sys/kernel/ns_last_pid", os.W_OK)


@engine("root", None if _can_steer_pids() else "steering PID allocation needs CAP_SYS_ADMIN")
def test_reused_pid_is_a_new_process(jobtree):
    tree = jobtree()
    old = tree.fork()
    job = JobReader(tree.pid)
    job.read()
    old_create = by_pid(job.read()[0])[old].create_time
    assert tree.ask("exit", old) == "gone"
    for _ in range(50):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(old - 1))
        new_pid = tree.fork()
        if new_pid == old:
            break
        assert tree.ask("exit", new_pid) == "gone"
    else:
        pytest.fail("could not get the PID handed out again")
    samples, new, ended = job.read()
    assert ended == [old]
    assert [i.pid for i in new] == [old]
    s = by_pid(samples)[old]
    assert s.cpu_percent is None  # no rate computed against the previous owner of the PID
    # create_time has clock-tick resolution (10 ms): a fast machine can hand the PID out again
    # within the same tick, so it cannot be the only thing that tells the two apart.
    assert s.create_time >= old_create


def test_a_model_process_sharing_its_cpu_is_seen_waiting_for_it():
    # A trainer pinned to one CPU beside a spinning neighbour pinned to the same CPU gets
    # about half of it and waits on the run queue the other half (/proc/<pid>/schedstat):
    # the measure compare uses to tell a job starved of CPU from one that sleeps.
    spin = [sys.executable, "-c", "while True: pass"]
    trainer = subprocess.Popen(spin)
    neighbour = subprocess.Popen(spin)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        cpu = min(os.sched_getaffinity(0))
        for pid in (trainer.pid, neighbour.pid):
            os.sched_setaffinity(pid, {cpu})
        job, quiet = JobReader(trainer.pid), JobReader(sleeper.pid)
        deadline = time.monotonic() + 120
        # both running Python (caught between fork and exec they are not trainers yet)
        while {job.read()[0][0].role, quiet.read()[0][0].role} != {"trainer"}:
            assert time.monotonic() < deadline, "the processes never ran Python"
            time.sleep(0.05)
        (before,), (rested,) = job.read()[0], quiet.read()[0]
        assert before.run_delay_s is not None and rested.run_delay_s is not None
        # until the trainer has run 0.3 s of CPU, however long the machine takes to give it
        # (polled: there is no event for CPU time; the pause keeps this test off the CPUs)
        deadline = time.monotonic() + 120
        while True:
            (after,) = job.read()[0]
            if after.cpu_user_s + after.cpu_system_s - before.cpu_user_s >= 0.3:
                break
            assert time.monotonic() < deadline, "the trainer got no CPU in 120 s"
            time.sleep(0.05)
        ran = after.cpu_user_s + after.cpu_system_s - before.cpu_user_s - before.cpu_system_s
        waited = after.run_delay_s - before.run_delay_s
        assert waited >= 0.3 * ran, (waited, ran)
        (later,) = quiet.read()[0]
        assert later.run_delay_s - rested.run_delay_s < 0.05
    finally:
        for p in (trainer, neighbour, sleeper):
            p.kill()
            p.wait()


def test_a_kernel_without_schedstat_leaves_the_wait_unmeasured_and_says_why(monkeypatch):
    calls = []

    def no_schedstat(data: bytes) -> float:
        calls.append(data)
        raise ValueError("schedstat b''")

    monkeypatch.setattr(procfs, "parse_schedstat", no_schedstat)
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        job = JobReader(trainer.pid)
        # until it runs Python (caught between fork and exec it is not a trainer yet)
        deadline = time.monotonic() + 120
        while job.read()[0][0].role != "trainer":
            assert time.monotonic() < deadline, "the trainer never ran Python"
            time.sleep(0.05)
        for _ in range(3):
            (sample,) = job.read()[0]
            assert sample.role == "trainer" and sample.run_delay_s is None
            assert "schedstat" in sample.unavailable["run_delay_s"]
        assert len(calls) == 1  # not read again at every sample
    finally:
        trainer.kill()
        trainer.wait()
