"""The screen a person sees, from real processes (and the fake NVML for GPU rows)."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests import fake_nvml
from tests.top import builders as b
from tests.top.screen import show
from torchdoctor.sampling.gpus import GpuReader
from torchdoctor.sampling.pidns import PidNamespace
from torchdoctor.thresholds import Thresholds
from torchdoctor.top.collect import TopCollector
from torchdoctor.top.model import RecordingStatus, UiState, build_view

TH = Thresholds()
# The fake NVML reports the PIDs the tests see as host PIDs (CI may run in a PID namespace).
HOST_PIDS = PidNamespace(procfs_is_host=True)


@pytest.fixture(scope="module")
def collector(torch_job):
    """One collector for the module, warm: its rates (CPU %) have a previous reading."""
    c = TopCollector(TH, gpu_reader=GpuReader(fake_nvml.scenario("no_driver")))
    c.read()
    yield c
    c.close()


def collect(collector, nvml=None, pidns=HOST_PIDS):
    """One reading of the real machine, with the GPUs of ``nvml`` (default: no driver)."""
    warm_gpu = collector.gpu
    nvml = nvml if nvml is not None else fake_nvml.scenario("no_driver")
    collector.gpu = GpuReader(nvml, pid_namespace=pidns)
    try:
        return collector.read()
    finally:
        collector.gpu.close()
        collector.gpu = warm_gpu


@pytest.fixture(scope="module")
def busy_gpu_readings(torch_job, collector):
    """The real job holding memory on GPU 0, which is 95 % full; GPU 1 is 70 % full."""
    gpus = [fake_nvml.FakeGpu(), fake_nvml.FakeGpu(uuid="GPU-3b1f6c52-0d7e-4b8e-9a51-8f6a3a1c0001")]
    gpus[0].memory_used = int(0.95 * gpus[0].memory_total)
    gpus[0].utilization_gpu = 97
    gpus[0].compute_processes = [(torch_job.pid, 6 * b.GIB)]
    gpus[1].memory_used = int(0.70 * gpus[1].memory_total)
    return collect(collector, fake_nvml.FakeNvml(gpus))


def test_job_is_shown_grouped_with_its_dataloader_workers(torch_job, collector):
    screen = show(build_view(collect(collector), TH, UiState()), interactive=False, height=200)
    header = screen.line_with(f"job {torch_job.pid}")
    assert "2 workers" in header
    lines = screen.lines
    at = lines.index(header)
    trainer = lines[at + 1]
    workers = lines[at + 2 : at + 4]
    assert re.match(rf"\s*{torch_job.pid} trainer ", trainer), trainer
    for line in workers:
        # Indented under the trainer, labelled as workers, one of the real worker PIDs.
        pid = int(line.split()[0])
        assert pid in torch_job.workers
        assert "└worker" in line
    assert {int(line.split()[0]) for line in workers} == set(torch_job.workers)
    assert "--td-live" in trainer


def test_gpu_row_at_the_alert_threshold_is_red_and_the_job_shows_its_vram(
    torch_job, busy_gpu_readings
):
    screen = show(build_view(busy_gpu_readings, TH, UiState()), height=200)
    gpu0 = screen.line_with("GPU0")
    assert "A100-SXM4-80GB" in gpu0 and " 97% util" in gpu0 and "95%" in gpu0
    assert screen.colour_of("95%", after="GPU0") == "red"
    gpu1 = screen.line_with("GPU1")
    assert "70%" in gpu1
    assert screen.colour_of("70%", after="GPU1") is None  # within the best range: no colour
    assert re.search(rf"\[0\] {torch_job.pid} python3? 6.0G", screen.line_with("on GPU:"))
    trainer = screen.line_with(f"{torch_job.pid} trainer")
    assert "6.0G" in trainer
    for worker in torch_job.workers:
        assert re.search(r"\s0B\s", screen.line_with(f"{worker} └worker"))


def test_thresholds_file_changes_the_colour(busy_gpu_readings):
    relaxed = Thresholds(gpu_memory_alert_pct=98.0, gpu_memory_best_high_pct=96.0)
    screen = show(build_view(busy_gpu_readings, relaxed, UiState()))
    assert screen.colour_of("95%", after="GPU0") is None


def test_no_gpu_is_one_line_saying_why(collector):
    readings = collect(collector, fake_nvml.scenario("no_driver"))
    screen = show(build_view(readings, TH, UiState()))
    lines = [line for line in screen.lines if "GPU" in line]
    assert lines == [f"GPUs: none shown: {readings.gpu_status.reason}"]
    assert "driver" in readings.gpu_status.reason.lower()


def test_a_long_reason_wraps_rather_than_being_cut(collector):
    readings = collect(collector, fake_nvml.scenario("stub_library"))
    screen = show(build_view(readings, TH, UiState()))
    at = screen.lines.index(screen.line_with("GPUs: none shown: "))
    shown = " ".join(line.strip() for line in screen.lines[at : at + 4] if "PID" not in line)
    assert shown == f"GPUs: none shown: {readings.gpu_status.reason}"


def test_throttle_reasons_are_named_in_yellow(collector):
    gpu = fake_nvml.FakeGpu(
        clock_event_reasons=fake_nvml.nvmlClocksEventReasonSwPowerCap
        | fake_nvml.nvmlClocksEventReasonHwThermalSlowdown
    )
    readings = collect(collector, fake_nvml.FakeNvml([gpu]))
    screen = show(build_view(readings, TH, UiState()))
    # 80 columns: the reasons go under the device's line.
    at = screen.lines.index(screen.line_with("GPU0"))
    assert screen.lines[at + 1] == "       slow: pwr-cap,hw-thermal"
    assert screen.colour_of("slow: pwr-cap", after="GPU0") == "yellow"
    wide = show(build_view(readings, TH, UiState()), width=120)
    assert wide.line_with("GPU0").endswith("34°C  slow: pwr-cap,hw-thermal")


def test_gpu_pids_from_another_namespace_are_said_unresolved(torch_job, collector):
    gpu = fake_nvml.FakeGpu(compute_processes=[(torch_job.pid, 2 * b.GIB)])
    readings = collect(
        collector, fake_nvml.FakeNvml([gpu]), pidns=PidNamespace(procfs_is_host=False)
    )
    screen = show(build_view(readings, TH, UiState()), height=200)
    assert f"host pid {torch_job.pid} unresolved 2.0G" in screen.line_with("on GPU:")
    # Not joined by guess: the job's VRAM is unknown ("-"), neither claimed nor zero.
    trainer = screen.line_with(f"{torch_job.pid} trainer")
    assert "2.0G" not in trainer and " 0B " not in trainer
    assert re.search(r"\s-\s+python", trainer), trainer


def test_fits_80x24_with_many_cores_jobs_and_gpus():
    jobs = [
        b.job(
            1000 * j,
            [b.proc(1000 * j, 1, cpu=50.0)]
            + [b.proc(1000 * j + w, 1000 * j, role="dataloader-worker") for w in range(1, 9)],
            recording=RecordingStatus("/r.sqlite", 10, 2.5, 80.0, 0.3),
        )
        for j in range(1, 5)
    ]
    r = b.readings(
        jobs, cores=64, status=b.gpu_status(2), gpus=[b.gpu(0), b.gpu(1)], host_sample=b.host(64)
    )
    state = UiState(selected_pid=4008)  # the last row: must be scrolled into view
    screen = show(build_view(r, TH, state))
    assert len(screen.lines) <= 24
    assert all(len(line) <= 80 for line in screen.lines)
    assert screen.lines[0].lstrip().startswith("torchdoctor top")
    assert "4008" in screen.text
    assert re.search(r"… \d+ more lines", screen.text)
    assert screen.lines[-1].startswith("↑↓ select")
    assert "starved: waits for data 30 % of step time" in screen.text


def test_a_rate_from_merged_sampled_steps_reads_as_a_lower_bound():
    def rate_line(lower_bound: bool) -> str:
        rec = RecordingStatus("/r.sqlite", 10, 2.5, None, 0.9, rate_lower_bound=lower_bound)
        job = b.job(1000, [b.proc(1000, 1, cpu=5.0)], recording=rec)
        screen = show(build_view(b.readings([job], cores=2), TH, UiState()))
        return screen.line_with("step/s")

    assert "≥ 2.5 step/s" in rate_line(True)
    assert "2.5 step/s" in rate_line(False) and "≥" not in rate_line(False)


def test_process_detail_shows_command_environment_and_history(torch_job, collector):
    for _ in range(2):
        readings = collector.read(detail_pid=torch_job.pid)
    state = UiState(selected_pid=torch_job.pid, detail_pid=torch_job.pid)
    screen = show(build_view(readings, TH, state))
    assert f"process {torch_job.pid}  trainer  of job {torch_job.pid}" in screen.text
    cmd_at = screen.lines.index(screen.line_with("cmd "))
    # the command wraps at the screen's width between arguments, wherever the path of the
    # checkout puts the break: each argument stays whole on one line (a CI checkout under a longer
    # path once cut "train.py" into "train" / ".py")
    command_lines = [line.strip() for line in screen.lines[cmd_at : cmd_at + 4]]
    assert any("train.py" in line for line in command_lines)
    assert any("--td-live" in line for line in command_lines)
    assert "OMP_NUM_THREADS=1" in screen.line_with("env ")
    # The module's collector has read the job at least 3 times by now.
    refreshes = int(re.search(r"history: last (\d+) refreshes", screen.text).group(1))
    assert refreshes == len(readings.history[torch_job.pid].cpu_percent) >= 3
    assert screen.line_with("CPU% ") and screen.line_with("RSS  ")


def test_gpu_process_outside_any_job_is_named(collector):
    other = subprocess.Popen(["sleep", "60"])
    try:
        gpu = fake_nvml.FakeGpu(compute_processes=[(other.pid, b.GIB)])
        screen = show(
            build_view(collect(collector, fake_nvml.FakeNvml([gpu])), TH, UiState()), height=200
        )
    finally:
        other.kill()
        other.wait()
    assert f"[0] {other.pid} sleep 1.0G" in screen.line_with("on GPU:")


def test_a_wrapped_command_breaks_between_arguments_and_cuts_only_what_is_too_long():
    from torchdoctor.top.render import _wrapped

    script = "/tmp/pytest-of-root/pytest-169/job0/train.py"
    cmd = f"/check/work/main/.venv/bin/python3 {script} --td-live " + "x" * 150
    lines = [line.plain for line in _wrapped("cmd ", cmd, 80, max_lines=4)]
    # the script would straddle column 80 on the first line: it starts the second, whole
    assert lines[0] == "cmd /check/work/main/.venv/bin/python3"
    assert lines[1].startswith(f"    {script} --td-live x")
    assert all(len(line) <= 80 for line in lines)
    # only the argument longer than a line is cut, and it reads back whole
    assert lines[1].split(" --td-live ")[1] + "".join(line[4:] for line in lines[2:]) == "x" * 150
