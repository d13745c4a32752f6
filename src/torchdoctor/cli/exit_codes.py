"""The exit statuses of every ``torchdoctor`` command: one table, which the documentation is
generated from. A command that runs a job (run, attach, launch, queue wait) exits with the
job's own status once it started; the rows below are torchdoctor's own."""

from __future__ import annotations

from dataclasses import dataclass

OK = 0
FOUND = 1
USAGE = 2
UNAVAILABLE = 3
REGRESSED = 4
NOT_EXECUTABLE = 126
NOT_FOUND = 127
INTERRUPTED = 130


@dataclass(frozen=True)
class ExitCode:
    code: int
    name: str
    meaning: str


EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(OK, "ok", "Done; for run, attach, launch and queue wait: the job exited 0."),
    ExitCode(
        FOUND,
        "found",
        "Something to act on: `diagnose --fail-on` met a finding that severe, `doctor` "
        "found an error, `queue wait` a job that failed without a status of its own.",
    ),
    ExitCode(
        USAGE,
        "usage",
        "Bad input, nothing started: an unknown option or command, a value that cannot be "
        "read, a file that is not a recording.",
    ),
    ExitCode(
        UNAVAILABLE,
        "unavailable",
        "Something needed is missing here: PyTorch not importable, /proc not readable.",
    ),
    ExitCode(
        REGRESSED,
        "regressed",
        "`compare --fail-if-slower` or `--fail-if-more-memory`: B is slower (with 95 % "
        "confidence) or holds more memory than A by more than the percentage given.",
    ),
    ExitCode(NOT_EXECUTABLE, "not-executable", "The command to run exists but cannot run."),
    ExitCode(NOT_FOUND, "not-found", "The command to run is not on PATH (as shells say)."),
    ExitCode(INTERRUPTED, "interrupted", "Stopped by Ctrl-C (SIGINT) before the end."),
)
JOB_STATUS = (
    "run, attach, launch, queue wait: any other status is the job's own (128+N: killed by "
    "signal N)."
)
