"""`show` (text and --json) and the HTML report of a recording whose cuda-oom event names a
memory snapshot: the peak, its phases, the top line; a damaged one is one line."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.conftest import run_td
from tests.helpers.schemas import assert_valid
from tests.memory import snapshots as snap
from tests.memory.test_cuda_memory import FIRST_STEP, WIDE, oom_recording, oom_snapshot_of


def test_show_and_the_report_give_the_peak(tmp_path):
    recording = oom_recording(tmp_path, oom_snapshot_of(FIRST_STEP))
    done = run_td("show", str(recording))
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("CUDA memory"))
    assert "8.25 GiB allocated, 9.25 GiB reserved at the peak" in line
    assert f"top: {snap.TOP_LINE} 3.00 GiB (activations)" in line
    assert "failed request 4.00 GiB" in line
    document = assert_valid("show", run_td("show", "--json", str(recording)).stdout)
    (memory,) = document["cuda_memory"]
    assert memory["kind"] == "oom" and memory["peak"]["peak_allocated"] == snap.PEAK
    assert memory["peak"]["sites"][0]["where"] == snap.TOP_LINE
    html = tmp_path / "job.html"
    assert run_td("report", str(recording), "-o", str(html)).returncode == 0
    page = html.read_text()
    assert '<section id="memory">' in page and snap.TOP_LINE in page


def test_a_damaged_snapshot_is_one_line_and_the_finding_stays(tmp_path):
    recording = oom_recording(tmp_path, b"\x80\x04garbage")
    done = run_td("show", str(recording))
    assert done.returncode == 0 and "Traceback" not in done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("CUDA memory")]
    assert "damaged or edited" in line
    out = " ".join(run_td("diagnose", str(recording), env=WIDE).stdout.split())
    assert "CUDA out of memory" in out and "not read:" in out


def test_a_run_with_memory_history_writes_the_end_snapshot_and_show_reads_it(tmp_path):
    recording = tmp_path / "train.sqlite"
    job = Path(__file__).parent / "jobs" / "fake_cuda_train.py"
    done = run_td("run", "--memory-history", "--quiet", "-o", str(recording), "--",
                  sys.executable, str(job))  # fmt: skip
    assert done.returncode == 0, done.stderr
    (written,) = tmp_path.glob("train.cuda-memory-*.pickle")
    document = assert_valid("show", run_td("show", "--json", str(recording)).stdout)
    (memory,) = document["cuda_memory"]
    assert memory["kind"] == "exit" and memory["path"] == str(written)
    assert memory["peak"]["peak_allocated"] == snap.PEAK
    assert memory["peak"]["by_phase"] == snap.PHASES  # the buffer came before the first step
    line = next(x for x in run_td("show", str(recording)).stdout.splitlines() if "CUDA" in x)
    assert line.startswith(
        f"CUDA memory (pid {written.stem.rsplit('-', 1)[1]}, snapshot at its end)"
    )
    assert f"top: {snap.TOP_LINE} 3.00 GiB (activations)" in line
