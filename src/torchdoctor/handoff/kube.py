"""Kubernetes manifests from the sizing: TrainJob (Kubeflow Trainer v2), PyTorchJob (training-
operator 1.9), batch/v1 Job; and the rules a schema cannot say.

What every target gets, and why:

- torchrun starts the ranks, with the node count and ranks per node written explicitly. TrainJob
  injects only ``PET_*`` variables (torchrun's option defaults) and never RANK, so its command
  must be torchrun; without ``numProcPerNode`` a CPU job gets one rank per requested CPU
  (kubeflow/trainer #2407). PyTorchJob's default ``nprocPerNode`` "auto" is every core of the
  node on a CPU pod.
- requests and limits from the sizing; the memory limit is the recorded peak + margin + the
  shared memory, since a memory-backed volume counts against the container's limit (kuberay
  #3897). No CPU limit: a CFS quota throttles torch's threads instead of failing clearly.
- a ``medium: Memory`` emptyDir on /dev/shm sized from the recording: neither the Trainer's
  torch-distributed runtime nor PyTorchJob mounts one, and a container's 64 MB default makes
  DataLoader workers die with bus errors (pytorch #108861).
- ``activeDeadlineSeconds`` from the time limit; ``backoffLimit: 0`` where the kind has it: a
  job that failed once fails again the same way, and each retry holds the GPUs.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.handoff.yaml_text import Path, to_yaml
from torchdoctor.sizing.command import torchrun_invocation
from torchdoctor.sizing.size import JobSize
from torchdoctor.units import fmt_bytes

KUBE_TARGETS = ("trainjob", "pytorchjob", "job")
# Trainer releases whose TrainJob schema this writes (int32 numProcPerNode, runtimePatches,
# activeDeadlineSeconds): 2.2 introduced all three; 2.0 and 2.1 had podTemplateOverrides.
TRAINER_VERSIONS = ("2.2", "2.3")
TRAINER_RUNTIME = "torch-distributed"  # the ClusterTrainingRuntime Trainer installs for torch
TRAINER_CONTAINER = "node"  # the container of that runtime's replicated job "node"
PATCH_MANAGER = "torchdoctor.io/handoff"
PYTORCHJOB_CONTAINER = "pytorch"  # the operator finds its container by this name
SHM_VOLUME = "dshm"
GPU_RESOURCE = "nvidia.com/gpu"

# A Kubernetes quantity (apimachinery's resource.Quantity); "48GB" is not one.
_QUANTITY = re.compile(
    r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:(?P<bin>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<dec>[mkMGTPE])"
    r"|[eE][+-]?[0-9]+)?"
)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"m": -1, "k": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}
# A DNS-1123 label: what a Job's name must be to name its pods and services.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# An image reference: registry/name:tag@digest, no spaces or control characters.
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass(slots=True)
class KubeOptions:
    target: str  # one of KUBE_TARGETS
    name: str
    image: str
    source: str  # one line: the recording the sizes come from
    namespace: str | None = None
    trainer_version: str = TRAINER_VERSIONS[-1]
    runtime: str = TRAINER_RUNTIME
    num_workers: int = 0  # DataLoader workers per rank, as recorded (for the shm rule)

    def __post_init__(self) -> None:
        check_label(self.name, "--job-name")
        if self.namespace is not None:
            check_label(self.namespace, "--namespace")
        check_label(self.runtime, "--runtime")
        if not _IMAGE.fullmatch(self.image) or len(self.image) > 512:
            raise UserError(
                f"--image {self.image!r}: give an image reference such as "
                "registry.example.com/team/train:1.0 (no spaces or quotes)"
            )
        if self.trainer_version not in TRAINER_VERSIONS:
            raise UserError(
                f"--trainer-version {self.trainer_version!r}: this torchdoctor writes TrainJob "
                f"for Trainer {' or '.join(TRAINER_VERSIONS)} (older releases had another schema)"
            )


@dataclass(slots=True)
class Manifest:
    doc: dict[str, Any]
    comments: dict[Path, str]
    header: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return to_yaml(self.doc, self.comments, self.header)


def check_label(value: str, option: str) -> str:
    if len(value) > 63 or not _DNS_LABEL.fullmatch(value):
        raise UserError(
            f"{option} {value!r}: give a Kubernetes name: lower-case letters, digits and '-', "
            "at most 63, starting and ending with a letter or digit"
        )
    return value


def label_from(text: str) -> str:
    """A DNS-1123 label made from a job name (``train_resnet.py`` -> ``train-resnet``)."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower().removesuffix(".py")).strip("-")[:63]
    return label.strip("-") or "torchdoctor-job"


