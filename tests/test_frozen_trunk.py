"""The frozen trunk (`cache_frozen_trunk`): a training step that starts at the first memory layer from kept hidden
states gives the loss and gradients of the whole stream bit for bit, on every route the stream takes; what is kept,
when it is used, and what is refused."""

import pytest
import torch

from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.modeling.frozen_trunk import FrozenTrunkCache
from titans_hf.training import TitansTrainingArguments

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL_MEMORY = dict(chunk_size=8, memory_chunk_size=4, memory_num_heads=2, memory_head_dim=16, memory_layers=[1])


def build(base_dir, **settings) -> TitansQwenForCausalLM:
    torch.manual_seed(0)
    model = TitansQwenForCausalLM.from_base(base_dir, **{**SMALL_MEMORY, **settings})
    with torch.no_grad():  # a memory that contributes: W_O starts at zero
        for block in model.memory.values():
            block.output_weight.copy_(0.5 * torch.randn(block.output_weight.shape,
                                                        generator=torch.Generator().manual_seed(1)))
    return model.train()


def batch(vocab: int, rows: int = 3, length: int = 37) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, vocab, (rows, length), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 29:] = 0  # a right-padded row ending chunks before the others
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, :20] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_and_gradients(model: TitansQwenForCausalLM, inputs: dict, **kwargs) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = model(**inputs, **kwargs).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("settings", [{}, {"attend_previous_chunk": False}, {"variant": "mal"},
                                      {"bptt_chunks": 2}, {"checkpoint_chunks": True}],
                         ids=["previous-chunk", "layer-by-layer", "mal", "bptt", "checkpointed"])
def test_steps_from_the_trunk_equal_the_whole_stream(tiny_qwen2_dir, settings):
    model = build(tiny_qwen2_dir, **settings)
    inputs = batch(model.config.text_config.vocab_size)
    loss, gradients = loss_and_gradients(model, inputs)
    assert gradients  # the memory trains

    model.cache_frozen_trunk()
    store = model.model._frozen_trunk_cache
    for reading, (hits, misses) in enumerate([(0, 3), (3, 3)]):  # the first reading computes, the second reads
        again, again_gradients = loss_and_gradients(model, inputs)
        assert (store.hits, store.misses) == (hits, misses), reading
        assert torch.equal(again, loss)
        assert again_gradients.keys() == gradients.keys()
        assert all(torch.equal(again_gradients[name], gradients[name]) for name in gradients)
    kept = next(iter(store.rows.values()))
    assert kept.shape == (37, model.config.text_config.hidden_size)


def test_state_passing_reads_the_trunk_too(tiny_qwen2_dir):
    model = build(tiny_qwen2_dir)
    inputs = batch(model.config.text_config.vocab_size)
    inputs["attention_mask"][1, 29:] = 1  # memory_states need rows that start and end together
    inputs["labels"][1, 29:] = inputs["input_ids"][1, 29:]
    with torch.no_grad():
        states = model.model(input_ids=inputs["input_ids"][:, :16], memory_states=model.init_memory_states(3)
                             ).memory_states
    expected = loss_and_gradients(model, inputs, memory_states=states)
    model.cache_frozen_trunk()
    for _ in range(2):
        loss, gradients = loss_and_gradients(model, inputs, memory_states=states)
        assert torch.equal(loss, expected[0])
        assert all(torch.equal(gradients[name], expected[1][name]) for name in expected[1])
    assert model.model._frozen_trunk_cache.hits == 3


def test_a_changed_row_computes_its_trunk_afresh(tiny_qwen2_dir):
    model = build(tiny_qwen2_dir).cache_frozen_trunk()
    inputs = batch(model.config.text_config.vocab_size)
    model(**inputs)
    changed = {**inputs, "attention_mask": inputs["attention_mask"].clone()}
    changed["attention_mask"][0, 30:] = 0
    model(**changed)
    store = model.model._frozen_trunk_cache
    assert (store.hits, store.misses, len(store.rows)) == (0, 6, 4)  # rows 1 and 2 kept once, row 0 twice


def test_where_the_trunk_is_not_used(tiny_qwen2_dir):
    mac = build(tiny_qwen2_dir, variant="mac", num_memory_tokens=2, num_persistent_tokens=3).cache_frozen_trunk()
    mac(**batch(mac.config.text_config.vocab_size))  # memory tokens enter the first layer
    model = build(tiny_qwen2_dir).cache_frozen_trunk()
    inputs = batch(model.config.text_config.vocab_size)
    model(**inputs, output_hidden_states=True)  # every layer's hidden states asked for
    model(input_ids=inputs["input_ids"], use_cache=True)  # a cache: prefill runs every layer
    assert mac.model._frozen_trunk_cache.misses == model.model._frozen_trunk_cache.misses == 0
    model.cache_frozen_trunk(False)
    assert model.model._frozen_trunk_cache is None


def test_a_training_layer_below_the_memory_is_refused(tiny_qwen2_dir):
    model = build(tiny_qwen2_dir).cache_frozen_trunk()
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.weight below the first memory layer \(1\) train"):
        model(**batch(model.config.text_config.vocab_size))


def test_the_store_keeps_the_newest_rows_within_its_bytes():
    store = FrozenTrunkCache(max_bytes=2 * 4 * 4 * 4)  # two rows of 4 x 4 float32
    keys = [bytes([k]) for k in range(3)]
    store.put(keys, torch.arange(48, dtype=torch.float32).reshape(3, 4, 4))
    assert list(store.rows) == keys[1:] and store.stored_bytes == 128 and store.misses == 3
    assert store.get(keys[:2]) is None and store.hits == 0
    assert torch.equal(store.get(keys[2:])[0], torch.arange(32, 48, dtype=torch.float32).reshape(4, 4))
    assert store.hits == 1
    assert FrozenTrunkCache.row_key(torch.tensor([1, 2]), None, 1) != FrozenTrunkCache.row_key(torch.tensor([1, 2]),
                                                                                             None, 2)
    with pytest.raises(ValueError, match="max_bytes must be a positive integer"):
        FrozenTrunkCache(max_bytes=0)


def test_training_from_the_trunk_trains_the_same_memory(tiny_qwen3_dir, tmp_path):
    """TitansTrainer with frozen_trunk_cache_gb: two epochs whose second reads every row's trunk end in the memory
    weights of the run without it, bit for bit."""
    from test_trainer import make_rows, make_trainer, trainable_weights

    def trained(**overrides) -> tuple[dict, TitansQwenForCausalLM]:
        torch.manual_seed(0)
        model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_chunk_size=8,
                                                memory_head_dim=16, memory_layers=[1], checkpoint_chunks=False)
        dataset = make_rows([40, 56, 33, 48], model.config.text_config.vocab_size)
        make_trainer(tiny_qwen3_dir, tmp_path / str(len(overrides)), dataset, model=model, save_strategy="no",
                     **overrides).train()
        return trainable_weights(model), model

    expected, _ = trained()
    weights, model = trained(frozen_trunk_cache_gb=0.5)
    store = model.model._frozen_trunk_cache
    assert (store.misses, store.hits) == (4, 4) and store.max_bytes == 2**29
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


def test_the_arguments_refuse_a_negative_trunk_size(tmp_path):
    for size in (-1, float("nan")):
        with pytest.raises(ValueError, match=r"frozen_trunk_cache_gb=(-1|nan) must be 0 \(off\) or positive"):
            TitansTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], frozen_trunk_cache_gb=size)
