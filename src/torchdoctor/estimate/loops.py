"""The training loops an estimate can assume: what each one keeps alive, and when.

The peak of a step depends on the loop as much as on the model: a hand-written loop that keeps
``out = model(x)`` (or nanoGPT's ``logits, loss = model(X, Y)``) holds the whole output through
``backward()`` and ``optimizer.step()``; Hugging Face's Trainer drops it inside
``compute_loss``; Lightning zeroes the gradients after ``training_step``, so the last step's
gradients live through the next forward. Each loop here is what the installed frameworks do,
read from their source (transformers 5.x ``Trainer.training_step``/``compute_loss``/
``_inner_training_loop``, Lightning 2.x ``loops/optimization/automatic.py``):

- ``hand-written``: ``out = model(x); loss = loss_fn(out, y); loss.backward(); opt.step();
  opt.zero_grad()``. ``out`` and ``loss`` stay referenced until the next forward returns and
  the name is rebound. The default.
- ``frees-output``: ``loss_fn(model(x), y).backward()`` (or ``del out`` before backward): the
  output is gone before backward.
- ``hf-trainer``: ``compute_loss`` calls ``model(**inputs)`` and returns only the loss, so the
  outputs die before ``accelerator.backward(loss)``; ``get_batch_samples`` fetches every
  micro-batch of an optimizer step before the first forward and accelerate's
  ``DataLoaderShard`` iterates one batch ahead; gradients are clipped to ``max_grad_norm``
  before ``optimizer.step()``; ``model.zero_grad()`` (set to None) after it; the default
  optimizer is TrainingArguments' (``adamw_torch_fused`` on torch >= 2.8), and
  ``Trainer.__init__`` sets ``model.config.use_cache`` to ``args.use_cache`` (False: no KV
  cache copies in the forward).
- ``lightning``: automatic optimization runs ``training_step`` (whose locals, the output
  included, die when it returns), then ``optimizer_zero_grad`` (set to None), then backward,
  inside the closure given to ``optimizer.step``; the loss is divided by
  ``accumulate_grad_batches`` (always, 1 included); zero_grad only on the first micro-batch of
  an accumulation. A sized DataLoader is not prefetched. A ``LightningModule``'s own
  ``training_step(batch, batch_idx)`` is its forward and loss.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from torchdoctor.errors import UserError

HAND_WRITTEN = "hand-written"
FREES_OUTPUT = "frees-output"
HF_TRAINER = "hf-trainer"
LIGHTNING = "lightning"


@dataclass(frozen=True)
class Loop:
    """How a training loop holds and releases memory around one step."""

    name: str
    summary: str  # what the loop keeps, in the words the output uses
    holds_output: bool  # the forward's result lives until the next forward returns
    zero_grad_after_forward: bool  # Lightning: the last step's gradients live through forward
    batches_ahead: int  # batches the data loader holds besides the ones in use
    fetches_micro_batches: bool  # every micro-batch of an optimizer step is fetched up front
    clips_gradients: bool  # clip_grad_norm_ before optimizer.step()
    framework_optimizer: bool  # optimizer implementation "auto" means the framework's default
    divides_loss_always: bool  # loss / accumulation steps even when that is 1


LOOPS: dict[str, Loop] = {
    HAND_WRITTEN: Loop(
        HAND_WRITTEN,
        "keeps the model's output through backward and optimizer.step (out = model(x))",
        holds_output=True,
        zero_grad_after_forward=False,
        batches_ahead=0,
        fetches_micro_batches=False,
        clips_gradients=False,
        framework_optimizer=False,
        divides_loss_always=False,
    ),
    FREES_OUTPUT: Loop(
        FREES_OUTPUT,
        "frees the model's output before backward (loss_fn(model(x), y).backward())",
        holds_output=False,
        zero_grad_after_forward=False,
        batches_ahead=0,
        fetches_micro_batches=False,
        clips_gradients=False,
        framework_optimizer=False,
        divides_loss_always=False,
    ),
    HF_TRAINER: Loop(
        HF_TRAINER,
        "Hugging Face Trainer: outputs freed in compute_loss, micro-batches fetched ahead, "
        "gradients clipped",
        holds_output=False,
        zero_grad_after_forward=False,
        batches_ahead=1,
        fetches_micro_batches=True,
        clips_gradients=True,
        framework_optimizer=True,
        divides_loss_always=False,
    ),
    LIGHTNING: Loop(
        LIGHTNING,
        "Lightning automatic optimization: training_step, then zero_grad, then backward",
        holds_output=False,
        zero_grad_after_forward=True,
        batches_ahead=0,
        fetches_micro_batches=False,
        clips_gradients=False,
        framework_optimizer=False,
        divides_loss_always=True,
    ),
}


def find_loop(name: str) -> Loop:
    """The loop called ``name``; a UserError naming the choices otherwise."""
    try:
        return LOOPS[name]
    except KeyError:
        raise UserError(f"unknown loop {name!r}: use one of {', '.join(LOOPS)}") from None


@dataclass(frozen=True)
class HfTrainerDefaults:
    """What ``transformers.TrainingArguments()`` sets that changes the step's memory."""

    optimizer_impl: str  # "fused" for adamw_torch_fused, else torch's own choice
    max_grad_norm: float
    use_cache: bool  # Trainer.__init__ sets model.config.use_cache to it (the KV cache)


@functools.lru_cache(maxsize=1)
def hf_trainer_defaults() -> HfTrainerDefaults:
    """Read from the installed transformers; without it, transformers 5.x's defaults on
    torch >= 2.8 (``optim="adamw_torch_fused"``, ``max_grad_norm=1.0``, ``use_cache=False``)."""
    try:
        from transformers import TrainingArguments
    except Exception:
        return HfTrainerDefaults("fused", 1.0, False)
    fields = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    optim = str(getattr(fields.get("optim"), "value", fields.get("optim")))
    norm = fields.get("max_grad_norm")
    return HfTrainerDefaults(
        "fused" if optim.endswith("_fused") else "auto",
        float(norm) if isinstance(norm, (int, float)) else 1.0,
        bool(fields.get("use_cache", False)),
    )