def memory_quantity(n_bytes: int) -> str:
    """Bytes as a Kubernetes quantity: whole Gi or Mi (sizes are rounded to 256 MiB)."""
    mib = math.ceil(n_bytes / 2**20)
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def parse_quantity(text: object) -> float | None:
    """The value of a Kubernetes quantity (bytes for memory), None if it is not one."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int | float):
        return float(text)
    if not isinstance(text, str):
        return None
    m = _QUANTITY.fullmatch(text)
    if not m:
        return None
    number = re.match(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", text)
    assert number is not None
    if m.group("bin"):
        return float(text[:-2]) * 1024 ** _BINARY[m.group("bin")]
    if m.group("dec"):
        return float(text[:-1]) * 1000 ** _DECIMAL[m.group("dec")]
    return float(number.group(0))


def container_command(target: str, command: list[str], nodes: int, ranks: int) -> list[str]:
    """The container's command: the image's torchrun around the user's script.

    The image's own ``torchrun`` (its Python, not this machine's). TrainJob's torchrun reads the
    node count, ranks per node, node rank and rendezvous from the ``PET_*`` variables Trainer
    injects (setting them is refused); PyTorchJob gets the counts on the command as well; a Job
    (one node) runs torchrun standalone.
    """
    _launcher, rest = torchrun_invocation(command)  # the same checks as sbatch's
    if target == "trainjob":
        return ["torchrun", *rest]
    if target == "pytorchjob":
        return ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(ranks), *rest]
    return ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", str(ranks), *rest]


def render_manifest(size: JobSize, command: list[str], opts: KubeOptions) -> Manifest:
    """The manifest for ``opts.target``, checked by :func:`check_rules` before it is returned."""
    if opts.target == "job" and size.nodes > 1:
        raise UserError(
            f"--to job runs on one node; for --nodes {size.nodes} use --to trainjob or "
            "--to pytorchjob (a plain Job has no rendezvous between pods)"
        )
    b = _Builder(size, command, opts)
    doc = {"trainjob": b.trainjob, "pytorchjob": b.pytorchjob, "job": b.job}[opts.target]()
    manifest = Manifest(doc, b.comments, b.header(), b.notes)
    problems = check_rules(doc, size.memory_peak, opts.num_workers)
    if problems:
        raise UserError(problems[0])
    return manifest


class _Builder:
    """The parts every target shares, each figure's source kept for its comment."""

    def __init__(self, size: JobSize, command: list[str], opts: KubeOptions) -> None:
        self.size, self.command, self.opts = size, command, opts
        self.comments: dict[Path, str] = {}
        self.notes: list[str] = []
        self.ranks = int(size.ranks_per_node.value)
        self.gpus = int(size.gpus_per_node.value)

    def header(self) -> list[str]:
        what = {
            "trainjob": f"a TrainJob for Kubeflow Trainer {self.opts.trainer_version}",
            "pytorchjob": "a PyTorchJob for the Kubeflow training-operator 1.9",
            "job": "a batch/v1 Job (one node)",
        }[self.opts.target]
        return [
            f"Written by `torchdoctor handoff --to {self.opts.target}`: {what}.",
            f"Sized from {self.source_line()}.",
            "Sizes are per node (pod); each comment says where a figure came from.",
            *[f"NOTE: {note}" for note in self.size.notes],
        ]

    def source_line(self) -> str:
        return self.opts.source

    def metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.opts.name}
        if self.opts.namespace:
            meta["namespace"] = self.opts.namespace
        meta["labels"] = {"app.kubernetes.io/managed-by": "torchdoctor"}
        return meta

    def env(self) -> list[dict[str, str]]:
        out = [{"name": "OMP_NUM_THREADS", "value": str(self.size.threads_per_rank.value)}]
        for key, figure in sorted(self.size.network_env.items()):
            if not _ENV_NAME.fullmatch(key) or key.startswith("PET_"):
                self.notes.append(f"{key}: left out, not a variable name a container takes")
                continue
            out.append({"name": key, "value": str(figure.value)})
        return out

    def env_comment(self) -> str:
        parts = [f"OMP_NUM_THREADS: {self.size.threads_per_rank.source}"]
        parts += [f"{k}: {f.source}" for k, f in sorted(self.size.network_env.items())]
        return "; ".join(parts)

    def memory_limit(self) -> tuple[int | None, str]:
        mem, shm = self.size.mem_per_node, self.size.shm
        shm_bytes = int(shm.value) if shm is not None else 0
        if mem is None:
            self.notes.append(
                "the recording has no memory figure: no memory request or limit written"
            )
            return None, ""
        value = int(mem.value) + shm_bytes
        return value, (
            f"memory: {mem.source}; + {fmt_bytes(shm_bytes)} of /dev/shm, which counts against "
            f"the limit -> {memory_quantity(value)} (request = limit: the pod is not evicted "
            "first under memory pressure)"
        )

    def resources(self, at: Path) -> dict[str, Any]:
        requests: dict[str, str] = {"cpu": str(self.size.cpus_per_task.value)}
        limits: dict[str, str] = {}
        memory, why = self.memory_limit()
        if memory is not None:
            requests["memory"] = limits["memory"] = memory_quantity(memory)
            self.comments[(*at, "limits")] = why
        self.comments[(*at, "requests")] = (
            f"cpu: {self.size.cpus_per_task.source} (no CPU limit: a quota throttles threads)"
        )
        if self.gpus:
            limits[GPU_RESOURCE] = str(self.gpus)
            requests[GPU_RESOURCE] = str(self.gpus)
        out: dict[str, Any] = {"requests": requests}
        if limits:
            out["limits"] = limits
        return out

    def shm_volume(self, at: Path) -> dict[str, Any]:
        shm = self.size.shm
        assert shm is not None  # size_job always sizes it
        self.comments[at] = f"/dev/shm: {shm.source}"
        return {
            "name": SHM_VOLUME,
            "emptyDir": {"medium": "Memory", "sizeLimit": memory_quantity(int(shm.value))},
        }

    def shm_mount(self) -> dict[str, str]:
        return {"name": SHM_VOLUME, "mountPath": "/dev/shm"}

    def deadline_comment(self) -> str:
        return f"time: {self.size.time_limit_s.source}"

    def ranks_comment(self) -> str:
        return f"ranks per node: {self.size.ranks_per_node.source}"

    def trainjob(self) -> dict[str, Any]:
        nodes = self.size.nodes
        trainer: dict[str, Any] = {
            "image": self.opts.image,
            "command": container_command("trainjob", self.command, nodes, self.ranks),
            "numNodes": nodes,
            "numProcPerNode": self.ranks,
            "env": self.env(),
            "resourcesPerNode": self.resources(("spec", "trainer", "resourcesPerNode")),
        }
        self.comments[("spec", "trainer", "command")] = (
            "torchrun reads PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK and PET_MASTER_* "
            "(Trainer injects them; RANK comes from torchrun)"
        )
        self.comments[("spec", "trainer", "numNodes")] = "nodes: --nodes (default 1)"
        self.comments[("spec", "trainer", "numProcPerNode")] = self.ranks_comment()
        self.comments[("spec", "trainer", "env")] = self.env_comment()
        self.comments[("spec", "activeDeadlineSeconds")] = self.deadline_comment()
        at: Path = ("spec", "runtimePatches", 0, "trainingRuntimeSpec", "template", "spec")
        pod_at: Path = (*at, "replicatedJobs", 0, "template", "spec", "template", "spec")
        self.comments[("spec", "runtimePatches")] = (
            f"the {TRAINER_RUNTIME} runtime mounts no /dev/shm: a memory-backed one is patched "
            "in (TrainJob has no backoffLimit; the runtime's Job sets it)"
        )
        pod = {
            "volumes": [self.shm_volume((*pod_at, "volumes", 0))],
            "containers": [{"name": TRAINER_CONTAINER, "volumeMounts": [self.shm_mount()]}],
        }
        return {
            "apiVersion": "trainer.kubeflow.org/v1alpha1",
            "kind": "TrainJob",
            "metadata": self.metadata(),
            "spec": {
                "runtimeRef": {"name": self.opts.runtime},
                "activeDeadlineSeconds": int(self.size.time_limit_s.value),
                "trainer": trainer,
                "runtimePatches": [
                    {
                        "manager": PATCH_MANAGER,
                        "trainingRuntimeSpec": {
                            "template": {
                                "spec": {
                                    "replicatedJobs": [
                                        {
                                            "name": TRAINER_CONTAINER,
                                            "template": {"spec": {"template": {"spec": pod}}},
                                        }
                                    ]
                                }
                            }
                        },
                    }
                ],
            },
        }

    def pod_template(self, at: Path, container_name: str, target: str) -> dict[str, Any]:
        pod_at = (*at, "spec")
        container = {
            "name": container_name,
            "image": self.opts.image,
            "command": container_command(target, self.command, self.size.nodes, self.ranks),
            "env": self.env(),
            "resources": self.resources((*pod_at, "containers", 0, "resources")),
            "volumeMounts": [self.shm_mount()],
        }
        self.comments[(*pod_at, "containers", 0, "command")] = self.ranks_comment()
        self.comments[(*pod_at, "containers", 0, "env")] = self.env_comment()
        spec: dict[str, Any] = {"containers": [container]}
        if target == "job":
            spec = {"restartPolicy": "Never", **spec}
        spec["volumes"] = [self.shm_volume((*pod_at, "volumes", 0))]
        return {"spec": spec}

    def pytorchjob(self) -> dict[str, Any]:
        nodes = self.size.nodes
        replicas: dict[str, Any] = {}
        for role, count in (("Master", 1), ("Worker", nodes - 1)):
            if count:
                at: Path = ("spec", "pytorchReplicaSpecs", role, "template")
                replicas[role] = {
                    "replicas": count,
                    "restartPolicy": "Never",
                    "template": self.pod_template(at, PYTORCHJOB_CONTAINER, "pytorchjob"),
                }
        self.comments[("spec", "nprocPerNode")] = (
            f"{self.ranks_comment()} (text: the schema's type; 'auto' is every core on a CPU pod)"
        )
        self.comments[("spec", "runPolicy")] = (
            f"{self.deadline_comment()}; no retries: a failed job fails again the same way"
        )
        return {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": self.metadata(),
            "spec": {
                "nprocPerNode": str(self.ranks),
                "runPolicy": {
                    "backoffLimit": 0,
                    "activeDeadlineSeconds": int(self.size.time_limit_s.value),
                    "cleanPodPolicy": "None",
                },
                "pytorchReplicaSpecs": replicas,
            },
        }

    def job(self) -> dict[str, Any]:
        self.comments[("spec", "activeDeadlineSeconds")] = self.deadline_comment()
        self.comments[("spec", "backoffLimit")] = (
            "no retries: a failed job fails again the same way"
        )
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": self.metadata(),
            "spec": {
                "backoffLimit": 0,
                "activeDeadlineSeconds": int(self.size.time_limit_s.value),
                "template": self.pod_template(("spec", "template"), "trainer", "job"),
            },
        }


