"""The fuzz suite's settings, its in-process harness and the one real recording it mutates.

Two hypothesis profiles: ``ci`` (the default: few examples, derandomized, so a normal test run
is fast and draws the same inputs on every machine) and ``fuzz`` (``make fuzz``: FUZZ_EXAMPLES
examples a test, random). A long run saves the failing inputs it finds in
``tests/fuzz/examples/`` (committed), and every later ``make fuzz`` replays them first; a
failure found and fixed gets an ``@example`` on its test, which every run, ``ci`` included,
replays.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from tests.conftest import run_td
from tests.recording.test_show_steps import SCRIPT
from torchdoctor.cli.exit_codes import FOUND, REGRESSED

EXAMPLES = Path(__file__).parent / "examples"
# The example count of a normal run: together the fuzz tests stay well under 3 minutes on 2
# cores (each example is a whole command, in process).
CI_EXAMPLES = 50

_common = {
    "deadline": None,  # a command's time varies with the machine's load: bounded by CALL_LIMIT_S
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}
settings.register_profile(
    "ci",
    max_examples=CI_EXAMPLES,
    derandomize=True,  # the same inputs every run: a normal test run is never flaky
    **_common,
)
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "2000")),
    database=DirectoryBasedExampleDatabase(EXAMPLES),
    **_common,
)
settings.load_profile("fuzz" if os.environ.get("FUZZ_EXAMPLES") else "ci")

# One command that runs longer than this has hung (the slowest honest one, a report of the
# test recording or a bench run, takes a few seconds).
CALL_LIMIT_S = 60.0


CALL_MEMORY = 4 << 30  # the most one command may add to the process's data


def _data_now() -> int:
    """This process's data segment now (VmData: heap and private mappings), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    return 0


class Hang(BaseException):
    """Raised into a command that ran past CALL_LIMIT_S (a BaseException: nothing the command
    catches as an Exception may swallow it)."""


@dataclass
class Outcome:
    argv: list[str]
    code: int
    stdout: str
    stderr: str

    def check(self) -> None:
        """Success, or a non-zero exit that says what is wrong in a line (and maybe a hint):
        never a traceback, whatever the exit status."""
        shown = f"torchdoctor {self.argv!r} -> {self.code}\nstderr:\n{self.stderr[-3000:]}"
        assert "Traceback" not in self.stderr, shown
        if self.code == 0:
            return
        if self.argv[:1] in (["run"], ["launch"]) and "torchdoctor: recording " in self.stderr:
            return  # the job started: the status is the job's, and the end report follows
        if (
            self.argv[:1] in (["run"], ["launch"])
            and {"-q", "--quiet"} & set(self.argv)
            and not self.stderr.strip()
        ):
            # --quiet says nothing of its own: a silent non-zero exit is the job's status
            # (`run --quiet '['`: the job is /usr/bin/[, which exits 2), any error of
            # torchdoctor's is still a line on stderr
            return
        if self.argv[:1] == ["tune"] and "trial  0" in self.stderr:
            return  # trials ran (their progress lines), then one line says why tune stopped
        # click's usage errors carry the usage line and its "Try ... -h" hint around the error
        # (and a missing choice, the choices: one a line, indented)
        lines = [
            line
            for line in self.stderr.split("\n")  # a \r a user typed is no new line
            if line.strip() and not line.startswith(("Usage: ", "Try '", "  ", "\t"))
        ]
        # A result, not an error: `doctor` found errors, `diagnose --fail-on` a finding,
        # `compare` a regression: the report is on stdout, stderr may be empty.
        fewest = 0 if self.code in (FOUND, REGRESSED) else 1
        assert fewest <= len(lines) <= 2, shown


