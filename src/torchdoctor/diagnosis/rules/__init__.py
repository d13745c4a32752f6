"""One module per rule. Each exposes ``ID`` (the finding id) and ``check(ctx)``, which returns
the rule's findings for a :class:`~torchdoctor.diagnosis.context.DiagnosisContext` (an empty
list when the data it needs is absent: rules never guess). A rule that sets
``AFTER_OTHERS = True`` runs last and may read ``ctx.findings``, the findings made before it. A rule with ``SCOPE = "job"`` compares ranks (``ctx.job``) and
runs once for a job recorded on several nodes; the others run on each node's recording.

Adding a rule means adding its module here and its test in tests/diagnosis/.
"""

RULE_MODULES: tuple[str, ...] = (
    "dataloader_bound",
    "thread_oversubscription",
    "cpu_saturated",
    "io_wait",
    "swap_thrash",
    "oom_killed",
    "host_memory_leak",
    "dataloader_copy_on_access",
    "vram_near_full",
    "vram_underused",
    "cuda_fragmentation",
    "cuda_oom",
    "cuda_memory_peak",
    "no_mixed_precision",
    "pin_memory_off",
    "workers_not_persistent",
    "gpu_throttled",
    "gpu_hardware_errors",
    "gpu_idle_cpu_training",
    # reads the ranks' findings (SCOPE = "job", AFTER_OTHERS): before gpu-underused and
    # short-recording, which read every other finding
    "scaling_no_gain",
    "gpu_underused",
    "dataparallel_used",
    "fp16_without_scaler",
    "grad_scale_falling",
    # profiled windows (run --profile-steps): silent without one
    "sync_points",
    "op_bound",
    "launch_bound",
    "python_overhead",
    "memcpy_bound",
    "comm_exposed",
    "short_recording",
    # distributed: compare the ranks of a job (SCOPE = "job": run once over every node)
    "rank_straggler",
    "communication_bound",
    "uneven_inputs",
    "sampler_not_reshuffled",
    "rank_oversubscribed",
    "ranks_share_gpu",
    "collective_timeout",
    "data_not_sharded",
    "sampler_seed_mismatch",
    "batchnorm_not_synced",
    "accumulation_without_no_sync",
    "unused_parameters_search",
)
