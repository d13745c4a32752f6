"""The checks ``launch`` runs before it starts anything: the doctor's checks that decide
whether a distributed job can start on this node (route and interfaces, rendezvous endpoint
and port, /dev/shm, CPU oversubscription, ranks the node cannot hold, the GPUs visible to it
and no more ranks than those, stale settings). An error refuses the launch (unless --force).
The checks are the doctor's own (:mod:`torchdoctor.doctor`): this module only picks them and
sorts their outcomes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


# The doctor checks (src/torchdoctor/doctor/) that decide whether a launch can start here.
PREFLIGHT_CHECKS = (
    "network.route",
    "network.gloo_socket_ifname",
    "network.nccl_socket_ifname",
    "network.hostname",
    "network.rendezvous",
    "host.shm",
    "host.cpu_oversubscription",
    "host.rank_count",
    "gpus.visible",
    "settings.environment",
)


def preflight(plan, *, gpu_status=None) -> PreflightReport:
    """Check the node for ``plan`` (a LaunchPlan) with the doctor's checks; ``gpu_status``
    is the GPUs as the launcher read them (None: the checks read them)."""
    from torchdoctor.doctor import ERROR, OK, WARNING, Plan, run_checks

    report = PreflightReport()
    env = dict(plan.env)
    addr = port = None
    if plan.rendezvous.startswith("static "):
        host, _, text = plan.rendezvous[len("static ") :].rpartition(":")
        addr, port = host, int(text)
    else:
        # --standalone: torchrun's store takes a free port on localhost; a MASTER_ADDR left
        # in the environment is not this run's endpoint.
        env.pop("MASTER_ADDR", None)
        env.pop("MASTER_PORT", None)
        report.passed.append("rendezvous port (chosen free by torchrun)")
    doctor_plan = Plan(
        master_addr=addr,
        master_port=port,
        nnodes=plan.nnodes,
        nproc_per_node=plan.nproc_per_node,
        env=env,
        gpu_status=gpu_status,
    )
    for check in run_checks(doctor_plan, PREFLIGHT_CHECKS):
        line = f"{check.name}: {check.saw}" + (f"; fix: {check.fix}" if check.fix else "")
        if check.status == ERROR:
            report.errors.append(line)
        elif check.status == WARNING:
            report.warnings.append(line)
        elif check.status == OK:
            report.passed.append(check.name)
    return report
