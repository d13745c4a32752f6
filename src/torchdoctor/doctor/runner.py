"""Running the checks: all of them, or the families / names a caller picks (the launcher's
preflight runs a subset)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torchdoctor.doctor import gpus, host, network, rendezvous, settings, versions
from torchdoctor.doctor.check import ERROR, SKIPPED, Check, Plan
from torchdoctor.doctor.facts import Facts

CheckFn = Callable[[Facts], Check]

# (name, function), in the order they are shown: versions, GPUs, network, host, settings.
REGISTRY: tuple[tuple[str, CheckFn], ...] = (
    ("versions.python", versions.check_python),
    ("versions.torch", versions.check_torch),
    ("versions.driver", versions.check_driver),
    ("versions.agent", versions.check_agent),
    ("gpus.visible", gpus.check_visible),
    ("gpus.topology", gpus.check_topology),
    ("gpus.p2p", gpus.check_p2p),
    ("gpus.processes", gpus.check_processes),
    ("network.route", network.check_route),
    ("network.nccl_socket_ifname", network.check_nccl_ifname),
    ("network.gloo_socket_ifname", network.check_gloo_ifname),
    ("network.hostname", network.check_hostname),
    ("network.rendezvous", rendezvous.check_rendezvous),
    ("network.link_speed", network.check_link_speed),
    ("network.infiniband", network.check_infiniband),
    ("host.shm", host.check_shm),
    ("host.open_files", host.check_open_files),
    ("host.numa", host.check_numa),
    ("host.cpu_oversubscription", host.check_oversubscription),
    ("host.rank_count", host.check_rank_count),
    ("settings.environment", settings.check_environment),
    ("settings.nccl_conf", settings.check_conf_files),
)
NAMES = tuple(name for name, _ in REGISTRY)
FAMILIES = tuple(dict.fromkeys(name.split(".")[0] for name in NAMES))


def select(only: Iterable[str] | None) -> list[tuple[str, CheckFn]]:
    """The registry entries named by ``only`` (check names or family names); all when None."""
    if only is None:
        return list(REGISTRY)
    wanted = list(only)
    unknown = [w for w in wanted if w not in NAMES and w not in FAMILIES and w != "bench"]
    if unknown:
        raise ValueError(
            f"unknown check(s) {', '.join(unknown)}; known: {', '.join(FAMILIES + NAMES)}"
        )
    return [(n, fn) for n, fn in REGISTRY if n in wanted or n.split(".")[0] in wanted]


def run_checks(plan: Plan | None = None, only: Iterable[str] | None = None) -> list[Check]:
    """Run the checks for ``plan`` (default: this machine, a single-node run).

    ``only`` picks check names ("network.route") or families ("network", "host"); with
    ``plan.bench`` (or "bench" in ``only``) a short all-reduce sweep runs last. A check that
    raises is reported as skipped with the error, and the others still run.
    """
    plan = plan or Plan()
    facts = Facts(plan)
    results = []
    entries = select(only)
    for name, fn in entries:
        try:
            result = fn(facts)
        except Exception as exc:  # a check must never take the others down
            result = Check(name, SKIPPED, f"the check failed to run: {type(exc).__name__}: {exc}")
        results.append(result)
    if plan.bench or (only is not None and "bench" in only):
        from torchdoctor.doctor.bench_check import check_bench

        results.append(check_bench(plan))
    return results


def exit_status(checks: list[Check]) -> int:
    """0 when no check is an error, 1 otherwise."""
    return 1 if any(c.status == ERROR for c in checks) else 0
