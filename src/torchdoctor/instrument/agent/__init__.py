"""The agent that runs inside the user's job: hooks torch, buffers records, ships them out.

This package is standard-library only on purpose: the bootstrap (``sitecustomize``) loads it
by path as the package ``_torchdoctor_agent`` into whatever Python the job runs, which need not
be the one that has torchdoctor installed; its modules import each other relatively, so they
load under either name. It never imports torch itself: :meth:`Agent.arm` waits for the user's
code to import torch and only then patches it.

Every Python process of a job loads it, and most never import torch, so start-up loads only
what waiting needs; the rest loads with torch:

- :mod:`.contract`: wire version, step fields, environment variables, overrides (start-up);
- :mod:`.sink`: the connection to the collector (start-up);
- :mod:`.core`: ``Agent``, the per-process state: lifecycle, patch registry, record buffers,
  flush, fork and exit (start-up);
- :mod:`.importwatch`: the finder that sees torch imported (start-up);
- :mod:`.hooks`: what is patched in torch, the wrappers and their one guard (with torch);
- :mod:`.steps`: step boundaries, data wait, samples, backward-only loops (with torch);
- :mod:`.evaluation`: evaluation passes between steps, plain arithmetic (with torch);
- :mod:`.loaders`: DataLoader records, tune's overrides, worker processes (with torch);
- :mod:`.settings`: the job's settings, role and thread override (with torch);
- :mod:`.cuda`: CUDA memory per step and out-of-memory events (with torch);
- :mod:`.ranks`: what each rank of a torchrun job adds (with torch, in ranks only).

Safety: every hook body runs guarded (:func:`.hooks.guard`); the first exception switches the
agent off for the process (patches restored), is recorded once as an
``instrumentation-disabled`` event and never reaches the user's code. The agent never writes
to stdout or stderr.

Records leave the process in batches (at most every ``FLUSH_INTERVAL_S`` seconds or
``FLUSH_MAX_STEPS`` steps, from the step hook: no thread) as JSON messages over a Unix
``SOCK_SEQPACKET`` connection to the collector, or to in-process sinks (``watch``).
"""

from .contract import (
    BACKWARD_STEPS_TO_DECIDE,
    ENV_COLLECTOR,
    ENV_NO_INSTRUMENT,
    ENV_OVERRIDES,
    ENV_STOP_AFTER_STEPS,
    FLUSH_INTERVAL_S,
    FLUSH_MAX_STEPS,
    MAX_PENDING_MESSAGES,
    OVERRIDE_TYPES,
    STEP_FIELDS,
    STOPPED_EXIT_STATUS,
    WIRE_VERSION,
    env_flag,
    parse_overrides,
)
from .core import Agent
from .sink import SocketSink

__all__ = [
    "AGENT",
    "BACKWARD_STEPS_TO_DECIDE",
    "ENV_COLLECTOR",
    "ENV_NO_INSTRUMENT",
    "ENV_OVERRIDES",
    "ENV_STOP_AFTER_STEPS",
    "FLUSH_INTERVAL_S",
    "FLUSH_MAX_STEPS",
    "MAX_PENDING_MESSAGES",
    "OVERRIDE_TYPES",
    "STEP_FIELDS",
    "STOPPED_EXIT_STATUS",
    "WIRE_VERSION",
    "Agent",
    "SocketSink",
    "arm_from_env",
    "env_flag",
    "parse_overrides",
]

AGENT = Agent()


def arm_from_env() -> bool:
    """Entry point of the bootstrap: arm the agent unless the environment says no."""
    if not AGENT.configure_from_env():
        return False
    AGENT.arm()
    return True
