"""A model of PyTorch's CUDA caching allocator, for reserved memory without a GPU.

It follows c10/cuda/CUDACachingAllocator.cpp with default settings (one stream, no
``max_split_size_mb``, no ``expandable_segments``, no power-of-two rounding):

- every request rounds up to a multiple of 512 B (``kMinBlockSize``);
- requests up to 1 MiB (``kSmallSize``) come from the small pool, carved out of 2 MiB segments;
- larger requests come from the large pool: under 10 MiB (``kMinLargeAlloc``) a 20 MiB segment
  (``kLargeBuffer``), else a segment rounded up to 2 MiB (``kRoundLarge``);
- a free block is found best-fit (smallest size, then lowest address) in the request's pool and
  split when the remainder is at least 512 B (small pool) or more than 1 MiB (large pool);
- freed blocks merge with free neighbours of the same segment; segments stay reserved until an
  allocation fails, when every entirely free segment is released and the allocation retried.

``allocated`` counts whole blocks, as ``torch.cuda.memory_allocated`` does, so an unsplit remainder
counts as allocated.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK_SIZE = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(size: int) -> int:
    """Bytes the allocator hands out for a request of ``size`` bytes."""
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return MIN_BLOCK_SIZE * ((size + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def segment_size(rounded: int) -> int:
    """Bytes the allocator asks cudaMalloc for when no cached block fits ``rounded`` bytes."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((rounded + ROUND_LARGE - 1) // ROUND_LARGE)


class OutOfMemory(Exception):
    """The simulated device cannot hold the allocation even after freeing cached segments."""

    def __init__(self, requested: int, reserved: int, capacity: int) -> None:
        super().__init__(
            f"cannot allocate {requested} B with {reserved} B of {capacity} B reserved"
        )
        self.requested = requested
        self.reserved = reserved
        self.capacity = capacity


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int]:
        return (self.size, self.address)


@dataclass
class AllocatorStats:
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    segments: int = 0
    cuda_mallocs: int = 0
    cache_flushes: int = 0


@dataclass
class CachingAllocatorModel:
    """Replays allocations and frees; ``capacity`` (bytes) makes cudaMalloc fail beyond it."""

    capacity: int | None = None
    stats: AllocatorStats = field(default_factory=AllocatorStats)
    # When a list, every action is appended to it in the format of PyTorch's memory snapshots
    # (``torch.cuda.memory._snapshot()["device_traces"][0]``), for pytorch.org/memory_viz.
    history: list[dict] | None = None

    def __post_init__(self) -> None:
        # Free blocks of each pool, sorted by (size, address) like the allocator's BlockPool.
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self._by_key: dict[tuple[bool, int, int], _Block] = {}
        self._next_address = 0x7F0000000000  # where CUDA's first mappings usually land
        self._handles: dict[int, _Block] = {}
        self._next_handle = 0
        self._segments: dict[int, _Block] = {}  # base address -> first block
        self._frames: dict[int, list[dict]] = {}

    # -- public ------------------------------------------------------------------------------
    def malloc(self, size: int, frames: list[dict] | None = None) -> int:
        """Allocate ``size`` bytes; returns a handle for :meth:`free`. ``frames`` label the
        allocation in the history."""
        rounded = round_size(size)
        small = rounded <= SMALL_SIZE
        block = self._take_free_block(small, rounded)
        if block is None:
            block = self._new_segment(small, rounded)
        remaining = block.size - rounded
        if (remaining >= MIN_BLOCK_SIZE) if small else (remaining > SMALL_SIZE):
            rest = _Block(block.address + rounded, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = rounded
            self._insert_free(rest)
        block.allocated = True
        self.stats.allocated += block.size
        self.stats.peak_allocated = max(self.stats.peak_allocated, self.stats.allocated)
        handle = self._next_handle
        self._next_handle += 1
        self._handles[handle] = block
        if self.history is not None:
            self._frames[handle] = frames or []
            self._record("alloc", block.address, block.size, frames or [])
        return handle

    def free(self, handle: int) -> None:
        block = self._handles.pop(handle)
        if self.history is not None:
            frames = self._frames.pop(handle, [])
            self._record("free_requested", block.address, block.size, frames)
            self._record("free_completed", block.address, block.size, frames)
        block.allocated = False
        self.stats.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove_free(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._insert_free(block)

    def block_size(self, handle: int) -> int:
        return self._handles[handle].size

    def empty_cache(self) -> None:
        """Release every entirely free segment (``torch.cuda.empty_cache``)."""
        for small in (True, False):
            for key in list(self._free[small]):
                block = self._by_key[(small, *key)]
                if block.prev is None and block.next is None:
                    self._remove_free(block)
                    self.stats.reserved -= block.size
                    self.stats.segments -= 1
                    del self._segments[block.address]
                    if self.history is not None:
                        self._record("segment_free", block.address, block.size, [])

    def segments(self) -> list[dict]:
        """The segments now, as ``torch.cuda.memory._snapshot()["segments"]`` lists them."""
        frames_of = {id(self._handles[h]): self._frames.get(h, []) for h in self._handles}
        result = []
        for address, block in sorted(self._segments.items()):
            blocks = []
            total = allocated = 0
            current: _Block | None = block
            while current is not None:
                entry: dict = {
                    "address": current.address,
                    "size": current.size,
                    "requested_size": current.size,
                    "state": "active_allocated" if current.allocated else "inactive",
                }
                if current.allocated:
                    entry["frames"] = frames_of.get(id(current), [])
                    allocated += current.size
                blocks.append(entry)
                total += current.size
                current = current.next
            result.append(
                {
                    "device": 0,
                    "address": address,
                    "total_size": total,
                    "allocated_size": allocated,
                    "active_size": allocated,
                    "requested_size": allocated,
                    "stream": 0,
                    "segment_type": "small" if block.small else "large",
                    "blocks": blocks,
                }
            )
        return result

    def _record(self, action: str, address: int, size: int, frames: list[dict]) -> None:
        assert self.history is not None
        self.history.append(
            {"action": action, "addr": address, "size": size, "stream": 0, "frames": frames}
        )

    # -- internals -----------------------------------------------------------------------------
    def _take_free_block(self, small: bool, rounded: int) -> _Block | None:
        pool = self._free[small]
        index = bisect.bisect_left(pool, (rounded, -1))
        if index == len(pool):
            return None
        block = self._by_key.pop((small, *pool.pop(index)))
        return block

    def _new_segment(self, small: bool, rounded: int) -> _Block:
        size = segment_size(rounded)
        if self.capacity is not None and self.stats.reserved + size > self.capacity:
            self.empty_cache()
            self.stats.cache_flushes += 1
            if self.stats.reserved + size > self.capacity:
                raise OutOfMemory(rounded, self.stats.reserved, self.capacity)
        block = _Block(self._next_address, size, small)
        # Segments never touch, so blocks of different segments never merge.
        self._next_address += size + ROUND_LARGE
        self.stats.reserved += size
        self.stats.segments += 1
        self.stats.cuda_mallocs += 1
        self.stats.peak_reserved = max(self.stats.peak_reserved, self.stats.reserved)
        self._segments[block.address] = block
        if self.history is not None:
            self._record("segment_alloc", block.address, size, [])
        return block

    def _insert_free(self, block: _Block) -> None:
        key = block.key()
        bisect.insort(self._free[block.small], key)
        self._by_key[(block.small, *key)] = block

    def _remove_free(self, block: _Block) -> None:
        key = block.key()
        pool = self._free[block.small]
        index = bisect.bisect_left(pool, key)
        del pool[index]
        del self._by_key[(block.small, *key)]
