"""`torchdoctor launch`: real torchrun ranks (gloo, CPU) recorded, and the distributed findings
made from what the ranks recorded. Each scenario is one real 2-rank job, run once."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from tests.conftest import run_td
from torchdoctor import open_recording

JOB = str(Path(__file__).resolve().parent / "jobs" / "ddp_job.py")
DISTRIBUTED_RULES = {
    "rank-straggler",
    "communication-bound",
    "uneven-inputs",
    "sampler-not-reshuffled",
    "rank-oversubscribed",
    "ranks-share-gpu",
    "collective-timeout",
    # issue 44's distributed mistakes: silent on a correct DDP job
    "data-not-sharded",
    "sampler-seed-mismatch",
    "batchnorm-not-synced",
    "accumulation-without-no-sync",
    "unused-parameters-search",
    "dataparallel-used",
    "fp16-without-scaler",
    "grad-scale-falling",
}


def launch(out: Path, *job_args: str, env_extra: dict | None = None, timeout: float = 240):
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env.update(env_extra or {})
    res = run_td(
        "launch", "--nproc-per-node", "2", "--out-dir", str(out), "--", JOB, *job_args,
        env=env, timeout=timeout,
    )  # fmt: skip
    recordings = sorted(out.glob("*.sqlite"))
    assert len(recordings) == 1, res.stderr
    return res, recordings[0]


def findings_of(*paths: Path) -> list[dict]:
    res = run_td("diagnose", "--json", *map(str, paths))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["findings"]


def by_id(findings: list[dict], rule: str) -> dict:
    found = [f for f in findings if f["id"] == rule]
    assert found, f"no {rule} finding among {[f['id'] for f in findings]}"
    return found[0]


@contextlib.contextmanager
def port_taken(port: int):
    """Hold ``port`` on every address, as another job's rendezvous would."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("0.0.0.0", port))
        s.listen(1)
    except OSError as exc:
        s.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        s = None  # someone else holds it: it is taken all the same
    try:
        yield
    finally:
        if s is not None:
            s.close()


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    out = tmp_path_factory.mktemp("healthy")
    # Each rank computes on 2048 samples a step against an all-reduce of 164 k parameters:
    # the exposed communication stays a few % of the step even on a busy 2-core machine.
    with port_taken(29500):
        res, rec = launch(out, "--samples", "65536", "--batch", "2048")
    return res, rec


def test_healthy_two_rank_job_records_both_ranks_and_finds_nothing(healthy) -> None:
    res, rec = healthy
    assert res.returncode == 0, res.stderr
    assert "2 rank(s) on node 0 of 1 (world size 2), rendezvous standalone" in res.stderr
    assert "OMP_NUM_THREADS=1: " in res.stderr
    with open_recording(rec) as r:
        assert r.meta["mode"] == "launch"
        assert r.meta["launch"]["world_size"] == 2
        steps = r.steps()
        infos = [json.loads(e["detail"]) for e in r.rows("events", where={"kind": "rank-info"})]
    per_rank = {rank: [s for s in steps if s["rank"] == rank] for rank in (0, 1)}
    # 65536 samples / 2 ranks / batch 2048: 16 steps on each rank, numbered 0..15
    assert [s["step"] for s in sorted(per_rank[0], key=lambda s: s["step"])] == list(range(16))
    assert [s["step"] for s in sorted(per_rank[1], key=lambda s: s["step"])] == list(range(16))
    assert {s["pid"] for s in per_rank[0]}.isdisjoint({s["pid"] for s in per_rank[1]})
    assert all(s["forward_s"] and s["backward_s"] and s["optimizer_s"] for s in steps)
    assert any(s["comm_s"] for s in per_rank[0]) and any(s["comm_s"] for s in per_rank[1])
    assert sorted((i["rank"], i["local_rank"], i["world_size"]) for i in infos) == [
        (0, 0, 2),
        (1, 1, 2),
    ]
    assert {i["omp_num_threads"] for i in infos} == {"1"}
    found = {f["id"] for f in findings_of(rec)}
    assert not found & DISTRIBUTED_RULES


