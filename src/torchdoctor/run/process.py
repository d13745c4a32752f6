"""Starting the user's command and waiting for it, with signals passed through faithfully.

The command runs without a shell, with our stdin/stdout/stderr, in our process group (so it
stays in the terminal's foreground, can read the terminal, and Ctrl-Z, `fg` and `bg` work on
it as on any command). A signal sent to that whole group reaches the command by itself:
Ctrl-C at the terminal (si_code SI_KERNEL), and `kill -- -PGID`, timeout(1) (which signals its
child, then its group), systemd's KillMode=control-group and Slurm (which signal every process
of the cgroup). Forwarding such a signal again would deliver it twice, and a job that
checkpoints on SIGTERM and quits at a second one would be cut short. Only a signal sent to
torchdoctor alone must be passed on.

Who a kill(2) was aimed at is not in its siginfo, and the command's own pending set cannot
tell either (a job with a handler takes the signal at once). So a *witness* shares our group
and cgroup (:class:`GroupWitness`): an idle process that keeps the forwarded signals blocked,
so one sent to it stays pending, visible in its /proc/PID/status. A signal that reached the
witness too was sent to the group (or the cgroup) and already reached the command; one that did
not was sent to us alone and is forwarded. Putting the command in a process group of its own
instead would break terminal job control and reading the terminal (or need tcsetpgrp and
relaying every stop and continue), would still double the signals systemd and Slurm send to
every process of the cgroup, and would let `timeout -k`'s final KILL to the group miss the
command.

A command's whole tree is stopped by :func:`stop_tree` (tune's trials, queued jobs, bench
scaling's trials): TERM, then KILL for what is left after a grace period.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable

from torchdoctor.errors import UserError
from torchdoctor.sampling import procfs

FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
_WAITED = {*FORWARDED, signal.SIGCHLD}
_SI_KERNEL = 0x80  # si_code of signals the kernel raises itself, e.g. the tty's Ctrl-C
# How long a signal sent to us may take to reach the witness as well: a group kill reaches
# every member in one kill(2), but timeout(1) signals us first and its group right after, and
# systemd and Slurm signal the processes of a cgroup one kill(2) at a time. A signal sent to
# us alone is forwarded this much later.
WITNESS_GRACE_S = 0.1


def resolve_command(
    argv: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None
) -> str:
    """The executable ``argv[0]`` names, as a shell would find it; 127/126 like a shell.

    ``env`` (its PATH) and ``cwd`` say where the command will run (default: here, now)."""
    if not argv:
        raise UserError(
            "no command given: put it after `--`, e.g. `torchdoctor run -- python train.py`"
        )
    name = argv[0]
    if not name.strip():
        # `run -- ""` said "command not found:  (is it installed...)", naming nothing
        raise UserError(
            f"empty command ({name!r}): the first word after `--` is the program to run, "
            "e.g. `torchdoctor run -- python train.py`",
            exit_code=127,
        )
    if "/" in name:
        where = os.path.join(cwd, name) if cwd is not None else name
        if not os.path.exists(where):
            raise UserError(f"command not found: {name}", exit_code=127)
        if os.path.isdir(where):
            # a shell's status for a folder; "check its permissions" pointed the wrong way
            raise UserError(f"{name} is a folder, not a command", exit_code=126)
        if not os.access(where, os.X_OK):
            raise UserError(
                f"command is not executable: {name} (check its permissions)", exit_code=126
            )
        return name
    search = os.get_exec_path(env)
    found = shutil.which(name, path=os.pathsep.join(search))
    if found is None:
        if any(os.path.isfile(os.path.join(d, name)) for d in search):
            raise UserError(
                f"command is not executable: {name} (check its permissions)", exit_code=126
            )
        raise UserError(f"command not found: {name} (is it installed and on PATH?)", exit_code=127)
    return found


def exit_status(wait_status: int) -> int:
    """The status a shell reports: the exit code, or 128+N when signal N ended the command."""
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


def hold_signals() -> set[int]:
    """Block the forwarded signals in this thread and every thread started after; call first.

    They then stay pending until :meth:`ChildProcess.wait` or :func:`wait_for_signal` takes
    them; a thread started earlier could otherwise swallow a Ctrl-C.
    """
    return signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)


def release_signals(previous: set[int]) -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def wait_for_signal(timeout_s: float) -> int | None:
    """The next held INT/TERM/HUP... within ``timeout_s``, or None (SIGCHLD is skipped)."""
    info = signal.sigtimedwait(_WAITED, timeout_s)
    if info is None or info.si_signo == signal.SIGCHLD:
        return None
    return info.si_signo


def spawn(
    path: str,
    argv: list[str],
    env: dict[str, str],
    *,
    log: os.PathLike[str] | str | None = None,
    new_group: bool = False,
) -> int:
    """Start ``argv`` without a shell, with its signals unblocked and default dispositions;
    return its PID. By default it shares our stdin/stdout/stderr and process group; with
    ``log`` it gets no stdin and writes stdout+stderr to that file, with ``new_group`` it leads
    a process group of its own (so everything it starts can be signalled at once).

    A command that cannot be started is a :class:`UserError` with a shell's status: 126 when
    it exists but cannot be executed, 127 otherwise.
    """
    actions = []
    if log is not None:
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, os.fspath(log), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ]
    extra = {"setpgroup": 0} if new_group else {}
    try:
        return os.posix_spawn(
            path,
            argv,
            env,
            file_actions=actions,
            setsigmask=(),
            # Python ignores SIGPIPE and SIGXFSZ; an exec'd program must not inherit that.
            setsigdef=(*FORWARDED, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD),
            **extra,
        )
    except OSError as exc:
        code = 126 if exc.errno in (errno.EACCES, errno.ENOEXEC) else 127
        raise UserError(f"cannot start {argv[0]}: {exc.strerror}", exit_code=code) from None


# The witness: an idle Python (no site, no user settings) that ends when we do (its stdin is a
# pipe whose only writer is us); it never unblocks the signals it was started with.
_WITNESS_CODE = "import os; os.read(0, 1)"


class GroupWitness:
    """A process in our process group and cgroup that keeps :data:`FORWARDED` blocked: a
    signal sent to it stays pending, so :meth:`saw` tells a signal sent to the whole group
    (or cgroup) from one sent to torchdoctor alone (see the module's docstring)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self._stdin: int | None = None
        self._start()

    def _start(self) -> None:
        read_end, self._stdin = os.pipe()  # both close on exec: the command inherits neither
        try:
            self.pid = os.posix_spawn(
                sys.executable,
                [sys.executable, "-I", "-S", "-c", _WITNESS_CODE],
                {},
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, read_end, 0),
                    (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                    (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
                ],
                setsigmask=FORWARDED,
                setsigdef=(*FORWARDED, signal.SIGPIPE),
            )
        finally:
            os.close(read_end)

    def pending(self) -> set[int]:
        """The signals waiting in the witness now (empty when it cannot be read)."""
        try:
            with open(f"/proc/{self.pid}/status", encoding="utf-8", errors="replace") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
            bits = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
        except (OSError, KeyError, ValueError):
            return set()
        return {n for n in range(1, 65) if bits >> (n - 1) & 1}

    def saw(self, signum: int, grace_s: float = WITNESS_GRACE_S) -> bool:
        """Whether ``signum``, just received by us, reached the witness too (within
        ``grace_s``). A witness that saw it is replaced: its pending signal cannot be taken
        back, and the next one must be told apart again."""
        deadline = time.monotonic() + grace_s
        while signum not in self.pending():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)  # no event to wait for: another process's pending set
        self.close()
        with contextlib.suppress(OSError):
            self._start()
        return True

    def close(self) -> None:
        if self._stdin is not None:
            os.close(self._stdin)
            self._stdin = None
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self.pid = None


