"""Two "nodes": two network namespaces joined by a veth pair shaped to 200 Mbit/s with tc.

One torchrun node in each namespace (``--nnodes 2``, master on the first namespace's address,
``GLOO_SOCKET_IFNAME`` set per side) runs ``torchdoctor bench allreduce`` as a rank of that
launch: busbw must come out at the shaped rate and be compared with the veth's rated speed,
naming the tc cap as the cause. ``torchdoctor doctor`` inside the namespaces sees the route,
the virtual interface, the shaping and the rendezvous port from both sides.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.engines import engine
from tests.helpers.netns import netns_unavailable, torchrun_pair, veth_pair
from torchdoctor.doctor import ERROR, OK, WARNING

pytestmark = engine("network namespaces", netns_unavailable())

RATE_MBIT = 200
PORT = 29517  # inside the private namespaces: nothing else can hold it


def _doctor(pair, end, *args: str) -> dict:
    result = pair.run(
        end, sys.executable, "-m", "torchdoctor", "doctor", "--json", "--only", "network",
        "--nnodes", "2", "--master-addr", pair.a.address, "--master-port", str(PORT), *args,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "GLOO_SOCKET_IFNAME": end.ifname},
    )  # fmt: skip
    return {c["name"]: c for c in json.loads(result.stdout)["checks"]}


def test_bench_and_doctor_across_two_shaped_namespaces():
    with veth_pair(rate_mbit=RATE_MBIT) as pair:
        # The worker's link down: no route, the named interface down, the master unreachable.
        pair.run(pair.b, "ip", "link", "set", pair.b.ifname, "down", check=True)
        down = _doctor(pair, pair.b)
        assert down["network.route"]["status"] == ERROR
        assert "no route to MASTER_ADDR" in down["network.route"]["saw"]
        assert down["network.gloo_socket_ifname"]["status"] == ERROR
        assert (
            f"{pair.b.ifname} is down or has no address"
            in down["network.gloo_socket_ifname"]["saw"]
        )
        assert down["network.nccl_socket_ifname"]["status"] == ERROR
        assert down["network.rendezvous"]["status"] == ERROR
        pair.run(pair.b, "ip", "link", "set", pair.b.ifname, "up", check=True)
        # doctor on the master's side: its own address, so the port must be free here.
        master = _doctor(pair, pair.a)
        assert master["network.route"]["details"]["interface"] == pair.a.ifname
        assert master["network.route"]["status"] == WARNING  # a veth: said to be virtual
        speed = master["network.link_speed"]
        assert speed["status"] == WARNING and speed["details"]["speed_mbps"] == 10000
        assert speed["details"]["tc_rate_bps"] == RATE_MBIT * 1_000_000 // 8
        assert f"caps its egress at {RATE_MBIT} Mbit/s" in speed["saw"]
        assert master["network.rendezvous"]["status"] == OK
        assert "this node is the master and the port is free" in master["network.rendezvous"]["saw"]
        assert master["network.gloo_socket_ifname"]["status"] == OK
        # doctor on the worker's side: the master answers, nothing listens yet.
        worker = _doctor(pair, pair.b)
        assert worker["network.route"]["details"]["interface"] == pair.b.ifname
        assert worker["network.rendezvous"]["status"] == OK
        assert "nothing listens on the port yet" in worker["network.rendezvous"]["saw"]
        assert worker["network.gloo_socket_ifname"]["status"] == OK
        assert worker["network.hostname"]["status"] != ERROR  # GLOO_SOCKET_IFNAME overrides it

        bench = [
            "-m", "torchdoctor", "bench", "allreduce", "--backend", "gloo", "--json",
            "--sizes", "2M,4M", "--iters", "3", "--warmup", "1", "--ops", "all_reduce",
        ]  # fmt: skip
        outputs = torchrun_pair(pair, PORT, *bench)
        for done in outputs:
            assert done.returncode == 0, done.stderr[-2000:]
    # Rank 0 printed the result; rank 1 printed nothing.
    assert outputs[1].stdout.strip() == ""
    doc = json.loads(outputs[0].stdout)
    assert doc["world_size"] == 2 and doc["nodes"] == 2
    assert all(r["wrong"] == 0 for r in doc["rows"])
    shaped = RATE_MBIT * 1e6 / 8
    assert abs(doc["peak_busbw"] - shaped) / shaped < 0.25, doc["peak_busbw"]
    assert sorted(link["interface"] for link in doc["links"]) == sorted(
        [pair.a.ifname, pair.b.ifname]
    )
    assert doc["link_speed_bps"] == 10000 * 1e6 / 8  # the veth's rated speed
    assert doc["ratio"] == pytest.approx(doc["peak_busbw"] / doc["link_speed_bps"])
    assert doc["ratio"] < doc["target"] == 0.85
    assert "short of the 85% target" in doc["verdict"]
    assert f"cap the link at {RATE_MBIT} Mbit/s" in doc["causes"][0], doc["causes"]


def test_the_helper_removes_everything_even_when_the_test_fails():
    def namespaces() -> str:
        return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

    with pytest.raises(RuntimeError, match="boom"), veth_pair() as pair:
        sleeper = pair.popen(pair.a, sys.executable, "-c", "import time; time.sleep(600)")
        assert pair.a.netns in namespaces()
        raise RuntimeError("boom")
    assert pair.a.netns not in namespaces() and pair.b.netns not in namespaces()
    assert sleeper.returncode is not None  # stopped by its PID
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert pair.a.ifname not in links
