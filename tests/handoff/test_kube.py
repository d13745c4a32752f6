"""Kubernetes manifests: golden files per target, validated strictly against the published API
models (kubeflow-trainer-api, kubeflow-training, kubernetes), and each rule no schema says
caught in one line."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.dependencies import require
from tests.slurm.test_script import CMD, GIB, MIB, recorded
from torchdoctor.errors import UserError
from torchdoctor.handoff.kube import (
    KubeOptions,
    check_rules,
    memory_quantity,
    parse_quantity,
    render_manifest,
)
from torchdoctor.handoff.validate import validate_doc, validate_text
from torchdoctor.handoff.yaml_text import to_yaml
from torchdoctor.sizing.size import JobRequest, size_job

GOLDEN = Path(__file__).parent / "golden"
yaml = require("yaml")
for _models in ("kubeflow_trainer_api", "kubeflow.training", "kubernetes"):
    require(_models)
TARGETS = ("trainjob", "pytorchjob", "job")


def manifest(target: str, nodes: int | None = None, **job):
    nodes = nodes or (2 if target != "job" else 1)
    size = size_job(recorded(**job), JobRequest(command=list(CMD), nodes=nodes))
    opts = KubeOptions(
        target=target,
        name="train",
        image="registry.example.com/team/train:1.0",
        source="recording /runs/train.sqlite",
        num_workers=2,
    )
    return size, render_manifest(size, list(CMD), opts)


@pytest.mark.parametrize("target", TARGETS)
def test_golden_manifest_validates_strictly(target: str) -> None:
    _, m = manifest(target, shm_peak=700 * MIB)
    golden = GOLDEN / f"{target}.yaml"
    if os.environ.get("TORCHDOCTOR_UPDATE_GOLDEN"):
        golden.write_text(m.text)
    assert m.text == golden.read_text()
    assert yaml.safe_load(m.text) == m.doc  # what is written is what was meant
    assert validate_text(m.text) == []


@pytest.mark.parametrize("target", TARGETS)
def test_memory_limit_is_peak_margin_and_shm(target: str) -> None:
    size, m = manifest(target, shm_peak=700 * MIB)
    text = m.text
    limit = size.mem_per_node.value + size.shm.value
    assert f'memory: "{memory_quantity(limit)}"' in text
    assert f'sizeLimit: "{memory_quantity(size.shm.value)}"' in text
    assert size.shm.value == 1536 * MIB  # 700 MiB x 2, rounded up to 256 MiB
    assert 'medium: "Memory"' in text
    assert "activeDeadlineSeconds: " in text


def test_shm_not_measured_is_said_plainly() -> None:
    _, m = manifest("job")  # the builder's recording predates shm sampling
    assert "shared memory not measured" in m.text


def _first(doc, *path):
    for p in path:
        doc = doc[p]
    return doc


def _trainer(doc):
    return doc["spec"]["trainer"]


@pytest.mark.parametrize(
    ("target", "edit", "says"),
    [
        (
            "trainjob",
            lambda d: _trainer(d).update(nprocPerNod=2),
            "spec.trainer.nprocPerNod: unknown field",
        ),
        (
            "pytorchjob",
            lambda d: d["spec"]["runPolicy"].update(backofLimit=0),
            "runPolicy.backofLimit: unknown field",
        ),
        ("job", lambda d: d["spec"].update(backofLimit=0), "spec.backofLimit: unknown field"),
        (
            "job",
            lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePullPolice="x"),
            "imagePullPolice: unknown field",
        ),
        ("pytorchjob", lambda d: d["spec"].update(nprocPerNode=2), "nprocPerNode: expected str"),
        ("trainjob", lambda d: _trainer(d).update(numProcPerNode="auto"), "numProcPerNode"),
    ],
)
def test_schema_catches_in_one_line(target, edit, says) -> None:
    _, m = manifest(target)
    doc = copy.deepcopy(m.doc)
    edit(doc)
    problems = validate_text(to_yaml(doc))
    assert problems and says in problems[0], problems
    assert all("\n" not in p for p in problems)


def _containers(doc):
    kind = doc["kind"]
    if kind == "PyTorchJob":
        return [
            r["template"]["spec"]["containers"][0]
            for r in doc["spec"]["pytorchReplicaSpecs"].values()
        ]
    if kind == "Job":
        return [doc["spec"]["template"]["spec"]["containers"][0]]
    return [{"resources": doc["spec"]["trainer"]["resourcesPerNode"]}]


def _drop_shm(doc):
    if doc["kind"] == "TrainJob":
        del doc["spec"]["runtimePatches"]
        return
    pods = (
        [r["template"]["spec"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
        if doc["kind"] == "PyTorchJob"
        else [doc["spec"]["template"]["spec"]]
    )
    for pod in pods:
        pod.pop("volumes")
        pod["containers"][0].pop("volumeMounts")


@pytest.mark.parametrize("target", TARGETS)
def test_48gb_memory_is_caught(target) -> None:
    size, m = manifest(target)
    doc = copy.deepcopy(m.doc)
    for c in _containers(doc):
        c["resources"]["limits"]["memory"] = "48GB"
    problems = check_rules(doc, size.memory_peak, 2)
    assert len(problems) >= 1 and "'48GB' is not a Kubernetes quantity" in problems[0]
    assert "48Gi or 48G" in problems[0]


@pytest.mark.parametrize("target", TARGETS)
def test_workers_without_shm_are_caught(target) -> None:
    size, m = manifest(target)
    doc = copy.deepcopy(m.doc)
    _drop_shm(doc)
    problems = check_rules(doc, size.memory_peak, 2)
    assert (
        problems
        and "2 DataLoader workers per rank but mounts no memory-backed /dev/shm" in problems[0]
    )
    assert check_rules(doc, size.memory_peak, 0) == []  # no workers: nothing to say


# A limit edited by hand after rendering, and the line the check gives for it.
EDITED_LIMITS = [
    ("nvidia.com/gpu", "4", "1 ranks per node but 4 GPUs per node"),
    ("memory", "8Gi", "memory limit 8.00 GiB is below the recorded peak 10.0 GiB"),
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("limit", "value", "message"), EDITED_LIMITS)
def test_an_edited_limit_is_caught(target, limit, value, message) -> None:
    size, m = manifest(target)
    doc = copy.deepcopy(m.doc)
    for c in _containers(doc):
        c["resources"]["limits"][limit] = value
    problems = check_rules(doc, size.memory_peak, 2)
    assert problems and message in problems[0]


def test_pytorchjob_container_must_be_pytorch() -> None:
    size, m = manifest("pytorchjob")
    doc = copy.deepcopy(m.doc)
    doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = (
        "main"
    )
    problems = check_rules(doc, size.memory_peak, 2)
    assert problems == [
        "spec.pytorchReplicaSpecs.Worker: container 'main' must be named 'pytorch': the "
        "PyTorchJob operator sets the rendezvous only on that container"
    ]


def test_several_nodes_need_torchrun() -> None:
    size, m = manifest("trainjob")
    doc = copy.deepcopy(m.doc)
    doc["spec"]["trainer"]["command"] = ["python", "train.py"]
    problems = check_rules(doc, size.memory_peak, 2)
    assert problems and "2 nodes need torchrun" in problems[0]


def test_ranks_follow_gpus_or_refuse() -> None:
    size = size_job(recorded(), JobRequest(command=list(CMD), gpus_per_node=4, ranks_per_node=2))
    opts = KubeOptions(target="job", name="t", image="x:1", source="s", num_workers=2)
    with pytest.raises(UserError, match="2 ranks per node but 4 GPUs per node"):
        render_manifest(size, list(CMD), opts)


def test_quantities() -> None:
    assert parse_quantity("48Gi") == 48 * GIB
    assert parse_quantity("500m") == 0.5
    assert parse_quantity("1e3") == 1000
    assert parse_quantity("48GB") is None
    assert memory_quantity(3 * GIB) == "3Gi" and memory_quantity(1280 * MIB) == "1280Mi"


def test_unknown_kind_is_refused() -> None:
    assert "is not one torchdoctor writes" in validate_doc({"kind": "Pod", "apiVersion": "v1"})[0]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (optional)")
@pytest.mark.parametrize("target", TARGETS)
def test_kubectl_kustomize_parses_them(target, tmp_path: Path) -> None:
    _, m = manifest(target)
    (tmp_path / "job.yaml").write_text(m.text)
    (tmp_path / "kustomization.yaml").write_text("resources:\n- job.yaml\n")
    res = subprocess.run(
        ["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(res.stdout) == m.doc
