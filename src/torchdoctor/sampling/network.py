"""The machine's network as a distributed run sees it: interfaces, the route to a peer, link speed.

Read from /proc and /sys only (no root, no netlink socket): ``/proc/net/route`` for the IPv4
routing table, ``/sys/class/net/<if>`` for state, kind and rated speed, and psutil for the
addresses. What the kernel would pick to reach an address is decided the way it decides for a
simple (single-table) set-up: an address of this machine goes over ``lo``, otherwise the
longest matching prefix wins, then the lowest metric. Policy routing (``ip rule``) is not
modelled; :func:`route_to` says which table it read.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass, field

from torchdoctor.sampling.procfs import read_text

SYS_NET = "/sys/class/net"
PROC_ROUTE = "/proc/net/route"

# Interface name prefixes of virtual devices that never leave the machine (or only through a
# bridge): a multi-node run that picks one of them talks to itself or to a container.
VIRTUAL_PREFIXES = (
    "lo",
    "docker",
    "veth",
    "br-",
    "virbr",
    "cni",
    "flannel",
    "cali",
    "vxlan",
    "tun",
    "tap",
    "kube",
    "weave",
    "podman",
    "lxc",
    "ifb",
    "dummy",
)

_RTF_UP = 0x0001


@dataclass(slots=True)
class Interface:
    """One network interface as /sys and the address table describe it."""

    name: str
    up: bool  # administratively up and carrier present (operstate up/unknown with IFF_UP)
    operstate: str
    addresses: list[str] = field(default_factory=list)  # IPv4 and IPv6, without prefix length
    kind: str = "physical"  # physical | loopback | virtual
    speed_mbps: int | None = None  # rated speed from sysfs; None when the driver gives none
    speed_reason: str | None = None  # why there is no speed

    @property
    def ipv4(self) -> list[str]:
        return [a for a in self.addresses if ":" not in a]


@dataclass(frozen=True, slots=True)
class Route:
    """The route the kernel would take to ``destination``."""

    destination: str
    interface: str
    gateway: str | None
    source: str | None  # an IPv4 address of ``interface`` (the likely source address)
    via: str  # how it was decided: "local address", "route 10.0.0.0/8", "default route"


def link_speed(name: str, sys_net: str = SYS_NET) -> tuple[int | None, str | None]:
    """Rated speed in Mbit/s from sysfs, or ``(None, why)``."""
    text = read_text(f"{sys_net}/{name}/speed")
    if text is None:
        if not os.path.exists(f"{sys_net}/{name}"):
            return None, f"no interface {name}"
        return None, f"{name} reports no speed (a virtual device, or the link is down)"
    try:
        speed = int(text)
    except ValueError:
        return None, f"{name}: unreadable speed {text!r}"
    if speed <= 0:
        return None, f"{name} reports speed {speed} (unknown: no link, or a virtual device)"
    return speed, None


def _kind(name: str, sys_net: str) -> str:
    if name == "lo":
        return "loopback"
    base = f"{sys_net}/{name}"
    # Physical devices have a "device" link to their bus device; bonds, VLANs and macvlans
    # sit on top of one ("bonding" folder, "lower_*" links). Bridges, veths, tunnels do not.
    if os.path.exists(f"{base}/device") or os.path.isdir(f"{base}/bonding"):
        return "physical"
    try:
        if any(entry.startswith("lower_") for entry in os.listdir(base)):
            return "physical"
    except OSError:
        pass
    return "virtual"


def interfaces(sys_net: str = SYS_NET) -> dict[str, Interface]:
    """Every interface of this network namespace, by name."""
    try:
        names = sorted(os.listdir(sys_net))
    except OSError:
        names = []
    addresses: dict[str, list[str]] = {}
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    addresses.setdefault(name, []).append(a.address.split("%")[0])
        names = sorted(set(names) | set(addresses))
    except Exception:  # psutil is a dependency, but an exotic /proc must not break the doctor
        pass
    result: dict[str, Interface] = {}
    for name in names:
        operstate = read_text(f"{sys_net}/{name}/operstate") or "unknown"
        flags_text = read_text(f"{sys_net}/{name}/flags")
        try:
            admin_up = bool(int(flags_text, 16) & 0x1) if flags_text else operstate == "up"
        except ValueError:
            admin_up = operstate == "up"
        # Loopback and many virtual devices say "unknown" while working.
        up = admin_up and operstate in ("up", "unknown")
        kind = _kind(name, sys_net)
        speed, reason = (
            (None, "loopback has no rated speed") if kind == "loopback" else (None, None)
        )
        if kind != "loopback":
            speed, reason = link_speed(name, sys_net)
        result[name] = Interface(
            name=name,
            up=up,
            operstate=operstate,
            addresses=addresses.get(name, []),
            kind=kind,
            speed_mbps=speed,
            speed_reason=reason,
        )
    return result


def is_virtual(name: str, sys_net: str = SYS_NET) -> bool:
    """Whether traffic through ``name`` stays on this machine or in a container network:
    loopback, bridges, veths, tunnels (by sysfs, or by the usual names when sysfs is missing)."""
    if os.path.isdir(f"{sys_net}/{name}"):
        return _kind(name, sys_net) != "physical"
    return name.startswith(VIRTUAL_PREFIXES)


def resolve_ipv4(host: str) -> str | None:
    """The first IPv4 address ``host`` resolves to (the order the resolver gives)."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        return None
    return infos[0][4][0] if infos else None


