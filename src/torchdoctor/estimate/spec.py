"""Turn a model spec (``file.py:factory``, ``pkg.mod:factory``, ``torchvision:NAME``,
``hf:MODEL_TYPE``) and the batch options into a :class:`Workload`."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import io
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from torchdoctor.errors import ParameterError, UserError, literal
from torchdoctor.estimate.workload import (
    Workload,
    default_loss,
    is_hf_model,
    split_batch,
    vocab_size,
)


def parse_shape(text: str) -> tuple[int, ...]:
    """``3x224x224`` (or ``3,224,224``) -> (3, 224, 224): one sample's shape, no batch dim."""
    # Empty parts are kept, so that "3x" or "x224" (a dimension left out) is refused, not
    # read as a shape of fewer dimensions than meant.
    parts = re.split(r"[x,\s]+", text.strip().lower())
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise UserError(
            f"cannot read input shape {text!r}: write one sample's shape like 3x224x224"
        )
    return tuple(int(p) for p in parts)


def load_workload(
    spec: str | Callable[[], Any],
    input_shape: tuple[int, ...] | None = None,
    tokens: int | None = None,
    timeout: float | None = None,
) -> Workload:
    """The workload ``spec`` names, fed by ``--input``, ``--tokens`` or the factory's batch maker.

    ``timeout``: seconds that importing the user's module, and each call of its factory, may
    take (None: no bound); past it a :class:`ParameterError` naming ``factory_timeout``."""
    module: ModuleType | None = None  # the user's module of file.py:factory, pkg.mod:factory
    if callable(spec):
        name = getattr(spec, "__qualname__", repr(spec))
        factory, default_input = spec, None
    elif spec.startswith("torchvision:"):
        name, factory, default_input = spec, _torchvision_factory(spec[12:]), (3, 224, 224)
    elif spec.startswith("hf:"):
        name, factory, default_input = spec, _hf_factory(spec[3:]), None
    else:
        factory, module = _import_factory(spec, timeout)
        name, default_input = spec, None
    shape = input_shape or (None if tokens else default_input)
    workload = _workload(name, factory, shape, tokens, timeout)
    if module is not None:
        workload.trains_with = trains_with(module)
    return workload


def trains_with(module: ModuleType) -> tuple[str, str] | None:
    """The training loop the user's module shows it trains with, and why we say so: a
    LightningModule or Lightning's Trainer -> ``lightning``; transformers' ``Trainer`` (or a
    subclass: TRL's SFTTrainer) -> ``hf-trainer``; None when it shows neither.

    Read from the module's globals (what it defined or imported), and only from frameworks it
    imported itself: ``sys.modules`` is looked up, never imported into (importing
    transformers.trainer would take seconds and pull in accelerate)."""
    file = Path(getattr(module, "__file__", None) or module.__name__).name
    values = [v for v in vars(module).values() if isinstance(v, type)]
    lightning = [
        getattr(sys.modules.get(name), attr, None)
        for name, attr in (
            ("lightning.pytorch", "LightningModule"),
            ("lightning.pytorch", "Trainer"),
            ("pytorch_lightning", "LightningModule"),
            ("pytorch_lightning", "Trainer"),
        )
    ]
    for base in filter(None, lightning):
        found = _most_derived(values, base)
        if found is not None:
            return "lightning", f"{file} uses Lightning ({found.__name__})"
    hf_trainer = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if hf_trainer is not None:
        found = _most_derived(values, hf_trainer)
        if found is not None:
            return "hf-trainer", f"{file} uses transformers' {found.__name__}"
    return None


def _most_derived(classes: list[type], base: type) -> type | None:
    """A subclass of ``base`` among ``classes`` (the user's own, e.g. ``MyTrainer(Trainer)``,
    names it better than the imported base), else ``base`` if it is among them."""
    found = [c for c in classes if issubclass(c, base)]
    return next((c for c in found if c is not base), found[0] if found else None)


