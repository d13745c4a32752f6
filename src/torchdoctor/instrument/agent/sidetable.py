"""Values the agent keeps about the user's objects (a DataLoader's record, an iterator's pass),
held beside them rather than in them. Loaded once torch is."""

from __future__ import annotations

from _weakref import ref as weakref_ref


class SideTable:
    """Values keyed by the identity of live objects, each dropped when its object dies.

    Not an attribute on the object: writing a key into an instance's ``__dict__`` from outside
    its class turns its inline attribute values into a plain dict (CPython 3.11+), and every
    attribute read in the object's own methods falls off the interpreter's fast path for good
    (a DataLoader iterator's ``__next__`` reads a dozen: ~0.7 µs a batch on the build VM). Not
    a ``WeakKeyDictionary``: that hashes and compares the keys, which user classes may define.
    """

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: dict[int, tuple] = {}

    def get(self, obj, default=None):
        entry = self._items.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        return default

    def __contains__(self, obj) -> bool:
        return self.get(obj, _MISSING) is not _MISSING

    def set(self, obj, value) -> None:
        """Keep ``value`` for ``obj`` (nothing is kept for objects that take no weak
        reference: what needs it is then not recorded for them)."""
        key = id(obj)
        items = self._items
        try:
            # The callback runs while obj is being freed, before its id can be reused.
            ref = weakref_ref(obj, lambda _, key=key: items.pop(key, None))
        except TypeError:
            return
        items[key] = (ref, value)

    def pop(self, obj, default=None):
        value = self.get(obj, _MISSING)
        if value is _MISSING:
            return default
        del self._items[id(obj)]
        return value


_MISSING = object()
