"""``--json`` means stdout is only JSON: what user code prints meanwhile goes to stderr."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def user_output_to_stderr(active: bool = True) -> Iterator[None]:
    """While the block runs (a model's constructor and forward, a factory's imports), send
    stdout to stderr: Python's ``print`` by ``sys.stdout``, and C code writing to fd 1 by the
    descriptor. Nothing is lost; it just does not mix with the JSON printed after."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = None
    with contextlib.suppress(OSError):
        saved = os.dup(1)
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
