"""Hostile or surprising input to the model: memory settings past what the arithmetic holds, saved configs that lost
a field, memory states that do not fit the model, and the arguments a daily transformers user passes
(`past_key_values`, `attn_implementation`).

Known answers come from the model itself: one call against the same input split over calls, a stream through a
cache against the one-pass logits, the eager attention against SDPA, a clipped memory against the same memory at
another scale of theta.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re

import pytest
import torch
import transformers.models.qwen3.modeling_qwen3 as modeling_qwen3

from test_modeling import SMALL_MEMORY, build, random_ids

from titans_hf.modeling import TitansCache, TitansQwenForCausalLM
from titans_hf.modeling.configuration_titans_qwen import (
    MEMORY_CONFIG_FORMAT_VERSION,
    TitansMemoryConfig,
    read_memory_config,
)
from titans_hf.modeling.update_rules import UPDATE_RULES

MAX_GRADIENT_RULE_LR = UPDATE_RULES["gradient"].max_lr


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny matmuls: one thread (see conftest)."""


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- memory settings ----


@pytest.mark.parametrize(("settings", "message"), [
    (dict(max_lr=float("inf")), r"max_lr=inf must be a finite number within float32's range"),
    (dict(max_lr=1e308, update_rule="gradient"), r"max_lr=1e\+308 must be a finite number within float32's range"),
    (dict(max_lr=1e7, update_rule="gradient"), r"max_lr=10000000.0: update_rule='gradient' needs max_lr <= 1e\+06"),
    (dict(theta_bias_init=1e308), r"theta_bias_init=1e\+308 must be a finite number within float32's range"),
    (dict(forget_bias_init=-1e39), r"forget_bias_init=-1e\+39 must be a finite number within float32's range"),
    (dict(write_cost=1e300), r"write_cost=1e\+300 must be a finite number within float32's range"),
    (dict(max_memory_norm=1e39), r"max_memory_norm=1e\+39 must be a finite number within float32's range"),
    (dict(max_memory_norm=0.0), r"max_memory_norm=0.0 must be > 0"),
])
def test_numbers_the_memory_cannot_compute_with_are_refused_naming_the_field(tiny_qwen3_dir, settings, message):
    """Each was accepted before and then ended in NaN logits, a wiped memory or torch's overflow error at build."""
    with pytest.raises(ValueError, match=message):
        TitansMemoryConfig(**settings)
    with pytest.raises(ValueError, match=message):
        TitansQwenForCausalLM.from_base(tiny_qwen3_dir, **SMALL_MEMORY, **settings)


def test_the_gradient_rule_at_its_max_lr_bound_writes_what_a_smaller_theta_writes(tiny_qwen3_dir):
    """The gradient rule's step is clipped: once every chunk's surprise reaches the clip, scaling theta scales the
    surprise, not the step, so max_lr 1e3 and the bound 1e6 read the same logits. Past the bound the surprise's norm
    leaves float32 and the writes vanish (the memory then reads its initial weights) or turn into NaN."""
    ids = random_ids(512, (2, 48), seed=3)
    logits = {}
    for max_lr in (1e3, MAX_GRADIENT_RULE_LR):
        model = build(tiny_qwen3_dir, update_rule="gradient", max_lr=max_lr, theta_bias_init=2.0)
        with torch.no_grad():
            logits[max_lr] = model(ids).logits
    assert torch.isfinite(logits[MAX_GRADIENT_RULE_LR]).all()
    torch.testing.assert_close(logits[MAX_GRADIENT_RULE_LR], logits[1e3], atol=1e-4, rtol=1e-4)
    # the writes matter: a memory that never writes (theta ~ 0) reads other logits
    silent = build(tiny_qwen3_dir, update_rule="gradient", max_lr=1e3, theta_bias_init=-1e4)
    with torch.no_grad():
        assert (silent(ids).logits - logits[1e3]).abs().max() > 1e-2


