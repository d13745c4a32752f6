"""Bad input: one clear line on stderr naming the problem, and a non-zero exit."""

from __future__ import annotations

import os
import sys

import pytest

from tests.conftest import run_td
from tests.estimate.conftest import MODELS_FILE


def _one_error_line(res, *fragments: str) -> str:
    code, _out, err = res if isinstance(res, tuple) else (res.returncode, res.stdout, res.stderr)
    assert code != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("torchdoctor: error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


def test_factory_not_found_lists_what_the_file_defines(estimate_cli):
    res = estimate_cli(f"{MODELS_FILE}:no_such_model", "--input", "16")
    _one_error_line(res, "no factory 'no_such_model'", "gpt_tiny")


def test_factory_that_raises(tmp_path, estimate_cli):
    spec = tmp_path / "broken.py"
    spec.write_text("def make():\n    raise ValueError('needs a config file')\n")
    res = estimate_cli(f"{spec}:make", "--input", "16")
    _one_error_line(res, "raised ValueError: needs a config file")


def test_missing_model_file(estimate_cli):
    res = estimate_cli("nowhere/models.py:make", "--input", "16")
    _one_error_line(res, "model file nowhere/models.py does not exist")


def test_input_shape_that_does_not_match_names_module_and_op():
    res = run_td("estimate", f"{MODELS_FILE}:mlp_dropout", "--input", "3x32x32", "--batch", "4")
    _one_error_line(res, "--input 3x32x32", "in module '1' (Linear)", "aten.addmm")


def test_data_dependent_op_without_fallback_names_item(estimate_cli):
    res = estimate_cli(f"{MODELS_FILE}:data_dependent", "--batch", "4", "--no-fallback")
    _one_error_line(res, ".item()", "(Gated)", "fake tensors cannot trace it")


def test_data_dependent_op_falls_back_to_a_real_cpu_run_and_says_so(estimate_cli):
    code, out, err = estimate_cli(f"{MODELS_FILE}:data_dependent", "--batch", "4")
    assert code == 0, err
    assert "real CPU run (fallback)" in out
    assert "calls .item()" in out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--gpu", "A200"], "unknown GPU 'A200'"),
        (["--gpu-memory", "lots"], "cannot read --gpu-memory 'lots': write a size like 16G"),
        (["--device", "cuda"], "--device cuda needs a GPU"),
        (["--input", "3xfoo"], "cannot read input shape"),
        (["--batch", "0"], "--batch must be at least 1"),
    ],
)
def test_bad_options(args, fragment, estimate_cli):
    res = estimate_cli(f"{MODELS_FILE}:mlp_dropout", *args)
    _one_error_line(res, fragment)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--input", "3x"], "cannot read input shape '3x'"),  # was read as the shape (3,)
        (["--gpu-memory", "0"], "--gpu-memory must be above 0"),  # was "a GPU with 0 B"
    ],
)
def test_sizes_and_shapes_that_mean_nothing_are_refused(args, fragment):
    _one_error_line(run_td("estimate", f"{MODELS_FILE}:mlp_dropout", *args), fragment)


def test_bad_spec_form(estimate_cli):
    _one_error_line(estimate_cli("just_a_name"), "cannot read model spec 'just_a_name'")


