"""``--json`` means stdout is only JSON: one document, with its ``schema_version`` and a JSON
Schema of its own in ``torchdoctor/cli/schemas/<name>.schema.json``; what user code prints
meanwhile goes to stderr."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

SCHEMAS_DIR = Path(__file__).parent / "schemas"
# name -> schema version of that document. A version goes up when a field changes meaning or
# goes away; added fields keep it.
SCHEMA_VERSIONS: dict[str, int] = {
    "bench-allreduce": 1,
    "bench-scaling": 1,
    "compare": 1,
    "diagnose": 1,
    "doctor": 1,
    "estimate": 1,
    "estimate-from": 1,
    "estimate-max-batch": 1,
    "export": 1,
    "handoff": 1,
    "handoff-status": 1,
    "ls": 1,
    "report": 1,
    "run": 1,
    "sbatch": 1,
    "show": 1,
    "slurm-status": 1,
    "submit": 1,
    "top": 1,
    "tune": 1,
}


def versioned(name: str, document: dict[str, Any]) -> dict[str, Any]:
    """``document`` with its ``schema_version`` first."""
    return {"schema_version": SCHEMA_VERSIONS[name], **document}


def dump_json(name: str, document: dict[str, Any], *, indent: int | None = 2) -> None:
    """Print the document ``name`` on stdout, versioned."""
    click.echo(json.dumps(versioned(name, document), indent=indent))


def schema_path(name: str) -> Path:
    return SCHEMAS_DIR / f"{name}.schema.json"


@contextlib.contextmanager
def user_output_to_stderr(active: bool = True) -> Iterator[None]:
    """While the block runs (a model's constructor and forward, a factory's imports), send
    stdout to stderr: Python's ``print`` by ``sys.stdout``, and C code writing to fd 1 by the
    descriptor. Nothing is lost; it just does not mix with the JSON printed after."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = None
    with contextlib.suppress(OSError):
        saved = os.dup(1)
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
