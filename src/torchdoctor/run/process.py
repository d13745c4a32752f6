"""Starting the user's command and waiting for it, with signals passed through faithfully.

The command runs without a shell, with our stdin/stdout/stderr, in our process group (so it
stays in the terminal's foreground and can read the terminal). Ctrl-C typed at the terminal
already reaches every process of the group, the command included; forwarding it again would
deliver it twice (a Python job would see a second KeyboardInterrupt in its cleanup). So we
wait for signals synchronously with ``sigtimedwait``, which tells a terminal's signal
(si_code SI_KERNEL) from one sent with kill(2) to us alone (SI_USER/SI_QUEUE), and forward
only the latter.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
from collections.abc import Callable

from torchdoctor.errors import UserError

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
    if "/" in name:
        where = os.path.join(cwd, name) if cwd is not None else name
        if not os.path.exists(where):
            raise UserError(f"command not found: {name}", exit_code=127)
        if os.path.isdir(where) or not os.access(where, os.X_OK):
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
        self.pid = spawn(path, argv, env, log=log, new_group=new_group)
        self.returncode: int | None = None

    def wait(self, on_signal: Callable[[int, bool], None] | None = None) -> int:
        """Wait for the command; forward signals sent to us alone; return its shell status.

        ``on_signal(signum, forwarded)`` is told about each INT/TERM/HUP that arrived.
        """
        while self.returncode is None:
            info = signal.sigtimedwait(_WAITED, 0.5)
            if info is not None and info.si_signo != signal.SIGCHLD:
                forwarded = info.si_code != _SI_KERNEL
                if forwarded:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid, info.si_signo)
                if on_signal is not None:
                    on_signal(info.si_signo, forwarded)
            self.poll()
        return self.returncode

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
