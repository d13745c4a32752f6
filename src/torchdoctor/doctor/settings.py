"""Settings left behind: workaround and debug variables that make NCCL slow or hangs endless.

NCCL's documentation says of its debug variables that they "should not be used in production
nor retained in scripts ... may result in sub-optimal behavior, crashes, or hangs". They end up
in ``.bashrc``, job scripts, container images and NCCL's own configuration files
(``/etc/nccl.conf``, ``~/.nccl.conf``, or ``NCCL_CONF_FILE``), which NCCL reads as
``NAME=value`` lines, with the environment taking precedence.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from torchdoctor.doctor.check import OK, WARNING, Check
from torchdoctor.doctor.facts import Facts

# name -> (bad when: predicate on the value, what it does)
STALE: dict[str, tuple[str, str]] = {
    "NCCL_P2P_DISABLE": (
        "set",
        "GPU peer-to-peer (NVLink/PCIe) off: copies go through host memory",
    ),
    "NCCL_P2P_LEVEL": ("set", "limits P2P to a topology level"),
    "NCCL_SHM_DISABLE": ("set", "shared-memory transport off between processes of one node"),
    "NCCL_IB_DISABLE": ("set", "InfiniBand/RoCE off: NCCL uses TCP sockets"),
    "NCCL_NET": ("set", "forces one network plugin (Socket: no InfiniBand)"),
    "NCCL_ALGO": ("set", "forces one collective algorithm instead of NCCL's tuned choice"),
    "NCCL_PROTO": ("set", "forces one protocol instead of NCCL's tuned choice"),
    "NCCL_MAX_NCHANNELS": ("set", "caps the channels (parallel rings) and so the bandwidth"),
    "NCCL_NTHREADS": ("set", "changes the threads per channel"),
    "NCCL_BLOCKING_WAIT": ("truthy", "blocks the CPU on every collective (old name)"),
    "TORCH_NCCL_BLOCKING_WAIT": (
        "truthy",
        "blocks the CPU on every collective: 4-8 GPUs train about as fast as one (pytorch#50820)",
    ),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": (
        "zero",
        "0 turns error handling off: a failed or timed-out collective hangs forever",
    ),
    "NCCL_ASYNC_ERROR_HANDLING": ("zero", "0 turns error handling off (old name)"),
}
DEFAULT_CONF_FILES = ("/etc/nccl.conf", "~/.nccl.conf")


def _bad(rule: str, value: str) -> bool:
    value = value.strip()
    if rule == "set":
        return value != ""
    if rule == "truthy":
        return value.lower() not in ("", "0", "false", "no", "off")
    if rule == "zero":
        return value == "0"
    raise ValueError(rule)


def stale_settings(values: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(name, value, what it does) for every left-behind setting among ``values``."""
    found = []
    for name, (rule, effect) in STALE.items():
        value = values.get(name)
        if value is not None and _bad(rule, value):
            found.append((name, value, effect))
    return found


def read_conf(path: str) -> dict[str, str]:
    """NAME=value lines of an NCCL configuration file (``#`` starts a comment)."""
    values: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                name, sep, value = line.partition("=")
                if sep and name.strip():
                    values[name.strip()] = value.strip()
    except OSError:
        pass
    return values


def conf_files(env: Mapping[str, str]) -> list[str]:
    files = [os.path.expanduser(p) for p in DEFAULT_CONF_FILES]
    if env.get("NCCL_CONF_FILE"):
        files.append(env["NCCL_CONF_FILE"])
    return files


def _unset_fix(names: list[str]) -> str:
    return f"`unset {' '.join(names)}` (and remove them from .bashrc / job scripts), then re-measure with `torchdoctor bench allreduce`"


def check_environment(facts: Facts) -> Check:
    found = stale_settings(facts.plan.env)
    if not found:
        return Check(
            "settings.environment",
            OK,
            "no NCCL workaround or debug variable set in the environment",
        )
    saw = "; ".join(f"{n}={v}: {effect}" for n, v, effect in found)
    return Check(
        "settings.environment",
        WARNING,
        saw,
        _unset_fix([n for n, _, _ in found]),
        {"variables": {n: v for n, v, _ in found}},
    )


def check_conf_files(facts: Facts) -> Check:
    present = [p for p in conf_files(facts.plan.env) if os.path.isfile(p)]
    if not present:
        return Check(
            "settings.nccl_conf",
            OK,
            "no NCCL configuration file (" + ", ".join(DEFAULT_CONF_FILES) + ")",
        )
    problems = []
    lines = []
    for path in present:
        values = read_conf(path)
        lines.append(f"{path}: {', '.join(f'{k}={v}' for k, v in values.items()) or 'empty'}")
        for name, value, effect in stale_settings(values):
            shadowed = " (overridden by the environment)" if name in facts.plan.env else ""
            problems.append((path, name, value, effect + shadowed))
    if not problems:
        return Check("settings.nccl_conf", OK, "; ".join(lines))
    return Check(
        "settings.nccl_conf",
        WARNING,
        "; ".join(f"{path}: {name}={value}: {effect}" for path, name, value, effect in problems),
        "delete "
        + ", ".join(f"the {name} line of {path}" for path, name, _, _ in problems)
        + ", then re-measure with `torchdoctor bench allreduce`",
        {"files": {p: read_conf(p) for p in present}},
    )


CHECKS = (check_environment, check_conf_files)
