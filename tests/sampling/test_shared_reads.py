"""What the readers of one `top` refresh share: one look at /proc (procfs.ProcTable) and one
PSS budget (job.SlowBudget), without one job's reader taking another's processes."""

from __future__ import annotations

from tests.helpers.fakeproc import fake_proc, fake_stat

from torchdoctor.sampling import procfs
from torchdoctor.sampling.job import JobReader, SlowBudget


def by_pid(samples):
    return {s.pid: s for s in samples}


def test_fake_stat_parses_as_the_kernel_writes_it():
    st = procfs.parse_pid_stat(fake_stat(7, ppid=3, starttime=4242).encode())
    assert (st.comm, st.state, st.ppid, st.starttime, st.threads) == ("python", "S", 3, 4242, 1)
    assert (st.utime, st.stime, st.rss_pages) == (5, 3, 100)


def test_a_table_reads_each_file_once_and_a_new_table_reads_again(tmp_path):
    proc = fake_proc(tmp_path / "proc", 41, {40: fake_stat(40, starttime=100)})
    table = procfs.ProcTable(str(proc))
    assert table.last_pid == 41
    assert table.pids == {40}
    assert table.stat(40).starttime == 100
    assert table.stat(39) is None  # not there: no stat, and none later in this table
    # The PID goes to another process: this table still says what it read...
    fake_proc(proc, 43, {40: fake_stat(40, starttime=900), 42: fake_stat(42)})
    assert table.stat(40).starttime == 100
    assert table.pids == {40} and table.last_pid == 41
    # ... the next refresh's table reads it again.
    again = procfs.ProcTable(str(proc))
    assert again.stat(40).starttime == 900
    assert again.pids == {40, 42} and again.last_pid == 43


def test_pids_handed_out_since_the_last_one_are_those_in_between_even_across_pid_max():
    pids = [5, 100, 200, 300, 32000]
    assert procfs.handed_out(pids, 100, 300) == [200, 300]
    assert procfs.handed_out(pids, 300, 300) == []
    assert procfs.handed_out(pids, 300, 100) == [5, 100, 32000]  # wrapped at pid_max


def test_readers_sharing_a_table_each_keep_their_own_tree(jobtree):
    one, two = jobtree(), jobtree()
    a = one.fork()
    readers = {one.pid: JobReader(one.pid), two.pid: JobReader(two.pid)}

    def refresh():
        table = procfs.ProcTable()  # one per refresh, as top takes it
        return {root: reader.read(table) for root, reader in readers.items()}

    seen = refresh()
    assert set(by_pid(seen[one.pid][0])) == {one.pid, a}
    assert set(by_pid(seen[two.pid][0])) == {two.pid}
    # A new process appears in its own job at the next refresh, and in no other.
    b = two.fork()
    seen = refresh()
    assert set(by_pid(seen[two.pid][0])) == {two.pid, b}
    assert [i.pid for i in seen[two.pid][1]] == [b]
    assert set(by_pid(seen[one.pid][0])) == {one.pid, a}
    # One that ends leaves its job at the next refresh.
    assert one.ask("exit", a) == "gone"
    seen = refresh()
    assert set(by_pid(seen[one.pid][0])) == {one.pid}
    assert seen[one.pid][2] == [a]
    assert set(by_pid(seen[two.pid][0])) == {two.pid, b}


def test_readers_sharing_a_pss_pool_stop_when_it_is_spent(jobtree):
    one, two = jobtree(), jobtree()
    one.fork()
    pool = SlowBudget(1e-9, burst=0.0)  # nothing to spend, nothing earned to speak of
    readers = [JobReader(t.pid, slow_pool=pool) for t in (one, two)]
    assert all(r.slow_waiting_since() == -1.0 for r in readers)  # never read: first in line
    for reader in readers:
        for s in reader.read()[0]:
            assert s.pss is None and "slower tier" in s.unavailable["pss"]
    # The pool lifted (as `run` lifts it near a memory limit): both read, from the one pool.
    readers[0].slow_budget = None
    assert pool.share is None and readers[1].slow_budget is None
    for reader in readers:
        assert all(s.pss is not None for s in reader.read()[0])
        assert reader.slow_waiting_since() > 0  # next due, after its refresh period


def test_a_pools_start_allowance_is_spent_once_and_its_refill_stops_at_the_burst():
    pool = SlowBudget(0.5, burst=0.1, tokens=2.0)
    pool.spend(0.5)
    pool.refill(pool._mono + 1.0)  # above the burst: nothing earned is added, nothing lost
    assert pool.tokens == 1.5 and pool.left()
    pool.trim()
    assert pool.tokens == 0.1
    pool.spend(0.3)
    assert not pool.left()
    pool.refill(pool._mono + 0.2)
    assert abs(pool.tokens - -0.1) < 1e-9 and not pool.left()
    pool.refill(pool._mono + 10.0)
    assert pool.tokens == 0.1  # at most the burst
