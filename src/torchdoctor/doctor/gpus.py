"""GPUs: which ones a run will see, how they are wired, and who else holds their memory.

``CUDA_VISIBLE_DEVICES`` is read the way the CUDA runtime reads it: a comma list of indexes or
(prefixes of) UUIDs, parsed up to the first entry that names no device (entries after it are
silently dropped); an empty value hides every GPU. Indexes are in CUDA's order, which is
"fastest first" unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; NVML and nvidia-smi number GPUs in
PCI order. On a machine with different GPU models the same index can mean two devices.
"""

from __future__ import annotations

import pwd

from torchdoctor.doctor.check import ERROR, OK, SKIPPED, WARNING, Check
from torchdoctor.doctor.facts import Facts
from torchdoctor.sampling import procfs
from torchdoctor.sampling.gpu_topology import LEVEL_ACROSS_SOCKETS, P2P_STATUS, TOPOLOGY_LEVELS
from torchdoctor.sampling.types import GpuInfo
from torchdoctor.units import fmt_bytes, one_line


def _no_gpus(name: str, facts: Facts) -> Check | None:
    status = facts.gpu_status
    if not status.available:
        return Check(name, SKIPPED, f"NVML unavailable: {status.reason}")
    return None


def _no_links(name: str, facts: Facts, one_gpu: str) -> Check | None:
    """The check's answer when there are no GPU links to judge: no NVML, no topology, one GPU."""
    skipped = _no_gpus(name, facts)
    if skipped:
        return skipped
    topo = facts.topology
    if not topo.available:
        return Check(name, SKIPPED, f"NVML topology unreadable: {topo.reason}")
    if not topo.links:
        return Check(name, OK, one_gpu)
    return None


def visible_devices(value: str, gpus: list[GpuInfo]) -> tuple[list[int], list[str]]:
    """NVML indexes CUDA will see for a CUDA_VISIBLE_DEVICES value, and the problems found.

    Integer entries are taken as PCI-order indexes (right only with CUDA_DEVICE_ORDER=PCI_BUS_ID
    or identical GPUs; the caller warns otherwise).
    """
    chosen: list[int] = []
    problems: list[str] = []
    entries = [e.strip() for e in value.split(",")]
    for position, entry in enumerate(entries):
        match: int | None = None
        if entry.lstrip("-").isdigit():
            number = int(entry)
            if 0 <= number < len(gpus):
                match = number
        elif entry.startswith(("GPU-", "MIG-")) and len(entry) > 4:
            found = [g.index for g in gpus if g.uuid and g.uuid.startswith(entry)]
            if len(found) == 1:
                match = found[0]
            elif len(found) > 1:
                problems.append(f"{entry!r} is a prefix of {len(found)} GPUs' UUIDs")
                break
        if match is None:
            dropped = entries[position + 1 :]
            problems.append(
                f"{entry!r} names no GPU here"
                + (f", so CUDA also ignores what follows ({','.join(dropped)})" if dropped else "")
            )
            break
        if match in chosen:
            problems.append(f"GPU {match} is listed twice")
            break
        chosen.append(match)
    return chosen, problems


