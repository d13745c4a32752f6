"""What tune searches over: one configuration, and the ladder of values each setting may take."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

DIMENSIONS = ("num_workers", "num_threads", "prefetch_factor", "persistent_workers", "pin_memory")
DEFAULT_PREFETCH = 2  # torch's own default when workers are used


@dataclass(frozen=True, slots=True)
class Config:
    """DataLoader and trainer-thread settings of one trial.

    ``prefetch_factor`` and ``persistent_workers`` only mean something with workers; without
    them they are normalised to (None, False) so that equal behaviour is one configuration.
    """

    num_workers: int
    num_threads: int
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pin_memory: bool = False

    def normalized(self) -> Config:
        if self.num_workers == 0:
            return replace(self, prefetch_factor=None, persistent_workers=False)
        if self.prefetch_factor is None:
            return replace(self, prefetch_factor=DEFAULT_PREFETCH)
        return self

    @property
    def cost(self) -> tuple:
        """What a configuration costs the machine; smaller is cheaper.

        Processes and threads first (CPU and memory), then buffered batches (memory), then
        workers kept alive between epochs, then pinned memory.
        """
        return (
            self.num_workers + self.num_threads,
            self.num_workers * (self.prefetch_factor or 0),
            self.persistent_workers,
            self.pin_memory,
            self.num_threads,
        )

    def overrides(self) -> dict[str, Any]:
        """The instrumentation's TORCHDOCTOR_OVERRIDES object for this configuration."""
        out: dict[str, Any] = {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers,
            "num_threads": self.num_threads,
        }
        if self.num_workers > 0 and self.prefetch_factor is not None:
            out["prefetch_factor"] = self.prefetch_factor
        return out

    def dataloader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments to paste into ``DataLoader(...)``."""
        out: dict[str, Any] = {"num_workers": self.num_workers}
        if self.num_workers > 0:
            out["prefetch_factor"] = self.prefetch_factor or DEFAULT_PREFETCH
            out["persistent_workers"] = self.persistent_workers
        out["pin_memory"] = self.pin_memory
        return out

    def label(self) -> str:
        """Short form for tables: ``w=2 t=1 pf=4 persist pin``."""
        parts = [f"w={self.num_workers}", f"t={self.num_threads}"]
        if self.num_workers > 0:
            parts.append(f"pf={self.prefetch_factor}")
            if self.persistent_workers:
                parts.append("persist")
        if self.pin_memory:
            parts.append("pin")
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ladder(limit: int, start: int = 0) -> tuple[int, ...]:
    """0/1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to ``limit``: finer where small counts matter."""
    values = []
    v = start
    while v <= limit:
        values.append(v)
        if v < 4:
            v += 1
        else:
            v += v // 2 if (v & (v - 1)) == 0 else v // 3
    if values[-1] != limit and limit >= start:
        values.append(limit)
    return tuple(values)


@dataclass(frozen=True, slots=True)
class Space:
    """The values each setting may take on this machine for this job.

    A dimension with one value is fixed: tune never spends a trial on it (pin_memory without a
    GPU, persistent_workers when the trials never reach an epoch's end).
    """

    num_workers: tuple[int, ...]
    num_threads: tuple[int, ...]
    prefetch_factor: tuple[int, ...] = (1, 2, 4, 8)
    persistent_workers: tuple[bool, ...] = (False,)
    pin_memory: tuple[bool, ...] = (False,)

    @classmethod
    def for_machine(
        cls,
        cpus: int,
        *,
        tune_pin_memory: bool = False,
        tune_persistent: bool = False,
        include: Config | None = None,
    ) -> Space:
        """Workers up to max(4, 2 x CPUs) (more only helps data sets that wait on I/O),
        trainer threads up to the CPU count; ``include``'s own values are always allowed."""
        cpus = max(1, cpus)
        workers = set(_ladder(max(4, 2 * cpus)))
        threads = set(_ladder(cpus, start=1))
        prefetch = {1, 2, 4, 8}
        if include is not None:
            workers.add(include.num_workers)
            threads.add(include.num_threads)
            if include.prefetch_factor:
                prefetch.add(include.prefetch_factor)
        return cls(
            num_workers=tuple(sorted(workers)),
            num_threads=tuple(sorted(threads)),
            prefetch_factor=tuple(sorted(prefetch)),
            persistent_workers=(False, True)
            if tune_persistent
            else ((include.persistent_workers,) if include is not None else (False,)),
            pin_memory=(False, True)
            if tune_pin_memory
            else ((include.pin_memory,) if include is not None else (False,)),
        )

    def values(self, dim: str) -> tuple:
        return getattr(self, dim)

    def clamp(self, config: Config) -> Config:
        """``config`` moved onto the space: each value to the nearest allowed one."""
        changes = {}
        for dim in DIMENSIONS:
            value = getattr(config, dim)
            allowed = self.values(dim)
            if value is None or value in allowed:
                continue
            if isinstance(value, bool):
                changes[dim] = allowed[0]
            else:
                changes[dim] = min(allowed, key=lambda a: (abs(a - value), a))
        return replace(config, **changes).normalized() if changes else config.normalized()

    def neighbours(self, config: Config) -> list[tuple[str, int, Config]]:
        """Configurations one step away along one setting: (setting, direction, config).

        Settings that only matter with workers are left alone while there are none.
        """
        out: list[tuple[str, int, Config]] = []
        for dim in DIMENSIONS:
            if config.num_workers == 0 and dim in ("prefetch_factor", "persistent_workers"):
                continue
            allowed = self.values(dim)
            if len(allowed) < 2:
                continue
            value = getattr(config, dim)
            if isinstance(value, bool):
                out.append((dim, 1 if not value else -1, replace(config, **{dim: not value})))
                continue
            if value not in allowed:
                continue
            i = allowed.index(value)
            for j, direction in ((i + 1, 1), (i - 1, -1)):
                if 0 <= j < len(allowed):
                    out.append((dim, direction, replace(config, **{dim: allowed[j]}).normalized()))
        return out

    def step(self, config: Config, dim: str, direction: int) -> Config | None:
        """One more step along ``dim`` in ``direction``; None at the edge."""
        value = getattr(config, dim)
        allowed = self.values(dim)
        if isinstance(value, bool) or value not in allowed:
            return None
        j = allowed.index(value) + direction
        if not 0 <= j < len(allowed):
            return None
        return replace(config, **{dim: allowed[j]}).normalized()

    def grid(self) -> list[Config]:
        """Every distinct configuration of the space (what an exhaustive search would run)."""
        seen: dict[Config, None] = {}
        for w in self.num_workers:
            for t in self.num_threads:
                for pf in self.prefetch_factor if w > 0 else (None,):
                    for pw in self.persistent_workers if w > 0 else (False,):
                        for pin in self.pin_memory:
                            seen[Config(w, t, pf, pw, pin).normalized()] = None
        return list(seen)
