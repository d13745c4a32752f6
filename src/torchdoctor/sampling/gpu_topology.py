"""How the GPUs are wired to each other and to the CPUs, from NVML.

For every pair of devices: the closest common ancestor on the bus (NVML's topology level: the
same board, one PCIe switch, several switches, the host bridge, the same CPU socket, across
sockets), whether peer-to-peer reads are possible (and if not, NVML's reason), and how many
NVLinks join them. For every device: its PCI bus id, its NUMA node and the CPUs NVML calls
"ideal" for it (from the device's CPU affinity mask).

Everything goes through :class:`torchdoctor.sampling.nvml.Nvml`; a call that fails leaves its
field ``None`` with the reason next to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchdoctor.sampling.nvml import FUNCTION_NOT_FOUND, Nvml, Unavailable, text

# nvmlGpuTopologyLevel_t (nvml.h): value -> (short name as nvidia-smi topo -m writes it, words)
TOPOLOGY_LEVELS: dict[int, tuple[str, str]] = {
    0: ("BOARD", "on the same board (multi-GPU card)"),
    10: ("PIX", "behind one PCIe switch"),
    20: ("PXB", "across several PCIe switches, not through the host bridge"),
    30: ("PHB", "through a PCIe host bridge (the CPU)"),
    40: ("NODE", "across host bridges within one NUMA node / CPU socket"),
    50: ("SYS", "across CPU sockets (the SMP interconnect, QPI/UPI/Infinity Fabric)"),
}
LEVEL_ACROSS_SOCKETS = 50

# nvmlGpuP2PStatus_t
P2P_STATUS: dict[int, str] = {
    0: "ok",
    1: "the chipset does not support it",
    2: "the GPU does not support it",
    3: "the IOH topology does not support it (GPUs behind different root complexes)",
    4: "disabled by a driver registry key",
    5: "not supported",
    6: "unknown",
}
# NVML_P2P_CAPS_INDEX_READ; written out because some nvidia-ml-py releases define it as a
# one-element tuple (a stray comma), which NVML would reject.
_P2P_CAPS_READ = 0
_NVLINK_MAX_LINKS = 18  # links per device NVML can report on current GPUs (H100: 18)
_NVSWITCH = -1  # key of the links that end at an NVSwitch


@dataclass(slots=True)
class GpuPlacement:
    """Where one device sits."""

    index: int
    bus_id: str | None  # "0000:07:00.0", as sysfs writes it
    numa_node: int | None
    cpus: list[int] | None  # the CPUs NVML calls ideal for this device
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class GpuLink:
    """How two devices reach each other."""

    a: int
    b: int
    level: int | None  # NVML topology level (see TOPOLOGY_LEVELS)
    nvlinks: int | None  # active NVLinks between them; None when NVML cannot say
    p2p: int | None  # nvmlGpuP2PStatus_t for reads
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def level_name(self) -> str:
        if self.nvlinks:
            return f"NV{self.nvlinks}"
        if self.level is None:
            return "?"
        return TOPOLOGY_LEVELS.get(self.level, (str(self.level), ""))[0]


@dataclass(slots=True)
class GpuTopology:
    available: bool
    reason: str | None
    placements: list[GpuPlacement] = field(default_factory=list)
    links: list[GpuLink] = field(default_factory=list)


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's "00000000:07:00.0" as sysfs names it, "0000:07:00.0"."""
    domain, _, rest = nvml_bus_id.strip().lower().partition(":")
    return f"{domain[-4:]}:{rest}" if rest else nvml_bus_id.lower()


def _mask_to_cpus(mask: Any) -> list[int]:
    cpus: list[int] = []
    for word_index, word in enumerate(mask):
        value = int(word)
        bit = 0
        while value:
            if value & 1:
                cpus.append(word_index * 64 + bit)
            value >>= 1
            bit += 1
    return cpus


