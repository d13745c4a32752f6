"""A fixed log-spaced histogram of durations: how the steps a recording folded keep their
quantiles (recording.compaction writes one per process per bucket, recording.steps merges them).

Bins are fixed for every recording, so histograms of any buckets, processes or recordings add
bin by bin. Bin 0 holds durations below ``FLOOR_S`` (1 µs, zero included); bin ``i >= 1``
holds ``[FLOOR_S * R**(i - 1), FLOOR_S * R**i)`` with ``R = 2**(1/64)``: each bin is 1.09 %
wide, so a quantile read from the histogram is within 1.09 % of the true one (the value is
interpolated inside its bin, usually much closer); one below the floor reads as 0. 64 bins an
octave cover 1 µs to 12 days in 2,560 bins; a longer duration falls in the last one.

Stored as a BLOB of unsigned LEB128 varints, pairs of (bin index minus the previous pair's
index, count), lowest bin first: a minute of steady steps spread over 20 bins is about 40
bytes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

FLOOR_S = 1e-6
BINS_PER_OCTAVE = 64
LAST_BIN = 40 * BINS_PER_OCTAVE  # 2**40 µs: 12.7 days
RATIO = 2.0 ** (1.0 / BINS_PER_OCTAVE)
# The widest error of a value read back from its bin, relative (the bin's width).
RELATIVE_ERROR = RATIO - 1.0


def bin_of(seconds: float) -> int:
    """The bin a duration falls in."""
    if not seconds >= FLOOR_S:  # NaN and what is below the floor: bin 0
        return 0
    return min(int(math.log2(seconds / FLOOR_S) * BINS_PER_OCTAVE) + 1, LAST_BIN)


def bin_bounds(index: int) -> tuple[float, float]:
    """The durations bin ``index`` holds: [low, high)."""
    if index <= 0:
        return 0.0, FLOOR_S
    return FLOOR_S * RATIO ** (index - 1), FLOOR_S * RATIO**index


def histogram(values: Iterable[float]) -> Counter[int]:
    """The bin counts of ``values``."""
    return Counter(bin_of(v) for v in values)


def encode(counts: Counter[int] | dict[int, int]) -> bytes:
    """``counts`` (bin -> count) as the BLOB the recording stores."""
    out = bytearray()
    previous = 0
    for index in sorted(counts):
        n = counts[index]
        if n <= 0:
            continue
        _varint(out, index - previous)
        _varint(out, n)
        previous = index
    return bytes(out)


def decode(blob: bytes | None, into: Counter[int] | None = None) -> Counter[int]:
    """The bin counts of a stored BLOB, added to ``into`` when given. Raises ValueError on
    bytes no writer stores (an edited file)."""
    counts: Counter[int] = Counter() if into is None else into
    if blob is None:
        return counts
    if not isinstance(blob, bytes):
        raise ValueError(f"a step histogram is {type(blob).__name__}, not bytes")
    values: list[int] = []
    shift = value = 0
    for byte in blob:
        value |= (byte & 0x7F) << shift
        if byte & 0x80:
            shift += 7
            if shift > 63:
                raise ValueError("a step histogram holds a number too long")
            continue
        values.append(value)
        shift = value = 0
    if shift or len(values) % 2:
        raise ValueError("a step histogram ends inside a number")
    index = 0
    for delta, n in zip(values[::2], values[1::2], strict=True):
        index += delta
        if index > LAST_BIN:
            raise ValueError(f"a step histogram has bin {index}, past the last ({LAST_BIN})")
        counts[index] += n
    return counts


def quantile(counts: Counter[int] | dict[int, int], q: float) -> float:
    """The ``q`` quantile of the durations counted, interpolated as :func:`recording.steps.
    quantile` does between order statistics (numpy's default), each order statistic placed
    evenly, on a log scale, inside its bin; NaN when nothing is counted."""
    total = sum(counts.values())
    if total <= 0:
        return math.nan
    pos = (total - 1) * q
    lo = int(pos)
    hi = min(lo + 1, total - 1)
    a = _order_statistic(counts, lo)
    b = a if hi == lo else _order_statistic(counts, hi)
    return a + (b - a) * (pos - lo)


def _order_statistic(counts: Counter[int] | dict[int, int], k: int) -> float:
    """The k-th smallest (0-based) duration counted."""
    seen = 0
    for index in sorted(counts):
        n = counts[index]
        if n <= 0:
            continue
        if k < seen + n:
            if index == 0:
                return 0.0  # below 1 µs: mostly steps that did not wait at all
            low, high = bin_bounds(index)
            return low * (high / low) ** ((k - seen + 0.5) / n)
        seen += n
    raise ValueError(f"order statistic {k} of {seen} values")


def _varint(out: bytearray, value: int) -> None:
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


__all__ = [
    "FLOOR_S",
    "RELATIVE_ERROR",
    "bin_bounds",
    "bin_of",
    "decode",
    "encode",
    "histogram",
    "quantile",
]
