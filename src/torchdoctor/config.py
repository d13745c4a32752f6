"""Defaults the user sets once: where recordings go, the sampling interval, the threshold table
and the exporter's address.

Each setting is taken from the first of (highest first):

1. the command's flag (``--out-dir``, ``--interval``, ``--thresholds``, ``--listen``);
2. an environment variable: ``TORCHDOCTOR_RUNS_DIR``, ``TORCHDOCTOR_INTERVAL``,
   ``TORCHDOCTOR_THRESHOLDS`` (a TOML file), ``TORCHDOCTOR_EXPORTER_LISTEN``,
   ``TORCHDOCTOR_AUTO_PROFILE`` (``0`` switches the automatic profiler window off);
3. ``[tool.torchdoctor]`` in the nearest pyproject.toml (this folder or a parent): keys
   ``runs_dir``, ``interval``, ``exporter_listen``, ``auto_profile`` (true/false) and the table
   ``[tool.torchdoctor.thresholds]``;
4. the user's file ``$XDG_CONFIG_HOME/torchdoctor/config.toml`` (``~/.config/...`` when
   ``XDG_CONFIG_HOME`` is unset): the same keys at top level, thresholds under ``[thresholds]``;
5. the built-in default (``./torchdoctor-runs``, 1 s, the published table, 127.0.0.1:9842,
   automatic profiling on).

A relative ``runs_dir`` is relative to the file that names it (the project's folder for
pyproject.toml), so every command run anywhere in a project records into the same folder.
Thresholds merge key by key down the same order.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.input_files import read_small_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

DEFAULT_RUNS_DIR = Path("torchdoctor-runs")
ENV_RUNS_DIR = "TORCHDOCTOR_RUNS_DIR"
ENV_INTERVAL = "TORCHDOCTOR_INTERVAL"
ENV_THRESHOLDS = "TORCHDOCTOR_THRESHOLDS"
ENV_EXPORTER_LISTEN = "TORCHDOCTOR_EXPORTER_LISTEN"
ENV_AUTO_PROFILE = "TORCHDOCTOR_AUTO_PROFILE"
KEYS = ("runs_dir", "interval", "exporter_listen", "auto_profile", "thresholds")
# What $TORCHDOCTOR_AUTO_PROFILE may say (any case): the words a shell user types for a switch.
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Source:
    """One layer of settings: where it was read (for messages) and what it holds."""

    name: str
    folder: Path | None  # what a relative runs_dir is relative to
    values: dict[str, Any]


def user_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "torchdoctor" / "config.toml"


def find_pyproject(start: Path | None = None) -> Path | None:
    """The nearest pyproject.toml in ``start`` (default: this folder) or a parent; None also
    when this folder was deleted (a shell left in a removed folder can still run commands:
    there is no project to read settings from, not a reason to refuse to run)."""
    if start is None:
        try:
            start = Path.cwd()
        except FileNotFoundError:
            return None
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def read_toml(path: Path, what: str = "file") -> dict[str, Any]:
    """The TOML file ``path`` (``what`` it is, for the messages), read through input_files:
    a regular file of at most 1 MiB, every failure one line."""
    data = read_small_file(path, what)
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UserError(f"{str(path)!r} is not valid TOML: not UTF-8 text ({exc.reason})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{str(path)!r} is not valid TOML: {exc}") from None


def sources(search_from: Path | None = None) -> list[Source]:
    """The file layers, highest first: the nearest pyproject.toml, then the user's file."""
    found: list[Source] = []
    pyproject = find_pyproject(search_from)
    if pyproject is not None:
        table = read_toml(pyproject).get("tool", {}).get("torchdoctor", {})
        found.append(_checked(Source(f"{pyproject} [tool.torchdoctor]", pyproject.parent, table)))
    user = user_config_path()
    if user.is_file():
        found.append(_checked(Source(str(user), user.parent, read_toml(user))))
    return found


def _checked(source: Source) -> Source:
    # Tables other parts of torchdoctor may read are let through; a mistyped key is not.
    unknown = sorted(
        k for k, v in source.values.items() if k not in KEYS and not isinstance(v, dict)
    )
    if unknown:
        raise UserError(
            f"{source.name}: unknown setting {unknown[0]!r}; known ones: {', '.join(KEYS)}"
        )
    return source


def runs_dir(flag: str | os.PathLike[str] | None = None) -> Path:
    """The one recordings folder: flag > TORCHDOCTOR_RUNS_DIR > pyproject > user config >
    ./torchdoctor-runs."""
    return runs_dir_setting(flag)[0]