def saved_config(tmp_path, **settings):
    """A memory config saved as save_pretrained writes it: (its path, its JSON)."""
    path = TitansMemoryConfig(**settings).save_pretrained(tmp_path)
    return path, json.loads(path.read_text())


@pytest.mark.parametrize("field", ["attend_previous_chunk", "update_rule", "write_cost", "max_lr", "base_shape"])
def test_a_current_config_file_that_lost_a_field_is_refused_naming_file_and_field(tmp_path, field):
    """A delta-rule memory whose file lost update_rule loaded as the gradient rule (the defaults of files from before
    the setting existed); a file of the current format holds every field, so a missing one is refused."""
    path, values = saved_config(tmp_path, update_rule="delta", attend_previous_chunk=True, max_lr=0.25)
    assert values["format_version"] == MEMORY_CONFIG_FORMAT_VERSION
    assert read_memory_config(path) == TitansMemoryConfig(update_rule="delta", max_lr=0.25)
    del values[field]
    path.write_text(json.dumps(values))
    before = sha256(path)
    with pytest.raises(ValueError, match=rf"^{path}: {field} missing: a memory config of format_version 1 holds "
                                         "every field"):
        read_memory_config(path)
    assert sha256(path) == before


def test_the_fields_of_the_current_format_are_those_it_was_defined_with():
    """A file of format 1 holds exactly these fields. A new field needs a new format number (and, for files of format
    1 that lack it, the value older memories had): otherwise every saved memory would be refused as incomplete."""
    assert MEMORY_CONFIG_FORMAT_VERSION == 1
    assert sorted(TitansMemoryConfig().to_dict()) == sorted([
        "format_version", "chunk_size", "memory_layers", "variant", "memory_model", "memory_num_heads",
        "memory_head_dim", "memory_depth", "memory_expansion", "conv_kernel", "conv_init", "memory_chunk_size",
        "memory_batch_size", "update_rule", "max_lr", "max_memory_norm", "theta_bias_init", "forget_bias_init",
        "write_cost", "num_memory_tokens", "num_persistent_tokens", "attend_previous_chunk", "bptt_chunks",
        "freeze_base", "checkpoint_chunks", "base_model_name_or_path", "revision", "base_shape", "base_fingerprint",
        "titans_hf_version"])


def test_a_config_file_from_before_the_first_release_is_refused_naming_it(tmp_path):
    """A file without format_version is from before titans_hf's first release (0.3.0): it was read with the values
    memories had before each setting it lacked existed; now it is refused in one line naming it, whatever it holds, and
    left as it was. A dict of settings (no titans_hf_version: not a saved file) still takes the defaults."""
    path, values = saved_config(tmp_path, update_rule="delta")
    whole = {name: value for name, value in values.items() if name != "format_version"}
    older = {name: value for name, value in whole.items() if name not in ("update_rule", "write_cost")}
    for unnumbered in (whole, older):
        path.write_text(json.dumps(unnumbered))
        before = sha256(path)
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: no format_version: the memory config is "
                                             r"from before titans_hf's first release \(0\.3\.0\),.* it must be saved "
                                             "again"):
            read_memory_config(path)
        assert sha256(path) == before
    assert TitansMemoryConfig.from_dict({"chunk_size": 16}).update_rule == "delta"  # settings, not a file


