"""``--json`` keeps stdout for the JSON: what runs meanwhile prints to stderr (Python prints and
C code writing to file descriptor 1 alike), and stdout works again afterwards."""

from __future__ import annotations

import json
import subprocess
import sys


def test_prints_inside_the_guard_go_to_stderr_and_stdout_is_restored():
    code = (
        "import json, os\n"
        "from torchdoctor.cli.json_output import user_output_to_stderr\n"
        "with user_output_to_stderr(True):\n"
        "    print('from python')\n"
        "    os.write(1, b'from fd 1\\n')\n"
        "print(json.dumps({'ok': True}))\n"
        "with user_output_to_stderr(False):\n"
        "    print('not guarded')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert json.loads(first) == {"ok": True} and second == "not guarded"
    assert "from python" in done.stderr and "from fd 1" in done.stderr
