"""Hostile input, the fingerprints: what tells a base or a tokenizer apart from another of the same shape.

A local base is recorded by a fingerprint of every byte of its weights, its config, generation config, tokenizer
files and chat templates, so a base with another tokenizer of the same size, another chat template or generation
defaults, or with a few edited embedding rows, is not the base a memory was trained on, and a memory config that
records no fingerprint for its local base, or one of another form (the sampled one of development versions), is
refused. A token store that records no tokenizer fingerprint is refused as one that records another is.

Each test checksums what it hands in and checks it is unchanged afterwards.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from titans_hf.data.prepare import prepare
from titans_hf.data.tokens_builder import check_stores_tokenizer
from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.modeling.memory_folder import base_fingerprint
from titans_hf.testing_utils import build_tokenizer


def checksums(*roots: Path) -> dict[str, str]:
    files = [file for root in roots for file in ([root] if root.is_file() else sorted(root.rglob("*")))]
    return {str(file): hashlib.sha256(file.read_bytes()).hexdigest() for file in files if file.is_file()}


@pytest.fixture
def local_base(tiny_qwen3_dir, tmp_path) -> Path:
    base = tmp_path / "base"
    shutil.copytree(tiny_qwen3_dir, base)
    return base


def memory_on(base: Path, folder: Path) -> Path:
    model = TitansQwenForCausalLM.from_base(base, chunk_size=16, memory_head_dim=16, memory_chunk_size=8)
    model.save_pretrained(folder)
    return folder


def other_tokenizer_of_the_same_size(base: Path, folder: Path) -> None:
    """Replace the base's tokenizer by one trained on other text, of exactly the base's vocabulary size."""
    size = len(AutoTokenizer.from_pretrained(base))
    build_tokenizer(["completely different words for another vocabulary entirely"] * 50
                    + [f"token{i} " * 3 for i in range(600)], folder, vocab_size=size)
    other = AutoTokenizer.from_pretrained(folder)
    assert len(other) == size and other.get_vocab() != AutoTokenizer.from_pretrained(base).get_vocab()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, base / name)


def edit_embedding_rows(base: Path) -> None:
    """Move 160 rows of the input embeddings (rows 40-199 of 512 rows of 64 floats), none of them at the start,
    middle or end of the tensor (rows 0-15, 248-263 and 496-511), where a fingerprint that samples a tensor's bytes
    would look."""
    weights = load_file(base / "model.safetensors")
    embeddings = weights["model.embed_tokens.weight"].clone()
    assert embeddings.shape == (512, 64)
    embeddings[40:200] += 0.5
    save_file({**weights, "model.embed_tokens.weight": embeddings}, base / "model.safetensors",
              metadata={"format": "pt"})


@pytest.mark.parametrize("change", ["tokenizer", "embedding rows"])
def test_a_base_with_another_tokenizer_or_edited_embedding_rows_is_not_the_recorded_base(local_base, tmp_path,
                                                                                        change):
    memory = memory_on(local_base, tmp_path / "memory")
    recorded = json.loads((memory / "memory_config.json").read_text())["base_fingerprint"]
    assert recorded == base_fingerprint(local_base)
    if change == "tokenizer":
        other_tokenizer_of_the_same_size(local_base, tmp_path / "other_tokenizer")
    else:
        edit_embedding_rows(local_base)
    assert base_fingerprint(local_base) != recorded
    before = checksums(memory, local_base)
    with pytest.raises(ValueError, match=rf"{memory}: its memory config names the local base {local_base}, but the "
                                         r"model there now is not the one the memory was trained on"):
        TitansQwenForCausalLM.from_pretrained(memory)
    assert checksums(memory, local_base) == before


CHAT_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"


@pytest.mark.parametrize("change", ["chat template", "named chat template", "generation config"])
def test_a_base_with_another_chat_template_or_generation_config_is_not_the_recorded_base(local_base, tmp_path, change):
    """transformers reads the chat templates beside the tokenizer (chat_template.jinja, additional_chat_templates/)
    and the generation defaults from generation_config.json: a base whose template or defaults changed after the
    memory recorded it is refused, naming the base; the unchanged base loads."""
    from transformers import GenerationConfig

    (local_base / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (local_base / "additional_chat_templates").mkdir()
    (local_base / "additional_chat_templates" / "terse.jinja").write_text("{{ messages[-1]['content'] }}")
    memory = memory_on(local_base, tmp_path / "memory")
    TitansQwenForCausalLM.from_pretrained(memory)  # the base as recorded
    tokenizer = AutoTokenizer.from_pretrained(local_base)
    assert tokenizer.chat_template == {"default": CHAT_TEMPLATE, "terse": "{{ messages[-1]['content'] }}"}
    if change == "chat template":
        (local_base / "chat_template.jinja").write_text(CHAT_TEMPLATE.replace(": ", " says: "))
        assert AutoTokenizer.from_pretrained(local_base).chat_template["default"] != CHAT_TEMPLATE
    elif change == "named chat template":
        (local_base / "additional_chat_templates" / "terse.jinja").write_text("{{ messages[0]['content'] }}")
        assert AutoTokenizer.from_pretrained(local_base).chat_template["terse"] == "{{ messages[0]['content'] }}"
    else:
        path = local_base / "generation_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "max_new_tokens": 7}))
        assert GenerationConfig.from_pretrained(local_base).max_new_tokens == 7
    before = checksums(memory, local_base)
    with pytest.raises(ValueError, match=rf"{re.escape(str(memory))}: its memory config names the local base "
                                         rf"{re.escape(str(local_base))}, but the model there now is not the one"):
        TitansQwenForCausalLM.from_pretrained(memory)
    assert checksums(memory, local_base) == before


@pytest.mark.parametrize("removed", ["null", "deleted from a config of no format_version", "deleted"])
def test_a_memory_config_without_the_fingerprint_of_its_local_base_is_refused_naming_file_and_field(local_base,
                                                                                                   tmp_path, removed):
    """from_base records a fingerprint for every local base; a config without one (null) would load on any model of
    the same shape at that path, so it is refused, naming memory_config.json and the field; the base given explicitly
    still loads the memory. Deleted from a config of the current format, the field is refused as missing when the
    config is read; from a config of no format_version (from before titans_hf's first release, whose missing fields
    took defaults), the config itself is refused, the base given explicitly or not."""
    memory = memory_on(local_base, tmp_path / "memory")
    config_path = memory / "memory_config.json"
    config = json.loads(config_path.read_text())
    assert len(config["base_fingerprint"]) == 64
    if removed == "null":
        config["base_fingerprint"] = None
    else:
        del config["base_fingerprint"]
        if removed != "deleted":
            config.pop("format_version", None)
    config_path.write_text(json.dumps(config))
    before = checksums(memory, local_base)
    message = {
        "null": rf"^{re.escape(str(config_path))}: names the local base {re.escape(str(local_base))} but records no "
                r"base_fingerprint, so nothing shows that the model there is the one the memory was trained on",
        "deleted": rf"^{re.escape(str(config_path))}: .*base_fingerprint",
        "deleted from a config of no format_version": rf"^{re.escape(str(config_path))}: no format_version: the "
                                                      r"memory config is from before titans_hf's first release",
    }[removed]
    with pytest.raises(ValueError, match=message):
        TitansQwenForCausalLM.from_pretrained(memory)
    if removed == "null":
        model = TitansQwenForCausalLM.from_base_and_memory(local_base, memory)
        assert model.config.memory_config.base_fingerprint is None
    elif removed != "deleted":
        with pytest.raises(ValueError, match=message):
            TitansQwenForCausalLM.from_base_and_memory(local_base, memory)
    assert checksums(memory, local_base) == before


def test_the_base_fingerprint_frames_each_file_by_name_and_size(tmp_path):
    """Bytes moved from one file to the next, or a file renamed, change the fingerprint."""
    folders = {}
    for label, files in {"original": {"vocab.json": b"ab", "merges.txt": b"c"},
                         "moved": {"vocab.json": b"a", "merges.txt": b"bc"},
                         "renamed": {"vocab.json": b"ab", "added_tokens.json": b"c"}}.items():
        folder = tmp_path / label
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        for name, content in files.items():
            (folder / name).write_bytes(content)
        folders[label] = base_fingerprint(folder)
    assert len(set(folders.values())) == 3
    assert all(len(value) == 64 for value in folders.values())


def fingerprint_of_development_versions(folder: Path) -> str:
    """The sampled fingerprint development versions of titans_hf (up to 0.3) recorded: config.json, and per
    safetensors file its name, size, header and 16 blocks of 64 KiB spread over it."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        data = path.read_bytes()
        digest.update(f"{path.name}:{len(data)}".encode())
        digest.update(data[:8 + int.from_bytes(data[:8], "little")])
        for index in range(16):
            start = len(data) * index // 16
            digest.update(data[start:start + (1 << 16)])
    return digest.hexdigest()


