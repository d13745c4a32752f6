#!/usr/bin/env bash
# The GPU check: what torchdoctor reads from a real NVIDIA GPU, in one short run (< 8 min).
#
#   bash benchmarks/gpu_check.sh            # from the repository root, on a machine with a GPU
#
# 1. picks a Python whose torch sees CUDA (python3, .venv, or a venv it makes with a pinned
#    CUDA torch when there is a GPU and a package index can be reached);
# 2. GpuReader on the real NVML: status, two reads, and the per-read cost (nvml_read_cost.py);
# 3. `torchdoctor run` on a small CUDA training loop with DataLoader workers, then prints the
#    NVML readings the recording holds, beside what PyTorch says it holds on the GPU;
# 4. the instrumentation's CUDA path on that recording: per-step cuda_* columns against what
#    the loop's torch reported; then a provoked CUDA OOM under `torchdoctor run` (the job's
#    exit status kept, the OOM recorded as an event); an activations OOM under
#    `run --memory-history`: the cuda-oom finding's micro-batch x accumulation, then run;
# 5. benchmarks/estimate_cuda_check.py, when it exists;
# 6. with GPU_CHECK_TESTS=1, the test modules that read GPUs or NVML, on the real GPU (they
#    assert what NVML really reports, so they hold on a GPU machine as they do here).
# 6b. a CUDA profile window (`run --profile-steps 5-7`): the trace's kernels, GPU busy/idle per
#    step, and sync-points naming the loop's loss.item() line;
# 6c. CUDA memory at the peak (`run --memory-history`): torch's own snapshots, at the end of a
#    loop and at an OOM, read by show (the activations' line, the failed request);
# 7. `torchdoctor doctor --json` on the real NVML (versions, topology, P2P, processes), and the
#    NCCL all-reduce / all-gather / reduce-scatter sweep over every GPU (needs two or more).
# Logs and the recording go to $OUT (or a temporary folder). Each step has its own time limit
# and a failing step does not stop the others; the exit status is the number of failed steps.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
TORCH_CUDA_PIN="${TORCH_CUDA_PIN:-torch==2.5.1}"
TORCH_CUDA_INDEX="${TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/cu124}"
FAILED=0

step() { echo; echo "=== $* ==="; }
fail() { echo "!!! failed: $*"; FAILED=$((FAILED + 1)); }

has_deps() {  # torchdoctor's runtime dependencies
  "$1" -c "import psutil, click, rich, pynvml" >/dev/null 2>&1
}
has_cuda_torch() {
  has_deps "$1" && "$1" -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1
}
CANDIDATES=("${PYTHON:-}" python3 "$ROOT/.venv/bin/python")

