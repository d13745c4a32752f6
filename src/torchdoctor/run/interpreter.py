"""The job's own Python: the interpreter that runs the job, torchrun and every torch import.

torchdoctor is often installed apart from the training environment (``pipx install``, ``uv
tool install``, a system package): its own interpreter then has no torch, or another torch
than the job's. So every command that starts the job or needs torch uses the job's
interpreter, found in this order:

1. the interpreter the command line names (``launch -- /env/bin/python train.py``);
2. ``--python PATH``;
3. the active virtualenv's ``python`` (``$VIRTUAL_ENV``), else the active conda env's
   (``$CONDA_PREFIX``);
4. torchdoctor's own.

A command that imports torch itself (``estimate``, ``bench allreduce``, ``doctor``) is
*relayed*: run again, whole, inside the job's interpreter, with this very torchdoctor loaded
by path and its own dependencies appended after the job's (the job's packages win, ours only
fill what it lacks). Nothing needs installing into the training environment.

torch (and the packages built against it) is never one of those fillers: torchdoctor's own
site folder often holds a torch too, and a training env without torch would otherwise pass
``doctor``'s checks and run ``estimate`` with torchdoctor's torch, answering for an environment
that is not the job's. A finder first on the relayed interpreter's ``sys.meta_path`` looks
those names up on the job's own path only, so a missing torch stays missing (see
:func:`relay_argv`). A ``--python`` is run once first (``-c``, no shell, a timeout) to know it
is a Python torchdoctor can run in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.sampling.roles import is_python

# Set in a relayed command's environment: the relay happens once, never again inside it.
RELAYED_ENV = "TORCHDOCTOR_RELAYED"
# The modules torchdoctor's own dependencies provide; their folders are appended to a relayed
# interpreter's path so that a training env without them still runs torchdoctor.
_DEPENDENCIES = ("click", "rich", "psutil", "pynvml", "prometheus_client")

OWN = "torchdoctor's own"
# Top-level packages the job's environment alone may provide in a relayed command: torch and
# what is built against its ABI. Ours are fillers for torchdoctor's own needs, never these.
JOBS_OWN = ("torch", "torchvision", "torchaudio", "torchgen", "functorch", "triton", "nvidia")
MIN_PYTHON = (3, 10)  # pyproject's requires-python: torchdoctor's code runs in the job's Python
PROBE_TIMEOUT_S = 30.0  # a cold interpreter on a busy network file system can take seconds


@dataclass(frozen=True)
class JobPython:
    """An interpreter that runs the job, and why it was chosen."""

    executable: str
    source: str  # "the command line", "--python", "the active virtualenv", ..., OWN

    @property
    def is_ours(self) -> bool:
        return same_interpreter(self.executable, sys.executable)

    def describe(self) -> str:
        return f"{self.executable} ({self.source})"


def same_interpreter(a: str, b: str) -> bool:
    """Whether two paths start the same Python (a venv's python is a symlink to its base, but
    a different interpreter: its prefix differs, so only the exact file counts)."""
    try:
        return os.path.samefile(a, b) and os.path.dirname(os.path.abspath(a)) == os.path.dirname(
            os.path.abspath(b)
        )
    except OSError:
        return False


def find_job_python(
    command: Sequence[str] = (),
    explicit: str | None = None,
    env: Mapping[str, str] | None = None,
) -> JobPython:
    """The job's interpreter for ``command`` (the job's argv, possibly empty)."""
    env = os.environ if env is None else env
    named = _command_python(command, env)
    if explicit is not None:
        chosen = _check(_resolve(explicit, env), "--python")
        if os.environ.get(RELAYED_ENV) != chosen:  # a relayed command's was probed already
            probe_python(chosen, "--python")
        if named is not None and not same_interpreter(named, chosen):
            raise UserError(
                f"--python {explicit} and the command's interpreter {command[0]} differ: "
                "give only one of them"
            )
        return JobPython(chosen, "--python")
    if named is not None:
        return JobPython(named, "the command line")
    for variable, what in (
        ("VIRTUAL_ENV", "the active virtualenv"),
        ("CONDA_PREFIX", "the active conda env"),
    ):
        prefix = env.get(variable)
        if prefix:
            candidate = Path(prefix) / "bin" / "python"
            if os.access(candidate, os.X_OK):
                return JobPython(str(candidate), f"{what}, ${variable}")
    return JobPython(sys.executable, OWN)


def _command_python(command: Sequence[str], env: Mapping[str, str]) -> str | None:
    if not command or not is_python(command[0]):
        return None
    return _check(_resolve(command[0], env), "the command's interpreter")


def _resolve(name: str, env: Mapping[str, str]) -> str:
    if os.sep in name:
        return os.path.abspath(name)
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    return found or name


def _check(path: str, what: str) -> str:
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise UserError(f"{what} {path} is not an executable Python: give the path of one")
    return path


def probe_python(path: str, what: str) -> tuple[int, int]:
    """``path``'s (major, minor), from running it once with ``-c`` (no shell, a timeout); a
    :class:`UserError` when it is no Python (/bin/false, /bin/sh) or one too old to run
    torchdoctor's code. Before, /bin/false failed silently and /bin/sh leaked its syntax
    errors."""
    fix = "give the path of a Python 3.10 or newer (e.g. /path/to/env/bin/python)"
    try:
        done = subprocess.run(
            [path, "-c", "import sys; print(tuple(sys.version_info[:2]))"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise UserError(
            f"{what} {path} did not answer within {PROBE_TIMEOUT_S:g} s when asked its version: {fix}"
        ) from None
    except OSError as exc:  # not an executable format the kernel runs
        raise UserError(f"{what} {path} is not a Python ({exc.strerror}): {fix}") from None
    words = done.stdout.strip().strip("()").split(",")
    if done.returncode != 0 or len(words) != 2 or not all(w.strip().isdigit() for w in words):
        raise UserError(
            f"{what} {path} is not a Python (asked its version, it exited with status "
            f"{done.returncode}): {fix}"
        )
    version = (int(words[0]), int(words[1]))
    if version < MIN_PYTHON:
        raise UserError(
            f"{what} {path} is Python {version[0]}.{version[1]}: torchdoctor runs its code in it "
            f"and needs {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer"
        )
    return version


# Run first in a relayed interpreter: `_ours` are torchdoctor's dependency folders appended
# after the job's path, and JOBS_OWN names are looked up on the job's path alone. Returning a
# spec or raising ModuleNotFoundError here ends the search, so the path finder later in
# sys.meta_path never reaches our folders for them; submodules (torch.nn) are found through
# their package's own __path__, already the job's.
_RELAY_FINDER = """
import importlib.machinery as _machinery

