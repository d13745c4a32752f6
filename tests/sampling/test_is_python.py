"""One rule says what is a Python interpreter, for `top`'s roles, `launch` and the Slurm script."""

from __future__ import annotations

import sys

import pytest

from torchdoctor.cli.common import job_name
from torchdoctor.launch.plan import split_script
from torchdoctor.sampling.roles import Traits, is_python
from torchdoctor.sizing.command import job_identity, torchrun_invocation

INTERPRETERS = [
    "python",
    "python3",
    "python3.12",
    "/usr/bin/python3.11",
    "/opt/venv/bin/python3.10d",  # a debug build
    "python3.7m",  # the old pymalloc ABI suffix
    "python3-dbg",  # Debian's debug interpreter
    "pypy",
    "pypy3.10",
    sys.executable,
]
NOT_INTERPRETERS = [
    "python-config",
    "python3.12-config",
    "pythonista",
    "ipython",
    "python3..1",
    "pytest",
    "torchrun",
    "train.py",
    "",
]


@pytest.mark.parametrize("name", INTERPRETERS)
def test_interpreters_are_python_everywhere(name, tmp_path):
    assert is_python(name)
    assert Traits([name, "train.py"]).python
    # launch drops the interpreter (torchrun starts the script with its own).
    script = tmp_path / "train.py"
    script.write_text("")
    assert split_script([name, str(script), "--lr", "1"]) == [str(script), "--lr", "1"]
    # The Slurm script hands the script to torchrun run by that same interpreter.
    assert torchrun_invocation([name, "train.py"]) == (
        [name, "-m", "torch.distributed.run"],
        ["train.py"],
    )
    assert job_identity([name, "-u", "train.py"]) == "train.py"
    assert job_name([name, "train.py"]).endswith("-train")


@pytest.mark.parametrize("name", NOT_INTERPRETERS)
def test_other_programs_are_not(name):
    assert not is_python(name)
    assert not Traits([name, "train.py"]).python
    if name and name != "torchrun":  # torchrun itself is refused with its own message
        assert torchrun_invocation([name, "train.py"])[0] == ["torchrun"]