def test_show_and_diagnose_agree_on_the_two_rank_jobs_step_figures(healthy) -> None:
    _, rec = healthy
    shown = run_td("show", "--json", str(rec))
    assert shown.returncode == 0, shown.stderr
    diagnosed = run_td("diagnose", "--json", str(rec))
    assert diagnosed.returncode == 0, diagnosed.stderr
    steps = json.loads(shown.stdout)["steps"]
    assert json.loads(diagnosed.stdout)["recordings"][0]["steps"] == steps
    # The job's rate is one rank's steps per second (the ranks' mean), never their sum; its
    # samples per second are every rank's samples together.
    ranks = steps["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1]
    rates = [r["steps_per_s"] for r in ranks]
    assert steps["steps_per_s"] == pytest.approx(sum(rates) / 2)
    assert steps["samples_per_s"] == pytest.approx(sum(r["samples_per_s"] for r in ranks))
    assert steps["batch_size"] == 2048
    assert steps["samples_per_s"] == pytest.approx(2 * 2048 * steps["steps_per_s"], rel=0.5)


def test_port_29500_taken_does_not_stop_the_job(healthy) -> None:
    res, rec = healthy
    assert res.returncode == 0
    with open_recording(rec) as r:
        ports = {
            json.loads(e["detail"])["master_port"]
            for e in r.rows("events", where={"kind": "rank-info"})
        }
    assert len(ports) == 1 and 29500 not in ports


def test_recordings_of_two_jobs_are_not_read_as_one(healthy, tmp_path: Path) -> None:
    import shutil
    import sqlite3

    _, rec = healthy
    other = tmp_path / "other.sqlite"
    shutil.copy(rec, other)
    with sqlite3.connect(other) as db:  # the same run, as if its rendezvous had been elsewhere
        for rowid, detail in db.execute("SELECT rowid, detail FROM events WHERE kind='rank-info'"):
            info = json.loads(detail)
            info["master_port"] = 1
            db.execute("UPDATE events SET detail=? WHERE rowid=?", (json.dumps(info), rowid))
    res = run_td("diagnose", str(rec), str(other))
    assert res.returncode == 2
    assert res.stderr.startswith("torchdoctor: error: these recordings hold 2 different jobs")


def test_straggler_named_and_sampler_not_reshuffled(tmp_path: Path) -> None:
    res, rec = launch(
        tmp_path, "--slow-rank", "1", "--slow-ms", "60", "--epochs", "2", "--samples", "8192",
        "--no-set-epoch",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    findings = findings_of(rec)
    straggler = by_id(findings, "rank-straggler")
    assert straggler["settings"]["rank"] == 1
    assert straggler["settings"]["cause"] == "data_wait_s"
    assert "Rank 1 on node 0" in straggler["title"]
    sampler = by_id(findings, "sampler-not-reshuffled")
    assert "2 passes over the data, all with epoch 0" in sampler["title"]
    assert "set_epoch(epoch)" in sampler["recommendation"]


def test_many_parameters_little_compute_is_communication_bound(tmp_path: Path) -> None:
    res, rec = launch(tmp_path, "--heavy", "--batch", "8", "--samples", "256")
    assert res.returncode == 0, res.stderr
    finding = by_id(findings_of(rec), "communication-bound")
    labels = {e["label"]: e["value"] for e in finding["evidence"]}
    assert labels["backward all-reduce per step (DDP)"] > 0
    assert labels["exposed communication (comm - overlap) share of step"] > 10
    assert labels["gradient bytes all-reduced per step"] > 18 * 2**20  # 4.7 M float params
    assert "no_sync" in finding["recommendation"]
    assert "bucket_cap_mb" in finding["recommendation"]


def test_uneven_shards_and_oversubscribed_ranks(tmp_path: Path) -> None:
    # OMP_NUM_THREADS=2 set by the user is kept: 2 ranks x 2 threads on 2 usable cores.
    res, rec = launch(
        tmp_path, "--uneven", "--samples", "3072", "--batch", "256", "--timeout", "10",
        env_extra={"OMP_NUM_THREADS": str(2 * len(os.sched_getaffinity(0)) // 2)},
    )  # fmt: skip
    assert res.returncode != 0  # rank 0's extra all-reduce has no partner
    assert "OMP_NUM_THREADS=" in res.stderr and "kept (set by you)" in res.stderr
    findings = findings_of(rec)
    uneven = by_id(findings, "uneven-inputs")
    values = {e["label"]: e["value"] for e in uneven["evidence"]}
    assert values["rank 0 batches per epoch"] == 8
    assert values["rank 1 batches per epoch"] == 4
    assert "drop_last=True" in uneven["recommendation"]
    over = by_id(findings, "rank-oversubscribed")
    assert over["settings"]["OMP_NUM_THREADS"] == max(1, len(os.sched_getaffinity(0)) // 2)


def test_hang_ends_with_the_users_timeout_and_names_the_missing_rank(tmp_path: Path) -> None:
    res, rec = launch(
        tmp_path, "--hang-rank", "1", "--hang-step", "3", "--timeout", "5", "--samples", "4096",
        "--batch", "256",
    )  # fmt: skip
    assert res.returncode != 0
    with open_recording(rec) as r:
        errors = [e for e in r.rows("events", where={"kind": "rank-error"})]
        rank0 = [s for s in r.steps() if s["rank"] == 0]
    assert [e["rank"] for e in errors] == [0]
    assert json.loads(errors[0]["detail"])["kind"] == "timeout"
    waited = errors[0]["t"] - max(s["t_end"] for s in rank0)
    assert 4.0 < waited < 60.0  # the 5 s timeout the job set, not torch's 30 min default
    fr = rec.with_suffix(".fr")
    assert (fr / "fr_trace_rank_0.json").is_file() and (fr / "fr_trace_rank_1.json").is_file()
    finding = by_id(findings_of(rec), "collective-timeout")
    assert finding["settings"]["missing_ranks"] == [1]
    assert finding["title"].startswith("rank 1 did not arrive at collective #")
    labels = {e["label"]: e["value"] for e in finding["evidence"]}
    assert "ddp_job.py" in labels["rank 1 was in"]  # the sleep it was stuck in


def test_bad_options_are_one_clear_line(tmp_path: Path) -> None:
    res = run_td("launch", "--nnodes", "2", "--out-dir", str(tmp_path), "--", JOB)
    assert res.returncode == 2
    assert res.stderr.startswith("torchdoctor: error: --nnodes 2 needs --master-addr")
    res = run_td("launch", "--out-dir", str(tmp_path), "--", "nope.py")
    assert res.stderr == "torchdoctor: error: no such script: 'nope.py'\n"
    assert not list(tmp_path.iterdir())


def test_preflight_error_refuses_to_start(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        res = run_td(
            "launch", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
            str(port), "--out-dir", str(tmp_path), "--", JOB,
        )  # fmt: skip
    assert res.returncode == 2
    assert "preflight error: network.rendezvous: 127.0.0.1:" in res.stderr
    assert res.stderr.splitlines()[-1].startswith("torchdoctor: error: preflight found 1 error")
    assert "--force" in res.stderr.splitlines()[-1]
    assert not list(tmp_path.glob("*.sqlite"))


def test_python_interpreter_before_the_script_is_accepted() -> None:
    from torchdoctor.launch.plan import split_script

    assert split_script([sys.executable, JOB, "--x"]) == [JOB, "--x"]
    assert split_script(["-m", "pkg.train"]) == ["-m", "pkg.train"]


def test_ranks_far_above_the_cpus_are_refused_before_anything_starts(tmp_path: Path) -> None:
    from torchdoctor.doctor.host import RANKS_PER_CPU
    from torchdoctor.sampling.hostinfo import whole_cpus_here

    cpus = whole_cpus_here()
    many = str(RANKS_PER_CPU * cpus + 1)
    res = run_td("launch", "--quiet", "--nproc-per-node", many, "--out-dir", str(tmp_path),
                 "--", JOB)  # fmt: skip
    assert res.returncode == 2
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("torchdoctor: error: preflight found 1 error(s) (host.rank_count: ")
    # The fix is fewer ranks (not OMP_NUM_THREADS), and --force overrides.
    assert "fix: start at most " in lines[0] and "--force" in lines[0]
    assert not list(tmp_path.glob("*.sqlite"))


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie that its new parent has yet to reap."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path: Path) -> None:
    import signal
    import subprocess
    import time

    from tests.conftest import TORCHDOCTOR

    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    script = Path(__file__).resolve().parent / "jobs" / "waiting_rank.py"
    launcher = subprocess.Popen(
        [*TORCHDOCTOR, "launch", "--quiet", "--nproc-per-node", "2",
         "--out-dir", str(tmp_path / "out"), "--", str(script), str(pids_dir)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 2:  # both ranks joined their group and said who they are
            assert launcher.poll() is None, launcher.stderr.read().decode()
            assert time.monotonic() < deadline, "the ranks did not start within 120 s"
            ranks = [int(p.read_text()) for p in sorted(pids_dir.glob("rank*"))]
            time.sleep(0.1)  # polling for the files the ranks write, not a synchronisation
        launcher.kill()  # SIGKILL: nothing of the launcher runs after this
        launcher.wait()
        # torchrun gets SIGTERM from the kernel and stops its ranks (torch's own grace is 30 s).
        deadline = time.monotonic() + 60
        while not all(_gone(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling for the ranks to be gone
        left = [pid for pid in ranks if not _gone(pid)]
        assert not left, f"ranks {left} outlived the killed launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in ranks:  # ours, started by the launch above: stopped by their PIDs
            with contextlib.suppress(ProcessLookupError):
                if not _gone(pid):
                    os.kill(pid, signal.SIGKILL)
        launcher.stderr.close()
