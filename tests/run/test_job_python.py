"""torchdoctor installed apart from torch (as `pipx install` or `uv tool install` leave it):
every command that starts the job or needs torch uses the training environment's Python.

Two real virtual environments: ``tool`` holds torchdoctor and its dependencies and no torch;
``train`` holds torch (and the test's other packages) and no torchdoctor, no click, no rich,
no psutil. Both are made from this venv's packages by links, so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SITE = Path(sysconfig.get_paths()["purelib"])
MODELS = REPO / "examples" / "estimate_models.py"
DDP_JOB = REPO / "tests" / "launch" / "jobs" / "ddp_job.py"
# What torchdoctor needs besides itself (rich brings markdown_it, mdurl and pygments).
TOOL_MODULES = ("click", "rich", "psutil", "pynvml.py", "prometheus_client", "markdown_it")
TOOL_MODULES += ("mdurl", "pygments")
NOT_IN_TRAIN = ("torchdoctor", "__editable__", "click", "rich", "psutil", "pynvml")
NOT_IN_TRAIN += ("prometheus_client", "nvidia_ml_py")


@dataclass
class Envs:
    tool: Path  # tool/bin/python: torchdoctor, no torch
    train: Path  # train/bin/python: torch, no torchdoctor

    def td(self, *args: str, env: dict[str, str] | None = None, timeout: float = 240):
        full = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        full.update(env or {})
        return subprocess.run(
            [str(self.tool), "-m", "torchdoctor", *args],
            capture_output=True,
            text=True,
            env=full,
            timeout=timeout,
            check=False,
        )


def _venv(folder: Path, entries: list[Path]) -> Path:
    """A venv whose site folder sees exactly ``entries`` (through one folder of links)."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(folder)], check=True)
    links = folder / "linked"
    links.mkdir()
    for entry in entries:
        (links / entry.name).symlink_to(entry)
    python = folder / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "linked.pth").write_text(f"{links}\n")
    return python


@pytest.fixture(scope="module")
def envs(tmp_path_factory) -> Envs:
    root = tmp_path_factory.mktemp("envs")
    tool_entries = [REPO / "src" / "torchdoctor"] + [SITE / name for name in TOOL_MODULES]
    tool = _venv(root / "tool", [e for e in tool_entries if e.exists()])
    train_entries = [
        entry
        for entry in SITE.iterdir()
        if not entry.name.endswith(".pth")
        and not entry.name.startswith(NOT_IN_TRAIN)
        and entry.name != "__pycache__"
    ]
    train = _venv(root / "train", train_entries)
    # The set-up itself is what the tests stand on: torch only where it belongs.
    probe = "import importlib.util as u; print(u.find_spec('torch') is not None, u.find_spec('torchdoctor') is not None)"
    assert subprocess.run(
        [str(tool), "-c", probe], capture_output=True, text=True
    ).stdout.split() == ["False", "True"]
    assert subprocess.run(
        [str(train), "-c", probe], capture_output=True, text=True
    ).stdout.split() == ["True", "False"]
    return Envs(tool, train)


def test_without_a_training_env_torch_commands_say_what_to_do(envs):
    done = envs.td("estimate", f"{MODELS}:gpt_tiny", "--tokens", "16")
    assert done.returncode == 3
    assert "needs PyTorch" in done.stderr and "not importable" in done.stderr


def test_estimate_runs_in_the_python_given_and_names_it(envs):
    done = envs.td(
        "estimate", f"{MODELS}:gpt_tiny", "--tokens", "16", "--python", str(envs.train), "--json"
    )
    assert done.returncode == 0, done.stderr
    assert f"using {envs.train} (--python)" in done.stderr
    assert json.loads(done.stdout)["peak_allocated_bytes"] > 0


def test_estimate_uses_the_active_virtualenv(envs):
    done = envs.td(
        "estimate",
        f"{MODELS}:gpt_tiny",
        "--tokens",
        "16",
        "--json",
        env={"VIRTUAL_ENV": str(envs.train.parent.parent)},
    )
    assert done.returncode == 0, done.stderr
    assert "the active virtualenv" in done.stderr
    assert json.loads(done.stdout)["peak_allocated_bytes"] > 0


def test_doctor_checks_the_training_envs_torch(envs):
    done = envs.td("doctor", "--json", "--only", "versions", "--python", str(envs.train))
    assert done.returncode in (0, 1), done.stderr
    text = done.stdout
    assert str(envs.train) in text  # the Python the versions were read in
    import torch

    assert torch.__version__.split("+")[0] in text