# --- the rules no schema says ---------------------------------------------------------------


@dataclass(slots=True)
class _Pod:
    where: str
    containers: list[dict[str, Any]]
    volumes: list[dict[str, Any]]
    ranks: Any = None
    nodes: Any = None


def check_rules(
    doc: dict[str, Any], recorded_peak: int | None = None, num_workers: int = 0
) -> list[str]:
    """Problems a controller meets that the API schema does not catch, one line each."""
    problems: list[str] = []
    kind = doc.get("kind")
    try:
        pods = _pods(doc)
    except (AttributeError, TypeError, KeyError):
        return [f"{kind}: not the shape of a {kind} manifest"]
    for pod in pods:
        for c in pod.containers:
            name = c.get("name")
            if kind == "PyTorchJob" and name != PYTORCHJOB_CONTAINER:
                problems.append(
                    f"{pod.where}: container {name!r} must be named {PYTORCHJOB_CONTAINER!r}: "
                    "the PyTorchJob operator sets the rendezvous only on that container"
                )
            resources = c.get("resources") or {}
            problems += _resource_problems(
                resources, f"{pod.where} container {name}", recorded_peak
            )
            gpus = (resources.get("limits") or {}).get(GPU_RESOURCE)
            command = c.get("command") or []
            _ranks_rule(pod, gpus, command, problems)
        problems += _shm_problems(pod, num_workers)
    return problems


