"""The view model: grouping, sorting, filtering and levels, from plain readings."""

from __future__ import annotations

import signal

from tests.top import builders as b
from torchdoctor.thresholds import Thresholds
from torchdoctor.top.keys import Quit, SendSignal, handle_key
from torchdoctor.top.model import FindingBrief, RecordingStatus, UiState, build_view

TH = Thresholds()


def two_rank_job():
    # torchrun (launcher) -> 2 ranks, each with 2 DataLoader workers.
    procs = [
        b.proc(100, 1, role="launcher", cpu=1.0),
        b.proc(101, 100, rank=0, cpu=95.0, vram=20 * b.GIB),
        b.proc(102, 100, rank=1, cpu=90.0, vram=21 * b.GIB),
        b.proc(111, 101, role="dataloader-worker", cpu=30.0),
        b.proc(112, 101, role="dataloader-worker", cpu=60.0),
        b.proc(121, 102, role="dataloader-worker", cpu=20.0),
        b.proc(122, 102, role="dataloader-worker", cpu=25.0),
    ]
    return b.job(100, procs, cmd=("torchrun", "--nproc-per-node=2", "train.py"))


def test_job_rows_follow_the_tree_ranks_before_their_workers():
    view = build_view(b.readings([two_rank_job()]), TH, UiState())
    (job,) = view.jobs
    order = [(r.pid, r.depth) for r in job.rows]
    # Each rank is followed by its own workers, busiest first (sort by CPU).
    assert order == [(100, 0), (101, 1), (112, 2), (111, 2), (102, 1), (122, 2), (121, 2)]
    assert job.ranks == [0, 1]
    assert job.workers == 4
    assert job.gpu_memory == 41 * b.GIB
    assert job.command == "torchrun --nproc-per-node=2 train.py"


def test_sort_key_cycles_and_orders_jobs():
    small = b.job(200, [b.proc(200, 1, cpu=5.0, rss=8 * b.GIB, pss=8 * b.GIB)])
    view = build_view(b.readings([small, two_rank_job()]), TH, UiState())
    assert [j.root_pid for j in view.jobs] == [100, 200]  # most CPU first
    state, _ = handle_key(UiState(), "s", view)
    assert state.sort == "mem"
    view = build_view(b.readings([small, two_rank_job()]), TH, state)
    assert [j.root_pid for j in view.jobs] == [200, 100]  # most PSS first
    assert state.message == "sorted by PSS"


def test_filter_keeps_matching_rows_and_the_path_to_them():
    state = UiState(filter="rank1")
    view = build_view(b.readings([two_rank_job()]), TH, state)
    (job,) = view.jobs
    assert [r.pid for r in job.rows] == [100, 102]
    assert [r.matched for r in job.rows] == [False, True]
    none = build_view(b.readings([two_rank_job()]), TH, UiState(filter="nothing-like-this"))
    assert none.jobs == []


def test_levels_come_from_the_threshold_table_and_its_overrides():
    hot = b.readings(
        host_sample=b.host(user=70.0, system=15.0, iowait=6.0, swap_in=2e6),
        status=b.gpu_status(),
        gpus=[b.gpu(used=int(0.95 * 80 * b.GIB))],
    )
    view = build_view(hot, TH, UiState())
    assert view.host.cpu_level == "alert"  # 85 % busy > 80 %
    assert view.host.iowait_level == "alert"  # 6 % > 5 %
    assert view.host.swap_level == "alert"  # 2 MB/s > 1 MB/s
    assert view.gpus[0].memory_level == "alert"  # 95 % > 90 %
    relaxed = Thresholds(gpu_memory_alert_pct=97.0, gpu_memory_best_high_pct=96.0)
    assert build_view(hot, relaxed, UiState()).gpus[0].memory_level == "ok"
    at_best = b.readings(status=b.gpu_status(), gpus=[b.gpu(used=int(0.88 * 80 * b.GIB))])
    assert build_view(at_best, TH, UiState()).gpus[0].memory_level == "warn"


def test_gpu_processes_are_joined_to_jobs_or_said_unresolved():
    j = b.job(300, [b.proc(300, 1, vram=4 * b.GIB)])
    r = b.readings(
        [j],
        status=b.gpu_status(),
        gpus=[b.gpu()],
        gpu_procs=[b.gpu_proc(300, 4 * b.GIB), b.gpu_proc(999_999, b.GIB, local=False)],
    )
    view = build_view(r, TH, UiState())
    ours, foreign = view.gpu_processes
    assert (ours.local_pid, ours.job_root) == (300, 300)
    assert foreign.local_pid is None and foreign.job_root is None
    assert view.gpu_unavailable is None


