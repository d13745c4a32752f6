"""The checks ``launch`` runs before it starts anything: the few that decide whether a
distributed job can start on this node at all. An error refuses the launch (unless --force).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

SHM_MIN_BYTES = 512 * 2**20  # below this DataLoader workers die with SIGBUS (ds_report warns)


@dataclass
class PreflightReport:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"preflight error: {e}" for e in self.errors]
        out += [f"preflight warning: {w}" for w in self.warnings]
        if self.passed:
            out.append("preflight ok: " + ", ".join(self.passed))
        return out

    def as_dict(self) -> dict:
        return {"errors": self.errors, "warnings": self.warnings, "passed": self.passed}


def preflight(plan, *, gpu_status=None) -> PreflightReport:
    """Check the node for ``plan`` (a LaunchPlan)."""
    report = PreflightReport()
    _check_port(plan, report)
    _check_interface(plan, report)
    _check_shm(report)
    _check_threads(plan, report)
    _check_gpus(plan, gpu_status, report)
    return report


def _check_port(plan, report: PreflightReport) -> None:
    if not plan.rendezvous.startswith("static ") or plan.node_rank != 0:
        if plan.rendezvous.startswith("standalone"):
            report.passed.append("rendezvous port (chosen free by torchrun)")
        return
    host, _, port = plan.rendezvous[len("static ") :].rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host if host not in ("localhost",) else "127.0.0.1", int(port)))
        except OSError as exc:
            report.errors.append(
                f"port {port} on {host} is not free ({exc.strerror}): another job holds it; "
                "pick another --master-port (on every node)"
            )
            return
    report.passed.append(f"port {port} free")


def _check_interface(plan, report: PreflightReport) -> None:
    if plan.nnodes == 1:
        return
    from torchdoctor.coordination.launch import egress_interface

    host = plan.rendezvous[len("static ") :].rpartition(":")[0]
    found = egress_interface(host)
    if found is None:
        report.errors.append(
            f"no route to --master-addr {host} from this node: check the address, or the "
            "network between the nodes"
        )
        return
    name, local = found
    if name == "lo" and plan.node_rank != 0:
        report.errors.append(f"--master-addr {host} is on this node's loopback ({name})")
        return
    chosen = plan.env.get("GLOO_SOCKET_IFNAME")
    if chosen and chosen != name:
        report.warnings.append(
            f"GLOO_SOCKET_IFNAME={chosen}, but {host} is reached through {name} ({local})"
        )
    report.passed.append(f"interface {name} ({local}) reaches {host}")


def _check_shm(report: PreflightReport) -> None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        report.warnings.append("/dev/shm is missing: DataLoader workers cannot share batches")
        return
    size = st.f_frsize * st.f_blocks
    if size < SHM_MIN_BYTES:
        report.warnings.append(
            f"/dev/shm holds only {size // 2**20} MiB: DataLoader workers may die with SIGBUS; "
            "give the container --shm-size=1g or --ipc=host"
        )
    else:
        report.passed.append(f"/dev/shm {size // 2**20} MiB")


def _check_threads(plan, report: PreflightReport) -> None:
    from torchdoctor.coordination.launch import usable_cpus

    cores = usable_cpus()
    try:
        threads = int(plan.env.get("OMP_NUM_THREADS", "1"))
    except ValueError:
        report.warnings.append(f"OMP_NUM_THREADS={plan.env['OMP_NUM_THREADS']!r} is not a number")
        return
    total = threads * plan.nproc_per_node
    if total > cores:
        report.warnings.append(
            f"{plan.nproc_per_node} ranks x OMP_NUM_THREADS={threads} = {total} threads on "
            f"{cores} usable cores: set OMP_NUM_THREADS={max(1, cores // plan.nproc_per_node)}"
        )
    else:
        report.passed.append(f"{total} threads on {cores} cores")


def _check_gpus(plan, gpu_status, report: PreflightReport) -> None:
    if gpu_status is None or not gpu_status.available or not gpu_status.gpus:
        return
    n = len(gpu_status.gpus)
    if plan.nproc_per_node > n:
        report.errors.append(
            f"{plan.nproc_per_node} ranks on {n} GPU(s): ranks would share a GPU; "
            f"use --nproc-per-node {n}"
        )
    else:
        report.passed.append(f"{plan.nproc_per_node} rank(s) on {n} GPU(s), one each")
