"""torchdoctor doctor: a real run on this machine, and each check's bad case made real.

Bad cases are real where the machine allows: a 16 MiB /dev/shm in a private mount namespace,
a host name mapped to 127.0.1.1 in a UTS + mount namespace with its own /etc/hosts, a port held
by a real listening socket, real environment variables and NCCL configuration files. GPU checks
run against the fake NVML (the only fake), with a real foreign process on the GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TORCHDOCTOR, run_td
from tests.helpers.engines import engine
from tests.sampling.gpu_fixtures import HOST_PIDS, load_fake_nvml
from torchdoctor.doctor import ERROR, NAMES, OK, SKIPPED, STATUSES, WARNING, Plan, run_checks
from torchdoctor.doctor.check import Check
from torchdoctor.doctor.facts import Facts, TorchFacts
from torchdoctor.doctor.gpus import visible_devices
from torchdoctor.doctor.network import nccl_matches
from torchdoctor.doctor.versions import check_driver, check_torch

fake_nvml = load_fake_nvml()

needs_root = engine(
    "root",
    None
    if os.geteuid() == 0 and shutil.which("unshare")
    else "needs root and unshare(1) to make a private mount / UTS namespace",
)


def one(checks, name):
    [check] = [c for c in checks if c.name == name]
    return check


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the settings the checks look at, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NCCL_", "TORCH_NCCL_", "GLOO_", "MASTER_", "CUDA_"))
        and k != "OMP_NUM_THREADS"
    }
    env.update(extra)
    return env


# -- a real run on this machine ------------------------------------------------------------------


def test_real_run_json_lists_every_check_with_status_saw_and_fix():
    result = run_td("doctor", "--json", env=clean_env())
    doc = json.loads(result.stdout)
    names = [c["name"] for c in doc["checks"]]
    assert names == list(NAMES)
    for c in doc["checks"]:
        assert c["status"] in STATUSES
        assert c["saw"], c
        assert c["family"] == c["name"].split(".")[0]
        if c["status"] in (WARNING, ERROR):
            assert c["fix"], c  # a problem always comes with its fix
    errors = [c for c in doc["checks"] if c["status"] == ERROR]
    assert result.returncode == doc["exit_status"] == (1 if errors else 0)
    assert sum(doc["summary"].values()) == len(NAMES)
    # No GPU here: the GPU checks say why they did not run instead of claiming "ok".
    by_name = {c["name"]: c for c in doc["checks"]}
    if by_name["versions.driver"]["status"] == SKIPPED:
        assert all(by_name[n]["status"] == SKIPPED for n in NAMES if n.startswith("gpus."))
        assert (
            "NVIDIA" in by_name["gpus.visible"]["saw"] or "NVML" in by_name["gpus.visible"]["saw"]
        )
    assert (
        by_name["host.shm"]["details"]["size"]
        == os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize
    )


def test_text_output_has_one_line_per_check_and_a_summary():
    result = run_td("doctor", env=clean_env())
    lines = result.stdout.splitlines()
    for name in NAMES:
        short = name.split(".", 1)[1]
        assert any(line.split()[1:2] == [short] for line in lines if line.startswith("  ")), name
    assert lines[-1].endswith(f"(exit status {result.returncode})")


def test_unknown_check_name_is_one_clear_error_line():
    result = run_td("doctor", "--only", "network.nosuch")
    assert result.returncode == 2
    assert result.stderr.startswith("torchdoctor: error: unknown check(s) network.nosuch")


# -- host ----------------------------------------------------------------------------------------


@needs_root
def test_small_dev_shm_in_a_private_mount_namespace_is_an_error():
    script = 'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "$@"'
    result = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            script,
            "sh",
            *TORCHDOCTOR,
            "doctor",
            "--json",
            "--only",
            "host",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    doc = json.loads(result.stdout)
    shm = {c["name"]: c for c in doc["checks"]}["host.shm"]
    assert shm["status"] == ERROR
    assert shm["details"]["size"] == 16 * 1024**2
    assert "16.0 MiB" in shm["saw"] and "--shm-size=1g" in shm["fix"]
    assert result.returncode == 1
    # The host's own /dev/shm was not touched.
    assert os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize != 16 * 1024**2


def test_low_open_files_limit_is_a_warning_with_the_ulimit_to_set():
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    result = subprocess.run(
        [*TORCHDOCTOR, "doctor", "--json", "--only", "host.open_files"],
        capture_output=True, text=True, timeout=120, env=clean_env(), preexec_fn=low_limit,
    )  # fmt: skip
    check = json.loads(result.stdout)["checks"][0]
    assert check["status"] == WARNING and check["details"]["soft"] == 256
    assert "Too many open files" in check["saw"]
    expected = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if expected >= 4096:
        assert check["fix"] == f"`ulimit -n {expected}` before starting the run"
    assert result.returncode == 0  # a warning is not an error


def test_ipv6_master_is_said_to_be_unchecked_not_ok():
    plan = Plan(master_addr="fd00::1", master_port=29500, env=clean_env())
    checks = run_checks(plan, ["network.route", "network.rendezvous"])
    assert [c.status for c in checks] == [SKIPPED, SKIPPED]
    assert "IPv6" in checks[0].saw and "IPv6" in checks[1].saw


def test_oversubscription_counts_ranks_threads_and_workers():
    cpus = len(os.sched_getaffinity(0))
    env = clean_env(OMP_NUM_THREADS=str(cpus))
    check = one(
        run_checks(Plan(nproc_per_node=2, env=env), ["host.cpu_oversubscription"]),
        "host.cpu_oversubscription",
    )
    assert check.status == WARNING
    assert check.details["threads"] == cpus and check.details["nproc"] == 2
    assert f"OMP_NUM_THREADS={max(1, cpus // 2)}" in check.fix
    fine = one(
        run_checks(Plan(nproc_per_node=1, env=clean_env(OMP_NUM_THREADS="1")), ["host"]),
        "host.cpu_oversubscription",
    )
    assert fine.status == OK


# -- network -------------------------------------------------------------------------------------


def test_gloo_socket_ifname_naming_a_missing_interface_is_an_error():
    plan = Plan(env=clean_env(GLOO_SOCKET_IFNAME="tdmissing0"))
    check = one(run_checks(plan, ["network"]), "network.gloo_socket_ifname")
    assert check.status == ERROR
    assert "no interface 'tdmissing0'" in check.saw
    assert check.fix.startswith("export GLOO_SOCKET_IFNAME=")
    # NCCL's syntax is refused by gloo: said so.
    plan = Plan(env=clean_env(GLOO_SOCKET_IFNAME="^lo,docker"))
    check = one(run_checks(plan, ["network.gloo_socket_ifname"]), "network.gloo_socket_ifname")
    assert check.status == ERROR and "NCCL's ^/= syntax" in check.saw
    ok = one(
        run_checks(Plan(env=clean_env(GLOO_SOCKET_IFNAME="lo")), ["network"]),
        "network.gloo_socket_ifname",
    )
    assert ok.status == OK


def test_nccl_socket_ifname_syntax_prefix_exact_and_exclude():
    names = ["docker0", "eth0", "eth1", "ib0", "lo"]
    assert nccl_matches("eth", names) == ["eth0", "eth1"]
    assert nccl_matches("=eth1", names) == ["eth1"]
    assert nccl_matches("^docker,lo", names) == ["eth0", "eth1", "ib0"]
    assert nccl_matches("^=eth0", names) == ["docker0", "eth1", "ib0", "lo"]
    check = one(
        run_checks(Plan(env=clean_env(NCCL_SOCKET_IFNAME="=tdmissing0")), ["network"]),
        "network.nccl_socket_ifname",
    )
    assert check.status == ERROR and "selects no interface" in check.saw


def test_occupied_rendezvous_port_is_an_error_naming_the_holder():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        plan = Plan(master_addr="127.0.0.1", master_port=port, env=clean_env())
        check = one(run_checks(plan, ["network.rendezvous"]), "network.rendezvous")
    assert check.status == ERROR
    assert "in use" in check.saw
    assert os.getpid() in check.details["owners"]
    assert "--master-port" in check.fix
    # Closed again: the same port is free now.
    free = one(
        run_checks(
            Plan(master_addr="127.0.0.1", master_port=port, env=clean_env()), ["network.rendezvous"]
        ),
        "network.rendezvous",
    )
    assert free.status == OK and "free" in free.saw


@pytest.mark.parametrize("port", ["abc", "99999", "0"])
def test_a_master_port_torch_cannot_use_is_an_error_naming_it(port):
    # 'abc' was read as torchrun's default 29500 and said ok; 99999 crashed the check on bind
    result = run_td(
        "doctor",
        "--json",
        "--only",
        "network.rendezvous",
        env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
    )
    assert result.returncode == 1, result.stderr
    [check] = [c for c in json.loads(result.stdout)["checks"] if c["name"] == "network.rendezvous"]
    assert check["status"] == ERROR
    assert f"MASTER_PORT={port!r} is not a TCP port" in check["saw"]
    assert "export MASTER_PORT=29500" in check["fix"]


def test_localhost_endpoint_with_several_nodes_is_an_error():
    plan = Plan(
        master_addr="localhost", master_port=29500, nnodes=2, env=clean_env(GLOO_SOCKET_IFNAME="lo")
    )
    checks = run_checks(plan, ["network"])
    rdzv = one(checks, "network.rendezvous")
    assert rdzv.status == ERROR and "own store" in rdzv.saw and "--standalone" in rdzv.fix
    assert one(checks, "network.route").status == ERROR  # lo cannot reach other nodes
    assert one(checks, "network.gloo_socket_ifname").status == ERROR


@needs_root
def test_hostname_resolving_to_127_0_1_1_is_an_error_for_several_nodes(tmp_path: Path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.1.1 td-doctor-test\n")
    script = f'hostname td-doctor-test && mount --bind {hosts} /etc/hosts && exec "$@"'
    base = ["unshare", "-u", "-m", "sh", "-c", script, "sh", *TORCHDOCTOR, "doctor", "--json"]
    result = subprocess.run(
        [*base, "--only", "network.hostname", "--nnodes", "2"],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip
    check = json.loads(result.stdout)["checks"][0]
    assert check["status"] == ERROR and result.returncode == 1
    assert "'td-doctor-test' resolves to 127.0.1.1" in check["saw"]
    assert "GLOO_SOCKET_IFNAME=" in check["fix"]
    # One node: a loopback host name is fine, and said so.
    single = subprocess.run(
        [*base, "--only", "network.hostname"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    check = json.loads(single.stdout)["checks"][0]
    assert check["status"] == OK and "127.0.1.1" in check["saw"] and single.returncode == 0
    assert socket.gethostname() != "td-doctor-test"  # our own UTS namespace is untouched


# -- settings ------------------------------------------------------------------------------------


def test_stale_nccl_variables_and_conf_file_are_warnings(tmp_path: Path):
    conf = tmp_path / "nccl.conf"
    conf.write_text("# left from a debugging session\nNCCL_IB_DISABLE=1\nNCCL_DEBUG=WARN\n")
    env = clean_env(
        NCCL_P2P_DISABLE="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="0", NCCL_CONF_FILE=str(conf)
    )
    checks = run_checks(Plan(env=env), ["settings"])
    env_check = one(checks, "settings.environment")
    assert env_check.status == WARNING
    assert env_check.details["variables"] == {
        "NCCL_P2P_DISABLE": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    }
    assert "unset NCCL_P2P_DISABLE TORCH_NCCL_ASYNC_ERROR_HANDLING" in env_check.fix
    conf_check = one(checks, "settings.nccl_conf")
    assert conf_check.status == WARNING
    assert f"{conf}: NCCL_IB_DISABLE=1" in conf_check.saw and "NCCL_DEBUG" not in conf_check.saw
    clean = run_checks(
        Plan(env=clean_env(TORCH_NCCL_ASYNC_ERROR_HANDLING="1")), ["settings.environment"]
    )
    assert clean[0].status == OK


def test_cli_exit_status_follows_errors():
    assert (
        run_td("doctor", "--only", "settings", env=clean_env(NCCL_P2P_DISABLE="1")).returncode == 0
    )
    result = run_td(
        "doctor",
        "--only",
        "network.gloo_socket_ifname",
        env=clean_env(GLOO_SOCKET_IFNAME="tdmissing0"),
    )
    assert result.returncode == 1 and "tdmissing0" in result.stdout


# -- GPUs through the fake NVML ------------------------------------------------------------------


def gpu_plan(scenario, **kwargs) -> Plan:
    nvml = scenario if not isinstance(scenario, str) else fake_nvml.scenario(scenario)
    kwargs.setdefault("env", clean_env())
    return Plan(nvml_module=nvml, pid_namespace=HOST_PIDS, **kwargs)


def test_topology_across_sockets_and_p2p_failures_from_nvml():
    checks = run_checks(gpu_plan("two_sockets"), ["gpus", "host.numa"])
    topo = one(checks, "gpus.topology")
    assert topo.status == WARNING
    assert "GPU0-GPU1: PIX" in topo.saw and "GPU0-GPU2: SYS" in topo.saw
    assert "CUDA_VISIBLE_DEVICES=0,1 or 2,3" in topo.fix
    p2p = one(checks, "gpus.p2p")
    assert p2p.status == WARNING
    assert "P2P reads between 2 of 6 GPU pairs" in p2p.saw
    assert "GPU0-GPU2: the IOH topology does not support it" in p2p.saw
    numa = one(checks, "host.numa")
    assert "GPU0: node 0, CPUs 0-15" in numa.saw and "GPU3: node 1, CPUs 16-31" in numa.saw
    assert one(checks, "gpus.visible").status == OK


def test_nvlink_and_nvswitch_topologies_are_fine():
    pair = run_checks(gpu_plan("nvlink_pair"), ["gpus.topology"])[0]
    assert pair.status == OK and pair.saw == "GPU0-GPU1: NV12"
    board = run_checks(gpu_plan("nvswitch"), ["gpus.topology", "gpus.p2p"])
    assert board[0].status == OK and "GPU0-GPU7: NV18" in board[0].saw  # through the NVSwitches
    assert board[1].status == OK


def test_cuda_visible_devices_index_uuid_and_order():
    gpus = fake_nvml.scenario("mixed_models")
    uuid1 = "GPU-11111111-2222-4333-8444-555555550001"
    # Indexes with different models and CUDA's default order: may pick another GPU.
    check = run_checks(gpu_plan(gpus, env=clean_env(CUDA_VISIBLE_DEVICES="0")), ["gpus.visible"])[0]
    assert check.status == WARNING and "fastest GPU first" in check.saw
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in check.fix and uuid1 not in check.fix
    fixed = clean_env(CUDA_VISIBLE_DEVICES="0", CUDA_DEVICE_ORDER="PCI_BUS_ID")
    assert run_checks(gpu_plan("mixed_models", env=fixed), ["gpus.visible"])[0].status == OK
    # UUIDs select by identity; an ambiguous prefix is an error, as CUDA refuses it.
    by_uuid = run_checks(
        gpu_plan("mixed_models", env=clean_env(CUDA_VISIBLE_DEVICES=uuid1)), ["gpus.visible"]
    )[0]
    assert by_uuid.status == OK and by_uuid.details["visible"] == [1]
    prefix = run_checks(
        gpu_plan("mixed_models", env=clean_env(CUDA_VISIBLE_DEVICES=uuid1[:12])), ["gpus.visible"]
    )[0]
    assert prefix.status == ERROR and "is a prefix of 2 GPUs' UUIDs" in prefix.saw
    listed = fake_nvml.scenario("mixed_models").gpus
    infos = [type("G", (), {"index": i, "uuid": g.uuid})() for i, g in enumerate(listed)]
    assert visible_devices(f"1,7,{uuid1}", infos) == (
        [1],
        [f"'7' names no GPU here, so CUDA also ignores what follows ({uuid1})"],
    )
    bad = run_checks(
        gpu_plan("mixed_models", env=clean_env(CUDA_VISIBLE_DEVICES="1,1")), ["gpus.visible"]
    )[0]
    assert bad.status == ERROR and "listed twice" in bad.saw
    empty = run_checks(
        gpu_plan("mixed_models", env=clean_env(CUDA_VISIBLE_DEVICES="")), ["gpus.visible"]
    )[0]
    assert empty.status == ERROR and "hides every GPU" in empty.fix
    too_many = run_checks(gpu_plan("two_gpus", nproc_per_node=4), ["gpus.visible"])[0]
    assert too_many.status == ERROR and "--nproc-per-node 2" in too_many.fix


def test_foreign_process_on_a_gpu_is_listed_never_killed():
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; print('up', flush=True); sys.stdin.read()",
            "td-foreign",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "up\n"
        nvml = fake_nvml.scenario("foreign_process")
        nvml.gpus[0].compute_processes = [(holder.pid, 3 * 1024**3)]
        check = run_checks(gpu_plan(nvml), ["gpus.processes"])[0]
        assert check.status == WARNING
        [row] = check.details["processes"]
        assert row["pid"] == holder.pid and row["memory"] == 3 * 1024**3
        assert row["user"] == __import__("pwd").getpwuid(os.getuid()).pw_name
        assert "-c import sys; print('up'" in row["command"]
        assert f"PID {holder.pid}" in check.saw and "3.00 GiB" in check.saw
        assert "never kills" in check.fix
        assert holder.poll() is None  # still running
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=10)


def _versions(nvml, torch: TorchFacts) -> dict[str, Check]:
    """The version checks on fake GPUs with the torch build given (not the installed one)."""
    facts = Facts(gpu_plan(nvml))
    facts.torch = torch  # the build under test, whichever wheel this venv has
    return {c.name: c for c in (check_torch(facts), check_driver(facts))}


CPU_TORCH = TorchFacts("2.4.0", cuda=None, gloo=True)
CUDA_TORCH = TorchFacts(
    "2.4.0", cuda="12.4", cudnn=90100, nccl="2.20.5", gloo=True, nccl_built=True
)


def test_versions_with_a_gpu_driver_and_a_cpu_torch():
    checks = _versions(fake_nvml.scenario("two_gpus"), CPU_TORCH)
    driver = checks["versions.driver"]
    assert driver.status == OK and "driver 550.54.15, supports CUDA up to 12.4" in driver.saw
    # A CPU build of torch with GPUs present is an error with the fix.
    torch_check = checks["versions.torch"]
    assert torch_check.status == ERROR and "CUDA build of torch" in torch_check.fix
    nodriver = run_checks(gpu_plan("no_driver"), ["versions.driver", "gpus"])
    assert {c.status for c in nodriver} == {SKIPPED}
    assert all("Driver Not Loaded" in c.saw or "driver not loaded" in c.saw for c in nodriver)


def test_versions_with_a_cuda_torch_newer_than_the_driver():
    checks = _versions(fake_nvml.scenario("two_gpus"), CUDA_TORCH)
    assert checks["versions.torch"].status == OK
    assert checks["versions.driver"].status == OK  # built for 12.4, driver supports 12.4
    newer = TorchFacts("2.6.0", cuda="12.6", cudnn=90500, nccl="2.21.5", gloo=True, nccl_built=True)
    assert _versions(fake_nvml.scenario("two_gpus"), newer)["versions.driver"].status == WARNING
    too_new = TorchFacts(
        "2.9.0", cuda="13.0", cudnn=91300, nccl="2.27.3", gloo=True, nccl_built=True
    )
    driver = _versions(fake_nvml.scenario("two_gpus"), too_new)["versions.driver"]
    assert driver.status == ERROR and "driver is too old for CUDA 13.0" in driver.fix


def test_bench_flag_adds_a_short_checked_sweep():
    result = run_td("doctor", "--json", "--bench", "--only", "settings", env=clean_env())
    doc = json.loads(result.stdout)
    assert [c["name"] for c in doc["checks"]] == [
        "settings.environment",
        "settings.nccl_conf",
        "bench.allreduce",
    ]
    bench = doc["checks"][-1]
    assert bench["status"] == OK, bench
    assert bench["details"]["backend"] == "gloo" and bench["details"]["nproc"] == 2
    sizes = [r["size"] for r in bench["details"]["rows"]]
    assert sizes == [1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20]
    assert bench["details"]["peak_busbw"] == max(r["busbw"] for r in bench["details"]["rows"])
    assert "results checked" in bench["saw"]


def test_more_ranks_than_cpus_is_fixed_with_fewer_ranks_not_threads():
    from torchdoctor.sampling.hostinfo import whole_cpus_here

    cpus = whole_cpus_here()
    # OMP_NUM_THREADS=1 already: the ranks alone outnumber the CPUs, no thread setting helps.
    plan = Plan(nproc_per_node=cpus + 1, env=clean_env(OMP_NUM_THREADS="1"))
    check = one(run_checks(plan, ["host.cpu_oversubscription"]), "host.cpu_oversubscription")
    assert check.status == WARNING
    assert check.fix == f"start at most {cpus} rank(s) per node (--nproc-per-node {cpus})"


def test_rank_count_refuses_ranks_far_above_the_cpus_or_beyond_the_ram():
    from torchdoctor.doctor.host import RANK_MEMORY, RANKS_PER_CPU
    from torchdoctor.sampling.hostinfo import available_ram, whole_cpus_here

    cpus = whole_cpus_here()
    # No GPU, whatever the machine has: an NVML whose driver is not loaded.
    no_gpu = {"nvml_module": fake_nvml.scenario("no_driver"), "env": clean_env()}
    # Without GPUs: up to RANKS_PER_CPU ranks a CPU pass (the oversubscription warning's
    # business), one more is an error.
    ok = one(
        run_checks(Plan(nproc_per_node=RANKS_PER_CPU * cpus, **no_gpu), ["host.rank_count"]),
        "host.rank_count",
    )
    assert ok.status == OK, ok
    over = one(
        run_checks(Plan(nproc_per_node=RANKS_PER_CPU * cpus + 1, **no_gpu), ["host.rank_count"]),
        "host.rank_count",
    )
    assert over.status == ERROR
    assert f"on {cpus} usable CPU(s) and no GPU" in over.saw
    assert over.fix.startswith("start at most ")
    # With GPUs the CPUs do not limit the ranks, the RAM does: one rank more than it holds.
    holds = available_ram() // RANK_MEMORY
    check = one(
        run_checks(gpu_plan("two_sockets", nproc_per_node=holds * 2), ["host.rank_count"]),
        "host.rank_count",
    )
    assert check.status == ERROR
    assert "of RAM" in check.saw and "is available" in check.saw
    assert "--nproc-per-node" in check.fix
