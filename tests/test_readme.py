"""Every code block of README.md and of the usage pages under docs/, run as written, in order, in one folder per
document set: `Qwen/Qwen2.5-0.5B` is a tiny Qwen3 with a tiny tokenizer served by the loopback Hub of test_hub.py
(so Hub ids resolve and pushes land there), and the folder holds the files the blocks read (text documents, chats, a
snapshot of published BABILong parquet).

Some blocks are run elsewhere or otherwise: the install block is what scripts/setup_env.sh runs (scripts/test.sh and
scripts/demo.sh source it), checked here against setup.cfg's pins and against setup_env.sh's pip calls (recorded, not
run) with and without the torch index the quick start names; the quick start runs the CPU demo
(scripts/demo.sh) and this very suite (scripts/test.sh), which CI runs through .ci/run; the recall recipe's block
(scripts/recall.sh, minutes) runs as written, on tiny sizes, in test_recall_recipe.py; the block marked for GPUs runs
here on two CPU processes at tiny sizes (ON_CPU: each replacement applies exactly once, so the block and its CPU run
stay the same command).
"""

from __future__ import annotations

import configparser
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

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SETUP_ENV = ROOT / "scripts" / "setup_env.sh"
# the usage pages, in the order their blocks run (each page reads what the pages before it made)
DOCS_PAGES = tuple(ROOT / "docs" / name for name in ("data.md", "model.md", "training.md", "evaluation.md",
                                                      "memory.md"))
BASE_REPO = "Qwen/Qwen2.5-0.5B"
QUICK_START = ("scripts/demo.sh", "scripts/test.sh")
RECALL = "scripts/recall.sh"
INSTALL = "pip install"
ON_GPUS = "# on GPUs"
# The GPU block as the tests run it: two CPU processes (FSDP through accelerate on a CPU becomes DDP), tiny rows of the
# same four chunk counts, two optimizer steps.
ON_CPU = {
    "titans_hf/accelerate/fsdp.yaml": "titans_hf/accelerate/cpu_ddp.yaml",
    "--generate_lengths 3500 7500 15500 31500": "--generate_lengths 0 200 440 900 --num_samples 8",
    "--max_length 32768 --chunk_size 4096 --answer_reserve_tokens 64":
        "--max_length 1024 --chunk_size 128 --answer_reserve_tokens 16",
    "--bf16": "--max_steps 2",
}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|endoftext|>{{ message['role'] }}\n{{ message['content'] }}<|endoftext|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}"
)
PROSE = ("The old clock on the tower struck noon while the river carried leaves past the mill. Ships waited in "
         "the harbour for the tide, their sails folded against the grey sky. Letters arrived from the capital, "
         "full of news about markets, roads and distant wars. ")


def code_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of a Markdown file, in order."""
    return re.findall(r"```(\w*)\n(.*?)```", path.read_text(encoding="utf-8"), re.DOTALL)


def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of every bash and python block, in order."""
    return [(language, code) for language, code in code_blocks(README) if language in ("bash", "python")]


def runs_elsewhere(code: str) -> bool:
    """The install, quick start and recall blocks (see the module's docstring)."""
    return INSTALL in code or all(command in code for command in QUICK_START) or RECALL in code


def on_cpu(code: str) -> str:
    """The GPU block as this test runs it."""
    for gpu, cpu in ON_CPU.items():
        assert code.count(gpu) == 1, f"the GPU block no longer says {gpu!r}: update ON_CPU"
        code = code.replace(gpu, cpu)
    return code


def run_blocks(blocks: list[tuple[str, str]], work: Path, env: dict[str, str], source: str) -> None:
    for number, (language, code) in enumerate(blocks):
        if runs_elsewhere(code):
            continue
        if code.startswith(ON_GPUS):
            code = on_cpu(code)
        command = ["bash", "-euo", "pipefail", "-c", code] if language == "bash" else [sys.executable, "-c", code]
        result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
        assert result.returncode == 0, f"{source} block {number} ({language}) failed:\n{code}\n{result.stderr[-4000:]}"