class _JobsOwnPackages:
    \"\"\"torch and its kin come from the training environment or not at all.\"\"\"

    names = frozenset(JOBS_OWN)

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is not None or name.partition(".")[0] not in cls.names:
            return None
        own_path = [entry for entry in sys.path if entry not in _ours]
        spec = _machinery.PathFinder.find_spec(name, own_path)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return spec

sys.meta_path.insert(0, _JobsOwnPackages)
"""


def relay_argv(job_python: JobPython, args: Sequence[str], shim: Path) -> list[str]:
    """The argv that runs ``torchdoctor ARGS`` inside ``job_python``, with this torchdoctor.

    ``shim`` is a folder holding only a link to this torchdoctor package: first on the path,
    so that neither the working directory nor a torchdoctor of the training env shadows it;
    multiprocessing's spawned children (bench allreduce's ranks) inherit that path. Our
    dependency folders go after the job's own path, and only those not on it already (a
    folder the job's Python has is the job's: its torch stays visible).
    """
    dependency_dirs = sorted({d for d in map(_module_dir, _DEPENDENCIES) if d is not None})
    code = (
        "import sys\n"
        f"sys.path[:1] = [{str(shim)!r}]\n"  # -c puts the working directory first
        f"_ours = [d for d in {dependency_dirs!r} if d not in sys.path]\n"
        "sys.path.extend(_ours)\n"
        f"JOBS_OWN = {JOBS_OWN!r}\n" + _RELAY_FINDER + "from torchdoctor.cli import main\n"
        "sys.argv[0] = 'torchdoctor'\n"
        "main()\n"
    )
    return [job_python.executable, "-c", code, *args]


def _module_dir(name: str) -> str | None:
    module = sys.modules.get(name)
    if module is None:
        try:
            module = __import__(name)
        except ImportError:
            return None
    where = getattr(module, "__file__", None)
    if not where:
        return None
    path = Path(where).resolve()
    # a package's folder sits in the site folder; a single-file module sits in it directly
    return str(path.parents[1] if path.name == "__init__.py" else path.parent)


def relay_if_needed(job_python: JobPython, args: Sequence[str], *, quiet: bool = False) -> None:
    """Run the command again inside the job's interpreter when it is not ours; exits then.

    Inside a relayed command (or when the job's interpreter is ours) this returns and the
    command goes on here. The relayed command's exit status becomes ours."""
    if job_python.is_ours or os.environ.get(RELAYED_ENV):
        return
    if not quiet:
        print(f"torchdoctor: using {job_python.describe()} for torch", file=sys.stderr)
    env = dict(os.environ, **{RELAYED_ENV: job_python.executable})
    with tempfile.TemporaryDirectory(prefix="torchdoctor-relay-") as shim:
        os.symlink(Path(__file__).resolve().parents[1], Path(shim) / "torchdoctor")
        try:
            done = subprocess.run(relay_argv(job_python, args, Path(shim)), env=env, check=False)
        except OSError as exc:
            raise UserError(f"cannot start {job_python.executable}: {exc.strerror}") from None
        except KeyboardInterrupt:
            raise SystemExit(130) from None
    raise SystemExit(done.returncode)


def announce(job_python: JobPython, what: str = "the job") -> None:
    """Say which interpreter runs ``what`` when it is not torchdoctor's own."""
    if not job_python.is_ours:
        print(f"torchdoctor: {what} runs with {job_python.describe()}", file=sys.stderr)
