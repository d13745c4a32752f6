"""Each loop shape people write, estimated and then run for real on the CPU.

The truth is the CPU allocator's peak as torch.profiler records it while the loop of
examples/estimate_loops.py runs: a loop written out by hand, transformers' real
``Trainer.train()`` or Lightning's real ``Trainer.fit()``, with none of the estimator's step
code, storage tracker or accounting involved.
"""

from __future__ import annotations

import ast
import json
import sys

import pytest
import torch

from tests.estimate.conftest import EXAMPLES, MODELS_FILE
from torchdoctor.errors import ParameterError
from torchdoctor.estimate.api import estimate, max_batch, prepare

TOLERANCE = 0.01
BATCH = 4
SEQ = 64


@pytest.fixture(scope="module")
def loops():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import estimate_loops
    finally:
        sys.path.remove(str(EXAMPLES))
    return estimate_loops


def _estimated(factory, **options) -> int:
    """The CPU peak the estimator predicts (kernel scratch included, as the allocator sees)."""
    check, setup = prepare(factory, **options)
    return check.estimate(setup).peak_allocated


def _tokens(vocab: int, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, SEQ))
    return ids, torch.randint(0, vocab, (rows, SEQ))


def case_nanogpt(models, loops):
    model, make_batch = models.nanogpt_small()
    (x, y), _ = make_batch(BATCH)
    return _estimated(models.nanogpt_small, batch_size=BATCH), loops.run_nanogpt(model, x, y)


def case_classic(models, loops):
    estimated = _estimated(models.gpt_tiny, tokens=SEQ, batch_size=BATCH)
    return estimated, loops.run_classic(models.gpt_tiny(), *_tokens(2048))


def case_accumulation(models, loops):
    """4 micro-batches, each ``out = model(x)`` (a dict) held until the next forward returns."""
    model, make_batch, loss = models.dict_output()
    x, y = make_batch(32)
    estimated = _estimated(models.dict_output, batch_size=32, grad_accumulation=4)
    return estimated, loops.run_classic(model, x, y, loss_fn=loss, accumulation=4)


def case_dict_output(models, loops):
    model, make_batch, loss = models.dict_output()
    x, y = make_batch(32)
    estimated = _estimated(models.dict_output, batch_size=32)
    return estimated, loops.run_classic(model, x, y, loss_fn=loss)


def case_hf_trainer(models, loops):
    estimated = _estimated(models.hf_gpt2_tiny, tokens=SEQ, batch_size=BATCH, loop="hf-trainer")
    ids, _ = _tokens(8192, rows=4 * BATCH)
    return estimated, loops.run_hf_trainer(models.hf_gpt2_tiny(), ids, BATCH)


def case_lightning(models, loops):
    module, make_batch = models.lightning_lm()
    ids, targets = make_batch(4 * BATCH)
    estimated = _estimated(models.lightning_lm, batch_size=BATCH, loop="lightning")
    return estimated, loops.run_lightning(module, ids, targets, BATCH)


CASES = {
    "nanogpt-logits-loss": case_nanogpt,
    "classic-out-model-x": case_classic,
    "accumulation-4-held": case_accumulation,
    "dict-output": case_dict_output,
    "hf-trainer-causal-lm": case_hf_trainer,
    "lightning-fit": case_lightning,
}


@pytest.mark.parametrize("case", CASES)
def test_estimate_matches_a_real_run_of_the_loop(models, loops, case):
    estimated, real = CASES[case](models, loops)
    assert estimated == pytest.approx(real, rel=TOLERANCE), (estimated, real)


def test_the_default_loop_holds_the_output_and_frees_output_does_not(models, loops):
    """nanoGPT's logits are the one large tensor a hand-written loop keeps through backward."""
    held = _estimated(models.nanogpt_small, batch_size=BATCH)
    freed = _estimated(models.nanogpt_small, batch_size=BATCH, loop="frees-output")
    assert held > freed * 1.10
    model, make_batch = models.nanogpt_small()
    (x, y), _ = make_batch(BATCH)
    real_freed = loops.run_nanogpt(model, x, y, hold=False)
    assert freed == pytest.approx(real_freed, rel=TOLERANCE)
    # The difference is one logits tensor: batch x sequence x vocabulary x 4 bytes.
    assert held - freed == BATCH * SEQ * 8192 * 4


