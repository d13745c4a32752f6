"""``torchdoctor estimate``: will a training step fit, and the largest batch that does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from torchdoctor.cli.common import python_option, run_in_job_python
from torchdoctor.cli.force import force_option
from torchdoctor.cli.json_output import user_output_to_stderr, versioned
from torchdoctor.cli.recordings import RECORDING
from torchdoctor.errors import ParameterError, UserError
from torchdoctor.estimate.loops import LOOPS
from torchdoctor.estimate.profiles import PROFILES
from torchdoctor.estimate.setup import OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS
from torchdoctor.output_files import check_output_file
from torchdoctor.units import fmt_bytes

# The library's errors name its Python parameters; the CLI words them as its flags.
FLAGS = {
    "batch_size": "--batch",
    "input_shape": "--input",
    "tokens": "--tokens",
    "optimizer_impl": "--optimizer-impl",
    "grad_accumulation": "--grad-accumulation",
    "inference": "--inference",
    "checkpointing": "--checkpointing",
    "loop": "--loop",
    "device": "--device",
    "gpu": "--gpu",
    "gpu_memory": "--gpu-memory",
    "margin": "--margin",
    "fallback": "--no-fallback",
    "memory_snapshot": "--memory-snapshot",
    "factory_timeout": "--timeout",
    "max_batch()": "--max-batch",
}


def _factory_timeout(text: str) -> float | None:
    """--timeout's seconds (None for 0: a factory that may take as long as it takes)."""
    from torchdoctor.units import parse_duration

    seconds = parse_duration(text, "--timeout", examples="600, 600s, 10m or 0 (no bound)")
    return None if seconds == 0 else seconds


# A loop differing by more than this fraction of the peak is shown next to the estimate.
SHOWN_LOOP_CHANGE = 0.01

_EPILOG = (
    """\b
SPEC names the model:
  file.py:factory          a function returning a model, (model, make_batch) or
                           (model, make_batch, loss); make_batch(n) -> (inputs, target)
  package.module:factory   the same, imported
  torchvision:NAME         e.g. torchvision:resnet50 (when torchvision imports)
  hf:MODEL_TYPE            e.g. hf:gpt2, built from its config (transformers; no weights)
\b
LOOP is the training loop whose memory is estimated:
  hand-written   out = model(x); loss = loss_fn(out, y): the output lives through backward
                 and optimizer.step until the next forward returns (the default)
  frees-output   loss_fn(model(x), y).backward(), or del out before backward
  hf-trainer     transformers.Trainer (the default for hf: specs, and for a file that uses it)
  lightning      Lightning's automatic optimization (training_step of a LightningModule; the
                 default for a file that uses Lightning)
\b
GPUs: """
    + ", ".join(PROFILES)
    + """ (or --gpu-memory 24GiB)
\b
Examples:
  torchdoctor estimate models.py:make --input 3x224x224 --batch 64
  torchdoctor estimate models.py:gpt --tokens 1024 --batch 8 --gpu A100-80GB
  torchdoctor estimate models.py:gpt --tokens 1024 --gpu H100-80GB --max-batch
  torchdoctor estimate --from last models.py:gpt --tokens 1024   (a recorded run, its GPU,
                           and the cuda-oom fix checked)
"""
)


