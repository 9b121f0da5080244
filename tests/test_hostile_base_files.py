"""Hostile input, the files of a base folder and of a full model folder.

A local base is read (its fingerprint, its safetensors headers) only as far as its files are regular files whose size
their contents account for: a FIFO, a link to /dev/zero, or a sparse file of a terabyte named like weights or like a
tokenizer is refused at once, naming it, where it would have made loading wait or read forever. The loads that could
hang run in one child process with a generous time limit, so that a regression fails these tests instead of hanging
the suite. A full model folder whose weight files lack some of its tensors is refused, naming the folder and them,
instead of loading with those tensors at random.

Each test checksums what it hands in and checks it is unchanged afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from titans_hf.modeling import TitansQwenForCausalLM

TERABYTE = 1 << 40
# The child imports torch and transformers (seconds on a busy machine), then refuses each case in milliseconds. The
# limits only turn a hang into a failure: an alarm ends a case that runs past CASE_SECONDS (a wait in Python or in a
# system call it retries), the child's own limit one stuck where no alarm reaches.
CASE_SECONDS = 30
CHILD = textwrap.dedent(f"""
    import json
    import signal
    import sys

    from titans_hf.modeling import TitansQwenForCausalLM

    def out_of_time(signum, frame):
        raise TimeoutError("still running after {CASE_SECONDS} s")

    signal.signal(signal.SIGALRM, out_of_time)
    for route, path in json.loads(sys.argv[1]):
        signal.alarm({CASE_SECONDS})
        try:
            if route == "load":
                TitansQwenForCausalLM.from_pretrained(path)
            else:
                TitansQwenForCausalLM.from_base(path, chunk_size=16, memory_head_dim=16, memory_chunk_size=8)
        except Exception as error:
            said = f"{{type(error).__name__}}: {{error}}"
        else:
            said = "loaded"
        signal.alarm(0)
        print(json.dumps(said), flush=True)
""")


def checksums(folder: Path) -> dict[str, str]:
    """sha256 of every regular file under `folder`, and the kind and size of every other entry (never read)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() or not path.is_file():
            found[str(path)] = f"{'link to ' + os.readlink(path) if path.is_symlink() else 'special'}"
        elif path.stat().st_size > 1 << 30:
            found[str(path)] = f"sparse {path.stat().st_size}"
        else:
            found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def forged_terabyte(path: Path) -> None:
    """A sparse terabyte whose header is well formed and tiles the file: one F32 tensor of shape [1] said to span all
    of its data."""
    data_size = TERABYTE - 8 - 256
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, data_size]}}).encode().ljust(256)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(TERABYTE)


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def link_to_dev_zero(path: Path) -> None:
    os.symlink("/dev/zero", path)


def sparse_terabyte(path: Path) -> None:
    with open(path, "wb") as handle:
        handle.truncate(TERABYTE)


def replaced(make):
    """`make`, over a file that is there (the tokenizer.json the memory recorded)."""
    def replace(path: Path) -> None:
        path.unlink()
        make(path)
    return replace


# case: (route, the file put into the base after the memory recorded it, how it is made, the refusal expected)
CASES = {
    "fifo weights": ("load", "extra.safetensors", make_fifo, r"{path}: a FIFO \(named pipe\), not a regular file"),
    "weights linked to /dev/zero": ("load", "extra.safetensors", link_to_dev_zero,
                                    r"{path}: a character device \(a link to /dev/zero\), not a regular file"),
    "sparse terabyte of weights": ("load", "extra.safetensors", sparse_terabyte,
                                   r"{path}: not a readable safetensors file \(its header claims 0 bytes of a "
                                   rf"{TERABYTE}-byte file\)"),
    "forged header over a sparse terabyte": ("load", "extra.safetensors", forged_terabyte,
                                             r"{path}: not a readable safetensors header \(tensor 'w' of dtype F32 and "
                                             rf"shape \[1\] spans {TERABYTE - 264} bytes"),
    "fifo tokenizer": ("load", "tokenizer.json", replaced(make_fifo),
                       r"{path}: a FIFO \(named pipe\), not a regular file"),
    "sparse terabyte tokenizer": ("load", "tokenizer.json", replaced(sparse_terabyte),
                                  rf"{{path}}: {TERABYTE} bytes, more than a model's config, tokenizer or chat "
                                  r"template file holds"),
    "fifo weights, from_base": ("from_base", "extra.safetensors", make_fifo,
                                r"{path}: a FIFO \(named pipe\), not a regular file"),
    "unchanged": ("load", None, None, r"loaded"),
}


