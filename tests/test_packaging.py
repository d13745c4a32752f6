"""The package as a user gets it: `python -m build` gives an sdist and a wheel, and the wheel,
installed into a fresh virtualenv (its dependencies from the package index, as pip is set up
here), runs `torchdoctor --version` and records a command."""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import torchdoctor
from tests.helpers.dependencies import require

REPO = Path(__file__).resolve().parent.parent


def _clean_env() -> dict[str, str]:
    """This test's environment without our source tree on the path: the venv must import the
    installed wheel, not the checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _has_setuptools(major: int) -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= major


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    require("build")
    out = tmp_path_factory.mktemp("dist")
    # The sdist is built from a copy: build writes egg-info beside the sources.
    src = tmp_path_factory.mktemp("src") / "torchdoctor"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "__pycache__",
            "*.egg-info",
            "torchdoctor-runs",
            "_build",
            "build",
            "*.so",  # the editable install's build of the compiled path: the wheel builds its own
        ),
    )
    # Without isolation when this environment has the build backend pyproject asks for: the same
    # artefacts, without downloading setuptools into two throwaway environments.
    isolation = ["--no-isolation"] if _has_setuptools(77) else []
    proc = subprocess.run(
        [sys.executable, "-m", "build", *isolation, "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("torchdoctor-*.whl")
    return wheel


def test_build_gives_an_sdist_and_a_wheel_with_the_package_data(dist):
    version = torchdoctor.__version__
    sdist = dist / f"torchdoctor-{version}.tar.gz"
    assert sdist.exists()
    with tarfile.open(sdist) as tar:
        assert f"torchdoctor-{version}/src/torchdoctor/instrument/agent/_fast.c" in tar.getnames()
    # With a C compiler (make system installs one) the wheel carries the agent's compiled fast
    # path and is tagged for this Python; without one it would be pure (py3-none-any).
    wheel = _wheel(dist)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert wheel.name.startswith(f"torchdoctor-{version}-{tag}-{tag}-linux_"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = email.message_from_bytes(z.read(f"torchdoctor-{version}.dist-info/METADATA"))
    assert any(n.startswith("torchdoctor/instrument/agent/_fast.cpython-") for n in names)
    assert "torchdoctor/py.typed" in names
    assert "torchdoctor/exporters/grafana-dashboard.json" in names
    data = f"torchdoctor-{version}.data/data/share/man/man1/"
    assert data + "torchdoctor.1" in names and data + "torchdoctor-run.1" in names
    assert meta["Version"] == version
    assert "Operating System :: POSIX :: Linux" in meta.get_all("Classifier")
    extras = set(meta.get_all("Provides-Extra"))
    assert {"prometheus", "parquet", "tensorboard", "all"} <= extras
    # test and documentation tools are dependency groups, never published extras
    assert "test" not in extras
    requires = " ".join(meta.get_all("Requires-Dist"))
    assert "pytest" not in requires and "sphinx" not in requires.lower()
    # attach sees steps after a plain install: py-spy is a base dependency (not behind an
    # extra), and the `attach` extra stays for older instructions
    assert any(
        r.startswith("py-spy") and "extra ==" not in r for r in meta.get_all("Requires-Dist")
    ), meta.get_all("Requires-Dist")
    assert "attach" in extras


def test_the_wheel_installs_and_runs_in_a_fresh_venv(dist, tmp_path):
    wheel = _wheel(dist)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py, td = venv / "bin" / "python", venv / "bin" / "torchdoctor"
    env = _clean_env()
    install = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    version = subprocess.run(
        [str(td), "--version"], capture_output=True, text=True, timeout=60, env=env
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"torchdoctor, version {torchdoctor.__version__}"
    rec = tmp_path / "pass.sqlite"
    run = subprocess.run(
        [str(td), "run", "--quiet", "--out", str(rec), "--", str(py), "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert rec.exists()
    # py-spy came with it, where attach looks for it first (beside the venv's python)
    from torchdoctor.sampling.pystacks import py_spy_path

    found = subprocess.run(
        [str(py), "-c", f"import {py_spy_path.__module__} as m; print(m.py_spy_path())"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )
    assert found.stdout.strip() == str(venv / "bin" / "py-spy"), found.stdout + found.stderr
    # the man pages came with it
    assert (venv / "share" / "man" / "man1" / "torchdoctor-run.1").exists()
    # it is the installed copy that ran, not this checkout
    where = subprocess.run(
        [str(py), "-c", "import torchdoctor; print(torchdoctor.__file__)"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert where.stdout.strip().startswith(str(venv))
    # and its agent takes the compiled path that the wheel built
    path = subprocess.run(
        [
            str(py),
            "-c",
            "from torchdoctor.instrument.agent import compiled; print(compiled.FAST_PATH)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert path.stdout.strip() == "compiled", path.stdout + path.stderr
