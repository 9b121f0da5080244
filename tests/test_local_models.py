import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from titans_hf.testing_utils import END_OF_TEXT


def test_tokenizer_round_trips_answers_with_leading_space(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    ids = tokenizer(" kitchen", add_special_tokens=False)["input_ids"]
    assert len(ids) == 1
    assert tokenizer.decode(ids) == " kitchen"
    assert tokenizer.eos_token == END_OF_TEXT and tokenizer.pad_token == END_OF_TEXT


def test_tokenizer_without_pad(tiny_tokenizer_no_pad_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_no_pad_dir)
    assert tokenizer.pad_token is None and tokenizer.eos_token == END_OF_TEXT


def test_tiny_models_load_by_path(tiny_qwen2_dir, tiny_qwen3_dir):
    for path, model_type in [(tiny_qwen2_dir, "qwen2"), (tiny_qwen3_dir, "qwen3")]:
        model = AutoModelForCausalLM.from_pretrained(path)
        assert model.config.model_type == model_type
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = tokenizer("Mary went to the kitchen.", return_tensors="pt")["input_ids"]
        logits = model(ids).logits
        assert logits.shape == (1, ids.shape[1], len(tokenizer))
        assert torch.isfinite(logits).all()