@pytest.fixture(scope="module")
def refusals(tiny_qwen3_dir, tmp_path_factory) -> dict[str, tuple[Path, str, dict, dict]]:
    """{case: (the hostile file, what the child said loading it, checksums of the base and memory before, after)},
    every case loaded by one child process."""
    root = tmp_path_factory.mktemp("hostile_bases")
    prepared = {}
    for case, (route, name, make, _) in CASES.items():
        base = root / case.replace(" ", "_").replace("/", "_").replace(",", "")
        shutil.copytree(tiny_qwen3_dir, base)
        memory = base.with_name(base.name + "_memory")
        TitansQwenForCausalLM.from_base(base, chunk_size=16, memory_head_dim=16, memory_chunk_size=8).save_memory(memory)
        if make is not None:
            make(base / name)
        prepared[case] = (route, base, memory, base / name if name else base)
    before = {case: {**checksums(base), **checksums(memory)} for case, (_, base, memory, _) in prepared.items()}
    jobs = [(route, str(memory if route == "load" else base)) for route, base, memory, _ in prepared.values()]
    limit = 120 + CASE_SECONDS * len(jobs)
    try:
        result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(jobs)], capture_output=True, text=True,
                                timeout=limit)
        output, errors = result.stdout, result.stderr
    except subprocess.TimeoutExpired as expired:
        output, errors = (text.decode() if isinstance(text, bytes) else text or ""
                          for text in (expired.stdout, expired.stderr))
    said = [json.loads(line) for line in output.splitlines() if line.startswith('"')]
    said += [f"no answer: the child hung past {limit} s or failed ({errors[-2000:]})"] * (len(jobs) - len(said))
    return {case: (hostile, message, before[case], {**checksums(base), **checksums(memory)})
            for (case, (_, base, memory, hostile)), message in zip(prepared.items(), said, strict=True)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_base_file_that_is_no_regular_file_or_claims_a_terabyte_is_refused_at_once_naming_it(refusals, case):
    hostile, message, before, after = refusals[case]
    expected = CASES[case][3].replace("{path}", re.escape(str(hostile)))
    assert re.match(rf"(ValueError: )?{expected}", message), message
    assert after == before


def test_a_full_model_folder_missing_base_tensors_is_refused_naming_the_folder_and_them(tiny_qwen3_dir, tmp_path):
    """transformers would start missing tensors at random and only report them; loading refuses, by the model class
    and the Auto class, naming the folder, how many are missing and the first of them. The whole folder loads, and
    `output_loading_info=True` returns transformers' report with the model."""
    from transformers import AutoModelForCausalLM

    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_head_dim=16, memory_chunk_size=8)
    folder = tmp_path / "full"
    model.save_pretrained(folder, save_full_model=True)
    loaded, info = TitansQwenForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert isinstance(loaded, TitansQwenForCausalLM) and info["missing_keys"] == set()
    weights = load_file(folder / "model.safetensors")
    dropped = sorted(name for name in weights if name.startswith("model.layers.1."))
    assert len(dropped) == 11
    save_file({name: tensor for name, tensor in weights.items() if name not in dropped}, folder / "model.safetensors",
              metadata={"format": "pt"})
    before = checksums(folder)
    first = ", ".join(dropped[:5])
    for load in (TitansQwenForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(folder))}: its weight files lack 11 of the model's "
                                             rf"tensors \({re.escape(first)}, \.\.\.\), which would start at random"):
            load(folder)
    assert checksums(folder) == before

    save_file({name: tensor for name, tensor in weights.items() if name != "model.embed_tokens.weight"},
              folder / "model.safetensors", metadata={"format": "pt"})  # and with it the tied lm_head
    with pytest.raises(ValueError, match=r"lack 2 of the model's tensors \(lm_head\.weight, "
                                         r"model\.embed_tokens\.weight\), which"):
        TitansQwenForCausalLM.from_pretrained(folder)
