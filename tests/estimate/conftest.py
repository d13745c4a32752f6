"""Fixtures for the estimator tests: the example model factories, real and importable."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO

EXAMPLES = REPO / "examples"
MODELS_FILE = EXAMPLES / "estimate_models.py"


@pytest.fixture(scope="session")
def models():
    """examples/estimate_models.py as a module (the factories the README uses)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import estimate_models
    finally:
        sys.path.remove(str(EXAMPLES))
    return estimate_models


@pytest.fixture(autouse=True)
def _two_threads():
    """CI has two cores; the same number everywhere keeps kernel choices comparable."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def estimate_cli(capsys):
    """Run `torchdoctor estimate ARGS...` in this process (torch is imported once, not per
    test): (exit status, stdout, stderr)."""
    from torchdoctor.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exited:
            main(["estimate", *args])
        captured = capsys.readouterr()
        return exited.value.code, captured.out, captured.err

    return run
