"""dpo and grpo stores train the memory: each prompt streamed through the memory once, every answer of its pair or
group scored from the memory state it leaves (`completion_log_probs`), DPO against the memory-off model, GRPO on
the stored rewards; through `titans-hf train` and through TitansTrainer in Python."""

from __future__ import annotations

import json
import math

import datasets
import pytest
import torch
from gloo_workers import ddp_and_one_process
from transformers import AutoTokenizer

from titans_hf.commands import main as cli_main
from titans_hf.data.collator import CompletionsCollator
from titans_hf.data.prepare import prepare
from titans_hf.modeling import TitansQwenForCausalLM
from titans_hf.modeling.memory_folder import MEMORY_WEIGHTS_NAME, is_memory_name
from titans_hf.training import TitansTrainer, TitansTrainingArguments
from titans_hf.training.preference import completions_loss, group_advantages

CHUNK = 8


def memory_model(model_dir, **settings) -> TitansQwenForCausalLM:
    torch.manual_seed(0)
    return TitansQwenForCausalLM.from_base(model_dir, chunk_size=CHUNK, memory_layers=[1], memory_chunk_size=4,
                                           memory_head_dim=16, **settings)


def open_memory(model: TitansQwenForCausalLM) -> None:
    """Output projections of the memory away from zero, so that the memory changes log-probabilities."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.memory.") and param.dim() == 2 and not param.any():
                param.normal_(std=0.5)


@pytest.mark.parametrize("attend_previous_chunk", [True, False])
def test_completion_log_probs_read_the_prompt_once_and_equal_whole_rows(tiny_qwen3_dir, attend_previous_chunk):
    """Prompts of 15 and 19 tokens (left-padded), groups of 3 completions of up to 5 tokens, one masked short: the
    log-probabilities and their gradients equal those of each completion read after its prompt as one row, and
    the memory sees each prompt's tokens once, not once per completion."""
    model = memory_model(tiny_qwen3_dir, attend_previous_chunk=attend_previous_chunk, checkpoint_chunks=False)
    open_memory(model)
    model.train()
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 300, (2, 19), generator=generator)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[1, :4] = 0
    completions = torch.randint(1, 300, (2, 3, 5), generator=generator)
    completion_mask = torch.ones_like(completions)
    completion_mask[0, 1, 3:] = 0

    seen = []
    hook = model.memory["1"].register_forward_hook(lambda module, args, output: seen.append(args[1].shape))
    scored = model.completion_log_probs(prompt, completions, prompt_mask, completion_mask)
    hook.remove()
    # tokens through the memory: each prompt's real tokens once (19 and 15: rows at different phases run
    # apart), then 2 x 3 completions of 5 columns; read once per completion it would be 3 x 34 + 30
    assert sum(shape[0] * shape[1] for shape in seen) == 19 + 15 + 2 * 3 * 5
    scored.sum().backward()
    fast = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()

    expected = torch.zeros(2, 3, 5)
    for row in range(2):
        start = int((prompt_mask[row] == 0).sum())
        for index in range(3):
            ids = torch.cat([prompt[row, start:], completions[row, index]])[None]
            logits = model(input_ids=ids).logits[0, :-1]
            log_probs = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None])[-5:, 0]
            expected[row, index] = log_probs * completion_mask[row, index]
    expected.sum().backward()
    torch.testing.assert_close(scored.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
    for name, grad in fast.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, atol=1e-5, rtol=1e-4, msg=name)
    assert any(grad.abs().sum() > 0 for name, grad in fast.items() if name.startswith("model.memory."))


def test_completions_collator_pads_prompts_left_and_answers_right():
    collate = CompletionsCollator(pad_token_id=0, chunk_size=4)
    batch = collate([{"prompt_ids": [5, 6, 7, 8, 9], "chosen_ids": [1], "rejected_ids": [2, 3]},
                     {"prompt_ids": [4], "chosen_ids": [7, 7, 7], "rejected_ids": [8]}])
    assert batch["prompt_ids"].tolist() == [[0, 0, 0, 5, 6, 7, 8, 9], [0, 0, 0, 0, 0, 0, 0, 4]]  # 2 whole chunks
    assert batch["prompt_attention_mask"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [0] * 7 + [1]]
    assert batch["completion_ids"].tolist() == [[[1, 0, 0], [2, 3, 0]], [[7, 7, 7], [8, 0, 0]]]
    assert batch["completion_mask"].tolist() == [[[1, 0, 0], [1, 1, 0]], [[1, 1, 1], [1, 0, 0]]]
    groups = collate([{"prompt_ids": [3], "completion_ids": [[1, 2], [4]], "completion_mask": [[1, 0], [1]],
                       "rewards": [0.5, -1.0]}])
    assert groups["completion_mask"].tolist() == [[[1, 0], [1, 0]]] and groups["rewards"].tolist() == [[0.5, -1.0]]
    with pytest.raises(ValueError, match=r"groups of \[1, 2\] completions in one batch"):
        collate([{"prompt_ids": [3], "completion_ids": [[1]], "completion_mask": [[1]], "rewards": [1.0]},
                 {"prompt_ids": [3], "completion_ids": [[1], [2]], "completion_mask": [[1], [1]], "rewards": [1, 2]}])
    with pytest.raises(ValueError, match="row 0 has no prompt"):
        collate([{"prompt_ids": [], "chosen_ids": [1], "rejected_ids": [2]}])


