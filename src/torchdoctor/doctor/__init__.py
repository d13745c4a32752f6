"""``torchdoctor doctor``: check the machine and the fabric before a distributed run.

    from torchdoctor.doctor import Plan, run_checks
    checks = run_checks(Plan(master_addr="10.0.0.1", master_port=29500, nnodes=2), ["network"])

Each check family is one module (versions, gpus, network, rendezvous, host, settings) of
functions taking the shared :class:`~torchdoctor.doctor.facts.Facts` and returning a
:class:`Check`.
"""

from torchdoctor.doctor.check import ERROR, OK, SKIPPED, STATUSES, WARNING, Check, Plan
from torchdoctor.doctor.runner import FAMILIES, NAMES, exit_status, run_checks

__all__ = [
    "ERROR",
    "FAMILIES",
    "NAMES",
    "OK",
    "SKIPPED",
    "STATUSES",
    "WARNING",
    "Check",
    "Plan",
    "exit_status",
    "run_checks",
]
