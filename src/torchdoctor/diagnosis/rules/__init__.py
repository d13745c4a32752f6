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
    "no_mixed_precision",
    "pin_memory_off",
    "workers_not_persistent",
    "gpu_throttled",
    "gpu_hardware_errors",
    "gpu_idle_cpu_training",
    "gpu_underused",
    "short_recording",
    # distributed: compare the ranks of a job (SCOPE = "job": run once over every node)
    "rank_straggler",
    "communication_bound",
    "uneven_inputs",
    "sampler_not_reshuffled",
    "rank_oversubscribed",
    "ranks_share_gpu",
    "collective_timeout",
)
