"""systemd units for a shared machine: the machine-wide scheduler and the exporter.

The scheduler must stay root (it starts each job as its submitter), so it cannot have
``NoNewPrivileges=`` or a narrowed capability set that drops setuid/setgid, and it must leave
the users' homes writable (their jobs write there, as them). What it can have: its own state
folder (``StateDirectory=``), a read-only /usr and /boot (``ProtectSystem=full``: a job may
still write /etc only if its own user could, and root's jobs are root's), no kernel tunables or
modules, and a restart when it dies, which loses nothing (the state is on disk). The exporter
changes no uid: it gets the full set (``NoNewPrivileges=``, ``ProtectSystem=strict``,
``ProtectHome=read-only``, ``PrivateTmp=``, no capabilities but reading others' files).
"""

from __future__ import annotations

import errno
import os
import shlex
import sys
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.output_files import write_output_file

QUEUE_UNIT = "torchdoctor-queue.service"
EXPORTER_UNIT = "torchdoctor-exporter.service"


def _exec(*args: str) -> str:
    return shlex.join([sys.executable, "-m", "torchdoctor", *args])


def queue_unit() -> str:
    return f"""[Unit]
Description=torchdoctor machine-wide job queue (every user's jobs, each run as its submitter)
After=local-fs.target

[Service]
Type=simple
ExecStart={_exec("queue", "serve", "--system")}
Restart=on-failure
RestartSec=2
# The state (SQLite) lives here; kill -9 or a reboot loses no job and no exit status.
StateDirectory=torchdoctor
StateDirectoryMode=0755
Environment=TORCHDOCTOR_SYSTEM_DIR=/var/lib/torchdoctor
# Jobs are started in their own sessions and must survive a restart of the scheduler.
KillMode=process
ProtectSystem=full
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
ProtectClock=yes
RestrictRealtime=yes
LockPersonality=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK

[Install]
WantedBy=multi-user.target
"""


def exporter_unit() -> str:
    return f"""[Unit]
Description=torchdoctor Prometheus exporter (every user's recorded jobs, on 127.0.0.1)
After=network.target

[Service]
Type=simple
ExecStart={_exec("exporter", "--all-users")}
Restart=on-failure
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=read-only
PrivateTmp=yes
PrivateDevices=no
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
CapabilityBoundingSet=CAP_DAC_READ_SEARCH

[Install]
WantedBy=multi-user.target
"""


def write_units(folder: str | Path) -> list[Path]:
    """Write both units into ``folder``; their paths.

    Each by :mod:`torchdoctor.output_files`, replacing an earlier install: a unit that is a
    symlink to /dev/null (masked with ``systemctl mask``) is refused, where writing through it
    and chmodding it made /dev/null 0644, unwritable for everyone but root."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):  # read-only, or root's and this is not root
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as exc:
        # The default /etc/systemd/system is root's; a read-only or mistyped --dir is the
        # same mistake: say where, and how to go on.
        raise UserError(
            f"cannot write the unit files into {folder} ({exc.strerror or exc}): run it as root, "
            "or give --dir a folder you can write"
        ) from None
    written = []
    for name, text in ((QUEUE_UNIT, queue_unit()), (EXPORTER_UNIT, exporter_unit())):
        write_output_file(folder / name, text, "--dir", force=True, mode=0o644)
        written.append(folder / name)
    return written
