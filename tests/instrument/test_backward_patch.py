"""The wrapper of torch.autograd.backward: there while a backward pass may end a step or CUDA
is in use, torch's own function once a CPU job's optimizer is known to end its steps."""

from __future__ import annotations

import json
import os

import pytest
import torch

from torchdoctor.instrument.agent import Agent
from torchdoctor.instrument.agent.contract import decode_message, encode_message
from torchdoctor.instrument.wire import decode

TORCH_BACKWARD = torch.autograd.backward


class ListSink(list):
    def __call__(self, message):
        self.append(decode_message(encode_message(message)))

    def steps(self):
        return [s for m in self for s in decode(m).steps]


@pytest.fixture
def agent():
    a = Agent()
    a.sink = ListSink()
    a.sinks.append(a.sink)
    a.arm()
    yield a
    a.uninstall()
    queued = getattr(torch.cuda, "_queued_calls", [])
    queued[:] = [
        c for c in queued if getattr(c[0], "__self__", None) is not a.counter.backward_patch
    ]


def _optimizer_steps(n: int, model=None) -> None:
    model = model or torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()


def _backward_steps(n: int) -> None:
    w = torch.nn.Parameter(torch.ones(1))
    for _ in range(n):
        (w * 2).sum().backward()
        with torch.no_grad():
            w -= 0.1 * w.grad


def test_optimizer_steps_take_the_wrapper_out_and_are_still_counted(agent):
    assert torch.autograd.backward is not TORCH_BACKWARD  # a backward pass may end a step
    _optimizer_steps(5)
    assert torch.autograd.backward is TORCH_BACKWARD
    agent.flush(final=True)
    assert [s.step for s in agent.sink.steps()] == list(range(5))
    agent.uninstall()
    assert torch.autograd.backward is TORCH_BACKWARD


def test_installed_again_it_stays_out(agent):
    _optimizer_steps(2)
    agent.uninstall()
    agent.arm()
    assert torch.autograd.backward is TORCH_BACKWARD
    _optimizer_steps(2)
    assert torch.autograd.backward is TORCH_BACKWARD


def test_loops_without_an_optimizer_keep_it(agent):
    _backward_steps(3)
    assert torch.autograd.backward is not TORCH_BACKWARD
    assert torch.autograd.backward.__wrapped__ is TORCH_BACKWARD


@pytest.mark.skipif(not hasattr(torch.cuda, "_lazy_call"), reason="torch.cuda has no _lazy_call")
def test_cuda_initialisation_puts_it_back(agent):
    _optimizer_steps(2)
    assert torch.autograd.backward is TORCH_BACKWARD
    # What torch.cuda's lazy init runs before its first allocation (no GPU here to start it).
    patch = agent.counter.backward_patch
    (queued,) = [c for c in torch.cuda._queued_calls if getattr(c[0], "__self__", None) is patch]
    queued[0]()
    assert torch.autograd.backward.__wrapped__ is TORCH_BACKWARD
    model = torch.nn.Linear(2, 1)
    depth = []
    model.weight.register_hook(lambda g: depth.append(agent.counter.backward_depth))
    model(torch.ones(1, 2)).sum().backward()
    assert depth == [1]  # an OOM on autograd's threads is told as inside backward


def test_a_wrapper_over_it_is_left_alone(agent):
    ours = torch.autograd.backward

    def theirs(*args, **kwargs):
        return ours(*args, **kwargs)

    torch.autograd.backward = theirs
    try:
        _optimizer_steps(3)
        assert torch.autograd.backward is theirs
    finally:
        torch.autograd.backward = ours


def test_a_forked_child_counts_backward_ended_steps_again(agent):
    _optimizer_steps(2)
    assert torch.autograd.backward is TORCH_BACKWARD
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its steps may end at backward passes
        try:
            wrapped = torch.autograd.backward is not TORCH_BACKWARD
            _backward_steps(2)
            os.write(write, json.dumps([wrapped, len(agent.counter.held_steps)]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        answer = fh.read()
    os.waitpid(pid, 0)
    assert json.loads(answer) == [True, 2]
    assert torch.autograd.backward is TORCH_BACKWARD  # the parent's is unchanged