def invoke(argv: list[str], cwd: Path, env: dict[str, str]) -> Outcome:
    """`torchdoctor ARGV` in this process through click's CliRunner isolation (stdin, stdout,
    stderr and the environment swapped), the real entry point `torchdoctor.cli.main` with its
    error handling. Any exception but SystemExit propagates and fails the test; a command
    running past CALL_LIMIT_S raises Hang."""
    from torchdoctor.cli import main

    def alarm(signum, frame):
        raise Hang(f"torchdoctor {argv!r} still running after {CALL_LIMIT_S:.0f} s")

    runner = CliRunner()
    old_cwd = os.getcwd()
    # A command hands settings to its children through os.environ (--thresholds sets
    # $TORCHDOCTOR_THRESHOLDS): in one process that would reach every later example and test.
    old_environ = dict(os.environ)
    # A command that asks for tens of GiB (a fuzzed size) fails with MemoryError, a finding,
    # instead of the kernel's OOM killer taking the test run (or a neighbour) down.
    old_data = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (_data_now() + CALL_MEMORY, old_data[1]))
    old_alarm = signal.signal(signal.SIGALRM, alarm)
    code: int = 0
    try:
        with runner.isolation(input="", env=env) as streams:
            _keep_captured_streams()
            os.chdir(cwd)
            signal.setitimer(signal.ITIMER_REAL, CALL_LIMIT_S)
            try:
                main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                os.chdir(old_cwd)
                sys.stdout.flush()  # the text wrappers over the captured bytes
                sys.stderr.flush()
            out, err = streams[0].getvalue(), streams[1].getvalue()
    finally:
        signal.signal(signal.SIGALRM, old_alarm)
        resource.setrlimit(resource.RLIMIT_DATA, old_data)
        os.environ.clear()
        os.environ.update(old_environ)
    decode = lambda b: b.decode("utf-8", "replace")  # noqa: E731
    return Outcome(list(argv), code, decode(out), decode(err))


def _keep_captured_streams() -> None:
    """The entry point swaps stdout and stderr for copies of descriptors 1 and 2 (so that a
    broken pipe drops output instead of failing): the captured streams have no descriptor and
    would become /dev/null. Already wrapped, they are kept."""
    try:
        from torchdoctor.cli.streams import DroppingStream
    except ImportError:
        return
    sys.stdout = DroppingStream(sys.stdout)
    sys.stderr = DroppingStream(sys.stderr)


@pytest.fixture
def sandbox(tmp_path_factory) -> Iterator[tuple[Path, dict[str, str]]]:
    """A folder to run in and an environment whose config, state, runtime and recordings
    folders are all inside it: nothing a fuzzed command writes lands in the tester's home."""
    root = tmp_path_factory.mktemp("sandbox")
    env = {
        "HOME": str(root / "home"),
        "XDG_CONFIG_HOME": str(root / "config"),
        "XDG_STATE_HOME": str(root / "state"),
        "XDG_RUNTIME_DIR": str(root / "runtime"),
        "XDG_CACHE_HOME": str(root / "cache"),
        "TORCHDOCTOR_RUNS_DIR": str(root / "runs"),
        "TORCHDOCTOR_QUEUE_IDLE_EXIT_S": "5",
        "COLUMNS": "100",
    }
    for key in ("home", "runtime"):
        (root / key).mkdir()
    os.chmod(root / "runtime", 0o700)
    yield root, env


# The training loop `show` is tested with: steps, a loader and settings to damage too.
TRAIN = SCRIPT


@pytest.fixture(scope="session")
def real_recording(tmp_path_factory) -> bytes:
    """The bytes of one real recording (made once a session): `torchdoctor run` of a tiny
    torch training loop, so that steps, loaders and settings are there to be damaged too."""
    folder = tmp_path_factory.mktemp("fuzz-recording")
    script = folder / "train.py"
    script.write_text(TRAIN)
    path = folder / "train.sqlite"
    res = run_td(
        "run", "--quiet", "--interval", "0.05", "--out", str(path), "--",
        sys.executable, str(script), timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return path.read_bytes()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def unchanged(*paths: Path) -> Iterator[None]:
    """The files ``paths`` have the same bytes after the block (readers never modify)."""
    before = {p: digest(p) for p in paths if p.is_file()}
    yield
    for p, d in before.items():
        assert p.is_file() and digest(p) == d, f"{p} was changed by a reader"
