"""The tests never use the machine's or the tester's own folders (issue 41): `make test` on a
machine where a machine-wide queue was once set up (/var/lib/torchdoctor, its service
stopped, its socket left behind) failed 32 tests with "the machine-wide queue does not
answer". tests/conftest.py's `hermetic` fixture points every variable that steers such a
folder at the test's own; these tests check that every folder the code resolves obeys it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from tests.queue.conftest import FAKE_JOB
from torchdoctor.queue.paths import QueuePaths
from torchdoctor.queue.store import QueueStore
from torchdoctor.queue.system import make_system_paths

# Resolved in a child process, as the commands under test resolve them.
RESOLVE = """
import json
from torchdoctor.config import runs_dir, user_config_path
from torchdoctor.queue.paths import queue_paths
from torchdoctor.queue.system import config_path, system_paths
from torchdoctor.recording.registry import registry_dir

mine, machine = queue_paths(), system_paths()
print(json.dumps({
    "user config": str(user_config_path()),
    "queue state": str(mine.state_dir),
    "queue socket": str(mine.socket),
    "registry": str(registry_dir()),
    "system queue": str(machine.state_dir),
    "system socket": str(machine.socket),
    "queue limits": config_path(),
    "recordings": str(runs_dir()),
}))
"""


def test_every_folder_the_code_resolves_lies_in_the_tests_own(hermetic, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    resolved = {name: Path(path) for name, path in json.loads(done.stdout).items()}
    # The default recordings folder is relative: the test's cwd decides, not the tester.
    assert resolved.pop("recordings") == Path("torchdoctor-runs")
    ours = [
        hermetic.config_home,
        hermetic.state_home,
        hermetic.runtime_dir,
        hermetic.system_dir,
    ]
    for name, path in resolved.items():
        assert any(path.is_relative_to(folder) for folder in ours), (name, path)
        assert not path.is_relative_to(Path.home()), (name, path)
    assert resolved["system queue"] == hermetic.system_dir
    assert resolved["queue limits"] == hermetic.queue_config
    # Unix socket paths hold at most 107 bytes.
    assert len(str(resolved["queue socket"])) < 100 and len(str(resolved["system socket"])) < 100


def _dead_machine_wide_queue(folder: Path) -> QueuePaths:
    """What a stopped machine-wide scheduler leaves: its folders, its state and its socket,
    which nothing listens on any more."""
    paths = QueuePaths(folder, folder)
    make_system_paths(paths)
    QueueStore(paths.db).close()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(paths.socket))
    return paths


def test_a_dead_machine_wide_queue_where_the_fixture_points_is_one_line(hermetic, queue_env):
    system = _dead_machine_wide_queue(hermetic.system_dir)
    q = queue_env()
    assert q.env["TORCHDOCTOR_SYSTEM_DIR"] == str(hermetic.system_dir)
    # Designed (queue/system.py): where the socket exists, the machine-wide queue is the one
    # every user uses; when it does not answer, each command says so and who can fix it.
    for args in (["submit", "--", sys.executable, FAKE_JOB], ["queue"], ["queue", "show", "1"]):
        done = q.td(*args)
        assert done.returncode != 0, done
        (line,) = done.stderr.splitlines()
        assert line.startswith(
            f"torchdoctor: error: the machine-wide queue ({system.socket}) does not answer ("
        )
        assert line.endswith("(systemctl start torchdoctor-queue)")
    assert not q.paths.state_dir.exists()  # nothing was queued in the user's own queue
    # An empty TORCHDOCTOR_SYSTEM_DIR says there is no machine-wide queue: the user's own.
    q.env["TORCHDOCTOR_SYSTEM_DIR"] = ""
    assert q.wait(q.submit("--", sys.executable, FAKE_JOB)) == 0
    assert "no jobs" not in q.td("queue", check=True).stdout


def test_a_machine_wide_queue_folder_without_its_socket_leaves_the_users_own(hermetic, queue_env):
    system = _dead_machine_wide_queue(hermetic.system_dir)
    system.socket.unlink()
    q = queue_env()
    listed = q.td("queue", check=True)
    assert listed.stdout.startswith("no jobs")
    assert q.wait(q.submit("--", sys.executable, FAKE_JOB)) == 0
    listed = q.td("queue", check=True)
    assert f"no machine-wide queue here ({system.socket} is absent)" in listed.stderr
