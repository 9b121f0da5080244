"""A Llama GGUF file converted into a Qwen2 folder (`titans_hf.gguf_base`), and the rows of the real-base job.

No download: a tiny Llama is built with transformers and written as a GGUF file with the `gguf` package, laid out
as llama.cpp's converter lays it out (its tensor names, q/k rows permuted for its rotary layout, the metadata keys
transformers' GGUF loader reads, F32 tensors so that the file holds the weights exactly).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM

from titans_hf import TitansQwenForCausalLM
from titans_hf.commands.real_base_job import CHOICES, CHOSEN_FORMAT, chat_wrapping, formatted_row, prepare
from titans_hf.commands.train import parse_arguments
from titans_hf.files import file_sha256
from titans_hf.gguf_base import CONVERSION_RECORD_NAME, PROBE_TEXT, llama_gguf_to_qwen2, main
from titans_hf.modeling.configuration_titans_qwen import TitansMemoryConfig
from titans_hf.tasks.babilong import PROMPT_TEMPLATE, supporting_fact_spans

GGUF_NAME = "tiny-llama.gguf"
HEADS, KV_HEADS, HIDDEN = 4, 2, 32
# rows of ids the logits are compared on (inside the tiny vocabulary)
INPUT_IDS = torch.tensor([[5, 17, 260, 3, 99, 411, 42, 7, 300, 12, 64, 150],
                          [200, 201, 8, 9, 500, 33, 1, 2, 77, 78, 79, 80]])


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    """A 2-layer Llama without bias, RoPE theta 1e5, tied embeddings; RMSNorm weights drawn away from 1, so that a
    norm copied to the wrong place shows in the logits."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e5},
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
    return model


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (its converter's `permute`): each head's rotary halves interleaved."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_llama_gguf(path: Path, model: LlamaForCausalLM, tokenizer_dir: Path, architecture: str = "llama",
                     name: str = "tiny llama", rope_dimension_count: int | None = None,
                     bias_tensor: str | None = None, rope_scaling: str | None = None, left_out: str | None = None,
                     chat_template: str | None = None) -> Path:
    """`model` and the tokenizer in `tokenizer_dir` as a GGUF file; the keyword arguments write what the converter
    must refuse (another architecture, a bias tensor or any extra tensor, heads of another size, RoPE scaling, a
    tensor left out, a chat template that does not render)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_rope_dimension_count(rope_dimension_count or config.hidden_size // config.num_attention_heads)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
    backend = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = backend["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {token["content"] for token in backend["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL
                            for token in tokens])
    writer.add_token_merges([merge if isinstance(merge, str) else " ".join(merge)
                             for merge in backend["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for layer in range(config.num_hidden_layers):
        names.update({f"model.layers.{layer}.{hf}.weight": f"blk.{layer}.{llama_cpp}.weight"
                      for hf, llama_cpp in per_layer.items()})
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":  # tied: llama.cpp writes no output.weight
            continue
        array = tensor.detach().numpy().astype(np.float32)
        if ".attn_q." in names[hf_name]:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif ".attn_k." in names[hf_name]:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        if names[hf_name] != left_out:
            writer.add_tensor(names[hf_name], array)
    if bias_tensor is not None:
        writer.add_tensor(bias_tensor, np.zeros(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def logits(model, input_ids: torch.Tensor = INPUT_IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory, tiny_tokenizer_dir):
    """A folder holding the tiny Llama as GGUF_NAME, and the Llama itself."""
    folder = tmp_path_factory.mktemp("gguf")
    vocab_size = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    model = tiny_llama(vocab_size)
    write_llama_gguf(folder / GGUF_NAME, model, Path(tiny_tokenizer_dir))
    return folder, model


@pytest.fixture(scope="module")
def converted(gguf_folder, tmp_path_factory):
    """The Qwen2 folder of the tiny GGUF, written by the command line; the GGUF's sha256 before."""
    folder, _ = gguf_folder
    before = file_sha256(folder / GGUF_NAME)
    out_dir = tmp_path_factory.mktemp("converted") / "qwen2"
    assert main([str(folder), GGUF_NAME, str(out_dir)]) == 0
    return out_dir, before


def test_the_written_gguf_loads_in_transformers_as_the_llama_it_holds(gguf_folder, one_thread):
    folder, model = gguf_folder
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME).eval()
    assert isinstance(loaded, LlamaForCausalLM) and loaded.config.tie_word_embeddings
    assert torch.equal(logits(loaded), logits(model))  # F32 tensors, q/k permuted back: the very same weights


