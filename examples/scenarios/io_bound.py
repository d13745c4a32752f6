"""I/O-bound: every sample is read from disk, bypassing the page cache (O_DIRECT).

A data set of 256 KiB records in one file, read at random with O_DIRECT so that no read is
served from RAM, as on a data set far larger than memory. With num_workers=0 the loop blocks
on each read in turn: CPUs sit in I/O wait and steps wait for data. torchdoctor finds
``dataloader-bound`` (and ``io-wait`` where the disk is slow enough to show it) and
recommends workers that keep several reads in flight; ``--num-workers N`` applies it.

    python io_bound.py                    # ~15 s
    python io_bound.py --num-workers 4 --persistent-workers
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import torch
from _common import apply_threads, loader_kwargs, mlp, parser, train
from torch.utils.data import DataLoader, Dataset

RECORD = 256 * 1024  # bytes per sample; a multiple of the 4 KiB O_DIRECT alignment
FEATURES = 256
# A real disk: /tmp may be tmpfs (RAM), which would make every read a memory copy.
DEFAULT_DATA_DIR = Path(
    "/var/tmp" if Path("/var/tmp").is_dir() else tempfile.gettempdir(), "torchdoctor-scenarios"
)


def make_data_file(path: Path, records: int) -> None:
    if path.exists() and path.stat().st_size == records * RECORD:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    with open(tmp, "wb") as fh:
        for _ in range(records):
            fh.write(os.urandom(RECORD))
    tmp.replace(path)


class DiskRecords(Dataset):
    def __init__(self, path: Path, records: int) -> None:
        self.path, self.records = path, records
        self._fd: int | None = None  # opened lazily: once per process (workers included)
        self._buf: mmap.mmap | None = None

    def __len__(self) -> int:
        return self.records

    def _open(self) -> None:
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        except OSError:  # file systems without O_DIRECT (tmpfs): drop the cache instead
            self._fd = os.open(self.path, os.O_RDONLY)
        self._buf = mmap.mmap(-1, RECORD)  # page-aligned, as O_DIRECT requires

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self._fd is None:
            self._open()
        os.preadv(self._fd, [self._buf], i * RECORD)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, i * RECORD, RECORD, os.POSIX_FADV_DONTNEED)
        raw = torch.frombuffer(bytearray(self._buf[: FEATURES * 4]), dtype=torch.uint8)
        x = raw.view(FEATURES, 4).float().mean(1) / 255.0
        return x, i % 10


def main() -> None:
    p = parser(__doc__.splitlines()[0], steps=400, batch_size=64)
    p.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help="where the data file is created once (not on tmpfs: it needs a real disk)",
    )
    p.add_argument("--records", type=int, default=2048, help="samples in the data file")
    args = p.parse_args()
    apply_threads(args)
    torch.manual_seed(0)
    path = args.data_dir / f"records-{args.records}.bin"
    make_data_file(path, args.records)
    loader = DataLoader(DiskRecords(path, args.records), **loader_kwargs(args))
    train(mlp(FEATURES, 128, layers=2), lambda: loader, args.steps, seconds=args.seconds)


if __name__ == "__main__":
    main()