def test_bench_allreduce_runs_its_ranks_in_the_training_env(envs):
    done = envs.td(
        "bench", "allreduce", "--nproc", "2", "--sizes", "4K,64K", "--iters", "3",
        "--warmup", "1", "--ops", "all_reduce", "--json", "--python", str(envs.train),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert "using" in done.stderr and str(envs.train) in done.stderr
    assert rows  # measured


def test_launch_keeps_the_interpreter_typed_and_names_it(envs, tmp_path):
    out = tmp_path / "runs"
    done = envs.td(
        "launch", "--nproc-per-node", "2", "--out-dir", str(out), "--",
        str(envs.train), str(DDP_JOB), "--samples", "2048",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"torchrun and the ranks run with {envs.train} (the command line)" in done.stderr
    (recording,) = out.glob("*.sqlite")
    from torchdoctor import open_recording

    with open_recording(recording) as rec:
        commands = [" ".join(p.get("cmdline") or []) for p in rec.rows("processes")]
    assert any(str(envs.train) in c and "ddp_job.py" in c for c in commands), commands


def test_bench_scaling_runs_every_trial_in_the_training_env(envs, tmp_path):
    done = envs.td(
        "bench", "scaling", "--nproc", "1", "--steps", "3", "--out-dir", str(tmp_path / "s"),
        "--json", "--", str(envs.train), str(DDP_JOB),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"every trial runs with {envs.train} (the command line)" in done.stderr
    (trial,) = json.loads(done.stdout)["trials"]
    assert trial["nproc"] == 1


def test_a_queued_jobs_vram_estimate_uses_the_jobs_torch(envs):
    code = (
        "from torchdoctor.queue.needs import _from_estimate; "
        f"print(_from_estimate('{MODELS}:gpt_tiny --tokens 16 --gpu A100-40GB', "
        f"['{envs.train}', 'train.py'])[0])"
    )
    done = subprocess.run(
        [str(envs.tool), "-c", code], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) > 0


def test_tune_names_the_interpreter_of_its_trials(envs, tmp_path):
    job = tmp_path / "job.py"
    job.write_text("print('ran')\n")
    done = envs.td(
        "tune", "--budget", "20", "--out-dir", str(tmp_path / "t"), "--", str(envs.train), str(job)
    )
    # The job takes no training step, so tune stops after its first trial: what matters here
    # is which Python ran it (a budget below tune's minimum is refused before it is said).
    assert f"every trial runs with {envs.train} (the command line)" in done.stderr


# -- a --python without torch, or not a Python at all -------------------------------------------


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A venv of the same base Python with nothing installed: no torch."""
    return _venv(tmp_path_factory.mktemp("bare") / "env", [])


def _td_with_torch(*args: str) -> subprocess.CompletedProcess:
    """torchdoctor from this venv, whose own site folder holds torch."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return subprocess.run(
        [sys.executable, "-m", "torchdoctor", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )


def test_a_python_without_torch_never_gets_torchdoctors_torch(bare_python):
    # The relay appended torchdoctor's site folder, torch included: doctor said "ok torch"
    # for an environment that has none, and estimate ran with torchdoctor's torch.
    done = _td_with_torch("doctor", "--json", "--only", "versions", "--python", str(bare_python))
    assert done.returncode == 1, done.stderr
    [check] = [c for c in json.loads(done.stdout)["checks"] if c["name"] == "versions.torch"]
    assert check["status"] == "error"
    assert check["saw"] == f"torch is not installed in {bare_python}"
    assert f"{bare_python} -m pip install torch" in check["fix"]
    done = _td_with_torch(
        "estimate", f"{MODELS}:gpt_tiny", "--tokens", "16", "--python", str(bare_python)
    )
    assert done.returncode == 3
    assert "needs PyTorch" in done.stderr


def test_torchdoctors_own_dependencies_still_fill_what_the_env_lacks(bare_python):
    # click, rich and psutil come from torchdoctor's folders: the bare env has none of them
    done = _td_with_torch(
        "doctor", "--json", "--only", "versions.python", "--python", str(bare_python)
    )
    assert done.returncode == 0, done.stderr
    assert str(bare_python) in done.stdout


@pytest.mark.parametrize("python", ["/bin/false", "/bin/sh", "old-python"])
def test_a_python_option_that_is_no_usable_python_is_one_line(tmp_path, python):
    if python == "old-python":
        fake = tmp_path / "python3.8"
        fake.write_text("#!/bin/sh\necho '(3, 8)'\n")
        fake.chmod(0o755)
        python, says = str(fake), "is Python 3.8: torchdoctor runs its code in it and needs 3.10"
    else:
        says = "is not a Python (asked its version, it exited with status"
    done = _td_with_torch("doctor", "--quiet", "--python", python)
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"torchdoctor: error: --python {python} {says}")
