"""Fingerprints of the samples a rank draws: the first batches of each epoch, hashed.

The rule data-not-sharded compares them across ranks: two ranks whose first batches hash alike
drew the same samples (no DistributedSampler, one built with the wrong rank or num_replicas, an
IterableDataset that does not split by rank). Built by :mod:`.ranks` when a rank starts an
epoch of a DataLoader; only the first :data:`FINGERPRINT_BATCHES` batches are looked at, then
the iterator's own objects are put back, so the rest of the epoch pays nothing.

- Map-style datasets: the index lists the sampler (or batch sampler) yields, read where the
  iterator takes them (its ``_sampler_iter``). A multi-worker iterator has already taken its
  prefetched indices when the epoch starts, so the fingerprint starts after them: the same
  offset on every rank of one script, which is all a comparison needs.
- Iterable datasets (no indices): the first values of the batches' tensors, read where the
  iterator returns them (its ``_next_data``, set on the instance and deleted afterwards).

Digests are hashlib's (``hash()`` of a string differs between processes). Any failure puts the
iterator back as it was and switches the agent off through ``fail`` (never the user's error).
"""

from __future__ import annotations

import hashlib

FINGERPRINT_BATCHES = 4  # batches hashed at the start of each epoch
_VALUES_PER_TENSOR = 256  # values of each batch tensor hashed (iterable datasets)
_TENSORS_PER_BATCH = 4


def tap(iterator, emit, fail, active) -> bool:
    """Start fingerprinting ``iterator``'s epoch; ``emit(kind, digest, batches, samples,
    first)`` is called once when it is done, ``fail(exc)`` on an error, and ``active()`` says
    whether the agent still runs. False when the iterator has neither place to look at, or
    is not one of torch's own: a subclass elsewhere (torchdata's StatefulDataLoader) may read
    or save its ``_sampler_iter`` itself, and must find its own object there."""
    if type(iterator).__module__ != "torch.utils.data.dataloader":
        return False
    if getattr(iterator, "_dataset_kind", None) == 1:  # _DatasetKind.Iterable
        DataTap(iterator, emit, fail, active)
        return True
    inner = getattr(iterator, "_sampler_iter", None)
    if inner is None:
        return False
    iterator._sampler_iter = IndexTap(iterator, inner, emit, fail, active)
    return True


class _Tap:
    """What both taps share: the running hash, its counts, and the hand-over of each item
    (``_pass``), which never lets an error of its own reach the user's loop."""

    __slots__ = ("owner", "emit", "fail", "active", "hasher", "batches", "samples", "first")
    KIND = ""

    def __init__(self, owner, emit, fail, active) -> None:
        self.owner = owner
        self.emit = emit
        self.fail = fail
        self.active = active
        self.hasher = hashlib.blake2b(digest_size=8)
        self.batches = 0
        self.samples = 0
        self.first: list | None = None

    def _pass(self, fetch):
        try:
            item = fetch()
        except StopIteration:
            # An epoch shorter than FINGERPRINT_BATCHES: what it drew is its fingerprint.
            self._finish(self.batches > 0)
            raise
        try:
            if not self.active():
                self._restore()
            else:
                self._take(item)
                self.batches += 1
                if self.batches >= FINGERPRINT_BATCHES:
                    self._finish(True)
        except Exception as exc:
            self._restore()
            self.fail(exc)
        return item

    def _finish(self, send: bool) -> None:
        try:
            self._restore()
            if send and self.active():
                digest = self.hasher.hexdigest()
                self.emit(self.KIND, digest, self.batches, self.samples, self.first)
        except Exception as exc:
            self.fail(exc)

    def _take(self, item) -> None:
        raise NotImplementedError

    def _restore(self) -> None:
        raise NotImplementedError


class IndexTap(_Tap):
    """Stands in for an iterator's ``_sampler_iter``: passes each index list on, hashing the
    first ones, then puts the sampler's own iterator back."""

    __slots__ = ("inner",)
    KIND = "indices"

    def __init__(self, owner, inner, emit, fail, active) -> None:
        super().__init__(owner, emit, fail, active)
        self.inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        return self._pass(self.inner.__next__)

    def _take(self, item) -> None:
        values = item.tolist() if hasattr(item, "tolist") else item
        if not isinstance(values, list):
            values = [values]
        self.hasher.update(repr(values).encode())
        self.samples += len(values)
        if self.first is None:
            self.first = values[:4]

    def _restore(self) -> None:
        if self.owner.__dict__.get("_sampler_iter") is self:
            self.owner._sampler_iter = self.inner


class DataTap(_Tap):
    """Set as the iterator instance's ``_next_data``: hashes the first batches' tensor values,
    then deletes itself so the class's method serves the rest of the epoch."""

    __slots__ = ("original",)
    KIND = "data"

    def __init__(self, owner, emit, fail, active) -> None:
        super().__init__(owner, emit, fail, active)
        self.original = owner._next_data
        owner._next_data = self

    def __call__(self):
        return self._pass(self.original)

    def _take(self, batch) -> None:
        tensors = _tensors(batch, [])
        for t in tensors:
            flat = t.detach().reshape(-1)[:_VALUES_PER_TENSOR].tolist()
            self.hasher.update(repr((tuple(t.shape), flat)).encode())
        if tensors:
            shape = tensors[0].shape
            self.samples += int(shape[0]) if len(shape) else 1
            if self.first is None:
                self.first = tensors[0].detach().reshape(-1)[:4].tolist()

    def _restore(self) -> None:
        if self.owner.__dict__.get("_next_data") is self:
            del self.owner._next_data


def _tensors(batch, out: list) -> list:
    """The first tensors of a collated batch (tensors, lists, tuples, dicts), depth-first."""
    if len(out) >= _TENSORS_PER_BATCH:
        return out
    if hasattr(batch, "reshape") and hasattr(batch, "tolist") and hasattr(batch, "shape"):
        out.append(batch)
    elif isinstance(batch, dict):
        for value in list(batch.values())[:_TENSORS_PER_BATCH]:
            _tensors(value, out)
    elif isinstance(batch, (list, tuple)):
        for value in batch[:_TENSORS_PER_BATCH]:
            _tensors(value, out)
    return out
