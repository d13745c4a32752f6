"""The agent's contract with the recorder side: wire version and step fields, environment
variables, flush limits, tune's overrides, and the small helpers both sides use.

Standard library only, and only what every Python start-up has loaded already: the agent is
loaded into every Python process of a job, most of which never import torch. The modules that
may load at start-up (the package's ``__init__``; this one, sink and core when the environment
asks for overrides or a stop rule) do without ``from __future__ import annotations``, which
would import the ``__future__`` module into every process: their annotations are ones Python
3.10 evaluates.
"""

import os
import time

WIRE_VERSION = 2  # 2: integer step columns as bytes after the JSON (see encode_message)
ENV_COLLECTOR = "TORCHDOCTOR_COLLECTOR"
ENV_NO_INSTRUMENT = "TORCHDOCTOR_NO_INSTRUMENT"
ENV_OVERRIDES = "TORCHDOCTOR_OVERRIDES"
ENV_STOP_AFTER_STEPS = "TORCHDOCTOR_STOP_AFTER_STEPS"
# A torch.profiler window (see profile.py): the steps "A-B", and where traces and
# `torchdoctor profile`'s requests go (the recording's path without .sqlite, plus .profile).
ENV_PROFILE_STEPS = "TORCHDOCTOR_PROFILE_STEPS"
ENV_PROFILE_DIR = "TORCHDOCTOR_PROFILE_DIR"
# Set (1): the agent runs its pure-Python path where the compiled one is built (see compiled.py).
ENV_PURE_PYTHON = "TORCHDOCTOR_AGENT_PURE_PYTHON"
# Where ranks write their flight-recorder dumps (launch sets it), and the dumps' file names:
# FR_PREFIX + rank (+ ".json"), the prefix torch's own dump-on-timeout uses too.
ENV_FR_DIR = "TORCHDOCTOR_FR_DIR"
# The PID of `torchdoctor launch`, set for torchrun alone: its start-up (the bootstrap) asks the
# kernel for SIGTERM when that process dies (PR_SET_PDEATHSIG) and removes the variable, so
# that a launcher killed with SIGKILL leaves no torchrun, and torchrun stops its ranks.
ENV_DIE_WITH = "TORCHDOCTOR_DIE_WITH"
FR_PREFIX = "fr_trace_rank_"

# Exit status of a process stopped by TORCHDOCTOR_STOP_AFTER_STEPS (EX_TEMPFAIL: Python itself
# never uses it). The recording also gets a "stopped-after-steps" event.
STOPPED_EXIT_STATUS = 75

# A flush every half second: soon enough for a live view (show, top, the exporters), and half
# what flushes cost the job at 0.25 s (a flush takes ~100-200 us of its time on a 2-core VM:
# 0.04-0.08 % of its CPU at 0.25 s, ~1 us a step of 2 ms).
FLUSH_INTERVAL_S = 0.5
FLUSH_INTERVAL_NS = int(FLUSH_INTERVAL_S * 1e9)
VOLATILE_EVERY_NS = 2_000_000_000  # re-read changeable settings at most every 2 s
# Steps buffered before a flush (or FLUSH_INTERVAL_S, whichever comes first). A flush is the
# agent's dearest moment, its code cold between the job's steps: ~200 us on a 2-core VM, so
# rarely. Its messages hold at most MESSAGE_MAX_VALUES step values each (see message_steps).
FLUSH_MAX_STEPS = 1024
MESSAGE_MAX_VALUES = 4096
MAX_PENDING_MESSAGES = 512  # kept while the collector is slow; oldest dropped beyond
# Backward passes without an optimizer step after which the loop is taken to update its
# parameters by hand: gradient accumulation steps its optimizer long before this.
BACKWARD_STEPS_TO_DECIDE = 64

