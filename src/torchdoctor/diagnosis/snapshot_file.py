"""The one way a CUDA memory snapshot file is read: safely, and in bounded memory.

A snapshot (``torch.cuda.memory._snapshot()`` pickled by the agent at an OOM or at the end of a
``run --memory-history`` job, or by ``estimate --memory-snapshot``) is a file the job or the
user wrote: it is never given to ``pickle.load``, which runs whatever a pickle names. The
unpickler here refuses every global (``find_class``) and every opcode that builds an object
(REDUCE, BUILD, INST, OBJ, NEWOBJ, persistent ids, extension codes) before anything runs: a
snapshot is only dicts, lists, tuples, str, int, float, bool and None.

It is Python's own unpickler (``pickle._Unpickler``, the pure-Python twin of the C one, whose
opcode table a subclass can extend) with one change: the items of ``device_traces`` - the
allocator's history, up to millions of entries - are handed to ``on_entry`` as each is read and
then dropped, never kept in a list. An entry's ``frames`` list, once read, is replaced in the
pickle's memo by what ``on_frames`` makes of it (the history shares one list between entries),
so memory holds the snapshot's segments, its distinct frames and strings, and what the caller
keeps: not the history.
"""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torchdoctor.errors import UserError
from torchdoctor.input_files import open_regular_file
from torchdoctor.units import fmt_bytes

# torch's default history (the agent keeps 100,000 entries) pickles to tens of MiB with Python
# stacks; a file of 1 GiB would take minutes to read in pure Python: refused, not read.
SNAPSHOT_LIMIT = 1 << 30
# Opcodes that call or build objects: a plain-data snapshot never holds one. GLOBAL and
# STACK_GLOBAL reach find_class, which refuses them naming the global; the extension codes
# are refused here, since a code cached by an earlier unpickling would skip find_class.
_REFUSED = (
    pickle.REDUCE, pickle.BUILD, pickle.INST, pickle.OBJ, pickle.NEWOBJ, pickle.NEWOBJ_EX,
    pickle.EXT1, pickle.EXT2, pickle.EXT4, pickle.PERSID, pickle.BINPERSID,
)  # fmt: skip

FRAMES_KEPT = 4096  # frames summaries kept in the memo (see _frames_summary)
# Memoised objects whose index the reader keeps, to take them out of the memo once the entry
# that holds them is handed over (ints and floats are never memoised).
_SHAREABLE = (dict, list, tuple, str, bytes)
FORGOTTEN = object()  # what a later reference to a value taken out of the memo reads as
EntryHandler = Callable[[list, dict], None]  # (the device's history list, the entry)
FramesHandler = Callable[[list], Any]


def damaged(path: str | os.PathLike[str], what: str) -> UserError:
    """The one line for a snapshot that cannot be read (cut short, edited, not a snapshot)."""
    return UserError(
        f"the memory snapshot {str(path)!r} is damaged or edited: {what}; it cannot be read "
        "(record the job again with torchdoctor run --memory-history)"
    )


def read_snapshot(
    path: str | os.PathLike[str],
    on_entry: EntryHandler,
    on_frames: FramesHandler,
    limit: int = SNAPSHOT_LIMIT,
) -> dict[str, Any]:
    """Read the snapshot at ``path``: every history entry goes to ``on_entry`` in order, each
    frames list through ``on_frames`` once; returns the top dictionary (``segments`` whole,
    ``device_traces`` as empty lists, the ones ``on_entry`` was given). Any failure is one
    :class:`~torchdoctor.errors.UserError` line."""
    shown = repr(str(path))
    fd = open_regular_file(path, "memory snapshot")
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(fd)
        if mode.st_size > limit:
            raise UserError(
                f"the memory snapshot {shown} is {fmt_bytes(mode.st_size)}, more than the "
                f"{fmt_bytes(limit)} torchdoctor reads; open it in https://pytorch.org/memory_viz"
            )
        try:
            top = _SnapshotUnpickler(handle, on_entry, on_frames).load()
        except UserError:
            raise
        except OSError as exc:
            raise UserError(
                f"cannot read the memory snapshot {shown}: {exc.strerror or exc}"
            ) from None
        except (pickle.UnpicklingError, EOFError, MemoryError, RecursionError) as exc:
            raise damaged(path, str(exc) or type(exc).__name__) from None
        except Exception as exc:  # noqa: BLE001 - any other failure of a bad file is one line
            raise damaged(path, f"{type(exc).__name__}: {exc}") from None
    if not isinstance(top, dict) or not isinstance(top.get("device_traces"), list):
        raise damaged(path, "it is not a memory snapshot (no device_traces)")
    return top


def _is_entry(item: Any) -> bool:
    return type(item) is dict and "action" in item


