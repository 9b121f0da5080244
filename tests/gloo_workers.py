"""Launching 2-process gloo runs: the workers that the FSDP2 tests run as scripts, and `accelerate launch` DDP
training beside the same training in one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


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


def ddp_and_one_process(flags: list[str], out_dir: Path) -> tuple[Path, Path]:
    """`titans-hf train` with `flags`, twice: `accelerate launch` of scripts/train.py on two gloo ranks of one row per
    batch (into out_dir/ddp), and one process of two rows per batch on one thread, as each rank (out_dir/one). With
    `--optim sgd` both take the same steps: DDP averages the ranks' gradients. Returns the two output folders."""
    import torch

    from titans_hf.commands import main as cli_main

    repo = Path(__file__).resolve().parent.parent
    ddp, one = out_dir / "ddp", out_dir / "one"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(repo / "titans_hf" / "accelerate" / "cpu_ddp.yaml"), str(repo / "scripts" / "train.py"), *flags,
               "--per_device_train_batch_size", "1", "--output_dir", str(ddp)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(out_dir / "hf_home")}
    result = subprocess.run(command, env=env, cwd=repo, capture_output=True, text=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert json.loads((ddp / "training_args.json").read_text())["world_size"] == 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli_main(["train", *flags, "--per_device_train_batch_size", "2", "--use_cpu", "true",
                         "--output_dir", str(one)]) == 0
    finally:
        torch.set_num_threads(threads)
    return ddp, one
