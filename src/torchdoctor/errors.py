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
