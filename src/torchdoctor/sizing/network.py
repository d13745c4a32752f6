"""The network settings a job's nodes need: from `torchdoctor doctor --json`, else the recording.

`doctor` run on a cluster node says which interface NCCL and gloo must use there
(``export NCCL_SOCKET_IFNAME==ib0 GLOO_SOCKET_IFNAME=ib0``); its JSON is what sbatch reads, so
the advice reaches every node of the job. Settings the recorded run had are carried over too,
marked as such: an interface name from another machine may not exist on the cluster's nodes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.input_files import read_small_file
from torchdoctor.sizing.figure import Figure

# NCCL_* and the socket choices of gloo and TensorPipe: what decides how ranks reach each other.
NETWORK_ENV_PREFIXES = ("NCCL_", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
_EXPORT = re.compile(r"export\s+((?:[A-Z][A-Z0-9_]*=\S+\s*)+)")


def recorded_network_env(env: dict[str, str]) -> dict[str, Figure]:
    return {
        k: Figure(v, "as the recorded run had it")
        for k, v in env.items()
        if k.startswith(NETWORK_ENV_PREFIXES)
    }


def doctor_network_env(path: str | Path) -> dict[str, Figure]:
    """The variables `doctor`'s network checks tell to export, from its ``--json`` output."""
    # Read as a settings file (a regular file, 1 MiB at most): /dev/zero was read to its end.
    text = read_small_file(path, "doctor --json file")
    try:
        data = json.loads(text)
        checks = data["checks"]
    except (ValueError, KeyError, TypeError):
        raise UserError(
            f"{path} is not the output of `torchdoctor doctor --json`: run that on a cluster "
            "node and save what it prints"
        ) from None
    out: dict[str, Figure] = {}
    for check in checks:
        name, fix = str(check.get("name", "")), str(check.get("fix") or "")
        if not name.startswith("network.") or check.get("status") not in ("warning", "error"):
            continue
        for match in _EXPORT.finditer(fix):
            for assignment in match.group(1).split():
                key, _, value = assignment.partition("=")
                # "<that interface>": doctor could not name one; nothing to export
                if key.startswith(NETWORK_ENV_PREFIXES) and "<" not in value:
                    out[key] = Figure(value, f"torchdoctor doctor ({name}): {check.get('saw')}")
    return out
