"""The machine-wide queue: one scheduler (root) for every user of a shared machine.

It listens on ``queue.sock`` in the system state folder (``/var/lib/torchdoctor``, or
``$TORCHDOCTOR_SYSTEM_DIR``). Anyone may connect; who they are is the kernel's answer
(SO_PEERCRED), never a field of the request. Every request names a method of
:class:`torchdoctor.queue.client.Queue`, which the scheduler runs on its own state on behalf
of that user: ownership is checked there, and what another user's job shows is cut down to
its public part here (owner, name, state, resources, times). Each job runs as its submitter
(see :mod:`torchdoctor.queue.supervisor`).

Without a machine-wide scheduler installed, ``torchdoctor`` uses the user's own queue as before.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.queue.model import Job
from torchdoctor.queue.paths import QueuePaths, queue_paths
from torchdoctor.queue.protocol import request

SYSTEM_DIR_ENV = "TORCHDOCTOR_SYSTEM_DIR"
SYSTEM_DIR = "/var/lib/torchdoctor"
CONFIG_ENV = "TORCHDOCTOR_QUEUE_CONFIG"
CONFIG_FILE = "/etc/torchdoctor/queue.toml"
USER_MODE_NOTE = "queue-mode-noted"
BUSY_OUTSIDE = 0.9  # in the user's state folder once they have been told

# What a request may ask of the queue, and the only names the scheduler will call.
METHODS = frozenset(
    {
        "submit",
        "job",
        "own",
        "jobs",
        "cancel",
        "hold",
        "release",
        "set_priority",
        "restart",
        "clean",
        "pause",
        "resume",
        "paused",
        "last_finished",
    }
)
# Fields of a job that only its owner and root see.
PRIVATE_FIELDS = ("argv", "env", "cwd", "log", "recording")


def system_paths(env: Mapping[str, str] | None = None) -> QueuePaths:
    env = os.environ if env is None else env
    folder = Path(env.get(SYSTEM_DIR_ENV) or SYSTEM_DIR)
    return QueuePaths(folder, folder)


def make_system_paths(paths: QueuePaths) -> None:
    """The system folder: reachable by everyone (the socket is in it), writable by root only;
    the state file and the scheduler's log inside are root's alone."""
    paths.state_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    os.chmod(paths.state_dir, 0o755)
    for folder in (paths.jobs_dir,):
        folder.mkdir(exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)
    check_state_files(paths)


def check_state_files(paths: QueuePaths) -> None:
    """Refuse a state folder or file that someone else could have written: its jobs run as
    whoever they name, so a state that is not ours alone is not trusted."""
    me = os.getuid()
    for path in (paths.state_dir, paths.jobs_dir, paths.db):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(info.st_mode):
            raise UserError(f"{path} is a symbolic link; the machine-wide queue will not use it")
        if info.st_uid != me:
            raise UserError(
                f"{path} belongs to uid {info.st_uid}, not to the scheduler's user {me}; "
                "the machine-wide queue will not trust it"
            )
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UserError(
                f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"the machine-wide queue will not trust it: `chmod go-w {path}` if it is yours"
            )


# -- the admin's limits -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Limit:
    """At most this many at once for one user (None: no limit)."""

    gpus: int | None = None
    cpus: int | None = None


@dataclass(slots=True)
class QueueConfig:
    default: Limit = field(default_factory=Limit)
    users: dict[str, Limit] = field(default_factory=dict)
    path: str | None = None
    # A free CPU at least this busy (0-1) with processes the queue did not start is not
    # promised; None: off (a per-user queue, or `busy_outside = false`).
    busy_outside: float | None = BUSY_OUTSIDE

    def limit(self, user: str | None) -> Limit:
        return self.users.get(user or "", self.default)


def config_path() -> str:
    """Where the admin's limits are read from: ``$TORCHDOCTOR_QUEUE_CONFIG``, else
    ``/etc/torchdoctor/queue.toml``."""
    return os.environ.get(CONFIG_ENV) or CONFIG_FILE


def load_config(path: str | None = None) -> QueueConfig:
    """``/etc/torchdoctor/queue.toml`` (or ``$TORCHDOCTOR_QUEUE_CONFIG``)::

        [limits]              # every user
        gpus = 2
        cpus = 8
        [limits.users.alice]  # this one
        cpus = 16
        [cores]
        busy_outside = 0.9    # a free CPU this busy outside the queue is not promised; false: off

    No file: no limits, busy_outside 0.9."""
    from torchdoctor.config import read_toml

    path = path or config_path()
    # No file is no limits; any other failure (a folder, /dev/zero, bad TOML) is read_toml's
    # one line: a settings file read as every other one is (input_files).
    if not os.path.exists(path):
        return QueueConfig()
    data = read_toml(Path(path), "queue configuration")
    limits = data.get("limits", {})
    if not isinstance(limits, dict):
        raise UserError(f"{path}: [limits] must be a table")

    def one(table: Any, where: str) -> Limit:
        if not isinstance(table, dict):
            raise UserError(f"{path}: {where} must be a table")
        values = {}
        for key in ("gpus", "cpus"):
            value = table.get(key)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise UserError(f"{path}: {where}.{key} must be a whole number >= 0")
            values[key] = value
        return Limit(**values)

    users = limits.get("users", {})
    if not isinstance(users, dict):
        raise UserError(f"{path}: [limits.users] must be a table")
    cores = data.get("cores", {})
    busy = cores.get("busy_outside", BUSY_OUTSIDE) if isinstance(cores, dict) else None
    if busy is False:
        busy = None
    elif busy is True or not isinstance(busy, (int, float)) or not 0 < busy <= 1:
        raise UserError(f"{path}: cores.busy_outside must be a share in (0, 1] or false")
    return QueueConfig(
        busy_outside=None if busy is None else float(busy),
        default=one({k: v for k, v in limits.items() if k != "users"}, "limits"),
        users={name: one(t, f"limits.users.{name}") for name, t in users.items()},
        path=path,
    )


# -- one request, in the scheduler ----------------------------------------------------------


def serve_request(queue: Any, message: Any) -> dict[str, Any]:
    """Run ``message`` (``{"method": NAME, "args": [...], "kwargs": {...}}``) on ``queue`` (a
    :class:`Queue` acting for the peer); the answer, errors as one line."""
    from torchdoctor.queue.client import Request

    if not isinstance(message, dict):
        return {"ok": False, "error": "a request is one JSON object on one line"}
    method = message.get("method")
    if method is None and message.get("op") == "kick":
        return {"ok": True, "pid": os.getpid()}
    args, kwargs = message.get("args", []), message.get("kwargs", {})
    if method not in METHODS or not isinstance(args, list) or not isinstance(kwargs, dict):
        return {"ok": False, "error": f"unknown request {str(method)[:40]!r}"}
    try:
        if method == "submit":
            req = dict(args[0]) if args and isinstance(args[0], dict) else {}
            names = {f.name for f in dataclasses.fields(Request)}
            if set(req) - names:
                raise UserError(f"unknown request fields {sorted(set(req) - names)}")
            args = [Request(**req)]
        if method == "cancel":
            kwargs["wait"] = False  # the client waits; the scheduler keeps serving
        call = getattr(queue, method)
        result = call if method == "paused" else call(*args, **kwargs)
    except UserError as exc:
        return {"ok": False, "error": exc.message, "exit_code": exc.exit_code}
    except (TypeError, ValueError, KeyError) as exc:
        return {"ok": False, "error": f"malformed request: {exc}"}
    return {"ok": True, "result": _plain(result, queue.caller)}


def public_view(job: Job, caller: int) -> dict[str, Any]:
    """The job as ``caller`` may see it: all of it for its owner and root; otherwise who,
    what it asked and got, and when, but not its command, folder, environment or files."""
    data = dataclasses.asdict(job)
    if caller != 0 and job.uid != caller:
        for name in PRIVATE_FIELDS:
            data[name] = {} if name == "env" else ([] if name == "argv" else None)
    return data


def _plain(value: Any, caller: int) -> Any:
    if isinstance(value, Job):
        return {"job": public_view(value, caller)}
    if isinstance(value, list) and value and isinstance(value[0], Job):
        return {"jobs": [public_view(j, caller) for j in value]}
    return value


# -- the client side ----------------------------------------------------------------------


class SystemQueue:
    """The machine's queue seen from one user: the same methods as :class:`Queue`, each one
    request to the machine-wide scheduler."""

    system = True

    def __init__(self, paths: QueuePaths) -> None:
        self.paths = paths
        self.caller = os.getuid()

    def __enter__(self) -> SystemQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            answer = request(
                self.paths.socket, {"method": method, "args": args, "kwargs": kwargs}, 30.0
            )
        except (OSError, ValueError) as exc:
            raise UserError(
                f"the machine-wide queue ({self.paths.socket}) does not answer ({exc}); "
                "ask the machine's admin to start it (systemctl start torchdoctor-queue)"
            ) from None
        if not answer.get("ok"):
            raise UserError(str(answer.get("error")), exit_code=int(answer.get("exit_code", 1)))
        result = answer.get("result")
        if isinstance(result, dict) and "job" in result:
            return Job(**result["job"])
        if isinstance(result, dict) and "jobs" in result:
            return [Job(**j) for j in result["jobs"]]
        if method == "jobs" and result == []:
            return []
        return result

    def submit(self, req: Any, machine: Any = None) -> Job:
        from torchdoctor.run.process import resolve_command

        # Looked for here, as the user who will run it.
        resolve_command(req.argv, env=req.env, cwd=req.cwd)
        mine = queue_paths()
        payload = dataclasses.asdict(req)
        payload["log_dir"] = payload["log_dir"] or str(mine.jobs_dir / "logs")
        payload["recording_dir"] = payload["recording_dir"] or str(mine.jobs_dir / "recordings")
        return self.call("submit", payload)

    def wait(self, job_id: int, timeout_s: float | None = None) -> Job:
        from torchdoctor.queue.client import WAIT_POLL_S

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job.ended:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise UserError(f"job {job_id} is still {job.state} after {timeout_s:g} s")
            time.sleep(WAIT_POLL_S * 5)

    def cancel(self, job_id: int, grace_s: float = 10.0, wait: bool = True) -> Job:
        job = self.call("cancel", job_id, grace_s=grace_s)
        return self.wait(job_id, timeout_s=grace_s + 30.0) if wait else job

    @property
    def paused(self) -> str | None:
        return self.call("paused")

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in METHODS:
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)


def system_queue_installed(env: Mapping[str, str] | None = None) -> bool:
    """Whether this machine has a machine-wide queue: its socket exists (a stopped service
    leaves it, and then the queue does not answer). An empty ``$TORCHDOCTOR_SYSTEM_DIR`` says
    there is none, whatever the default folder holds."""
    env = os.environ if env is None else env
    return env.get(SYSTEM_DIR_ENV) != "" and system_paths(env).socket.exists()


def open_queue(say_mode: bool = False) -> Any:
    """The machine-wide queue where one is installed (its socket exists), else this user's own
    (with ``say_mode``, said once on stderr: the first time this user lists their queue)."""
    from torchdoctor.queue.client import Queue

    paths = system_paths()
    if system_queue_installed():
        return SystemQueue(paths)
    queue = Queue()
    note = queue.paths.state_dir / USER_MODE_NOTE
    if say_mode and not note.exists():
        print(
            f"torchdoctor: no machine-wide queue here ({paths.socket} is absent): this queue is "
            "yours alone and does not see other users' jobs",
            file=sys.stderr,
        )
        note.touch()
    return queue
