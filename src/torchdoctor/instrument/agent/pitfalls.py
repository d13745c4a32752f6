"""What the agent records for the distributed-mistake rules (data-not-sharded,
batchnorm-not-synced, accumulation-without-no-sync, unused-parameters-search,
dataparallel-used): a few counters on paths the agent already wraps, and events that are
rare by construction.

- ``ddp-model`` (once, at the first DDP forward): BatchNorm and SyncBatchNorm layers of the
  wrapped module, ``find_unused_parameters``, ``static_graph``;
- ``ddp-sync-pattern`` (after 4, 8, 16... steps: the last one holds the running totals):
  forward passes under grad per optimizer step and how many of them DDP synchronised
  (``require_backward_grad_sync``, which ``no_sync()`` turns off), steps that accumulated,
  DDP's ``unused_parameter_size`` and, only where ``find_unused_parameters`` searches, the time
  DDP's ``_post_forward`` (the graph search) took;
- ``data-fingerprint`` (once per epoch of a training loader): see :mod:`.fingerprints`;
- ``data-parallel`` (each ``nn.DataParallel`` built, in any process): its devices.
- ``grad-scaler-skip`` (a GradScaler skipped ``optimizer.step()`` on inf/NaN gradients, any
  process): the scaler's calls and skips so far, and its factors.

Counting costs a few integer operations per forward and per step; the only wrapper added per
forward (``_post_forward`` timing) is set on the DDP instance, and only when its search is on.
"""

from __future__ import annotations

from .contract import perf_ns

# ddp-sync-pattern after this many steps, then each time the count doubles: the last event
# covers at least half of the run, and a week-long job sends a few dozen.
_PATTERN_FIRST = 4


class DdpChecks:
    """Per-rank counters of :class:`.ranks.RankInstrument`'s forward and step hooks."""

    def __init__(self, agent, torch) -> None:
        self.agent = agent
        self.torch = torch
        self.model_sent = False
        self.forwards = 0  # forward passes under grad in the step under way
        self.synced = 0  # ... of which DDP prepared an all-reduce
        self.steps = 0
        self.accumulating_steps = 0  # steps of more than one forward under grad
        self.micro_steps = 0  # their forwards
        self.synced_micro_steps = 0  # ... of which synchronised
        self.next_pattern = _PATTERN_FIRST
        self.search_ns = 0  # DDP _post_forward time where find_unused_parameters searches
        self.searches = 0
        self.ddp = None  # the DDP module (weakref), set by the first forward

    # -- forward ----------------------------------------------------------------------------

    def on_forward(self, module) -> None:
        if not self.model_sent:
            self.model_sent = True
            self._send_model(module)
        if self.torch.is_grad_enabled():
            self.forwards += 1
            if getattr(module, "require_backward_grad_sync", True):
                self.synced += 1

    def _send_model(self, module) -> None:
        import weakref

        self.ddp = weakref.ref(module)
        nn = self.torch.nn
        batch_norm = getattr(nn.modules.batchnorm, "_BatchNorm", ())
        sync_cls = getattr(nn, "SyncBatchNorm", ())
        plain: list[str] = []
        synced = 0
        inner = getattr(module, "module", module)
        for name, child in inner.named_modules():
            if isinstance(child, sync_cls):
                synced += 1
            elif isinstance(child, batch_norm):
                plain.append(f"{name or type(child).__name__} ({type(child).__name__})")
        find_unused = bool(getattr(module, "find_unused_parameters", False))
        static_graph = bool(getattr(module, "static_graph", False))
        self.agent.event(
            "ddp-model",
            {
                "rank": self.agent.rank,
                "batchnorm_layers": len(plain),
                "batchnorm_names": plain[:5],
                "syncbatchnorm_layers": synced,
                "find_unused_parameters": find_unused,
                "static_graph": static_graph,
                "step": self.agent.step,
            },
        )
        if find_unused and not static_graph and "_post_forward" not in module.__dict__:
            self._time_search(module)

    def _time_search(self, module) -> None:
        """Time DDP's ``_post_forward`` on this instance: with find_unused_parameters it walks
        the autograd graph from the outputs (``prepare_for_backward``), which is the cost the
        rule unused-parameters-search reports. Set on the instance, removed if it fails."""
        original = module._post_forward
        checks = self

        def _post_forward(output):
            if not checks.agent.active:
                return original(output)
            t0 = perf_ns()
            try:
                return original(output)
            finally:
                checks.search_ns += perf_ns() - t0
                checks.searches += 1

        module._post_forward = _post_forward

    # -- step ---------------------------------------------------------------------------

    def step_closed(self) -> None:
        forwards = self.forwards
        if forwards > 1:
            self.accumulating_steps += 1
            self.micro_steps += forwards
            self.synced_micro_steps += self.synced
        self.forwards = self.synced = 0
        self.steps += 1
        if self.steps >= self.next_pattern:
            self.next_pattern *= 2
            self._send_pattern()

    def _send_pattern(self) -> None:
        detail = {
            "rank": self.agent.rank,
            "steps": self.steps,
            "accumulating_steps": self.accumulating_steps,
            "micro_steps": self.micro_steps,
            "synced_micro_steps": self.synced_micro_steps,
            "search_ns": self.search_ns if self.searches else None,
            "searches": self.searches,
            "unused_parameter_size": None,
        }
        ddp = self.ddp() if self.ddp is not None else None
        if ddp is not None:
            data = ddp._get_ddp_logging_data()
            detail["unused_parameter_size"] = data.get("unused_parameter_size", 0)
            detail["find_unused_parameters"] = bool(data.get("find_unused_parameters"))
        self.agent.event("ddp-sync-pattern", detail)

    # -- loaders ------------------------------------------------------------------------

    def tap_loader(self, it, loader_id, epoch, training: bool) -> None:
        """Fingerprint this epoch's first batches (training loaders only: an evaluation loader
        left whole on every rank is common and harmless)."""
        if not training:
            return
        agent = self.agent

        def emit(kind, digest, batches, samples, first) -> None:
            agent.event(
                "data-fingerprint",
                {"rank": agent.rank, "loader_id": loader_id, "epoch": epoch, "kind": kind,
                 "digest": digest, "batches": batches, "samples": samples, "first": first,
                 "step": agent.step},
            )  # fmt: skip

        def fail(exc: Exception) -> None:
            agent.disable("data-fingerprint", exc)

        from . import fingerprints  # ranks only: not loaded into every process with torch

        fingerprints.tap(it, emit, fail, lambda: agent.active)


