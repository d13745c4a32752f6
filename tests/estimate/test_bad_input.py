"""Bad input: one clear line on stderr naming the problem, and a non-zero exit."""

from __future__ import annotations

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
