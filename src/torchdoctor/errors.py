"""Errors that reach the user as one clear line and a non-zero exit status."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message says what is wrong and what to do; ``exit_code`` is the status."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class NotARecordingError(UserError):
    """The file is not a torchdoctor recording (or is from a newer schema)."""


def require_torch(purpose: str) -> object:
    """Import torch lazily; without it raise a UserError that says how to install it."""
    try:
        import torch
    except ImportError:
        raise UserError(
            f"{purpose} needs PyTorch, which is not importable here: "
            "install it with `pip install torch` (or your CUDA build)",
            exit_code=3,
        ) from None
    return torch


_NO_VALUE = object()
Parameter = str | tuple[str, object]  # a name, or (name, value) to name it with its value


class ParameterError(UserError):
    """A bad argument of a library function, whose message names the Python parameters.

    ``template`` has one ``{}`` per parameter (other braces doubled). A library caller reads
    ``batch_size must be at least 1``; an interface re-words it in its own terms with
    :meth:`worded` (the CLI: ``--batch must be at least 1``). A parameter given with a value
    reads ``device='cuda'`` (``--device cuda``); the value True reads ``inference=True``
    (``--inference``).
    """

    def __init__(self, template: str, *parameters: Parameter, exit_code: int = 2) -> None:
        self.template = template
        self.parameters = [p if isinstance(p, tuple) else (p, _NO_VALUE) for p in parameters]
        words = [
            name if value is _NO_VALUE else f"{name}={value!r}" for name, value in self.parameters
        ]
        super().__init__(template.format(*words), exit_code)

    def worded(self, names: dict[str, str]) -> UserError:
        """The same error with each parameter called what ``names`` calls it."""
        words = []
        for name, value in self.parameters:
            word = names.get(name, name)
            words.append(word if value is _NO_VALUE or value is True else f"{word} {value}")
        return UserError(self.template.format(*words), self.exit_code)


def literal(text: str) -> str:
    """``text`` made safe to put into a :class:`ParameterError` template."""
    return text.replace("{", "{{").replace("}", "}}")
