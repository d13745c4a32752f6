"""The agent package as the bootstrap loads it into a job's Python: by path, as
``_torchdoctor_agent``, nothing of torchdoctor imported, and its torch-time modules loaded only
once the program imports torch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from torchdoctor.instrument.collector import bootstrap_env

BUILT = importlib.util.find_spec("torchdoctor.instrument.agent._fast") is not None

START_UP = ["_torchdoctor_agent"]
WITH_TORCH = [
    f"_torchdoctor_agent.{m}"
    for m in (
        "compiled", "contract", "core", "cuda", "evaluation", "hooks", "loaders", "settings",
        "sidetable", "sink", "steps",
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


def test_a_process_that_never_imports_torch_loads_only_the_start_up_modules(tmp_path):
    before, after = _loaded(tmp_path, "import json")
    assert before == after == sorted(START_UP)


def test_importing_torch_loads_the_hooks_and_installs_them(tmp_path):
    body = "import torch\nagent = sys.modules['_torchdoctor_agent'].AGENT\nassert agent.active"
    before, after = _loaded(tmp_path, body)
    assert before == sorted(START_UP)
    assert after == sorted(START_UP + WITH_TORCH)  # no torchdoctor module, by path only


def test_the_package_imports_under_both_names_to_one_behaviour():
    from torchdoctor.instrument import agent

    assert agent.Agent.__module__ == "torchdoctor.instrument.agent.core"
    assert agent.STOPPED_EXIT_STATUS == 75
    assert agent.AGENT.flush_max_steps == agent.FLUSH_MAX_STEPS


def test_the_variables_that_build_the_agent_at_start_up_are_the_contract_s():
    from torchdoctor.instrument import agent
    from torchdoctor.instrument.agent import contract

    assert agent._BUILD_NOW_IF_SET == (
        contract.ENV_NO_INSTRUMENT,
        contract.ENV_OVERRIDES,
        contract.ENV_STOP_AFTER_STEPS,
    )
    assert agent._START_UP_ENV[0] == contract.ENV_COLLECTOR


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
