"""A shared machine for the tests: real users (made with useradd, removed after), the
machine-wide scheduler (`torchdoctor queue serve --system`, as root) in a private system
folder, and each user's `torchdoctor` commands run with that user's uid.

The users cannot execute this venv's interpreter (it lives under /root), so their commands run
in a fork of the test process that has become the user (setgroups, setgid, setuid) with every
module already imported: the scheduler sees their real uid on its socket, which is what is
under test. Their jobs run /usr/bin/python3 (stdlib only), as a user's job on a shared server
would run their own interpreter.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import fake_nvml
from tests.queue.conftest import HELPERS, kill_jobs_left
from torchdoctor.queue.store import QueueStore

SRC = Path(__file__).resolve().parents[2] / "src"
JOB = str(HELPERS / "shared_job.py")
SYSTEM_PYTHON = "/usr/bin/python3"
SECRET_VAR, SECRET_VALUE = "TDQ_TEST_TOKEN", "s3cr3t-token"


def need_root() -> None:
    why = None
    if os.getuid() != 0:
        why = "needs root: it makes real users with useradd and runs the machine-wide scheduler"
    elif shutil.which("useradd") is None:
        why = "needs useradd (Debian's passwd package)"
    elif not os.access(SYSTEM_PYTHON, os.X_OK):
        why = f"needs {SYSTEM_PYTHON} for the test users' jobs"
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but this test cannot run: {why}")
        pytest.skip(why)


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


@dataclass
class User:
    name: str
    uid: int
    gid: int
    home: Path


class SharedMachine:
    def __init__(self, base: Path, gpus: list[dict]) -> None:
        self.base = base
        self.system_dir = base / "system"
        self.config = base / "queue.toml"
        gpu_dir = base / "gpus"
        gpu_dir.mkdir(mode=0o777)
        os.chmod(gpu_dir, 0o777)  # every user's job writes its fake allocations here
        self.machine = str(gpu_dir / "fake-gpus.json")
        fake_nvml.write_machine(self.machine, gpus)
        for path in (self.machine, self.machine + ".lock"):
            Path(path).touch()
            os.chmod(path, 0o666)
        self.gates = base / "gates"
        self.gates.mkdir(mode=0o755)
        os.chmod(self.gates, 0o755)
        self.users: list[User] = []
        self.scheduler: subprocess.Popen | None = None
        self.pythonpath = str(SRC)
        # Every process of the machine, root's and the users', loads the fake libnvidia-ml
        # (the real nvidia-ml-py binding runs) reading this machine's GPUs.
        self.nvml_env = {k: v for k, v in fake_nvml.machine_env(self.machine, {}).items()}

    # -- users ------------------------------------------------------------------------------

    def add_user(self) -> User:
        name = f"tdq{uuid.uuid4().hex[:8]}"
        home = self.base / name
        subprocess.run(
            ["useradd", "--create-home", "--home-dir", str(home), "--shell", "/bin/sh", name],
            check=True,
            capture_output=True,
        )
        entry = pwd.getpwnam(name)
        os.chmod(home, 0o700)
        user = User(name, entry.pw_uid, entry.pw_gid, home)
        self.users.append(user)
        return user

    def user_env(self, user: User) -> dict[str, str]:
        return {
            "HOME": str(user.home),
            "USER": user.name,
            "LOGNAME": user.name,
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "PYTHONPATH": self.pythonpath,
            "TORCHDOCTOR_SYSTEM_DIR": str(self.system_dir),
            **self.nvml_env,
            "LANG": "C.UTF-8",
            SECRET_VAR: f"{SECRET_VALUE}-{user.name}",  # must never reach a metric
        }

    def as_user(self, user: User, *args: str, timeout: float = 120.0) -> Done:
        """`torchdoctor ARGS` run by ``user``: a fork of this process that became them."""
        return self.as_user_call(user, _cli(args), timeout)

    def as_user_call(self, user: User, action, timeout: float = 120.0) -> Done:
        """``action()`` in a fork become ``user``; its exit code and what it printed."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.close(out_r)
                os.close(err_r)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
                sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
                os.setgroups(os.getgrouplist(user.name, user.gid))
                os.setgid(user.gid)
                os.setuid(user.uid)
                os.environ.clear()
                os.environ.update(self.user_env(user))
                os.chdir(user.home)
                code = action() or 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        os.close(out_w)
        os.close(err_w)
        chunks = {out_r: [], err_r: []}
        deadline = time.monotonic() + timeout
        open_fds = [out_r, err_r]
        while open_fds:
            ready, _, _ = select.select(open_fds, [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                break
            for fd in ready:
                data = os.read(fd, 65536)
                if data:
                    chunks[fd].append(data)
                else:
                    open_fds.remove(fd)
                    os.close(fd)
        for fd in open_fds:
            os.close(fd)
        _, status = os.waitpid(pid, 0)
        return Done(
            os.waitstatus_to_exitcode(status),
            b"".join(chunks[out_r]).decode(),
            b"".join(chunks[err_r]).decode(),
        )

    def submit(self, user: User, *args: str) -> int:
        done = self.as_user(user, "submit", "-q", *args)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.strip().splitlines()[-1])

    def job_args(self, *args: str) -> list[str]:
        return ["--", SYSTEM_PYTHON, JOB, *args]

    def gate(self, name: str) -> str:
        return str(self.gates / name)

    def open_gate(self, name: str) -> None:
        Path(self.gate(name)).touch()

    # -- the scheduler (root) ---------------------------------------------------------------

    def root_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [self.pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "TORCHDOCTOR_SYSTEM_DIR": str(self.system_dir),
            "TORCHDOCTOR_QUEUE_CONFIG": str(self.config),
            **self.nvml_env,
        }

    def start_scheduler(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchdoctor", "queue", "serve", "--system"],
            env=self.root_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = proc.stdout.readline()  # it says so once its socket listens
        assert "machine-wide queue on" in line, (line, proc.stderr.read() if proc.poll() else "")
        self.scheduler = proc
        return proc

    def kill_scheduler(self) -> None:
        assert self.scheduler is not None
        self.scheduler.kill()
        self.scheduler.wait()
        self.scheduler = None

    def store(self) -> QueueStore:
        return QueueStore(self.system_dir / "queue.sqlite")

    def job(self, job_id: int):
        store = self.store()
        try:
            return store.get(job_id)
        finally:
            store.close()

    def until(self, what, timeout: float = 90.0):
        """Wait for a state of the queue that no one announces."""
        deadline = time.monotonic() + timeout
        while True:
            value = what()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def ended(self, job_id: int):
        return self.until(lambda: (j := self.job(job_id)) is not None and j.ended and j)

    def scheduler_log(self) -> str:
        """What the scheduler and the supervisors it started said (for failure messages)."""
        path = self.system_dir / "queue" / "scheduler.log"
        return path.read_text() if path.exists() else ""

    def report(self, job_id: int) -> list[dict]:
        """The JSON lines the job printed (read as root from its owner's log)."""
        return [json.loads(line) for line in Path(self.job(job_id).log).read_text().splitlines()]

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.scheduler.wait(timeout=20)
            if self.scheduler.poll() is None:
                self.scheduler.kill()
        if (self.system_dir / "queue.sqlite").exists():
            kill_jobs_left(self.store())
        for user in self.users:
            subprocess.run(["userdel", "--force", "--remove", user.name], capture_output=True)
            # The registry folder its recorded jobs announced themselves in.
            shutil.rmtree(
                Path(tempfile.gettempdir()) / f"torchdoctor-{user.uid}", ignore_errors=True
            )


def _cli(args: tuple[str, ...]):
    def run() -> int:
        from torchdoctor.cli import main

        main(list(args))
        return 0

    return run


def preload() -> None:
    """What a user's command imports, imported while we are still root (see the module doc)."""
    import torchdoctor.cli
    import torchdoctor.cli.common
    import torchdoctor.cli.queue
    import torchdoctor.cli.submit  # noqa: F401
    import torchdoctor.queue.client
    import torchdoctor.queue.needs
    import torchdoctor.queue.system
    import torchdoctor.run.process  # noqa: F401
    from torchdoctor.cli import main

    with contextlib.suppress(SystemExit):
        main(["queue", "--help"])


def shared_machines(capsys):
    """The test's fixture body: yields ``make(gpus, config)``, cleans up every machine made."""
    need_root()
    preload()
    capsys.readouterr()
    base = Path(tempfile.mkdtemp(prefix="tdq-shared-", dir="/tmp"))
    os.chmod(base, 0o755)
    made: list[SharedMachine] = []

    def make(gpus: list[dict] | None = None, config: str = "") -> SharedMachine:
        machine = SharedMachine(base, gpus or [])
        if "[cores]" not in config:
            # This test machine is shared with other work that keeps its cores busy: holding
            # back cores busy outside the queue (the default) would make these tests wait on it.
            config += "\n[cores]\nbusy_outside = false\n"
        machine.config.write_text(config)
        made.append(machine)
        return machine

    yield make
    for machine in made:
        machine.close()
    shutil.rmtree(base, ignore_errors=True)
