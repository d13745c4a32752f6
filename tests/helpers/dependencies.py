"""The Python packages the tests import beyond torchdoctor's own dependencies: one way to need one.

They are not optional: `make setup` installs every one (``pip install -e '.[all]' --group dev``
and the pinned CPU torch). A test whose package is missing fails, naming the package and what
installs it, where it used to skip: a run that lost a dependency must not pass green with
whole areas untested. (Programs and machine features, which a laptop may lack, are engines:
tests/helpers/engines.py.)
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

INSTALL = "pip install -e '.[all]' --group dev"

# What brings each package (pyproject.toml's [dependency-groups] and the Makefile's torch pin).
FROM = {
    "jsonschema": "the `test` group of [dependency-groups] (in `dev`)",
    "build": "the `test` group of [dependency-groups] (in `dev`)",
    "sphinx": "the `docs` group of [dependency-groups] (in `dev`)",
    "sphinx_click": "the `docs` group of [dependency-groups] (in `dev`)",
    "yaml": "the `kubernetes` extra (in `all`)",
    "kubeflow_trainer_api": "the `kubernetes` extra (in `all`)",
    "kubeflow.training": "the `kubernetes` extra (in `all`)",
    "kubernetes": "the `kubernetes` extra (in `all`)",
    "ray": "the `ray` extra (in `all`)",
    "accelerate": "the `test` group of [dependency-groups] (in `dev`)",
    "ray.train": "the `ray` extra (in `all`)",
    "torch": "`make setup`, which pins the CPU build (the `dev` group's lightning pulls a CUDA one)",
}


def require(module: str) -> ModuleType:
    """``module`` imported, or the test fails saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(
            f"{module} is not installed ({exc}); it comes with {FROM[module]}: run `make setup`, "
            f"or `.venv/bin/{INSTALL}`",
            pytrace=False,
        )