step "Python with CUDA torch"
PY=""
CUDA=0
for cand in "${CANDIDATES[@]}"; do
  if [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && has_cuda_torch "$cand"; then
    PY="$cand"; CUDA=1; break
  fi
done
if [ -z "$PY" ] && [ -e /dev/nvidiactl ] && [ -z "${GPU_CHECK_NO_INSTALL:-}" ]; then
  echo "no Python here has a CUDA torch; making /tmp/td-gpu-venv with $TORCH_CUDA_PIN"
  python3 -m venv /tmp/td-gpu-venv \
    && timeout 300 /tmp/td-gpu-venv/bin/pip install -q "$TORCH_CUDA_PIN" --index-url "$TORCH_CUDA_INDEX" \
    && timeout 120 /tmp/td-gpu-venv/bin/pip install -q -e "$ROOT" \
    && has_cuda_torch /tmp/td-gpu-venv/bin/python && PY=/tmp/td-gpu-venv/bin/python && CUDA=1
fi
if [ -z "$PY" ]; then
  fail "no Python with a CUDA torch (and none could be installed): NVML checks only"
  for cand in "${CANDIDATES[@]}"; do
    if [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && has_deps "$cand"; then
      PY="$cand"; break
    fi
  done
  [ -n "$PY" ] || { echo "no Python with torchdoctor's dependencies either"; exit 1; }
fi
"$PY" -c "import sys, torch; print(sys.executable, 'torch', torch.__version__, 'CUDA', torch.version.cuda)" 2>&1 \
  || "$PY" -c "import sys; print(sys.executable, 'without torch')"
command -v nvidia-smi >/dev/null && nvidia-smi -L

step "GpuReader on the real NVML"
timeout 60 "$PY" - <<'EOF' || fail "GpuReader"
import json, os, time
from dataclasses import asdict
from torchdoctor.sampling.gpus import GpuReader

reader = GpuReader(slow_refresh_s=0.5)
print(json.dumps(asdict(reader.status), indent=1))
if not reader.status.available:
    raise SystemExit(f"NVML unavailable: {reader.status.reason}")
for _ in range(2):
    samples, procs = reader.read({os.getpid()})
    for s in samples:
        print(json.dumps(asdict(s)))
    print(f"{len(procs)} GPU process(es):", [(p.pid, p.local_pid, p.used_memory) for p in procs])
    time.sleep(0.6)
reader.close()
EOF

step "per-read cost of GpuReader (fake and real NVML)"
timeout 120 "$PY" benchmarks/nvml_read_cost.py --reads 300 || fail "nvml_read_cost"

REC="$OUT/gpu-check.sqlite"
rm -f "$REC"
if [ "$CUDA" = 1 ]; then
step "torchdoctor run on a CUDA training loop"
if timeout 180 "$PY" -m torchdoctor run --interval 0.25 --out "$REC" -- \
    "$PY" benchmarks/gpu_train_loop.py --seconds 20 --workers 2 2>&1 | tee "$OUT/train.log"; then
  :
else
  fail "torchdoctor run"
fi

step "NVML readings in the recording"
timeout 60 "$PY" - "$REC" "$OUT/train.log" <<'EOF' || fail "reading the recording back"
import json, sys
from collections import defaultdict

path, log = sys.argv[1], sys.argv[2]
loop = {}
for line in open(log, errors="replace"):
    if line.startswith("gpu_train_loop:"):
        loop = json.loads(line.split(":", 1)[1])
try:
    from torchdoctor import open_recording
except ImportError as exc:
    raise SystemExit(f"no recording reader here ({exc})")
rec = open_recording(path)
gpus = rec.meta.get("gpus") or {}
print("NVML status:", {k: v for k, v in gpus.items() if k != "gpus"})
for g in gpus.get("gpus") or []:
    print("  device:", g)
rows = rec.rows("gpu_samples")
print(f"{len(rows)} GPU samples")
by_dev = defaultdict(list)
for r in rows:
    by_dev[r["index"]].append(r)

def span(values):
    vals = [v for v in values if v is not None]
    return f"{min(vals):.1f}..{max(vals):.1f}" if vals else "none"

for index, rs in sorted(by_dev.items()):
    gib = [r["memory_used"] / 2**30 if r["memory_used"] is not None else None for r in rs]
    reasons = sorted({x for r in rs for x in (r["clock_event_reasons"] or [])})
    missing = {k: v for r in rs for k, v in (r["unavailable"] or {}).items()}
    print(f"GPU {index}: util% {span(r['utilization_gpu'] for r in rs)}, "
          f"mem-bus% {span(r['utilization_memory'] for r in rs)}, used GiB {span(gib)}, "
          f"power W {span(r['power_w'] for r in rs)}, temp C {span(r['temperature_c'] for r in rs)}, "
          f"SM MHz {span(r['sm_clock_mhz'] for r in rs)}, "
          f"PCIe rx MB/s {span((r['pcie_rx_per_s'] or 0) / 1e6 for r in rs)}, "
          f"tx MB/s {span((r['pcie_tx_per_s'] or 0) / 1e6 for r in rs)}")
    print(f"   clock-event reasons seen: {reasons}; unavailable: {missing or 'nothing'}")
peak = defaultdict(int)
for r in rec.rows("gpu_process_samples"):
    if r["used_memory"] is not None:
        peak[(r["pid"], r["in_job"])] = max(peak[(r["pid"], r["in_job"])], r["used_memory"])
for (pid, in_job), used in sorted(peak.items()):
    print(f"GPU process {pid} ({'job' if in_job else 'outside the job'}): peak {used / 2**20:.0f} MiB")
roles = {p["pid"]: p["role"] for p in rec.processes()}
job_peak = defaultdict(int)
for r in rec.rows("process_samples", columns=["pid", "gpu_memory"]):
    if r["gpu_memory"] is not None:
        job_peak[r["pid"]] = max(job_peak[r["pid"]], r["gpu_memory"])
for pid, used in sorted(job_peak.items()):
    print(f"job process {pid} ({roles.get(pid)}): peak GPU memory {used / 2**20:.0f} MiB")
if loop:
    print(f"loop said: pid {loop['pid']}, {loop['steps']} steps on {loop['device']}, torch "
          f"reserved {loop['torch_memory_reserved'] / 2**20:.0f} MiB (NVML adds the CUDA "
          f"context, a few hundred MiB)")
    nvml = job_peak.get(loop["pid"])
    if not nvml or nvml < loop["torch_memory_reserved"]:
        raise SystemExit(f"NVML memory of the trainer ({nvml}) below what torch reserved")
EOF
fi

if [ "$CUDA" = 1 ]; then
step "instrumentation's CUDA path: per-step memory figures"
timeout 60 "$PY" - "$REC" "$OUT/train.log" <<'EOF' || fail "per-step CUDA figures"
import json, sys
from torchdoctor import open_recording

path, log = sys.argv[1], sys.argv[2]
loop = {}
for line in open(log, errors="replace"):
    if line.startswith("gpu_train_loop:"):
        loop = json.loads(line.split(":", 1)[1])
rec = open_recording(path)
steps = [s for s in rec.steps() if s["pid"] == loop.get("pid")]
cols = ("cuda_allocated", "cuda_reserved", "cuda_max_allocated", "cuda_alloc_retries", "cuda_ooms")
filled = {c: sum(1 for s in steps if s[c] is not None) for c in cols}
print(f"{len(steps)} steps of the trainer; steps with each CUDA figure: {filled}")
events = [e["kind"] for e in rec.rows("events")]
print("events:", sorted(set(events)))
if not steps or min(filled.values()) < len(steps) // 2:
    raise SystemExit("the agent recorded no CUDA memory figures for most steps")
peak = max(s["cuda_max_allocated"] for s in steps if s["cuda_max_allocated"] is not None)
reserved = max(s["cuda_reserved"] for s in steps if s["cuda_reserved"] is not None)
print(f"recorded peak allocated {peak / 2**20:.1f} MiB, reserved {reserved / 2**20:.1f} MiB; "
      f"the loop's torch said reserved {loop.get('torch_memory_reserved', 0) / 2**20:.1f} MiB")
if loop and reserved > loop["torch_memory_reserved"] * 1.01 + 2**21:
    raise SystemExit("recorded reserved memory above what torch itself reported at the end")
if "cuda-oom-observer-unavailable" in events:
    raise SystemExit("the OOM observer could not be attached")
EOF

step "a provoked CUDA out-of-memory under torchdoctor run"
OOM="$OUT/gpu-oom.sqlite"
rm -f "$OOM"
timeout 120 "$PY" -m torchdoctor run --quiet --out "$OOM" -- "$PY" -c '
import sys, torch
model = torch.nn.Linear(1024, 1024).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    opt.zero_grad(); model(torch.randn(64, 1024, device="cuda")).sum().backward(); opt.step()
free, total = torch.cuda.mem_get_info()
try:
    torch.empty(int(total * 2), dtype=torch.uint8, device="cuda")
except torch.cuda.OutOfMemoryError as exc:
    print("provoked:", str(exc).splitlines()[0][:120])
    sys.exit(3)
'
code=$?
echo "job exit status under torchdoctor run: $code (the job exits 3)"
[ "$code" = 3 ] || fail "the job's exit status was not kept through an OOM"
timeout 60 "$PY" - "$OOM" <<'EOF' || fail "OOM recorded"
import json, sys
from torchdoctor import open_recording
rec = open_recording(sys.argv[1])
ooms = [e for e in rec.rows("events") if e["kind"] == "cuda-oom"]
print(f"cuda-oom events: {len(ooms)}", [json.loads(e["detail"]) for e in ooms][:2])
if not ooms:
    raise SystemExit("no cuda-oom event recorded")
EOF
fi

if [ "$CUDA" = 1 ]; then
step "an activations OOM under torchdoctor run --memory-history: the cuda-oom finding, and its fix run"
# An MLP fed by a DataLoader (so the batch size is recorded) whose batch is sized from the GPU
# to need ~1.5x its memory in activations: it dies of CUDA OOM in its first big step. The
# finding must say activations and give micro-batch x accumulation = the batch; that fix must
# then run on this GPU within the best range (85 %).
cat > "$OUT/oom_train.py" <<'PYEOF'
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
WIDTH, DEPTH = 4096, 8
total = torch.cuda.get_device_properties(0).total_memory
per_sample = 2 * DEPTH * WIDTH * 4  # a Linear's input and a ReLU's output kept per layer
big = int(total * 1.5 / per_sample) // 64 * 64
micro, accum = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (big, 1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(1000, WIDTH), *[
    m for _ in range(DEPTH) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())]).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
def train(batch, accum, steps):
    data = DataLoader(TensorDataset(torch.randint(0, 1000, (batch * accum * steps,))),
                      batch_size=batch)
    for i, (idx,) in enumerate(data):
        model(idx.cuda()).float().pow(2).mean().backward()
        if (i + 1) % accum == 0:
            opt.step(); opt.zero_grad(set_to_none=True)
train(64, 1, 2)  # small steps first: per-step memory is recorded
torch.cuda.reset_peak_memory_stats()
train(micro, accum, 1)
print(f"oom_train: batch {micro} x {accum} ran, peak "
      f"{torch.cuda.max_memory_reserved() / total * 100:.1f} % of the GPU")
PYEOF
OOMA="$OUT/gpu-oom-activations.sqlite"
rm -f "$OOMA" "$OUT"/gpu-oom-activations.cuda-oom-*.pickle "$OUT/oom-fix.txt"
timeout 180 "$PY" -m torchdoctor run --quiet --memory-history --out "$OOMA" -- \
  "$PY" "$OUT/oom_train.py"
code=$?
echo "job exit status under torchdoctor run: $code (an uncaught OOM: 1)"
[ "$code" = 1 ] || fail "the OOM job's exit status was not kept"
timeout 120 "$PY" - "$OOMA" "$OUT" > "$OUT/oom-fix.txt" <<'PYEOF' || fail "cuda-oom finding"
import glob, json, sys
from torchdoctor import open_recording
from torchdoctor.diagnosis.engine import diagnose
rec = open_recording(sys.argv[1])
ooms = [json.loads(e["detail"]) for e in rec.rows("events") if e["kind"] == "cuda-oom"]
print("cuda-oom event:", ooms[-1] if ooms else None, file=sys.stderr)
(f,) = [f for f in diagnose(rec) if f.id == "cuda-oom"]
print(f"{f.title}\n  {f.recommendation}\n  settings {f.settings}", file=sys.stderr)
assert "activations" in f.title, f.title
micro, accum = f.settings["batch_size"], f.settings["gradient_accumulation_steps"]
assert micro * accum == ooms[-1]["batch_size"], (micro, accum)
snaps = glob.glob(f"{sys.argv[2]}/gpu-oom-activations.cuda-oom-*.pickle")
assert snaps, "no memory snapshot written"
with open(snaps[0], "rb") as fh:
    assert fh.read(2) == b"\x80\x04", "snapshot not pickled with protocol 4"
print(micro, accum)
PYEOF
if [ -s "$OUT/oom-fix.txt" ]; then
  read -r MICRO ACCUM < "$OUT/oom-fix.txt"
  timeout 180 "$PY" "$OUT/oom_train.py" "$MICRO" "$ACCUM" | tee "$OUT/oom-fix-run.log" \
    || fail "the cuda-oom fix (batch $MICRO x $ACCUM) did not run on this GPU"
  "$PY" -c 'import re, sys; t = open(sys.argv[1]).read(); sys.exit(float(re.search(r"peak ([0-9.]+) %", t)[1]) > 85)' \
    "$OUT/oom-fix-run.log" || fail "the cuda-oom fix ran above 85 % of the GPU"
fi
fi

if [ "$CUDA" = 1 ]; then
step "a CUDA profile window: run --profile-steps 5-7 on a loop that syncs every step"
# A real CUDA window (issue 42): the trace must hold GPU kernels, the recording's per-step
# breakdown GPU busy/idle, and diagnose must name the loss.item() line (sync-points) with its
# cost; a fp32 matmul-heavy step on a tensor-core GPU may add op-bound (AMP/TF32).
cat > "$OUT/profile_train.py" <<'PYEOF'
import torch
torch.backends.cuda.matmul.allow_tf32 = False
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(512, 2048, device="cuda")
for step in range(40):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.4f}")  # line 11: a host-device sync every step
PYEOF
timeout 300 "$PY" -m torchdoctor run --quiet --profile-steps 5-7 --out "$OUT/profile.sqlite" \
    -- "$PY" "$OUT/profile_train.py" > /dev/null || fail "run --profile-steps on CUDA"
