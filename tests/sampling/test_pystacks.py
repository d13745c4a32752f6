"""Steps from the phases of sampled main-thread stacks (py-spy's speedscope output)."""

from __future__ import annotations

from torchdoctor.sampling.pystacks import EstimatedStep, analyse, merging_note, phase_of

TORCH = "/venv/lib/python3.11/site-packages/torch"
FRAMES = [
    {"name": "<module>", "file": "/home/u/train.py"},
    {"name": "_BaseDataLoaderIter.__next__", "file": f"{TORCH}/utils/data/dataloader.py"},
    {
        "name": "_SingleProcessDataLoaderIter._next_data",
        "file": f"{TORCH}/utils/data/dataloader.py",
    },
    {"name": "Slow.__getitem__", "file": "/home/u/train.py"},
    {"name": "Module._wrapped_call_impl", "file": f"{TORCH}/nn/modules/module.py"},
    {"name": "Tensor.backward", "file": f"{TORCH}/_tensor.py"},
    {"name": "SGD.step", "file": f"{TORCH}/optim/sgd.py"},
    {"name": "Optimizer.zero_grad", "file": f"{TORCH}/optim/optimizer.py"},
    {"name": "_pin_memory_loop", "file": f"{TORCH}/utils/data/_utils/pin_memory.py"},
]
DATA, FORWARD, BACKWARD, STEP, ZERO = [0, 1, 2, 3], [0, 4], [0, 5], [0, 6], [0, 7]


def _doc(stacks, period=0.01, others=()):
    main = {
        "name": 'Thread 42 "MainThread"',
        "type": "sampled",
        "samples": stacks,
        "weights": [period] * len(stacks),
        "endValue": period * len(stacks),
    }
    threads = [
        {"name": f'Thread {43 + i} "x"', "samples": s, "weights": []} for i, s in enumerate(others)
    ]
    return {"shared": {"frames": FRAMES}, "profiles": [main, *threads]}


def test_phase_is_the_outermost_torch_frame() -> None:
    assert phase_of([FRAMES[i] for i in DATA]) == "data"
    assert phase_of([FRAMES[i] for i in ZERO]) == "other"  # zero_grad is no boundary
    assert phase_of([FRAMES[0]]) == "other"


def test_a_step_starts_when_the_phases_go_back_to_an_earlier_one() -> None:
    # [partial] | data data data fwd bwd zero step | data data fwd bwd | data (partial)
    stacks = [BACKWARD, DATA, DATA, DATA, FORWARD, BACKWARD, ZERO, STEP, DATA, DATA, FORWARD,
              BACKWARD, DATA]  # fmt: skip
    result = analyse(_doc(stacks, others=[[[8]]]), 42, t_end=100.0)
    assert result.samples == 13 and abs(result.t_start - 99.87) < 1e-9
    assert [round(s.t_end - s.t_start, 3) for s in result.steps] == [0.07, 0.04]
    assert [round(s.data_wait_s, 3) for s in result.steps] == [0.03, 0.02]
    assert [round(s.backward_s, 3) for s in result.steps] == [0.01, 0.01]
    assert result.optimizer_seen and result.loader_kind == "single-process"
    assert result.dataset_type == "Slow" and result.pin_memory_thread


def test_a_loop_without_optimizer_steps_by_backward() -> None:
    # The samples before the first return to an earlier phase may be the end of a step: left out.
    stacks = [DATA, FORWARD, BACKWARD, DATA, FORWARD, BACKWARD, DATA, FORWARD, BACKWARD, DATA]
    result = analyse(_doc(stacks), 42, t_end=10.0)
    assert len(result.steps) == 2 and not result.optimizer_seen


def test_each_step_keeps_how_many_samples_saw_it_and_its_work() -> None:
    # | data data data fwd bwd zero step | data data fwd | data (partial)
    stacks = [BACKWARD, DATA, DATA, DATA, FORWARD, BACKWARD, ZERO, STEP, DATA, DATA, FORWARD,
              DATA]  # fmt: skip
    result = analyse(_doc(stacks), 42, t_end=100.0)
    assert [(s.samples, s.work_samples) for s in result.steps] == [(7, 4), (3, 1)]


def _steps(*shapes: tuple[int, int]) -> list[EstimatedStep]:
    return [EstimatedStep(0.0, 1.0, 0.5, 0.2, 0.2, 0.1, n, work) for n, work in shapes]


def test_steps_whose_work_fits_in_a_sampling_period_are_said_to_merge() -> None:
    # A data-bound loop whose work is one sample or less: seen once when seen at all.
    note = merging_note(_steps(*[(8, 1)] * 9, (8, 2), (8, 1)), rate_hz=200)
    assert note is not None and "1.09 samples a step, 5 ms apart" in note and "5 ms" in note
    assert "lower bounds" in note
    # Work of two periods and more: every step seen, nothing said.
    assert merging_note(_steps(*[(8, 2)] * 6, *[(8, 3)] * 6), rate_hz=200) is None
    # Too few steps to tell.
    assert merging_note(_steps(*[(8, 1)] * 2), rate_hz=200) is None


def test_whole_steps_under_four_samples_are_said_to_merge() -> None:
    note = merging_note(_steps(*[(2, 2)] * 6, *[(3, 3)] * 4, *[(6, 5)] * 2), rate_hz=100)
    assert note is not None and "10 of 12 steps spanned under four samples, 10 ms apart" in note
    assert merging_note(_steps(*[(2, 2)] * 5, *[(6, 5)] * 7), rate_hz=100) is None
