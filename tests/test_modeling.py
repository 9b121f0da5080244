"""TitansQwenForCausalLM on tiny random Qwen2/Qwen3 saved to disk and loaded by path.

Known answers come from the base model itself (an untrained MAG must equal it bit for bit), from a reference loop
written here with the public modules, and from the model fed the same tokens in other pieces.
"""

import contextlib
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import titans_hf  # noqa: F401  (registers the Auto classes)
import titans_hf.modeling.streaming
from titans_hf.modeling import TitansCache, TitansQwenConfig, TitansQwenForCausalLM, TitansQwenModel
from titans_hf.modeling.memory_folder import is_memory_name

SMALL_MEMORY = dict(chunk_size=8, memory_chunk_size=4, memory_num_heads=2, memory_head_dim=16)
VARIANT_SETTINGS = {
    "mag": dict(variant="mag"),
    "mal": dict(variant="mal"),
    "mac": dict(variant="mac", num_memory_tokens=2, num_persistent_tokens=3),
}


@pytest.fixture(params=["qwen2", "qwen3"])
def base_dir(request, tiny_qwen2_dir, tiny_qwen3_dir):
    return {"qwen2": tiny_qwen2_dir, "qwen3": tiny_qwen3_dir}[request.param]


def build(base_dir, seed: int = 0, **settings) -> TitansQwenForCausalLM:
    """A model whose memory actually contributes: W_O (zero at init) set to random values."""
    torch.manual_seed(seed)  # the memory's own init draws from the global generator
    model = TitansQwenForCausalLM.from_base(base_dir, **{**SMALL_MEMORY, **settings})
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.memory.values():
            block.output_weight.copy_(0.5 * torch.randn(block.output_weight.shape, generator=generator))
    return model.eval()