def _workload(
    name: str,
    factory: Callable[[], Any],
    input_shape: tuple[int, ...] | None,
    tokens: int | None,
    timeout: float | None = None,
) -> Workload:
    parts: dict[str, Any] = {}

    def build_model() -> Any:
        with _user_code(f"the factory of {name}", _script_of(name), timeout):
            made = factory()
        model, batch_maker, loss = _unpack(name, made)
        parts["batch_maker"], parts["loss"] = batch_maker, loss
        return model

    def make_batch(model: Any, batch_size: int) -> Any:
        import torch

        if tokens is not None:
            vocab = vocab_size(model)
            if vocab is None:
                raise ParameterError(
                    literal(f"{name} has no embedding to take the vocabulary from: ")
                    + "use {} instead of {}",
                    "input_shape",
                    "tokens",
                )
            ids = torch.randint(0, vocab, (batch_size, tokens))
            if is_hf_model(model):
                return {"input_ids": ids, "labels": ids}, None
            return ids, torch.randint(0, vocab, (batch_size, tokens))
        if input_shape is not None:
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
            return torch.randn(batch_size, *input_shape, dtype=dtype or torch.float32), None
        maker = parts.get("batch_maker")
        if maker is None:
            raise ParameterError(
                literal(f"{name} gives no batch maker: ") + "pass {} (e.g. 3x224x224) or {}",
                "input_shape",
                "tokens",
            )
        try:
            return split_batch(maker(batch_size))
        except Exception as exc:
            raise UserError(
                f"the batch maker of {name} raised {type(exc).__name__}: {exc}"
            ) from exc

    def loss_fn(output: Any, target: Any) -> Any:
        loss = parts.get("loss") or default_loss
        return loss(output, target)

    source: tuple[str, object] | None = None
    if tokens is not None:
        source = ("tokens", tokens)
    elif input_shape is not None:
        source = ("input_shape", "x".join(str(d) for d in input_shape))
    return Workload(name, build_model, make_batch, loss_fn, source)


