"""torchdoctor's bootstrap, put first on PYTHONPATH by ``torchdoctor run`` for the job.

Python imports ``sitecustomize`` at start-up. This one arms the torchdoctor agent (a package of
the standard library only, loaded by path as ``_torchdoctor_agent``): nothing happens until the
program imports torch. Then it runs the ``sitecustomize`` that would have been imported without
torchdoctor, if there is one.

Every Python process of the job runs this and most never import torch, so start-up loads none
of the agent: it leaves a finder that loads the agent when the program first looks torch up
(:class:`_AgentOnTorch`), and hands the search to the agent's own import watch. An environment
that asks for overrides or a stop rule builds the agent at once (they are recorded even in a
process that never imports torch).
It never prints and never lets an exception of its own out: the program starts as it would.
It imports nothing that start-up has not, but the built-in ``atexit``.
"""

_AGENT = "_torchdoctor_agent"
# The variables that make start-up build the agent at once (contract.ENV_NO_INSTRUMENT,
# ENV_OVERRIDES, ENV_STOP_AFTER_STEPS; a test keeps them equal).
_BUILD_NOW_IF_SET = (
    "TORCHDOCTOR_NO_INSTRUMENT",
    "TORCHDOCTOR_OVERRIDES",
    "TORCHDOCTOR_STOP_AFTER_STEPS",
)
# What an agent built later reads of its start-up: the environment as it was then.
_START_UP_ENV = (
    "TORCHDOCTOR_COLLECTOR",
    "RANK",
    "TORCHDOCTOR_PROFILE_STEPS",
    "TORCHDOCTOR_PROFILE_DIR",
)


def _torchdoctor_bootstrap():
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    environ = os.environ
    if "TORCHDOCTOR_DIE_WITH" in environ:  # contract.ENV_DIE_WITH: torchrun under launch
        _die_with(environ.pop("TORCHDOCTOR_DIE_WITH"))
    flag = environ.get("TORCHDOCTOR_NO_INSTRUMENT", "").strip().lower()
    try:
        if flag in ("", "0", "false", "no", "off") and _AGENT not in sys.modules:
            folder = os.path.join(os.path.dirname(here), "agent")
            if "torch" in sys.modules or any(map(environ.get, _BUILD_NOW_IF_SET)):
                _load_agent(folder).arm_from_env()
            else:
                _wait_for_torch(folder, environ)
    except Exception:
        _unload_agent()
    _chain_sitecustomize(here)


def _die_with(launcher):
    """SIGTERM this process when ``launcher`` (its parent, a PID) dies, even by SIGKILL: the
    kernel's PR_SET_PDEATHSIG, which lasts through exec but not into children (the variable
    is gone from the environment they get). torchrun stops its ranks on SIGTERM. A launcher
    already gone when this runs sends nothing: the signal is sent here at once."""
    import os

    try:
        import ctypes

        launcher = int(launcher)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, 15, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGTERM
        if os.getppid() != launcher:  # reparented, or started through a wrapper: ask
            try:
                os.kill(launcher, 0)
            except ProcessLookupError:
                os.kill(os.getpid(), 15)
    except Exception:
        pass  # never in the program's way: without it the job starts as it would


def _wait_for_torch(folder, environ):
    import atexit
    import os
    import sys
    import time

    snapshot = {k: environ[k] for k in _START_UP_ENV if k in environ}
    finder = _AgentOnTorch(folder, (snapshot, time.perf_counter_ns()))
    # Registered now, in their order among the program's own: the agent, once built, is
    # forked and flushed at exit as an agent armed at start-up is.
    os.register_at_fork(after_in_child=_after_fork)
    atexit.register(_at_exit)
    sys.meta_path.insert(0, finder)


class _AgentOnTorch:
    """A meta-path finder that loads the agent when torch is first looked up and answers with
    the agent's import watch, which builds and installs the agent once torch is loaded.

    ``torchdoctor_start_up`` is what the agent takes (and removes this finder) when it is
    built: the start-up's environment and its clock."""

    def __init__(self, folder, start_up):
        self.folder = folder
        self.torchdoctor_start_up = start_up
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" or self._busy:
            return None
        import sys

        agent = sys.modules.get(_AGENT)
        if agent is None:
            try:
                agent = _load_agent(self.folder)
            except Exception:
                _unload_agent()
                return None
        self._busy = True  # the agent's watch looks torch up through sys.meta_path again
        try:
            return agent.TorchImportFinder(agent.torch_imported).find_spec(fullname, path, target)
        except Exception:
            return None
        finally:
            self._busy = False


def _after_fork():
    import sys

    agent = sys.modules.get(_AGENT)
    if agent is not None:
        agent.after_fork()


def _at_exit():
    import sys

    agent = sys.modules.get(_AGENT)
    if agent is not None:
        agent.at_exit()


def _load_agent(folder):
    import os
    import sys

    SourceFileLoader, _ = _machinery()
    # The agent is a package: its modules import each other relatively, and with __path__ and
    # __package__ set they load as _torchdoctor_agent.<name>.
    path = os.path.join(folder, "__init__.py")
    loader = SourceFileLoader(_AGENT, path)
    agent = type(sys)(_AGENT)
    agent.__file__ = path
    agent.__loader__ = loader
    agent.__path__ = [folder]
    agent.__package__ = _AGENT
    sys.modules[_AGENT] = agent
    loader.exec_module(agent)
    return agent


def _unload_agent():
    import sys

    for name in [n for n in sys.modules if n.partition(".")[0] == _AGENT]:
        sys.modules.pop(name, None)


def _machinery():
    """(SourceFileLoader, PathFinder), from the import system Python has already loaded:
    ``importlib.machinery`` would import ``importlib`` and ``warnings`` into every process."""
    try:
        from _frozen_importlib_external import PathFinder, SourceFileLoader
    except ImportError:  # not CPython
        from importlib.machinery import PathFinder, SourceFileLoader
    return SourceFileLoader, PathFinder


def _chain_sitecustomize(here):
    import os
    import sys

    _, PathFinder = _machinery()

    search = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = PathFinder.find_spec("sitecustomize", search)
    if spec is None or spec.loader is None:
        return
    import importlib.util

    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    # The chained module's own errors behave as they would without torchdoctor: site.py
    # reports them the same way ("Error in sitecustomize") and carries on.
    spec.loader.exec_module(module)


_torchdoctor_bootstrap()