def check_visible(facts: Facts) -> Check:
    skipped = _no_gpus("gpus.visible", facts)
    if skipped:
        return skipped
    env = facts.plan.env
    gpus = facts.gpu_status.gpus
    names = ", ".join(f"{g.index}: {g.name} ({g.uuid or 'no UUID'})" for g in gpus)
    value = env.get("CUDA_VISIBLE_DEVICES")
    order = env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    if value is None:
        visible = [g.index for g in gpus]
        saw = f"{len(gpus)} GPU(s), all visible (CUDA_VISIBLE_DEVICES unset): {names}"
        problems: list[str] = []
    else:
        visible, problems = visible_devices(value, gpus)
        saw = f"CUDA_VISIBLE_DEVICES={value!r} -> GPUs {visible or 'none'} of {names}"
    details = {"visible": visible, "cuda_device_order": order}
    if value is not None and value.strip() == "":
        return Check(
            "gpus.visible",
            ERROR,
            saw,
            "CUDA_VISIBLE_DEVICES is empty, which hides every GPU: `unset CUDA_VISIBLE_DEVICES`",
            details,
        )
    if problems:
        return Check(
            "gpus.visible",
            ERROR,
            saw + "; " + "; ".join(problems),
            "list each GPU once, by index or UUID (`nvidia-smi -L` prints them), e.g. "
            f"CUDA_VISIBLE_DEVICES={','.join(str(g.index) for g in gpus)}",
            details,
        )
    nproc = facts.plan.nproc_per_node
    if nproc is not None and nproc > len(visible):
        return Check(
            "gpus.visible",
            ERROR,
            saw + f"; {nproc} ranks per node planned on {len(visible)} visible GPU(s)",
            f"use --nproc-per-node {len(visible)} (one rank per GPU; NCCL refuses two ranks on "
            "one GPU), or make more GPUs visible",
            details,
        )
    by_index = [entry.strip() for entry in (value or "").split(",")]
    uses_indexes = value is not None and any(e.isdigit() for e in by_index)
    models = {g.name for g in gpus}
    if uses_indexes and order != "PCI_BUS_ID" and len(models) > 1:
        uuids = ",".join(gpus[i].uuid or str(i) for i in visible)
        return Check(
            "gpus.visible",
            WARNING,
            saw + f"; GPU models differ ({', '.join(sorted(models))}) and CUDA_DEVICE_ORDER is "
            f"{order}: CUDA numbers the fastest GPU first, nvidia-smi/NVML in PCI order, so an "
            "index may select a different GPU than nvidia-smi shows",
            f"export CUDA_DEVICE_ORDER=PCI_BUS_ID, or name GPUs by UUID: "
            f"CUDA_VISIBLE_DEVICES={uuids}",
            details,
        )
    return Check("gpus.visible", OK, saw, details=details)


def check_topology(facts: Facts) -> Check:
    answer = _no_links("gpus.topology", facts, "one GPU: no traffic between GPUs on this node")
    if answer:
        return answer
    topo = facts.topology
    pairs = [f"GPU{link.a}-GPU{link.b}: {link.level_name}" for link in topo.links]
    details = {
        "links": [
            {"a": link.a, "b": link.b, "level": link.level_name, "nvlinks": link.nvlinks}
            for link in topo.links
        ]
    }
    saw = "; ".join(pairs)
    unknown = [link for link in topo.links if link.level is None and not link.nvlinks]
    across = [
        link
        for link in topo.links
        if not link.nvlinks and link.level is not None and link.level >= LEVEL_ACROSS_SOCKETS
    ]
    if across:
        names = ", ".join(f"GPU{link.a}-GPU{link.b}" for link in across)
        sockets: dict[int | None, list[int]] = {}
        for placement in topo.placements:
            sockets.setdefault(placement.numa_node, []).append(placement.index)
        groups = [
            ",".join(map(str, v)) for k, v in sorted(sockets.items(), key=lambda kv: str(kv[0]))
        ]
        return Check(
            "gpus.topology",
            WARNING,
            saw + f"; {names}: {TOPOLOGY_LEVELS[LEVEL_ACROSS_SOCKETS][1]}, the slowest path",
            "for jobs smaller than the node keep each job on the GPUs of one socket "
            f"(CUDA_VISIBLE_DEVICES={groups[0]}"
            + (f" or {groups[1]}" if len(groups) > 1 else "")
            + "); a job spanning sockets runs at the inter-socket bandwidth",
            details,
        )
    if unknown:
        reasons = {r for link in unknown for r in link.unavailable.values()}
        return Check("gpus.topology", SKIPPED, saw + "; unreadable: " + "; ".join(sorted(reasons)))
    return Check("gpus.topology", OK, saw, details=details)


