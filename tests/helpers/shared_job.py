"""A job for the shared-machine tests, run by /usr/bin/python3 as a test user (stdlib only).

It prints one JSON line of what /proc says about it (uid, groups, allowed CPUs) and the time it
started, keeps its cores busy for ``--burn`` seconds or until ``--gate`` exists, then prints the
time it ended and exits with ``--exit``.
"""

import argparse
import json
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--burn", type=float, default=0.0)
parser.add_argument("--gate")
parser.add_argument("--exit", type=int, default=0)
args = parser.parse_args()

status = {}
with open("/proc/self/status") as f:
    for line in f:
        key, _, value = line.partition(":")
        status[key] = value.strip()
print(
    json.dumps(
        {
            "uid": int(status["Uid"].split()[0]),
            "euid": int(status["Uid"].split()[1]),
            "gid": int(status["Gid"].split()[0]),
            "cpus": status["Cpus_allowed_list"],
            "cwd": os.getcwd(),
            "start": time.time(),
        }
    ),
    flush=True,
)
end = time.monotonic() + args.burn
while time.monotonic() < end or (args.gate and not os.path.exists(args.gate)):
    for _ in range(20000):  # busy: the cores it was given are in use
        pass
    if args.gate and time.monotonic() >= end:
        time.sleep(0.01)  # waiting on the gate: do not burn a shared machine for nothing
print(json.dumps({"end": time.time()}), flush=True)
sys.exit(args.exit)
