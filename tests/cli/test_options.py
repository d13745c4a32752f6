"""Options are read before the command: a typo is refused before anything starts; bare groups
print their help; unknown commands and options get a suggestion; renamed options still work."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.conftest import PY


def _job_that_leaves_a_mark(mark: Path) -> list[str]:
    """A command that would create ``mark`` if it ever ran."""
    return [PY, "-c", f"open({str(mark)!r}, 'w').write('ran')"]


@pytest.mark.parametrize(
    ("command", "typo", "meant"),
    [
        (["run"], "--intervl", "--interval"),
        (["tune"], "--bugdet", "--budget"),
        (["submit"], "--priorty", "--priority"),
        (["sbatch"], "--nodse", "--nodes"),
        (["launch"], "--nproc-per-nod", "--nproc-per-node"),
        (["bench", "scaling"], "--stesp", "--steps"),
    ],
)
def test_a_mistyped_option_is_refused_before_anything_starts(user, command, typo, meant):
    mark = user.home / "the-job-ran"
    done = user.td(*command, typo, "1", "--", *_job_that_leaves_a_mark(mark))
    assert done.returncode == 2, done.stderr
    assert f"No such option '{typo}'" in done.stderr
    assert meant in done.stderr.split(typo, 1)[1]  # the suggestion follows the typo
    assert "for help." in done.stderr  # click's "Try 'torchdoctor ... --help' for help."
    # Nothing started: no job, no recording, no queue state, no scheduler's folders.
    assert not mark.exists()
    assert not user.runs.exists()
    assert not (user.home / ".local").exists()


def test_the_command_after_the_options_is_the_jobs_own(user):
    """Options after the command's first word are the command's: not checked, not ours."""
    mark = user.home / "ran"
    code = f"import sys; open({str(mark)!r}, 'w').write(' '.join(sys.argv[1:]))"
    done = user.td("run", "--quiet", PY, "-c", code, "--intervl", "1")
    assert done.returncode == 0, done.stderr
    assert mark.read_text() == "--intervl 1"


@pytest.mark.parametrize("group", [[], ["bench"], ["slurm"]])
def test_bare_groups_print_their_help_and_exit_0(user, group):
    done = user.td(*group)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: torchdoctor")
    assert "Commands:" in done.stdout or "Benchmarks:" in done.stdout
    assert done.stderr == ""


@pytest.mark.parametrize(
    ("args", "meant"), [(["shw"], "'show'"), (["bench", "alreduce"], "'allreduce'")]
)
def test_an_unknown_command_gets_did_you_mean(user, args, meant):
    done = user.td(*args, "x")
    assert done.returncode == 2
    assert f"No such command '{args[-1]}'. Did you mean {meant}?" in done.stderr
    assert "for help." in done.stderr


def test_a_renamed_option_still_works_and_says_so_once(user, tmp_path):
    done = user.td("export", "nowhere.sqlite", "--format", "csv", "--to", str(tmp_path / "o"))
    assert "--to is now --out-dir" in done.stderr
    assert done.stderr.count("is now") == 1
    # The old spelling reached the command (the error is about the recording, not --to).
    assert "nowhere.sqlite" in done.stderr and "No such option" not in done.stderr
    assert "--to" not in user.td("export", "--help").stdout  # hidden from the help
