"""Every --json document carries its schema_version and validates against its shipped schema."""

from __future__ import annotations

import json
import sys

from tests.conftest import REPO, run_td
from tests.helpers.dependencies import require
from tests.helpers.schemas import assert_valid
from tests.queue.conftest import queue_env  # noqa: F401 - the fixture
from torchdoctor.cli.json_output import SCHEMA_VERSIONS, SCHEMAS_DIR

GPT = f"{REPO / 'examples' / 'estimate_models.py'}:gpt_tiny"


def test_every_document_has_a_schema_and_every_schema_is_valid():
    jsonschema = require("jsonschema")
    shipped = {p.name.removesuffix(".schema.json") for p in SCHEMAS_DIR.glob("*.schema.json")}
    assert shipped == set(SCHEMA_VERSIONS)
    for name in shipped:
        schema = json.loads((SCHEMAS_DIR / f"{name}.schema.json").read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["properties"]["schema_version"] == {"const": SCHEMA_VERSIONS[name]}
    # shipped in the wheel: pyproject's package-data names the folder
    assert '"cli/schemas/*.schema.json"' in (REPO / "pyproject.toml").read_text()


def test_recording_commands_json(user, tmp_path):
    require("jsonschema")
    done = user.td(
        "run", "--json", "--interval", "0.1", "--", sys.executable, "-c", "print('job says hi')"
    )
    assert done.returncode == 0, done.stderr
    *job_output, last_line = done.stdout.splitlines()
    # the job's own output first, untouched; into a pipe, which cannot be read back to see
    # whether it ended a line, the JSON always starts on a new one
    assert job_output == ["job says hi", ""]
    run = assert_valid("run", last_line)
    assert run["exit_status"] == 0 and run["status"] == "exit 0"
    assert_valid("ls", user.json("ls", "--json"))
    assert_valid("show", user.json("show", "last", "--json"))
    assert_valid("diagnose", user.json("diagnose", "last", "--json"))
    report = assert_valid(
        "report", user.json("report", "last", "-o", str(tmp_path / "r.html"), "--json")
    )
    assert report["path"] == str(tmp_path / "r.html") and report["bytes"] > 1000
    exported = assert_valid(
        "export",
        user.json(
            "export", "last", "--format", "jsonl", "--out-dir", str(tmp_path / "x"), "--json"
        ),
    )
    assert exported["files"] and all(p.startswith(str(tmp_path / "x")) for p in exported["files"])
    sbatch = assert_valid(
        "sbatch", user.json("sbatch", "--from", "last", "--json", "--", "python", "t.py")
    )
    assert sbatch["script"].startswith("#!") and sbatch["job_id"] is None


def test_submit_json(queue_env):  # noqa: F811
    require("jsonschema")
    q = queue_env()
    done = q.td("submit", "--mem", "100M", "--json", "--", sys.executable, "-c", "pass")
    assert done.returncode == 0, done.stderr
    job = assert_valid("submit", done.stdout)
    assert job["mem_bytes"] == 100 * 2**20 and q.wait(job["id"]) == 0


def test_machine_commands_json():
    require("jsonschema")
    top = run_td("top", "--once", "--json", "--interval", "0.2")
    assert top.returncode == 0, top.stderr
    assert_valid("top", top.stdout)
    doctor = run_td("doctor", "--only", "versions", "--json")
    assert doctor.returncode in (0, 1), doctor.stderr
    assert_valid("doctor", doctor.stdout)


def test_estimate_and_bench_json():
    require("jsonschema")
    require("torch")
    one = run_td("estimate", GPT, "--tokens", "16", "--gpu", "T4", "--json")
    assert one.returncode == 0, one.stderr
    assert_valid("estimate", one.stdout)
    most = run_td(
        "estimate", GPT, "--tokens", "16", "--gpu-memory", "64MiB", "--max-batch", "--json"
    )
    assert most.returncode == 0, most.stderr
    assert_valid("estimate-max-batch", most.stdout)
    bench = run_td(
        "bench", "allreduce", "--backend", "gloo", "--nproc", "2", "--sizes", "4K",
        "--ops", "all_reduce", "--iters", "1", "--warmup", "0", "--json",
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    assert_valid("bench-allreduce", bench.stdout)
