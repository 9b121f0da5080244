"""A Llama GGUF file as a plain Qwen2 folder, so that a pretrained model shipped only as GGUF can be a frozen base.

A Llama whose attention and MLP have no bias is a Qwen2 whose q/k/v biases are zero: same decoder layer, same
RMSNorm, same rotary embedding, same SwiGLU MLP. `llama_gguf_to_qwen2` therefore

1. checks the file's header with the `gguf` package before anything slow: a plain file named inside its folder,
   `general.architecture` "llama", no bias tensor, a head size equal to the hidden size over the heads, no RoPE
   scaling (transformers' GGUF loader would drop it), every tensor a Llama of its block count needs and no other
   (`llama_tensor_names`: transformers fills a missing one at random and drops an extra one, each with a log line
   only), each refusal a ValueError naming the file and the field or tensors;
2. loads model and tokenizer with transformers' own GGUF loader (`from_pretrained(folder, gguf_file=...)`), which
   dequantizes the weights to float32, and checks that every parameter of that Llama equals the tensor of the file
   it came from, dequantized by the `gguf` package itself (`check_weights_are_the_files`): the logits of step 4 are
   then compared with a model known to hold the file's weights, not with whatever the loader filled in. A chat
   template the file carries must render a one-message chat within `data.tokenizers.CHAT_TEMPLATE_SECONDS` (in a
   child process, killed when it does not: transformers' template sandbox bounds what a template may touch, not
   its time), so that a template that never ends is refused here rather than hanging every later command that
   renders it;
3. builds the `Qwen2Config` of the same shape (`use_sliding_window=False`), copies every weight and sets the q/k/v
   biases to zero;
4. saves model and tokenizer with `save_pretrained` into a temporary folder beside `out_dir`, loads that folder back
   and refuses it unless its logits on `CHECK_TOKENS` tokens equal the Llama's to float32 rounding (measured on a
   CPU: exactly equal, a zero bias adds exactly 0) and its tokenizer has the GGUF's vocabulary and encodes
   `PROBE_TEXT` alike. Not every text: `AutoTokenizer` loads any Qwen2 folder as `Qwen2Tokenizer`, whose
   pre-tokenizer keeps a run of newlines (and punctuation before one) together where a GPT-2 style vocabulary's
   own splits it ("kitchen.\n\nQuestion": ".", "\n\n" rather than ".", "\n", "\n"), so the probe has no newline;
   docs/real_base.md measures what that changes;
5. renames the folder into place (all of it or nothing) with `CONVERSION_RECORD_NAME` beside the weights: the
   file's name and sha256, the sha256 of every weights file written (what `reused_conversion_problem` checks before
   a folder is reused), and the largest logit difference measured.

``python -m titans_hf.gguf_base FOLDER FILE.gguf OUT_DIR [--reuse] [--overwrite]`` runs it from a shell (needs
``titans_hf[gguf]``); a refusal is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from titans_hf.data.tokenizers import chat_template_problem
from titans_hf.files import atomic_write_json, file_sha256, hidden_sibling, remove_path
from titans_hf.outputs import check_folder_output, record_folder, replace_outputs

GGUF_ARCHITECTURE = "llama"
CONVERSION_RECORD_NAME = "gguf_conversion.json"
# Tokens of the logits check: a seeded draw over the vocabulary, and a text the tokenizers must encode alike.
CHECK_TOKENS = 32
PROBE_TEXT = "Mary went back to the kitchen. Question: Where is Mary? Answer: kitchen"
# float32 rounding, relative to the largest logit: two kernels summing the same products in another order
LOGITS_RTOL = 1e-5
# llama.cpp's tensor names: the model's own, and each block's, with the transformers parameter each one becomes
LLAMA_MODEL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                       "output.weight": "lm_head.weight"}
LLAMA_BLOCK_TENSORS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                       "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                       "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                       "ffn_down": "mlp.down_proj"}


def _field(reader: Any, key: str) -> Any:
    """The value of GGUF metadata field `key` (a string, a number, or None when absent)."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def check_llama_gguf(path: str | os.PathLike) -> dict[str, Any]:
    """Refuse, from its header alone, a GGUF file that is not a Llama without bias: ValueError naming the file and
    the field (or tensor). Returns the header fields the conversion reports (`general.name`, the shape)."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as error:
        raise ValueError(f"GGUF file {path}: not a readable GGUF file ({type(error).__name__}: {error})") from None
    architecture = _field(reader, "general.architecture")
    if architecture != GGUF_ARCHITECTURE:
        raise ValueError(f"GGUF file {path}: general.architecture is {architecture!r}, not {GGUF_ARCHITECTURE!r}; "
                         "only a Llama converts to a Qwen2")
    biases = [tensor.name for tensor in reader.tensors if tensor.name.endswith(".bias")]
    if biases:
        raise ValueError(f"GGUF file {path}: tensor {biases[0]} is an attention or MLP bias ({len(biases)} bias "
                         "tensors in all); a Qwen2 has q/k/v biases only and transformers' Llama none, so this model "
                         "does not convert exactly")
    hidden, heads = _field(reader, "llama.embedding_length"), _field(reader, "llama.attention.head_count")
    head_dim = _field(reader, "llama.rope.dimension_count")
    if not hidden or not heads or head_dim != hidden // heads:
        raise ValueError(f"GGUF file {path}: llama.rope.dimension_count is {head_dim}, not llama.embedding_length "
                         f"{hidden} // llama.attention.head_count {heads}; a Qwen2's heads are hidden_size // "
                         "num_attention_heads wide")
    scaling = _field(reader, "llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF file {path}: llama.rope.scaling.type is {scaling!r}; transformers' GGUF loader drops "
                         "RoPE scaling, so neither model would be the one this file describes")
    _check_tensor_names(path, reader)
    return {"general.name": _field(reader, "general.name"), "hidden_size": hidden, "num_hidden_layers":
            _field(reader, "llama.block_count"), "vocab_size": _field(reader, "llama.vocab_size")}


def llama_tensor_names(num_layers: int) -> dict[str, str]:
    """{llama.cpp tensor name: transformers parameter name} of a Llama of `num_layers` blocks; "output.weight" is
    absent from a file whose embeddings are tied."""
    names = dict(LLAMA_MODEL_TENSORS)
    for layer in range(num_layers):
        names.update({f"blk.{layer}.{gguf_name}.weight": f"model.layers.{layer}.{name}.weight"
                      for gguf_name, name in LLAMA_BLOCK_TENSORS.items()})
    return names


def _check_tensor_names(path: Path, reader: Any) -> None:
    """Refuse, naming them, tensors a Llama of the file's `llama.block_count` needs and the file lacks, and tensors
    it holds that no parameter takes."""
    layers = _field(reader, "llama.block_count")
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"GGUF file {path}: llama.block_count is {layers!r}, not a positive number of layers")
    expected = llama_tensor_names(layers)
    present = [tensor.name for tensor in reader.tensors]
    missing = sorted(set(expected) - set(present) - {"output.weight"})
    if missing:
        raise ValueError(f"GGUF file {path}: lacks {len(missing)} tensor(s) a Llama of {layers} layers needs: "
                         f"{missing[:8]}; transformers would fill them at random")
    extra = sorted(set(present) - set(expected))
    if extra:
        raise ValueError(f"GGUF file {path}: holds {len(extra)} tensor(s) no Llama parameter takes: {extra[:8]}; "
                         "transformers would drop them without a word, so the model would not be this file's")


def _unpermuted(array: Any, heads: int) -> Any:
    """The transformers row order of a llama.cpp q/k weight (the inverse of its converter's `permute`)."""
    return (array.reshape(heads, array.shape[0] // heads // 2, 2, *array.shape[1:])
            .swapaxes(1, 2).reshape(array.shape))


def check_weights_are_the_files(path: Path, llama: Any) -> None:
    """Refuse (ValueError naming the tensor) a loaded Llama any parameter of which is not exactly the tensor of the
    GGUF file `path` it comes from, dequantized by the `gguf` package (q/k rows back in transformers' order), and
    one with a parameter no tensor of the file gives (tied output weights excepted: they are the embeddings)."""
    import gguf

    reader = gguf.GGUFReader(path)
    parameters = dict(llama.named_parameters(remove_duplicate=False))
    names = llama_tensor_names(llama.config.num_hidden_layers)
    heads = {"attn_q": llama.config.num_attention_heads, "attn_k": llama.config.num_key_value_heads}
    tied = "output.weight" not in {tensor.name for tensor in reader.tensors}
    given: set[str] = set()
    for tensor in reader.tensors:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype("float32")
        kind = tensor.name.split(".")[-2]
        if kind in heads:
            array = _unpermuted(array, heads[kind])
        targets = [names[tensor.name]]
        if tensor.name == "token_embd.weight" and tied:
            targets.append("lm_head.weight")
        for target in targets:
            parameter = parameters.get(target)
            expected = torch.from_numpy(array)
            if parameter is None or parameter.shape != expected.shape or not torch.equal(parameter.float(), expected):
                raise ValueError(f"GGUF file {path}: transformers' GGUF loader gave {target} other values than "
                                 f"tensor {tensor.name} holds, so the model would not be this file's")
            given.add(target)
    ungiven = sorted(set(parameters) - given)
    if ungiven:
        raise ValueError(f"GGUF file {path}: no tensor of the file gives {ungiven[:8]}; transformers filled them in")


def qwen2_config_of(llama_config: Any) -> Qwen2Config:
    """The Qwen2 configuration of a transformers `LlamaConfig`'s shape: sizes, RoPE, RMSNorm epsilon, tied
    embeddings and special token ids; full attention in every layer."""
    return Qwen2Config(
        vocab_size=llama_config.vocab_size,
        hidden_size=llama_config.hidden_size,
        intermediate_size=llama_config.intermediate_size,
        num_hidden_layers=llama_config.num_hidden_layers,
        num_attention_heads=llama_config.num_attention_heads,
        num_key_value_heads=llama_config.num_key_value_heads,
        hidden_act=llama_config.hidden_act,
        max_position_embeddings=llama_config.max_position_embeddings,
        rms_norm_eps=llama_config.rms_norm_eps,
        rope_parameters=dict(llama_config.rope_parameters),
        tie_word_embeddings=llama_config.tie_word_embeddings,
        use_sliding_window=False,
        attention_dropout=0.0,
        bos_token_id=llama_config.bos_token_id,
        eos_token_id=llama_config.eos_token_id,
        pad_token_id=llama_config.pad_token_id,
    )


def qwen2_of_llama(llama: Any) -> Qwen2ForCausalLM:
    """A `Qwen2ForCausalLM` holding `llama`'s weights (same parameter names), its q/k/v biases zero."""
    qwen = Qwen2ForCausalLM(qwen2_config_of(llama.config)).to(llama.dtype)
    state = dict(llama.state_dict())
    for name, parameter in qwen.named_parameters():
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            state[name] = torch.zeros_like(parameter)
    qwen.load_state_dict(state, strict=True)
    return qwen.eval()


def _logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def llama_gguf_to_qwen2(gguf_dir: str | os.PathLike, gguf_file: str, out_dir: str | os.PathLike,
                        overwrite: bool = False) -> Path:
    """Convert the Llama GGUF `gguf_dir`/`gguf_file` into a plain Qwen2 folder `out_dir` (model, tokenizer,
    `CONVERSION_RECORD_NAME`) that `AutoModelForCausalLM.from_pretrained` and `TitansQwenForCausalLM.from_base` load.

    `gguf_file` is a file name inside `gguf_dir`, as `from_pretrained(gguf_dir, gguf_file=...)` takes it. An existing
    `out_dir` is replaced only with `overwrite`, and only when this tool wrote it whole. Refuses (ValueError naming
    file and field) a file that is not a Llama without bias, and a conversion whose saved folder does not give the
    Llama's logits and tokens. Returns `out_dir`.
    """
    folder, out_dir = Path(gguf_dir), Path(out_dir)
    if Path(gguf_file).name != gguf_file or gguf_file in ("", ".", ".."):
        raise ValueError(f"gguf_file {gguf_file!r}: give a file name inside {folder}, not a path")
    path = folder / gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path}: no such file")
    check_folder_output(out_dir, overwrite)
    header = check_llama_gguf(path)
    digest = file_sha256(path)

    # transformers takes a "llama" file named "mistral" for a Mistral, which gguf 0.19 cannot map
    try:
        llama = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, trust_remote_code=False).eval()
        reason = None if llama.config.model_type == GGUF_ARCHITECTURE else f"a {llama.config.model_type!r} model"
    except (NotImplementedError, ValueError) as error:
        reason = f"{type(error).__name__}: {error}"
    if reason is not None:
        raise ValueError(f"GGUF file {path}: transformers' GGUF loader does not read it as a Llama (general.name "
                         f"{header['general.name']!r}): {reason}")
    check_weights_are_the_files(path, llama)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, trust_remote_code=False)
    problem = chat_template_problem(tokenizer)
    if problem is not None:
        raise ValueError(f"GGUF file {path}: its chat template (tokenizer.chat_template): {problem}; every command "
                         "that renders it would hang or fail")
    input_ids = torch.randint(llama.config.vocab_size, (1, CHECK_TOKENS), generator=torch.Generator().manual_seed(0))
    expected = _logits(llama, input_ids)
    probe_ids = tokenizer(PROBE_TEXT)["input_ids"]

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temporary = hidden_sibling(out_dir, "converting")
    temporary.mkdir()
    try:
        qwen2_of_llama(llama).save_pretrained(temporary)
        tokenizer.save_pretrained(temporary)
        del llama
        saved = AutoModelForCausalLM.from_pretrained(temporary, trust_remote_code=False).eval()
        difference = (_logits(saved, input_ids) - expected).abs().max().item()
        bound = LOGITS_RTOL * max(1.0, expected.abs().max().item())
        if not difference <= bound:  # NaN fails too
            raise ValueError(f"GGUF file {path}: the Qwen2 folder's logits differ from the Llama's by up to "
                             f"{difference:g} (more than float32 rounding, {bound:g}) on {CHECK_TOKENS} tokens")
        saved_tokenizer = AutoTokenizer.from_pretrained(temporary, trust_remote_code=False)
        saved_ids = saved_tokenizer(PROBE_TEXT)["input_ids"]
        if saved_tokenizer.get_vocab() != tokenizer.get_vocab() or saved_ids != probe_ids:
            raise ValueError(f"GGUF file {path}: the saved tokenizer has another vocabulary or encodes "
                             f"{PROBE_TEXT!r} as {saved_ids}, the GGUF's as {probe_ids}")
        atomic_write_json(temporary / CONVERSION_RECORD_NAME, {
            "gguf_file": gguf_file, "sha256": digest, **header, "model_type": "qwen2",
            "weights_sha256": {weights.name: file_sha256(weights) for weights in sorted(temporary.glob("*.safetensors"))},
            "check": {"tokens": CHECK_TOKENS, "max_abs_logit_difference": difference, "bound": bound},
        })
        record_folder(temporary, "titans_hf.gguf_base")
        replace_outputs([temporary], [out_dir])
    except BaseException:
        remove_path(temporary)
        raise
    return out_dir


