"""A real, remote-controlled process tree for the sampling tests.

Run as ``python tests/helpers/jobtree.py``: this process is the job's root (a "trainer"). It
reads one command per line on stdin and answers one line on stdout, so a test can shape the
tree step by step and know exactly when each step is done (no sleeps):

    fork idle|spawn|forkserver   start an idle child (multiprocessing fork, spawn or
                           forkserver start method) -> "<pid>"
    burn PID SECONDS       the child spins until it used SECONDS of CPU -> "done"
    alloc PID MB           the child allocates and touches MB megabytes -> "done"
    comm PID NAME          the child renames itself (/proc/self/comm) -> "done"
    exit PID               the child exits and is reaped -> "gone"
    zombie PID             the child exits and is left unreaped (a zombie) -> "zombie"
    reap PID               reap a zombie left by "zombie" -> "gone"
    preexec                fork a child that waits to exec (like a shell's child) -> "<pid>"
    exec PID               that child execs a new Python program -> "execd"
    loader                 start a torch DataLoader with 2 fork workers -> "<pid> <pid>"
    quit                   exit (children are told to exit first)
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time


def child_main(conn) -> None:
    """A child waiting on its control pipe: idle (blocked in read) unless told otherwise."""
    hoard = []
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        cmd = msg[0]
        if cmd == "burn":
            end = time.process_time() + msg[1]
            while time.process_time() < end:
                pass
            conn.send("done")
        elif cmd == "alloc":
            hoard.append(b"\x01" * (msg[1] << 20))  # written, so the pages are really resident
            conn.send("done")
        elif cmd == "comm":
            with open("/proc/self/comm", "w") as f:
                f.write(msg[1])
            conn.send("done")
        elif cmd == "exit":
            return


# What an exec'd child runs: say so on the inherited pipe, then wait for SIGTERM.
EXEC_TARGET = "import os, signal, sys; os.write(int(sys.argv[1]), b'x'); signal.pause()"


class _Dataset:
    """Every item is the PID of the worker that produced it."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> int:
        return os.getpid()


def main() -> None:
    children: dict[int, tuple[mp.Process, object]] = {}
    pending_exec: dict[int, tuple[int, int]] = {}
    execd: list[int] = []
    loaders = []
    out = sys.stdout

    def reply(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        cmd = parts[0]
        if cmd == "fork":
            kind = parts[1]
            ctx = mp.get_context(kind if kind in ("spawn", "forkserver") else "fork")
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=child_main, args=(child_conn,), daemon=True)
            proc.start()
            child_conn.close()
            parent_conn.recv()  # running its loop: done starting up
            children[proc.pid] = (proc, parent_conn)
            reply(str(proc.pid))
        elif cmd in ("burn", "alloc"):
            proc, conn = children[int(parts[1])]
            value = float(parts[2]) if cmd == "burn" else int(parts[2])
            conn.send((cmd, value))
            conn.recv()
            reply("done")
        elif cmd == "comm":
            proc, conn = children[int(parts[1])]
            conn.send(("comm", parts[2]))
            conn.recv()
            reply("done")
        elif cmd == "exit":
            proc, conn = children.pop(int(parts[1]))
            conn.send(("exit",))
            proc.join()
            reply("gone")
        elif cmd == "zombie":
            pid = int(parts[1])
            proc, conn = children[pid]
            conn.send(("exit",))
            # Wait until it is a zombie without reaping it (WNOWAIT).
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            reply("zombie")
        elif cmd == "reap":
            proc, conn = children.pop(int(parts[1]))
            proc.join()
            reply("gone")
        elif cmd == "preexec":
            go_r, go_w = os.pipe()
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # a fork child that will exec on "exec PID", like a shell's child
                os.close(go_w)
                os.close(ready_r)
                if not os.read(go_r, 1):
                    os._exit(0)
                os.set_inheritable(ready_w, True)
                os.execv(sys.executable, [sys.executable, "-c", EXEC_TARGET, str(ready_w)])
            os.close(go_r)
            os.close(ready_w)
            pending_exec[pid] = (go_w, ready_r)
            reply(str(pid))
        elif cmd == "exec":
            pid = int(parts[1])
            go_w, ready_r = pending_exec.pop(pid)
            os.write(go_w, b"g")
            os.read(ready_r, 1)  # written by the new program
            os.close(go_w)
            os.close(ready_r)
            execd.append(pid)
            reply("execd")
        elif cmd == "loader":
            import torch.utils.data as tud

            loader = tud.DataLoader(
                _Dataset(), batch_size=1, num_workers=2, multiprocessing_context="fork"
            )
            it = iter(loader)
            # Batches go to the workers round robin: the first two come from both workers.
            pids = {int(next(it)[0]), int(next(it)[0])}
            loaders.append(it)
            reply(" ".join(str(p) for p in sorted(pids)))
        elif cmd == "quit":
            break
    for proc, conn in children.values():
        with contextlib.suppress(OSError):
            conn.send(("exit",))
        proc.join()
    for go_w, _ready_r in pending_exec.values():
        os.close(go_w)  # the child sees EOF and exits without exec'ing
    for pid in execd:
        os.kill(pid, signal.SIGTERM)
    for pid in [*pending_exec, *execd]:
        os.waitpid(pid, 0)
    loaders.clear()


if __name__ == "__main__":
    main()
