"""The agent in this process with a list as its sink: hooks, records, failure and restore."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

from torchdoctor.instrument import agent as agent_mod
from torchdoctor.instrument.agent import Agent, parse_overrides
from torchdoctor.instrument.agent.contract import decode_message, encode_message
from torchdoctor.instrument.agent.steps import batch_len
from torchdoctor.instrument.wire import decode


class ListSink(list):
    def __call__(self, message):
        self.append(decode_message(encode_message(message)))  # what the wire would carry

    def records(self):
        steps, loaders, settings, events = [], [], [], []
        for m in self:
            b = decode(m)
            steps += b.steps
            loaders += b.dataloaders
            settings += b.settings
            events += b.events
        return steps, loaders, settings, events


@pytest.fixture
def agent():
    a = Agent()
    sink = ListSink()
    a.sinks.append(sink)
    a.sink = sink
    a.arm()
    assert a.active
    yield a
    a.uninstall()


def _train(steps=6, batch_size=4, amp=False, loader=None):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    data = TensorDataset(torch.randn(steps * batch_size, 3), torch.randn(steps * batch_size, 1))
    loader = loader or DataLoader(data, batch_size=batch_size)
    for x, y in loader:
        if amp:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
        else:
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def test_steps_settings_and_loader_of_an_in_process_loop(agent):
    _train(steps=6, amp=True)
    agent.flush(final=True)
    steps, loaders, settings, events = agent.sink.records()
    assert [s.step for s in steps] == list(range(6))
    assert all(s.batch_size == 4 and s.samples == 4 for s in steps)
    assert all(s.autocast_dtype == "bfloat16" and s.grad_scaler is False for s in steps)
    assert all(0 <= s.data_wait_s <= s.wall_s for s in steps)
    assert steps[1].t_start == pytest.approx(steps[0].t_end, abs=1e-3)
    (loader,) = loaders
    assert loader.dataset_len == 24 and loader.num_workers == 0 and loader.first_batch_s > 0
    values = {s.key: json.loads(s.value) for s in settings}
    assert values["optimizer.class"] == "torch.optim.adamw.AdamW"
    assert values["optimizer.foreach"] is False
    assert values["params.count"] == 4 and values["params.bytes"] == 16
    assert values["amp.autocast"] == "bfloat16"
    assert values["torch.num_threads"] == torch.get_num_threads()
    assert values["matmul.float32_precision"] == torch.get_float32_matmul_precision()
    assert [e.kind for e in events].count("epoch-start") == 1


def test_each_pass_of_a_loader_is_an_epoch_start_with_its_loader_epoch_and_step(agent):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(6, 2)), batch_size=3)
    for _ in range(2):
        for (x,) in loader:
            model(x).sum().backward()
            opt.step()
    with torch.no_grad():
        for (x,) in loader:
            model(x)
    agent.flush(final=True)
    events = agent.sink.records()[3]
    details = [json.loads(e.detail) for e in events if e.kind == "epoch-start"]
    assert details == [
        {"loader_id": 0, "epoch": 0, "step": 0},
        {"loader_id": 0, "epoch": 1, "step": 2},
        {"loader_id": 0, "epoch": 2, "step": 4, "evaluation": True},
    ]


def test_gradient_accumulation_and_a_second_optimizer(agent):
    gen, disc = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(24, 2)), batch_size=3)
    for i, (x,) in enumerate(loader):
        disc(gen(x)).sum().backward()
        if i % 2 == 1:  # two micro-batches per step, and two optimizers step in it
            opt_d.step()
            opt_g.step()
    agent.flush(final=True)
    steps = agent.sink.records()[0]
    assert len(steps) == 4
    assert all(s.samples == 6 and s.batch_size == 3 for s in steps)


def test_uninstall_restores_torch():
    originals = (
        DataLoader.__init__,
        DataLoader.__iter__,
        _BaseDataLoaderIter.__next__,
        torch.set_num_threads,
    )
    a = Agent()
    a.sinks.append(ListSink())
    a.arm()
    assert DataLoader.__init__ is not originals[0]
    a.uninstall()
    assert (
        DataLoader.__init__,
        DataLoader.__iter__,
        _BaseDataLoaderIter.__next__,
        torch.set_num_threads,
    ) == originals


def test_a_failing_sink_switches_the_agent_off_once_and_training_goes_on():
    class FlakySink(ListSink):
        def __call__(self, message):
            if not self.failed:
                self.failed = True
                raise RuntimeError("recording closed under us")
            super().__call__(message)

    sink = FlakySink()
    sink.failed = False
    a = Agent()
    a.sinks.append(sink)
    a.arm()
    original_init = a._patches[0][2]
    a.stop_after = None
    a.flush_max_steps = 2
    model = _train(steps=8)  # the first flush raises inside the step hook
    assert isinstance(model, torch.nn.Linear)
    assert not a.active and "recording closed under us" in a.disabled_reason
    assert DataLoader.__init__ is original_init
    events = sink.records()[3]
    assert [e.kind for e in events] == ["instrumentation-disabled"]
    assert json.loads(events[0].detail)["where"] == "optimizer-step"
    _train(steps=2)  # nothing more is recorded
    assert len(sink) == 1


def test_cuda_oom_is_recorded_with_its_step_and_batch_size(agent):
    _train(steps=3, batch_size=5)
    # What the CUDA caching allocator calls when an allocation fails, before it raises.
    agent.cuda.on_oom(0, 2 << 30, 38 << 30, 1 << 20)
    _, _, _, events = agent.sink.records()
    (oom,) = [e for e in events if e.kind == "cuda-oom"]
    detail = json.loads(oom.detail)
    assert detail["step"] == 3 and detail["batch_size"] == 5
    assert detail["requested_bytes"] == 2 << 30 and detail["free_bytes"] == 1 << 20
    assert detail["device_limit_bytes"] == 38 << 30 and detail["phase"] == "forward"


def test_loader_built_before_the_agent_is_still_described():
    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    loader = DataLoader(data, batch_size=2)
    a = Agent()
    a.sinks.append(sink := ListSink())
    a.arm()
    try:
        _train(steps=4, batch_size=2, loader=loader)
    finally:
        a.uninstall()
    _, loaders, _, _ = sink.records()
    assert [ld.batch_size for ld in loaders] == [2]


def test_parse_overrides_says_what_is_wrong():
    assert parse_overrides('{"num_workers": 4, "pin_memory": true}') == {
        "num_workers": 4,
        "pin_memory": True,
    }
    assert parse_overrides("") == {}
    for text, message in [
        ("{", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"workers": 2}', "unknown key 'workers'"),
        ('{"num_workers": true}', "num_workers must be an integer"),
        ('{"pin_memory": 1}', "pin_memory must be true or false"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_overrides(text)


def test_invalid_overrides_are_reported_not_applied():
    a = Agent()
    assert a.configure_from_env({"TORCHDOCTOR_OVERRIDES": '{"num_threads": "two"}'})
    assert a.overrides == {}
    assert a.events[0][1] == "overrides-invalid"
    assert not Agent().configure_from_env({"TORCHDOCTOR_NO_INSTRUMENT": "1"})
    assert Agent().configure_from_env({"TORCHDOCTOR_NO_INSTRUMENT": "0"})


def test_batch_len_reads_common_batch_shapes():
    t = torch.Tensor
    assert batch_len(torch.zeros(7, 3), t) == 7
    assert batch_len((torch.zeros(5, 2), torch.zeros(5)), t) == 5
    assert batch_len({"input_ids": torch.zeros(3, 9)}, t) == 3
    assert batch_len(["a", "b"], t) == 2
    assert batch_len(torch.tensor(1.0), t) is None
    assert batch_len(object(), t) is None


def test_socket_sink_without_collector_drops_quietly(tmp_path):
    sink = agent_mod.SocketSink(str(tmp_path / "nobody.sock"))
    sink({"v": 1, "pid": 1})
    sink.close()
    assert sink.dropped == 1


def test_waits_of_a_background_prefetch_thread_are_not_the_steps_data_wait(agent):
    import queue
    import threading
    import time

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            time.sleep(0.01)
            return torch.ones(2)

    q: queue.Queue = queue.Queue(maxsize=12)
    loader = DataLoader(Slow(), batch_size=2)
    thread = threading.Thread(target=lambda: [q.put(b) for b in loader] + [q.put(None)])
    thread.start()
    thread.join()  # everything prefetched: the trainer never waits
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    while (batch := q.get()) is not None:
        (p * batch).sum().backward()
        opt.step()
    agent.flush(final=True)
    steps = agent.sink.records()[0]
    assert len(steps) == 6
    # the first step precedes knowing which thread steps; after it, no foreign wait counts
    assert all(s.data_wait_s == 0 for s in steps[1:])


def test_an_uncaught_out_of_memory_error_is_recorded_then_reported_as_usual(agent, capsys):
    import sys

    _train(steps=2, batch_size=3)
    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except torch.OutOfMemoryError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)  # what Python does at top level
    assert "CUDA out of memory" in capsys.readouterr().err  # the usual traceback, unchanged
    _, _, _, events = agent.sink.records()
    (oom,) = [e for e in events if e.kind == "cuda-oom"]
    detail = json.loads(oom.detail)
    # The sizes come from the message; the phase from the traceback (no torch frame: forward).
    assert detail == {
        "step": 2,
        "batch_size": 3,
        "source": "uncaught",
        "phase": "forward",
        "requested_bytes": 2 << 30,
    }