def random_ids(vocab: int, shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    return torch.randint(1, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_untrained_mag_reproduces_base_logits_exactly(base_dir):
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    model = TitansQwenForCausalLM.from_base(base_dir, **SMALL_MEMORY, memory_layers=[0, 1],
                                            attend_previous_chunk=False).eval()  # the base chunk by chunk
    ids = random_ids(base.config.vocab_size, (2, 20))
    with torch.no_grad():
        ours = model(ids).logits
        # one chunk: the plain base call; longer: the base on each chunk alone (positions restart per chunk)
        assert torch.equal(ours[:, :8], base(ids[:, :8]).logits)
        expected = torch.cat([base(ids[:, s : s + 8]).logits for s in range(0, 20, 8)], dim=1)
    assert torch.equal(ours, expected)
    # the wrapped backbone keeps the base's keys and values
    base_state = base.state_dict()
    model_state = {k: v for k, v in model.state_dict().items() if k in base_state}
    assert model_state.keys() == base_state.keys()
    assert all(torch.equal(model_state[k], base_state[k]) for k in base_state)


def reference_mag_logits(model: TitansQwenForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Chunk by chunk with the public modules: fresh attention per chunk, one memory state carried along."""
    backbone, chunk = model.model, model.config.memory_config.chunk_size
    states = {int(layer): None for layer in model.memory}
    logits = []
    for start in range(0, ids.shape[1], chunk):
        hidden = backbone.embed_tokens(ids[:, start : start + chunk])
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        rotary = backbone.rotary_emb(hidden, positions)
        for index, layer in enumerate(backbone.layers):
            output = layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=positions)
            if index in states:
                block = model.memory[str(index)]
                read, states[index] = block.neural_memory(hidden, states[index])
                gate = torch.sigmoid(F.rms_norm(output, (output.shape[-1],)) @ block.gate_weight.T + block.gate_bias)
                output = output + gate * (read @ block.output_weight.T)
            hidden = output
        logits.append(model.lm_head(backbone.norm(hidden)))
    return torch.cat(logits, dim=1)


def test_chunked_forward_equals_reference_loop(base_dir):
    model = build(base_dir, memory_layers=[0, 1], attend_previous_chunk=False)  # the reference loop is chunk-local
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    ids = random_ids(model.config.text_config.vocab_size, (2, 27))
    with torch.no_grad():
        ours = model(ids).logits
        expected = reference_mag_logits(model, ids)
        # the ablation: same weights, memory read zeroed, so exactly the base run chunk by chunk
        with model.memory_disabled():
            ablated = model(ids).logits
            with model.chunk_by_chunk():
                ablated_loop = model(ids).logits
        base_chunkwise = torch.cat([base(ids[:, s : s + 8]).logits for s in range(0, 27, 8)], dim=1)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    # the chunk loop makes the base's own calls: bitwise; layer by layer the chunks are the rows of one batch, which
    # some CPUs' matmuls round differently from a batch of one chunk (seen: 4e-7 on an AMD EPYC)
    assert torch.equal(ablated_loop, base_chunkwise)
    torch.testing.assert_close(ablated, base_chunkwise, atol=2e-6, rtol=0)
    assert (ours - ablated).abs().max() > 1e-2


@pytest.mark.parametrize("variant", ["mag", "mal", "mac"])
def test_pieces_through_the_cache_equal_one_pass(tiny_qwen3_dir, variant):
    """Any split of the input (inside chunks, across boundaries) gives the one-pass logits; the chunk-local cache
    holds the current chunk's keys only (the window's two chunks: test_previous_chunk_* below)."""
    model = build(tiny_qwen3_dir, **VARIANT_SETTINGS[variant], attend_previous_chunk=False)
    ids = random_ids(model.config.text_config.vocab_size, (2, 30), seed=1)
    with torch.no_grad():
        whole = model(ids).logits
        cache, pieces = TitansCache(model.config), []
        for start, end in [(0, 3), (3, 8), (8, 19), (19, 20), (20, 30)]:
            pieces.append(model(ids[:, start:end], cache=cache).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 30
    # only the current chunk's keys are held: 30 = 3 chunks of 8 + 6, plus the mac prefix
    prefix = 5 if variant == "mac" else 0
    assert cache.layers[0].keys.shape[-2] == 6 + prefix


@pytest.mark.parametrize("variant", ["mag", "mal", "mac"])
def test_generate_equals_recomputing_forward_each_step(tiny_qwen2_dir, variant):
    model = build(tiny_qwen2_dir, **VARIANT_SETTINGS[variant])
    vocab = model.config.text_config.vocab_size
    ids = random_ids(vocab, (2, 13), seed=2)
    mask = torch.ones_like(ids)
    mask[1, :8] = 0  # left padding on the second row: one whole chunk (padding_multiple = 8)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0)
    assert isinstance(out.cache, TitansCache) and out.cache.get_seq_length() == 13 + 5
    for step in range(6):
        seq = out.sequences[:, : 13 + step]
        full_mask = torch.cat([mask, torch.ones(2, step, dtype=mask.dtype)], dim=1)
        with torch.no_grad():
            logits = model(seq, attention_mask=full_mask).logits[:, -1]
        torch.testing.assert_close(out.scores[step], logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(out.sequences[:, 13 + step], logits.argmax(-1))


def left_padded(rows: list[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as `tokenizer(..., padding=True)` with padding_side="left" builds it (pad id 0)."""
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        batch[index, width - len(row):], mask[index, width - len(row):] = row, 1
    return batch, mask


@pytest.mark.parametrize("attend_previous_chunk", [True, False])
@pytest.mark.parametrize("variant", ["mag", "mal", "mac"])
def test_any_left_padding_answers_as_the_row_alone(tiny_qwen3_dir, variant, attend_previous_chunk):
    """Rows of 5, 13, 18, 26 and 31 tokens (chunks of 8, memory updates of 4) left-padded to 33 tokens, so every row
    starts at another place of the chunk cycle (padding 28, 20, 15, 7, 2): forward, the streaming cache fed in
    pieces and generate answer every row as the row alone (logits to 1e-5, greedy tokens equal), its labels'
    losses too."""
    model = build(tiny_qwen3_dir, **VARIANT_SETTINGS[variant], attend_previous_chunk=attend_previous_chunk)
    vocab = model.config.text_config.vocab_size
    rows = [random_ids(vocab, (1, length), seed=length)[0] for length in (5, 13, 18, 26, 31)]
    batch, mask = left_padded(rows, 33)
    labels = torch.where(mask.bool(), batch, -100)
    with torch.no_grad():
        out = model(batch, attention_mask=mask, labels=labels, logits_to_keep=33, return_token_losses=True)
        cache, pieces = TitansCache(model.config), []
        # the first piece holds every row's first token (where its chunks start), the later ones any split
        for start, end in [(0, 29), (29, 30), (30, 33)]:
            pieces.append(model(batch[:, start:end], attention_mask=mask[:, :end], cache=cache).logits)
        streamed = torch.cat(pieces, dim=1)
    batched = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    total, count = 0.0, 0
    for index, row in enumerate(rows):
        real = slice(33 - len(row), 33)
        with torch.no_grad():
            alone = model(row[None], labels=row[None], logits_to_keep=len(row), return_token_losses=True)
        torch.testing.assert_close(out.logits[index, real], alone.logits[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(streamed[index, real], alone.logits[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.token_losses[index, real], alone.token_losses[0], atol=1e-5, rtol=1e-5)
        total, count = total + alone.token_losses.sum(), count + len(row) - 1
        single = model.generate(row[None], max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
                                return_dict_in_generate=True)
        assert torch.equal(batched.sequences[index, 33:], single.sequences[0, len(row):])
        for step in range(6):
            torch.testing.assert_close(batched.scores[step][index], single.scores[step][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, total / count, atol=1e-5, rtol=1e-5)  # the first tokens predict nothing
    assert [(group.phase, group.rows.tolist()) for group in batched.cache.phase_groups] == [
        (2, [4]), (4, [0, 1]), (7, [2, 3])]  # padding 28, 20, 15, 7, 2 by phase (8 tokens a cycle)


def test_left_padded_beams_and_samples_stay_with_their_rows(tiny_qwen3_dir):
    """Beam search and several returned sequences reorder and repeat the rows of a left-padded batch's cache: each
    row's beams equal those of the row alone."""
    model = build(tiny_qwen3_dir)
    vocab = model.config.text_config.vocab_size
    rows = [random_ids(vocab, (1, length), seed=length)[0] for length in (6, 11)]
    batch, mask = left_padded(rows, 11)
    settings = dict(max_new_tokens=4, num_beams=3, num_return_sequences=2, do_sample=False, pad_token_id=0)
    batched = model.generate(batch, attention_mask=mask, **settings)
    for index, row in enumerate(rows):
        alone = model.generate(row[None], **settings)
        assert torch.equal(batched[2 * index: 2 * index + 2, 11:], alone[:, len(row):])


def test_an_empty_row_in_the_first_piece_of_a_cache_is_refused(tiny_qwen3_dir):
    model = build(tiny_qwen3_dir)
    batch, mask = left_padded([torch.tensor([5, 6, 7])], 3)
    mask[0] = 0
    with pytest.raises(ValueError, match="row 0 has no real token in the first piece given to an empty cache"):
        model(batch, attention_mask=mask, cache=TitansCache(model.config))


def test_prefill_holds_one_chunk_whatever_the_prompt_length(tiny_qwen3_dir):
    model = build(tiny_qwen3_dir)
    vocab = model.config.text_config.vocab_size
    sizes = []
    for length in (24, 72):
        cache = TitansCache(model.config)
        with torch.no_grad():
            logits = model(random_ids(vocab, (1, length)), cache=cache, logits_to_keep=1).logits
        assert logits.shape == (1, 1, vocab)
        held = [layer.keys.numel() + layer.values.numel() for layer in cache.layers]
        held += [t.numel() for s in cache.memory_states.values() for t in s.state_dict().values()]
        sizes.append(sum(held))
    assert sizes[0] == sizes[1]


def test_loss_is_chunkwise_cross_entropy_with_the_shift_across_chunks(tiny_qwen3_dir):
    model = build(tiny_qwen3_dir)
    vocab = model.config.text_config.vocab_size
    ids = random_ids(vocab, (2, 20), seed=3)
    labels = ids.clone()
    labels[:, :7] = -100  # position 7 (last of chunk 0) predicts label 8 (first of chunk 1): kept
    labels[1, 15:] = -100
    with torch.no_grad():
        logits = model(ids).logits
        out = model(ids, labels=labels)
        summed = model(ids, labels=labels, num_items_in_batch=7).loss
    targets = labels[:, 1:]
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    count = (targets != -100).sum()
    assert count == 13 + 8
    torch.testing.assert_close(out.loss, per_token / count, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(summed, per_token / 7, atol=1e-5, rtol=1e-5)
    assert out.logits is None  # with labels, no [T, vocab] tensor unless asked for
    kept = model(ids, labels=labels, logits_to_keep=3).logits
    torch.testing.assert_close(kept, logits[:, -3:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer_major", [True, False])
def test_rows_ending_early_stream_to_their_end_only(tiny_qwen3_dir, monkeypatch, layer_major):
    """Rows of 5, 13, 24 and 40 tokens right-padded to 40 (chunks of 8): each runs only as far as its own last chunk
    (8, 16, 24, 40 tokens), and the loss, token losses, write rate, memory gradients and the
    memory states the batch ends in (the convolution tail holding the padding's zeros) equal those of the whole
    padded batch run at once."""
    model = build(tiny_qwen3_dir, memory_layers=[0, 1]).train()
    vocab = model.config.text_config.vocab_size
    lengths = (5, 13, 24, 40)
    batch, mask = torch.zeros(4, 40, dtype=torch.long), torch.zeros(4, 40, dtype=torch.long)
    for index, length in enumerate(lengths):
        batch[index, :length], mask[index, :length] = random_ids(vocab, (1, length), seed=length)[0], 1
    labels = torch.where(mask.bool(), batch, -100)
    generator = torch.Generator().manual_seed(3)
    starts = {layer: dataclasses.replace(state, weights=[w + 0.1 * torch.randn(w.shape, generator=generator)
                                                         for w in state.weights])
              for layer, state in model.model.init_memory_states(4).items()}
    for state in starts.values():
        state.batch_start_weights = state.weights

    def run():
        model.zero_grad()
        with contextlib.nullcontext() if layer_major else model.chunk_by_chunk():
            out = model(batch, attention_mask=mask, labels=labels, memory_states=starts, return_token_losses=True)
        out.loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return out, grads

    widths = []
    stream = model.model._stream_aligned_rows
    monkeypatch.setattr(model.model, "_stream_aligned_rows", lambda inputs, *args: widths.append(inputs.shape[1]) or
                        stream(inputs, *args))
    # a whole chunk of padding after the longest row too: the longest rows still run to the end, so the logits kept
    # there are the whole batch's (the rows that stopped earlier have zeros at padding positions)
    wider = lambda: model(F.pad(batch, (0, 8)), attention_mask=F.pad(mask, (0, 8)), logits_to_keep=1).logits  # noqa: E731
    trimmed, trimmed_grads = run()
    with torch.no_grad():
        trimmed_last = wider()
    assert widths == [8, 16, 24, 40, 8, 16, 24, 48]
    monkeypatch.setattr(model.model, "_row_ends", lambda token_mask, length, states: None)
    whole, whole_grads = run()
    with torch.no_grad():
        torch.testing.assert_close(trimmed_last[3], wider()[3], atol=1e-5, rtol=1e-5)
    assert trimmed_last.shape == (4, 1, vocab) and not trimmed_last[:3].any()
    assert widths[8:] == [40, 48]
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(trimmed.loss, whole.loss, **close)
    real = mask.bool()
    torch.testing.assert_close(trimmed.token_losses[real], whole.token_losses[real], **close)
    assert not trimmed.token_losses[~real].any()
    torch.testing.assert_close(trimmed.write_rate, whole.write_rate, **close)
    assert trimmed_grads.keys() == whole_grads.keys() and trimmed_grads
    for name, grad in trimmed_grads.items():
        torch.testing.assert_close(grad, whole_grads[name], **close)
    for layer, state in whole.memory_states.items():
        other = trimmed.memory_states[layer]
        assert other.position == state.position == 40
        assert (other.batch_start_weights is other.weights) == (state.batch_start_weights is state.weights)
        for a, b in zip(state.weights + state.momentum + state.batch_start_weights,
                        other.weights + other.momentum + other.batch_start_weights):
            torch.testing.assert_close(b, a, **close)
        for name in ("conv_tail", "buffer_keys", "buffer_values", "buffer_lr", "buffer_gate_logits", "buffer_mask"):
            torch.testing.assert_close(getattr(other, name), getattr(state, name), **close)
        assert not other.conv_tail[:3].any() and other.conv_tail[3].any()  # only the 40-token row ends on tokens


def test_padding_never_writes_memory(tiny_qwen3_dir):
    model = build(tiny_qwen3_dir)
    vocab = model.config.text_config.vocab_size
    real = random_ids(vocab, (1, 12), seed=4)
    padded = torch.cat([real, torch.zeros(1, 8, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 12), torch.zeros(1, 8)], dim=1).long()
    with torch.no_grad():
        alone_cache, padded_cache = TitansCache(model.config), TitansCache(model.config)
        alone = model(real, cache=alone_cache).logits
        with_padding = model(padded, attention_mask=mask, cache=padded_cache).logits
    torch.testing.assert_close(with_padding[:, :12], alone, atol=1e-5, rtol=1e-5)
    for layer, state in alone_cache.memory_states.items():
        other = padded_cache.memory_states[layer]
        # 12 real tokens: 3 update chunks of 4 wrote in both; the 2 chunks of padding after them changed nothing
        assert other.position == 20 and state.position == 12
        for a, b in zip(state.weights + state.momentum, other.weights + other.momentum):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_last_chunk_loss_trains_memory_through_the_first_chunk(tiny_qwen2_dir):
    """BABILong's path: the fact is in chunk 0, the loss in chunk 2. Attention never crosses chunks, so any gradient
    reaching chunk 0's tokens went through the memory; the frozen backbone gets none."""
    vocab = AutoConfig.from_pretrained(tiny_qwen2_dir).vocab_size
    ids = random_ids(vocab, (2, 24), seed=5)
    labels = torch.full_like(ids, -100)
    labels[:, 18:] = ids[:, 18:]

    def first_chunk_gradient(**settings):
        # no chunk checkpointing here: the hook below acts on the first forward only (equivalence is tested apart);
        # no write cost, whose gradient reaches every chunk's tokens directly
        model = build(tiny_qwen2_dir, memory_layers=[1], checkpoint_chunks=False, write_cost=0, **settings).train()
        captured = []

        def keep_first_chunk_embeddings(module, args, output):
            if not captured:  # the first call embeds chunk 0 (later calls: other chunks, or recomputation)
                output.requires_grad_(True)
                output.retain_grad()
                captured.append(output)
            return output

        model.model.embed_tokens.register_forward_hook(keep_first_chunk_embeddings)
        model(ids, labels=labels).loss.backward()
        return model, captured[0].grad

    model, grad = first_chunk_gradient()
    assert grad is not None and grad.abs().sum() > 0
    assert all(p.grad is None for n, p in model.named_parameters() if not is_memory_name(n))  # the base's
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(model.memory_parameter_names().values())
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in trainable)
    # truncated backprop every chunk cuts exactly that path
    _, cut = first_chunk_gradient(bptt_chunks=1)
    assert cut is None or cut.abs().sum() == 0


def test_chunk_checkpointing_gives_the_same_gradients(tiny_qwen3_dir):
    vocab = AutoConfig.from_pretrained(tiny_qwen3_dir).vocab_size
    ids = random_ids(vocab, (2, 20), seed=6)
    grads = []
    for checkpoint_chunks in (True, False):
        model = build(tiny_qwen3_dir, checkpoint_chunks=checkpoint_chunks).train()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], atol=1e-6, rtol=1e-5)
    # the ablation's backward may run after its context exits: the recomputation must still skip the memory
    grads = []
    for checkpoint_chunks in (True, False):
        model = build(tiny_qwen3_dir, checkpoint_chunks=checkpoint_chunks, freeze_base=False).train()
        with model.memory_disabled():
            loss = model(ids, labels=ids).loss
        loss.backward()
        grads.append(model.model.layers[0].mlp.down_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_save_memory_then_load_gives_identical_logits(tmp_path, tiny_qwen3_dir, tiny_qwen2_dir):
    model = build(tiny_qwen3_dir, **VARIANT_SETTINGS["mac"])
    ids = random_ids(model.config.text_config.vocab_size, (2, 20), seed=7)
    model.save_memory(tmp_path / "memory")
    assert sorted(p.name for p in (tmp_path / "memory").iterdir()) == ["config.json", "memory_config.json",
                                                                   "memory_model.safetensors"]
    saved = json.loads((tmp_path / "memory" / "memory_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(tiny_qwen3_dir)
    assert saved["variant"] == "mac" and saved["base_shape"]["model_type"] == "qwen3"
    assert saved == model.config.memory_config.to_dict()
    loaded = TitansQwenForCausalLM.from_base_and_memory(tiny_qwen3_dir, tmp_path / "memory").eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="model_type"):
        TitansQwenForCausalLM.from_base_and_memory(tiny_qwen2_dir, tmp_path / "memory")
    with pytest.raises(FileNotFoundError, match="nowhere: neither a local folder nor a Hub repository id"):
        TitansQwenForCausalLM.from_base_and_memory(tiny_qwen3_dir, tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty/memory_config.json: not found"):
        TitansQwenForCausalLM.from_base_and_memory(tiny_qwen3_dir, tmp_path / "empty")
    with pytest.raises(ValueError, match="missing"):
        loaded.load_memory_state_dict({})


def test_full_save_pretrained_round_trips_through_auto_classes(tmp_path, tiny_qwen3_dir):
    model = build(tiny_qwen3_dir)
    model.save_pretrained(tmp_path / "memory")  # a frozen base: the memory alone, as PEFT saves an adapter
    assert sorted(p.name for p in (tmp_path / "memory").iterdir()) == ["config.json", "memory_config.json",
                                                                   "memory_model.safetensors"]
    model.save_pretrained(tmp_path / "full", save_full_model=True)
    assert AutoConfig.from_pretrained(tmp_path / "full").model_type == "titans_qwen"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full").eval()
    assert isinstance(loaded, TitansQwenForCausalLM)
    ids = random_ids(model.config.text_config.vocab_size, (1, 20), seed=8)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert not any(p.requires_grad for n, p in loaded.named_parameters() if not is_memory_name(n))
    # in bf16 the backbone follows the request while the (small, finely trained) memory stays fp32
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.bfloat16).eval()
    dtypes = {n: p.dtype for n, p in half.named_parameters()}
    assert {d for n, d in dtypes.items() if n.startswith("model.memory.")} == {torch.float32}
    assert {d for n, d in dtypes.items() if not is_memory_name(n)} == {torch.bfloat16}
    with torch.no_grad():
        assert half(ids).logits.dtype == torch.bfloat16


def test_bf16_forward(tiny_qwen3_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.bfloat16).eval()
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, dtype=torch.bfloat16, **SMALL_MEMORY,
                                            attend_previous_chunk=False).eval()  # the base chunk by chunk
    ids = random_ids(base.config.vocab_size, (2, 16), seed=9)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, torch.cat([base(ids[:, :8]).logits, base(ids[:, 8:]).logits], 1))
    trained = build(tiny_qwen3_dir, dtype=torch.bfloat16).train()
    out = trained(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert trained.memory["1"].output_weight.dtype == torch.float32  # memory weights stay fp32 under bf16
    assert torch.isfinite(trained.memory["1"].output_weight.grad).all()


def test_invalid_settings_fail_clearly(tiny_qwen3_dir):
    text = AutoConfig.from_pretrained(tiny_qwen3_dir)
    with pytest.raises(ValueError, match="variant"):
        TitansQwenConfig(text_config=text, memory_config={"variant": "memory-as-gate"})
    with pytest.raises(ValueError, match="memory_layers"):
        TitansQwenConfig(text_config=text, memory_config={"memory_layers": [2]})
    with pytest.raises(ValueError, match="num_memory_tokens"):
        TitansQwenConfig(text_config=text, memory_config={"variant": "mac"})
    with pytest.raises(ValueError, match="memory_model"):
        TitansQwenConfig(text_config=text, memory_config={"memory_model": "lstm"})
    with pytest.raises(ValueError, match="unknown memory settings"):
        TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk=8)


def test_conv_init_reaches_every_memory_and_survives_save_load(tiny_qwen3_dir, tmp_path):
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_layers=[0, 1], memory_num_heads=2,
                                            memory_head_dim=8, conv_kernel=4)
    assert model.config.memory_config.conv_init == "window"
    for block in model.memory.values():
        assert torch.equal(block.neural_memory.conv_weight[:32], torch.full((32, 4), 0.25))
    with torch.no_grad():
        for block in model.memory.values():
            block.neural_memory.conv_weight.add_(0.5)  # trained weights, not the init, must come back
    model.save_memory(tmp_path / "memory")
    loaded = TitansQwenForCausalLM.from_base_and_memory(tiny_qwen3_dir, tmp_path / "memory")
    assert loaded.config.memory_config.conv_init == "window"
    for name, block in model.memory.items():
        assert torch.equal(loaded.memory[name].neural_memory.conv_weight, block.neural_memory.conv_weight)
    identity = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_num_heads=2, memory_head_dim=8,
                                               conv_kernel=4, conv_init="identity")
    weight = next(iter(identity.memory.values())).neural_memory.conv_weight
    assert torch.equal(weight, torch.tensor([[0.0, 0.0, 0.0, 1.0]]).expand(48, 4))
    with pytest.raises(ValueError, match="conv_init"):
        TitansQwenConfig(text_config=model.config.text_config.to_dict(), memory_config={"conv_init": "mean"})


# ---- attention over the previous chunk too (attend_previous_chunk) ----


@pytest.mark.parametrize("variant", ["mag", "mac"])
def test_previous_chunk_window_equals_full_attention_over_two_chunks(tiny_qwen3_dir, variant):
    """Memory off, two chunks: the second chunk sees the first, exactly what full attention over both sees."""
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval()
    model = build(tiny_qwen3_dir, attend_previous_chunk=True, **VARIANT_SETTINGS[variant])
    ids = random_ids(model.config.text_config.vocab_size, (2, 16), seed=11)
    with torch.no_grad(), model.memory_disabled():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, atol=1e-5, rtol=1e-5)
        plain = build(tiny_qwen3_dir, **VARIANT_SETTINGS[variant])
        assert not torch.allclose(plain(ids).logits[:, 8:], base(ids).logits[:, 8:], atol=1e-3)  # the window matters


@pytest.mark.parametrize("variant", ["mag", "mal", "mac"])
def test_previous_chunk_window_through_the_cache_and_generate_equals_recomputing(tiny_qwen2_dir, variant):
    """Five chunks (keys move back a chunk four times): pieces through the cache equal one pass, generate equals the
    forward recomputed at every step, and the cache never holds more than two chunks' keys."""
    model = build(tiny_qwen2_dir, attend_previous_chunk=True, **VARIANT_SETTINGS[variant])
    ids = random_ids(model.config.text_config.vocab_size, (2, 37), seed=12)
    prefix = 5 if variant == "mac" else 0
    with torch.no_grad():
        whole = model(ids).logits
        cache, pieces = TitansCache(model.config), []
        for start, end in [(0, 3), (3, 11), (11, 20), (20, 21), (21, 37)]:
            pieces.append(model(ids[:, start:end], cache=cache).logits)
            assert cache.layers[0].keys.shape[-2] <= 2 * (8 + prefix)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-5)
    assert cache.layers[0].keys.shape[-2] == (8 + prefix) + (5 + prefix)  # chunk 4 whole, chunk 5 so far
    out = model.generate(ids[:, :13], attention_mask=torch.ones(2, 13, dtype=torch.long), max_new_tokens=12,
                         do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    for step in range(12):
        with torch.no_grad():
            logits = model(out.sequences[:, : 13 + step]).logits[:, -1]
        torch.testing.assert_close(out.scores[step], logits, atol=1e-5, rtol=1e-5)


def test_previous_chunk_window_trains_through_checkpointed_chunks(tiny_qwen3_dir):
    """Gradients with chunk checkpointing equal those without (the previous chunk's keys cross checkpoints)."""
    grads = []
    for checkpoint_chunks in (False, True):
        model = build(tiny_qwen3_dir, attend_previous_chunk=True, checkpoint_chunks=checkpoint_chunks).train()
        ids = random_ids(model.config.text_config.vocab_size, (2, 30), seed=13)
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5)


def test_previous_chunk_window_keys_move_as_rope_composes(tiny_qwen3_dir):
    """_move_keys(k at p, o) equals k rotated at p + o, and rotate_half is the base's own."""
    from transformers.models.qwen3 import modeling_qwen3

    model = build(tiny_qwen3_dir, attend_previous_chunk=True)
    keys = torch.randn(1, 2, 5, model.config.text_config.head_dim, generator=torch.Generator().manual_seed(14))
    assert torch.equal(modeling_qwen3.rotate_half(keys), titans_hf.modeling.streaming.rotate_half(keys))
    rotary = model.model.rotary_emb

    def rotated(positions):
        cos, sin = rotary(keys, torch.tensor([positions]))
        return keys * cos.unsqueeze(1) + modeling_qwen3.rotate_half(keys) * sin.unsqueeze(1)

    torch.testing.assert_close(model.model._move_keys(rotated(list(range(8, 13))), -8), rotated(list(range(5))),
                               atol=1e-5, rtol=1e-5)


def test_to_dtype_casts_every_parameter_and_the_memory_state_stays_float32(tiny_qwen3_dir):
    """model.to(torch.bfloat16), half(), float() and double() cast every parameter, the memory's too, as on any
    module (the memory stays float32 where the model is built or loaded in half precision: test_bf16_forward,
    test_full_save_pretrained_round_trips_through_auto_classes); the memory's state is float32 whatever its
    weights' dtype, and the cast model runs."""
    cast = build(tiny_qwen3_dir, **VARIANT_SETTINGS["mac"])
    assert cast.to(torch.bfloat16) is cast
    assert {p.dtype for p in cast.parameters()} == {torch.bfloat16}
    assert cast.model.persistent_tokens.dtype == cast.memory["1"].output_weight.dtype == torch.bfloat16
    states = cast.init_memory_states(2)
    assert {t.dtype for state in states.values() for t in state.state_dict().values()
            if t.is_floating_point()} == {torch.float32}
    ids = random_ids(cast.config.text_config.vocab_size, (2, 20), seed=4)
    with torch.no_grad():
        logits = cast(ids).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    cast.half()
    assert {p.dtype for p in cast.parameters()} == {torch.float16}
    cast.double()
    assert {p.dtype for p in cast.parameters()} == {torch.float64}
    cast.float()
    assert {p.dtype for p in cast.parameters()} == {torch.float32}


def test_hidden_states_are_the_chunked_runs_per_layer(tiny_qwen3_dir):
    """output_hidden_states: embeddings and every layer's output over the whole input, chunk after chunk (an
    untrained mag: exactly the base's on each chunk alone, the last one normed); with a memory and left padding,
    each row's equal its own alone."""
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval()
    plain = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, **SMALL_MEMORY, attend_previous_chunk=False).eval()
    ids = random_ids(base.config.vocab_size, (2, 20), seed=5)
    with torch.no_grad():
        ours = plain(ids, output_hidden_states=True).hidden_states
        pieces = [base(ids[:, s: s + 8], output_hidden_states=True).hidden_states for s in range(0, 20, 8)]
    assert len(ours) == base.config.num_hidden_layers + 1
    for index, hidden in enumerate(ours):
        assert torch.equal(hidden, torch.cat([piece[index] for piece in pieces], dim=1))
    assert plain(ids).hidden_states is None

    model = build(tiny_qwen3_dir)
    rows = [random_ids(model.config.text_config.vocab_size, (1, length), seed=length)[0] for length in (7, 19)]
    batch, mask = left_padded(rows, 19)
    with torch.no_grad():
        batched = model(batch, attention_mask=mask, output_hidden_states=True).hidden_states
        for index, row in enumerate(rows):
            alone = model(row[None], output_hidden_states=True).hidden_states
            for layer, hidden in enumerate(alone):
                torch.testing.assert_close(batched[layer][index, 19 - len(row):], hidden[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attend_previous_chunk", [True, False])  # the chunk loop; the layer-major stream
def test_the_decoders_last_hidden_state_is_the_last_of_the_hidden_states(tiny_qwen3_dir, attend_previous_chunk):
    """`model.model` (what `base_model` and `get_decoder()` are) returns output_hidden_states' last, normed entry as
    its last_hidden_state, bitwise, with rows at two places of the chunk cycle (phase groups) and an unfinished last
    chunk, and no other hidden states unless asked; the causal LM keeps none unless asked."""
    model = build(tiny_qwen3_dir, attend_previous_chunk=attend_previous_chunk)
    assert isinstance(model.model, TitansQwenModel)
    assert model.base_model is model.model and model.get_decoder() is model.model
    rows = [random_ids(model.config.text_config.vocab_size, (1, length), seed=length)[0] for length in (7, 21)]
    batch, mask = left_padded(rows, 21)
    with torch.no_grad():
        every = model(batch, attention_mask=mask, output_hidden_states=True).hidden_states
        decoded = model.model(input_ids=batch, attention_mask=mask)
        hidden = model.model(input_ids=batch, attention_mask=mask, output_hidden_states=True)
        plain = model(batch)
    assert decoded.hidden_states is None and plain.hidden_states is None
    assert torch.equal(decoded.last_hidden_state, every[-1])
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(hidden.hidden_states, every, strict=True))
    assert torch.equal(hidden.last_hidden_state, every[-1])


def test_get_decoder_returns_the_recorded_hidden_states(tmp_path):
    """`get_decoder()` returns the last hidden states, normed, of the chunk loop with the memory: what it
    returned before the decoder held the memory (titans_hf 0.3.0, where it was a view running the causal LM's own
    loop), to float32 rounding (a fresh environment's kernels may sum in another order), recorded in
    tests/data/decoder_hidden_states.safetensors for a tiny Qwen3 (build_qwen: vocab 96, seed 0),
    memories after both layers (their W_O drawn as `build` draws them) and a batch of a row of 21 tokens and a row
    left-padded by 14 (off the chunk cycle): the chunk loop with the previous chunk (mag), the layer-major stream
    (mal, chunk-local) and prefix tokens (mac), with the write gate's bias of that release (-2)."""
    from safetensors.torch import load_file

    from titans_hf.testing_utils import build_qwen

    recorded = load_file(str(Path(__file__).parent / "data" / "decoder_hidden_states.safetensors"))
    build_qwen(tmp_path, vocab_size=96, family="qwen3", seed=0)
    settings = {"mag": dict(variant="mag"), "mal_chunk_local": dict(variant="mal", attend_previous_chunk=False),
                "mac": VARIANT_SETTINGS["mac"]}
    for name, variant in settings.items():
        model = build(tmp_path, memory_layers=[0, 1], theta_bias_init=-2.0, **variant)
        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=recorded["input_ids"],
                                         attention_mask=recorded["attention_mask"]).last_hidden_state
        torch.testing.assert_close(hidden, recorded[name], rtol=1e-5, atol=1e-5, msg=name)


def test_inputs_embeds_equal_input_ids(tiny_qwen3_dir):
    """forward and generate take the tokens' embeddings in place of their ids, left padding included."""
    model = build(tiny_qwen3_dir, **VARIANT_SETTINGS["mac"])
    vocab = model.config.text_config.vocab_size
    batch, mask = left_padded([random_ids(vocab, (1, length), seed=length)[0] for length in (9, 14)], 14)
    embeds = model.get_input_embeddings()(batch)
    with torch.no_grad():
        torch.testing.assert_close(model(inputs_embeds=embeds, attention_mask=mask).logits,
                                   model(batch, attention_mask=mask).logits, atol=0, rtol=0)
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(inputs_embeds=embeds, **settings), model.generate(batch, **settings)[:, 14:])
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        model(batch, inputs_embeds=embeds)
    with pytest.raises(ValueError, match=r"inputs_embeds must be a \[batch, tokens >= 1, 64\] float tensor"):
        model(inputs_embeds=embeds[..., :10])


