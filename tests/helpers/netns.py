"""Two "machines" for tests: two network namespaces joined by a veth pair, optionally shaped.

    from tests.helpers.netns import netns_unavailable, veth_pair

    pytestmark = engine("network namespaces", netns_unavailable())  # tests/helpers/engines

    with veth_pair(rate_mbit=200) as pair:
        server = pair.popen(pair.a, sys.executable, "-m", "http.server", "--bind", pair.a.address)
        pair.run(pair.b, "curl", f"http://{pair.a.address}:8000/")

- Names are unique per call (PID, a counter and random bits), so parallel test runs and
  leftovers of a killed run never collide; addresses are a /30 out of the benchmarking range
  198.18.0.0/15 (RFC 2544) and exist only inside the two namespaces: traffic never leaves
  the machine.
- ``rate_mbit`` puts a token-bucket (tbf) qdisc on both ends' egress, so each direction of
  the link carries at most that rate.
- Everything is torn down when the ``with`` block ends, also when it raises: processes
  started through :meth:`VethPair.popen` are killed by their PIDs, then both namespaces are
  deleted (which deletes the veth pair with them).

Needs root and iproute2 (``ip``, ``tc``); :func:`netns_unavailable` says why not otherwise.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

BENCHMARK_NET = ipaddress.IPv4Network("198.18.0.0/15")
_counter = itertools.count()
_probe_result: list[str | None] = []


@dataclass(frozen=True)
class NetnsEnd:
    """One side: a namespace, its end of the veth pair and that end's address."""

    netns: str
    ifname: str
    address: str

    def argv(self, *command: str) -> list[str]:
        """``command`` run inside this namespace (``ip netns exec`` also gives it its own /sys)."""
        return ["ip", "netns", "exec", self.netns, *command]


@dataclass
class VethPair:
    a: NetnsEnd
    b: NetnsEnd
    prefixlen: int
    rate_mbit: float | None
    _procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, end: NetnsEnd, *command: str, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 120)
        return subprocess.run(end.argv(*command), **kwargs)

    def popen(self, end: NetnsEnd, *command: str, **kwargs) -> subprocess.Popen:
        """Start ``command`` in ``end``'s namespace; it is killed at teardown if still running."""
        proc = subprocess.Popen(end.argv(*command), **kwargs)
        self._procs.append(proc)
        return proc

    def _stop_processes(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def torchrun_pair(
    pair: VethPair, port: int, *program: str, timeout: float = 240
) -> list[subprocess.CompletedProcess]:
    """One torchrun node per namespace (``--nnodes 2``, one rank each, master on ``a``),
    ``GLOO_SOCKET_IFNAME`` set to each side's veth; runs ``program`` (torchrun's arguments
    after the node options, e.g. ``-m torchdoctor bench allreduce``) and waits for both."""
    procs = []
    for rank, end in enumerate((pair.a, pair.b)):
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "GLOO_SOCKET_IFNAME": end.ifname,
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            pair.popen(
                end,
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(rank),
                "--master-addr",
                pair.a.address,
                "--master-port",
                str(port),
                *program,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        )
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def netns_unavailable() -> str | None:
    """None when namespaces and veth pairs can be made here; otherwise why not (cached)."""
    if _probe_result:
        return _probe_result[0]
    reason: str | None = None
    if os.geteuid() != 0:
        reason = "needs root to create network namespaces (CI runs as root)"
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        reason = "needs iproute2 (ip, tc): `make system` installs it"
    else:
        try:
            with veth_pair():
                pass
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            reason = f"cannot create a network namespace with a veth pair here: {exc}"
    _probe_result.append(reason)
    return reason


@contextlib.contextmanager
def veth_pair(
    rate_mbit: float | None = None, *, burst: str = "64kb", latency: str = "100ms"
) -> Iterator[VethPair]:
    """Two fresh namespaces joined by a veth pair with addresses from 198.18.0.0/15."""
    token = f"{os.getpid() % 0x10000:04x}{next(_counter) % 0x100:02x}{secrets.token_hex(1)}"
    # A /30 chosen from the token: 32768 of them fit in the /15.
    subnet_index = int(token, 16) % (BENCHMARK_NET.num_addresses // 4)
    base = BENCHMARK_NET.network_address + 4 * subnet_index
    a = NetnsEnd(f"td-{token}-a", f"td{token}a", str(base + 1))
    b = NetnsEnd(f"td-{token}-b", f"td{token}b", str(base + 2))
    assert ipaddress.IPv4Address(a.address) in BENCHMARK_NET
    pair = VethPair(a, b, 30, rate_mbit)
    made: list[str] = []
    try:
        for end in (a, b):
            _ip("netns", "add", end.netns)
            made.append(end.netns)
        _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
        try:
            for end in (a, b):
                _ip("link", "set", end.ifname, "netns", end.netns)
        except RuntimeError:
            with contextlib.suppress(RuntimeError):
                _ip("link", "del", a.ifname)  # still in our namespace: delete it here
            raise
        for end in (a, b):
            _ip("-n", end.netns, "addr", "add", f"{end.address}/30", "dev", end.ifname)
            _ip("-n", end.netns, "link", "set", end.ifname, "up")
            _ip("-n", end.netns, "link", "set", "lo", "up")
            if rate_mbit is not None:
                shaped = subprocess.run(
                    end.argv("tc", "qdisc", "add", "dev", end.ifname, "root", "tbf",
                             "rate", f"{rate_mbit}mbit", "burst", burst, "latency", latency),
                    capture_output=True, text=True, timeout=30,
                )  # fmt: skip
                if shaped.returncode != 0:
                    raise RuntimeError(f"tc on {end.ifname}: {shaped.stderr.strip()}")
        yield pair
    finally:
        pair._stop_processes()
        for netns in made:
            # Deleting a namespace deletes the veth end in it, and so the whole pair.
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", netns)
