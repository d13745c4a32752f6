"""GPU rules on recordings shaped like NVML and torch.cuda report them (fake-free: the figures
are written by the real writer; no GPU is needed to judge them)."""

from __future__ import annotations

from tests.diagnosis.builders import T0, GiB, Gpu, Job, Proc, const, loader, make_steps
from tests.diagnosis.conftest import by_id, evidence, serious
from torchdoctor.recording.records import JobEvent


def ids(findings):
    return [f.id for f in findings]


def gpu_job(
    *,
    used_gib: float = 52.0,
    util: float = 96.0,
    autocast: str | None = "bfloat16",
    pin: bool = True,
    capability: str = "8.0",
    batch: int = 64,
    fixed_gib: float = 12.0,
    peak_gib: float = 44.0,
    reserved_gib: float = 48.0,
    retries=0,
    wait: float = 0.002,
    **kw,
) -> Job:
    """A healthy A100 job by default: 65 % of VRAM, busy GPU, bf16 autocast, pinned loader."""
    return Job(
        cpus=16,
        procs=[Proc(1000, cpu=const(110.0))]
        + [Proc(2000 + i, role="dataloader-worker", cpu=const(40.0)) for i in range(6)],
        gpus=[
            Gpu(
                util=const(util),
                used=const(used_gib * GiB),
                capability=capability,
                **kw.pop("gpu", {}),
            )
        ],
        steps=make_steps(
            n=300,
            wall=0.12,
            wait=wait,
            batch=batch,
            autocast_dtype=autocast,
            cuda_allocated=int(fixed_gib * GiB),
            cuda_max_allocated=int(peak_gib * GiB),
            cuda_reserved=int(reserved_gib * GiB),
            cuda_alloc_retries=retries,
            cuda_ooms=0,
        ),
        dataloaders=[
            loader(num_workers=6, pin_memory=pin, persistent_workers=True, batch_size=batch)
        ],
        settings={1000: {"torch.num_threads": 8, "params.devices": ["cuda:0"]}},
        **kw,
    )


def test_healthy_gpu_job_gets_a_clean_bill(run_rules):
    findings = run_rules(gpu_job())
    assert serious(findings) == []
    assert ids(findings) == []


def test_vram_near_full_recommends_a_batch_in_the_best_range(run_rules):
    # 76 of 80 GiB (95 %): 12 GiB fixed, 32 GiB of activations for 64 samples (0.5 GiB each),
    # reserved/peak = 1.09, NVML sees 4 GiB beyond the reservation.
    job = gpu_job(used_gib=76.0, peak_gib=44.0, reserved_gib=72.0 * 44 / 66)
    f = by_id(run_rules(job), "vram-near-full")
    assert f.severity == "warning"
    new_batch = f.settings["batch_size"]
    assert 16 <= new_batch < 64
    predicted = float(f.recommendation.split("lands at about ")[1].split(" %")[0])
    assert 60 <= predicted <= 85
    assert evidence(f, "activation memory per sample") == 512 * 2**20


def test_vram_at_85_percent_is_fine(run_rules):
    assert "vram-near-full" not in ids(run_rules(gpu_job(used_gib=68.0)))


def test_cuda_oom_is_critical(run_rules):
    job = gpu_job(used_gib=70.0)
    job.events = [JobEvent(1000, None, T0 + 20, "cuda-oom", '{"batch_size": 64}')]
    f = by_id(run_rules(job), "cuda-oom")  # vram-near-full leaves an OOM to cuda-oom
    assert f.severity == "critical"
    assert "vram-near-full" not in ids(run_rules(job))


def test_vram_underused_suggests_a_larger_batch(run_rules):
    job = gpu_job(used_gib=20.0, fixed_gib=4.0, peak_gib=12.0, reserved_gib=14.0)
    f = by_id(run_rules(job), "vram-underused")
    assert f.severity == "info"
    assert f.settings["batch_size"] > 64