def read_topology(nvml_module: Any = None, cpu_count: int = 1024) -> GpuTopology:
    """Read placements and pairwise links of every device NVML sees."""
    nvml = Nvml(nvml_module)
    if not nvml.start():
        return GpuTopology(False, nvml.reason)
    try:
        count = nvml.call("nvmlDeviceGetCount")
        if isinstance(count, Unavailable):
            return GpuTopology(False, f"cannot count GPUs: {count.reason}")
        handles = []
        for index in range(count):
            handle = nvml.call("nvmlDeviceGetHandleByIndex", index)
            handles.append(None if isinstance(handle, Unavailable) else handle)
        topology = GpuTopology(True, None)
        bus_ids: dict[str, int] = {}
        for index, handle in enumerate(handles):
            placement = _placement(nvml, index, handle, cpu_count)
            if placement.bus_id:
                bus_ids[placement.bus_id] = index
            topology.placements.append(placement)
        nvlinks = [_nvlink_peers(nvml, h, bus_ids) for h in handles]
        for a in range(count):
            for b in range(a + 1, count):
                topology.links.append(_link(nvml, a, b, handles, nvlinks))
        return topology
    finally:
        nvml.shutdown()


def _placement(nvml: Nvml, index: int, handle: Any, cpu_count: int) -> GpuPlacement:
    placement = GpuPlacement(index, None, None, None)
    if handle is None:
        placement.unavailable["*"] = "no handle for this device"
        return placement
    pci = nvml.call(("nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo"), handle)
    if isinstance(pci, Unavailable):
        placement.unavailable["bus_id"] = pci.reason
    else:
        placement.bus_id = sysfs_bus_id(text(pci.busId))
    node = nvml.call("nvmlDeviceGetNumaNodeId", handle)
    if isinstance(node, Unavailable):
        placement.unavailable["numa_node"] = node.reason
    elif int(node) >= 0:
        placement.numa_node = int(node)
    words = max(1, (cpu_count + 63) // 64)
    mask = nvml.call("nvmlDeviceGetCpuAffinity", handle, words)
    if isinstance(mask, Unavailable):
        placement.unavailable["cpus"] = mask.reason
    else:
        placement.cpus = _mask_to_cpus(mask)
    return placement


def _nvlink_peers(nvml: Nvml, handle: Any, bus_ids: dict[str, int]) -> dict[int, int] | str:
    """Active NVLinks of one device, counted per peer GPU index; or why NVML cannot say."""
    if handle is None:
        return "no handle for this device"
    peers: dict[int, int] = {}
    for link in range(_NVLINK_MAX_LINKS):
        state = nvml.call("nvmlDeviceGetNvLinkState", handle, link)
        if isinstance(state, Unavailable):
            if link == 0:
                # PCIe-only GPUs answer NotSupported for link 0: no NVLink at all.
                return {} if state.kind != FUNCTION_NOT_FOUND else state.reason
            break  # past the device's last link (InvalidArgument) or unreadable
        if not state:
            continue
        remote = nvml.call("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        if isinstance(remote, Unavailable):
            continue
        # A link whose far end is no GPU of this machine ends at an NVSwitch.
        peer = bus_ids.get(sysfs_bus_id(text(remote.busId)), _NVSWITCH)
        peers[peer] = peers.get(peer, 0) + 1
    return peers


def _link(
    nvml: Nvml, a: int, b: int, handles: list[Any], nvlinks: list[dict[int, int] | str]
) -> GpuLink:
    link = GpuLink(a, b, None, None, None)
    ha, hb = handles[a], handles[b]
    if ha is None or hb is None:
        link.unavailable["*"] = "no handle for one of the devices"
        return link
    level = nvml.call("nvmlDeviceGetTopologyCommonAncestor", ha, hb)
    if isinstance(level, Unavailable):
        link.unavailable["level"] = level.reason
    else:
        link.level = int(level)
    p2p = nvml.call("nvmlDeviceGetP2PStatus", ha, hb, _P2P_CAPS_READ)
    if isinstance(p2p, Unavailable):
        link.unavailable["p2p"] = p2p.reason
    else:
        link.p2p = int(p2p)
    peers = nvlinks[a]
    if isinstance(peers, str):
        link.unavailable["nvlinks"] = peers
    else:
        other = nvlinks[b]
        direct = peers.get(b, 0)
        # Two GPUs on the same NVSwitch fabric reach each other at the speed of the fewer links.
        switched = (
            min(peers.get(_NVSWITCH, 0), other.get(_NVSWITCH, 0)) if isinstance(other, dict) else 0
        )
        link.nvlinks = direct + switched
    return link