@pytest.mark.parametrize(("settings", "message"), [
    (dict(memory_depth=2), r"update_rule='delta' writes the linear memory token by token: it needs "
                           r"memory_model='mlp', memory_depth=1 and no memory_batch_size \(got 'mlp', 2, None\)"),
    (dict(memory_chunk_size=4, memory_batch_size=8), r"update_rule='delta' .* \(got 'mlp', 1, 8\)"),
    (dict(update_rule="gradient", memory_chunk_size=64, memory_batch_size=100),
     r"memory_batch_size=100 must be a multiple of memory_chunk_size \(64\) and at least it"),
    (dict(max_lr=0.6), r"max_lr=0.6: update_rule='delta' needs max_lr <= 0.5 \(a step 2 theta <= 1 keeps each "
                       r"write a contraction along its key\)"),
    (dict(update_rule="gradient", max_memory_norm=3.0), r"max_memory_norm bounds the delta rule's state"),
    (dict(variant="mac"), r"variant 'mac' needs num_memory_tokens >= 1"),
    (dict(num_persistent_tokens=2), r"num_memory_tokens / num_persistent_tokens are only used by variant 'mac', got "
                                    r"variant='mag'"),
    (dict(variant="memory-as-gate"), r"variant='memory-as-gate' must be one of \['mac', 'mag', 'mal'\]"),
    (dict(memory_model="lstm"), r"memory_model='lstm' must be one of \['mlp'\]"),
    (dict(conv_init="mean"), r"conv_init='mean' must be one of \['identity', 'shifted', 'window'\]"),
    (dict(conv_init="shifted", conv_kernel=1),
     r"conv_init='shifted' keys the tokens before their own: it needs conv_kernel >= 2, got 1"),
])
def test_the_limits_of_each_rule_and_variant_are_the_memory_configs_own(tmp_path, settings, message):
    """TitansMemoryConfig checks every setting once, the update rules' and the variants' limits included (they were
    checked only when a TitansQwenConfig or a NeuralMemory was built, so a memory config held them unchecked); a saved
    file that breaks one is refused naming it, and left as it was."""
    with pytest.raises(ValueError, match=message):
        TitansMemoryConfig(**settings)
    path, values = saved_config(tmp_path)
    path.write_text(json.dumps({**values, **settings}))
    before = sha256(path)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {message}"):
        read_memory_config(path)
    assert sha256(path) == before


def test_the_delta_rules_norm_bound_is_resolved_into_the_config_and_a_file_without_it_loads_to_the_same(
        tmp_path, tiny_qwen3_dir):
    """max_memory_norm None is the delta rule's 4 sqrt(memory_head_dim), resolved into the field when the config is
    built: the config, its saved file and the model's memories hold the number. A file that holds null (as every
    delta-rule memory saved before the number was stored) loads to the same number; the gradient rule has none."""
    assert TitansMemoryConfig().max_memory_norm == 32.0  # 4 sqrt(64)
    assert TitansMemoryConfig(max_memory_norm=3).max_memory_norm == 3.0
    assert TitansMemoryConfig(update_rule="gradient").max_memory_norm is None
    path, values = saved_config(tmp_path, **SMALL_MEMORY)
    assert values["max_memory_norm"] == 16.0  # 4 sqrt(16)
    path.write_text(json.dumps({**values, "max_memory_norm": None}))
    loaded = read_memory_config(path)
    assert loaded.max_memory_norm == 16.0 and loaded == TitansMemoryConfig(**SMALL_MEMORY)
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, loaded)
    assert model.config.memory_config.max_memory_norm == 16.0
    assert [(block.neural_memory.max_memory_norm, block.neural_memory.update_settings.max_memory_norm)
            for block in model.memory.values()] == [(16.0, 16.0)]
    path, values = saved_config(tmp_path, update_rule="gradient")
    assert values["max_memory_norm"] is None and read_memory_config(path).max_memory_norm is None



def test_from_base_with_another_update_rule_takes_that_rules_defaults(tiny_qwen3_dir):
    """A config resolved for the delta rule, given to from_base with update_rule="gradient", leaves the delta rule's
    resolved values behind (the bound, the write gate's bias, the write cost) and takes the gradient rule's; values
    given with the new rule stay as given."""
    delta = TitansMemoryConfig(**SMALL_MEMORY)
    assert (delta.max_memory_norm, delta.theta_bias_init, delta.write_cost) == (16.0, -6.0, 1.0)
    memory = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, delta, update_rule="gradient").config.memory_config
    assert (memory.update_rule, memory.max_memory_norm, memory.theta_bias_init, memory.write_cost) == (
        "gradient", None, -2.0, 0.0)
    memory = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, delta, update_rule="gradient",
                                             theta_bias_init=-3.0).config.memory_config
    assert (memory.theta_bias_init, memory.write_cost) == (-3.0, 0.0)
    memory = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, delta, max_lr=0.25).config.memory_config
    assert (memory.update_rule, memory.max_memory_norm, memory.theta_bias_init) == ("delta", 16.0, -6.0)

