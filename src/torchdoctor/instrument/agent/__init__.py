"""The agent that runs inside the user's job: hooks torch, buffers records, ships them out.

This package is standard-library only on purpose: the bootstrap (``sitecustomize``) loads it
by path as the package ``_torchdoctor_agent`` into whatever Python the job runs, which need not
be the one that has torchdoctor installed; its modules import each other relatively, so they
load under either name. It never imports torch itself: :meth:`Agent.arm` waits for the user's
code to import torch and only then patches it.

Every Python process of a job loads it, and most never import torch, so start-up loads only
what waiting needs (this module and the import watch: the agent itself is built when torch is
imported, unless the environment asks for overrides or a stop rule, which it records at once);
the rest loads with torch:

- this module: the lazy names, the deferred build and the finder that sees torch imported
  (``TorchImportFinder``) (start-up);
- :mod:`.contract`: wire version, step fields, environment variables, overrides;
- :mod:`.sink`: the connection to the collector;
- :mod:`.core`: ``Agent``, the per-process state: lifecycle, patch registry, record buffers,
  flush, fork and exit;
- :mod:`.hooks`: what is patched in torch, the wrappers and their one guard (with torch);
- :mod:`.steps`: step boundaries, data wait, samples, backward-only loops (with torch);
- :mod:`.evaluation`: evaluation passes between steps, plain arithmetic (with torch);
- :mod:`.loaders`: DataLoader records, tune's overrides, worker processes (with torch);
- :mod:`.settings`: the job's settings, role and thread override (with torch);
- :mod:`.cuda`: CUDA memory per step and out-of-memory events (with torch);
- :mod:`.ranks`: what each rank of a torchrun job adds (with torch, in ranks only).

Safety: every hook body runs guarded (:func:`.hooks.guard`); the first exception switches the
agent off for the process (patches restored), is recorded once as an
``instrumentation-disabled`` event and never reaches the user's code. The agent never writes
to stdout or stderr.

Records leave the process in batches (at most every ``FLUSH_INTERVAL_S`` seconds or
``FLUSH_MAX_STEPS`` steps, from the step hook: no thread) as JSON messages over a Unix
``SOCK_SEQPACKET`` connection to the collector, or to in-process sinks (``watch``).
"""

import os
import sys

# Every name below loads its module on first use (PEP 562): a process that never imports torch
# loads only this module.
_LAZY = {
    **dict.fromkeys(
        (
            "BACKWARD_STEPS_TO_DECIDE",
            "ENV_COLLECTOR",
            "ENV_NO_INSTRUMENT",
            "ENV_OVERRIDES",
            "ENV_STOP_AFTER_STEPS",
            "FLUSH_INTERVAL_S",
            "FLUSH_MAX_STEPS",
            "MAX_PENDING_MESSAGES",
            "OVERRIDE_TYPES",
            "STEP_FIELDS",
            "STOPPED_EXIT_STATUS",
            "WIRE_VERSION",
            "env_flag",
            "parse_overrides",
        ),
        "contract",
    ),
    "Agent": "core",
    "SocketSink": "sink",
}

__all__ = ["AGENT", "arm_from_env", *_LAZY]

# The variables that make start-up build the agent at once (contract.ENV_NO_INSTRUMENT,
# ENV_OVERRIDES, ENV_STOP_AFTER_STEPS; a test keeps them equal): what they say is recorded as
# events even in a process that never imports torch. Without them, nothing the agent does
# before torch is imported can be seen, so it is built then.
_BUILD_NOW_IF_SET = (
    "TORCHDOCTOR_NO_INSTRUMENT",
    "TORCHDOCTOR_OVERRIDES",
    "TORCHDOCTOR_STOP_AFTER_STEPS",
)
# What a deferred agent reads of its start-up: the environment as it was then.
_START_UP_ENV = ("TORCHDOCTOR_COLLECTOR", "RANK")
_deferred: list = []  # [(environment, perf_counter_ns, finder)] while the agent waits for torch


def __getattr__(name: str):
    if name == "AGENT":
        return _agent()
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    __import__(f"{__name__}.{module}")
    value = getattr(sys.modules[f"{__name__}.{module}"], name)
    globals()[name] = value
    return value


def _agent():
    """The process's ``Agent``, built on first use; a start-up that deferred it is finished
    now, as it would have been then (its environment, its flush clock, its process hooks)."""
    agent = globals().get("AGENT")
    if agent is not None:
        return agent
    from .core import Agent

    agent = Agent()
    globals()["AGENT"] = agent
    if _deferred:
        environ, started_ns, finder = _deferred.pop()
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        # The start-up registered the fork and exit hooks (in their order among the program's
        # own): they call this agent now.
        agent._fork_registered = agent._atexit_registered = True
        agent.last_flush = started_ns
        try:
            agent.rank = int(environ["RANK"])
        except (KeyError, ValueError):
            agent.rank = None
        if agent.configure_from_env(environ):
            agent.arm()
    return agent


def _after_fork() -> None:
    agent = globals().get("AGENT")
    if agent is not None:
        agent._after_fork()


def _at_exit() -> None:
    agent = globals().get("AGENT")
    if agent is not None:
        agent._at_exit()


def _torch_imported(torch) -> None:
    _agent()  # arms it: torch is in sys.modules, so it installs at once


# The import watch lives here, not in a module of its own: one module fewer to find and load in
# every process of the job.


class TorchImportFinder:
    """A meta-path finder that lets the real finders load torch, then calls ``on_loaded``."""

    def __init__(self, on_loaded) -> None:
        self.on_loaded = on_loaded
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" or self._busy:
            return None
        import importlib.util

        self._busy = True
        try:
            spec = importlib.util.find_spec("torch")
        except Exception:
            return None
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _NotifyingLoader(spec.loader, self.on_loaded)
        return spec


class _NotifyingLoader:
    def __init__(self, loader, on_loaded) -> None:
        self._loader = loader
        self._on_loaded = on_loaded

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # torch sees its own loader, as without torchdoctor.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._on_loaded(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def arm_from_env() -> bool:
    """Entry point of the bootstrap: arm the agent unless the environment says no."""
    environ = os.environ
    if "AGENT" in globals() or "torch" in sys.modules or any(map(environ.get, _BUILD_NOW_IF_SET)):
        agent = _agent()
        if not agent.configure_from_env():
            return False
        agent.arm()
        return True
    # Nothing to do until torch is imported: wait for it with the import watch alone.
    import atexit
    import time

    finder = TorchImportFinder(_torch_imported)
    snapshot = {k: environ[k] for k in _START_UP_ENV if k in environ}
    _deferred.append((snapshot, time.perf_counter_ns(), finder))
    os.register_at_fork(after_in_child=_after_fork)
    atexit.register(_at_exit)
    sys.meta_path.insert(0, finder)
    return True