ls -la "$OUT"/profile.profile/ 2>&1
timeout 120 "$PY" -m torchdoctor show "$OUT/profile.sqlite" 2>&1 | tee "$OUT/profile-show.txt"
timeout 120 "$PY" -m torchdoctor diagnose "$OUT/profile.sqlite" 2>&1 | tee "$OUT/profile-diagnose.txt"
grep -q "sync-points" "$OUT/profile-diagnose.txt" && grep -q "profile_train.py:11" "$OUT/profile-diagnose.txt" \
  || fail "sync-points did not name profile_train.py:11 on the CUDA window"
fi

if [ "$CUDA" = 1 ]; then
step "CUDA memory at the peak: run --memory-history, a snapshot at the end and one at an OOM"
# Issue 42: a real snapshot (torch's own, not one shaped like it) read by torchdoctor. The end
# snapshot's peak must name the line that makes the activations; the OOM's (a tensor far larger
# than the GPU, asked at line 6) must give the request that failed.
cat > "$OUT/memory_train.py" <<'PYEOF'
import sys, torch
model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
for step in range(10):
    if step == 5 and sys.argv[1:] == ["oom"]:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # line 6: more than any GPU
    x = torch.randn(16384, 4096, device="cuda")  # line 7: 2 GiB of activations per step
    model(x).square().mean().backward()  # line 8: the activations
    opt.step()
    opt.zero_grad()
