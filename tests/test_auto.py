"""A memory folder behaves like any Hugging Face model folder: `AutoConfig`, `AutoModelForCausalLM` and
`pipeline("text-generation")` load it (the base it names plus the memory) without trust_remote_code, and batched
pipelines answer each prompt as it is answered alone."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, pipeline

import titans_hf  # noqa: F401  (registers titans_qwen with the Auto classes)
from titans_hf.modeling import TitansQwenConfig, TitansQwenForCausalLM

from test_modeling import VARIANT_SETTINGS, build


@pytest.fixture
def memory_folder(tmp_path, tiny_qwen3_dir):
    model = build(tiny_qwen3_dir, **VARIANT_SETTINGS["mac"])
    folder = tmp_path / "memory"
    model.save_pretrained(folder)
    return model, folder


def test_auto_classes_load_a_memory_folder_as_from_pretrained_does(memory_folder, tiny_qwen3_dir):
    model, folder = memory_folder
    # adapter-sized: the memory's weights and two small configs, nothing of the base
    assert sorted(path.name for path in folder.iterdir()) == ["config.json", "memory_config.json",
                                                              "memory_model.safetensors"]
    assert '"_name_or_path"' not in (folder / "config.json").read_text()  # the memory config names the base
    config = AutoConfig.from_pretrained(folder)
    assert isinstance(config, TitansQwenConfig)
    assert config.memory_config == model.config.memory_config
    assert config.text_config.to_dict() | {"_name_or_path": ""} == model.config.text_config.to_dict() | {
        "_name_or_path": ""}

    auto = AutoModelForCausalLM.from_pretrained(folder).eval()
    direct = TitansQwenForCausalLM.from_pretrained(folder).eval()
    assert type(auto) is TitansQwenForCausalLM
    assert auto.config.name_or_path == str(tiny_qwen3_dir) == model.config.name_or_path  # the base, as PEFT's
    assert auto.memory_state_dict().keys() == model.memory_state_dict().keys()
    ids = torch.randint(1, 200, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        torch.testing.assert_close(auto(ids).logits, expected, atol=0, rtol=0)
        torch.testing.assert_close(direct(ids).logits, expected, atol=0, rtol=0)
    assert [name for name, p in auto.named_parameters() if p.requires_grad] == [
        name for name, p in model.named_parameters() if p.requires_grad]

    # a folder written before config.json existed still loads by the model class
    (folder / "config.json").unlink()
    with torch.no_grad():
        torch.testing.assert_close(TitansQwenForCausalLM.from_pretrained(folder).eval()(ids).logits, expected,
                                   atol=0, rtol=0)


def test_a_memory_folder_never_chooses_code_or_load_options_through_config_json(memory_folder):
    """config.json is what the Auto classes dispatch on; the model loads from memory_config.json and the base, so
    nothing else written there (remote code, a dtype, an attention implementation) takes effect."""
    model, folder = memory_folder
    values = json.loads((folder / "config.json").read_text())
    values.update(auto_map={"AutoModelForCausalLM": "evil--modeling.Evil", "AutoConfig": "evil--config.Evil"},
                  dtype="bfloat16")
    values["text_config"]["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(values))
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded) is TitansQwenForCausalLM and loaded.model.embed_tokens.weight.dtype == torch.float32


def test_pipeline_loads_a_memory_folder_and_batches_answer_as_alone(memory_folder, tiny_qwen3_dir):
    """pipeline("text-generation", model=<memory folder>) with its tokenizer beside it (as TitansTrainer writes
    it); batch_size=3 left-pads prompts of different lengths, and every answer equals the prompt's alone."""
    model, folder = memory_folder
    AutoTokenizer.from_pretrained(tiny_qwen3_dir).save_pretrained(folder)
    generator = pipeline("text-generation", model=str(folder))
    assert type(generator.model) is TitansQwenForCausalLM
    generator.tokenizer.padding_side = "left"
    prompts = ["Mary went to the kitchen.", "John moved to the garden. Sandra went back to the office. Where is",
               "The old clock", "Daniel travelled to the hallway. Question: Where is Daniel? Answer:"]
    settings = dict(max_new_tokens=5, do_sample=False, return_full_text=False)
    batched = generator(prompts, batch_size=3, **settings)
    alone = [generator(prompt, **settings) for prompt in prompts]
    assert batched == alone
    lengths = {len(generator.tokenizer(prompt)["input_ids"]) % model.padding_multiple for prompt in prompts}
    assert len(lengths) > 1  # the batch mixes places in the chunk cycle
