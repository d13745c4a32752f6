"""What the agent keeps about the user's DataLoaders and iterators is held beside them: their
own attributes are never written (that would slow every attribute read of theirs)."""

from __future__ import annotations

import gc
import json

import torch
from torch.utils.data import DataLoader, TensorDataset

from torchdoctor.instrument.agent import Agent
from torchdoctor.instrument.agent.sidetable import SideTable


class Picky:
    """Equality that must never be asked (a WeakKeyDictionary would)."""

    def __eq__(self, other):
        raise AssertionError("compared")

    __hash__ = None


def test_values_by_identity_dropped_with_their_object():
    table = SideTable()
    a, b = Picky(), Picky()
    table.set(a, 1)
    table.set(b, 2)
    assert table.get(a) == 1 and b in table and table.pop(b) == 2 and b not in table
    assert table.pop(b, "gone") == "gone"
    del a
    gc.collect()
    assert not table._items  # the entry went with its object
    table.set(42, "no weak reference")  # ints take none: nothing is kept
    assert table.get(42) is None


def test_a_training_pass_leaves_the_loaders_and_iterators_attributes_as_torch_made_them():
    data = TensorDataset(torch.randn(12, 3), torch.randn(12, 1))
    plain_loader = DataLoader(data, batch_size=4)
    plain_keys = (set(vars(plain_loader)), set(vars(iter(plain_loader))))
    agent = Agent()
    messages = []
    agent.sinks.append(lambda m: messages.append(json.dumps(m, default=str)))
    agent.arm()
    try:
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(data, batch_size=4)
        for _ in range(2):
            it = iter(loader)
            for x, y in it:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            assert set(vars(it)) == plain_keys[1]
        assert set(vars(loader)) == plain_keys[0]
        info = agent.loader_state.info_of.get(loader)
        assert info.epochs == 2 and info.record["first_batch_s"] > 0
    finally:
        agent.uninstall()
