"""The agent that runs inside the user's job: hooks torch, buffers records, ships them out.

This package is standard-library only on purpose: the bootstrap (``sitecustomize``) loads it
by path as the package ``_torchdoctor_agent`` into whatever Python the job runs, which need not
be the one that has torchdoctor installed; its modules import each other relatively, so they
load under either name. It never imports torch itself: :meth:`Agent.arm` waits for the user's
code to import torch and only then patches it.

Every Python process of a job runs the bootstrap, and most never import torch: the bootstrap
loads this package when the program first looks torch up (or at once when the environment asks
for overrides or a stop rule, which are recorded even without torch). This module holds the
lazy names, the import watch that arms the agent once torch is loaded (``TorchImportFinder``)
and the hand-over from the bootstrap; the rest loads with torch:

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

import sys

# Every name below loads its module on first use (PEP 562): a process that loads the agent and
# never imports torch (overrides, a stop rule, a program that only looks torch up) loads only
# this module.
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
    """The process's ``Agent``, built on first use; a start-up that waited for torch is
    finished now, as it would have been then (its environment, its flush clock)."""
    agent = globals().get("AGENT")
    if agent is not None:
        return agent
    from .core import Agent

    agent = Agent()
    globals()["AGENT"] = agent
    start_up = _take_start_up()
    if start_up is not None:
        environ, started_ns = start_up
        # The bootstrap registered the fork and exit hooks (in their order among the
        # program's own): they call this agent now.
        agent._fork_registered = agent._atexit_registered = True
        agent.last_flush = started_ns
        try:
            agent.rank = int(environ["RANK"])
        except (KeyError, ValueError):
            agent.rank = None
        if agent.configure_from_env(environ):
            agent.arm()
    return agent


def _take_start_up():
    """(environment, perf_counter_ns) of a start-up whose bootstrap waited for torch, taken
    once: its finder (``torchdoctor_start_up``) leaves sys.meta_path. None without one."""
    for finder in sys.meta_path:
        # Read from the instance's own dict: another finder's __getattr__ may answer anything.
        state = getattr(finder, "__dict__", None)
        start_up = state.get("torchdoctor_start_up") if isinstance(state, dict) else None
        if start_up is not None:
            sys.meta_path.remove(finder)
            return start_up
    return None


# The bootstrap's hand-over: it calls these through the module, by name.


def after_fork() -> None:
    agent = globals().get("AGENT")
    if agent is not None:
        agent._after_fork()


def at_exit() -> None:
    agent = globals().get("AGENT")
    if agent is not None:
        agent._at_exit()


def torch_imported(torch) -> None:
    _agent()  # arms it: torch is in sys.modules, so it installs at once


# The import watch lives here, not in a module of its own: one module fewer to find and load in
# every process that imports torch.


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
    """The bootstrap's entry point when start-up builds the agent at once (torch already
    imported, or overrides or a stop rule asked for): arm it unless the environment says no."""
    agent = _agent()
    if not agent.configure_from_env():
        return False
    agent.arm()
    return True