def _unpack(name: str, made: Any) -> tuple[Any, Any, Any]:
    import torch

    model, batch_maker, loss = made, None, None
    if isinstance(made, dict):
        model, batch_maker, loss = made.get("model"), made.get("make_batch"), made.get("loss")
    elif isinstance(made, (tuple, list)):
        if not 1 <= len(made) <= 3:
            raise UserError(
                f"the factory of {name} returned {len(made)} items: return a model, "
                "(model, make_batch) or (model, make_batch, loss)"
            )
        model, batch_maker, loss = (*made, None, None)[:3]
    if not isinstance(model, torch.nn.Module):
        raise UserError(
            f"the factory of {name} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model, batch_maker, loss


def _script_of(spec_name: str) -> str:
    """What the user's code sees as sys.argv[0]: the file (or module) the spec names."""
    return spec_name.partition(":")[0] or spec_name


@contextlib.contextmanager
def _user_code(what: str, argv0: str, timeout: float | None = None) -> Iterator[None]:
    """Around importing the user's module and calling its factory, inside torchdoctor's process.

    ``sys.argv`` is ``[argv0]``, as if the file ran with no arguments: a module-level
    ``argparse`` (the usual train.py) parsed torchdoctor's own command line and its error looked
    like torchdoctor's. What the code writes on stderr is held back, so that an exit or an
    exception is one line (the code's last line of stderr goes into it), and passed on when
    the code returns normally (its warnings are the user's to see). ``sys.exit()`` and any
    exception become a :class:`UserError` naming ``what``; so does running past ``timeout``
    seconds (:func:`_bounded`)."""
    saved_argv = sys.argv
    held = io.StringIO()
    sys.argv = [argv0]
    try:
        with _bounded(what, timeout), contextlib.redirect_stderr(held):
            yield
    except _CallersAlarm as wrapped:
        raise wrapped.original from None  # the caller's own alarm handler raised it
    except _NoReturn:
        raise ParameterError(
            literal(f"{what} did not return within {_seconds(timeout)}: ")
            + "it may wait for something that never comes (raise {} if it is only slow)",
            "factory_timeout",
        ) from None
    except SystemExit as exc:
        raise UserError(_exit_message(what, exc.code, held.getvalue())) from None
    except (UserError, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise UserError(f"{what} raised {type(exc).__name__}: {exc}") from exc
    else:
        sys.stderr.write(held.getvalue())
    finally:
        sys.argv = saved_argv


class _NoReturn(BaseException):
    """Raised into the user's code when it ran past its bound: a BaseException, so that the
    code's own ``except Exception`` does not swallow it."""


class _CallersAlarm(BaseException):
    """What the caller's own SIGALRM handler raised while the user's code ran: carried past
    the code's ``except Exception`` and ours, and raised again as it was."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(original)
        self.original = original


# A progress line on a terminal after this long, then again each time this long went by.
PROGRESS_EVERY_S = 10.0


@contextlib.contextmanager
def _bounded(what: str, timeout: float | None) -> Iterator[None]:
    """Bound the user's code to ``timeout`` seconds (None: unbounded, silent), and say it is
    still waited for.

    A factory that never returns (a download that hangs, a lock, ``input()``) hung estimate
    silently (probe M2). SIGALRM raises :class:`_NoReturn` in the main thread, where the code
    runs: Python code and the blocking calls signals interrupt (sleep, socket reads, lock
    waits) end there. Elsewhere (the API from another thread) signals cannot reach it and only
    the progress line is given. The line goes to the terminal the user watches, captured
    before the code's stderr is held back, and only when it is a terminal."""
    import os
    import signal
    import threading
    import time

    if timeout is None:
        yield
        return
    stderr = sys.stderr
    tty = bool(getattr(stderr, "isatty", None)) and stderr.isatty()
    armed = threading.current_thread() is threading.main_thread()
    done = threading.Event()
    watcher = None
    if tty:
        watcher = threading.Thread(
            target=_progress, args=(what, timeout, stderr, done), daemon=True
        )
        watcher.start()
    if armed:
        # A timer the caller armed already (a test harness's bound, the user's own alarm)
        # stays theirs: whichever is due first fires, and theirs is armed again afterwards
        # with the time it had left.
        outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
        outer_first = 0 < outer_left <= timeout
        started = time.monotonic()
        outer_fired = False

        def alarm(signum: int, frame: Any) -> None:
            nonlocal outer_first, outer_fired
            if not outer_first:
                raise _NoReturn
            # The caller's alarm: ours is armed again for what is left of it, and theirs
            # does what it would have done without us.
            outer_first, outer_fired = False, True
            left = max(timeout - (time.monotonic() - started), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left)
            if callable(previous):
                try:
                    previous(signum, frame)
                except BaseException as exc:
                    raise _CallersAlarm(exc) from None  # not the user's: see _user_code
            elif previous == signal.SIG_DFL:  # the process ends on SIGALRM
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGALRM)

        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, outer_left if outer_first else timeout)
    try:
        yield
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if outer_left > 0 and not outer_fired:
                left = max(outer_left - (time.monotonic() - started), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, left, outer_interval)
        done.set()
        if watcher is not None:
            watcher.join(1.0)


def _progress(what: str, timeout: float, stderr: Any, done: Any) -> None:
    from torchdoctor.terminal import make_console

    console = make_console(file=stderr, soft_wrap=True)  # one line each, never cut
    waited = 0.0
    while not done.wait(PROGRESS_EVERY_S):
        waited += PROGRESS_EVERY_S
        console.print(
            f"torchdoctor: still waiting for {what}: {waited:.0f} s of at most {_seconds(timeout)}"
        )


def _seconds(timeout: float | None) -> str:
    return f"{timeout:g} s"