def _pods(doc: dict[str, Any]) -> list[_Pod]:
    kind = doc.get("kind")
    spec = doc.get("spec") or {}
    if kind == "TrainJob":
        trainer = spec.get("trainer") or {}
        volumes: list[dict[str, Any]] = []
        mounts: list[dict[str, Any]] = []
        for patch in spec.get("runtimePatches") or []:
            rjobs = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
            for rjob in rjobs:
                pod = rjob["template"]["spec"]["template"]["spec"]
                volumes += pod.get("volumes") or []
                for c in pod.get("containers") or []:
                    if c.get("name") == TRAINER_CONTAINER:
                        mounts += c.get("volumeMounts") or []
        container = {
            "name": TRAINER_CONTAINER,
            "command": trainer.get("command"),
            "resources": trainer.get("resourcesPerNode"),
            "volumeMounts": mounts,
        }
        return [
            _Pod(
                "spec.trainer",
                [container],
                volumes,
                trainer.get("numProcPerNode"),
                trainer.get("numNodes"),
            )
        ]
    if kind == "PyTorchJob":
        replicas = spec["pytorchReplicaSpecs"]
        nodes = sum(int(r.get("replicas", 1)) for r in replicas.values())
        return [
            _Pod(
                f"spec.pytorchReplicaSpecs.{role}",
                r["template"]["spec"].get("containers") or [],
                r["template"]["spec"].get("volumes") or [],
                spec.get("nprocPerNode"),
                nodes,
            )
            for role, r in replicas.items()
        ]
    if kind == "Job":
        pod = spec["template"]["spec"]
        containers = pod.get("containers") or []
        ranks = (
            _flag(containers[0].get("command") or [], "--nproc-per-node") if containers else None
        )
        return [_Pod("spec.template.spec", containers, pod.get("volumes") or [], ranks, 1)]
    return []


