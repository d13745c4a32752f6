"""Callbacks for PyTorch Lightning and the Hugging Face Trainer that record a fit with
:func:`torchdoctor.watch`. Both libraries are optional: each factory imports its library when
called and says how to install it when it is missing.

    trainer = lightning.Trainer(callbacks=[torchdoctor_lightning_callback("fit.sqlite")])
    trainer = transformers.Trainer(..., callbacks=[torchdoctor_hf_callback("fit.sqlite")])
"""

from __future__ import annotations

import os

from torchdoctor.errors import UserError
from torchdoctor.instrument.watch import Watch


class WatchSession:
    """What both callbacks do: start a :class:`Watch` when training starts, stop it once when
    it ends or fails. Safe to call in any order and more than once."""

    def __init__(self, out: str | os.PathLike[str] | None = None, **watch_kwargs) -> None:
        self.out = out
        self.watch_kwargs = watch_kwargs
        self.watch: Watch | None = None
        self.path = None

    def train_start(self) -> None:
        if self.watch is None:
            self.watch = Watch(self.out, **self.watch_kwargs).start()
            self.path = self.watch.path

    def train_end(self, failed: bool = False) -> None:
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.stop(exit_status=1 if failed else 0)


def torchdoctor_lightning_callback(out=None, **watch_kwargs):
    """A ``lightning`` (or ``pytorch_lightning``) Callback recording the fit into ``out``."""
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:
        try:
            from pytorch_lightning.callbacks import Callback
        except ImportError:
            raise UserError(
                "the Lightning callback needs PyTorch Lightning: pip install lightning"
            ) from None

    class TorchdoctorCallback(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.session = WatchSession(out, **watch_kwargs)

        def on_fit_start(self, trainer, pl_module) -> None:
            self.session.train_start()

        def on_fit_end(self, trainer, pl_module) -> None:
            self.session.train_end()

        def on_exception(self, trainer, pl_module, exception) -> None:
            self.session.train_end(failed=True)

    return TorchdoctorCallback()


def torchdoctor_hf_callback(out=None, **watch_kwargs):
    """A Hugging Face ``TrainerCallback`` recording ``trainer.train()`` into ``out``."""
    try:
        from transformers import TrainerCallback
    except ImportError:
        raise UserError(
            "the Hugging Face callback needs transformers: pip install transformers"
        ) from None

    class TorchdoctorTrainerCallback(TrainerCallback):
        def __init__(self) -> None:
            self.session = WatchSession(out, **watch_kwargs)

        def on_train_begin(self, args, state, control, **kwargs):
            self.session.train_start()

        def on_train_end(self, args, state, control, **kwargs):
            self.session.train_end()

    return TorchdoctorTrainerCallback()