def test_a_fingerprint_of_another_form_is_refused_even_where_the_base_matches_it(local_base, tmp_path):
    """One fingerprint, the full one: a memory config recording the sampled form of development versions, which the
    unchanged base still matches, is refused as a base that is not the recorded one is, naming both."""
    memory = memory_on(local_base, tmp_path / "memory")
    config_path = memory / "memory_config.json"
    config = json.loads(config_path.read_text())
    assert config["base_fingerprint"] == base_fingerprint(local_base)
    sampled = fingerprint_of_development_versions(local_base)
    assert sampled != base_fingerprint(local_base)
    config_path.write_text(json.dumps({**config, "base_fingerprint": sampled}))
    before = checksums(memory, local_base)
    with pytest.raises(ValueError, match=rf"{memory}: its memory config names the local base {local_base}, but the "
                                         r"model there now is not the one the memory was trained on \(base_fingerprint "
                                         r"differs"):
        TitansQwenForCausalLM.from_pretrained(memory)
    assert checksums(memory, local_base) == before


# ---- token stores ----

@pytest.fixture
def prepared_store(tmp_path, tiny_tokenizer_dir) -> Path:
    source = tmp_path / "docs.txt"
    source.write_text("John went to the garden. Mary went to the office.\n" * 8)
    [store] = prepare(source, tmp_path / "corpus_bin", tiny_tokenizer_dir)
    return store


@pytest.mark.parametrize("dropped", [("tokenizer_fingerprint",), ("vocab_size", "tokenizer_fingerprint")])
def test_a_store_that_records_no_tokenizer_fingerprint_is_refused(prepared_store, tiny_tokenizer_dir, dropped):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    meta_path = prepared_store / "meta.json"
    check_stores_tokenizer([meta_path], tokenizer, "the model's tokenizer")  # as prepare wrote it: both recorded
    meta = json.loads(meta_path.read_text())
    assert meta["vocab_size"] == len(tokenizer) and len(meta["tokenizer_fingerprint"]) == 64
    meta_path.write_text(json.dumps({key: value for key, value in meta.items() if key not in dropped}))
    before = checksums(prepared_store)
    with pytest.raises(ValueError, match=rf"^{prepared_store}: records no tokenizer_fingerprint, so nothing shows "
                                         r"that its ids were made by the model's tokenizer \(.*\); prepare the store "
                                         r"again with this tokenizer"):
        check_stores_tokenizer([meta_path], tokenizer, "the model's tokenizer")
    assert checksums(prepared_store) == before