PYEOF
for mode in end oom; do
  timeout 300 "$PY" -m torchdoctor run --quiet --memory-history --out "$OUT/memory-$mode.sqlite" \
      -- "$PY" "$OUT/memory_train.py" "$mode" > /dev/null
  ls -la "$OUT"/memory-$mode.cuda-*.pickle 2>&1
  timeout 300 "$PY" -m torchdoctor show "$OUT/memory-$mode.sqlite" 2>&1 | tee "$OUT/memory-$mode-show.txt"
  timeout 300 "$PY" -m torchdoctor diagnose "$OUT/memory-$mode.sqlite" > "$OUT/memory-$mode-diagnose.txt" 2>&1
done
grep -q "snapshot at its end).*memory_train.py:8" "$OUT/memory-end-show.txt" \
  || fail "the end snapshot's peak did not name memory_train.py:8"
grep -q "snapshot at the OOM).*failed request 1.00 PiB" "$OUT/memory-oom-show.txt" \
  || fail "the OOM snapshot did not give the 1 PiB request"
fi

if [ -f benchmarks/estimate_cuda_check.py ] && [ "$CUDA" = 1 ]; then
  step "estimate_cuda_check.py"
  timeout 200 "$PY" benchmarks/estimate_cuda_check.py 2>&1 | tee "$OUT/estimate.log" \
    || fail "estimate_cuda_check"