def test_optional_backends_missing_say_what_to_install(estimate_cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import now raises ImportError
    _one_error_line(estimate_cli("hf:gpt2", "--tokens", "16"), "pip install transformers")


def test_unknown_hf_model_type_names_examples(estimate_cli):
    _one_error_line(
        estimate_cli("hf:no_such_arch", "--tokens", "16"), "no model type 'no_such_arch'", "gpt2"
    )


# -- the user's module runs in torchdoctor's process: its exits and argv are its own -----------

_ARGPARSE_AT_IMPORT = """
import argparse
import torch
parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--data", required={required})
args = parser.parse_args()
def make():
    return torch.nn.Linear(8, 2)
"""


def test_a_module_level_argparse_does_not_parse_torchdoctors_arguments(tmp_path):
    # It saw `estimate ap.py:make --input 8` and refused it in its own words, as if torchdoctor had
    (tmp_path / "ap.py").write_text(_ARGPARSE_AT_IMPORT.format(required=False))
    res = run_td("estimate", "ap.py:make", "--input", "8", "--batch", "2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "usage:" not in res.stderr


def test_an_argparse_that_exits_at_import_is_one_line_naming_the_file(tmp_path):
    (tmp_path / "ap.py").write_text(_ARGPARSE_AT_IMPORT.format(required=True))
    res = run_td("estimate", "ap.py:make", "--input", "8", cwd=tmp_path)
    assert res.returncode == 2
    _one_error_line(
        res,
        "importing ap.py exited with status 2",
        "the following arguments are required: --data",
        "its argparse parsed the command line?",
    )


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("jobs.py:exits", "the factory of jobs.py:exits exited with status 3"),  # was silent
        ("jobs.py:raises", "the factory of jobs.py:raises raised ValueError: no model today"),
        # a package module whose import raises something other than ImportError: a traceback
        ("badpkg.boom:make", "importing badpkg.boom raised ValueError: import-time failure"),
        ("nosuchpkg.mod:make", "cannot import module 'nosuchpkg.mod': No module named"),
        ("jobs.py:exits:extra", "cannot read model spec 'jobs.py:exits:extra': one colon"),
    ],
)
def test_the_users_exits_and_errors_are_one_line(tmp_path, spec, fragment):
    (tmp_path / "jobs.py").write_text(
        "import sys\n"
        "def exits():\n    sys.exit(3)\n"
        "def raises():\n    raise ValueError('no model today')\n"
    )
    (tmp_path / "badpkg").mkdir()
    (tmp_path / "badpkg" / "__init__.py").write_text("")
    (tmp_path / "badpkg" / "boom.py").write_text("raise ValueError('import-time failure')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = run_td("estimate", spec, "--input", "8", cwd=tmp_path, env=env)
    assert res.returncode == 2
    _one_error_line(res, fragment)


def test_a_folder_given_as_the_model_file_is_said_to_be_a_folder(tmp_path):
    # was "model file ... does not exist"
    res = run_td("estimate", f"{tmp_path}:make", "--input", "8")
    _one_error_line(res, f"model file {tmp_path} is a folder, not a Python file")


SLOW_FACTORY = "import time\n\n\ndef make():\n    time.sleep(120)\n"
SLOW_IMPORT = "import time\n\ntime.sleep(120)\n\n\ndef make():\n    pass\n"


@pytest.mark.parametrize(
    ("source", "what"),
    [(SLOW_FACTORY, "the factory of slow.py:make"), (SLOW_IMPORT, "importing slow.py")],
    ids=["factory", "import"],
)
def test_a_factory_that_never_returns_is_one_line_after_timeout(tmp_path, source, what):
    # probe M2: it hung silently. --timeout 2s: the line comes about 2 s after torch imported.
    (tmp_path / "slow.py").write_text(source)
    res = run_td("estimate", "slow.py:make", "--input", "8", "--timeout", "2s", cwd=tmp_path)
    _one_error_line(res, f"{what} did not return within 2 s", "raise --timeout")


@pytest.mark.parametrize("value", ["nan", "-5", "soon"])
def test_a_timeout_that_is_no_duration_is_refused(value):
    res = run_td("estimate", f"{MODELS_FILE}:mlp_dropout", "--input", "8", "--timeout", value)
    _one_error_line(res, "--timeout")


def test_the_wait_is_said_on_a_terminal_and_the_bound_ends_it(tmp_path, monkeypatch):
    """In process: a terminal stderr gets 'still waiting' lines while the factory runs, the
    SIGALRM bound ends it with the error naming factory_timeout, and the process's own SIGALRM
    handler is back afterwards."""
    import io
    import signal
    import time

    from torchdoctor.errors import ParameterError
    from torchdoctor.estimate import spec as spec_mod

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    (tmp_path / "slow.py").write_text(SLOW_FACTORY)
    terminal = Terminal()
    monkeypatch.setattr(spec_mod, "PROGRESS_EVERY_S", 0.2)
    monkeypatch.setattr(sys, "stderr", terminal)
    before = signal.getsignal(signal.SIGALRM)
    timer_before, _ = signal.getitimer(signal.ITIMER_REAL)
    workload = spec_mod.load_workload(f"{tmp_path / 'slow.py'}:make", (8,), timeout=1.0)
    started = time.monotonic()
    with pytest.raises(ParameterError) as caught:
        workload.build_model()
    assert time.monotonic() - started < 10
    assert "did not return within 1 s" in str(caught.value)
    assert "still waiting for the factory of" in terminal.getvalue()
    assert "s of at most 1 s" in terminal.getvalue()
    assert signal.getsignal(signal.SIGALRM) is before
    # A timer armed before (pytest-timeout's) is armed again with the time it had left.
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    assert (0 < left <= timer_before) if timer_before else left == 0


def test_a_timer_the_caller_armed_stays_theirs(tmp_path):
    """The bound nests in a SIGALRM timer armed by the caller (the fuzz suite's own bound): a
    factory that returns leaves it armed with the time it had left, and when it is due before
    ours, the caller's handler is the one that runs."""
    import signal
    import time

    from torchdoctor.estimate import spec as spec_mod

    class CallersAlarm(Exception):
        pass

    def callers(signum, frame):
        raise CallersAlarm

    (tmp_path / "fast.py").write_text(
        "import torch\n\n\ndef make():\n    return torch.nn.Linear(2, 2)\n"
    )
    (tmp_path / "slow.py").write_text(SLOW_FACTORY)
    previous = signal.signal(signal.SIGALRM, callers)
    previous_timer = signal.getitimer(signal.ITIMER_REAL)  # pytest-timeout's, if any
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        spec_mod.load_workload(f"{tmp_path / 'fast.py'}:make", (2,), timeout=600).build_model()
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 20 < left <= 30 and signal.getsignal(signal.SIGALRM) is callers

        signal.setitimer(signal.ITIMER_REAL, 0.5)
        slow = spec_mod.load_workload(f"{tmp_path / 'slow.py'}:make", (2,), timeout=60)
        started = time.monotonic()
        with pytest.raises(CallersAlarm):
            slow.build_model()
        assert time.monotonic() - started < 10
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        assert signal.getsignal(signal.SIGALRM) is callers
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if previous_timer[0]:
            signal.setitimer(signal.ITIMER_REAL, *previous_timer)