@pytest.mark.parametrize("version", [2, "1", None, True])
def test_a_config_file_of_an_unknown_format_is_refused(tmp_path, version):
    path, values = saved_config(tmp_path)
    path.write_text(json.dumps({**values, "format_version": version}))
    with pytest.raises(ValueError, match=rf"^{path}: format_version={version!r}; this titans_hf .* reads memory "
                                         "configs of format 1"):
        read_memory_config(path)


# ---- memory_states ----


def other_memory_states(tiny_qwen3_dir, **settings):
    """Fresh states for 2 rows of a memory of other settings."""
    return TitansQwenForCausalLM.from_base(tiny_qwen3_dir, **{**SMALL_MEMORY, **settings}).init_memory_states(2)


@pytest.mark.parametrize(("make", "message"), [
    (lambda model, fresh: [fresh[1]],
     r"forward: memory_states must be a dict with one MemoryState per memory layer \[1\] .*got a list"),
    (lambda model, fresh: {0: fresh[1]},
     r"forward: memory_states must be a dict with one MemoryState per memory layer \[1\] .*got a dict with keys \[0\]"),
    (lambda model, fresh: {"1": fresh[1]}, r"got a dict with keys \['1'\]"),
    (lambda model, fresh: {1: fresh[1].state_dict()},
     r"forward: memory_states\[1\] must be a MemoryState, got a dict \(MemoryState.from_state_dict"),
    (lambda model, fresh: {1: fresh[1].select([0])},
     r"forward: memory_states must hold 2 rows each \(one per input row\); memory_states\[1\] holds 1"),
    (lambda model, fresh: {1: dataclasses.replace(fresh[1], conv_tail=fresh[1].conv_tail.half())},
     r"forward: memory_states\[1\].conv_tail: expected a torch.float32 tensor of shape \(2, 3, 96\), got a "
     r"torch.float16 tensor of shape \(2, 3, 96\)"),
    (lambda model, fresh: {1: dataclasses.replace(fresh[1], buffer_mask=[[1.0]])},
     r"forward: memory_states\[1\].buffer_mask: expected a torch.float32 tensor of shape \(2, 0\) .*got a list"),
    (lambda model, fresh: {1: dataclasses.replace(fresh[1], momentum=[m.double() for m in fresh[1].momentum])},
     r"memory_states\[1\].momentum\[0\]: expected a torch.float32 tensor of shape \(2, 2, 16, 16\), got a "
     r"torch.float64"),
    (lambda model, fresh: {1: dataclasses.replace(fresh[1], position=3)},
     r"memory_states\[1\].buffer_keys: expected a torch.float32 tensor of shape \(2, 2, 3, 16\) \(position 3 leaves "
     r"3 token\(s\) of an unfinished update chunk of 4\)"),
    (lambda model, fresh: {1: dataclasses.replace(fresh[1], position=4)},
     r"forward: memory_states\[1\].position is 4: memory_states must be at a chunk boundary \(a multiple of "
     r"chunk_size 8\)"),
    (lambda model, fresh: {1: dataclasses.replace(fresh[1], position=-8)},
     r"memory_states\[1\].position: expected the number of tokens seen \(an integer >= 0\), got -8"),
    (lambda model, fresh: {1: dataclasses.replace(fresh[1], weights=[fresh[1].weights[0]] * 2)},
     r"memory_states\[1\].weights: expected a list of 1 tensor\(s\), one per fast weight of this memory \(mlp, "
     r"depth 1\), got 2 tensors"),
    (lambda model, fresh: {1: dataclasses.replace(fresh[1], momentum=[torch.full_like(fresh[1].momentum[0], float(
        "nan"))])}, r"forward: memory_states\[1\].momentum\[0\]: expected finite values, got NaN or infinite ones"),
    (lambda model, fresh: {1: dataclasses.replace(fresh[1], conv_tail=fresh[1].conv_tail.clone().fill_(float(
        "inf")))}, r"forward: memory_states\[1\].conv_tail: expected finite values"),
], ids=["list", "other layer", "str key", "state_dict", "rows", "float16", "not a tensor", "float64", "buffers",
        "off the chunks", "negative position", "depth", "nan", "inf"])
