"""Waits for the program to import torch: a meta-path finder that lets the real finders load
torch, then calls back (the agent installs its hooks then, never before)."""


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
