"""torchdoctor's bootstrap, put first on PYTHONPATH by ``torchdoctor run`` for the job.

Python imports ``sitecustomize`` at start-up. This one loads the torchdoctor agent (standard
library only) and arms it: nothing happens until the program imports torch. Then it runs the
``sitecustomize`` that would have been imported without torchdoctor, if there is one.
It never prints and never lets an exception out: the program must start exactly as it would.
"""


def _torchdoctor_bootstrap():
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        if "_torchdoctor_agent" not in sys.modules:
            import importlib.util

            path = os.path.join(os.path.dirname(here), "agent.py")
            spec = importlib.util.spec_from_file_location("_torchdoctor_agent", path)
            agent = importlib.util.module_from_spec(spec)
            sys.modules["_torchdoctor_agent"] = agent
            spec.loader.exec_module(agent)
            agent.arm_from_env()
    except Exception:
        sys.modules.pop("_torchdoctor_agent", None)
    _chain_sitecustomize(here)


def _chain_sitecustomize(here):
    import importlib.machinery
    import importlib.util
    import os
    import sys

    search = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", search)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    # The chained module's own errors behave as they would without torchdoctor: site.py
    # reports them the same way ("Error in sitecustomize") and carries on.
    spec.loader.exec_module(module)


_torchdoctor_bootstrap()