@pytest.mark.parametrize("variant", ["mag", "mal"])
def test_layer_major_stream_equals_the_chunk_loop(tiny_qwen3_dir, variant):
    """Chunk-local attention without a cache runs layer by layer over all chunks at once (`_stream_layer_by_layer`);
    it must give what the chunk loop gives: logits, predictions, per-layer hidden states and gradients, with left
    padding, an unfinished last chunk and segments of two chunks (three segments here)."""
    vocab = AutoConfig.from_pretrained(tiny_qwen3_dir).vocab_size
    ids = random_ids(vocab, (3, 37), seed=8)
    mask = torch.ones_like(ids)
    mask[1, :16] = 0  # two whole chunks of padding: one batch with the other rows
    labels = ids.masked_fill(mask == 0, -100)
    runs = []
    for layer_major in (True, False):
        model = build(tiny_qwen3_dir, variant=variant, attend_previous_chunk=False, checkpoint_chunks=False).train()
        model.model.LAYER_MAJOR_TOKENS = 16
        with contextlib.nullcontext() if layer_major else model.chunk_by_chunk():
            assert model.model._runs_layer_by_layer(37, None) == layer_major
            out = model(ids, attention_mask=mask, labels=labels, logits_to_keep=37, return_predictions=True,
                        output_hidden_states=True)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        runs.append((out, grads))
    (fast, fast_grads), (loop, loop_grads) = runs
    real = mask.bool()
    torch.testing.assert_close(fast.logits[real], loop.logits[real], atol=1e-6, rtol=1e-5)
    assert torch.equal(fast.label_predictions, loop.label_predictions)
    torch.testing.assert_close(fast.loss, loop.loss, atol=1e-6, rtol=1e-6)
    for fast_hidden, loop_hidden in zip(fast.hidden_states, loop.hidden_states, strict=True):
        torch.testing.assert_close(fast_hidden[real], loop_hidden[real], atol=1e-6, rtol=1e-5)
    assert fast_grads.keys() == loop_grads.keys() and fast_grads
    for name, grad in fast_grads.items():
        torch.testing.assert_close(grad, loop_grads[name], atol=1e-6, rtol=1e-5)


