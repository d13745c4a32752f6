"""The rendezvous endpoint: an address every node can reach, and a port that is free or open.

torchrun's c10d rendezvous makes a node host the store when the endpoint is ``localhost``, a
loopback address or one of its own addresses; with several nodes and a ``localhost`` endpoint
every node hosts its own store, they never meet, and each waits out the 600 s join timeout.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

from torchdoctor.doctor.check import ERROR, OK, SKIPPED, WARNING, Check, env_port
from torchdoctor.doctor.facts import Facts
from torchdoctor.sampling import procfs
from torchdoctor.units import one_line

DEFAULT_PORT = 29500  # torchrun's default --master-port
CONNECT_TIMEOUT_S = 3.0
_TCP_LISTEN = "0A"


def listeners(port: int) -> list[int]:
    """Socket inodes listening on TCP ``port`` (IPv4 and IPv6), from /proc/net/tcp{,6}."""
    inodes = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        text = procfs.read_text(table) or ""
        for line in text.splitlines()[1:]:
            parts = line.split()
            if len(parts) < 10 or parts[3] != _TCP_LISTEN:
                continue
            try:
                if int(parts[1].rsplit(":", 1)[1], 16) == port:
                    inodes.append(int(parts[9]))
            except (ValueError, IndexError):
                continue
    return inodes


def socket_owners(inodes: list[int]) -> list[tuple[int, str]]:
    """(PID, command line) of the processes holding these sockets, among those we may inspect."""
    wanted = {f"socket:[{i}]" for i in inodes if i}
    owners = []
    if not wanted:
        return owners
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # another user's process: not ours to look into
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    argv = procfs.parse_cmdline(procfs.read_path(f"/proc/{pid}/cmdline", 65536))
                    owners.append((int(pid), one_line(argv, 80)))
                    break
            except OSError:
                continue
    return owners


def _is_local(facts: Facts, ip: str) -> bool:
    if ipaddress.IPv4Address(ip).is_loopback:
        return True
    return any(ip in iface.ipv4 for iface in facts.interfaces.values())


def check_rendezvous(facts: Facts) -> Check:
    plan = facts.plan
    raw_port = plan.env.get("MASTER_PORT", "")
    if plan.master_port is None and raw_port and env_port(plan.env) is None:
        # torch.distributed's env:// init reads int(MASTER_PORT) and would fail on it; the
        # check used to go on with port 29500 and say ok ('abc'), or crash on bind (99999).
        return Check(
            "network.rendezvous",
            ERROR,
            f"MASTER_PORT={raw_port!r} is not a TCP port: torch.distributed would fail to "
            "rendezvous on it",
            f"export MASTER_PORT={DEFAULT_PORT} (a port from 1 to 65535), or unset it",
        )
    port = plan.master_port or DEFAULT_PORT
    port_note = "" if plan.master_port else f" (torchrun's default port {DEFAULT_PORT})"
    if plan.master_addr is None:
        return Check(
            "network.rendezvous",
            SKIPPED,
            "no --master-addr / MASTER_ADDR: no rendezvous endpoint to check",
        )
    endpoint = f"{plan.master_addr}:{port}{port_note}"
    ip = facts.master_ip
    if ":" in plan.master_addr:
        return Check(
            "network.rendezvous", SKIPPED, f"{endpoint}: IPv6 endpoints are not checked yet"
        )
    if ip is None:
        return Check(
            "network.rendezvous",
            ERROR,
            f"{endpoint}: {plan.master_addr!r} does not resolve",
            "use the head node's IP address",
        )
    loopback = ipaddress.IPv4Address(ip).is_loopback or plan.master_addr == "localhost"
    if plan.multi_node and loopback:
        return Check(
            "network.rendezvous",
            ERROR,
            f"{endpoint} is a loopback endpoint with {plan.nnodes} nodes: every node would host "
            "its own store and wait out the 600 s join timeout",
            "use the head node's routable address (e.g. --rdzv-endpoint=<head IP>:"
            f"{port}); on a single node use torchrun --standalone",
        )
    details = {"endpoint": f"{ip}:{port}"}
    if _is_local(facts, ip):
        return _check_local_port(ip, port, endpoint, details)
    return _check_remote_port(ip, port, endpoint, details)


def _check_local_port(ip: str, port: int, endpoint: str, details: dict) -> Check:
    """The master is this machine: its store must be able to bind the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # As the store does: SO_REUSEADDR, so sockets in TIME_WAIT do not count as taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("" if not ipaddress.IPv4Address(ip).is_loopback else ip, port))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            return Check(
                "network.rendezvous", ERROR, f"{endpoint}: cannot bind: {exc.strerror}", ""
            )
        owners = socket_owners(listeners(port))
        who = (
            "; ".join(f"PID {pid}: {cmd}" for pid, cmd in owners)
            if owners
            else "a process this user cannot inspect"
        )
        details["owners"] = [pid for pid, _ in owners]
        return Check(
            "network.rendezvous",
            ERROR,
            f"{endpoint}: this node is the master and the port is in use by {who}",
            "pick a free port (--master-port), or stop that process if it is a leftover "
            "(torchdoctor never stops it for you)",
            details,
        )
    finally:
        sock.close()
    return Check(
        "network.rendezvous",
        OK,
        f"{endpoint}: this node is the master and the port is free",
        details=details,
    )


def _check_remote_port(ip: str, port: int, endpoint: str, details: dict) -> Check:
    """The master is another node: its address must answer (refused is fine before it starts)."""
    try:
        with socket.create_connection((ip, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except ConnectionRefusedError:
        return Check(
            "network.rendezvous",
            OK,
            f"{endpoint}: the master host answers; nothing listens on the port yet (normal "
            "before rank 0 starts)",
            details=details,
        )
    except TimeoutError:
        return Check(
            "network.rendezvous",
            ERROR,
            f"{endpoint}: no answer within {CONNECT_TIMEOUT_S:g} s, packets are dropped (firewall?)",
            f"allow TCP to port {port} on the master, and all TCP between the nodes on this "
            "interface (NCCL and gloo connect back on random ports)",
            details,
        )
    except OSError as exc:
        return Check(
            "network.rendezvous",
            ERROR,
            f"{endpoint}: cannot connect: {exc.strerror or exc}",
            "check the address and the route to the head node (network.route)",
            details,
        )
    return Check(
        "network.rendezvous",
        WARNING,
        f"{endpoint}: something already listens there (a running rendezvous, or another program "
        "on the port)",
        "if the job has not started yet, pick another --master-port on every node",
        details,
    )


CHECKS = (check_rendezvous,)
