"""The one place where torchdoctor calls NVML.

Every call to the NVIDIA Management Library goes through :class:`Nvml`, which

- imports the official bindings (``nvidia-ml-py``, imported as ``pynvml``) lazily, or takes a
  module with the same shape (the tests pass ``tests/fake_nvml.py``);
- initialises NVML once and says in plain words why it could not (no driver, the CUDA
  toolkit's stub ``libnvidia-ml.so``, a driver/library mismatch, missing bindings...);
- turns every failure of a call into an :class:`Unavailable` value with a ``kind`` a program can
  test and a ``reason`` a person can read. NVML never crashes the caller and a failed call never
  becomes a silent zero.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

# Kinds of unavailability. Callers branch on these, people read ``Unavailable.reason``.
NOT_SUPPORTED = "not_supported"
GPU_LOST = "gpu_lost"
NO_PERMISSION = "no_permission"
FUNCTION_NOT_FOUND = "function_not_found"
UNKNOWN = "unknown"
NO_DRIVER = "no_driver"
STUB_LIBRARY = "stub_library"
DRIVER_MISMATCH = "driver_mismatch"
NO_BINDINGS = "no_bindings"
NO_GPU = "no_gpu"
ERROR = "error"

# Failures that will not go away while the process runs: the reader stops asking.
PERMANENT_KINDS = frozenset({NOT_SUPPORTED, FUNCTION_NOT_FOUND, NO_PERMISSION, GPU_LOST})

# NVML return codes (nvml.h). They are part of the C ABI, so they are the same in every version
# of the bindings; matching on codes also covers the classes pynvml generates from them.
_ERR_UNINITIALIZED = 1
_ERR_NOT_SUPPORTED = 3
_ERR_NO_PERMISSION = 4
_ERR_DRIVER_NOT_LOADED = 9
_ERR_TIMEOUT = 10
_ERR_LIBRARY_NOT_FOUND = 12
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_GPU_IS_LOST = 15
_ERR_RESET_REQUIRED = 16
_ERR_LIB_RM_VERSION_MISMATCH = 18
_ERR_UNKNOWN = 999

_BY_CODE: dict[int, tuple[str, str]] = {
    _ERR_NOT_SUPPORTED: (NOT_SUPPORTED, "not supported on this GPU"),
    _ERR_GPU_IS_LOST: (GPU_LOST, "GPU is lost"),
    _ERR_NO_PERMISSION: (NO_PERMISSION, "no permission to read this from NVML"),
    _ERR_FUNCTION_NOT_FOUND: (
        FUNCTION_NOT_FOUND,
        "function not found in libnvidia-ml: the driver is older than the nvidia-ml-py bindings",
    ),
    _ERR_UNKNOWN: (UNKNOWN, "unknown NVML error"),
    _ERR_LIBRARY_NOT_FOUND: (NO_DRIVER, "no NVIDIA driver: libnvidia-ml.so.1 not found"),
    _ERR_DRIVER_NOT_LOADED: (NO_DRIVER, "NVIDIA driver not loaded"),
    _ERR_LIB_RM_VERSION_MISMATCH: (
        DRIVER_MISMATCH,
        "NVML and the loaded driver differ in version (driver updated without a reboot?)",
    ),
    _ERR_RESET_REQUIRED: (GPU_LOST, "GPU requires a reset"),
    _ERR_TIMEOUT: (ERROR, "NVML call timed out"),
    _ERR_UNINITIALIZED: (ERROR, "NVML is not initialised"),
}

STUB_REASON = (
    "stub library: the libnvidia-ml.so loaded is the CUDA toolkit's build-time stub, not the "
    "driver's; run where the NVIDIA driver is installed (in a container: start it with the "
    "NVIDIA Container Toolkit, e.g. `docker run --gpus all`)"
)
NO_BINDINGS_REASON = "nvidia-ml-py is not installed: `pip install nvidia-ml-py`"

# Text the CUDA toolkit's stub libnvidia-ml prints when any of its functions is called.
_STUB_BANNER = b"is a stub library"


@dataclass(frozen=True, slots=True)
class Unavailable:
    """The result of an NVML call that did not give a value."""

    kind: str
    reason: str

    @property
    def permanent(self) -> bool:
        return self.kind in PERMANENT_KINDS


def classify(exc: BaseException, name: str = "") -> Unavailable:
    """Turn any exception raised by an NVML binding into an :class:`Unavailable`."""
    code = getattr(exc, "value", None)
    if isinstance(code, int) and code in _BY_CODE:
        kind, reason = _BY_CODE[code]
        return Unavailable(kind, reason)
    if type(exc).__name__ == "NVMLLibraryMismatchError":
        # pynvml raises this (not an NVMLError) when an unversioned wrapper finds no symbol.
        return Unavailable(*_BY_CODE[_ERR_FUNCTION_NOT_FOUND])
    if isinstance(exc, AttributeError):
        return Unavailable(
            FUNCTION_NOT_FOUND,
            f"the installed nvidia-ml-py has no {name or 'such function'}: upgrade nvidia-ml-py",
        )
    if isinstance(code, int):
        try:
            message = str(exc)
        except Exception:
            message = ""
        return Unavailable(ERROR, f"NVML error {code}" + (f": {message}" if message else ""))
    return Unavailable(ERROR, f"{type(exc).__name__}: {exc}")


class Nvml:
    """NVML initialised once, with one guarded way to call it.

    ``module`` is the bindings module (``pynvml``); ``None`` imports the installed one on
    :meth:`start`.
    """

    def __init__(self, module: ModuleType | Any | None = None) -> None:
        self._module = module
        self._started = False
        self._running = False
        self.reason: str | None = None
        self.kind: str | None = None
        # Resolved name for each fallback chain, found once: which of the versioned functions
        # this driver and these bindings have.
        self._resolved: dict[tuple[str, ...], str] = {}

    @property
    def available(self) -> bool:
        return self._running

    def start(self) -> bool:
        """Import and initialise NVML once; afterwards ``available``/``reason`` tell how it went."""
        if self._started:
            return self._running
        self._started = True
        if self._module is None:
            try:
                self._module = importlib.import_module("pynvml")
            except ImportError:
                self.kind, self.reason = NO_BINDINGS, NO_BINDINGS_REASON
                return False
        failure: Unavailable | None = None
        with _capture_stdout() as captured:
            try:
                self._module.nvmlInit()
            except Exception as exc:
                failure = classify(exc, "nvmlInit")
        if _STUB_BANNER in captured.data or (failure is not None and _stub_library_mapped()):
            # A stub fails with whatever code its build chose; its banner, its folder or its
            # contents are what identify it. A banner counts even if the init call succeeded.
            if failure is None:
                self._shutdown_quietly()
            self.kind, self.reason = STUB_LIBRARY, STUB_REASON
            return False
        captured.replay()
        if failure is not None:
            self.kind, self.reason = failure.kind, failure.reason
            return False
        self._running = True
        return True

    def call(self, name: str | tuple[str, ...], *args: Any, **kwargs: Any) -> Any:
        """Call an NVML function; return its value or an :class:`Unavailable`.

        ``name`` may be a tuple of alternatives, newest first (``("nvmlX_v3", "nvmlX_v2")``):
        the first one that the driver and the bindings both have is used from then on.
        """
        if not self._running:
            return Unavailable(self.kind or ERROR, self.reason or "NVML is not initialised")
        if isinstance(name, str):
            return self._call_one(name, args, kwargs)
        resolved = self._resolved.get(name)
        if resolved is not None:
            return self._call_one(resolved, args, kwargs)
        result: Any = Unavailable(ERROR, "no function to call")
        for candidate in name:
            result = self._call_one(candidate, args, kwargs)
            if not (isinstance(result, Unavailable) and result.kind == FUNCTION_NOT_FOUND):
                self._resolved[name] = candidate
                return result
        return result

    def _call_one(self, name: str, args: tuple, kwargs: dict) -> Any:
        try:
            return getattr(self._module, name)(*args, **kwargs)
        except Exception as exc:
            return classify(exc, name)

    def constant(self, name: str, default: Any) -> Any:
        return getattr(self._module, name, default)

    def shutdown(self) -> None:
        if self._running:
            self._running = False
            self.kind, self.reason = ERROR, "NVML was shut down"
            self._shutdown_quietly()

    def _shutdown_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self._module.nvmlShutdown()


def text(value: Any) -> str:
    """NVML strings arrive as ``str`` or, from some binding versions, ``bytes``."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _stub_library_mapped() -> bool:
    """Whether the libnvidia-ml mapped into this process is the CUDA toolkit's stub: it lives
    in a ``stubs`` folder, or (copied elsewhere) it carries the stub's banner text."""
    paths = set()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and "libnvidia-ml" in parts[5]:
                    paths.add(parts[5].strip())
    except OSError:
        return False
    return any("/stubs/" in path or is_stub_file(path) for path in paths)


