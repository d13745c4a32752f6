"""Callbacks for PyTorch Lightning and the Hugging Face Trainer that record a fit with
:func:`torchdoctor.watch`. Both libraries are optional: each factory imports its library when
called and says how to install it when it is missing.

    trainer = lightning.Trainer(callbacks=[torchdoctor_lightning_callback("fit.sqlite")])
    trainer = transformers.Trainer(..., callbacks=[torchdoctor_hf_callback("fit.sqlite")])

Each fit gets its own recording: the first one ``fit.sqlite``, a later fit with the same
callback ``fit-2.sqlite`` and so on; every rank of a distributed fit writes its own
``.rankN`` file. The recording closes with exit status 0 when the fit ends, or with the status
the failure would give the process (1; 130 for Ctrl-C) when it raises; the exception itself
reaches the caller unchanged. A recording that cannot start or finish never stops the fit: it
says so once as a ``RuntimeWarning``.

The callback classes live at module level (built on first use, see :func:`__getattr__`) so
that a trainer holding one can be pickled, as Lightning's ``ddp_spawn`` does.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from pathlib import Path

from torchdoctor.errors import UserError
from torchdoctor.run.watch import Watch, default_name, rank_path

LIGHTNING_CLASS = "TorchdoctorLightningCallback"
HF_CLASS = "TorchdoctorTrainerCallback"
_CLASSES: dict[str, type] = {}


def exit_status_of(exc: BaseException) -> int:
    """The status a shell would report had ``exc`` ended the process."""
    if isinstance(exc, KeyboardInterrupt):
        return 130  # 128 + SIGINT
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        return code if isinstance(code, int) else 1
    return 1


class WatchSession:
    """What both callbacks do: start a :class:`Watch` when training starts, stop it once when
    it ends or fails. Safe to call in any order and more than once; never raises from a hook.

    A bad ``out`` or watch option raises :class:`UserError` here, before the fit starts.
    """

    def __init__(self, out: str | os.PathLike[str] | None = None, **watch_kwargs) -> None:
        probe = Watch(out, **watch_kwargs)  # a bad interval or keyword fails now, not mid-fit
        if out is not None and probe.path.exists():
            raise UserError(
                f"{str(probe.path)!r} already exists; give the torchdoctor callback a new file name"
            )
        self.out = Path(out) if out is not None else None
        self.watch_kwargs = watch_kwargs
        self.watch: Watch | None = None
        self.path: Path | None = None  # the latest fit's recording
        self.paths: list[Path] = []  # every fit's recording, in order

    def __getstate__(self) -> dict:
        # A trainer is pickled to start spawned ranks; the running recording stays here.
        return {**self.__dict__, "watch": None}

    def train_start(self, rank: int | None = None, world_size: int | None = None) -> None:
        """Start recording unless already recording (Lightning's tuner runs fits within fits).

        ``rank``/``world_size`` come from the trainer: launchers that set no ``RANK`` variable
        (Lightning's own) still get one file per rank.
        """
        if self.watch is not None:
            return
        watch = None
        try:
            path = self._next_path(rank, world_size)
            # No out: a fresh file per fit, named uniquely when it is created.
            name = _ranked_name(rank, world_size) if path is None else None
            watch = Watch(path, name=name, **self.watch_kwargs)
            watch.start()
        except Exception as exc:
            if watch is not None:
                with contextlib.suppress(Exception):
                    watch.stop(exit_status=None)  # a half-started recording
            warnings.warn(f"torchdoctor: this fit is not recorded: {exc}", RuntimeWarning, 2)
            return
        self.watch = watch
        self.path = watch.path
        self.paths.append(watch.path)

    def train_end(self, failed: bool = False) -> None:
        """Finish the recording: exit status 0, or 1 when ``failed``."""
        self._stop(1 if failed else 0)

    def train_failed(self, exc: BaseException) -> None:
        """Finish the recording with the status ``exc`` would give the process."""
        self._stop(exit_status_of(exc))

    def _stop(self, exit_status: int) -> None:
        watch, self.watch = self.watch, None
        if watch is None:
            return
        try:
            watch.stop(exit_status=exit_status)
        except Exception as exc:
            warnings.warn(
                f"torchdoctor: the recording {str(watch.path)!r} may be incomplete: {exc}",
                RuntimeWarning,
                2,
            )

    def _next_path(self, rank: int | None, world_size: int | None) -> Path | None:
        if self.out is None:
            return None
        if not self.paths:
            return _ranked(self.out, rank, world_size)
        n = len(self.paths) + 1
        while True:
            path = _ranked(
                self.out.with_name(f"{self.out.stem}-{n}{self.out.suffix}"), rank, world_size
            )
            if not rank_path(path).exists():
                return path
            n += 1


def _ranked_name(rank: int | None, world_size: int | None) -> str:
    return _ranked(Path(default_name()), rank, world_size).name


def _ranked(path: Path, rank: int | None, world_size: int | None) -> Path:
    """``run.sqlite`` -> ``run.rank1.sqlite`` for rank 1 of several, unless ``RANK`` in the
    environment already makes :class:`Watch` name it so."""
    if rank is None or world_size is None or world_size <= 1 or rank_path(path) != path:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _lightning_callback_class() -> type:
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:
        try:
            from pytorch_lightning.callbacks import Callback
        except ImportError:
            raise UserError(
                "the Lightning callback needs PyTorch Lightning: pip install lightning"
            ) from None

    class TorchdoctorLightningCallback(Callback):
        """Records ``trainer.fit`` into ``out`` (see :func:`torchdoctor_lightning_callback`)."""

        def __init__(self, out: str | os.PathLike[str] | None = None, **watch_kwargs) -> None:
            super().__init__()
            self.session = WatchSession(out, **watch_kwargs)

        @property
        def path(self) -> Path | None:
            """The latest fit's recording (None before the first fit)."""
            return self.session.path

        def on_fit_start(self, trainer, pl_module) -> None:
            self.session.train_start(trainer.global_rank, trainer.world_size)

        def on_fit_end(self, trainer, pl_module) -> None:
            self.session.train_end()

        def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
            self.session.train_failed(exception)

    return TorchdoctorLightningCallback


def _hf_callback_class() -> type:
    try:
        from transformers import Trainer, TrainerCallback
    except ImportError:
        raise UserError(
            "the Hugging Face callback needs transformers: pip install transformers accelerate"
        ) from None

    class TorchdoctorTrainerCallback(TrainerCallback):
        """Records ``trainer.train()`` into ``out`` (see :func:`torchdoctor_hf_callback`)."""

        def __init__(self, out: str | os.PathLike[str] | None = None, **watch_kwargs) -> None:
            self.session = WatchSession(out, **watch_kwargs)

        @property
        def path(self) -> Path | None:
            """The latest fit's recording (None before the first fit)."""
            return self.session.path

        def on_init_end(self, args, state, control, **kwargs) -> None:
            # The Trainer has no failure event for callbacks: wrap the train() of the Trainer
            # that is being built with this callback, so a failing fit is recorded as failed.
            try:
                trainer = _calling_instance(Trainer, lambda t: self in t.callback_handler.callbacks)
                if trainer is not None:
                    _record_failures_of(trainer, self.session)
            except Exception as exc:
                warnings.warn(
                    f"torchdoctor: a failing fit will be recorded without its exit status: {exc}",
                    RuntimeWarning,
                    2,
                )

        def on_train_begin(self, args, state, control, **kwargs) -> None:
            self.session.train_start(args.process_index, args.world_size)

        def on_train_end(self, args, state, control, **kwargs) -> None:
            self.session.train_end()

    return TorchdoctorTrainerCallback


def _calling_instance(cls: type, accept, max_depth: int = 12):
    """The nearest ``self`` up the call stack that is a ``cls`` and that ``accept`` takes."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, cls) and accept(candidate):
            return candidate
        frame = frame.f_back
    return None


def _record_failures_of(trainer, session: WatchSession) -> None:
    """Make ``trainer.train`` close the session as failed when it raises (then re-raise)."""
    train = trainer.train
    if getattr(train, "_torchdoctor_session", None) is session:
        return

    @functools.wraps(train)
    def recorded_train(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        except BaseException as exc:
            session.train_failed(exc)
            raise

    recorded_train._torchdoctor_session = session
    trainer.train = recorded_train


_BUILDERS = {LIGHTNING_CLASS: _lightning_callback_class, HF_CLASS: _hf_callback_class}


def __getattr__(name: str) -> type:
    """``TorchdoctorLightningCallback`` and ``TorchdoctorTrainerCallback``, built on first use
    (importing their library); pickle finds them here by name."""
    builder = _BUILDERS.get(name)
    if builder is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = _CLASSES.get(name)
    if cls is None:
        cls = builder()
        cls.__module__ = __name__
        cls.__qualname__ = name
        _CLASSES[name] = cls
    return cls


def torchdoctor_lightning_callback(out: str | os.PathLike[str] | None = None, **watch_kwargs):
    """A ``lightning`` (or ``pytorch_lightning``) Callback recording ``trainer.fit`` into ``out``.

    ``out`` defaults to ``./torchdoctor-runs/<UTC time>-python-<script>.sqlite``;
    ``watch_kwargs`` are :func:`torchdoctor.watch`'s (``interval``, ``instrument``, ``gpus``).
    """
    return __getattr__(LIGHTNING_CLASS)(out, **watch_kwargs)


def torchdoctor_hf_callback(out: str | os.PathLike[str] | None = None, **watch_kwargs):
    """A Hugging Face ``TrainerCallback`` recording ``trainer.train()`` into ``out``.

    Pass it to ``Trainer(callbacks=[...])`` (not ``add_callback``) so that a failing fit is
    recorded with its exit status; otherwise the recording is finished when Python exits.
    ``watch_kwargs`` are :func:`torchdoctor.watch`'s (``interval``, ``instrument``, ``gpus``).
    """
    return __getattr__(HF_CLASS)(out, **watch_kwargs)
