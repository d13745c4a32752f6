"""`torchdoctor sbatch` on hostile input: values bound for the script (H6), absurd time limits
(minor 12), a damaged recording (minor 18) and the -o file (H1, minor 3)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_td
from tests.helpers.bad_input import one_error_line, record_short_job
from tests.helpers.engines import not_root, require_engine
from tests.slurm.test_script import recorded, script_for
from torchdoctor.errors import UserError
from torchdoctor.slurm.notation import MAX_TIME_LIMIT_S, require_duration

CMD = ["--", sys.executable, "train.py"]


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    """A real recording of a short job (its figures are enough to write a script)."""
    return record_short_job(tmp_path_factory.mktemp("rec") / "job.sqlite")


@pytest.mark.parametrize("option", ["--partition", "--account", "--job-name", "--gpu-type"])
@pytest.mark.parametrize("value", ["x\necho INJECTED", "a b", "x\recho", "x#y", 'x"y'])
def test_a_value_that_cannot_stand_in_an_sbatch_line_is_refused(
    recording: Path, tmp_path: Path, option: str, value: str
) -> None:
    out = tmp_path / "job.sbatch"
    res = run_td("sbatch", "--from", str(recording), option, value, "-o", str(out), *CMD)
    assert one_error_line(res) == (
        f"torchdoctor: error: {option} {value!r}: give one name without spaces or newlines"
    )
    assert not out.exists()


def test_a_recordings_folder_with_a_newline_is_refused(recording: Path, tmp_path: Path) -> None:
    folder = tmp_path / "runs\necho INJECTED"
    res = run_td("sbatch", "--from", str(recording), "--recordings", str(folder), *CMD)
    assert "--recordings" in one_error_line(res) and "#SBATCH line" in res.stderr


def test_a_recorded_command_with_newlines_stays_in_its_comment() -> None:
    # `python -c` code has newlines: in the "# Sized from" comment they ended the comment, and
    # the rest ran as a command (and ended sbatch's reading of #SBATCH lines).
    from torchdoctor.sizing.size import JobRequest, size_job
    from torchdoctor.slurm.script import ScriptOptions, render_script

    command = ["python", "train.py"]
    job = recorded(command=["python", "-c", "import os\nos.system('echo INJECTED')"])
    size = size_job(job, JobRequest(command=command))
    opts = ScriptOptions(
        command=command,
        job_name="train",
        recordings=Path("/shared/runs"),
        torchdoctor="/opt/my $HOME/venv/bin/torchdoctor",
        source="recording /runs/a.sqlite (`python -c import os\nos.system('echo INJECTED')`)",
    )
    text = render_script(size, opts)
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    head = text.split("\n\n", 1)[0].splitlines()
    # Every line before the body is a comment or a directive: sbatch reads them all.
    assert all(line.startswith("#") for line in head), head
    assert any(line.startswith("#SBATCH --time=") for line in directives)
    assert "import os\\nos.system" in text and "\nos.system" not in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    # The executable's path is taken literally by bash ($HOME not expanded).
    shown = subprocess.run(
        ["bash", "-c", text.split("set -eu\n", 1)[1].split("export JOB_RECORDINGS")[0]
         + 'echo "$TORCHDOCTOR"'],
        env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert shown == "/opt/my $HOME/venv/bin/torchdoctor\n"


def test_steps_past_any_time_limit_are_refused() -> None:
    # minor 12: --steps 99999999999999999999 wrote `#SBATCH --time=481633480341880:20:00`.
    for steps in (99999999999999999999, 10**400, int(MAX_TIME_LIMIT_S / 0.5) + 1):
        with pytest.raises(UserError, match=r"^--steps \d+ at 500 ms a step run longer than 365"):
            script_for(recorded(), steps=steps)
    text, _ = script_for(recorded(), steps=10_000)  # 10 s + 5000 s, +50 %: as before
    assert "#SBATCH --time=02:06:00" in text
    # With --time given the steps only feed a comment: no refusal, the limit asked for.
    text, _ = script_for(recorded(), steps=10**30, time_limit_s=3600)
    assert "#SBATCH --time=01:00:00" in text


def test_a_time_limit_past_a_year_is_refused(recording: Path) -> None:
    with pytest.raises(UserError, match="longer than 365 days"):
        require_duration("366d", "--time")
    assert require_duration("365d", "--time") == MAX_TIME_LIMIT_S
    res = run_td("sbatch", "--from", str(recording), "--time", "999999h", *CMD)
    assert "--time '999999h' is longer than 365 days" in one_error_line(res)


def test_a_truncated_recording_is_said_to_be_damaged(recording: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.sqlite"
    cut.write_bytes(recording.read_bytes()[: recording.stat().st_size // 3])
    res = run_td("sbatch", "--from", str(cut), *CMD)
    assert res.returncode == 0, res.stderr
    warning = f"torchdoctor: warning: the recording {cut} is damaged (the file holds "
    assert warning in res.stderr
    assert f"# NOTE: the recording {cut} is damaged" in res.stdout


# -- the -o file --------------------------------------------------------------------------


def test_a_new_script_is_executable_and_a_replaced_one_keeps_its_mode(
    recording: Path, tmp_path: Path
) -> None:
    new = tmp_path / "job.sbatch"
    res = run_td("sbatch", "--from", str(recording), "-o", str(new), *CMD)
    assert res.returncode == 0, res.stderr
    assert stat.S_IMODE(new.stat().st_mode) == 0o755 & ~_umask()
    res = run_td("sbatch", "--from", str(recording), "-o", str(new), *CMD)
    assert res.returncode == 0, res.stderr  # its own script again: replaced without --force
    mine = tmp_path / "mine.sh"
    mine.write_text("my script\n")
    mine.chmod(0o600)
    line = one_error_line(run_td("sbatch", "--from", str(recording), "-o", str(mine), *CMD))
    assert "already exists; add --force" in line and mine.read_text() == "my script\n"
    res = run_td("sbatch", "--from", str(recording), "-o", str(mine), "--force", *CMD)
    assert res.returncode == 0, res.stderr
    assert mine.read_text().startswith("#!/bin/bash")
    assert stat.S_IMODE(mine.stat().st_mode) == 0o600  # not chmodded: torchdoctor did not make it


def test_a_recording_is_never_replaced_by_a_script(recording: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.sqlite"
    victim.write_bytes(recording.read_bytes())
    res = run_td("sbatch", "--from", str(recording), "-o", str(victim), "--force", *CMD)
    assert "is a torchdoctor recording" in one_error_line(res)
    assert victim.read_bytes() == recording.read_bytes()


def test_a_parent_that_is_a_file_is_one_line(recording: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    res = run_td("sbatch", "--from", str(recording), "-o", str(tmp_path / "afile" / "x"), *CMD)
    assert "afile' is a file, not a folder" in one_error_line(res)


def test_a_device_is_neither_replaced_nor_chmodded(recording: Path, tmp_path: Path) -> None:
    # As root, `sbatch -o /dev/null` made /dev/null 0755: unwritable for everyone else.
    require_engine("root", not_root())
    node = tmp_path / "null"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    node.chmod(0o666)
    res = run_td("sbatch", "--from", str(recording), "-o", str(node), "--force", *CMD)
    assert "is a character device" in one_error_line(res)
    assert stat.S_ISCHR(node.stat().st_mode) and stat.S_IMODE(node.stat().st_mode) == 0o666


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_a_recorded_variable_name_that_is_shell_code_is_left_out() -> None:
    # The recording's environment is carried into the script; a name is not quoted by bash.
    env = {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_X=1;echo INJECTED;: ": "y"}
    text, _ = script_for(recorded(network_env=env))
    assert "export NCCL_SOCKET_IFNAME=ib0" in text
    assert [line for line in text.splitlines() if "INJECTED" in line] == [
        "# NCCL_X=1;echo INJECTED;: : left out, not a variable name bash exports"
    ]
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
