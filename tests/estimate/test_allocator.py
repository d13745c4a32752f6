"""The caching allocator model against the rules of c10's CUDACachingAllocator."""

from __future__ import annotations

import pytest

from torchdoctor.estimate.allocator import (
    CachingAllocatorModel,
    OutOfMemory,
    round_size,
    segment_size,
)

KiB, MiB = 1024, 1024**2


def test_requests_round_up_to_512_bytes():
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(3 * MiB + 1) == 3 * MiB + 512


def test_segment_sizes_by_pool():
    assert segment_size(512) == 2 * MiB  # small pool: 2 MiB segments
    assert segment_size(1 * MiB) == 2 * MiB
    assert segment_size(1 * MiB + 512) == 20 * MiB  # 1-10 MiB: 20 MiB segments
    assert segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB  # large: rounded up to 2 MiB
    assert segment_size(11 * MiB) == 12 * MiB


def test_small_requests_share_one_2mib_segment():
    alloc = CachingAllocatorModel()
    handles = [alloc.malloc(800 * KiB) for _ in range(3)]
    # 3 x 800 KiB do not fit one 2 MiB segment: the third opens a second one.
    assert alloc.stats.segments == 2
    assert alloc.stats.reserved == 4 * MiB
    assert alloc.stats.allocated == 3 * 800 * KiB
    alloc.free(handles[0])
    alloc.malloc(500 * KiB)  # best fit reuses the freed block, no new segment
    assert alloc.stats.segments == 2


def test_medium_requests_split_a_20mib_segment():
    alloc = CachingAllocatorModel()
    alloc.malloc(5 * MiB)
    alloc.malloc(5 * MiB)
    assert alloc.stats.reserved == 20 * MiB and alloc.stats.segments == 1
    alloc.malloc(12 * MiB)  # the 10 MiB left cannot hold it
    assert alloc.stats.reserved == 32 * MiB and alloc.stats.segments == 2


def test_unsplit_remainder_counts_as_allocated():
    alloc = CachingAllocatorModel()
    handle = alloc.malloc(11 * MiB + 100)  # 12 MiB segment; 1 MiB - 512 B left is not split
    assert alloc.block_size(handle) == 12 * MiB
    assert alloc.stats.allocated == 12 * MiB


def test_freed_neighbours_merge_and_serve_a_larger_request():
    alloc = CachingAllocatorModel()
    a = alloc.malloc(4 * MiB)
    b = alloc.malloc(4 * MiB)
    keep = alloc.malloc(4 * MiB)
    alloc.free(a)
    alloc.free(b)
    alloc.malloc(8 * MiB)  # fits the merged 8 MiB hole of the same 20 MiB segment
    assert alloc.stats.segments == 1
    assert alloc.stats.peak_reserved == 20 * MiB
    alloc.free(keep)


def test_reserved_stays_after_free_until_cache_is_emptied():
    alloc = CachingAllocatorModel()
    alloc.free(alloc.malloc(64 * MiB))
    assert alloc.stats.allocated == 0 and alloc.stats.reserved == 64 * MiB
    alloc.empty_cache()
    assert alloc.stats.reserved == 0


def test_out_of_memory_frees_cached_segments_before_failing():
    alloc = CachingAllocatorModel(capacity=100 * MiB)
    alloc.free(alloc.malloc(60 * MiB))
    alloc.malloc(80 * MiB)  # needs the cached 60 MiB released first
    assert alloc.stats.cache_flushes == 1
    assert alloc.stats.reserved == 80 * MiB
    with pytest.raises(OutOfMemory):
        alloc.malloc(30 * MiB)
