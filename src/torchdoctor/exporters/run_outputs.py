"""What ``torchdoctor run`` serves or writes beside its recording: a Prometheus endpoint and
TensorBoard scalars. Both live in the recorder process, never in the training process: a
listening socket there would be inherited by forked DataLoader workers, a scrape would compete
with the step loop for the GIL, and the endpoint would die with a hung trainer.

Neither may harm the job: a port that cannot be bound is said in one line and the job runs
without the endpoint; a writer that fails says so once and stops.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from torchdoctor.errors import UserError


@dataclass(frozen=True, slots=True)
class RunOutputOptions:
    prometheus: tuple[str, int] | None = None  # (address, port) from --prometheus
    tensorboard: Path | None = None  # --tensorboard DIR


def check_options(prometheus: str | None, tensorboard: str | None) -> RunOutputOptions:
    """Validate the options before anything starts (UserError on bad input)."""
    listen = None
    if prometheus is not None:
        from torchdoctor.exporters.prometheus import parse_listen

        listen = parse_listen(prometheus, "--prometheus")
    if tensorboard is not None:
        from torchdoctor.exporters.tensorboard import check_available

        check_available()
    return RunOutputOptions(listen, Path(tensorboard) if tensorboard is not None else None)


class RunOutputs:
    """Started once the recording exists, closed once the job has ended and all is flushed."""

    def __init__(self, recording: Path, options: RunOutputOptions, *, quiet: bool) -> None:
        self._server = None
        self._collector = None
        self._scalars = None
        if options.prometheus is not None:
            self._start_prometheus(recording, *options.prometheus, quiet=quiet)
        if options.tensorboard is not None:
            from torchdoctor.exporters.tensorboard import LiveScalars

            scalars = LiveScalars(recording, options.tensorboard)
            try:
                scalars.start()
            except UserError as exc:
                print(f"torchdoctor: {exc.message}; the job runs without TensorBoard scalars",
                      file=sys.stderr)  # fmt: skip
            else:
                self._scalars = scalars

    def _start_prometheus(self, recording: Path, address: str, port: int, *, quiet: bool) -> None:
        from torchdoctor.exporters.prometheus import JobCollector, bind_error, serve

        collector = JobCollector(recording)
        try:
            server = serve(collector, address, port)
        except OSError as exc:
            print(
                f"torchdoctor: {bind_error(exc, address, port)}; the job runs without the "
                "endpoint (choose another with --prometheus [ADDR:]PORT)",
                file=sys.stderr,
            )
            return
        self._server, self._collector = server, collector
        if not quiet:
            host, bound = server.server_address[:2]
            shown = f"[{host}]" if ":" in host else host
            print(f"torchdoctor: Prometheus metrics at http://{shown}:{bound}/metrics",
                  file=sys.stderr)  # fmt: skip

    def close(self) -> None:
        if self._scalars is not None:
            self._scalars.close()
        if self._server is not None:
            from torchdoctor.exporters.prometheus import stop

            stop(self._server)
            self._collector.close()
