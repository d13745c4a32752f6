"""Shell completion from the real command, and read-only queue commands that create nothing."""

from __future__ import annotations

import pytest

from tests.queue.conftest import queue_env  # noqa: F401 - the fixture


def _complete(user, words: str, env: dict | None = None) -> list[str]:
    """What bash completion offers for ``words`` (the last word being completed)."""
    parts = words.split(" ")
    done = user.td(
        env={
            **(env or user.env),
            "_TORCHDOCTOR_COMPLETE": "bash_complete",
            "COMP_WORDS": words,
            "COMP_CWORD": str(len(parts) - 1),
        }
    )
    assert done.returncode == 0, done.stderr
    return [line.split(",", 1)[1] for line in done.stdout.splitlines() if line]


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_the_shells_script(user, shell):
    done = user.td("completion", shell)
    assert done.returncode == 0, done.stderr
    assert "_TORCHDOCTOR_COMPLETE" in done.stdout


def test_commands_and_recordings_complete(user):
    assert _complete(user, "torchdoctor sh") == ["show"]
    user.record("pass")
    (recording,) = user.runs.glob("*.sqlite")
    offered = _complete(user, "torchdoctor diagnose ")
    assert offered[:2] == ["last", "@last"] and str(recording) in offered


def test_queued_job_ids_complete(queue_env, user):  # noqa: F811
    q = queue_env()
    first = q.submit("--", "python3", "-c", "pass")
    assert q.wait(first) == 0
    assert str(first) in _complete(user, "torchdoctor queue show ", env=q.env)


def test_read_only_queue_commands_create_nothing_on_a_fresh_machine(user):
    for args in (["queue"], ["queue", "--json"], ["queue", "show", "1"], ["queue", "logs", "1"]):
        done = user.td(*args)
        assert done.returncode in (0, 2), done.stderr
    assert user.td("queue").stdout.startswith("no jobs")
    assert "nothing was ever queued here" in user.td("queue", "wait", "1").stderr
    _complete(user, "torchdoctor queue show ")
    assert not (user.home / ".local").exists()
    assert not (user.home.parent / "runtime").exists()
