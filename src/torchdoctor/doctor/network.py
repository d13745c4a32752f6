"""The network: which interface gloo and NCCL would use to reach MASTER_ADDR, and whether it works.

The two socket-interface variables differ in syntax, a classic trap:

- ``NCCL_SOCKET_IFNAME`` is a comma list of name *prefixes*; ``^`` in front excludes them,
  ``=`` asks for exact names (``^=`` both). Unset, NCCL skips ``lo`` and ``docker*``.
- ``GLOO_SOCKET_IFNAME`` is a comma list of *exact* interface names, nothing else. Unset, gloo
  binds the address the host name resolves to, which /etc/hosts often maps to 127.0.1.1.
"""

from __future__ import annotations

import os
import resource
import socket

from torchdoctor.doctor.check import ERROR, OK, SKIPPED, WARNING, Check
from torchdoctor.doctor.facts import Facts
from torchdoctor.sampling import network
from torchdoctor.sampling.network import Interface
from torchdoctor.sampling.procfs import read_text

NCCL_DEFAULT_EXCLUDE = ("docker", "lo")


def nccl_matches(spec: str, names: list[str]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME=spec selects among ``names`` (NCCL's matching rules)."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    if exclude:
        spec = spec[1:]
    exact = spec.startswith("=")
    if exact:
        spec = spec[1:]
    patterns = [p.strip() for p in spec.split(",") if p.strip()]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in patterns)

    return [n for n in names if hit(n) != exclude]


def _usable(iface: Interface | None) -> bool:
    return iface is not None and iface.up and bool(iface.addresses)


def _fix_ifname(name: str) -> str:
    return f"export NCCL_SOCKET_IFNAME=={name} GLOO_SOCKET_IFNAME={name}"


def check_route(facts: Facts) -> Check:
    plan = facts.plan
    if plan.master_addr is None:
        route = facts.route
        if plan.multi_node:
            return Check(
                "network.route",
                ERROR,
                f"{plan.nnodes} nodes planned but no master address given",
                "pass --master-addr HOST (the head node's address the others can reach) or set "
                "MASTER_ADDR",
            )
        if route is None:
            return Check("network.route", OK, "no MASTER_ADDR (single node) and no default route")
        return Check(
            "network.route",
            OK,
            f"no MASTER_ADDR (single node); the default route leaves through {route.interface}",
            details={"interface": route.interface, "source": route.source},
        )
    if ":" in plan.master_addr:
        return Check(
            "network.route",
            SKIPPED,
            f"MASTER_ADDR {plan.master_addr} is IPv6: only the IPv4 routing table is read",
        )
    if facts.master_ip is None:
        return Check(
            "network.route",
            ERROR,
            f"MASTER_ADDR {plan.master_addr!r} does not resolve to an IPv4 address here",
            "use the head node's IP address, or a name every node resolves (check /etc/hosts, DNS)",
        )
    route = facts.route
    target = plan.master_addr + (
        f" ({facts.master_ip})" if facts.master_ip != plan.master_addr else ""
    )
    if route is None:
        return Check(
            "network.route",
            ERROR,
            f"no route to MASTER_ADDR {target} in /proc/net/route",
            "check the address, or add a route (`ip route add ...`) on the interface that "
            "reaches the head node",
        )
    details = {
        "interface": route.interface,
        "source": route.source,
        "gateway": route.gateway,
        "via": route.via,
        "master_ip": facts.master_ip,
    }
    saw = f"MASTER_ADDR {target} is reached through {route.interface} ({route.via}" + (
        f", gateway {route.gateway})" if route.gateway else ")"
    )
    if plan.multi_node and route.interface == "lo":
        return Check(
            "network.route",
            ERROR,
            saw + f"; with {plan.nnodes} nodes the other nodes cannot reach a loopback address",
            "use the head node's routable address for --master-addr / MASTER_ADDR",
            details,
        )
    if plan.multi_node and network.is_virtual(route.interface):
        return Check(
            "network.route",
            WARNING,
            saw + f"; {route.interface} is a virtual interface (container bridge, veth or "
            "overlay): bandwidth between machines goes through it",
            "if the nodes have a direct link, use its address for MASTER_ADDR and "
            + _fix_ifname("<that interface>"),
            details,
        )
    return Check("network.route", OK, saw, details=details)


def check_nccl_ifname(facts: Facts) -> Check:
    value = facts.plan.env.get("NCCL_SOCKET_IFNAME")
    names = sorted(facts.interfaces)
    route = facts.route
    if value is None:
        chosen = nccl_matches("^" + ",".join(NCCL_DEFAULT_EXCLUDE), names)
        chosen = [n for n in chosen if _usable(facts.interface(n))]
        ib = [n for n in chosen if n.startswith("ib")]
        first = (ib or chosen or ["lo"])[0]
        saw = f"NCCL_SOCKET_IFNAME unset: NCCL would pick {first} (skips lo and docker*)"
        if facts.plan.multi_node and first == "lo":
            return Check(
                "network.nccl_socket_ifname",
                ERROR,
                saw + ": no other interface is up with an address, and lo reaches no other node",
                "bring up the interface that reaches the other nodes (`ip link set <dev> up`), "
                "then export NCCL_SOCKET_IFNAME==<dev>",
                {"interfaces": [first]},
            )
        # A loopback route is network.route's error; lo is no advice for several nodes.
        if facts.plan.multi_node and route and route.interface not in (first, "lo"):
            return Check(
                "network.nccl_socket_ifname",
                WARNING,
                saw + f", but MASTER_ADDR is reached through {route.interface}",
                f"export NCCL_SOCKET_IFNAME=={route.interface}",
                {"interfaces": [first]},
            )
        return Check("network.nccl_socket_ifname", OK, saw, details={"interfaces": [first]})
    chosen = nccl_matches(value, names)
    usable = [n for n in chosen if _usable(facts.interface(n))]
    saw = f"NCCL_SOCKET_IFNAME={value!r} selects {', '.join(chosen) or 'no interface'}"
    details = {"interfaces": usable}
    if not usable:
        down = [n for n in chosen if n not in usable]
        return Check(
            "network.nccl_socket_ifname",
            ERROR,
            saw
            + (f" ({', '.join(down)} down or without an address)" if down else "")
            + f"; interfaces here: {', '.join(names)}",
            (
                f"export NCCL_SOCKET_IFNAME=={route.interface}"
                if route
                else "name an interface that is up"
            )
            + " (a prefix, `=name` for an exact name, `^` to exclude)",
            details,
        )
    if facts.plan.multi_node and route and route.interface not in usable + ["lo"]:
        return Check(
            "network.nccl_socket_ifname",
            ERROR,
            saw + f", but MASTER_ADDR is reached through {route.interface}",
            f"export NCCL_SOCKET_IFNAME=={route.interface}",
            details,
        )
    return Check("network.nccl_socket_ifname", OK, saw, details=details)


def check_gloo_ifname(facts: Facts) -> Check:
    value = facts.plan.env.get("GLOO_SOCKET_IFNAME")
    route = facts.route
    if value is None:
        return Check(
            "network.gloo_socket_ifname",
            OK,
            "GLOO_SOCKET_IFNAME unset: gloo binds the address the host name resolves to "
            "(see network.hostname)",
        )
    names = [n.strip() for n in value.split(",")]
    if any(n.startswith(("^", "=")) for n in names):
        return Check(
            "network.gloo_socket_ifname",
            ERROR,
            f"GLOO_SOCKET_IFNAME={value!r} uses NCCL's ^/= syntax; gloo takes exact interface "
            "names only and fails with 'Unable to find address for'",
            f"export GLOO_SOCKET_IFNAME={route.interface if route else '<interface>'}",
        )
    missing = [n for n in names if n not in facts.interfaces]
    unusable = [n for n in names if n in facts.interfaces and not _usable(facts.interface(n))]
    fix = (
        f"export GLOO_SOCKET_IFNAME={route.interface}"
        if route
        else f"name an interface that is up: one of {', '.join(sorted(facts.interfaces))}"
    )
    if missing or unusable:
        problems = [f"no interface {n!r}" for n in missing] + [
            f"{n} is down or has no address" for n in unusable
        ]
        return Check(
            "network.gloo_socket_ifname",
            ERROR,
            f"GLOO_SOCKET_IFNAME={value!r}: "
            + "; ".join(problems)
            + f" (interfaces here: {', '.join(sorted(facts.interfaces))})",
            fix,
        )
    saw = f"GLOO_SOCKET_IFNAME={value!r}: up, address " + ", ".join(
        facts.interfaces[n].addresses[0] for n in names
    )
    if facts.plan.multi_node and route and route.interface not in names + ["lo"]:
        return Check(
            "network.gloo_socket_ifname",
            ERROR,
            saw + f", but MASTER_ADDR is reached through {route.interface}",
            fix,
        )
    if facts.plan.multi_node and "lo" in names:
        return Check(
            "network.gloo_socket_ifname", ERROR, saw + "; lo cannot reach other nodes", fix
        )
    return Check("network.gloo_socket_ifname", OK, saw, details={"interfaces": names})


def check_hostname(facts: Facts) -> Check:
    host = socket.gethostname()
    address = network.resolve_ipv4(host)
    if address is None:
        return Check(
            "network.hostname",
            WARNING if not facts.plan.env.get("GLOO_SOCKET_IFNAME") else OK,
            f"host name {host!r} does not resolve (gloo without GLOO_SOCKET_IFNAME needs it to)",
            f"add '<this node's IP> {host}' to /etc/hosts, or set GLOO_SOCKET_IFNAME",
        )
    saw = f"host name {host!r} resolves to {address}"
    loopback = address.startswith("127.")
    if not loopback:
        return Check("network.hostname", OK, saw, details={"address": address})
    route = facts.route
    iface = route.interface if route and route.interface != "lo" else "<interface>"
    if facts.plan.env.get("GLOO_SOCKET_IFNAME"):
        return Check(
            "network.hostname",
            OK,
            saw + " (loopback), but GLOO_SOCKET_IFNAME overrides it",
            details={"address": address},
        )
    if facts.plan.multi_node:
        return Check(
            "network.hostname",
            ERROR,
            saw + " (loopback): gloo would advertise it to the other nodes, which then fail "
            f"with 'connectFullMesh failed ... remote=[{address}]'",
            f"export GLOO_SOCKET_IFNAME={iface} (or map {host} to the node's IP in /etc/hosts)",
            {"address": address},
        )
    return Check(
        "network.hostname",
        OK,
        saw + " (loopback): fine on one node; a multi-node run needs GLOO_SOCKET_IFNAME",
        details={"address": address},
    )


def check_link_speed(facts: Facts) -> Check:
    route = facts.route
    if route is None:
        return Check("network.link_speed", SKIPPED, "no route to measure a link for")
    iface = facts.interface(route.interface)
    if route.interface == "lo" or iface is None:
        return Check(
            "network.link_speed", SKIPPED, f"{route.interface}: loopback has no link speed"
        )
    cap, _why = network.tc_rate_cap(route.interface)
    details = {"interface": route.interface, "speed_mbps": iface.speed_mbps, "tc_rate_bps": cap}
    if iface.speed_mbps is None:
        return Check(
            "network.link_speed", SKIPPED, iface.speed_reason or "no speed", details=details
        )
    target = iface.speed_mbps * 1e6 / 8 * 0.85
    saw = (
        f"{route.interface}: rated {iface.speed_mbps} Mbit/s ({iface.speed_mbps / 8000:.3g} GB/s); "
        f"85 % of it, the busbw to expect across nodes, is {target / 1e9:.3g} GB/s"
    )
    if cap is not None and cap * 8 < iface.speed_mbps * 1e6:
        return Check(
            "network.link_speed",
            WARNING,
            saw + f"; a tc qdisc caps its egress at {cap * 8 / 1e6:g} Mbit/s",
            f"remove the shaping if it is not meant for this run: `tc qdisc del dev {route.interface} root`",
            details,
        )
    return Check("network.link_speed", OK, saw, details=details)


def _memlock() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return soft


def check_infiniband(facts: Facts, sys_ib: str = "/sys/class/infiniband") -> Check:
    try:
        devices = sorted(os.listdir(sys_ib))
    except OSError:
        devices = []
    if not devices:
        return Check(
            "network.infiniband",
            OK,
            "no InfiniBand/RoCE device: NCCL uses TCP sockets between nodes",
        )
    ports = []
    active = 0
    for dev in devices:
        base = f"{sys_ib}/{dev}/ports"
        try:
            numbers = sorted(os.listdir(base))
        except OSError:
            numbers = []
        for port in numbers:
            state = (read_text(f"{base}/{port}/state") or "?").split(":")[-1].strip()
            layer = read_text(f"{base}/{port}/link_layer") or "?"
            ports.append(f"{dev}/{port} {state} ({layer})")
            active += state == "ACTIVE"
    saw = f"RDMA devices: {', '.join(ports) or ', '.join(devices)}"
    problems, fixes = [], []
    if not os.path.isdir("/dev/infiniband"):
        problems.append("/dev/infiniband is missing (a container without the device)")
        fixes.append("start the container with --device /dev/infiniband --cap-add IPC_LOCK")
    memlock = _memlock()
    if memlock != resource.RLIM_INFINITY:
        problems.append(f"locked-memory limit is {memlock // 1024} KiB, not unlimited")
        fixes.append("raise it: `ulimit -l unlimited` (Docker: --ulimit memlock=-1)")
    if active == 0:
        problems.append("no port is ACTIVE")
        fixes.append("check the cable / subnet manager (`ibstat`)")
    if facts.gpu_status.available and not os.path.isdir("/sys/module/nvidia_peermem"):
        problems.append("nvidia_peermem is not loaded (no GPUDirect RDMA)")
        fixes.append("`modprobe nvidia_peermem`")
    if problems:
        blocking = any(p.startswith(("/dev", "no port")) for p in problems)
        return Check(
            "network.infiniband",
            ERROR if blocking else WARNING,
            saw + "; " + "; ".join(problems) + ": NCCL silently falls back to TCP sockets",
            "; ".join(fixes),
        )
    return Check("network.infiniband", OK, saw)


CHECKS = (
    check_route,
    check_nccl_ifname,
    check_gloo_ifname,
    check_hostname,
    check_link_speed,
    check_infiniband,
)