class ChildProcess:
    """A started command (see :func:`spawn` for ``log`` and ``new_group``); ``returncode`` is
    its shell status once it has been reaped.

    For the user's own command, call :func:`hold_signals` before creating it.
    """

    def __init__(
        self,
        path: str,
        argv: list[str],
        env: dict[str, str],
        *,
        log: os.PathLike[str] | str | None = None,
        new_group: bool = False,
    ) -> None:
        # Sharing our group, the command gets group signals by itself: the witness tells them
        # apart. Without one (it could not start) every kill(2) is forwarded, as before.
        self._witness: GroupWitness | None = None
        self._group_copy_due: dict[int, float] = {}  # signal -> until when
        if not new_group:
            with contextlib.suppress(OSError):
                self._witness = GroupWitness()
        try:
            self.pid = spawn(path, argv, env, log=log, new_group=new_group)
        except BaseException:
            self._close_witness()
            raise
        self.returncode: int | None = None

    def wait(self, on_signal: Callable[[int, bool], None] | None = None) -> int:
        """Wait for the command; forward signals sent to us alone; return its shell status.

        ``on_signal(signum, forwarded)`` is told about each INT/TERM/HUP that arrived.
        """
        try:
            while self.returncode is None:
                info = signal.sigtimedwait(_WAITED, 0.5)
                if info is not None and info.si_signo != signal.SIGCHLD:
                    forwarded = self._sent_to_us_alone(info)
                    if forwarded:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(self.pid, info.si_signo)
                    if on_signal is not None:
                        on_signal(info.si_signo, forwarded)
                self.poll()
        finally:
            self._close_witness()
        return self.returncode

    def _sent_to_us_alone(self, info: signal.struct_siginfo) -> bool:
        """Whether the signal reached us and not the command: then it is forwarded."""
        if info.si_code == _SI_KERNEL:  # the terminal's: sent to its whole foreground group
            return False
        if self._witness is None:
            return True
        signum = info.si_signo
        if time.monotonic() < self._group_copy_due.pop(signum, 0.0):
            return False  # our own copy of a group signal the witness already showed
        if not self._witness.saw(signum):
            return True
        # The group signal the witness saw reached us too. Unless it merged with the one just
        # taken (a signal pending twice is delivered once), our copy is still to come: e.g.
        # timeout(1) signals us alone, then its group. That copy is not forwarded either.
        self._group_copy_due[signum] = time.monotonic() + WITNESS_GRACE_S
        # A command that left our group (setsid, setpgid) missed a group signal: forwarded.
        # (One sent to every process of the cgroup did reach it, but a lost TERM harms more.)
        return _group_of(self.pid) != os.getpgrp()

    def _close_witness(self) -> None:
        if self._witness is not None:
            self._witness.close()
            self._witness = None

    def poll(self) -> int | None:
        """Reap the command if it has ended; its shell status, or None while it runs."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = -1
                return self.returncode
            if pid == self.pid:
                self.returncode = exit_status(status)
        return self.returncode


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


# -- stopping a whole tree ---------------------------------------------------------------------

KILL_WAIT_S = 3.0  # after KILL: how long to wait for the kernel to take the processes down
_POLL_S = 0.05


def live_stat(pid: int):
    """The process's /proc stat, or None when it is gone or a zombie (awaiting its reaper)."""
    try:
        stat = procfs.parse_pid_stat(procfs.read_path(f"/proc/{pid}/stat"))
    except (OSError, ValueError, IndexError):
        return None
    return None if stat.state in ("Z", "X") else stat


