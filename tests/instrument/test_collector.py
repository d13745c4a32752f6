"""The collector: a real socket, real agent-side senders, the real recording writer."""

from __future__ import annotations

import json
import os
import socket
import tempfile

import pytest

from torchdoctor.instrument import agent as agent_mod
from torchdoctor.instrument.collector import BOOTSTRAP_DIR, Collector
from torchdoctor.recording import RecordingWriter, open_recording


def _message(pid, steps):
    return {
        "v": 1,
        "pid": pid,
        "rank": None,
        "role": "trainer",
        "step_fields": ["wall_s", "step", "t_start", "t_end", "data_wait_s", "future_field"],
        "steps": [[0.5, i, 10.0 + i, 10.5 + i, 0.1, "x"] for i in range(steps)],
        "settings": [[1.0, "torch.num_threads", "4"]],
        "events": [[1.0, "process-start", "{}"]],
    }


def test_messages_from_several_senders_land_in_the_recording(tmp_path):
    out = tmp_path / "r.sqlite"
    writer = RecordingWriter(out, {})
    collector = Collector(writer)
    senders = [agent_mod.SocketSink(collector.address) for _ in range(3)]
    for pid, sink in enumerate(senders, start=100):
        sink(_message(pid, 4))
        sink.close()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    raw.connect(collector.address)
    raw.send(b"not json")
    raw.send(json.dumps({"pid": "x"}).encode())
    raw.close()
    collector.close()
    writer.close()
    with open_recording(out) as rec:
        steps = rec.rows("steps")
        assert sorted({s["pid"] for s in steps}) == [100, 101, 102]
        assert len(steps) == 12 and all(s["wall_s"] == 0.5 for s in steps)
        assert len(rec.rows("settings")) == 3 and len(rec.rows("events")) == 3
    assert collector.sink.errors == 2
    assert not os.path.exists(collector.address)


def test_child_env_chains_pythonpath_and_respects_no_instrument(tmp_path):
    collector = Collector(RecordingWriter(tmp_path / "r.sqlite", {}))
    try:
        env = collector.child_env({"PYTHONPATH": "/opt/lib", "HOME": "/root"})
        assert env["PYTHONPATH"] == os.pathsep.join([BOOTSTRAP_DIR, "/opt/lib"])
        assert env[agent_mod.ENV_COLLECTOR] == collector.address
        assert "sitecustomize.py" in os.listdir(BOOTSTRAP_DIR)
        off = {"TORCHDOCTOR_NO_INSTRUMENT": "1"}
        assert collector.child_env(off) is off
    finally:
        collector.close()


def test_cannot_listen_warns_once_and_leaves_env_alone(tmp_path, monkeypatch):
    def no_tmp(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", no_tmp)
    warnings = []
    collector = Collector(RecordingWriter(tmp_path / "r.sqlite", {}), warn=warnings.append)
    env = {"PATH": "/bin"}
    assert collector.child_env(env) is env
    collector.close()
    assert len(warnings) == 1 and "will not be recorded" in warnings[0]


def test_step_columns_carry_every_value_as_the_rows_held_it():
    from torchdoctor.instrument.agent.contract import (
        STEP_FIELDS,
        decode_message,
        encode_message,
        pack_steps,
        unpack_steps,
    )

    # What the agent keeps: perf_counter ends, rows of CPU steps (8 values) and CUDA steps
    # (13), nulls, flags, a dtype that changes, a count that does not.
    rows = [
        (0, 5_000, 1_000, 0, 64, 64, None, False),
        (1, 6_000, 1_000, 250, 64, None, "bfloat16", True),
        [2, 7_500, 1_500, 10, 64, 64, None, False, 1 << 40, 1 << 41, 1 << 40, 0, 0],
    ]
    message = {
        "step_fields": list(STEP_FIELDS),
        "step_count": len(rows),
        "step_columns": pack_steps(rows),
        "clock_offset_ns": 1_796_000_000 * 10**9,
    }
    back = unpack_steps(decode_message(encode_message(message)))
    width = max(len(r) for r in rows)
    for row, got in zip(rows, back, strict=True):
        want = [*row, *[None] * (width - len(row))]
        want[1] += message["clock_offset_ns"]  # ends come back on UNIX time
        assert got == want and [type(v) for v in got] == [type(v) for v in want]


def test_int64_columns_follow_the_json_as_bytes_and_bad_framing_is_refused():
    from torchdoctor.instrument.agent.contract import (
        BINARY_MESSAGE,
        decode_message,
        encode_message,
        pack_steps,
        unpack_steps,
    )

    rows = [(i, 10_000 + i * 977, 977 + i, i % 5, 64, 64, None, False) for i in range(128)]
    message = {"pid": 1, "step_count": 128, "step_columns": pack_steps(rows)}
    data = encode_message(message)
    assert data.startswith(BINARY_MESSAGE)
    text_size = int.from_bytes(data[len(BINARY_MESSAGE) : len(BINARY_MESSAGE) + 4], "little")
    # Four columns vary (step, end, wall, wait): their int64s are the tail, not in the JSON.
    assert len(data) - len(BINARY_MESSAGE) - 4 - text_size == 4 * 128 * 8
    assert unpack_steps(decode_message(data)) == [list(r) for r in rows]
    for broken in (data[:-1], data + b"\0", data[:12]):
        with pytest.raises(ValueError):
            decode_message(broken)


def test_a_version_1_agents_hex_columns_still_read():
    import json
    from array import array

    from torchdoctor.instrument.agent.contract import decode_message, unpack_steps

    ends = array("q", [5, 7, 9]).tobytes().hex()
    old = {"v": 1, "step_count": 3, "step_columns": [["q", ends], ["=", 64]]}
    assert unpack_steps(decode_message(json.dumps(old).encode())) == [[5, 64], [7, 64], [9, 64]]
