"""The private members of transformers and huggingface_hub the model relies on are checked in one place: the check
passes on the installed versions and names the member when one moves."""

from __future__ import annotations

import pytest
from huggingface_hub import file_download
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel

from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.modeling.library_internals import check_transformers_internals, check_transformers_internals_once


def test_the_installed_libraries_have_every_private_member_the_model_uses():
    check_transformers_internals()


@pytest.mark.parametrize(("owner", "name", "message"), [
    (GenerationMixin, "_prepare_cache_for_generation", r"transformers.GenerationMixin._prepare_cache_for_generation "
                                                       r"is gone"),
    (PreTrainedModel, "_set_gradient_checkpointing", r"transformers.PreTrainedModel._set_gradient_checkpointing is "
                                                     r"gone"),
    (next(c for c in PreTrainedModel.__mro__ if "_tp_plan" in vars(c)), "_tp_plan",
     r"transformers.PreTrainedModel._tp_plan is gone"),
    (PreTrainedConfig, "_attn_implementation", r"transformers.PreTrainedConfig._attn_implementation is no longer a "
                                               r"property over _attn_implementation_internal"),
    (file_download, "_CACHED_NO_EXIST", r"huggingface_hub.file_download._CACHED_NO_EXIST is gone"),
], ids=["prepare cache", "gradient checkpointing", "tp plan", "attention", "cached no exist"])
def test_a_private_member_that_moved_is_named(monkeypatch, tiny_qwen3_dir, owner, name, message):
    monkeypatch.delattr(owner, name)
    with pytest.raises(RuntimeError, match=rf"relies on private members .* moved: .*{message}"):
        check_transformers_internals()
    check_transformers_internals_once.cache_clear()  # the model checks them when it is built
    with pytest.raises(RuntimeError, match=message):
        TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=8, memory_head_dim=16)


def test_a_changed_signature_is_named(monkeypatch):
    def moved(self, generation_config, model_kwargs, batch_size):
        pass

    monkeypatch.setattr(GenerationMixin, "_prepare_cache_for_generation", moved)
    with pytest.raises(RuntimeError, match=r"_prepare_cache_for_generation takes \(generation_config, model_kwargs, "
                                           r"batch_size\), not \(generation_config, model_kwargs, generation_mode"):
        check_transformers_internals()


def test_a_mark_the_library_no_longer_reads_is_named(monkeypatch):
    def sample(self, *args, **kwargs):
        pass

    monkeypatch.setattr(GenerationMixin, "_sample", sample)
    with pytest.raises(RuntimeError, match=r"transformers.GenerationMixin._sample no longer reads _is_user_defined"):
        check_transformers_internals()
