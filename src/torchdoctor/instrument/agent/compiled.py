"""Which fast path this process runs at every batch and step: the compiled one (``_fast``, built
from ``_fast.c`` at install where a C compiler was there) or the pure-Python one.

Both record the same rows: the compiled part does only the common batch and the common step and
calls the Python handlers of :mod:`.steps` for everything else. The pure-Python path runs where
the extension was not built, where it was built for another Python (the job's interpreter need
not be torchdoctor's: the agent is loaded by path), and where ``TORCHDOCTOR_AGENT_PURE_PYTHON``
is set. The recording says which (the ``agent.fast_path`` setting). Loaded with torch.
"""

from __future__ import annotations

import os

from .contract import ENV_PURE_PYTHON, env_flag

# The step counter's fields that the compiled path reads and writes: ``_fast.CounterFields``
# has exactly these (a test keeps them equal), the pure path has them as slots. On the compiled
# path the numbers are C integers (``boundary`` and the batch sizes may be None), so that a batch
# or a step allocates nothing.
COUNTER_FIELDS = (
    "step", "boundary", "data_wait", "samples", "batches", "last_batch_size",
    "loader_batch_size", "loader_seen", "eval_ns", "first_batches_due", "prev_step_fed",
    "autocast_dtype", "scaler_used", "evaluation", "step_thread", "last_optimizer", "fast",
    "cuda_started",
    "agent", "loaders", "grad_enabled", "tensor_type", "batch_len",
)  # fmt: skip


def _load():
    if env_flag(os.environ.get(ENV_PURE_PYTHON)):
        return None, f"python ({ENV_PURE_PYTHON} is set)"
    try:
        from . import _fast
    except ImportError as exc:
        return None, f"python (no compiled path for this Python: {exc})"[:300]
    return _fast, "compiled"


fast, FAST_PATH = _load()


class _PythonCounterFields:
    """The pure path's counter fields: slots, read and written as the compiled ones are."""

    __slots__ = COUNTER_FIELDS

    # The compiled path keeps the steps its common case ends as numbers until a flush (or the
    # full path) asks for them as rows; the pure path appends rows to agent.steps at once.
    pending_rows = 0

    def drain_rows(self, steps: list) -> None:
        """Append the steps ended and not yet in ``steps`` (the agent's rows) to it."""

    def discard_rows(self) -> None:
        """Forget the steps ended and not yet drained (a forked child's copy of its parent's)."""


CounterFields = fast.CounterFields if fast is not None else _PythonCounterFields


def read_grad_mode_natively(counter, torch) -> bool:
    """Have the compiled path read the autograd mode at every batch in torch's own library
    (``c10::GradMode::is_enabled``, the function behind ``torch.is_grad_enabled``) rather than
    through Python's call protocol, once it reads what torch says in both modes. False where
    it cannot (the pure path, a libc10 without the symbol): the batch calls
    ``counter.grad_enabled`` as before."""
    use = getattr(counter, "use_native_grad_mode", None)
    if use is None:
        return False
    try:
        with torch.no_grad():
            off = use(True), torch.is_grad_enabled()
        with torch.enable_grad():
            on = use(True), torch.is_grad_enabled()
    except Exception:
        off = on = None
    if off != (False, False) or on != (True, True):
        use(False)
        return False
    return True
