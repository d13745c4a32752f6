"""The user's training command, as torchrun runs it and as a recording names it."""

from __future__ import annotations

import os

from torchdoctor.errors import UserError
from torchdoctor.sampling.roles import is_python

_LAUNCHERS = ("torchrun", "torchdoctor")


def torchrun_invocation(argv: list[str]) -> tuple[list[str], list[str]]:
    """How torchrun is started for ``argv``, and what follows torchrun's own options.

    ``python train.py --lr 1`` becomes ``python -m torch.distributed.run ... train.py --lr 1``:
    torchrun run by the job's own interpreter, so each rank gets that same python (the
    ``torchrun`` script on PATH may belong to another environment). A non-Python command runs
    through ``torchrun --no-python``.
    """
    if not argv:
        raise UserError("no command given: put it after `--`, e.g. `-- python train.py`")
    if os.path.basename(argv[0]) in _LAUNCHERS or argv[1:3] == ["-m", "torch.distributed.run"]:
        raise UserError(
            f"give the training command itself, not `{os.path.basename(argv[0])} ...`: "
            "the script starts torchrun (one per node) and the recorder itself"
        )
    if not is_python(argv[0]):
        return ["torchrun"], ["--no-python", *argv]
    rest = argv[1:]
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return [argv[0], "-m", "torch.distributed.run"], ["-m", *rest[1:]]
    if rest and not rest[0].startswith("-"):
        return [argv[0], "-m", "torch.distributed.run"], rest
    raise UserError(
        f"cannot hand `{' '.join(argv[:3])}` to torchrun: it takes a script or `-m module` "
        "right after python (interpreter options such as -u go in PYTHON* variables)"
    )


def job_identity(argv: list[str]) -> str:
    """What a command runs, without interpreter, launchers and their options: the script
    (``train.py``), ``-m module``, or the program; used to tell one job's recording from
    another's."""
    args = list(argv)
    while args:
        base = os.path.basename(args[0])
        if base in _LAUNCHERS or is_python(base):
            args = _skip_options(args[1:])
            if args[:1] == ["-m"] and len(args) > 1:
                if args[1] == "torch.distributed.run":
                    args = _skip_options(args[2:])
                    continue
                return f"-m {args[1]}"
            if base == "torchdoctor" and args[:1] in (["run"], ["launch"]):
                args = _skip_options(args[1:])
            if args[:1] == ["--"]:
                args = args[1:]
            if args[:1] == ["--no-python"]:
                args = args[1:]
            continue
        return os.path.normpath(args[0]) if args[0].endswith(".py") else base
    return ""


def _skip_options(args: list[str]) -> list[str]:
    """Drop leading ``--opt`` / ``--opt=value`` / ``--opt value`` launcher options."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "--", "--no-python"):
        if "=" not in args[i] and i + 1 < len(args) and not args[i + 1].startswith("-"):
            # torchrun's and torchdoctor's options all take a value unless they are flags;
            # a value that names the script would end up skipped, so stop at a .py file.
            if args[i + 1].endswith(".py"):
                i += 1
                break
            i += 2
            continue
        i += 1
    return args[i:]
