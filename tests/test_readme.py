"""Every code block of README.md, run as written, in order, in one folder: `Qwen/Qwen2.5-0.5B` is a tiny Qwen3
with a tiny tokenizer served by the loopback Hub of test_hub.py (so Hub ids resolve and pushes land there), and
the folder holds the files the blocks read (text documents, chats, a snapshot of published BABILong parquet).

Two blocks are run elsewhere: the quick start runs the main job (scripts/demo.sh) and this very suite
(scripts/test.sh), which CI runs through .ci/run; the recall recipe's block (scripts/recall.sh, minutes) runs as
written, on tiny sizes, in test_recall_recipe.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from huggingface_hub import HfApi, constants
from test_hub import HubStub, _make_handler
from transformers import AutoTokenizer

from titans_hf.tasks.babilong import generate_babilong
from titans_hf.testing_utils import build_qwen

README = Path(__file__).resolve().parent.parent / "README.md"
BASE_REPO = "Qwen/Qwen2.5-0.5B"
QUICK_START = ("scripts/demo.sh", "scripts/test.sh")
RECALL = "scripts/recall.sh"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|endoftext|>{{ message['role'] }}\n{{ message['content'] }}<|endoftext|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}"
)
PROSE = ("The old clock on the tower struck noon while the river carried leaves past the mill. Ships waited in "
         "the harbour for the tide, their sails folded against the grey sky. Letters arrived from the capital, "
         "full of news about markets, roads and distant wars. ")


def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of every bash and python block, in order."""
    return re.findall(r"```(bash|python)\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)


def test_the_readme_shows_runnable_blocks_and_the_quick_start():
    blocks = readme_blocks()
    assert sum(all(command in code for command in QUICK_START) for _, code in blocks) == 1
    assert sum(RECALL in code for _, code in blocks) == 1
    assert len(blocks) >= 10 and {language for language, _ in blocks} == {"bash", "python"}


@pytest.fixture
def sandbox(tmp_path, tiny_tokenizer_dir, monkeypatch):
    """The folder the blocks run in, and the environment: the loopback Hub with the base on it, a token."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # this process uploads the base to the loopback Hub
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    token = "hf_readme_" + "0" * 24
    stub = HubStub(token)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(stub))
    stub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    base = tmp_path / "base_upload"
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(base)
    build_qwen(base, vocab_size=len(tokenizer), family="qwen3")
    api = HfApi(endpoint=stub.endpoint, token=token)
    api.create_repo(BASE_REPO)
    api.upload_folder(folder_path=str(base), repo_id=BASE_REPO)

    work = tmp_path / "work"
    (work / "corpus").mkdir(parents=True)
    for index in range(3):
        (work / "corpus" / f"book{index}.txt").write_text(PROSE * (60 + 10 * index), encoding="utf-8")
    chats = [{"messages": [{"role": "user", "content": f"Where did ship {i} wait?"},
                           {"role": "assistant", "content": "In the harbour, for the tide."}]} for i in range(40)]
    (work / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats), encoding="utf-8")
    snapshot = work / "babilong-1k-samples" / "0k"
    snapshot.mkdir(parents=True)
    rows = generate_babilong("qa1", 20, 0, tokenizer, seed=5)
    pq.write_table(pa.Table.from_pylist(rows), snapshot / "qa1-00000-of-00001.parquet")

    repo = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "HF_ENDPOINT": stub.endpoint, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(tmp_path / "hf_home"), "HF_TOKEN": token, "OMP_NUM_THREADS": "1",
    }
    # scripts/ and titans_hf/accelerate/ as the README names them, relative to a clone
    for name in ("scripts", "titans_hf"):
        (work / name).symlink_to(repo / name)
    yield work, env, stub
    server.shutdown()
    server.server_close()
    thread.join()


def test_every_readme_block_runs_as_written(sandbox):
    work, env, stub = sandbox
    for number, (language, code) in enumerate(readme_blocks()):
        if all(command in code for command in QUICK_START) or RECALL in code:
            continue
        command = ["bash", "-euo", "pipefail", "-c", code] if language == "bash" else [sys.executable, "-c", code]
        result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
        assert result.returncode == 0, f"README block {number} ({language}) failed:\n{code}\n{result.stderr[-4000:]}"
    # what the blocks made is what they say
    assert (work / "stores" / "corpus.h5").is_file() and (work / "stores" / "chats" / "meta.json").is_file()
    assert (work / "outputs" / "eval" / "results.json").is_file()
    assert (work / "outputs" / "lm_eval" / "lm_results.json").is_file()
    assert (work / "outputs" / "lm_eval_harness" / "lm_eval_results.json").is_file()
    for repo in ("your-name/qwen2.5-0.5b-titans-qa1",):
        assert {"memory_model.safetensors", "memory_config.json", "config.json", "README.md"} == set(stub.files[repo])
    # the accelerate hooks saved the memory folder in place of the whole model's weights
    assert (work / "outputs" / "accelerate_state" / "memory_model.safetensors").is_file()
    assert not list((work / "outputs" / "accelerate_state").glob("model*.safetensors"))