def runs_dir_setting(flag: str | os.PathLike[str] | None = None) -> tuple[Path, str | None]:
    """:func:`runs_dir` and who chose it when not the flag nor the default
    (``$TORCHDOCTOR_RUNS_DIR``, ``runs_dir in <file>``): an unusable folder's message says
    what to change, which the user may have set long ago."""
    if flag:
        return Path(flag), None
    env = os.environ.get(ENV_RUNS_DIR)
    if env:
        return Path(os.path.expanduser(env)), f"${ENV_RUNS_DIR}"
    for source in sources():
        value = source.values.get("runs_dir")
        if value is not None:
            if not isinstance(value, str) or not value:
                raise UserError(f"{source.name}: runs_dir must be a folder name (a string)")
            path = Path(os.path.expanduser(value))
            if not path.is_absolute() and source.folder is not None:
                path = source.folder / path
            return path, f"runs_dir in {source.name}"
    return DEFAULT_RUNS_DIR, None


def interval(default: float, examples: str) -> tuple[float, str | None]:
    """Seconds between samples from TORCHDOCTOR_INTERVAL > pyproject > user config (the flag
    outranks them all: the caller reads it), and who set them, as an error about the value
    should say: ``$TORCHDOCTOR_INTERVAL``, ``<file>: interval``, or None for ``default``."""
    from torchdoctor.units import parse_duration

    env = os.environ.get(ENV_INTERVAL)
    if env:
        where = f"${ENV_INTERVAL}"
        return parse_duration(env, where, examples=examples), where
    for source in sources():
        value = source.values.get("interval")
        if value is None:
            continue
        where = f"{source.name}: interval"
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise UserError(f"{where} must be seconds (a number or '2s')")
        if isinstance(value, str):
            return parse_duration(value, where, examples=examples), where
        return float(value), where
    return default, None


def exporter_listen(flag: str | None) -> tuple[str | None, str]:
    """The exporter's [ADDR:]PORT: flag > TORCHDOCTOR_EXPORTER_LISTEN > pyproject > user
    config (None for the built-in default), and who set it, for the message a bad value
    gets: ``--listen``, ``$TORCHDOCTOR_EXPORTER_LISTEN`` or ``<file>: exporter_listen``."""
    if flag:
        return flag, "--listen"
    env = os.environ.get(ENV_EXPORTER_LISTEN)
    if env:
        return env, f"${ENV_EXPORTER_LISTEN}"
    for source in sources():
        value = source.values.get("exporter_listen")
        if value is not None:
            return str(value), f"{source.name}: exporter_listen"
    return None, "--listen"


def auto_profile(environ: Mapping[str, str] | None = None) -> tuple[bool, str | None]:
    """Whether the automatic profiler window may be taken (run/auto_profile.py):
    ``$TORCHDOCTOR_AUTO_PROFILE`` of ``environ`` (default: ours; a queued job's is the one it
    was submitted with) > pyproject > user config > on; and who set it (``--no-auto-profile``
    sets the variable), None for the default."""
    environ = os.environ if environ is None else environ
    env = environ.get(ENV_AUTO_PROFILE)
    if env:
        word = env.strip().lower()
        if word in _ON or word in _OFF:
            return word in _ON, f"${ENV_AUTO_PROFILE}"
        raise UserError(
            f"${ENV_AUTO_PROFILE} = {env!r}: use 0 (off) or 1 (on), as --no-auto-profile sets it"
        )
    for source in sources():
        value = source.values.get("auto_profile")
        if value is None:
            continue
        if not isinstance(value, bool):
            raise UserError(f"{source.name}: auto_profile must be true or false, not {value!r}")
        return value, f"{source.name}: auto_profile"
    return True, None


def threshold_tables(
    flag: str | os.PathLike[str] | None, search_from: Path | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """The threshold tables that apply, lowest first (user config, pyproject, the file of
    TORCHDOCTOR_THRESHOLDS or of the flag), each with where it came from."""
    tables: list[tuple[str, dict[str, Any]]] = []
    for source in reversed(sources(search_from)):
        table = source.values.get("thresholds")
        if table:
            if not isinstance(table, dict):
                raise UserError(f"{source.name}: thresholds must be a table")
            tables.append((f"{source.name} thresholds", table))
    file = flag or os.environ.get(ENV_THRESHOLDS)
    if file:
        data = read_toml(Path(file), "thresholds file")
        table = data.get("thresholds", data)
        if not isinstance(table, dict):
            # `thresholds = 5` as the whole file: a one-line answer, not a TypeError later
            raise UserError(
                f"{file}: thresholds must be a table ([thresholds] and key = number lines), "
                f"got {table!r}"
            )
        tables.append((str(file), table))
    return tables
