"""A real one-node Slurm cluster (Debian's slurm-wlm 22.05 + munge), started for a test as root.

Everything lives in one temporary folder: munged on its own socket with its own key (the
machine's /run/munge and /etc/munge are left alone), slurm.conf on free ports with state and
spool dirs here, SLURM_CONF pointing at it. The daemons run in the foreground as our
children and are stopped by their PIDs, after any job left is cancelled.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DEADLINE_S = 60.0
POLL_S = 0.2
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"}


def why_not_startable() -> str | None:
    """Why a cluster cannot start here, or None."""
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd and munged needs root (CI runs as root)"
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "munge"):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"{tool} is not installed (`make system` installs slurm-wlm and munge)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "there is no munge user (the munge package creates it)"
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=60, check=check
        )

    def wait_for_job(self, job_id: str, deadline_s: float = 600.0) -> dict[str, str]:
        """Poll scontrol until the job reaches a final state; its fields."""
        from torchdoctor.slurm.client import parse_pairs

        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            out = self.run("scontrol", "show", "job", "-o", job_id).stdout
            fields = parse_pairs(out)
            if fields.get("JobState") in FINAL_STATES:
                return fields
            time.sleep(POLL_S)
        raise AssertionError(f"job {job_id} did not finish within {deadline_s} s: {out}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted((self.root / "log").glob("*"))
        )


def start_cluster() -> SlurmCluster:
    # munged wants every folder above its socket searchable by all: not pytest's 0700 tmp.
    root = Path(tempfile.mkdtemp(prefix="td-slurm-"))
    root.chmod(0o755)
    cluster = SlurmCluster(root, dict(os.environ))
    try:
        _start(cluster)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def _start(cluster: SlurmCluster) -> None:
    root = cluster.root
    munge_user = pwd.getpwnam("munge")
    munge_dir = root / "munge"
    munge_dir.mkdir(mode=0o755)
    os.chown(munge_dir, munge_user.pw_uid, munge_user.pw_gid)
    key = munge_dir / "munge.key"
    if shutil.which("mungekey"):
        subprocess.run([_tool("mungekey"), "--create", f"--keyfile={key}"], check=True)
    else:
        key.write_bytes(os.urandom(1024))
    os.chown(key, munge_user.pw_uid, munge_user.pw_gid)
    key.chmod(0o400)
    sock = munge_dir / "munge.socket"
    for name in ("log", "state", "spool"):
        (root / name).mkdir()
    cluster.procs.append(
        _spawn(
            [
                _tool("munged"),
                "--foreground",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
                f"--log-file={munge_dir / 'munged.log'}",
            ],
            root / "log" / "munged.out",
            user="munge",
            group="munge",
        )
    )
    _until(lambda: sock.exists(), "munged to create its socket", cluster)
    host = socket.gethostname().split(".")[0]
    node_line = subprocess.run(
        [_tool("slurmd"), "-C"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=td
SlurmctldHost={host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root / "log" / "jobcomp.log"}
SlurmctldLogFile={root / "log" / "slurmctld.log"}
SlurmdLogFile={root / "log" / "slurmd.log"}
{node_line} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    )
    cluster.env["SLURM_CONF"] = str(conf)
    for daemon in ("slurmctld", "slurmd"):
        cluster.procs.append(
            _spawn([_tool(daemon), "-D"], root / "log" / f"{daemon}.out", env=cluster.env)
        )

    def idle() -> bool:
        res = cluster.run("sinfo", "-h", "-o", "%T", check=False)
        return res.returncode == 0 and res.stdout.split() == ["idle"]

    _until(idle, "the node to show idle in sinfo", cluster)


def _spawn(argv: list[str], log: Path, **kwargs) -> subprocess.Popen:
    with open(log, "wb") as out:  # the daemon keeps its own copy of the descriptor
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **kwargs)


def _until(condition, what: str, cluster: SlurmCluster) -> None:
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        if condition():
            return
        for proc in cluster.procs:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{proc.args[0]} exited ({proc.returncode}) while waiting for {what}\n"
                    + cluster.logs()
                )
        time.sleep(POLL_S)
    raise RuntimeError(f"timed out waiting for {what}\n{cluster.logs()}")


def stop_cluster(cluster: SlurmCluster) -> None:
    """Cancel what is left, stop the daemons by PID (newest first), remove the folder."""
    if "SLURM_CONF" in cluster.env and all(p.poll() is None for p in cluster.procs[1:]):
        cluster.run("scancel", "--user=root", check=False)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            res = cluster.run("squeue", "-h", "-o", "%i", check=False)
            if res.returncode != 0 or not res.stdout.strip():
                break
            time.sleep(POLL_S)
    for proc in reversed(cluster.procs):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    shutil.rmtree(cluster.root, ignore_errors=True)
