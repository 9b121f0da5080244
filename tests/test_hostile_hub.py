"""Hostile memory folders and Hub repositories: nothing in them runs code, picks load options or paths, or gets a
full base (or anything else that is not the memory its config describes) uploaded; a safetensors header that does
not fit its file, or a memory folder missing its config, is refused in one line naming the file."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_hub import (  # noqa: F401
    MEMORY_CONFIG,
    REPO_ID,
    _snapshot,
    hub,
    hub_token,
    memory_folder,
    memory_model,
)

from titans_hf.hub import push_memory_folder
from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.modeling.memory_folder import base_fingerprint, load_memory_weights
from titans_hf.tasks.babilong.evaluation import load_model_for_eval

REMOTE_CODE = '''
from pathlib import Path
Path({marker!r}).write_text("remote code ran")
from transformers import Qwen3Config, Qwen3ForCausalLM
class EvilConfig(Qwen3Config):
    pass
class EvilForCausalLM(Qwen3ForCausalLM):
    pass
'''


def push(folder, hub, token, **kwargs):  # noqa: F811
    return push_memory_folder(folder, REPO_ID, token=token, endpoint=hub.endpoint,
                              check_weights=TitansQwenForCausalLM.check_memory_weights, **kwargs)


def test_a_linked_weights_file_is_not_uploaded(hub, hub_token, memory_folder, tmp_path):  # noqa: F811
    outside = tmp_path / "elsewhere.safetensors"
    (memory_folder / "memory_model.safetensors").rename(outside)
    (memory_folder / "memory_model.safetensors").symlink_to(outside)
    with pytest.raises(ValueError, match=r"memory_model\.safetensors: is a link"):
        push(memory_folder, hub, hub_token)
    assert hub.requests == []


@pytest.mark.parametrize("change, message", [
    ("link", r"config\.json: is a link"),
    ("model_type", r"config\.json: a memory folder's config\.json is a JSON object with model_type 'titans_qwen'"),
    ("auto_map", r"config\.json: names code to run \(auto_map\)"),
])
def test_a_config_json_that_is_not_the_memorys_is_not_uploaded(hub, hub_token, memory_folder, tmp_path, change,  # noqa: F811
                                                               message):
    """The Auto classes' config.json goes up beside the memory only as the model wrote it: no link, no other model
    type, no code named in it."""
    path = memory_folder / "config.json"
    values = json.loads(path.read_text())
    if change == "link":
        (tmp_path / "elsewhere.json").write_text(path.read_text())
        path.unlink()
        path.symlink_to(tmp_path / "elsewhere.json")
    elif change == "model_type":
        path.write_text(json.dumps({**values, "model_type": "qwen3"}))
    else:
        path.write_text(json.dumps({**values, "auto_map": {"AutoModelForCausalLM": "evil--modeling.Evil"}}))
    with pytest.raises(ValueError, match=message):
        push(memory_folder, hub, hub_token)
    assert hub.requests == []


def test_weights_that_are_not_the_configs_memory_are_not_uploaded(hub, hub_token, memory_folder):  # noqa: F811
    weights = memory_folder / "memory_model.safetensors"
    full = memory_model(MEMORY_CONFIG).state_dict()  # the whole model, base included
    save_file({name: tensor.contiguous() for name, tensor in full.items()}, str(weights))
    with pytest.raises(ValueError, match=rf"{weights}: not the weights of this memory config .*unexpected "
                                         r"\['lm_head.weight', 'model.embed_tokens.weight'"):
        push(memory_folder, hub, hub_token)
    memory = memory_model(MEMORY_CONFIG).memory_state_dict()
    memory["memory.1.output_weight"] = torch.zeros(32, 8)  # the config says 2 heads of 8 = 16 wide
    save_file({name: tensor.contiguous() for name, tensor in memory.items()}, str(weights))
    with pytest.raises(ValueError, match=r"memory\.1\.output_weight is torch\.float32 \(32, 8\), the memory config "
                                         r"makes it torch\.float32 \(32, 16\)"):
        push(memory_folder, hub, hub_token)
    memory = {name: tensor.to(torch.float64) for name, tensor in memory_model(MEMORY_CONFIG).memory_state_dict().items()}
    save_file(memory, str(weights))
    with pytest.raises(ValueError, match="is torch.float64"):
        push(memory_folder, hub, hub_token)
    assert hub.requests == []


@pytest.mark.parametrize("extra", [{"load_kwargs": {"trust_remote_code": True}}, {"trust_remote_code": True},
                                   {"dtype": "float16"}, {"attn_implementation": "flash_attention_2"}])
def test_a_memory_config_cannot_pass_load_options(tiny_qwen3_dir, tmp_path, extra):
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=8, memory_head_dim=16)
    model.save_pretrained(tmp_path / "memory")
    config_path = tmp_path / "memory" / "memory_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **extra}))
    before = _snapshot(tmp_path / "memory")
    with pytest.raises(ValueError, match=rf"{config_path}: unknown memory setting\(s\) \['{next(iter(extra))}'\]"):
        TitansQwenForCausalLM.from_pretrained(tmp_path / "memory")
    assert _snapshot(tmp_path / "memory") == before


def _base_with_remote_code(tiny_qwen3_dir: Path, folder: Path, marker: Path, model_type: str) -> Path:
    """The tiny base, its config and tokenizer config naming code (auto_map) that would write `marker` if run."""
    folder.mkdir()
    for file in tiny_qwen3_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    (folder / "modeling_evil.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    (folder / "configuration_evil.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                                   "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer["auto_map"] = {"AutoTokenizer": ["modeling_evil.EvilForCausalLM", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return folder


def test_eval_of_a_memory_never_runs_code_from_its_base(tiny_qwen3_dir, tmp_path):
    marker = tmp_path / "remote_code_ran"
    base = _base_with_remote_code(tiny_qwen3_dir, tmp_path / "base", marker, model_type="qwen3")
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_head_dim=16)
    model.config.memory_config.base_model_name_or_path = str(base)
    model.config.memory_config.base_fingerprint = base_fingerprint(base)  # that base, as if trained on it
    model.save_pretrained(tmp_path / "memory")
    command = [sys.executable, "-m", "titans_hf.commands", "eval", "--model", str(tmp_path / "memory"), "--generate",
               "--lengths", "0", "--num-samples", "2", "--no-ablation", "--output", str(tmp_path / "eval")]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert not marker.exists()
    # a base that only remote code could build is refused, not run
    evil = _base_with_remote_code(tiny_qwen3_dir, tmp_path / "evil", marker, model_type="evil_model")
    with pytest.raises(ValueError, match="evil"):
        TitansQwenForCausalLM.from_base_and_memory(evil, tmp_path / "memory")
    assert not marker.exists()


def test_a_memory_from_the_hub_never_picks_a_local_base(hub, hub_token, tiny_qwen3_dir):  # noqa: F811
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_head_dim=16)
    model.push_to_hub(REPO_ID, token=hub_token, base_model="someone/tiny-qwen3")
    config = json.loads(hub.files[REPO_ID]["memory_config.json"])
    hub.files[REPO_ID]["memory_config.json"] = json.dumps({**config, "base_model_name_or_path": str(tiny_qwen3_dir)}
                                                          ).encode()
    with pytest.raises(ValueError, match=f"names the base '{tiny_qwen3_dir}', which is not a Hub id"):
        TitansQwenForCausalLM.from_pretrained(REPO_ID)
    # named explicitly, the same local base is the user's choice
    loaded = TitansQwenForCausalLM.from_base_and_memory(tiny_qwen3_dir, REPO_ID)
    assert all(torch.equal(loaded.memory_state_dict()[n], t) for n, t in model.memory_state_dict().items())


def _read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _write_safetensors(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _share_bytes(path: Path) -> tuple[str, str]:
    """Rewrite a safetensors file so that two tensors of one size lie on the same bytes (the second one's own bytes
    dropped, the ranges still tiling the data); returns their names."""
    header, data = _read_safetensors(path)
    names = sorted((name for name in header if name != "__metadata__"), key=lambda n: header[n]["data_offsets"])
    size = {name: header[name]["data_offsets"][1] - header[name]["data_offsets"][0] for name in names}
    first, second = next((a, b) for i, a in enumerate(names) for b in names[i + 1:] if size[a] == size[b] > 0)
    kept, position = bytearray(), 0
    for name in names:
        if name == second:
            continue
        begin, end = header[name]["data_offsets"]
        kept += data[begin:end]
        header[name] = {**header[name], "data_offsets": [position, position + size[name]]}
        position += size[name]
    header[second] = {**header[second], "data_offsets": header[first]["data_offsets"]}
    _write_safetensors(path, header, bytes(kept))
    return first, second


def test_memory_weights_whose_tensors_share_bytes_are_refused_naming_the_file(
        hub, hub_token, tiny_qwen3_dir, tmp_path):  # noqa: F811
    """Two tensors on one byte range would alias each other's values; every reader of a memory's weights (load,
    push, resume) refuses them, whatever the installed safetensors checks."""
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_head_dim=16)
    folder = model.save_memory(tmp_path / "memory")
    weights = folder / "memory_model.safetensors"
    first, second = _share_bytes(weights)
    before = _snapshot(folder)
    message = (rf"^{weights}: not a readable safetensors header \(tensors '{first}' and '{second}' share bytes "
               r"\[\d+, \d+\) of the data\)$")
    with pytest.raises(ValueError, match=message):
        TitansQwenForCausalLM.from_pretrained(folder)
    with pytest.raises(ValueError, match=message):
        load_memory_weights(weights)
    with pytest.raises(ValueError, match=message):
        push(folder, hub, hub_token)
    assert hub.requests == []
    assert _snapshot(folder) == before


@pytest.mark.parametrize("damage, message", [
    ("truncated", r"not a readable safetensors header \(tensor '.*' lies outside the file"),
    ("not json", r"not a readable safetensors header \(Expecting property name"),
    ("shared bytes", r"not a readable safetensors header \(tensors '.*' and '.*' share bytes"),
    ("huge header", r"not a readable safetensors file \(its header claims 18446744073709551615 bytes"),
])
def test_a_base_whose_safetensors_header_is_bad_is_refused_naming_the_file(tiny_qwen3_dir, tmp_path, damage, message):
    memory = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_head_dim=16).save_memory(
        tmp_path / "memory")
    base = tmp_path / "base"
    shutil.copytree(tiny_qwen3_dir, base)
    weights = base / "model.safetensors"
    raw = weights.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    if damage == "truncated":
        weights.write_bytes(raw[:len(raw) // 2])
    elif damage == "not json":
        weights.write_bytes(raw[:8] + b"{" * length + raw[8 + length:])
    elif damage == "shared bytes":
        _share_bytes(weights)
    else:
        weights.write_bytes(b"\xff" * 8 + raw[8:])
    before = _snapshot(base)
    with pytest.raises(ValueError, match=rf"^{weights}: {message}"):
        TitansQwenForCausalLM.from_base(base, chunk_size=16, memory_head_dim=16)
    with pytest.raises(ValueError, match=rf"^{weights}: {message}"):
        TitansQwenForCausalLM.from_base_and_memory(base, memory)
    assert _snapshot(base) == before


def test_a_memory_folder_without_its_memory_config_is_refused_naming_it(tiny_qwen3_dir, tmp_path):
    """Its config.json alone sends the Auto classes and the model class to the full-model loader, which would look
    for model.safetensors; the missing file is named instead."""
    from transformers import AutoModelForCausalLM

    folder = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_head_dim=16).save_memory(
        tmp_path / "memory")
    (folder / "memory_config.json").unlink()
    before = _snapshot(folder)
    message = rf"^{folder}/memory_config\.json: not found, though {folder} holds a memory's weights"
    for load in (TitansQwenForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained, load_model_for_eval):
        with pytest.raises(FileNotFoundError, match=message):
            load(str(folder))
    assert _snapshot(folder) == before