def check_p2p(facts: Facts) -> Check:
    answer = _no_links("gpus.p2p", facts, "one GPU: peer-to-peer not needed")
    if answer:
        return answer
    topo = facts.topology
    unreadable = [link for link in topo.links if link.p2p is None]
    broken = [link for link in topo.links if link.p2p not in (None, 0)]
    saw = f"P2P reads between {len(topo.links) - len(broken) - len(unreadable)} of {len(topo.links)} GPU pairs"
    details = {
        "pairs": {
            f"{link.a}-{link.b}": P2P_STATUS.get(link.p2p, str(link.p2p))
            if link.p2p is not None
            else None
            for link in topo.links
        }
    }
    if broken:
        why = "; ".join(
            f"GPU{link.a}-GPU{link.b}: {P2P_STATUS.get(link.p2p, str(link.p2p))}" for link in broken
        )
        return Check(
            "gpus.p2p",
            WARNING,
            saw + f"; not possible: {why} (NCCL falls back to copies through host memory)",
            "on PCIe machines enable P2P: turn off PCIe ACS (BIOS, or `pci=noacs`) and put the "
            "IOMMU in pass-through (`iommu=pt`); if a P2P hang forced NCCL_P2P_DISABLE=1, treat it "
            "as a temporary workaround",
            details,
        )
    if unreadable:
        reasons = sorted({link.unavailable.get("p2p", "?") for link in unreadable})
        return Check(
            "gpus.p2p", SKIPPED, saw + "; NVML cannot say for the others: " + "; ".join(reasons)
        )
    return Check("gpus.p2p", OK, saw + " possible", details=details)


def _owner(pid: int | None) -> tuple[str, str]:
    """(user, command line) of a local PID, or what stops us from knowing."""
    if pid is None:
        return "?", "(in another PID namespace: not visible from here)"
    try:
        uid_line = [
            line
            for line in procfs.read_path(f"/proc/{pid}/status")
            .decode("ascii", "replace")
            .splitlines()
            if line.startswith("Uid:")
        ]
        uid = int(uid_line[0].split()[1])
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
    except (OSError, IndexError, ValueError):
        return "?", "(exited)"
    try:
        argv = procfs.parse_cmdline(procfs.read_path(f"/proc/{pid}/cmdline", 65536))
    except OSError:
        argv = []
    return user, one_line(argv, 80) if argv else "(command not readable)"


def check_processes(facts: Facts) -> Check:
    skipped = _no_gpus("gpus.processes", facts)
    if skipped:
        return skipped
    foreign = [p for p in facts.gpu_processes if not p.in_job]
    if not foreign:
        return Check("gpus.processes", OK, "no other process holds GPU memory")
    rows = []
    listed = []
    for p in sorted(foreign, key=lambda p: (p.gpu_index, p.pid)):
        user, command = _owner(p.local_pid)
        memory = fmt_bytes(p.used_memory, "memory n/a")
        rows.append(f"GPU{p.gpu_index}: PID {p.pid} ({user}) {memory}: {command}")
        listed.append(
            {
                "gpu": p.gpu_index,
                "pid": p.pid,
                "user": user,
                "memory": p.used_memory,
                "command": command,
            }
        )
    note = facts.gpu_status.process_pids_unresolved
    pids = " ".join(str(p) for p in sorted({p.pid for p in foreign}))
    return Check(
        "gpus.processes",
        WARNING,
        f"{len(foreign)} other process(es) hold GPU memory: "
        + "; ".join(rows)
        + (f" ({note})" if note else ""),
        "check whether they are leftovers of an earlier run (`ps -o pid,user,etime,args -p "
        f"{pids}`) and stop them yourself if so; torchdoctor never kills them. Otherwise give "
        "this run other GPUs (CUDA_VISIBLE_DEVICES)",
        {"processes": listed},
    )


CHECKS = (check_visible, check_topology, check_p2p, check_processes)
