"""What gets trained: a model builder, a batch maker and a loss, whatever the spec's form."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Batch = tuple[Any, Any]  # (inputs: tensor | tuple of tensors | dict of tensors, target | None)


@dataclass
class Workload:
    """A model to estimate, built fresh (under fake tensors) for every traced step."""

    name: str
    build_model: Callable[[], Any]
    make_batch: Callable[[Any, int], Batch]  # (model, batch size) -> batch
    loss_fn: Callable[[Any, Any], Any]
    # The parameter and value the batches come from (("tokens", 64)); None: the batch maker.
    batch_option: tuple[str, object] | None = None
    # The loop the spec's module shows it trains with, and why (spec.trains_with); None: unknown.
    trains_with: tuple[str, str] | None = None
    # The loop an estimate assumes when none is asked for, and why it was chosen (api.prepare).
    default_loop: tuple[str, str] | None = None


def call_model(model: Any, inputs: Any) -> Any:
    """Run ``model`` on a batch's inputs: positional for tuples, keywords for dicts."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def is_hf_model(model: Any) -> bool:
    """A transformers model: it takes keyword inputs and computes its loss from ``labels``."""
    return hasattr(model, "config") and hasattr(model, "get_input_embeddings")


def is_lightning_module(model: Any) -> bool:
    """A ``LightningModule`` (without importing Lightning): its ``training_step`` is the
    forward and loss of a step."""
    return any(cls.__name__ == "LightningModule" for cls in type(model).__mro__)


def split_batch(batch: Any) -> Batch:
    """A batch maker may return just the inputs, or ``(inputs, target)``."""
    if isinstance(batch, tuple) and len(batch) == 2:
        return batch[0], batch[1]
    return batch, None


def default_loss(output: Any, target: Any) -> Any:
    """The loss when the spec gives none: the model's own loss, else cross-entropy or MSE.

    The model's own loss is its output's ``loss`` (HF ModelOutput, a dict), or the 0-dim
    floating tensor of a returned tuple (nanoGPT's ``logits, loss = model(X, Y)``).
    Classification-shaped outputs (floating, at least 2-D) get cross-entropy against ``target``
    (random class ids of the output's leading shape when there is no target); anything else the
    mean squared output.
    """
    import torch
    import torch.nn.functional as F

    out = output
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, dict):
        if isinstance(out.get("loss"), torch.Tensor):
            return out["loss"]
        out = out.get("logits", next(iter(out.values())))
    if isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, torch.Tensor) and item.dim() == 0 and item.is_floating_point():
                return item
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        out = logits
    while isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model returned {type(output).__name__}, not a tensor: pass a loss")
    if out.is_floating_point() and out.dim() >= 2:
        classes = out.shape[-1]
        if not (isinstance(target, torch.Tensor) and target.shape == out.shape[:-1]):
            target = torch.randint(0, classes, out.shape[:-1], device=out.device)
        return F.cross_entropy(out.reshape(-1, classes), target.reshape(-1))
    return out.float().pow(2).mean()


def vocab_size(model: Any) -> int | None:
    """The token vocabulary of ``model``: its config's, else its first embedding's."""
    import torch

    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if isinstance(size, int):
        return size
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            return module.num_embeddings
    return None
