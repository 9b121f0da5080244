"""Launching the 2-process gloo workers that the FSDP2 tests run as scripts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_ranks(script: str, leading: list[str], trailing: list[str]) -> None:
    """Run `python script *leading RANK 2 PORT *trailing` for ranks 0 and 1; fail with their output if either fails."""
    port, env = str(free_port()), {**os.environ, "OMP_NUM_THREADS": "1"}
    workers = [
        subprocess.Popen([sys.executable, script, *leading, str(rank), "2", port, *trailing],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    outputs = [worker.communicate()[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], "\n".join(outputs)[-4000:]


def exit_without_finalising() -> None:
    """End a worker whose work is written, skipping interpreter finalisation: gloo's threads can abort it
    ("terminate called without an active exception", exit -6)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
