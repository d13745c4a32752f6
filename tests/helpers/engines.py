"""The engines the tests drive for real (Slurm, munge, Prometheus, Chromium, tmux, network
namespaces, cgroups, root, the C compiler ...): one way to need one.

Where an engine is missing a test skips and says why; with ``CI=true`` it fails instead, so a
CI run that lost an engine (a package not installed, a capability dropped) cannot pass green.
The run ends with one line naming the engines that were exercised (tests/conftest.py).

Two forms, the same rule:

- in a test or fixture body: ``require_engine("tmux", None if shutil.which("tmux") else
  "tmux is not installed")``;
- as a mark on a test or a module: ``engine("prometheus", why_missing)`` (checked at set-up).

``why_missing`` is ``None`` when the engine is there, else the reason it is not.
"""

from __future__ import annotations

import os

import pytest

_exercised: set[str] = set()
_missing: dict[str, str] = {}


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require_engine(name: str, why_missing: str | None) -> None:
    """Carry on when the engine is there; otherwise skip, or fail when ``CI=true``."""
    if why_missing is None:
        _exercised.add(name)
        return
    _missing.setdefault(name, why_missing)
    message = f"needs {name}: {why_missing}"
    if on_ci():
        pytest.fail(f"{message} (CI=true: the set-up must provide it, see `make system`)")
    pytest.skip(message)


def engine(name: str, why_missing: str | None) -> pytest.MarkDecorator:
    """``require_engine`` as a mark, for a decorator or a module's ``pytestmark``."""
    return pytest.mark.engine(name, why_missing)


def not_root() -> str | None:
    return None if os.geteuid() == 0 else "needs root (CI runs as root)"


def summary() -> str:
    line = "engines exercised: " + (", ".join(sorted(_exercised)) or "none")
    absent = sorted(set(_missing) - _exercised)
    if absent:
        line += "; missing (skipped): " + ", ".join(absent)
    return line
