"""The sampling loop: a background thread that snapshots the job and hands it to the writer."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from torchdoctor.recording.writer import RecordingWriter
from torchdoctor.sampling.sampler import Sampler

MIN_INTERVAL_S = 0.05
MAX_INTERVAL_S = 60.0
DEFAULT_INTERVAL_S = 0.5


class Recorder:
    """Samples every ``interval_s`` until :meth:`stop`; flushes at least once a second.

    A failure inside sampling must never touch the user's job: the loop reports it once on
    stderr, records what it had and stops sampling, while the job runs on.
    """

    def __init__(
        self,
        sampler: Sampler,
        writer: RecordingWriter,
        interval_s: float,
        also: Callable[[], None] | None = None,
    ) -> None:
        self.sampler = sampler
        self.also = also  # run after every sample (the job's memory cgroup is followed so)
        self.writer = writer
        self.interval_s = interval_s
        self.samples = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="torchdoctor-recorder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, final_sample: bool = False, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if final_sample and self.error is None:
            self._sample_once()
        self.writer.flush()
        if not self._thread.is_alive():  # a sampler stuck past the timeout keeps its readers
            self.sampler.close()

    def _loop(self) -> None:
        next_at = time.monotonic()
        # Flush on a wall-clock cadence too, so a long --interval still commits within 2 s.
        flush_wait = min(self.interval_s, 1.0)
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_at:
                if not self._sample_once():
                    return
                next_at += self.interval_s
                if next_at < now:  # we fell behind (machine overloaded): skip, do not burst
                    next_at = now + self.interval_s
            self.writer.maybe_flush()
            self._stop.wait(max(0.0, min(next_at - time.monotonic(), flush_wait)))

    def _sample_once(self) -> bool:
        if self.writer.stopped:
            return False  # the writer said why (a full disk): sampling on would be wasted
        try:
            self.writer.write_snapshot(self.sampler.snapshot())
            if self.also is not None:
                try:
                    self.also()
                except Exception as exc:  # noqa: BLE001 - it alone stops, sampling goes on
                    self.also = None
                    print(
                        f"torchdoctor: stopped following the job's memory cgroup "
                        f"({type(exc).__name__}: {exc}); sampling goes on",
                        file=sys.stderr,
                    )
            self.samples += 1
            return not self.writer.stopped
        except Exception as exc:  # noqa: BLE001 - the job must outlive any sampling bug
            self.error = f"{type(exc).__name__}: {exc}"
            print(
                f"torchdoctor: sampling stopped after {self.samples} samples ({self.error}); "
                "the job keeps running and the recording keeps what was sampled",
                file=sys.stderr,
            )
            return False