def _flag(command: list[str], name: str) -> str | None:
    for i, word in enumerate(command[:-1]):
        if word == name:
            return command[i + 1]
    return None


def _ranks_rule(pod: _Pod, gpus: Any, command: list[str], problems: list[str]) -> None:
    try:
        ranks = int(pod.ranks) if pod.ranks is not None else None
        nodes = int(pod.nodes) if pod.nodes is not None else 1
        gpu_count = int(gpus) if gpus is not None else 0
    except (TypeError, ValueError):
        problems.append(f"{pod.where}: ranks per node {pod.ranks!r} is not a number of ranks")
        return
    if ranks is None:
        problems.append(
            f"{pod.where}: no ranks per node given: the default is one rank per CPU (TrainJob) or "
            "every core (PyTorchJob 'auto'); write it explicitly"
        )
    elif gpu_count and ranks != gpu_count:
        problems.append(
            f"{pod.where}: {ranks} ranks per node but {gpu_count} GPUs per node: give one rank "
            "per GPU (--ranks-per-node or --gpus-per-node)"
        )
    if nodes > 1 and (not command or os.path.basename(str(command[0])) != "torchrun"):
        problems.append(
            f"{pod.where}: {nodes} nodes need torchrun to start the ranks (the operator sets no "
            f"RANK for several processes per node); the command starts {command[:1]}"
        )


def _resource_problems(resources: Any, where: str, recorded_peak: int | None) -> list[str]:
    problems: list[str] = []
    if not isinstance(resources, dict):
        return problems
    for group in ("requests", "limits"):
        for key, value in (resources.get(group) or {}).items():
            if parse_quantity(value) is None:
                byte_unit = re.fullmatch(r"([0-9.]+)([KMGTPE])i?B", str(value))
                hint = (
                    f" (write {byte_unit[1]}{byte_unit[2]}i or {byte_unit[1]}{byte_unit[2]}: "
                    "Kubernetes has no unit 'B')"
                    if byte_unit
                    else ""
                )
                problems.append(
                    f"{where}: {group}.{key} {value!r} is not a Kubernetes quantity{hint}"
                )
    limit = parse_quantity((resources.get("limits") or {}).get("memory"))
    if limit is not None and recorded_peak is not None and limit < recorded_peak:
        problems.append(
            f"{where}: memory limit {fmt_bytes(limit)} is below the recorded peak "
            f"{fmt_bytes(recorded_peak)}: the pod would be OOMKilled"
        )
    return problems


def _shm_problems(pod: _Pod, num_workers: int) -> list[str]:
    memory_volumes = {
        v.get("name")
        for v in pod.volumes
        if isinstance(v, dict) and (v.get("emptyDir") or {}).get("medium") == "Memory"
    }
    for c in pod.containers:
        for m in c.get("volumeMounts") or []:
            if m.get("mountPath") == "/dev/shm" and m.get("name") in memory_volumes:
                return []
    if num_workers:
        return [
            f"{pod.where}: the job runs {num_workers} DataLoader workers per rank but mounts no "
            "memory-backed /dev/shm: workers die with bus errors in the container's 64 MB"
        ]
    return []
