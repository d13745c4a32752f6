"""The agent package as the bootstrap loads it into a job's Python: by path, as
``_torchdoctor_agent``, nothing of torchdoctor imported, and its torch-time modules loaded only
once the program imports torch."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from torchdoctor.instrument.collector import BOOTSTRAP_DIR, bootstrap_env

BUILT = importlib.util.find_spec("torchdoctor.instrument.agent._fast") is not None

WITH_TORCH = ["_torchdoctor_agent"] + [
    f"_torchdoctor_agent.{m}"
    for m in (
        "compiled", "contract", "core", "cuda", "eval_forward", "evaluation", "hooks", "loaders",
        "pitfalls",
        "settings", "sidetable", "sink", "steps",
        *(["_fast"] if BUILT else []),  # built for this Python: a plain environment takes it
    )
]  # fmt: skip

SHOW = """
import json, sys
def ours():
    return sorted(m for m in sys.modules if m.startswith(("_torchdoctor", "torchdoctor")))
before = ours()
{body}
print(json.dumps([before, ours()]))
"""


def _loaded(tmp_path, body: str) -> tuple[list[str], list[str]]:
    # A plain environment, PYTHONPATH carrying only the bootstrap, as `torchdoctor run` sets.
    env = bootstrap_env({"PATH": "/usr/bin:/bin"}, str(tmp_path / "nobody.sock"))
    code = SHOW.format(body=body)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    before, after = json.loads(out.stdout)
    return before, after


def test_a_process_that_never_imports_torch_loads_none_of_the_agent(tmp_path):
    before, after = _loaded(tmp_path, "import json")
    assert before == after == []


def test_importing_torch_loads_the_hooks_and_installs_them(tmp_path):
    body = "import torch\nagent = sys.modules['_torchdoctor_agent'].AGENT\nassert agent.active"
    before, after = _loaded(tmp_path, body)
    assert before == []
    assert after == sorted(WITH_TORCH)  # no torchdoctor module, by path only


def test_looking_torch_up_loads_the_watch_and_importing_it_later_installs_the_agent(tmp_path):
    # Libraries ask importlib.util.find_spec("torch") long before (or without) importing it.
    body = """
import importlib.util
assert importlib.util.find_spec("torch") is not None
agent = sys.modules['_torchdoctor_agent']
assert "AGENT" not in vars(agent), "looking torch up built the agent"
import torch
assert agent.AGENT.active and agent.AGENT.sinks, "importing torch later did not install it"
assert not any("torchdoctor_start_up" in vars(f) for f in sys.meta_path if hasattr(f, "__dict__"))
"""
    before, after = _loaded(tmp_path, body)
    assert before == []
    assert after == sorted(WITH_TORCH)


def test_the_package_imports_under_both_names_to_one_behaviour():
    from torchdoctor.instrument import agent

    assert agent.Agent.__module__ == "torchdoctor.instrument.agent.core"
    assert agent.STOPPED_EXIT_STATUS == 75
    assert agent.AGENT.flush_max_steps == agent.FLUSH_MAX_STEPS


def test_the_variables_that_build_the_agent_at_start_up_are_the_contract_s():
    from torchdoctor.instrument.agent import contract

    # Read, not run: importing the bootstrap would bootstrap this process.
    tree = ast.parse((Path(BOOTSTRAP_DIR) / "sitecustomize.py").read_text())
    names = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    assert names["_BUILD_NOW_IF_SET"] == (
        contract.ENV_NO_INSTRUMENT,
        contract.ENV_OVERRIDES,
        contract.ENV_STOP_AFTER_STEPS,
    )
    assert names["_START_UP_ENV"][0] == contract.ENV_COLLECTOR


def test_a_start_up_with_overrides_builds_the_agent_at_once(tmp_path):
    env = bootstrap_env({"PATH": "/usr/bin:/bin"}, str(tmp_path / "nobody.sock"))
    env["TORCHDOCTOR_OVERRIDES"] = "{not json"
    body = "print(sys.modules['_torchdoctor_agent'].AGENT.events[0][1])"
    out = subprocess.run(
        [sys.executable, "-c", f"import sys\n{body}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "overrides-invalid"
