"""Shared fixtures: offline caches and tiny tokenizers / Qwen models saved to disk.

Everything is built locally and loaded back through ``from_pretrained`` on a path,
the same code path a hub id takes.
"""

from __future__ import annotations

import os
import tempfile

_HF_HOME = tempfile.mkdtemp(prefix="titans_hf_tests_hf_home_")
os.environ.setdefault("HF_HOME", _HF_HOME)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from titans_hf.testing_utils import build_qwen, build_tokenizer  # noqa: E402

ACTORS = ["John", "Mary", "Sandra", "Daniel"]
LOCATIONS = ["bathroom", "bedroom", "garden", "hallway", "kitchen", "office"]
VERBS = ["moved to", "went to", "journeyed to", "travelled to", "went back to"]
PROSE = [
    "The old clock on the tower struck noon while the river carried leaves past the mill.",
    "A quiet wind moved across the fields, and the farmers spoke of rain and harvest.",
    "Ships waited in the harbour for the tide, their sails folded against the grey sky.",
    "Letters arrived from the capital, full of news about markets, roads and distant wars.",
    "In the evening the lamps were lit one by one along the narrow streets of the town.",
]


def tokenizer_corpus() -> list[str]:
    """Text that makes every BABILong word and common prose word a single BPE token."""
    facts = [f"{a} {v} the {loc}." for a in ACTORS for v in VERBS for loc in LOCATIONS]
    questions = [f"Question: Where is {a}? Answer: {loc}" for a in ACTORS for loc in LOCATIONS]
    return (facts + questions + PROSE) * 20


# The tests that take minutes, scheduled first: `pytest -n 2 --dist loadgroup` (scripts/test.sh) hands out tests in
# this order, one at a time as workers free up, so these two start at once on different workers and the rest fills in
# beside them (`--dist loadfile` would start the files with the most tests first, and these last).
SLOWEST_TESTS = ("test_every_readme_block_runs_as_written", "test_every_docs_block_runs_as_written",
                 "test_readme_recall_block_trains_evaluates_reports_and_reuses_base_and_data")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: SLOWEST_TESTS.index(item.name) if item.name in SLOWEST_TESTS else len(SLOWEST_TESTS))


@pytest.fixture(scope="module")
def one_thread():
    """Torch at one intra-op thread for a module: tiny matmuls gain nothing from two, and lose badly when other jobs
    share the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tokenizer(tokenizer_corpus(), path, vocab_size=512)
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer_no_pad_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tokenizer_no_pad")
    build_tokenizer(tokenizer_corpus(), path, vocab_size=512, pad_token=None)
    return path


def _tiny_model_dir(tmp_path_factory, tokenizer_dir, family: str):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp(f"tiny_{family}")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(path)
    build_qwen(path, vocab_size=len(tokenizer), family=family)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A folder holding a random 2-layer Qwen3 (hidden 64) and its tokenizer."""
    return _tiny_model_dir(tmp_path_factory, tiny_tokenizer_dir, "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A folder holding a random 2-layer Qwen2 (hidden 64) and its tokenizer."""
    return _tiny_model_dir(tmp_path_factory, tiny_tokenizer_dir, "qwen2")
