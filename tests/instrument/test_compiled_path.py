"""The agent's compiled fast path (compiled.py, _fast.c): built where a C compiler is, taken by
the common batch and step, recording what the pure-Python path records, and as safe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.engines import require_engine
from torchdoctor.instrument.agent import Agent, compiled
from torchdoctor.instrument.agent.contract import ENV_PURE_PYTHON

JOB = Path(__file__).parent / "jobs" / "batch_kinds_job.py"
ROOT = Path(__file__).resolve().parents[2]
TORCH_NEXT = torch.utils.data.dataloader._BaseDataLoaderIter.__next__


@pytest.fixture
def fast():
    if os.environ.get(ENV_PURE_PYTHON):
        pytest.skip(f"{ENV_PURE_PYTHON} is set: this run tests the pure-Python path")
    # `make setup` builds it (pip install -e, a C compiler from `make system`).
    require_engine("the compiled agent path", None if compiled.fast else compiled.FAST_PATH)
    return compiled.fast


@pytest.fixture
def agent():
    a = Agent()
    a.sink = []
    a.sinks.append(a.sink.append)
    a.arm()
    yield a
    a.uninstall()
    queued = getattr(torch.cuda, "_queued_calls", [])
    parts = (a.counter, a.counter.backward_patch)
    queued[:] = [c for c in queued if getattr(c[0], "__self__", None) not in parts]


def _train(loader, model=None, opt=None, epochs: int = 1) -> int:
    model = model or torch.nn.Linear(3, 1)
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    seen = 0
    for _ in range(epochs):
        for batch in loader:
            x = batch["x"] if isinstance(batch, dict) else batch[0]
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            seen += len(x)
    return seen


def _pairs(n: int = 40, batch_size: int = 4):
    data = torch.utils.data.TensorDataset(torch.randn(n, 3), torch.randn(n, 1))
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


def test_the_counter_fields_are_the_ones_the_pure_path_has(fast):
    fields = {
        name
        for name, value in vars(fast.CounterFields).items()
        if type(value).__name__ in ("member_descriptor", "getset_descriptor")
    }
    assert fields - {"pending_rows"} == set(compiled.COUNTER_FIELDS)


def test_its_numbers_read_and_write_as_the_pure_paths_ints_and_nones(fast):
    fields = fast.CounterFields()
    assert (fields.step, fields.samples) == (0, 0)
    assert fields.boundary is None and fields.last_batch_size is None
    fields.boundary = 1 << 62  # perf_counter_ns values
    fields.samples += 5
    fields.last_batch_size = 5
    assert (fields.boundary, fields.samples, fields.last_batch_size) == (1 << 62, 5, 5)
    fields.last_batch_size = None
    assert fields.last_batch_size is None and fields.pending_rows == 0
    with pytest.raises(TypeError):
        fields.step = None  # never None on either path
    with pytest.raises(OverflowError):
        fields.boundary = 1 << 64


def test_it_reads_the_clock_the_python_parts_read(fast):
    before = time.perf_counter_ns()
    inside = fast.perf_counter_ns()
    after = time.perf_counter_ns()
    assert before <= inside <= after


def test_it_reads_each_threads_autograd_mode_in_torchs_own_library(fast):
    # The batch's training-or-evaluation test: c10::GradMode::is_enabled, read in C, is what
    # torch.is_grad_enabled says, per thread (a prefetch thread's mode is its own).
    fields = fast.CounterFields()
    assert compiled.read_grad_mode_natively(fields, torch)
    assert fields.use_native_grad_mode(True) is True
    with torch.no_grad():
        assert fields.use_native_grad_mode(True) is False
    with torch.inference_mode():
        assert fields.use_native_grad_mode(True) is False
    seen = []

    def evaluating_thread():
        torch.set_grad_enabled(False)
        seen.append(fields.use_native_grad_mode(True))

    thread = threading.Thread(target=evaluating_thread)
    thread.start()
    thread.join()
    assert seen == [False] and fields.use_native_grad_mode(True) is True


def test_the_python_call_stays_where_the_library_cannot_be_read(fast):
    class Unreadable:  # a libc10 without the symbol: use_native_grad_mode answers None
        def __init__(self) -> None:
            self.calls = []

        def use_native_grad_mode(self, on):
            self.calls.append(on)

    fields = Unreadable()
    assert not compiled.read_grad_mode_natively(fields, torch)
    assert fields.calls[-1] is False  # switched off: the batch calls grad_enabled
    assert not compiled.read_grad_mode_natively(object(), torch)  # the pure path's fields


def _record(pure: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(ENV_PURE_PYTHON, None)
    if pure:
        env[ENV_PURE_PYTHON] = "1"
    out = subprocess.run(
        [sys.executable, str(JOB)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_both_paths_record_the_same_steps_evaluations_and_epochs(fast):
    built, pure = _record(pure=False), _record(pure=True)
    assert built["fast_path"] == "compiled"
    assert pure["fast_path"] == f"python ({ENV_PURE_PYTHON} is set)"
    assert built["disabled"] is None and pure["disabled"] is None
    for key in ("steps", "evaluations", "epochs"):
        assert built[key] == pure[key], key
    # What the job did, per epoch: 22 pairs in 4s (a last 2), 12 tensors in 5s, 10 dicts in
    # 3s, 6 words in 4s; every step took data and time.
    sizes = [4, 4, 4, 4, 4, 2, 5, 5, 2, 3, 3, 3, 1, 4, 2]
    assert [s[1] for s in built["steps"]] == sizes * 2
    assert [s[2] for s in built["steps"]] == sizes * 2
    assert [s[0] for s in built["steps"]] == list(range(30))
    assert all(s[3] and s[4] for s in built["steps"])
    assert built["evaluations"] == [
        {"step": 15, "batches": 6, "samples": 22},
        {"step": 30, "batches": 6, "samples": 22},
    ]


def _python_calls(names: set[str], run) -> dict[str, int]:
    calls = dict.fromkeys(names, 0)

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name in calls:
            calls[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def test_the_common_batch_and_step_run_no_python_of_the_agent(fast, agent):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(_pairs(8), model, opt)  # the first steps take the full path (settings, checks)
    calls = _python_calls(
        {"on_batch", "on_step", "_on_step", "batch_len", "after_step", "flush"},
        lambda: _train(_pairs(40), model, opt),
    )
    # one flush-free pass of 10 steps: only the pass's end (on_exhausted) is Python
    assert calls == dict.fromkeys(calls, 0)
    assert agent.counter.step == 12


def test_a_step_flushes_once_the_interval_has_passed_since_the_last_flush(fast, agent):
    # What a live view (show, top, the exporters) relies on: steps leave the job within
    # FLUSH_INTERVAL_S however few there are, and not at every step before then.
    from torchdoctor.instrument.agent.contract import FLUSH_INTERVAL_NS, perf_ns

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(_pairs(8), model, opt)  # the first steps take the full path (settings, checks)
    agent.flush()
    sent = len(agent.sink)
    agent.last_flush = perf_ns()
    _train(_pairs(8), model, opt)  # two steps, well inside the interval: kept
    assert (len(agent.sink), agent.counter.pending_rows) == (sent, 2)
    agent.last_flush = perf_ns() - FLUSH_INTERVAL_NS  # the interval has passed
    _train(_pairs(4), model, opt)  # the next step sends all three
    assert (len(agent.sink), agent.counter.pending_rows) == (sent + 1, 0)
    assert agent.sink[-1]["step_count"] == 3


def test_its_steps_reach_the_sink_in_order_packed_as_the_pure_path_packs_them(fast, agent):
    from torchdoctor.instrument.agent.contract import pack_steps, unpack_steps

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(_pairs(8), model, opt)  # the first steps take the full path
    agent.flush()
    sent = len(agent.sink)
    agent.flush_max_steps = 100

    def train():
        _train(_pairs(150, batch_size=1), model, opt)
        assert agent.counter.pending_rows > 0  # kept as numbers until the next flush
        agent.counter.autocast_dtype = "bfloat16"  # the next step ran under autocast
        _train(_pairs(150, batch_size=1), model, opt)

    # Every flush of these steps packs them in C: no row is built, no Python packing runs.
    calls = _python_calls({"pack_steps", "_step_row", "_on_step"}, train)
    assert calls == dict.fromkeys(calls, 0)
    agent.flush()
    assert agent.counter.pending_rows == 0
    fresh = [m for m in agent.sink[sent:] if m["step_count"]]
    assert sum(m["step_count"] for m in fresh) == 300
    assert max(m["step_count"] for m in fresh) <= 100
    rows = [row for m in agent.sink for row in unpack_steps(m)]
    assert [row[0] for row in rows] == list(range(302))  # every step, once, in order
    assert [row[6] for row in rows].count("bfloat16") == 1
    for message in fresh:  # packed in C as contract.pack_steps packs the same rows
        kinds = [kind for kind, _ in message["step_columns"]]
        assert kinds == [kind for kind, _ in pack_steps(unpack_steps(message))]
    kinds = {kind for m in fresh for kind, _ in m["step_columns"]}
    assert kinds == {"=", "Q", "j"}


@pytest.mark.skipif(not hasattr(torch.cuda, "_lazy_call"), reason="torch.cuda has no _lazy_call")
def test_cudas_start_sends_the_steps_down_the_full_path(fast, agent):
    # The short path never reads torch.cuda's flag: torch's lazy init tells the counter.
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(_pairs(8), model, opt)
    full = _python_calls({"_on_step"}, lambda: _train(_pairs(16), model, opt))
    assert full == {"_on_step": 0}
    counter = agent.counter
    (queued,) = [c for c in torch.cuda._queued_calls if getattr(c[0], "__self__", None) is counter]
    queued[0]()  # what torch.cuda's lazy init runs before its first allocation
    full = _python_calls({"_on_step"}, lambda: _train(_pairs(16), model, opt))
    assert full == {"_on_step": 4}  # every step reads the CUDA figures again
    assert agent.counter.step == 10


def test_an_error_in_its_part_switches_the_agent_off_and_the_loop_goes_on(fast, agent):
    class Dicts(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return {"x": torch.full((3,), float(i))}

    def broken(batch, tensor_type):
        raise ValueError("cannot count this batch")

    agent.counter.batch_len = broken  # dict batches are counted by steps.batch_len
    seen = _train(torch.utils.data.DataLoader(Dicts(), batch_size=4))
    assert seen == 12  # every batch reached the loop
    assert agent.disabled_reason == "ValueError: cannot count this batch"
    assert torch.utils.data.dataloader._BaseDataLoaderIter.__next__ is TORCH_NEXT
    disabled = [
        json.loads(detail)
        for m in agent.sink
        for _, kind, detail in m["events"]
        if kind == "instrumentation-disabled"
    ]
    assert disabled == [{"where": "dataloader-next", "error": agent.disabled_reason}]


def test_a_keyboard_interrupt_reaches_the_users_code(fast, agent):
    def interrupted(batch, tensor_type):
        raise KeyboardInterrupt

    agent.counter.batch_len = interrupted
    loader = torch.utils.data.DataLoader([{"x": torch.ones(3)}] * 4, batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        next(iter(loader))
    assert agent.active  # not the agent's failure: the user's Ctrl-C


def test_the_wrapper_is_a_method_of_torchs_iterators(fast, agent):
    cls = torch.utils.data.dataloader._BaseDataLoaderIter
    wrapper = cls.__dict__["__next__"]
    assert type(wrapper) is fast.NextWrapper and wrapper.__wrapped__ is TORCH_NEXT
    it = iter(_pairs(8))
    first = it.__next__()  # bound, as a function in the class would be
    second = cls.__next__(it)  # unbound
    assert [len(b[0]) for b in (first, second)] == [4, 4]
    assert agent.counter.batches == 2 and agent.counter.samples == 8
    with pytest.raises(StopIteration):
        next(it)


def test_it_reads_the_agents_current_values_also_after_its_class_changed(fast, agent):
    # The compiled path reads the agent's slots at their offsets, found once per class version.
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(_pairs(8), model, opt)  # past the full first steps
    agent.flush()
    Agent.changed_by_the_test = True  # a new class version: the offsets are found again
    try:
        agent.flush_max_steps = 3
        _train(_pairs(24), model, opt)  # 6 steps: two flushes of 3
        counts = [m["step_count"] for m in agent.sink if m["step_count"]]
        assert counts[-2:] == [3, 3]
        agent.active = False  # read at once: nothing more is counted
        steps = agent.counter.step
        _train(_pairs(8), model, opt)
        assert agent.counter.step == steps
    finally:
        del Agent.changed_by_the_test
        agent.active = True