def test_fragmentation_with_retries(run_rules):
    job = gpu_job(used_gib=74.0, peak_gib=44.0, reserved_gib=70.0, retries=lambda i: i // 50)
    f = by_id(run_rules(job), "cuda-fragmentation")
    assert f.severity == "warning"
    assert f.settings == {"env.PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert evidence(f, "allocation retries") == 5


def test_fragmentation_already_fixed_is_silent(run_rules):
    job = gpu_job(used_gib=74.0, peak_gib=44.0, reserved_gib=70.0, retries=3)
    job.settings[1000]["env.PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    assert "cuda-fragmentation" not in ids(run_rules(job))


def test_gpu_underused_names_the_dataloader_as_cause(run_rules):
    job = gpu_job(util=28.0, wait=0.07)
    job.dataloaders = [loader(num_workers=0, pin_memory=True, batch_size=64)]
    job.procs = [Proc(1000, cpu=const(100.0))]
    findings = run_rules(job)
    f = by_id(findings, "gpu-underused")
    assert f.severity == "warning"
    assert "cause: dataloader-bound" in f.recommendation
    assert f.settings == by_id(findings, "dataloader-bound").settings
    assert "a kernel was running" in f.details


def test_gpu_underused_without_host_cause_says_where_to_look(run_rules):
    f = by_id(run_rules(gpu_job(util=35.0)), "gpu-underused")
    assert "torch.profiler" in f.recommendation


def test_gpu_busy_just_above_the_limit_is_silent(run_rules):
    assert "gpu-underused" not in ids(run_rules(gpu_job(util=52.0)))


def test_no_mixed_precision_on_tensor_core_gpus(run_rules):
    f = by_id(run_rules(gpu_job(autocast=None)), "no-mixed-precision")
    assert f.settings == {"autocast_dtype": "bfloat16"}
    v100 = by_id(run_rules(gpu_job(autocast=None, capability="7.0")), "no-mixed-precision")
    assert v100.settings == {"autocast_dtype": "float16", "grad_scaler": True}
    assert "GradScaler" in v100.recommendation
    pascal = run_rules(gpu_job(autocast=None, capability="6.0"))
    assert "no-mixed-precision" not in ids(pascal)


def test_pin_memory_off(run_rules):
    f = by_id(run_rules(gpu_job(pin=False)), "pin-memory-off")
    assert f.settings == {"pin_memory": True}


def test_workers_restarted_every_epoch(run_rules):
    job = gpu_job()
    job.dataloaders = [loader(num_workers=6, pin_memory=True, persistent_workers=False)]
    # 4 epochs of 75 steps; the first step of each epoch waits 1.5 s for the workers.
    job.steps = make_steps(
        n=300,
        wall=0.12,
        wait=0.002,
        wait_fn=lambda i: 1.5 if i % 75 == 0 else 0.002,
        cuda_allocated=12 * GiB,
        cuda_max_allocated=44 * GiB,
        cuda_reserved=48 * GiB,
        autocast_dtype="bfloat16",
    )
    job.events = [
        JobEvent(1000, None, s.t_start + 0.001, "epoch-start", '{"loader_id": 0}')
        for s in job.steps
        if s.step % 75 == 0
    ]
    f = by_id(run_rules(job), "workers-not-persistent")
    assert f.settings == {"persistent_workers": True}
    assert f.severity == "warning"  # 4.5 s lost of ~40 s
    assert evidence(f, "epochs") == 4


def test_thermal_throttling_warns_power_cap_informs(run_rules):
    hot = gpu_job(gpu={"reasons": lambda t: ["hw_thermal_slowdown"], "temperature": const(91.0)})
    f = by_id(run_rules(hot), "gpu-throttled")
    assert f.severity == "warning"
    assert evidence(f, "peak temperature") == 91.0
    capped = by_id(run_rules(gpu_job(gpu={"reasons": lambda t: ["sw_power_cap"]})), "gpu-throttled")
    assert capped.severity == "info"
    idle = run_rules(gpu_job(gpu={"reasons": lambda t: ["gpu_idle"]}))
    assert "gpu-throttled" not in ids(idle)


def test_cpu_training_next_to_a_free_gpu(run_rules):
    job = Job(
        cpus=8,
        procs=[Proc(1000, cpu=const(700.0))],
        gpus=[Gpu(util=const(0.0), used=const(0.5 * GiB), job_pid=None)],
        steps=make_steps(n=200),
        settings={1000: {"torch.num_threads": 8, "params.devices": ["cpu"]}},
    )
    f = by_id(run_rules(job), "gpu-idle-cpu-training")
    assert f.severity == "warning"
    assert f.settings == {"device": "cuda:0"}
    busy = Job(
        cpus=8,
        procs=[Proc(1000, cpu=const(700.0))],
        gpus=[Gpu(util=const(90.0), used=const(70 * GiB), job_pid=None)],
        steps=make_steps(n=200),
        settings={1000: {"torch.num_threads": 8, "params.devices": ["cpu"]}},
    )
    assert "gpu-idle-cpu-training" not in ids(run_rules(busy))


def test_no_gpu_rules_without_gpus(run_rules):
    job = Job(procs=[Proc(1000, cpu=const(100.0))], steps=make_steps(n=200))
    findings = run_rules(job)
    gpu_ids = {
        "vram-near-full",
        "vram-underused",
        "cuda-fragmentation",
        "gpu-underused",
        "no-mixed-precision",
        "pin-memory-off",
        "gpu-throttled",
        "gpu-idle-cpu-training",
    }
    assert not gpu_ids & set(ids(findings))


def test_xid_and_ecc_errors_name_the_cause_and_its_fix(run_rules):
    fell_off = gpu_job(gpu={"xids": lambda t: [79] if t == 20.0 else []})
    f = by_id(run_rules(fell_off), "gpu-hardware-errors")
    assert f.severity == "critical" and "Xid 79 (GPU has fallen off the bus)" in f.title
    assert "nvidia-bug-report.sh" in f.recommendation and f.settings["causes"] == ["hardware"]

    memory = gpu_job(gpu={"ecc_uncorrected": lambda t: 0 if t < 20 else 2})
    f = by_id(run_rules(memory), "gpu-hardware-errors")
    assert f.severity == "critical" and "ECC" in f.title
    assert evidence(f, "of them during the recording") == 2
    assert "ROW_REMAPPER" in f.recommendation

    page_fault = gpu_job(gpu={"xids": lambda t: [31] if t == 12.0 else []})
    f = by_id(run_rules(page_fault), "gpu-hardware-errors")
    assert f.severity == "warning" and "compute-sanitizer" in f.recommendation


def test_no_hardware_finding_on_a_clean_gpu_or_one_without_ecc(run_rules):
    assert "gpu-hardware-errors" not in ids(run_rules(gpu_job()))
    no_ecc = gpu_job(gpu={"ecc_uncorrected": lambda t: None})
    assert "gpu-hardware-errors" not in ids(run_rules(no_ecc))
