"""dataparallel-used: the model is wrapped in ``nn.DataParallel``.

DataParallel drives every GPU from one process: one Python interpreter (one GIL) replicates the
module to each GPU in every forward, scatters the inputs and gathers the outputs on the first
GPU. PyTorch recommends DistributedDataParallel, one process per GPU, even on one machine. Seen
from the agent's ``data-parallel`` event (``DataParallel.__init__``, in any process).
"""

from __future__ import annotations

from torchdoctor.diagnosis.context import DiagnosisContext
from torchdoctor.diagnosis.findings import Evidence, Finding

ID = "dataparallel-used"

# The speed-up is PyTorch's statement, not a figure of ours: no GPU has measured one here.
_SOURCE = (
    "PyTorch's documentation of DistributedDataParallel: \"DistributedDataParallel is proven "
    "to be significantly faster than torch.nn.DataParallel for single-node multi-GPU data "
    'parallel training" (torch/nn/parallel/distributed.py, torch 2.13)'
)


def check(ctx: DiagnosisContext) -> list[Finding]:
    events = [e for e in ctx.events_of("data-parallel") if isinstance(e["detail"], dict)]
    if not events:
        return []
    d = events[0]["detail"]
    devices = int(d.get("devices") or 0)
    evidence = [
        Evidence("nn.DataParallel built", len(events), "times"),
        Evidence("wrapped module", str(d.get("module") or "?"), ""),
        Evidence("GPUs it drives", devices, "GPUs"),
    ]
    if devices <= 1:
        title = "nn.DataParallel wraps the model, with " + (
            "no GPU: it runs the module as it is" if devices == 0 else "one GPU: no parallelism"
        )
    else:
        title = f"nn.DataParallel drives {devices} GPUs from one process"
    gpus = max(devices, 2)
    return [
        Finding(
            id=ID,
            severity="warning" if devices >= 2 else "info",
            title=title,
            evidence=evidence,
            recommendation=(
                "Use one process per GPU with DistributedDataParallel: "
                '`dist.init_process_group("nccl")`, `local_rank = int(os.environ["LOCAL_RANK"])`, '
                "`torch.cuda.set_device(local_rank)`, `model = DistributedDataParallel("
                "model.to(local_rank), device_ids=[local_rank])`, a DistributedSampler for the "
                f"data, and run it with `torchdoctor launch --nproc-per-node {gpus} train.py` "
                "(every rank recorded)."
            ),
            expected_effect=(
                f"No single-process bottleneck (GIL, replication and gather on GPU 0). {_SOURCE}; "
                "torchdoctor has measured no figure of its own: record both runs and compare "
                "them with `torchdoctor compare`."
            ),
            confidence=0.95,
            settings={"parallel": "DistributedDataParallel", "nproc_per_node": gpus},
        )
    ]
