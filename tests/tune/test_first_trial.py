"""tune's first search trial is what diagnose prints: the demo's shape (main-process loading
on 2 intra-op threads, 2 CPUs) gives workers and one trainer thread, and tune starts there."""

from __future__ import annotations

from tests.diagnosis.builders import Job, Proc, const, loader, make_steps
from torchdoctor.diagnosis.engine import diagnose
from torchdoctor.recording.reader import open_recording
from torchdoctor.tune.space import Config
from torchdoctor.tune.tuner import suggestion_from_diagnosis


def test_first_trial_is_the_diagnosis_settings(tmp_path):
    # 190 ms of a 210 ms step waits for data loaded on the trainer's 2 threads, which burn
    # 1.9 CPUs doing it; the machine has 2 CPUs and nothing else runs.
    job = Job(
        cpus=2,
        duration=70.0,
        procs=[Proc(1000, cpu=const(190.0))],
        host=lambda t: {"cpu_busy": 96.0},
        steps=make_steps(n=300, wall=0.21, wait=0.19, batch=32),
        dataloaders=[loader(num_workers=0, batch_size=32)],
        settings={1000: {"torch.num_threads": 2}},
    )
    path = job.write(tmp_path / "demo-like.sqlite")
    with open_recording(path) as rec:
        (f,) = [x for x in diagnose(rec) if x.id == "dataloader-bound"]
    assert f.settings["num_workers"] == 2
    assert f.settings["torch.num_threads"] == 1
    assert f.settings["env.OMP_NUM_THREADS"] == "1"
    assert "torch.set_num_threads(1)" in f.recommendation
    suggestion = suggestion_from_diagnosis(str(path), Config(num_workers=0, num_threads=2))
    assert suggestion == Config(
        num_workers=2,
        num_threads=1,
        prefetch_factor=f.settings["prefetch_factor"],
        persistent_workers=True,
    )