# Order of the values of one step on the wire; every message names it, so the collector never
# depends on this module's version. Times are integer nanoseconds: JSON writes an int several
# times faster than a float, and this is the bulk of what the job spends on shipping. Steps
# without CUDA figures leave the trailing CUDA values out.
STEP_FIELDS = (
    "step",
    "t_end_ns",
    "wall_ns",
    "data_wait_ns",
    "batch_size",
    "samples",
    "autocast_dtype",
    "grad_scaler",
    "cuda_allocated",
    "cuda_reserved",
    "cuda_max_allocated",
    "cuda_alloc_retries",
    "cuda_ooms",
    # Ranks only (ranks.py), after CUDA values padded with nulls.
    "forward_ns",
    "backward_ns",
    "optimizer_ns",
    "comm_ns",
    "comm_overlap_ns",
    "backward_compute_ns",
    # True on the steps a profiler window touched (its warm-up through the step its export
    # stalled, profile.py): step statistics leave them out. After the rank values, padded.
    "profiled",
)
AGENT_STEP_VALUES = 13  # STEP_FIELDS up to cuda_ooms
SHORT_STEP_VALUES = 8  # the common step's row (no CUDA, no rank figures): up to grad_scaler
RANK_STEP_FIELDS = STEP_FIELDS[AGENT_STEP_VALUES:-1]  # what ranks.py appends, in this order
PROFILED_VALUE = len(STEP_FIELDS) - 1  # the index of "profiled" in a step's row
# The step's end as the agent keeps it: perf_counter_ns, one clock read per step boundary.
# A message carries the offset to UNIX time read when it was flushed (``clock_offset_ns``).
PERF_CLOCK_FIELD = "t_end_ns"

# tune's overrides: key -> accepted Python type.
OVERRIDE_TYPES = {
    "num_workers": int,
    "prefetch_factor": int,
    "pin_memory": bool,
    "persistent_workers": bool,
    "num_threads": int,
}
DATALOADER_OVERRIDES = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")

# Process roles as the recording names them (sampling/roles.py holds the same vocabulary for
# the rest of torchdoctor; the agent keeps its own copy, being standard-library only).
TRAINER = "trainer"
WORKER = "dataloader-worker"
LAUNCHER = "launcher"
RANK = "rank"
MULTIPROCESSING_CHILD = "multiprocessing-child"
FORKED_CHILD = "forked-child"

perf_ns = time.perf_counter_ns
now = time.time
now_ns = time.time_ns


def env_flag(value: str | None) -> bool:
    """True for a set variable other than an explicit no ("", "0", "false", "no", "off")."""
    return value is not None and value.strip().lower() not in ("", "0", "false", "no", "off")


def env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def parse_overrides(text: str | None) -> dict:
    """Parse TORCHDOCTOR_OVERRIDES (a JSON object); raise ValueError saying what is wrong."""
    if not text:
        return {}
    try:
        import json

        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{ENV_OVERRIDES} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{ENV_OVERRIDES} must be a JSON object, got {type(data).__name__}")
    out = {}
    for key, value in data.items():
        kind = OVERRIDE_TYPES.get(key)
        if kind is None:
            known = ", ".join(sorted(OVERRIDE_TYPES))
            raise ValueError(f"{ENV_OVERRIDES}: unknown key {key!r} (known: {known})")
        # bool is an int in Python: reject it where a count is expected, and vice versa.
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{ENV_OVERRIDES}: {key} must be an integer, got {value!r}")
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"{ENV_OVERRIDES}: {key} must be true or false, got {value!r}")
        out[key] = value
    return out