def test_memory_states_that_do_not_fit_are_refused_in_one_line(tiny_qwen3_dir, make, message):
    """Before, each ended in torch's own error (or, for NaN, in NaN logits without a word)."""
    model = build(tiny_qwen3_dir)
    ids = random_ids(512, (2, 16))
    with pytest.raises(ValueError, match=message), torch.no_grad():
        model(ids, memory_states=make(model, model.init_memory_states(2)))
    with pytest.raises(ValueError, match=message), torch.no_grad():  # the decoder alone checks them too
        model.get_decoder()(ids, memory_states=make(model, model.init_memory_states(2)))


@pytest.mark.parametrize(("settings", "message"), [
    (dict(memory_num_heads=4), r"memory_states\[1\].weights\[0\]: expected a torch.float32 tensor of shape "
                               r"\(2, 2, 16, 16\), got a torch.float32 tensor of shape \(2, 4, 16, 16\)"),
    (dict(memory_head_dim=8, memory_num_heads=4), r"memory_states\[1\].weights\[0\]: .* shape \(2, 4, 8, 8\)"),
    (dict(update_rule="gradient", memory_depth=2), r"memory_states\[1\].weights: expected a list of 1 tensor"),
    (dict(conv_kernel=6), r"memory_states\[1\].conv_tail: expected a torch.float32 tensor of shape \(2, 3, 96\), "
                          r"got a torch.float32 tensor of shape \(2, 5, 96\)"),
])
def test_memory_states_of_another_memory_are_refused(tiny_qwen3_dir, settings, message):
    model = build(tiny_qwen3_dir)
    with pytest.raises(ValueError, match=message), torch.no_grad():
        model(random_ids(512, (2, 16)), memory_states=other_memory_states(tiny_qwen3_dir, **settings))


# ---- continuing a stream: cache (or past_key_values) vs memory_states ----