def _hex_ipv4(text: str) -> ipaddress.IPv4Address:
    # /proc/net/route writes addresses as the host-order hex of the network-order integer.
    return ipaddress.IPv4Address(int(text, 16).to_bytes(4, "little"))


def read_routes(path: str = PROC_ROUTE) -> list[tuple[str, ipaddress.IPv4Network, str | None, int]]:
    """(interface, network, gateway or None, metric) for every route that is up."""
    text = read_text(path)
    routes = []
    for line in (text or "").splitlines()[1:]:
        parts = line.split()
        if len(parts) < 8:
            continue
        try:
            iface, dest, gateway, flags, metric, mask = (
                parts[0],
                _hex_ipv4(parts[1]),
                _hex_ipv4(parts[2]),
                int(parts[3], 16),
                int(parts[6]),
                _hex_ipv4(parts[7]),
            )
            network = ipaddress.IPv4Network(f"{dest}/{mask}", strict=False)
        except ValueError:
            continue
        if not flags & _RTF_UP:
            continue
        routes.append((iface, network, str(gateway) if int(gateway) else None, metric))
    return routes


def route_to(
    address: str, ifaces: dict[str, Interface] | None = None, route_file: str = PROC_ROUTE
) -> Route | None:
    """The interface the kernel would use to reach an IPv4 ``address``; None when unroutable."""
    dest = ipaddress.IPv4Address(address)
    ifaces = interfaces() if ifaces is None else ifaces
    if dest.is_loopback:
        return Route(address, "lo", None, "127.0.0.1", "loopback address")
    for iface in ifaces.values():
        if address in iface.ipv4:
            # This machine's own address: peers reach it through the interface that holds it.
            return Route(address, iface.name, None, address, "local address")
    best = None
    for iface, network, gateway, metric in read_routes(route_file):
        if dest in network:
            key = (network.prefixlen, -metric)
            if best is None or key > best[0]:
                best = (key, iface, network, gateway)
    if best is None:
        return None
    _key, iface, network, gateway = best
    via = "default route" if network.prefixlen == 0 else f"route {network}"
    own = ifaces.get(iface)
    source = own.ipv4[0] if own and own.ipv4 else None
    return Route(address, iface, gateway, source, via)


def tc_rate_cap(name: str) -> tuple[int | None, str | None]:
    """The egress rate (bytes/s) a tc qdisc (tbf, htb...) sets on ``name``, or (None, why).

    Needs the ``tc`` program (iproute2); reading qdiscs needs no root.
    """
    tc = shutil.which("tc") or ("/usr/sbin/tc" if os.path.exists("/usr/sbin/tc") else None)
    if tc is None:
        return None, "tc (iproute2) not installed: traffic shaping not checked"
    try:
        out = subprocess.run(
            [tc, "-j", "qdisc", "show", "dev", name],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        qdiscs = json.loads(out.stdout or "[]")
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None, "tc gave no readable answer"
    rates = [
        int(q["options"]["rate"])
        for q in qdiscs
        if isinstance(q.get("options"), dict) and isinstance(q["options"].get("rate"), int)
    ]
    return (min(rates), None) if rates else (None, None)
