"""`torchdoctor handoff`: one sizing for every target, each figure with its source; bad input
is one line and a non-zero exit."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.conftest import run_td
from tests.helpers.dependencies import require
from tests.slurm.conftest import DDP_CMD

yaml = require("yaml")
IMAGE = "registry.example.com/team/train:1.0"


def _handoff(recording: Path, target: str, *extra: str, cmd=DDP_CMD):
    image = ["--image", IMAGE] if target in ("trainjob", "pytorchjob", "job") else []
    return run_td("handoff", "--to", target, "--from", str(recording), *image, *extra, "--", *cmd)


def test_slurm_is_sbatch_itself(ddp_recording: Path) -> None:
    via_handoff = _handoff(ddp_recording, "slurm")
    via_sbatch = run_td("sbatch", "--from", str(ddp_recording), "--", *DDP_CMD)
    assert via_handoff.returncode == 0, via_handoff.stderr
    # the same script but for the minute it was written in
    strip = lambda t: re.sub(r" on \d{4}-\d\d-\d\d \d\d:\d\d UTC", "", t)  # noqa: E731
    assert strip(via_handoff.stdout) == strip(via_sbatch.stdout)


def _sbatch_figures(text: str) -> dict[str, str]:
    return dict(re.findall(r"#SBATCH --(cpus-per-task|mem|time)=(\S+)", text))


def test_every_target_gets_the_same_sizes(ddp_recording: Path) -> None:
    """One definition: cores, memory, shm, ranks and threads agree across targets."""
    slurm = _sbatch_figures(_handoff(ddp_recording, "slurm").stdout)
    cpus = int(slurm["cpus-per-task"])
    mem_mib = int(slurm["mem"].rstrip("M")) if slurm["mem"].endswith("M") else None
    seen = {}
    for target in ("trainjob", "pytorchjob", "job"):
        res = _handoff(ddp_recording, target)
        assert res.returncode == 0, res.stderr
        doc = yaml.safe_load(res.stdout)
        if target == "trainjob":
            trainer = doc["spec"]["trainer"]
            resources, ranks = trainer["resourcesPerNode"], trainer["numProcPerNode"]
            patch = doc["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
            pod = patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
            env = trainer["env"]
        elif target == "pytorchjob":
            pod = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
            resources, ranks = pod["containers"][0]["resources"], int(doc["spec"]["nprocPerNode"])
            env = pod["containers"][0]["env"]
        else:
            pod = doc["spec"]["template"]["spec"]
            resources = pod["containers"][0]["resources"]
            command = pod["containers"][0]["command"]
            ranks = int(command[command.index("--nproc-per-node") + 1])
            env = pod["containers"][0]["env"]
        shm = pod["volumes"][0]["emptyDir"]["sizeLimit"]
        seen[target] = (
            resources["requests"]["cpu"],
            resources["limits"]["memory"],
            shm,
            ranks,
            {e["name"]: e["value"] for e in env}["OMP_NUM_THREADS"],
        )
        assert resources["requests"]["cpu"] == str(cpus)
    assert len(set(seen.values())) == 1, seen
    _, memory, shm, ranks, _ = seen["job"]
    assert ranks == 2
    # memory limit = Slurm's --mem (recorded peak + margin) + the shared memory volume
    if mem_mib is not None:
        assert _mib(memory) == mem_mib + _mib(shm)
    ray = _handoff(ddp_recording, "ray")
    assert ray.returncode == 0, ray.stderr
    assert f"--entrypoint-num-cpus {cpus}" in ray.stdout
    assert "--nproc-per-node 2" in ray.stdout


def _mib(quantity: str) -> int:
    return int(quantity[:-2]) * (1024 if quantity.endswith("Gi") else 1)


def test_every_figure_says_where_it_came_from(ddp_recording: Path) -> None:
    text = _handoff(ddp_recording, "trainjob").stdout
    assert "# memory: peak PSS of the whole job" in text
    assert "# cpu: peak CPU use" in text
    assert "/dev/shm: " in text
    assert "# time: " in text
    assert "# ranks per node: ranks that stepped in the recording" in text


@pytest.mark.parametrize(
    ("extra", "target", "says"),
    [
        ((), "trainjob", "needs --image"),
        (("--image", "a b"), "job", "--image 'a b'"),
        (("--job-name", "Bad_Name"), "job", "--job-name 'Bad_Name'"),
        (("--partition", "gpu"), "job", "--partition is for --to slurm"),
        (("--image", "x:1"), "slurm", "--image is for --to"),
        (("--submit",), "pytorchjob", "reaches no Kubernetes cluster"),
        (("--nodes", "2"), "job", "--to job runs on one node"),
        (("--trainer-version", "2.1"), "trainjob", "'2.1' is not one of"),
        (("--address", "127.0.0.1:8265\nx"), "ray", "give the URL of Ray's job API"),
    ],
)
def test_bad_input_is_one_line(ddp_recording: Path, extra, target, says) -> None:
    image = ["--image", IMAGE] if target in ("trainjob", "pytorchjob", "job") else []
    if "--image" in extra or target == "trainjob" and not extra:
        image = []
    res = run_td(
        "handoff", "--to", target, "--from", str(ddp_recording), *image, *extra, "--", *DDP_CMD
    )
    assert res.returncode != 0
    assert says in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, res.stderr


def test_o_writes_through_the_one_writer(ddp_recording: Path, tmp_path: Path) -> None:
    out = tmp_path / "job.yaml"
    out.write_text("someone's notes\n")
    res = _handoff(ddp_recording, "trainjob", "-o", str(out))
    assert res.returncode != 0 and "--force" in res.stderr
    assert out.read_text() == "someone's notes\n"
    assert _handoff(ddp_recording, "trainjob", "-o", str(out), "--force").returncode == 0
    assert yaml.safe_load(out.read_text())["kind"] == "TrainJob"
    # a manifest it wrote itself is written again without --force
    assert _handoff(ddp_recording, "trainjob", "-o", str(out)).returncode == 0


def test_status_wants_ray_id() -> None:
    res = run_td("handoff", "status", "slurm:12")
    assert res.returncode != 0 and "give ray:ID" in res.stderr


def test_command_words_cannot_break_the_manifest(ddp_recording: Path) -> None:
    """A word of the command with YAML syntax in it stays one string of the command."""
    tricky = ["--steps", "3", "--note", "a: b\n- c # d", "*ref", "yes", "1e3"]
    res = _handoff(ddp_recording, "job", cmd=[sys.executable, DDP_CMD[1], *tricky])
    assert res.returncode == 0, res.stderr
    command = yaml.safe_load(res.stdout)["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-len(tricky) :] == tricky


def test_json_document_validates(ddp_recording: Path) -> None:
    from tests.helpers.schemas import assert_valid

    for target in ("trainjob", "ray", "ray-train"):
        res = _handoff(ddp_recording, target, "--json")
        assert res.returncode == 0, res.stderr
        doc = assert_valid("handoff", res.stdout)
        assert doc["target"] == target and doc["path"] is None
    res = _handoff(ddp_recording, "slurm", "--json")
    assert assert_valid("sbatch", res.stdout)["script"].startswith("#!/bin/bash")