def group_members(pgid: int) -> list[int]:
    """PIDs of the live processes in process group ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) == pgid and live_stat(int(entry)) is not None:
                    out.append(int(entry))
    return out


def own_children() -> list[int]:
    """Our live child processes (for a child subreaper: the orphans of its job too)."""
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = live_stat(int(entry))
            if stat is not None and stat.ppid == me:
                out.append(int(entry))
    return out


def _descendants(pid: int) -> set[int]:
    import psutil

    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


class ProcessTree:
    """Everything a command started: the process group it leads (``root``), the processes it
    started that left the group (its descendants), and with ``orphans`` (a child subreaper)
    our own children, which its orphans were re-parented to."""

    def __init__(self, root: int, *, orphans: bool = False) -> None:
        self.root = root
        self.pgid = root
        self.orphans = orphans

    def members(self) -> set[int]:
        """The live (not zombie) processes of the tree now."""
        found = set(group_members(self.pgid)) | _descendants(self.root)
        if self.orphans:
            found |= set(own_children())
        return {pid for pid in found if live_stat(pid) is not None}

    def signal(self, signum: int, pids: set[int] | None = None) -> None:
        """Send ``signum`` to the group and to ``pids`` (default: the members now)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signum)
        for pid in self.members() if pids is None else pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)


def stop_tree(
    tree: ProcessTree, grace_s: float, *, cancelled: threading.Event | None = None
) -> None:
    """TERM to the whole tree, KILL to what is left after ``grace_s``; returns once nothing of
    it runs (or KILL's own wait ran out), or as soon as ``cancelled`` is set.

    The members are listed before TERM: a process whose parent dies is re-parented and would
    no longer be found among the root's descendants."""
    cancelled = cancelled or threading.Event()
    known = tree.members()
    tree.signal(signal.SIGTERM, known)
    if _wait_gone(tree, known, grace_s, cancelled) or cancelled.is_set():
        return
    known |= tree.members()
    tree.signal(signal.SIGKILL, known)
    _wait_gone(tree, known, KILL_WAIT_S, cancelled)


def _wait_gone(
    tree: ProcessTree, known: set[int], timeout_s: float, cancelled: threading.Event
) -> bool:
    end = time.monotonic() + timeout_s
    while True:
        if not any(live_stat(pid) is not None for pid in known) and not tree.members():
            return True
        if time.monotonic() >= end or cancelled.wait(_POLL_S):
            return False


class TreeStopper:
    """:func:`stop_tree` in the background: :meth:`start` returns at once (the caller goes on
    waiting for its child), :meth:`cancel` stops it once the tree has ended by itself."""

    def __init__(self, tree: ProcessTree, grace_s: float) -> None:
        self.tree = tree
        self.grace_s = grace_s  # may be changed until start()
        self.started = False
        self._cancelled = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, delay_s: float = 0.0) -> None:
        """Start stopping the tree, after ``delay_s`` (a time limit) unless cancelled first."""
        if self.started:
            return
        self.started = True
        self._thread = threading.Thread(
            target=self._run, args=(delay_s,), name="torchdoctor-stop-tree", daemon=True
        )
        self._thread.start()

    def _run(self, delay_s: float) -> None:
        if delay_s > 0 and self._cancelled.wait(delay_s):
            return
        stop_tree(self.tree, self.grace_s, cancelled=self._cancelled)

    def cancel(self) -> None:
        self._cancelled.set()