@pytest.mark.parametrize("attend_previous_chunk", [True, False])
@pytest.mark.parametrize("split", [13, 16], ids=["inside a chunk", "on a chunk boundary"])
def test_an_input_split_over_calls_through_the_cache_is_the_one_call(tiny_qwen3_dir, attend_previous_chunk, split):
    """Through `cache` (or `past_key_values`, its name before transformers 5.24, which was silently ignored: the
    second call started from an empty memory and no previous chunk), two calls give the one call's logits."""
    model = build(tiny_qwen3_dir, attend_previous_chunk=attend_previous_chunk)
    ids = random_ids(512, (2, 30), seed=1)
    with torch.no_grad():
        whole = model(ids).logits
        first = model(ids[:, :split], use_cache=True)
        second = model(ids[:, split:], cache=first.cache).logits
        first_again = model(ids[:, :split], use_cache=True)
        by_old_name = model(ids[:, split:], past_key_values=first_again.cache).logits
        alone = model(ids[:, split:]).logits
    torch.testing.assert_close(torch.cat([first.logits, second], dim=1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_old_name, whole[:, split:], atol=1e-5, rtol=1e-5)
    assert first_again.cache.get_seq_length() == 30
    assert (alone - whole[:, split:]).abs().max() > 1e-2  # what the cache carried is what made them equal


def test_cache_and_past_key_values_together_are_refused(tiny_qwen3_dir):
    model = build(tiny_qwen3_dir)
    ids = random_ids(512, (1, 8))
    for call in (model, model.get_decoder()):
        with pytest.raises(ValueError, match="cache and past_key_values were both given; they are one argument"):
            call(ids, cache=TitansCache(model.config), past_key_values=TitansCache(model.config))


@pytest.mark.parametrize("attend_previous_chunk", [True, False])
def test_memory_states_start_a_new_input_from_a_memory(tiny_qwen3_dir, attend_previous_chunk):
    """memory_states carry the memory only; attention starts afresh. With chunk-local attention that is the one
    call's stream exactly; with the previous chunk in view it is not (the new input's first chunk misses the previous
    chunk's keys): its first chunk reads as the chunk-local model's does from the same memory."""
    model = build(tiny_qwen3_dir, attend_previous_chunk=attend_previous_chunk)
    ids = random_ids(512, (2, 32), seed=2)
    with torch.no_grad():
        whole = model(ids).logits
        first = model(ids[:, :16], memory_states=model.init_memory_states(2))
        second = model(ids[:, 16:], memory_states=first.memory_states).logits
        fresh = model(ids[:, 16:]).logits
    assert (second - fresh).abs().max() > 1e-2  # the memory carried over
    if not attend_previous_chunk:
        torch.testing.assert_close(second, whole[:, 16:], atol=1e-5, rtol=1e-5)
        return
    assert (second - whole[:, 16:]).abs().max() > 1e-2  # not a continuation: that is what cache= is for
    local = build(tiny_qwen3_dir, attend_previous_chunk=False)
    assert all(torch.equal(weight, local.state_dict()[name]) for name, weight in model.state_dict().items())
    with torch.no_grad():
        local_second = local(ids[:, 16:], memory_states=first.memory_states).logits
    torch.testing.assert_close(second[:, :8], local_second[:, :8], atol=1e-5, rtol=1e-5)  # its first chunk: alone
    assert (second[:, 8:] - local_second[:, 8:]).abs().max() > 1e-2  # later chunks see the chunk before them


# ---- attention implementations ----


def test_eager_attention_runs_and_equals_sdpa(tiny_qwen3_dir, monkeypatch):
    """attn_implementation="eager" reaches every decoder layer of the chunk loop (the previous chunk's window, left
    padding, the cache of generate), and reads what SDPA reads."""
    calls = []
    eager = modeling_qwen3.eager_attention_forward
    monkeypatch.setattr(modeling_qwen3, "eager_attention_forward",
                        lambda *args, **kwargs: calls.append(1) or eager(*args, **kwargs))
    ids = random_ids(512, (2, 30), seed=4)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    outputs = {}
    for implementation in ("sdpa", "eager"):
        model = build(tiny_qwen3_dir, attn_implementation=implementation)
        assert model.config._attn_implementation == implementation
        calls.clear()
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
            generated = model.generate(ids[:, :12], attention_mask=mask[:, :12], max_new_tokens=6, do_sample=False,
                                       pad_token_id=0)
        outputs[implementation] = (logits, generated, len(calls))
    assert outputs["sdpa"][2] == 0 and outputs["eager"][2] > 0
    real = mask.bool()
    torch.testing.assert_close(outputs["eager"][0][real], outputs["sdpa"][0][real], atol=1e-5, rtol=1e-5)
    assert torch.equal(outputs["eager"][1], outputs["sdpa"][1])


def test_the_auto_classes_pass_attn_implementation_to_the_base(tiny_qwen3_dir, tmp_path):
    """`AutoModelForCausalLM.from_pretrained(memory_folder, attn_implementation="eager")` puts the setting on the
    config it hands over; the memory folder's base loads with it, and without it keeps the default (SDPA)."""
    from transformers import AutoModelForCausalLM

    TitansQwenForCausalLM.from_base(tiny_qwen3_dir, **SMALL_MEMORY).save_pretrained(tmp_path / "memory")
    eager = AutoModelForCausalLM.from_pretrained(tmp_path / "memory", attn_implementation="eager")
    default = AutoModelForCausalLM.from_pretrained(tmp_path / "memory")
    assert eager.config._attn_implementation == "eager"
    assert eager.model.layers[0].self_attn.config._attn_implementation == "eager"
    assert default.model.layers[0].self_attn.config._attn_implementation == "sdpa"
