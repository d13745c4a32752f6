"""Memory snapshots shaped like torch 2.13's ``torch.cuda.memory._snapshot()`` on a CUDA job,
with known answers: segments and blocks, the history with segment_alloc/free, alloc,
free_requested/free_completed and an ``oom`` entry, frames innermost first (torch's own files
before the user's line), one frame dict shared by every stack that passes through it and one
empty frames list shared by every entry without a Python stack (as torch's ``py_symbolize``
builds them: the pickle refers back to them through its memo).
"""

from __future__ import annotations

from typing import Any

GiB = 2**30
MiB = 2**20
SITE = "/venv/lib/python3.11/site-packages/torch"
FIRST_STEP_US = 1_764_489_600_000_000  # a first step, UNIX microseconds


def frame(filename: str, line: int, name: str) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


LINEAR = frame(f"{SITE}/nn/modules/linear.py", 125, "forward")
CALL = frame(f"{SITE}/nn/modules/module.py", 1762, "_call_impl")
APPLY = frame(f"{SITE}/nn/modules/module.py", 930, "_apply")
ADAM = frame(f"{SITE}/optim/adam.py", 400, "_single_tensor_adam")
AGENT = frame("/venv/lib/python3.11/torchdoctor/instrument/agent/hooks.py", 210, "step")
MODEL_42 = frame("/home/u/proj/model.py", 42, "forward")
MODEL_57 = frame("/home/u/proj/model.py", 57, "forward")
TRAIN_8 = frame("/home/u/proj/train.py", 8, "main")
TRAIN_10 = frame("/home/u/proj/train.py", 10, "main")
TRAIN_17 = frame("/home/u/proj/train.py", 17, "train_step")
TRAIN_20 = frame("/home/u/proj/train.py", 20, "train_step")
RUNPY = frame("/usr/lib/python3.11/runpy.py", 88, "_run_code")

# What the OOM snapshot below holds at its peak, by construction.
PEAK = 8 * GiB + 256 * MiB
PHASES = {
    "activations": 3 * GiB + 512 * MiB,
    "parameters": 2 * GiB + 256 * MiB,
    "before the history": GiB + 512 * MiB,
    "gradients": GiB,
}
TOP_LINE = "model.py:42 forward"  # 3 blocks of 1 GiB
RESERVED_AT_PEAK = 9 * GiB + 256 * MiB  # a 512 MiB segment was given back after the peak
RESERVED_AT_END = 8 * GiB + 768 * MiB
ALLOCATED_AT_END = 5 * GiB + 256 * MiB
LARGEST_FREE = 3 * GiB
REQUEST = 4 * GiB
DEVICE_FREE = 300 * MiB


def oom_snapshot(first_step_us: int = FIRST_STEP_US) -> dict[str, Any]:
    """A job that ran out of memory at its optimizer step; the peak came earlier, at the end
    of backward. Before the history began: a 1 GiB block still live at the end and a 512 MiB
    block freed after the peak. The step starts at ``first_step_us`` (the recording's)."""
    base = 0x7F0000000000
    static, early = base, base + 16 * GiB  # allocated before the history
    params, buffer = base + GiB, base + 3 * GiB + 256 * MiB
    acts = [base + 4 * GiB + i * GiB for i in range(3)]
    act57 = base + 8 * GiB
    grads = [base + 9 * GiB, base + 9 * GiB + 512 * MiB]
    state = base + 10 * GiB
    forward = [LINEAR, CALL, MODEL_42, CALL, TRAIN_17, RUNPY]
    no_stack: list = []  # torch's one list for every entry without a Python stack
    t = first_step_us - 10_000_000
    history: list[dict[str, Any]] = []

    def add(action: str, addr: int, size: int, frames: list, **extra: Any) -> None:
        nonlocal t
        t += 1000
        history.append(
            {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
             "frames": frames, "pool_id": (0, 0), **extra}
        )  # fmt: skip

    add("segment_alloc", base + 20 * GiB, 512 * MiB, no_stack)
    add("alloc", params, 2 * GiB, [APPLY, CALL, APPLY, TRAIN_8, RUNPY])  # model.cuda()
    add("alloc", buffer, 256 * MiB, [TRAIN_10, RUNPY])  # a buffer made before the first step
    t = first_step_us
    for addr in acts:
        add("alloc", addr, GiB, list(forward))
    add("alloc", act57, 512 * MiB, [LINEAR, CALL, MODEL_57, CALL, TRAIN_17, RUNPY])
    for addr in grads:  # backward, on autograd's device thread: no Python stack
        add("alloc", addr, 512 * MiB, no_stack)
    for addr in [*acts, act57]:  # the peak ends: forward's saved tensors go
        add("free_requested", addr, GiB if addr != act57 else 512 * MiB, no_stack)
        add("free_completed", addr, GiB if addr != act57 else 512 * MiB, no_stack)
    add("segment_free", base + 20 * GiB, 512 * MiB, no_stack)
    add("alloc", state, GiB, [ADAM, AGENT, TRAIN_20, RUNPY])  # Adam's lazy state
    add("free_requested", early, 512 * MiB, no_stack)
    add("free_completed", early, 512 * MiB, no_stack)
    history.append({"action": "oom", "size": REQUEST, "stream": 0, "time_us": t + 1,
                    "frames": [ADAM, TRAIN_20], "device_free": DEVICE_FREE})  # fmt: skip

    def block(addr: int, size: int, state: str) -> dict[str, Any]:
        return {"address": addr, "size": size, "requested_size": size if state != "inactive" else 0,
                "state": state, "frames": []}  # fmt: skip

    blocks = [
        block(static, GiB, "active_allocated"),
        block(params, 2 * GiB, "active_allocated"),
        block(buffer, 256 * MiB, "active_allocated"),
        block(acts[0], 3 * GiB, "inactive"),
        block(act57, 512 * MiB, "inactive"),
        block(grads[0], 512 * MiB, "active_allocated"),
        block(grads[1], 512 * MiB, "active_allocated"),
        block(state, GiB, "active_allocated"),
    ]
    segment = {
        "device": 0, "address": base, "total_size": RESERVED_AT_END, "stream": 0,
        "segment_type": "large", "segment_pool_id": (0, 0), "allocated_size": ALLOCATED_AT_END,
        "active_size": ALLOCATED_AT_END, "requested_size": ALLOCATED_AT_END, "blocks": blocks,
    }  # fmt: skip
    return {
        "segments": [segment],
        "device_traces": [history],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""},
        "external_annotations": [],
    }


def long_history(entries: int) -> dict[str, Any]:
    """A history of ``entries`` allocs and frees from 50 lines, at most 1,000 blocks live,
    with torch's sharing (frame dicts, the empty list); the peak is 1,000 MiB."""
    stacks = [[LINEAR, CALL, frame("/home/u/proj/model.py", 40 + i, "forward"), TRAIN_17]
              for i in range(50)]  # fmt: skip
    no_stack: list = []
    history = []
    live: list[int] = []
    addr = 0x7F0000000000
    i = 0
    while len(history) < entries:
        a = addr + i * MiB
        history.append({"action": "alloc", "addr": a, "size": MiB, "stream": 0, "time_us": i,
                        "frames": list(stacks[i % 50]), "pool_id": (0, 0)})  # fmt: skip
        live.append(a)
        if len(live) > 1000:
            history.append({"action": "free_completed", "addr": live.pop(0), "size": MiB,
                            "stream": 0, "time_us": i, "frames": no_stack})  # fmt: skip
        i += 1
    return {"segments": [], "device_traces": [history], "allocator_settings": {}}