def test_the_qwen2_folder_gives_the_gguf_llamas_logits_exactly(gguf_folder, converted, one_thread):
    # exactly, not within rounding: both run the same float32 CPU kernels on the same weights, and the zero q/k/v
    # biases a Qwen2 adds are added as exact zeros
    folder, _ = gguf_folder
    out_dir, sha_before = converted
    llama = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME).eval()
    qwen = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    assert isinstance(qwen, Qwen2ForCausalLM)
    config = qwen.config
    assert not config.use_sliding_window and config.tie_word_embeddings and config.num_key_value_heads == KV_HEADS
    assert config.rope_parameters["rope_theta"] == 1e5 and config.rms_norm_eps == pytest.approx(1e-5)
    biases = [p for n, p in qwen.named_parameters() if n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
    assert len(biases) == 3 * config.num_hidden_layers and all(not bias.any() for bias in biases)
    assert torch.equal(logits(qwen), logits(llama))
    record = json.loads((out_dir / CONVERSION_RECORD_NAME).read_text(encoding="utf-8"))
    assert record["sha256"] == sha_before and record["gguf_file"] == GGUF_NAME
    assert record["check"]["max_abs_logit_difference"] == 0.0
    gguf_tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    assert AutoTokenizer.from_pretrained(out_dir)(PROBE_TEXT)["input_ids"] == gguf_tokenizer(PROBE_TEXT)["input_ids"]
    assert file_sha256(folder / GGUF_NAME) == sha_before  # the input is never modified


def test_a_titans_qwen_on_the_folder_starts_with_the_bases_logits(converted, one_thread):
    # MAG's output projection starts at zero: an untrained memory adds exactly nothing, and one chunk covering the
    # whole row attends as the plain model does
    out_dir, _ = converted
    qwen = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    titans = TitansQwenForCausalLM.from_base(out_dir, TitansMemoryConfig(
        chunk_size=INPUT_IDS.shape[1], memory_num_heads=2, memory_head_dim=8)).eval()
    assert torch.equal(logits(titans), logits(qwen))


def test_a_conversion_replaces_only_with_overwrite(gguf_folder, converted, one_thread):
    folder, _ = gguf_folder
    out_dir, _ = converted
    weights = file_sha256(out_dir / "model.safetensors")
    with pytest.raises(FileExistsError, match="exists; pass --overwrite"):
        llama_gguf_to_qwen2(folder, GGUF_NAME, out_dir)
    assert llama_gguf_to_qwen2(folder, GGUF_NAME, out_dir, overwrite=True) == out_dir
    assert file_sha256(out_dir / "model.safetensors") == weights
    user_folder = out_dir.parent / "mine"
    user_folder.mkdir()
    (user_folder / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="will not replace it"):
        llama_gguf_to_qwen2(folder, GGUF_NAME, user_folder, overwrite=True)
    assert (user_folder / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("variant, error", [
    (dict(architecture="qwen2"), r"general\.architecture is 'qwen2', not 'llama'"),
    (dict(bias_tensor="blk.0.attn_q.bias"), r"tensor blk\.0\.attn_q\.bias is an attention or MLP bias"),
    (dict(bias_tensor="blk.1.ffn_down.bias"), r"tensor blk\.1\.ffn_down\.bias is an attention or MLP bias"),
    (dict(rope_dimension_count=4), r"llama\.rope\.dimension_count is 4, not llama\.embedding_length 32 // "
                                   r"llama\.attention\.head_count 4"),
    (dict(rope_scaling="linear"), r"llama\.rope\.scaling\.type is 'linear'"),
    (dict(left_out="blk.1.ffn_up.weight"), r"lacks 1 tensor\(s\) a Llama of 2 layers needs: \['blk\.1\.ffn_up\.weight'\]"),
    (dict(bias_tensor="blk.0.attn_rot.weight"), r"holds 1 tensor\(s\) no Llama parameter takes: "
                                                r"\['blk\.0\.attn_rot\.weight'\]"),
    (dict(chat_template="{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"),
     r"its chat template \(tokenizer\.chat_template\): it does not render a one-message chat within 1 s"),
    (dict(name="mistral"), r"transformers' GGUF loader does not read it as a Llama \(general\.name 'mistral'\)"),
])
def test_a_gguf_that_is_not_a_llama_without_bias_is_refused_naming_file_and_field(
        tmp_path, gguf_folder, tiny_tokenizer_dir, variant, error, one_thread):
    _, model = gguf_folder
    path = write_llama_gguf(tmp_path / "other.gguf", model, Path(tiny_tokenizer_dir), **variant)
    before = file_sha256(path)
    with pytest.raises(ValueError, match=rf"GGUF file {tmp_path / 'other.gguf'}: {error}"):
        llama_gguf_to_qwen2(tmp_path, "other.gguf", tmp_path / "qwen2")
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["other.gguf"]  # no folder, no temporary
    assert file_sha256(path) == before


def test_a_file_argument_that_is_no_gguf_file_is_refused_before_loading(tmp_path):
    (tmp_path / "notes.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=rf"GGUF file {tmp_path / 'notes.gguf'}: not a readable GGUF file"):
        llama_gguf_to_qwen2(tmp_path, "notes.gguf", tmp_path / "qwen2")
    with pytest.raises(ValueError, match=r"gguf_file '\.\./notes\.gguf': give a file name inside"):
        llama_gguf_to_qwen2(tmp_path / "sub", "../notes.gguf", tmp_path / "qwen2")
    with pytest.raises(FileNotFoundError, match=rf"GGUF file {tmp_path / 'absent.gguf'}: no such file"):
        llama_gguf_to_qwen2(tmp_path, "absent.gguf", tmp_path / "qwen2")
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["notes.gguf"]


def test_a_conversion_whose_logits_differ_is_refused_and_leaves_nothing(tmp_path, gguf_folder, monkeypatch,
                                                                        one_thread):
    import titans_hf.gguf_base as gguf_base

    folder, _ = gguf_folder
    convert = gguf_base.qwen2_of_llama

    def off_by_a_little(llama):
        qwen = convert(llama)
        with torch.no_grad():
            qwen.model.layers[1].self_attn.k_proj.bias.fill_(1e-2)
        return qwen

    monkeypatch.setattr(gguf_base, "qwen2_of_llama", off_by_a_little)
    with pytest.raises(ValueError, match=r"the Qwen2 folder's logits differ from the Llama's by up to"):
        llama_gguf_to_qwen2(folder, GGUF_NAME, tmp_path / "qwen2")
    assert list(tmp_path.iterdir()) == []


def test_a_conversion_whose_saved_tokenizer_differs_is_refused_and_leaves_nothing(tmp_path, gguf_folder, monkeypatch,
                                                                                 one_thread):
    import titans_hf.gguf_base as gguf_base

    folder, _ = gguf_folder

    class SavedWithAnExtraToken:
        """AutoTokenizer, except that the saved folder's tokenizer comes back with one token more."""

        @staticmethod
        def from_pretrained(path, **kwargs):
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
            if "gguf_file" not in kwargs:
                tokenizer.add_tokens(["kitchenette"])
            return tokenizer

    monkeypatch.setattr(gguf_base, "AutoTokenizer", SavedWithAnExtraToken)
    with pytest.raises(ValueError, match=r"the saved tokenizer has another vocabulary"):
        llama_gguf_to_qwen2(folder, GGUF_NAME, tmp_path / "qwen2")
    assert list(tmp_path.iterdir()) == []


def test_the_real_base_rows_ask_for_one_of_the_six_places_in_the_chat_turn(converted):
    out_dir, _ = converted
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    row = {"input": "Mary went to the garden. John moved to the office.", "question": "Where is Mary? ",
           "target": "garden"}
    wrapping = chat_wrapping(tokenizer)
    assert wrapping == ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    formatted = formatted_row(row, CHOSEN_FORMAT, wrapping)
    assert PROMPT_TEMPLATE.format(**formatted) == (
        "<|im_start|>user\nMary went to the garden. John moved to the office.\n\nQuestion: Where is Mary? Choose "
        "one: bathroom, bedroom, garden, hallway, kitchen, office.<|im_end|>\n<|im_start|>assistant\n\nAnswer:")
    assert formatted["target"] == "garden" and CHOICES in formatted["question"]
    # the scorers still find the supporting fact: its span moves by the chat prefix
    prefix = len(wrapping[0])
    assert supporting_fact_spans(formatted, "qa1") == [(prefix, prefix + len("Mary went to the garden."))]
    tokenizer.chat_template = None
    assert formatted_row(row, CHOSEN_FORMAT, chat_wrapping(tokenizer))["input"] == row["input"]


def test_prepare_writes_the_rows_and_flags_that_titans_hf_train_reads(tmp_path, converted):
    out_dir, _ = converted
    flags = prepare(str(out_dir), tmp_path, chunk_size=32, train_chunks=(0, 4), eval_chunks=(4, 8), train_rows=4,
                    eval_rows=3, max_steps=2)
    model_args, memory_args, data_args, training_args = parse_arguments([str(tmp_path / "train_args.json")])
    assert model_args.model_name_or_path == str(out_dir) and memory_args.memory_layers == [1]  # 0.8 of 2 layers
    assert data_args.data_files == [str(tmp_path / "data" / "train" / "qa1" / f"{n}.json") for n in (0, 128)]
    assert training_args.curriculum_chunks == flags["curriculum_chunks"] and training_args.max_steps == 2
    # one optimizer step a batch of 8 rows (the recipe's accumulation of 8 is for rows of 32k tokens), the base in
    # bfloat16 and the memory's write gate open, without a write cost
    assert (training_args.per_device_train_batch_size, training_args.gradient_accumulation_steps) == (8, 1)
    assert model_args.dtype == "bfloat16"
    assert (memory_args.theta_bias_init, memory_args.write_cost, memory_args.conv_kernel) == (-2.0, 0.0, 8)
    assert training_args.frozen_trunk_cache_gb == 4.0  # the layers below the memory computed once per row
    for split, lengths, rows in (("train", (0, 128), 4), ("eval", (128, 256), 3)):
        for length in lengths:
            written = json.loads((tmp_path / "data" / split / "qa1" / f"{length}.json").read_text(encoding="utf-8"))
            assert len(written) == rows
            assert all(row["question"].startswith("Where is ") and row["question"].endswith(CHOICES)
                       for row in written)  # this tokenizer has no chat template: no chat turn around it
    before = file_sha256(tmp_path / "train_args.json")
    with pytest.raises(FileExistsError, match="exists; pass --overwrite"):
        prepare(str(out_dir), tmp_path, chunk_size=32, train_chunks=(0, 4), eval_chunks=(4, 8), train_rows=4,
                eval_rows=3)
    assert file_sha256(tmp_path / "train_args.json") == before


def test_a_llama_whose_loaded_weights_are_not_the_files_is_refused(tmp_path, gguf_folder, monkeypatch, one_thread):
    # the reference of the logits check is a model known to hold the file's tensors: a parameter the loader filled
    # in (or changed) is refused, although the Qwen2 folder would give that model's logits exactly
    import titans_hf.gguf_base as gguf_base

    folder, _ = gguf_folder

    class LoadedWithAFilledInNorm:
        @staticmethod
        def from_pretrained(path, **kwargs):
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            if "gguf_file" in kwargs:
                with torch.no_grad():
                    model.model.layers[1].post_attention_layernorm.weight.fill_(1.0)
            return model

    monkeypatch.setattr(gguf_base, "AutoModelForCausalLM", LoadedWithAFilledInNorm)
    with pytest.raises(ValueError, match=r"gave model\.layers\.1\.post_attention_layernorm\.weight other values "
                                         r"than tensor blk\.1\.ffn_norm\.weight holds"):
        llama_gguf_to_qwen2(folder, GGUF_NAME, tmp_path / "qwen2")
    assert list(tmp_path.iterdir()) == []


def test_a_chat_template_is_carried_into_the_folder(tmp_path, gguf_folder, tiny_tokenizer_dir, one_thread):
    _, model = gguf_folder
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    write_llama_gguf(tmp_path / "chat.gguf", model, Path(tiny_tokenizer_dir), chat_template=template)
    llama_gguf_to_qwen2(tmp_path, "chat.gguf", tmp_path / "qwen2")
    assert AutoTokenizer.from_pretrained(tmp_path / "qwen2").chat_template == template


def test_a_reused_base_is_checked_by_its_weights_hash(gguf_folder, converted, tmp_path, capsys, one_thread):
    folder, _ = gguf_folder
    out_dir = tmp_path / "base"
    assert main([str(folder), GGUF_NAME, str(out_dir)]) == 0
    weights = out_dir / "model.safetensors"
    record = json.loads((out_dir / CONVERSION_RECORD_NAME).read_text(encoding="utf-8"))
    assert record["weights_sha256"] == {"model.safetensors": file_sha256(weights)}
    capsys.readouterr()
    assert main([str(folder), GGUF_NAME, str(out_dir), "--reuse", "--overwrite"]) == 0
    assert capsys.readouterr().out.startswith(f"reusing {out_dir}")
    # weights changed under a record that still names the file: converted again, not reused
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert main([str(folder), GGUF_NAME, str(out_dir), "--reuse", "--overwrite"]) == 2
    assert "will not replace it, even with --overwrite: files changed" in capsys.readouterr().err
    weights.unlink()
    (out_dir / CONVERSION_RECORD_NAME).unlink()
    for path in sorted(out_dir.rglob("*"), reverse=True):
        path.unlink()
    out_dir.rmdir()
    assert main([str(folder), GGUF_NAME, str(out_dir), "--reuse"]) == 0
    assert file_sha256(out_dir / "model.safetensors") == record["weights_sha256"]["model.safetensors"]


def test_the_command_line_refuses_in_one_line_without_a_traceback(tmp_path, capsys):
    (tmp_path / "notes.gguf").write_bytes(b"not a gguf file at all")
    assert main([str(tmp_path), "notes.gguf", str(tmp_path / "qwen2")]) == 2
    error = capsys.readouterr().err
    assert error == (f"python -m titans_hf.gguf_base: error: GGUF file {tmp_path / 'notes.gguf'}: not a readable "
                     f"GGUF file" + error.split("not a readable GGUF file", 1)[1])
    assert "Traceback" not in error and error.count("\n") == 1
    assert main([str(tmp_path), "absent.gguf", str(tmp_path / "qwen2")]) == 2
    assert "absent.gguf: no such file" in capsys.readouterr().err