def test_without_nvml_one_line_says_why():
    view = build_view(b.readings(), TH, UiState())
    assert view.gpu_unavailable == "GPUs: none shown: no NVIDIA driver: libnvidia-ml.so.1 not found"
    assert view.gpus == []


def test_job_status_names_the_starved_job_and_prefers_findings():
    starved = RecordingStatus("/r.sqlite", 50, 3.0, 96.0, 0.41)
    fed = RecordingStatus("/s.sqlite", 50, 12.0, 384.0, 0.01)
    jobs = [
        b.job(400, [b.proc(400, 1)], recording=starved),
        b.job(500, [b.proc(500, 1)], recording=fed),
    ]
    view = build_view(b.readings(jobs), TH, UiState())
    status = {j.root_pid: (j.status, j.status_level) for j in view.jobs}
    assert status[400] == ("starved: waits for data 41 % of step time", "alert")
    assert status[500] == ("not waiting for data", "ok")
    stalled = RecordingStatus("/t.sqlite", 50, 0.0, 0.0, None, stalled_s=42.4)
    view = build_view(b.readings([b.job(700, [b.proc(700, 1)], recording=stalled)]), TH, UiState())
    assert (view.jobs[0].status, view.jobs[0].status_level) == ("stalled: no step for 42 s", "warn")
    starved.findings = [
        FindingBrief("threads", "warning", "CPU threads oversubscribed"),
        FindingBrief("dataloader-bound", "critical", "DataLoader-bound: raise num_workers to 6"),
    ]
    view = build_view(b.readings(jobs), TH, UiState())
    assert view.jobs[0].status == "DataLoader-bound: raise num_workers to 6"
    assert view.jobs[0].status_level == "alert"


def test_signal_needs_a_selection_a_choice_and_a_yes():
    view = build_view(b.readings([two_rank_job()]), TH, UiState())
    state, action = handle_key(UiState(), "k", view)
    assert action is None and state.mode == "normal"
    assert state.message == "select a process first (up/down)"
    state, _ = handle_key(state, "down", view)
    state, _ = handle_key(state, "down", view)
    assert state.selected_pid == 101
    state, _ = handle_key(state, "k", view)
    assert state.mode == "signal"
    state, _ = handle_key(state, "t", view)
    assert (state.mode, state.pending_signal) == ("confirm", "SIGTERM")
    refused, action = handle_key(state, "n", view)
    assert action is None and refused.message == "no signal sent"
    state, action = handle_key(state, "y", view)
    assert action == SendSignal(101, b.T - 100, signal.SIGTERM)
    assert state.mode == "normal"


def test_filter_typing_detail_and_quit():
    view = build_view(b.readings([two_rank_job()]), TH, UiState())
    state = UiState()
    for key in ["/", "r", "a", "n", "k", "x", "backspace", "1", "enter"]:
        state, _ = handle_key(state, key, view)
    assert (state.filter, state.mode) == ("rank1", "normal")
    state, _ = handle_key(state, "enter", view)  # no selection yet: opens the first row
    assert state.detail_pid == 100
    state, _ = handle_key(state, "esc", view)
    assert state.detail_pid is None
    state, _ = handle_key(state, "esc", view)
    assert state.filter == ""
    _, action = handle_key(state, "q", view)
    assert action == Quit()


def test_unrecorded_job_with_saturated_workers_and_an_idle_trainer_is_flagged():
    def job_with(trainer_cpu, worker_cpu):
        return b.job(
            600,
            [
                b.proc(600, 1, cpu=trainer_cpu),
                b.proc(601, 600, role="dataloader-worker", cpu=worker_cpu),
                b.proc(602, 600, role="dataloader-worker", cpu=worker_cpu),
            ],
        )

    starved = build_view(b.readings([job_with(12.0, 97.0)]), TH, UiState()).jobs[0]
    assert starved.status == "likely starved: 2 workers at 97 % CPU, trainer at 12 %"
    assert starved.status_level == "warn"
    busy = build_view(b.readings([job_with(99.0, 97.0)]), TH, UiState()).jobs[0]
    assert (busy.status, busy.status_level) == ("", "ok")