def reused_conversion_problem(out_dir: str | os.PathLike, gguf_sha256: str) -> str | None:
    """None when `out_dir` is a conversion of the GGUF file whose sha256 is `gguf_sha256` that may be used as it is:
    its `CONVERSION_RECORD_NAME` names that file and every weights file it lists has its recorded sha256 (and no
    other weights file lies there). Else why not."""
    out_dir = Path(out_dir)
    try:
        record = json.loads((out_dir / CONVERSION_RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        return f"{out_dir / CONVERSION_RECORD_NAME} cannot be read as JSON ({type(error).__name__})"
    if not isinstance(record, dict) or record.get("sha256") != gguf_sha256:
        return f"{out_dir / CONVERSION_RECORD_NAME} records another GGUF file"
    recorded = record.get("weights_sha256")
    present = sorted(path.name for path in out_dir.glob("*.safetensors"))
    if not isinstance(recorded, dict) or not recorded or sorted(recorded) != present:
        return f"the weights files in {out_dir} are not the ones {CONVERSION_RECORD_NAME} records"
    changed = [name for name in present if file_sha256(out_dir / name) != recorded[name]]
    return f"{changed} in {out_dir} changed since the conversion" if changed else None


def main(argv: list[str] | None = None) -> int:
    """The command line; a refusal (a bad file, an output it may not replace) is one line on stderr, exit 2."""
    prog = "python -m titans_hf.gguf_base"
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Convert a Llama GGUF file into a Qwen2 folder (exact, checked).")
    parser.add_argument("gguf_dir", help="folder holding the GGUF file")
    parser.add_argument("gguf_file", help="the GGUF file's name inside it")
    parser.add_argument("out_dir", help="the Qwen2 folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace a folder this tool wrote there earlier")
    parser.add_argument("--reuse", action="store_true",
                        help="keep OUT_DIR as it is when it is a conversion of this very file whose weights are "
                        "unchanged (their sha256 recorded at conversion); else convert")
    args = parser.parse_args(argv)
    try:
        path = Path(args.gguf_dir) / args.gguf_file
        why_not = reused_conversion_problem(args.out_dir, file_sha256(path)) if args.reuse and path.is_file() else ""
        if why_not is None:
            print(f"reusing {args.out_dir}: a conversion of {path} whose weights are unchanged")
            return 0
        if why_not and Path(args.out_dir).exists():
            print(f"not reusing {args.out_dir}: {why_not}")
        print(llama_gguf_to_qwen2(args.gguf_dir, args.gguf_file, args.out_dir, args.overwrite))
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
            PermissionError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