def is_stub_file(path: str) -> bool:
    """Whether a library file holds the stub's banner (the real library is a few MB at most)."""
    try:
        with open(path, "rb") as lib:
            return _STUB_BANNER in lib.read(64 * 1024 * 1024)
    except OSError:
        return False


class _Captured:
    def __init__(self) -> None:
        self.data = b""

    def replay(self) -> None:
        # Whatever else reached stdout while we listened goes out again: nothing is lost.
        if self.data:
            with contextlib.suppress(OSError):
                os.write(1, self.data)


@contextlib.contextmanager
def _capture_stdout() -> Iterator[_Captured]:
    """Collect what is written to file descriptor 1 meanwhile.

    The stub libnvidia-ml prints a banner on stdout; inside ``torchdoctor run`` that stdout is
    the user's terminal or log, so the banner is kept off it and used as evidence instead.
    """
    captured = _Captured()
    try:
        saved = os.dup(1)
    except OSError:
        yield captured
        return
    with tempfile.TemporaryFile() as sink:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.dup2(sink.fileno(), 1)
        try:
            yield captured
        finally:
            _flush_c_stdio()
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            captured.data = sink.read()


def _flush_c_stdio() -> None:
    # C code (the stub) writes through libc's buffered stdout; flush it into our capture.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)
