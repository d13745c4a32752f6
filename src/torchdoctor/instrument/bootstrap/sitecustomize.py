"""torchdoctor's bootstrap, put first on PYTHONPATH by ``torchdoctor run`` for the job.

Python imports ``sitecustomize`` at start-up. This one loads the torchdoctor agent (standard
library only) and arms it: nothing happens until the program imports torch. Then it runs the
``sitecustomize`` that would have been imported without torchdoctor, if there is one.
It never prints and never lets an exception of its own out: the program starts as it would.
Every Python process of the job runs this, so it imports nothing that start-up has not.
"""


def _torchdoctor_bootstrap():
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    flag = os.environ.get("TORCHDOCTOR_NO_INSTRUMENT", "").strip().lower()
    try:
        if flag in ("", "0", "false", "no", "off") and "_torchdoctor_agent" not in sys.modules:
            SourceFileLoader, _ = _machinery()
            # The agent is a package: its modules import each other relatively, and with
            # __path__ and __package__ set they load as _torchdoctor_agent.<name>.
            folder = os.path.join(os.path.dirname(here), "agent")
            path = os.path.join(folder, "__init__.py")
            loader = SourceFileLoader("_torchdoctor_agent", path)
            agent = type(sys)("_torchdoctor_agent")
            agent.__file__ = path
            agent.__loader__ = loader
            agent.__path__ = [folder]
            agent.__package__ = "_torchdoctor_agent"
            sys.modules["_torchdoctor_agent"] = agent
            loader.exec_module(agent)
            agent.arm_from_env()
    except Exception:
        for name in [n for n in sys.modules if n.partition(".")[0] == "_torchdoctor_agent"]:
            sys.modules.pop(name, None)
    _chain_sitecustomize(here)


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