def test_json_is_only_json_when_the_model_prints_and_names_the_loop(estimate_cli):
    code, out, err = estimate_cli(f"{MODELS_FILE}:nanogpt_small", "--batch", "2", "--json")
    assert code == 0, err
    data = json.loads(out)  # the model's "number of parameters" line is not in it
    assert "number of parameters" in err
    assert data["loop"] == "hand-written" and data["setup"]["loop"] == "hand-written"
    others = {o["loop"]: o for o in data["other_loops"]}
    # hf-trainer is offered for transformers models, lightning for LightningModules.
    assert set(others) == {"frees-output"}
    assert others["frees-output"]["change_bytes"] == -2 * SEQ * 8192 * 4
    assert others["frees-output"]["bytes"] == data["peak_allocated_bytes"] - 2 * SEQ * 8192 * 4


def test_text_names_the_loop_and_what_freeing_the_output_would_give(estimate_cli):
    code, out, err = estimate_cli(f"{MODELS_FILE}:nanogpt_small", "--batch", "2")
    assert code == 0, err
    assert "number of parameters" in out  # without --json the model's prints stay where they are
    assert "loop: hand-written, which keeps the model's output through backward" in out
    line = next(line for line in out.splitlines() if "with --loop frees-output" in line)
    assert "(-4.00 MiB," in line


def test_hf_specs_default_to_the_hf_trainer_loop():
    _check, setup = prepare("hf:gpt2", tokens=8)
    assert setup.loop == "hf-trainer"
    assert "adamw (fused, the hf-trainer default)" in setup.describe()


def test_max_batch_searches_with_the_loop_chosen(models):
    held = max_batch(models.nanogpt_small, device="cpu", gpu_memory="96MiB")
    freed = max_batch(models.nanogpt_small, device="cpu", gpu_memory="96MiB", loop="frees-output")
    assert held.estimate.setup.loop == "hand-written"
    assert freed.estimate.setup.loop == "frees-output"
    assert freed.batch_size > held.batch_size >= 1


@pytest.mark.parametrize(
    ("options", "python", "cli"),
    [
        ({"batch_size": 0}, "batch_size must be at least 1", "--batch must be at least 1"),
        (
            {"grad_accumulation": 0},
            "grad_accumulation must be at least 1",
            "--grad-accumulation must be at least 1",
        ),
        ({"margin": 1.5}, "margin must be a fraction", "--margin must be a fraction"),
        (
            {"gpu": "A100-80GB", "device": "cpu"},
            "gpu='A100-80GB' describes a CUDA target: add device='cuda'",
            "--gpu A100-80GB describes a CUDA target: add --device cuda",
        ),
    ],
)
def test_library_errors_name_the_parameter_and_the_cli_the_flag(
    models, estimate_cli, options, python, cli
):
    with pytest.raises(ParameterError) as raised:
        estimate(models.mlp_dropout, **options)
    assert python in str(raised.value)
    flags = {
        "batch_size": "--batch",
        "grad_accumulation": "--grad-accumulation",
        "margin": "--margin",
        "gpu": "--gpu",
        "device": "--device",
    }
    args = [part for key, value in options.items() for part in (flags[key], str(value))]
    code, _out, err = estimate_cli(f"{MODELS_FILE}:mlp_dropout", *args)
    assert code != 0 and cli in err, err


def test_max_batch_without_a_memory_names_its_parameters(models):
    with pytest.raises(
        ParameterError, match=r"max_batch\(\) needs a memory to fit: pass gpu or gpu_memory"
    ):
        max_batch(models.mlp_dropout)


def test_estimate_modules_import_no_cycle():
    """estimate/api.py -> max_batch.py -> fitcheck.py, never back (issue 12)."""
    import torchdoctor.estimate as package

    folder = package.__path__[0]
    graph: dict[str, set[str]] = {}
    for path in sorted(__import__("pathlib").Path(folder).glob("*.py")):
        tree = ast.parse(path.read_text())
        graph[path.stem] = {
            node.module.rsplit(".", 1)[-1]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("torchdoctor.estimate.")
        }

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = [name for name in graph if reaches(name, name, {name})]
    assert cycles == []


def test_a_failing_batch_is_named_by_the_parameter_it_came_from(models):
    with pytest.raises(
        ParameterError, match=r"from input_shape='3x32x32' in module '1' \(Linear\)"
    ):
        estimate(models.mlp_dropout, input_shape="3x32x32", batch_size=4)