@click.command(
    "estimate",
    epilog=_EPILOG,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.argument("spec")
@click.option("--batch", "batch_size", type=int, default=1, show_default=True, help="Batch size.")
@click.option(
    "--input",
    "input_shape",
    metavar="SHAPE",
    help="One sample's shape, e.g. 3x224x224 (float inputs).",
)
@click.option(
    "--tokens",
    type=int,
    metavar="SEQ",
    help="Sequence length of token-id inputs (vocab from the model).",
)
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adamw", show_default=True)
@click.option(
    "--optimizer-impl",
    type=click.Choice(OPTIMIZER_IMPLS),
    default="auto",
    show_default=True,
    help="auto: what torch picks on the target (foreach on CUDA, for-loop on the CPU).",
)
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@click.option(
    "--grad-accumulation",
    type=int,
    default=1,
    show_default=True,
    metavar="K",
    help="Micro-batches per optimizer step.",
)
@click.option(
    "--inference", is_flag=True, help="One forward pass under no_grad instead of training."
)
@click.option(
    "--checkpointing", is_flag=True, help="Wrap the repeated blocks in activation checkpointing."
)
@click.option(
    "--loop",
    type=click.Choice(list(LOOPS)),
    help=(
        "The training loop whose memory to estimate (below) "
        "[the one the spec's file uses, else hand-written]."
    ),
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    help="Target device [cuda when --gpu/--gpu-memory is given, else cpu].",
)
@click.option(
    "--gpu", metavar="NAME", help="GPU profile, e.g. A100-80GB, H100-80GB, L4, T4, RTX 4090."
)
@click.option(
    "--gpu-memory",
    metavar="SIZE",
    help="Target memory instead of a profile, e.g. 24G (= 24GiB; 24GB is 24 x 10^9 bytes).",
)
@click.option(
    "--margin",
    type=float,
    default=0.05,
    show_default=True,
    help="Fraction of the memory kept free when deciding what fits.",
)
@click.option(
    "--max-batch", "find_max", is_flag=True, help="Find the largest batch that fits the target."
)
@click.option(
    "--no-fallback",
    is_flag=True,
    help="Never fall back to a real CPU run when fake tensors cannot trace the model.",
)
@click.option(
    "--memory-snapshot",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Write the step's allocations as a pickle to open at https://pytorch.org/memory_viz.",
)
@force_option("the --memory-snapshot file")
@click.option(
    "--from",
    "recording",
    type=RECORDING,
    metavar="RECORDING",
    help="Re-estimate a recorded run (`last`: the newest) on its recorded GPU, with its batch, "
    "precision and optimizer (options given here win), and the cuda-oom finding's fix.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the result as JSON (schema in the README)."
)
@click.option(
    "--timeout",
    "factory_timeout",
    metavar="TIME",
    default="600s",
    show_default=True,
    callback=lambda ctx, param, value: _factory_timeout(value),
    help="How long importing SPEC's file, and each call of its factory, may take before one "
    "line says it did not return (0: no bound). A line on a terminal says it is waited for.",
)
@python_option
@click.option("--quiet", is_flag=True, help="No progress line on stderr (--max-batch).")
def command(
    spec: str,
    batch_size: int,
    find_max: bool,
    no_fallback: bool,
    memory_snapshot: str | None,
    force: bool,
    recording: Path | None,
    as_json: bool,
    quiet: bool,
    **options: Any,
) -> None:
    """Estimate the GPU (or CPU) memory of a training step, without a GPU.

    Two training steps are traced under fake tensors on the CPU, storage by storage; for a CUDA
    target the attention kernels, dropout masks, autocast lists, optimizer implementation and
    the caching allocator of CUDA are modelled on top.
    """
    run_in_job_python(options.pop("python"))
    # The other options (--input, --gpu, --margin, ...) are api.prepare's, under its names.
    options["fallback"] = not no_fallback
    if find_max:
        if batch_size != 1:
            raise UserError("--max-batch searches the batch size: leave out --batch")
        if memory_snapshot:
            raise UserError("--memory-snapshot describes one step: use it without --max-batch")
    if recording is not None and (find_max or memory_snapshot):
        raise UserError(
            "--from checks the recorded step and its fix: leave out --max-batch and "
            "--memory-snapshot"
        )
    if memory_snapshot:  # refused now, not after the model is traced
        check_output_file(memory_snapshot, "--memory-snapshot", force=force)
    try:
        # Model code runs here (imports, constructors, forwards): under --json its prints
        # go to stderr, so that stdout is the JSON alone.
        with user_output_to_stderr(as_json):
            if recording is not None:
                options["batch_size"] = batch_size
                text = _run_from(spec, recording, options, _given(), as_json)
            else:
                text = _run(
                    spec, batch_size, find_max, memory_snapshot, as_json, options, quiet, force
                )
    except ParameterError as exc:
        raise exc.worded(FLAGS) from None
    click.echo(text)


def _given() -> set[str]:
    """The parameters the user typed (or set in the environment), not left at their default."""
    ctx = click.get_current_context()
    defaults = (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
    return {name for name in ctx.params if ctx.get_parameter_source(name) not in defaults}


def _run(
    spec: str,
    batch_size: int,
    find_max: bool,
    memory_snapshot: str | None,
    as_json: bool,
    options: dict[str, Any],
    quiet: bool = False,
    force: bool = False,
) -> str:
    """The estimate (or the batch search) as the text or JSON to print."""
    from torchdoctor.estimate import api
    from torchdoctor.estimate.fitcheck import other_loops

    if find_max:
        from torchdoctor.cli.progress import Steps

        with Steps("probing batch sizes", quiet=quiet) as steps:

            def on_probe(batch: int, size: int, fits: bool) -> None:
                steps.advance(f"batch {batch}: {fmt_bytes(size)} {'fits' if fits else 'too big'}")

            found = api.max_batch(spec, on_probe=on_probe, **options)
        if as_json:
            return json.dumps(versioned("estimate-max-batch", found.to_dict()), indent=2)
        return render_max_batch(found)
    check, setup = api.prepare(spec, batch_size=batch_size, **options)
    result = check.estimate(setup, memory_snapshot, replace_snapshot=force)
    if not setup.inference:
        result.other_loops = other_loops(check, setup, result)
    # Only a step that does not fit a given memory asks what would.
    found_alternatives = api.alternatives(check, setup) if result.fits is False else []
    if as_json:
        data = result.to_dict()
        data["alternatives"] = [a.to_dict() for a in found_alternatives]
        return json.dumps(versioned("estimate", data), indent=2)
    text = render_estimate(result)
    if found_alternatives:
        text += "\n" + render_alternatives(found_alternatives, result)
    return text


# Where each figure of a --from estimate came from.
FROM_RECORDING, FROM_COMMAND_LINE, FROM_DEFAULT = "recording", "command line", "default"
RECORDED_OPTIONS = ("batch_size", "precision", "optimizer", "optimizer_impl")
# The cuda-oom fixes the estimator does not model, by the finding's setting that names them.
NOT_MODELLED = {
    "optimizer": "an 8-bit optimizer state (bitsandbytes) is not modelled by the estimator",
    "env.PYTORCH_CUDA_ALLOC_CONF": (
        "expandable segments change the allocator's layout, which the estimator does not model"
    ),
}


def _run_from(
    spec: str, path: Path, options: dict[str, Any], given: set[str], as_json: bool
) -> str:
    """Re-estimate the recorded step on the recorded GPU, and the cuda-oom finding's fix."""
    from torchdoctor.diagnosis.engine import diagnose
    from torchdoctor.diagnosis.rules import cuda_oom
    from torchdoctor.estimate import api
    from torchdoctor.estimate.recorded import read_recorded_step
    from torchdoctor.recording.reader import open_recording
    from torchdoctor.thresholds import load_thresholds

    with open_recording(path) as rec:
        recorded = read_recorded_step(rec)
        finding = next((f for f in diagnose(rec, load_thresholds()) if f.id == cuda_oom.ID), None)
    sources: dict[str, str] = {}
    if given & {"gpu", "gpu_memory"}:
        sources["gpu"] = FROM_COMMAND_LINE
    elif recorded.gpu is None:
        raise UserError(
            f"{path} has no GPU information (no NVIDIA GPU was visible to the recording): "
            "give the target with --gpu or --gpu-memory"
        )
    else:
        options["gpu"] = recorded.gpu
        sources["gpu"] = FROM_RECORDING
    for name in RECORDED_OPTIONS:
        value = getattr(recorded, name)
        if name in given:
            sources[name] = FROM_COMMAND_LINE
        elif value is not None:
            options[name] = value
            sources[name] = FROM_RECORDING
        else:
            sources[name] = FROM_DEFAULT
    check, setup = api.prepare(spec, **options)
    checks: list[tuple[str, str, Any]] = [
        ("recorded", f"the recorded step (batch {setup.batch_size})", setup)
    ]
    fix = finding.settings if finding else {}
    if fix.get("batch_size"):
        micro, k = int(fix["batch_size"]), int(fix.get("gradient_accumulation_steps") or 1)
        checks.append(
            (
                "fix",
                f"cuda-oom fix: micro-batches of {micro} accumulated over {k}",
                setup.with_(batch_size=micro, grad_accumulation=setup.grad_accumulation * k),
            )
        )
    offered = finding is not None and cuda_oom.BF16_ALTERNATIVE in finding.recommendation
    if offered and setup.precision == "fp32":
        checks.append(
            (
                "alternative",
                f"cuda-oom alternative: bf16 autocast at batch {setup.batch_size}",
                setup.with_(precision="bf16-mixed"),
            )
        )
    not_checked = [why for key, why in NOT_MODELLED.items() if key in fix]
    results = [(kind, label, check.estimate(changed)) for kind, label, changed in checks]
    notes = list(recorded.notes)
    first = results[0][2]
    if recorded.oom is not None and first.fits:
        notes.append(
            "the estimator fits the recorded step, yet the job ran out of memory: something "
            "outside this step held memory (another process, a larger batch or sequence)"
        )
    if as_json:
        return json.dumps(
            versioned(
                "estimate-from",
                _from_document(path, first, sources, finding, results, not_checked, notes),
            ),
            indent=2,
        )
    return render_from(path, first, sources, finding, results, not_checked, notes)


def _from_document(path, first, sources, finding, results, not_checked, notes) -> dict[str, Any]:
    from torchdoctor.estimate.result import JSON_VERSION

    gpu = first.target.gpu
    return {
        "version": JSON_VERSION,
        "recording": str(path),
        "model": first.model,
        "gpu": {
            "name": gpu.name if gpu else None,
            "memory_bytes": first.gpu_memory,
            "compute_capability": ".".join(map(str, gpu.compute_capability)) if gpu else None,
        },
        "sources": sources,
        "cuda_oom": (
            {"title": finding.title, "settings": dict(finding.settings)} if finding else None
        ),
        "sized_by": "estimator",
        "checks": [
            {
                "kind": kind,
                "change": label,
                "setup": result.to_dict()["setup"],
                "fits": result.fits,
                "total_bytes": result.headline_bytes,
                "peak_allocated_bytes": result.peak_allocated,
                "peak_reserved_bytes": result.peak_reserved,
                "gpu_memory_bytes": result.gpu_memory,
                "margin": result.margin,
                "estimate": result.to_dict(),
            }
            for kind, label, result in results
        ],
        "not_checked": not_checked,
        "notes": notes,
    }


def render_from(path, first, sources, finding, results, not_checked, notes) -> str:
    """The recorded step and the cuda-oom fix, re-estimated, as the terminal shows them."""
    setup = first.setup
    said = {
        "batch_size": f"batch {setup.batch_size}",
        "precision": setup.precision,
        "optimizer": setup.optimizer,
        "optimizer_impl": f"{setup.optimizer_impl} implementation",
    }
    set_up = ", ".join(f"{said[name]} ({sources[name]})" for name in RECORDED_OPTIONS)
    lines = [
        f"{first.model}: the recorded loop of {path} re-estimated",
        f"  GPU       {_target_line(first)}, from the {sources['gpu']}",
        f"  set-up    {set_up}",
        "  cuda-oom  "
        + (finding.title if finding else "none in this recording: the recorded step only"),
        "",
        f"  figures from the estimator ({first.method}), keeping {first.margin:.0%} free:",
    ]
    width = max(len(label) for _kind, label, _result in results)
    for _kind, label, result in results:
        verdict = "fits" if result.fits else "does NOT fit"
        lines.append(
            f"    {label:<{width}}  peak {fmt_bytes(result.headline_bytes):>9} of "
            f"{fmt_bytes(result.gpu_memory)}  {verdict}"
        )
    lines += [f"  not checked: {why}" for why in not_checked]
    if notes:
        lines.append("")
        lines += [f"  note: {note}" for note in notes]
    return "\n".join(lines)


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:,.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:,.1f} M"
    return f"{n:,}"


def _target_line(result: Any) -> str:
    gpu = result.target.gpu
    if gpu is None:
        return "CPU"
    cc = ".".join(map(str, gpu.compute_capability))
    return f"{gpu.name} ({fmt_bytes(gpu.memory_bytes)}, sm{cc.replace('.', '')})"


def render_estimate(result: Any) -> str:
    """The estimate as the terminal shows it."""
    lines = [
        f"{result.model}: {result.setup.describe()} on {_target_line(result)}",
        f"{_count(result.parameter_count)} parameters; {result.method} in {result.seconds:.1f} s",
        "",
    ]
    if result.total is not None:
        lines += [
            f"  peak allocated  {fmt_bytes(result.peak_allocated):>11}   torch.cuda.max_memory_allocated()",
            f"  peak reserved   {fmt_bytes(result.peak_reserved):>11}   torch.cuda.max_memory_reserved()",
            f"  nvidia-smi      {fmt_bytes(result.total):>11}   reserved + CUDA context",
        ]
    else:
        lines.append(
            f"  peak memory     {fmt_bytes(result.peak_allocated):>11}   live tensor bytes on the CPU"
        )
    if result.fits is not None:
        verdict = "fits" if result.fits else "does NOT fit"
        lines.append(
            f"  {verdict} in {fmt_bytes(result.gpu_memory)} keeping {result.margin:.0%} free"
        )
    lines += render_loop(result)
    total = result.headline_bytes or 1
    lines += ["", f"  at the peak (step {result.peak_step + 1}, {result.peak_phase}):"]
    for name, value in result.breakdown.items():
        if value:
            lines.append(f"    {name:<20} {fmt_bytes(value):>11}  {value / total:6.1%}")
    if result.top_modules:
        lines += ["", "  activation memory by module (last forward pass, saved for backward):"]
        for module in result.top_modules:
            label = f"{module.module} ({module.type})" if module.type else module.module
            if module.count > 1:
                label += f" x{module.count}"
            lines.append(f"    {label:<52} {fmt_bytes(module.bytes):>11}")
    base = result.baselines
    naive = "naive formula: 4 B x params" + (
        "" if result.setup.inference else " x 2 x optimizer factor"
    )
    lines += [
        "",
        "  what rules of thumb say (no activations):",
        f"    {naive:<52} {fmt_bytes(base.naive_formula_bytes):>11}",
        f"    {'parameters only, like accelerate estimate-memory':<52} {fmt_bytes(base.params_only_bytes):>11}",
    ]
    if result.notes:
        lines.append("")
        lines += [f"  note: {note}" for note in result.notes]
    return "\n".join(lines)


def render_loop(result: Any) -> list[str]:
    """The loop assumed, and the other loops that change the peak by more than 1 %."""
    if result.setup.inference:
        return []
    loop = LOOPS[result.setup.loop]
    lines = ["", f"  loop: {loop.name}, which {loop.summary}"]
    if result.loop_reason:
        lines.append(f"    ({result.loop_reason})")
    base = result.headline_bytes or 1
    shown = [o for o in result.other_loops if abs(o.change) > SHOWN_LOOP_CHANGE * base]
    for other in shown:
        sign = "+" if other.change > 0 else "-"
        lines.append(
            f"    with --loop {other.loop:<13} {fmt_bytes(other.bytes):>11}  "
            f"({sign}{fmt_bytes(abs(other.change))}, {other.change / base:+.1%})"
        )
    if result.other_loops and not shown:
        names = ", ".join(o.loop for o in result.other_loops)
        lines.append(f"    the same peak within 1 % with --loop {names}")
    return lines


def render_alternatives(found: list[Any], result: Any) -> str:
    lines = ["", "  what would make it fit (each re-estimated):"]
    width = max((len(alt.change) for alt in found), default=0)
    for alt in found:
        verdict = "fits" if alt.estimate.fits else "does not fit"
        lines.append(
            f"    {alt.change:<{width}}  {fmt_bytes(alt.estimate.headline_bytes):>9}  {verdict}"
        )
    return "\n".join(lines)


def render_max_batch(found: Any) -> str:
    searched = ", ".join(
        f"{b} ({fmt_bytes(n)}{'' if fits else ', too big'})" for b, n, fits in found.probes
    )
    first = found.estimate
    margin = f"keeping {first.margin:.0%} free" if first else ""
    if found.batch_size == 0:
        head = [
            f"not even batch 1 fits {fmt_bytes(found.capacity)} {margin}: "
            f"it needs {fmt_bytes(first.headline_bytes)}",
        ]
        body = render_estimate(first)
        return "\n".join(head + ["", body, render_alternatives(found.alternatives, first)])
    head = [
        f"largest batch that fits {fmt_bytes(found.capacity)} {margin}: {found.batch_size} "
        f"({fmt_bytes(first.headline_bytes)})",
        f"searched {len(found.probes)} simulated steps in {found.seconds:.1f} s: {searched}",
        "",
    ]
    return "\n".join(head) + render_estimate(first)