def test_losses_have_their_known_values(tiny_qwen3_dir):
    """DPO at the start (MAG memory output zero: policy == memory-off reference) is log 2; GRPO advantages are
    (r - mean) / (std + 1e-4) per group, and a group of equal rewards gives no gradient at all."""
    model = memory_model(tiny_qwen3_dir)
    model.train()
    batch = CompletionsCollator(pad_token_id=0, chunk_size=CHUNK)(
        [{"prompt_ids": list(range(3, 23)), "chosen_ids": [30, 31], "rejected_ids": [40, 41, 42]}])
    torch.testing.assert_close(completions_loss(model, batch, dpo_beta=0.1), torch.tensor(math.log(2)))
    torch.testing.assert_close(group_advantages(torch.tensor([[1.0, 3.0], [2.0, 2.0]])),
                               torch.tensor([[-1.0, 1.0], [0.0, 0.0]]) / (2 ** 0.5 + 1e-4))  # std: unbiased, as TRL
    equal = CompletionsCollator(pad_token_id=0, chunk_size=CHUNK)(
        [{"prompt_ids": list(range(3, 23)), "completion_ids": [[30, 31], [40]], "completion_mask": [[1, 1], [1]],
          "rewards": [2.0, 2.0]}])
    open_memory(model)
    completions_loss(model, equal, dpo_beta=0.1).backward()
    assert all(not p.grad.any() for p in model.parameters() if p.grad is not None)
    unequal = {**equal, "rewards": torch.tensor([[2.0, -1.0]])}
    completions_loss(model, unequal, dpo_beta=0.1).backward()
    assert any(p.grad.abs().sum() > 0 for name, p in model.named_parameters() if name.startswith("model.memory."))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


STORY = "Mary went to the kitchen. " + "The old clock on the tower struck noon. " * 3 + "Where is Mary?"


def test_titans_hf_train_on_a_dpo_store(tiny_qwen3_dir, tiny_tokenizer_dir, tmp_path):
    records = [{"prompt": STORY, "chosen": " kitchen", "rejected": " garden"},
               {"prompt": STORY.replace("Mary", "John"), "chosen": " kitchen", "rejected": " office"}] * 2
    [store] = prepare(write_jsonl(tmp_path / "pairs.jsonl", records), tmp_path / "pairs.h5", tiny_tokenizer_dir,
                      train_type="dpo")
    base = {name: t.clone() for name, t in memory_model(tiny_qwen3_dir).state_dict().items()
            if not is_memory_name(name)}
    start = memory_model(tiny_qwen3_dir).memory_state_dict()
    assert cli_main([
        "train", "--dataset", "titans_tokens", "--train_type", "dpo", "--data_files", str(store),
        "--model_name_or_path", str(tiny_qwen3_dir), "--chunk_size", str(CHUNK), "--memory_layers", "1",
        "--memory_chunk_size", "4", "--memory_head_dim", "16", "--output_dir", str(tmp_path / "out"),
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--learning_rate", "1e-2",
        "--max_steps", "3", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
        "--use_cpu", "true", "--train_ratio", "0.75", "--logging_steps", "1", "--eval_strategy", "steps",
        "--eval_steps", "3",  # the held-out pair's DPO loss
    ]) == 0  # fmt: skip
    trained = TitansQwenForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(trained.state_dict()[name], tensor) for name, tensor in base.items())
    assert any(not torch.equal(trained.memory_state_dict()[name], tensor) for name, tensor in start.items())
    assert (tmp_path / "out" / MEMORY_WEIGHTS_NAME).is_file()


def test_titans_trainer_on_grpo_rows_in_python(tiny_qwen3_dir, tiny_tokenizer_dir, tmp_path):
    """load_dataset("titans_tokens", train_type="grpo") -> TitansTrainer: the memory trains on stored rewards and
    the base stays bitwise; the logged gradient norm is positive."""
    records = [{"prompt": STORY, "responses": [" kitchen", " garden", " office"], "rewards": [1.0, 0.0, -0.5]},
               {"prompt": STORY.replace("Mary", "Sandra"), "responses": [" hallway", " kitchen", " bedroom"],
                "rewards": [0.0, 1.0, 0.0]}]
    [store] = prepare(write_jsonl(tmp_path / "groups.jsonl", records), tmp_path / "groups_bin", tiny_tokenizer_dir,
                      train_type="grpo")
    rows = datasets.load_dataset("titans_tokens", data_files=f"{store}/*", train_type="grpo",
                                 cache_dir=str(tmp_path / "cache"))["train"]
    model = memory_model(tiny_qwen3_dir)
    base = {name: t.clone() for name, t in model.state_dict().items() if not is_memory_name(name)}
    start = {name: t.clone() for name, t in model.memory_state_dict().items()}
    args = TitansTrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                                   gradient_accumulation_steps=1, max_steps=3, learning_rate=1e-2, logging_steps=1,
                                   save_strategy="no", report_to="none", use_cpu=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    trainer = TitansTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.train()
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in base.items())
    assert any(not torch.equal(model.memory_state_dict()[name], tensor) for name, tensor in start.items())
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert norms and all(norm > 0 for norm in norms)


