"""DataLoaders as the agent records them: their configuration, epochs and first-batch latency,
tune's overrides applied to ``DataLoader.__init__``, and the worker processes, which report
their own settings and never steps. Loaded once torch is imported."""

from __future__ import annotations

import os

from .contract import DATALOADER_OVERRIDES, WORKER, now, qualname
from .sidetable import SideTable


class LoaderInfo:
    __slots__ = ("loader_id", "record", "sent", "epochs", "batch_size", "dataset_id")

    def __init__(
        self, loader_id: int, record: dict, batch_size: int | None, dataset_id: int
    ) -> None:
        self.loader_id = loader_id
        self.record = record
        self.sent = False
        self.epochs = 0
        self.batch_size = batch_size
        self.dataset_id = dataset_id  # id() of its dataset: a loader built over another's


class Loaders:
    """The DataLoaders of this process; records go to ``agent.loaders`` once complete."""

    # How many iterators still await their first batch is the counter's first_batches_due:
    # every batch reads it, on the compiled path as a C integer.
    __slots__ = (
        "agent", "iterable_dataset", "info_of", "first_of", "pass_of", "batch_size_of",
        "pending", "next_id", "iterated_datasets",
    )  # fmt: skip

    def __init__(self, agent, torch) -> None:
        self.agent = agent
        self.iterable_dataset = torch.utils.data.IterableDataset
        # Kept beside the user's objects (see SideTable), for the objects' lifetime: a forked
        # child finds its parent's loaders known, as the parent left them.
        self.info_of = SideTable()  # DataLoader -> LoaderInfo
        self.first_of = SideTable()  # iterator -> (LoaderInfo, t_iter): first batch to come
        self.pass_of = SideTable()  # iterator -> evaluation.PassStart of a training pass
        self.batch_size_of = SideTable()  # iterator of an evaluation pass -> its batch size
        self.reset()

    def reset(self) -> None:
        self.pending: list[LoaderInfo] = []  # built, first batch still to come
        self.next_id = 0
        self.iterated_datasets: set[int] = set()  # id() of the datasets of loaders iterated

    def on_created(self, loader) -> None:
        dataset = loader.dataset
        try:
            dataset_len = len(dataset)
        except Exception:
            dataset_len = None  # IterableDataset without __len__, or a failing __len__
        # `is None`, never truthiness: bool() of a sampler without __bool__ calls its len(),
        # which an IterableDataset's BatchSampler(_InfiniteConstantSampler) raises from (and
        # a user's sampler may compute at a cost).
        sampler = getattr(loader, "batch_sampler", None)
        if sampler is None:
            sampler = getattr(loader, "sampler", None)
        sampler_type = type(loader.sampler).__name__ if loader.sampler is not None else None
        if sampler is not None and getattr(loader, "batch_size", None) is None:
            sampler_type = type(sampler).__name__
        record = {
            "loader_id": self.next_id,
            "t": now(),
            "batch_size": loader.batch_size,
            "num_workers": loader.num_workers,
            "pin_memory": bool(loader.pin_memory),
            "persistent_workers": bool(loader.persistent_workers),
            "prefetch_factor": loader.prefetch_factor if loader.num_workers > 0 else None,
            "drop_last": bool(loader.drop_last),
            "multiprocessing_context": _start_method(loader),
            "dataset_type": qualname(dataset),
            "dataset_len": dataset_len,
            "sampler_type": sampler_type,
            "first_batch_s": None,
        }
        info = LoaderInfo(self.next_id, record, loader.batch_size, id(dataset))
        self.next_id += 1
        self.info_of.set(loader, info)
        self.pending.append(info)

    def on_iter(self, loader, it, t_iter: int) -> None:
        info = self.info_of.get(loader)
        if info is None:
            # Built before the agent was installed (watch() started after the DataLoader).
            self.on_created(loader)
            info = self.info_of.get(loader)
            if info is None:  # a loader that takes no weak reference
                return
        agent = self.agent
        counter = agent.counter
        # The detail as JSON by hand (see Agent.event_json); its three values are ints.
        detail = f'{{"loader_id":{info.loader_id},"epoch":{info.epochs},"step":{counter.step}'
        if counter.on_step_thread():
            evaluating = not counter.grad_enabled()
            counter.on_pass_start(it, t_iter, info.batch_size, evaluating)
            if evaluating:
                detail += ',"evaluation":true'
        else:
            counter.loader_batch_size = info.batch_size
        agent.event_json("epoch-start", detail + "}")
        info.epochs += 1
        self.iterated_datasets.add(info.dataset_id)
        if not info.sent and it not in self.first_of:
            self.first_of.set(it, (info, t_iter))
            if it in self.first_of:
                counter.first_batches_due += 1

    def first_batch(self, it, t_end: int) -> None:
        first = self.first_of.pop(it)
        if first is not None:
            self.agent.counter.first_batches_due -= 1
            info, t_iter = first
            info.record["first_batch_s"] = (t_end - t_iter) / 1e9
            self.emit(info)

    def emit(self, info: LoaderInfo) -> None:
        if info.sent:
            return
        info.sent = True
        if info in self.pending:
            self.pending.remove(info)
        record = info.record
        if record["num_workers"] > 0 and record["multiprocessing_context"] is None:
            import multiprocessing

            # Workers have started by now, so this is the method they were started with.
            record["multiprocessing_context"] = multiprocessing.get_start_method(allow_none=True)
        self.agent.loaders.append(record)

    def emit_pending(self) -> None:
        """Send the loaders whose first batch never came (at exit, at uninstall), except one
        never iterated over the dataset of a loader that was: a wrapper built from it took
        its place (accelerate's DataLoaderShard from the HF Trainer's loader) and the job's
        one loader would be listed twice."""
        for info in list(self.pending):
            if info.epochs == 0 and info.dataset_id in self.iterated_datasets:
                self.pending.remove(info)
                continue
            self.emit(info)

    def apply_overrides(self, init, args: tuple, kwargs: dict):
        """Return (args, kwargs, changes) for DataLoader.__init__ with tune's overrides."""
        import inspect

        agent = self.agent
        bound = inspect.signature(init).bind(*args, **kwargs)
        arguments = bound.arguments
        changes = {}
        user_workers = arguments.get("num_workers", 0)
        iterable = isinstance(arguments.get("dataset"), self.iterable_dataset)
        for key in DATALOADER_OVERRIDES:
            if key not in agent.overrides:
                continue
            if key == "num_workers" and iterable and user_workers == 0:
                # An IterableDataset that was never split across workers would yield every
                # sample once per worker: more workers would change what the job trains on.
                agent.event("override-skipped", {"num_workers": "iterable dataset, no workers"})
                continue
            arguments[key] = agent.overrides[key]
            changes[key] = agent.overrides[key]
        if not changes:
            return args, kwargs, changes
        if arguments.get("num_workers", 0) == 0:
            # Multiprocessing-only options are rejected without workers.
            arguments["prefetch_factor"] = None
            arguments["persistent_workers"] = False
        return bound.args, bound.kwargs, changes

    def enter_worker(self, worker_id, num_workers) -> None:
        """This process is a DataLoader worker: it reports its settings, never steps."""
        agent = self.agent
        agent.role = WORKER
        agent.threads_override_pending = False
        agent.event("dataloader-worker-start", {"worker_id": worker_id, "ppid": os.getppid()})
        agent.setting("process.role", agent.role)
        agent.setting("dataloader.worker_id", worker_id)
        agent.setting("dataloader.num_workers", num_workers)
        agent.setting("dataloader.parent_pid", os.getppid())
        import multiprocessing

        agent.setting("dataloader.start_method", multiprocessing.get_start_method(allow_none=True))
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            agent.setting(f"env.{name}", os.environ.get(name))


def _start_method(loader) -> str | None:
    context = loader.multiprocessing_context
    return context.get_start_method() if context is not None else None
