"""Which loop an estimate of ``file.py:factory`` assumes when ``--loop`` is not given (issue 48:
a Trainer user's estimate under the hand-written loop was 30 % high): the Trainer or Lightning
the user's file uses, else the hand-written loop, saying it was assumed and how to choose.
Real files importing the real frameworks, through the API and the command."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tests.conftest import run_td
from tests.helpers.dependencies import require
from torchdoctor.estimate.api import prepare

FACTORY = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def make():
    return Net(), lambda n: (torch.randn(n, 32), torch.randint(0, 4, (n,)))
"""

HF = """
from transformers import Trainer, TrainingArguments


class MyTrainer(Trainer):
    pass
"""

LIGHTNING = """
import lightning as L


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def make_lightning():
    return Module(), lambda n: (torch.randn(n, 32), torch.randint(0, 4, (n,)))
"""


def _file(tmp_path: Path, name: str, *parts: str) -> Path:
    path = tmp_path / name
    path.write_text("\n".join(textwrap.dedent(p) for p in (FACTORY, *parts)))
    return path


def _loop(spec: str, **options) -> tuple[str, str]:
    check, setup = prepare(spec, batch_size=2, **options)
    result = check.estimate(setup)
    assert result.setup.loop == setup.loop
    return setup.loop, result.loop_reason


def test_a_file_that_uses_the_hf_trainer_is_estimated_under_it(tmp_path):
    require("transformers")
    path = _file(tmp_path, "hf_train.py", HF)
    loop, reason = _loop(f"{path}:make")
    assert loop == "hf-trainer"
    assert reason == "hf_train.py uses transformers' MyTrainer (--loop chooses another)"
    # Asked for, the loop is the one asked for and no reason is said.
    assert _loop(f"{path}:make", loop="hand-written") == ("hand-written", "")


def test_a_lightning_module_is_estimated_under_lightning(tmp_path):
    require("lightning")
    path = _file(tmp_path, "pl_train.py", LIGHTNING)
    loop, reason = _loop(f"{path}:make_lightning")
    assert (loop, reason) == (
        "lightning",
        "pl_train.py uses Lightning (Module) (--loop chooses another)",
    )


def test_a_plain_file_says_the_loop_was_assumed_and_how_to_choose(tmp_path):
    path = _file(tmp_path, "plain.py")
    run = run_td("estimate", f"{path}:make", "--batch", "2", timeout=300)
    assert run.returncode == 0, run.stderr
    assert "  loop: hand-written, which" in run.stdout
    assert (
        f"    (assumed: {path} uses neither transformers' Trainer nor Lightning "
        "(--loop hf-trainer or lightning if it is trained by one))"
    ) in run.stdout
    as_json = run_td("estimate", f"{path}:make", "--batch", "2", "--json", timeout=300)
    document = json.loads(as_json.stdout)
    assert document["loop"] == "hand-written"
    assert document["loop_reason"].startswith("assumed: ")
    given = run_td("estimate", f"{path}:make", "--batch", "2", "--loop", "frees-output", "--json")
    assert json.loads(given.stdout)["loop_reason"] is None