def message_steps(width: int) -> int:
    """Steps per message for rows of ``width`` values. A SOCK_SEQPACKET message must fit the
    socket's send buffer (net.core.wmem_default, 208 KiB by default): 4096 values take at most
    32 KiB as int64 columns and stay well under it as JSON (the 512 common steps of a message
    take 18 KiB)."""
    return max(1, MESSAGE_MAX_VALUES // max(1, width))


def pack_steps(rows: list) -> list:
    """The step rows of one message as columns (rows may be shorter: the rest is null).

    Built at flush time, so that a step only appends its values. Each column is one of
    ``["=", value]`` (every row the same), ``["Q", bytes]`` (native int64s: the agent and the
    collector share the machine; on the socket the bytes follow the JSON, see
    :func:`encode_message`) or ``["j", values]``; JSON of per-row lists costs the job about
    ten times as much per step, and the int64s as hex inside the JSON twice what they cost as
    bytes (the hex, and the JSON encoder scanning it)."""
    out = []
    count = len(rows)
    # One struct per message length, kept: packing a column through it costs about half what
    # array("q", column) does (no per-item argument parsing).
    int64s = _INT64S.get(count)
    if int64s is None:
        from struct import Struct

        int64s = _INT64S[count] = Struct(f"{count}q")
    if len(set(map(len, rows))) == 1:
        # Rows of one length (the usual message): zip transposes them faster than zip_longest.
        columns = zip(*rows, strict=True)
    else:
        from itertools import zip_longest

        columns = zip_longest(*rows)
    for column in columns:
        first = column[0]
        if column.count(first) == count and (first is None or type(first) in _SAME_TYPES):
            out.append(["=", first])
            continue
        if type(first) is int:
            try:
                out.append(["Q", int64s.pack(*column)])
                continue
            except Exception:  # noqa: BLE001 - struct.error or TypeError: a null or a non-int
                pass
        out.append(["j", list(column)])
    return out


_INT64S: dict = {}  # message length -> struct.Struct of that many native int64s
# count() compares with ==, so True == 1: a field's column holds one type (a flag is never
# a count), and these are the types whose equal values are the same value.
_SAME_TYPES = (int, str, bool, float)
# A message with step columns as bytes: this, the JSON's length (4 bytes, little-endian), the
# JSON, then the bytes of its "B" columns in order. A JSON text never starts with a NUL.
BINARY_MESSAGE = b"\x00TD2"


def encode_message(message: dict) -> bytes:
    """A message as the socket carries it: JSON, the bytes of its int64 columns after it."""
    columns = message.get("step_columns")
    blobs = [data for kind, data in columns if kind == "Q"] if columns else None
    if not blobs:
        return dumps(message).encode()
    wire = dict(message)
    wire["step_columns"] = [["B", len(c[1])] if c[0] == "Q" else c for c in columns]
    text = dumps(wire).encode()
    return b"".join((BINARY_MESSAGE, len(text).to_bytes(4, "little"), text, *blobs))


def decode_message(data: bytes) -> dict:
    """The message :func:`encode_message` wrote (or a plain JSON one, from older agents);
    raises ValueError on a malformed one."""
    import json

    if not data.startswith(BINARY_MESSAGE):
        return json.loads(data)
    head = len(BINARY_MESSAGE)
    size = int.from_bytes(data[head : head + 4], "little")
    position = head + 4 + size
    message = json.loads(data[head + 4 : position])
    if not isinstance(message, dict):
        raise ValueError("an agent message is a JSON object")
    columns = []
    for kind, value in message.get("step_columns") or ():
        if kind == "B":
            end = position + int(value)
            if end > len(data):
                raise ValueError("a step column's bytes run past the message")
            kind, value, position = "Q", data[position:end], end
        columns.append([kind, value])
    if position != len(data):
        raise ValueError("bytes after a message's step columns")
    message["step_columns"] = columns
    return message


def unpack_steps(message: dict) -> list:
    """The step rows of a message (either the columns of :func:`pack_steps`, ``q`` columns
    as hex from agents of wire version 1, or ``steps`` as rows from older ones), times on UNIX
    time nanoseconds."""
    columns = message.get("step_columns")
    if columns is None:
        return list(message.get("steps") or ())
    count = int(message["step_count"])
    values = []
    for kind, data in columns:
        if kind == "=":
            values.append([data] * count)
        elif kind == "Q" or kind == "q":
            from array import array

            packed = array("q")
            packed.frombytes(data if kind == "Q" else bytes.fromhex(data))
            values.append(packed.tolist())
        elif kind == "j":
            values.append(list(data))
        else:
            raise ValueError(f"unknown step column encoding {kind!r}")
        if len(values[-1]) != count:
            raise ValueError("a step column does not hold step_count values")
    fields = list(message.get("step_fields") or ())
    offset = int(message.get("clock_offset_ns") or 0)
    if offset and PERF_CLOCK_FIELD in fields[: len(values)]:
        i = fields.index(PERF_CLOCK_FIELD)
        values[i] = [None if v is None else v + offset for v in values[i]]
    return [list(row) for row in zip(*values, strict=True)]


_encode = None  # the process's one JSON encoder, built at the first dumps


def dumps(value) -> str:
    """JSON as the agent writes it: compact, anything JSON has no type for as its str()."""
    global _encode
    if _encode is None:
        import json  # not at start-up: most processes of a job never encode anything

        # json.dumps with options builds a new encoder at every call (~4 µs of a pass's
        # epoch-start event, and of every message).
        _encode = json.JSONEncoder(default=str, separators=(",", ":")).encode
    return _encode(value)


def qualname(obj) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"