fi

if [ -n "${GPU_CHECK_TESTS:-}" ]; then
  step "the GPU-touching test modules, on this GPU"
  timeout 420 "$PY" -m pytest -q -x -p no:cacheprovider tests/sampling tests/cli/test_run.py \
    tests/recording tests/top/test_cli_top.py tests/instrument/test_jobs.py 2>&1 \
    | tee "$OUT/tests.log" | tail -15 || fail "tests on the GPU machine"
fi

step "torchdoctor doctor on the real NVML"
# Exit 1 only means some check found an error on this machine; 2+ is a crash.
timeout 120 "$PY" -m torchdoctor doctor --json > "$OUT/doctor.json"
DOCTOR_RC=$?
if [ "$DOCTOR_RC" -le 1 ]; then
  "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); [print(f\"{c['status']:8} {c['name']:28} {c['saw']}\") for c in d['checks']]" "$OUT/doctor.json"
else
  fail "torchdoctor doctor (exit status $DOCTOR_RC)"
fi

if [ "$CUDA" = 1 ]; then
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "${NGPU:-0}" -ge 2 ]; then
    step "NCCL sweep: torchdoctor bench allreduce over $NGPU GPUs"
    timeout 300 "$PY" -m torchdoctor bench allreduce --backend nccl --nproc "$NGPU" \
        --sizes 8K:256M --iters 20 --warmup 5 2>&1 | tee "$OUT/bench-nccl.txt" \
      || fail "bench allreduce --backend nccl"
  else
    step "NCCL sweep skipped: $NGPU GPU(s), NCCL needs one GPU per rank and two ranks"
    timeout 120 "$PY" -m torchdoctor doctor --bench --only bench 2>&1 | tee "$OUT/doctor-bench.txt" \
      || fail "doctor --bench"
  fi
fi

step "done: $FAILED failed step(s); files in $OUT"
exit "$FAILED"