def test_the_readme_shows_runnable_blocks_and_the_quick_start():
    blocks = readme_blocks()
    assert sum(all(command in code for command in QUICK_START) for _, code in blocks) == 1
    assert sum(RECALL in code for _, code in blocks) == 1
    assert len(blocks) >= 10 and {language for language, _ in blocks} == {"bash", "python"}
    assert len(blocks) == len(code_blocks(README))  # no block in another language, which no test would run
    [gpu] = [code for _, code in blocks if code.startswith(ON_GPUS)]
    assert "accelerate launch" in gpu and "--state_passing 0.5" in on_cpu(gpu)
    for page in DOCS_PAGES:
        languages = [language for language, _ in code_blocks(page)]
        assert languages and set(languages) <= {"bash", "python"}, page
        assert not any(runs_elsewhere(code) or code.startswith(ON_GPUS) for _, code in code_blocks(page)), page
    every_page = {path.name for path in (ROOT / "docs").glob("*.md")}
    unrun = {"ARCHITECTURE.md"}  # its blocks are file trees, not commands
    assert not {name for name in every_page - unrun if code_blocks(ROOT / "docs" / name)} - {p.name for p in DOCS_PAGES}


def readme_section(title: str) -> str:
    """The text of README.md's `## title` section, up to the next one."""
    return README.read_text(encoding="utf-8").split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def setup_env_pip_calls(tmp_path: Path, env: dict[str, str], pip_fails: bool = False) -> tuple[int, list[str], str]:
    """(exit status, each pip call's arguments, stderr) of scripts/setup_env.sh run in a copy of the repository
    whose .venv/bin/python records its arguments (and fails each call with `pip_fails`) instead of installing; a
    second call with the same `tmp_path` runs it again in the same copy."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True, exist_ok=True)
    (repo / "scripts" / "setup_env.sh").write_bytes(SETUP_ENV.read_bytes())
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(f'#!/usr/bin/env bash\necho "$*" >> "{tmp_path}/calls.txt"\nexit {int(pip_fails)}\n')
    python.chmod(0o755)
    (tmp_path / "calls.txt").unlink(missing_ok=True)
    result = subprocess.run(["bash", str(repo / "scripts" / "setup_env.sh"), "test"], env=env, capture_output=True,
                            text=True)
    calls = (tmp_path / "calls.txt").read_text().splitlines() if (tmp_path / "calls.txt").exists() else []
    return result.returncode, calls, result.stderr


def test_the_install_block_is_what_setup_env_installs(tmp_path):
    """setup_env.sh installs torch==2.13.0 from pip's configured index, or from the one TORCH_INDEX_URL names; the
    README's quick start says so and names the CPU index of its install block; a bad URL is one error line."""
    [install] = [code for _, code in readme_blocks() if INSTALL in code]
    assert "python3 -m venv .venv" in install.splitlines()[0]  # a venv first, so nothing else pulls a torch in
    cpu_index = "https://download.pytorch.org/whl/cpu"
    assert f"pip install torch==2.13.0 --index-url {cpu_index}" in install
    quick_start = " ".join(readme_section("Quick start").split())
    assert f"`TORCH_INDEX_URL={cpu_index} scripts/test.sh`" in quick_start
    assert "`torch==2.13.0`, then this package. torch comes from the index pip is configured with" in quick_start
    assert "CPU wheel" not in quick_start  # what pip's configured index holds decides the build
    env = {key: value for key, value in os.environ.items() if key != "TORCH_INDEX_URL"}
    pip = "-m pip install --quiet --disable-pip-version-check"
    assert setup_env_pip_calls(tmp_path / "default", env) == (0, [f"{pip} torch==2.13.0", f"{pip} -e .[test]"], "")
    # once installed, a rerun installs nothing until the package's metadata or the torch index changes
    assert setup_env_pip_calls(tmp_path / "default", env) == (0, [], "")
    (tmp_path / "default" / "repo" / "setup.cfg").write_text("[metadata]\nname = changed\n")
    assert setup_env_pip_calls(tmp_path / "default", env) == (0, [f"{pip} torch==2.13.0", f"{pip} -e .[test]"], "")
    assert setup_env_pip_calls(tmp_path / "default", {**env, "TORCH_INDEX_URL": cpu_index}) == (
        0, [f"{pip} --index-url {cpu_index} torch==2.13.0", f"{pip} -e .[test]"], "")
    assert setup_env_pip_calls(tmp_path / "cpu", {**env, "TORCH_INDEX_URL": cpu_index}) == (
        0, [f"{pip} --index-url {cpu_index} torch==2.13.0", f"{pip} -e .[test]"], "")
    assert setup_env_pip_calls(tmp_path / "unreachable", {**env, "TORCH_INDEX_URL": cpu_index}, pip_fails=True) == (
        1, [f"{pip} --index-url {cpu_index} torch==2.13.0"],
        f"setup_env.sh: pip could not install torch==2.13.0 from TORCH_INDEX_URL={cpu_index}\n")
    # a failed install leaves no record of one: the next run tries again
    assert setup_env_pip_calls(tmp_path / "unreachable", {**env, "TORCH_INDEX_URL": cpu_index}) == (
        0, [f"{pip} --index-url {cpu_index} torch==2.13.0", f"{pip} -e .[test]"], "")
    assert setup_env_pip_calls(tmp_path / "bad", {**env, "TORCH_INDEX_URL": "--no-deps x"}) == (
        2, [], "setup_env.sh: TORCH_INDEX_URL='--no-deps x' is not an index URL (http://, https:// or file://, no "
        "spaces)\n")
    assert "pip install -e .  " in install
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg", encoding="utf-8")
    pinned = [line for line in setup["options"]["install_requires"].split() if "<" in line]
    assert len(pinned) == 5 and all(requirement in install for requirement in pinned)
    extras = setup["options.extras_require"]
    named = re.findall(r'pip install -e "\.\[(\w+)\]"', install)
    assert named == ["trl", "peft", "lm_eval", "test"]
    for extra in named:
        assert all(requirement in install for requirement in extras[extra].split()), extra


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
        # a ledger line a paragraph, so that the books hold the distinct sentences a haystack needs
        book = "".join(f"{PROSE}The ledger's page {page} was written in blue ink. " for page in range(60 + 10 * index))
        (work / "corpus" / f"book{index}.txt").write_text(book, encoding="utf-8")
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
    work, env, _ = sandbox
    run_blocks(readme_blocks(), work, env, "README")
    # what the blocks made is what they say
    assert (work / "stores" / "corpus.h5").is_file() and (work / "stores" / "chats" / "meta.json").is_file()
    assert (work / "outputs" / "lm_eval" / "lm_results.json").is_file()
    assert (work / "outputs" / "lm_eval_harness" / "lm_eval_results.json").is_file()
    for memory in ("qwen_memory", "qa1_32k", "dpo_memory", "lora_memory"):
        assert {"memory_model.safetensors", "memory_config.json", "config.json"} <= set(
            path.name for path in (work / "outputs" / memory).iterdir()), memory
    assert (work / "outputs" / "lora_memory" / "adapter_model.safetensors").is_file()


def test_every_docs_block_runs_as_written(sandbox):
    work, env, stub = sandbox
    for page in DOCS_PAGES:
        run_blocks(code_blocks(page), work, env, f"docs/{page.name}")
    # what the blocks made is what they say
    assert (work / "stores" / "corpus.h5").is_file() and (work / "stores" / "chats" / "meta.json").is_file()
    assert (work / "outputs" / "eval" / "results.json").is_file()
    assert (work / "outputs" / "lm_eval" / "lm_results.json").is_file()
    for repo in ("your-name/qwen2.5-0.5b-titans-qa1",):
        assert {"memory_model.safetensors", "memory_config.json", "config.json", "README.md"} == set(stub.files[repo])
    # the accelerate hooks saved the memory folder in place of the whole model's weights
    assert (work / "outputs" / "accelerate_state" / "memory_model.safetensors").is_file()
    assert not list((work / "outputs" / "accelerate_state").glob("model*.safetensors"))
