"""Hostile input to the model left from earlier rounds: memory states (or a cache) of another update rule, the
attentions asked for at load, and labels that label nothing. Each was accepted before, and then gave a silent wrong
answer: states read under a rule that did not make them, no attentions, a loss of 0.0."""

from __future__ import annotations

import pytest
import torch

from test_modeling import SMALL_MEMORY, build, random_ids

from titans_hf.modeling import TitansCache, TitansQwenForCausalLM


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny matmuls: one thread (see conftest)."""


# ---- states of another update rule ----

RULE_MESSAGE = (r"forward: memory_states\[1\]\.update_rule: expected a state of this memory's update_rule='delta', "
                r"got one made by a memory of update_rule='gradient'")


@pytest.mark.parametrize("streamed", [False, True], ids=["fresh", "after a stream"])
def test_memory_states_of_the_gradient_rule_are_refused_by_a_delta_rule_model(tiny_qwen3_dir, streamed):
    """The two rules' states have the same shapes (the linear memory, one fast weight per head), so every shape check
    passed and the delta rule read the gradient rule's fast weights as its own."""
    delta = build(tiny_qwen3_dir)
    gradient = build(tiny_qwen3_dir, update_rule="gradient")
    ids = random_ids(512, (2, 16))
    with torch.no_grad():
        states = gradient.init_memory_states(2)
        if streamed:
            states = gradient(ids, memory_states=states).memory_states
        with pytest.raises(ValueError, match=RULE_MESSAGE):
            delta(ids, memory_states=states)
        with pytest.raises(ValueError, match=RULE_MESSAGE.replace("delta", "@").replace("gradient", "delta")
                           .replace("@", "gradient")):
            gradient(ids, memory_states=delta.init_memory_states(2))
        delta(ids, memory_states=delta.init_memory_states(2))  # its own rule's states still start a stream


def test_a_cache_of_the_gradient_rule_is_refused_by_a_delta_rule_model(tiny_qwen3_dir):
    delta = build(tiny_qwen3_dir)
    gradient = build(tiny_qwen3_dir, update_rule="gradient")
    ids = random_ids(512, (2, 16))
    message = (r"forward: cache holds the memory states of a model of update_rule='gradient'; this model's memory is "
               r"update_rule='delta'")
    with torch.no_grad():
        cache = gradient(ids[:, :8], use_cache=True).cache
        with pytest.raises(ValueError, match=message):
            delta(ids[:, 8:], cache=cache)
        with pytest.raises(ValueError, match=message):
            delta(ids[:, 8:], past_key_values=TitansCache(gradient.config))
        with pytest.raises(ValueError, match=message):
            delta.generate(ids, cache=TitansCache(gradient.config), max_new_tokens=2, do_sample=False)
        delta(ids[:, 8:], cache=delta(ids[:, :8], use_cache=True).cache)  # its own cache still continues


# ---- output_attentions at load ----


def test_output_attentions_at_load_is_refused_naming_the_argument(tiny_qwen3_dir, tmp_path):
    """It reached the base's config alone, and every forward returned no attentions without a word."""
    folder = build(tiny_qwen3_dir).save_memory(tmp_path / "memory")
    message = r"{}: output_attentions=True: TitansQwenForCausalLM attends chunk by chunk .* load without it"
    with pytest.raises(ValueError, match=message.format("from_pretrained")):
        TitansQwenForCausalLM.from_pretrained(folder, output_attentions=True)
    with pytest.raises(ValueError, match=message.format("from_base_and_memory")):
        TitansQwenForCausalLM.from_base_and_memory(None, folder, output_attentions=True)
    with pytest.raises(ValueError, match=message.format("from_base")):
        TitansQwenForCausalLM.from_base(tiny_qwen3_dir, load_kwargs={"output_attentions": True}, **SMALL_MEMORY)
    full = tmp_path / "full"
    build(tiny_qwen3_dir).save_pretrained(full, save_full_model=True)
    with pytest.raises(ValueError, match=message.format("from_pretrained")):
        TitansQwenForCausalLM.from_pretrained(full, output_attentions=True)
    assert TitansQwenForCausalLM.from_pretrained(folder, output_attentions=False).config.output_attentions is False


# ---- labels that label nothing ----

NO_LABEL_MESSAGE = r"forward: labels label no token \(every label after the first position is -100"


def test_labels_that_label_no_token_are_refused_naming_labels(tiny_qwen3_dir):
    """Their mean loss is undefined (transformers' own models return NaN); it was 0.0, which trains nothing and
    reads as a perfect model."""
    model = build(tiny_qwen3_dir)
    ids = random_ids(512, (2, 16))
    only_first = torch.full_like(ids, -100)
    only_first[:, 0] = ids[:, 0]  # the first position is predicted by nothing
    with torch.no_grad():
        for labels in (torch.full_like(ids, -100), only_first):
            with pytest.raises(ValueError, match=NO_LABEL_MESSAGE):
                model(ids, labels=labels)
            with pytest.raises(ValueError, match=NO_LABEL_MESSAGE):
                model(ids, labels=labels, num_items_in_batch=0)
            with pytest.raises(ValueError, match=NO_LABEL_MESSAGE):
                model(ids, labels=labels, num_items_in_batch=torch.tensor(0))


def test_a_micro_batch_without_labels_inside_a_labelled_accumulated_batch_adds_zero(tiny_qwen3_dir):
    """Under gradient accumulation the Trainer passes num_items_in_batch, the labelled tokens of every micro-batch of
    the step: one micro-batch without any adds 0 to the accumulated mean, and the step's loss is the labelled
    micro-batch's mean."""
    model = build(tiny_qwen3_dir)
    ids = random_ids(512, (2, 16))
    labelled = ids.clone()
    labelled[:, :10] = -100
    count = int((labelled[:, 1:] != -100).sum())
    with torch.no_grad():
        empty = model(ids, labels=torch.full_like(ids, -100), num_items_in_batch=torch.tensor(count)).loss
        mean = model(ids, labels=labelled).loss
        summed = model(ids, labels=labelled, num_items_in_batch=torch.tensor(count)).loss
    assert empty.item() == 0.0
    torch.testing.assert_close(empty + summed, mean)
