"""ARCHITECTURE.md stays true: the packages it names exist, its floors are the layers the
import linter enforces (pyproject.toml), and the modules and names it points to are there."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "src" / "torchdoctor"
DOC = (REPO / "ARCHITECTURE.md").read_text()
LAYERS_CONTRACT = "floors"


def documented_floors() -> list[set[str]]:
    """The packages of each row of the floor table, top floor first."""
    table = DOC.split("## The floors", 1)[1].split("\n## ", 1)[0]
    floors = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1].startswith("`"):
            floors.append(set(re.findall(r"`([a-z_]+)`", cells[1])))
    return floors


def linted_floors() -> list[set[str]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["name"].startswith(LAYERS_CONTRACT)]
    return [
        {name.strip().removeprefix("torchdoctor.") for name in layer.split("|")}
        for layer in layers["layers"]
    ]


def test_every_package_named_exists_and_every_package_is_named():
    named = set().union(*documented_floors())
    assert named, "ARCHITECTURE.md has no floor table"
    for name in sorted(named):
        assert (PACKAGE / name / "__init__.py").is_file(), f"ARCHITECTURE.md names {name}/"
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages - named == set(), "packages ARCHITECTURE.md does not place on a floor"


def test_the_floors_are_the_linters_layers():
    assert documented_floors() == linted_floors()


def backticked() -> list[str]:
    return re.findall(r"`([^`]+)`", DOC)


@pytest.mark.parametrize(
    "path", sorted({t for t in backticked() if re.fullmatch(r"[a-z_/]+(\.py|/)", t) and "/" in t})
)
def test_every_path_named_exists(path):
    assert (PACKAGE / path).exists() or (REPO / path).exists(), path


@pytest.mark.parametrize(
    "dotted",
    sorted(
        t
        for t in backticked()
        if re.fullmatch(r"[a-z_]+(\.[A-Za-z_]+)+", t)
        and (PACKAGE / t.split(".")[0] / "__init__.py").is_file()
    ),
)
def test_every_module_and_name_named_exists(dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        try:
            found = importlib.import_module("torchdoctor." + ".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            assert hasattr(found, attr), f"{dotted}: no {attr}"
            found = getattr(found, attr)
        return
    pytest.fail(f"{dotted} is not a module of torchdoctor")