NAMES = ["Mary", "John", "Sandra", "Daniel", "Fred"]  # 4 train rows (--train_ratio 0.8), 1 held out


@pytest.mark.parametrize("train_type", ["dpo", "grpo"])
def test_two_process_ddp_on_a_store_takes_the_steps_of_one_process(tiny_qwen3_dir, tiny_tokenizer_dir, tmp_path,
                                                                   train_type):
    """`accelerate launch` of scripts/train.py on a dpo / grpo store, two gloo ranks of one row each, takes the
    same SGD steps as one process with both rows in its batch: DDP averages the ranks' gradients, which for DPO's
    mean over pairs and GRPO's mean over equally many answer tokens is the gradient of the two-row batch."""
    from safetensors.torch import load_file

    if train_type == "dpo":
        records = [{"prompt": STORY.replace("Mary", name), "chosen": " kitchen", "rejected": " garden"}
                   for name in NAMES]
    else:
        records = [{"prompt": STORY.replace("Mary", name), "responses": [" kitchen", " garden", " office"],
                    "rewards": [1.0, float(index), -0.5]} for index, name in enumerate(NAMES)]
    [store] = prepare(write_jsonl(tmp_path / "rows.jsonl", records), tmp_path / "rows.h5", tiny_tokenizer_dir,
                      train_type=train_type)
    flags = [
        "--dataset", "titans_tokens", "--train_type", train_type, "--data_files", str(store), "--train_ratio", "0.8",
        "--model_name_or_path", str(tiny_qwen3_dir), "--chunk_size", str(CHUNK), "--memory_layers", "1",
        "--memory_chunk_size", "4", "--memory_head_dim", "16", "--gradient_accumulation_steps", "1",
        "--optim", "sgd", "--learning_rate", "0.5", "--max_steps", "2", "--save_strategy", "no", "--report_to",
        "none", "--disable_tqdm", "true", "--dpo_beta", "0.5",
    ]  # fmt: skip
    ddp_dir, one_dir = ddp_and_one_process(flags, tmp_path)
    ddp, one = (load_file(folder / MEMORY_WEIGHTS_NAME) for folder in (ddp_dir, one_dir))
    assert ddp.keys() == one.keys() == memory_model(tiny_qwen3_dir).memory_state_dict().keys()
    for name, tensor in one.items():
        torch.testing.assert_close(ddp[name], tensor, atol=1e-6, rtol=1e-4, msg=name)
    trained_from_zero = [name for name in one if name.endswith("output_weight")]  # W_O starts at zero
    assert trained_from_zero and all(one[name].any() for name in trained_from_zero)


@pytest.mark.parametrize("attend_previous_chunk", [True, False])
def test_checkpointed_prompt_chunks_are_recomputed_and_score_as_without(tiny_qwen3_dir, attend_previous_chunk):
    """Under checkpoint_chunks a training call streams each prompt up to its last chunk without a cache, chunk by
    chunk recomputed in backward (the memory sees those chunks again during backward), and hands the state to a
    cache for the last chunk and the answers: log-probabilities and gradients as the single cached pass gives."""
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, 300, (2, 19), generator=generator)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[1, :4] = 0  # 15 tokens: one whole chunk of 8 before its last
    completions = torch.randint(1, 300, (2, 3, 5), generator=generator)
    completion_mask = torch.ones_like(completions)
    completion_mask[0, 2, 2:] = 0
    results = []
    for checkpoint_chunks in (True, False):
        model = memory_model(tiny_qwen3_dir, attend_previous_chunk=attend_previous_chunk,
                             checkpoint_chunks=checkpoint_chunks)
        open_memory(model)
        model.train()
        seen = []
        hook = model.memory["1"].register_forward_hook(lambda module, args, output: seen.append(args[1].shape[1]))
        scored = model.completion_log_probs(prompt, completions, prompt_mask, completion_mask)
        forward_tokens = sum(seen)
        (scored * torch.arange(1, 6)).sum().backward()
        hook.remove()
        grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
        results.append((scored.detach(), grads, forward_tokens, sum(seen) - forward_tokens))
    (checkpointed, grads, _, recomputed), (cached, cached_grads, _, not_recomputed) = results
    assert recomputed == 16 + 8 and not_recomputed == 0  # rows' chunks before their last: 2 x 8 and 1 x 8 tokens
    torch.testing.assert_close(checkpointed, cached, atol=1e-5, rtol=1e-5)
    for name, grad in cached_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert any(grad.abs().sum() > 0 for name, grad in grads.items() if name.startswith("model.memory."))