def reference_write_rate(captured: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor | None]],
                         real_tokens: int, heads: int, layers: int) -> torch.Tensor:
    """mean(theta / max_lr) over memory layers, heads and real tokens, from each memory call's inputs."""
    total = 0.0
    for memory, hidden, mask in captured:
        x = F.rms_norm(hidden, (hidden.shape[-1],), memory.norm.weight, memory.norm.eps)
        theta = torch.sigmoid(F.linear(x, memory.to_gates.weight, memory.to_gates.bias)[..., :memory.memory_num_heads])
        total = total + (theta if mask is None else theta * mask[..., None]).sum()
    return total / (real_tokens * heads * layers)


@pytest.mark.parametrize("layer_major", [True, False])
def test_training_loss_adds_the_write_cost_of_the_mean_theta(tiny_qwen3_dir, layer_major):
    """`write_rate` is mean(theta / max_lr) over both memory layers, their heads and the real tokens (left padding
    off the chunk cycle runs as separate streams, right padding writes nothing); a training forward with labels adds
    `write_cost` * `write_rate` to the loss (weighted by the batch's share of `num_items_in_batch`), with exactly
    that term's gradient; an evaluation forward and the memory-off ablation add nothing."""
    vocab = AutoConfig.from_pretrained(tiny_qwen3_dir).vocab_size
    ids = random_ids(vocab, (3, 29), seed=9)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding off the chunk cycle
    mask[2, 23:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 5] = -100  # a row's first token has no label (what `items` below counts is what the loss sums)
    model = build(tiny_qwen3_dir, memory_layers=[0, 1], write_cost=2.5, attend_previous_chunk=False,
                  checkpoint_chunks=False)
    assert model.config.memory_config.write_cost == 2.5
    captured = []
    for block in model.memory.values():
        block.neural_memory.register_forward_hook(
            lambda module, args, output: captured.append((module, args[0].detach(), args[2])))
    last_bias = model.memory["1"].neural_memory.to_gates.bias

    def run(training: bool, **kwargs):
        model.train(training)
        captured.clear()
        model.zero_grad()
        with contextlib.nullcontext() if layer_major else model.chunk_by_chunk():
            out = model(ids, attention_mask=mask, labels=labels, **kwargs)
        out.loss.backward()
        return out, last_bias.grad.clone()

    evaluated, lm_gradient = run(False)
    trained, gradient = run(True)
    assert len(captured) >= (2 if layer_major else 8)  # several streams, and chunk by chunk several calls
    rate = reference_write_rate(captured, int(mask.sum()), heads=2, layers=2)
    torch.testing.assert_close(trained.write_rate, rate.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(evaluated.write_rate, trained.write_rate, rtol=0, atol=0)
    torch.testing.assert_close(trained.loss, evaluated.loss + 2.5 * rate.detach(), rtol=1e-6, atol=0)
    # the last memory's theta feeds nothing else of the cost: its bias gradient is the reference's
    cost_gradient, = torch.autograd.grad(2.5 * reference_write_rate(
        [(module, hidden, m) for module, hidden, m in captured if module is model.memory["1"].neural_memory],
        int(mask.sum()), heads=2, layers=2), last_bias)
    torch.testing.assert_close(gradient - lm_gradient, cost_gradient, rtol=1e-4, atol=1e-8)
    assert cost_gradient[:2].abs().min() > 0 and not cost_gradient[2:].any()  # theta's two heads, not the gates'

    weighed, _ = run(True, write_cost=0.75)  # a weight for this call (a trainer's schedule), in place of the config's
    torch.testing.assert_close(weighed.loss, evaluated.loss + 0.75 * rate.detach(), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=r"write_cost=-1.0 must be >= 0"):
        model(ids, attention_mask=mask, labels=labels, write_cost=-1.0)
    items = int((labels[:, 1:] != -100).sum())
    shared, _ = run(True, num_items_in_batch=4 * items)
    torch.testing.assert_close(shared.loss, (evaluated.loss + 2.5 * rate.detach()) / 4, rtol=1e-6, atol=0)
    model.train()
    with model.memory_disabled():
        off = model(ids, attention_mask=mask, labels=labels)
    assert off.write_rate is None
    model.eval()
    with model.memory_disabled():
        torch.testing.assert_close(model(ids, attention_mask=mask, labels=labels).loss, off.loss, rtol=0, atol=0)


def test_memory_off_computes_only_the_chunks_whose_outputs_are_asked_for(tiny_qwen3_dir):
    """Inside `memory_disabled()` with chunk-local attention nothing crosses a chunk: the last position's logits and
    `generate` (left padding and all) run the last chunk alone, with the same results as the whole chunk loop."""
    model = build(tiny_qwen3_dir, attend_previous_chunk=False)
    vocab = model.config.text_config.vocab_size
    ids = random_ids(vocab, (2, 37), seed=10)  # chunks of 8: four whole ones, then 5 tokens
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding off the chunk cycle: the rows run as two streams
    widths = []
    model.model.layers[0].register_forward_hook(lambda module, args, output: widths.append(args[0].shape[1]))
    with torch.no_grad(), model.memory_disabled(), model.chunk_by_chunk():
        every = model(ids, attention_mask=mask).logits  # all logits asked for: every chunk runs
        assert widths == [8, 8, 8, 8, 5] + [8, 8, 8, 8, 2]  # row 1 from its first real token on
        widths.clear()
        last = model(ids, attention_mask=mask, logits_to_keep=6).logits
        assert widths == [8, 5] + [8, 2]  # the chunks holding the last 6 positions of each stream
        torch.testing.assert_close(last, every[:, -6:], rtol=1e-5, atol=1e-6)  # the head on fewer rows
        widths.clear()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
        assert widths[:2] == [5, 2]  # the prefill: each stream's unfinished last chunk
        for step in range(5):
            seq = out.sequences[:, :37 + step]
            logits = model(seq, attention_mask=torch.cat([mask, torch.ones(2, step, dtype=mask.dtype)], 1)).logits
            torch.testing.assert_close(out.scores[step], logits[:, -1], atol=1e-5, rtol=1e-5)
            assert torch.equal(out.sequences[:, 37 + step], logits[:, -1].argmax(-1))