# -- nn.DataParallel, in every process ---------------------------------------------------------


def install_data_parallel(agent, torch, guard) -> None:
    """Patch ``nn.DataParallel.__init__`` to send a ``data-parallel`` event (any process: a
    DataParallel job is usually one process, not a torchrun rank)."""
    dp_cls = getattr(getattr(torch.nn, "parallel", None), "DataParallel", None)
    if dp_cls is None or "__init__" not in dp_cls.__dict__:
        return
    original = dp_cls.__init__

    def built(module) -> None:
        ids = list(getattr(module, "device_ids", None) or [])
        agent.event(
            "data-parallel",
            {"device_ids": [str(d) for d in ids], "devices": len(ids),
             "module": type(getattr(module, "module", module)).__name__,
             "rank": agent.rank, "step": agent.step},
        )  # fmt: skip

    built = guard(agent, "data-parallel", built)

    def __init__(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if agent.active:
            built(self)
        return result

    __init__.__wrapped__ = original
    agent.patch(dp_cls, "__init__", __init__)


# -- GradScaler's skipped steps, in every process ----------------------------------------------

_SKIP_WARMUP = 20  # the first scaler steps calibrate the scale down from 65536: skips expected
_SKIPS_SENT_EACH = 16  # an event for each of the first skips, then at powers of 2


def install_grad_scaler(agent, torch, guard) -> None:
    """Patch ``GradScaler._maybe_opt_step``, where the scaler (having read ``found_inf`` with
    its own ``.item()``) runs or skips ``optimizer.step()``: a skip leaves the agent's step
    count where it was. No tensor is read here, so no device sync is added. A
    ``grad-scaler-skip`` event goes out for the first skips, then at powers of 2."""
    scaler_mod = getattr(getattr(torch, "amp", None), "grad_scaler", None)
    scaler_cls = getattr(scaler_mod, "GradScaler", None)
    if scaler_cls is None or "_maybe_opt_step" not in scaler_cls.__dict__:
        return
    original = scaler_cls._maybe_opt_step
    counts = {"calls": 0, "skipped": 0, "late": 0}

    def skipped(scaler) -> None:
        counts["skipped"] += 1
        if counts["calls"] > _SKIP_WARMUP:
            counts["late"] += 1
        n = counts["skipped"]
        if n <= _SKIPS_SENT_EACH or n & (n - 1) == 0:
            agent.event(
                "grad-scaler-skip",
                {"calls": counts["calls"], "skipped": n, "skipped_after_warmup": counts["late"],
                 "warmup_calls": _SKIP_WARMUP, "step": agent.step, "rank": agent.rank,
                 "init_scale": getattr(scaler, "_init_scale", None),
                 "backoff_factor": getattr(scaler, "_backoff_factor", None),
                 "growth_factor": getattr(scaler, "_growth_factor", None),
                 "growth_interval": getattr(scaler, "_growth_interval", None)},
            )  # fmt: skip

    skipped = guard(agent, "grad-scaler-skip", skipped)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        if not agent.active:
            return original(self, optimizer, optimizer_state, *args, **kwargs)
        before = agent.step
        result = original(self, optimizer, optimizer_state, *args, **kwargs)
        counts["calls"] += 1
        if agent.active and agent.step == before:
            skipped(self)
        return result

    _maybe_opt_step.__wrapped__ = original
    agent.patch(scaler_cls, "_maybe_opt_step", _maybe_opt_step)