def _exit_message(what: str, code: object, stderr: str) -> str:
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    said = f": {last}" if last else ""
    if code is None or isinstance(code, int):
        message = f"{what} exited with status {code or 0}{said}"
    else:  # sys.exit("message") prints the message and exits 1
        message = f"{what} exited: {code}"
    if code == 2 and "usage:" in stderr:
        # argparse's status: its parser ran at import, where only the script's own run needs it
        message += " (its argparse parsed the command line? keep parsing under "
        message += "`if __name__ == '__main__':`, or give it defaults)"
    return message


def _import_factory(
    spec: str, timeout: float | None = None
) -> tuple[Callable[[], Any], ModuleType]:
    """The factory ``spec`` names, and the module it was found in."""
    target, sep, attr = spec.partition(":")
    form = "use file.py:factory, package.module:factory, torchvision:NAME or hf:MODEL_TYPE"
    if not sep or not target or not attr:
        raise UserError(f"cannot read model spec {spec!r}: {form}")
    if ":" in attr:
        # models.py:make:extra was read as the module 'models.py:make'
        raise UserError(
            f"cannot read model spec {spec!r}: one colon, between the file or module and the "
            f"factory ({form})"
        )
    if target.endswith(".py") or "/" in target:
        path = Path(target)
        if path.is_dir():
            raise UserError(f"model file {target} is a folder, not a Python file: {form}")
        if not path.is_file():
            raise UserError(f"model file {target} does not exist")
        module_name = f"_torchdoctor_spec_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.resolve().parent))
        try:
            sys.modules[module_name] = module
            with _user_code(f"importing {target}", target, timeout):
                module_spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        try:
            with _user_code(f"importing {target}", target, timeout):
                module = importlib.import_module(target)
        except UserError as exc:
            if isinstance(exc.__cause__, ImportError):
                raise UserError(f"cannot import module {target!r}: {exc.__cause__}") from None
            raise
    factory = getattr(module, attr, None)
    if factory is None:
        defined = [
            n
            for n, v in vars(module).items()
            if callable(v)
            and not n.startswith("_")
            and getattr(v, "__module__", "") == module.__name__
        ]
        hint = f" (it defines: {', '.join(sorted(defined))})" if defined else ""
        raise UserError(f"no factory {attr!r} in {target}{hint}")
    if not callable(factory):
        raise UserError(f"{target}:{attr} is a {type(factory).__name__}, not a callable factory")
    if inspect.isclass(factory) and not _is_module_class(factory):
        raise UserError(f"{target}:{attr} is a class that is not a torch.nn.Module")
    return factory, module


def _is_module_class(cls: type) -> bool:
    import torch

    return issubclass(cls, torch.nn.Module)


def _torchvision_factory(name: str) -> Callable[[], Any]:
    try:
        import torchvision
    except Exception as exc:  # torchvision can fail to import for ABI reasons, not just absence
        raise UserError(
            f"torchvision:{name} needs torchvision, which does not import here ({exc}): "
            "install the torchvision build matching your torch"
        ) from None
    available = torchvision.models.list_models()
    if name not in available:
        raise UserError(f"torchvision has no model {name!r}: e.g. {', '.join(available[:8])}")
    return lambda: torchvision.models.get_model(name, weights=None)


def _hf_factory(model_type: str) -> Callable[[], Any]:
    try:
        import transformers
    except Exception:
        raise UserError(
            f"hf:{model_type} needs transformers, which is not importable here: "
            "pip install transformers"
        ) from None
    try:
        config = transformers.AutoConfig.for_model(model_type)
    except ValueError:
        raise UserError(
            f"transformers knows no model type {model_type!r} (e.g. gpt2, llama, bert)"
        ) from None

    def build() -> Any:
        for auto in ("AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModel"):
            try:
                return getattr(transformers, auto).from_config(config)
            except ValueError:
                continue
        raise UserError(f"transformers cannot build a model for type {model_type!r}")

    return build
