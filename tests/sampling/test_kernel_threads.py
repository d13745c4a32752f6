"""Kernel threads are told from processes by their stat flags (attach refuses them: probe
minor 20, `attach 2` recorded kthreadd as a "job")."""

from __future__ import annotations

import os

from torchdoctor.sampling.procfs import is_kernel_thread, stat_is_kernel_thread

# kthreadd's stat line as Linux 6.x writes it (flags 2129984 = 0x208040: PF_KTHREAD set), and a
# user process whose command name holds ") " and spaces (the name is parsed from the last ")").
KTHREADD = b"2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 25 0 0 1844 0 0\n"
ODD_NAME = b"4242 (a) b c) S 1 4242 4242 0 -1 4194560 120 0 0 0 3 1 0 0 20 0 1 0 9000 0 0\n"


def test_the_flags_say_kernel_thread():
    assert stat_is_kernel_thread(KTHREADD)
    assert not stat_is_kernel_thread(ODD_NAME)
    assert not is_kernel_thread(os.getpid())


def test_attach_refuses_a_kernel_thread_in_one_line(monkeypatch, tmp_path, capsys):
    """The refusal as a user sees it, for this test's own PID taken for a kernel thread (a real
    one is not visible in a container's PID namespace, and a test reads no machine state)."""
    import pytest

    from torchdoctor.cli import main
    from torchdoctor.sampling import procfs

    monkeypatch.setattr(procfs, "is_kernel_thread", lambda pid: pid == os.getpid())
    out = tmp_path / "a.sqlite"
    with pytest.raises(SystemExit) as done:
        main(["attach", "--quiet", "--out", str(out), str(os.getpid())])
    err = capsys.readouterr().err
    assert done.value.code == 2, err
    assert err.count("\n") == 1 and "is a kernel thread, not a job" in err
    assert not out.exists()  # refused before anything is claimed