class _SnapshotUnpickler(pickle._Unpickler):  # the pure-Python one: its opcode table extends
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, handle: Any, on_entry: EntryHandler, on_frames: FramesHandler) -> None:
        super().__init__(handle)
        self.on_entry = on_entry
        self.on_frames = on_frames
        self.memo = _Memo()
        # memo indices of the frames summaries kept, the one named last at the end
        self.kept: OrderedDict[int, None] = OrderedDict()
        self.next_memo = 0
        # id of each memoised _SHAREABLE object -> its memo index, while it is in the memo
        self.memo_index: dict[int, int] = {}

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names a Python global ({module}.{name}), refused")

    def refuse(self) -> None:
        raise pickle.UnpicklingError("it holds an opcode that builds objects, refused")

    def load_memoize(self) -> None:
        # Indices by count, not len(memo): entries leave the memo once handed over.
        obj = self.stack[-1]
        self.memo[self.next_memo] = obj
        if type(obj) in _SHAREABLE:
            self.memo_index[id(obj)] = self.next_memo
        self.next_memo += 1

    def load_binput(self) -> None:  # protocols 1-3 name the memo index
        self._store(self.read(1)[0])

    def load_long_binput(self) -> None:
        self._store(int.from_bytes(self.read(4), "little"))

    def load_get(self) -> None:
        self._fetch(int(self.readline()[:-1]))

    def load_binget(self) -> None:
        self._fetch(self.read(1)[0])

    def load_long_binget(self) -> None:
        self._fetch(int.from_bytes(self.read(4), "little"))

    def _fetch(self, index: int) -> None:
        self.append(self.memo[index])
        if index in self.kept:
            self.kept.move_to_end(index)

    def _store(self, index: int) -> None:
        obj = self.stack[-1]
        self.memo[index] = obj
        if type(obj) in _SHAREABLE:
            self.memo_index[id(obj)] = index

    def load_append(self) -> None:
        value = self.stack.pop()
        self._add(self.stack[-1], [value])

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._add(self.stack[-1], items)

    def _add(self, target: Any, items: list) -> None:
        if type(target) is not list:
            raise pickle.UnpicklingError("APPEND to something other than a list")
        for item in items:
            if _is_entry(item):
                self._hand_over(target, item)
            else:
                target.append(item)

    def _hand_over(self, history: list, entry: dict) -> None:
        """Give ``entry`` to the caller and take it and its own values out of the memo. torch
        shares between entries only the frames lists (one traceback for a block's alloc and
        frees, one empty list for every entry without a stack) and the action strings; the
        rest (the entry, its pool_id tuple, its compile context) is made per entry."""
        self._forget(entry)
        for key, value in entry.items():
            if key == "frames":
                if type(value) is list:
                    entry[key] = self._frames_summary(value)
            elif key != "action":
                self._forget(value)
        self.on_entry(history, entry)

    def _frames_summary(self, frames: list) -> Any:
        summary = self.on_frames(frames)
        index = self.memo_index.pop(id(frames), None)
        if index is not None:
            # A later entry may name the same list through the memo: it gets the summary.
            # The FRAMES_KEPT lists named last stay (torch's one empty list, named by every
            # entry without a stack, always does); an older one is forgotten: a block's frees,
            # which share its alloc's list, need no frames.
            self.memo[index] = summary
            self.kept[index] = None
            if len(self.kept) > FRAMES_KEPT:
                oldest, _ = self.kept.popitem(last=False)
                self.memo.pop(oldest, None)
        return summary

    def _forget(self, obj: Any) -> None:
        index = self.memo_index.pop(id(obj), None)
        if index is not None:
            del self.memo[index]


class _Memo(dict):
    """The pickle's memo: an index the reader forgot reads as FORGOTTEN, not an error."""

    def __missing__(self, key: int) -> Any:
        return FORGOTTEN


for _opcode in _REFUSED:
    _SnapshotUnpickler.dispatch[_opcode[0]] = _SnapshotUnpickler.refuse
for _opcode, _method in (
    (pickle.MEMOIZE, _SnapshotUnpickler.load_memoize),
    (pickle.BINPUT, _SnapshotUnpickler.load_binput),
    (pickle.GET, _SnapshotUnpickler.load_get),
    (pickle.BINGET, _SnapshotUnpickler.load_binget),
    (pickle.LONG_BINGET, _SnapshotUnpickler.load_long_binget),
    (pickle.LONG_BINPUT, _SnapshotUnpickler.load_long_binput),
    (pickle.APPEND, _SnapshotUnpickler.load_append),
    (pickle.APPENDS, _SnapshotUnpickler.load_appends),
):
    _SnapshotUnpickler.dispatch[_opcode[0]] = _method
