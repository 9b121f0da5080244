"""Two training steps of TitansQwen (frozen base, memory trainable, with or without a LoRA on the base) under raw
FSDP2 `fully_shard`, two gloo CPU processes, against the same steps taken by one process on both halves of the
batch: on labelled windows, and on dpo + grpo batches (a prompt and a group of completions, the DPO reference the
memory-off model).

FSDP through accelerate/Trainer on a CPU silently becomes DDP (accelerate 1.15), so the sharded path is exercised directly.
This file is also the worker script: `python test_fsdp.py MODE RANK WORLD PORT MODEL_DIR OUT_DIR`.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from gloo_workers import exit_without_finalising, run_two_ranks

CHUNKED = dict(chunk_size=8, memory_chunk_size=4, memory_num_heads=2, memory_head_dim=16, memory_layers=[0, 1])
LEARNING_RATE = 0.5
STEPS = 2  # the second step's forward must see the first step's weights, however backward left the units


def build(model_dir, mode: str):
    """The model of a mode ("lm", "lm_lora", "completions", "completions_lora"): with "_lora", LoRA of rank 4 on
    the base's q/k/v projections, lora_B moved off zero so that the LoRA changes the result."""
    from titans_hf.modeling import TitansQwenForCausalLM

    torch.manual_seed(0)
    model = TitansQwenForCausalLM.from_base(model_dir, **CHUNKED)
    with torch.no_grad():
        for block in model.memory.values():
            block.output_weight.normal_(std=0.5)  # so every memory parameter gets a gradient on the first step
    if mode.endswith("_lora"):
        from peft import LoraConfig

        from titans_hf.lora import add_lora

        add_lora(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"]))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.normal_(std=0.1)
    return model.train()


def batch(rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, vocab, (2, 20), generator=torch.Generator().manual_seed(100 + rank))
    labels = ids.clone()
    labels[:, : 4 + 3 * (rank % 2)] = -100  # ranks hold different numbers of labelled tokens
    return ids, labels


def completion_batches(rank: int, vocab: int) -> tuple[dict, dict]:
    """A rank's dpo batch (a 20-token prompt, chosen and rejected answers) and grpo batch (a 13-token prompt, three
    responses with rewards), as a CompletionsCollator makes them."""
    from titans_hf.data.collator import CompletionsCollator

    generator = torch.Generator().manual_seed(200 + rank)
    ids = torch.randint(1, vocab, (33 + 3 * 4,), generator=generator).tolist()
    collate = CompletionsCollator(pad_token_id=0, chunk_size=CHUNKED["chunk_size"])
    dpo = collate([{"prompt_ids": ids[:20], "chosen_ids": ids[33:35], "rejected_ids": ids[35:38]}])
    grpo = collate([{"prompt_ids": ids[20:33], "completion_ids": [ids[38:41], ids[41:43], ids[43:45]],
                     "completion_mask": [[1, 1, 1], [1, 1], [1, 1]], "rewards": [1.0, 0.0, -0.5 * rank]}])
    return dpo, grpo


def rank_loss(model, mode: str, rank: int) -> torch.Tensor:
    """The loss of one rank's batch: the LM loss of its windows, or the DPO + GRPO loss of its completions."""
    from titans_hf.training.preference import completions_loss

    vocab = model.config.text_config.vocab_size
    if mode.startswith("lm"):
        ids, labels = batch(rank, vocab)
        return model(ids, labels=labels).loss
    dpo, grpo = completion_batches(rank, vocab)
    return completions_loss(model, dpo, dpo_beta=0.5) + completions_loss(model, grpo, dpo_beta=0.5)


def worker(mode: str, rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.fsdp import FSDPModule, fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = build(model_dir, mode)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=LEARNING_RATE)
    losses, frozen_grads = [], []
    for step in range(STEPS):
        try:
            loss = rank_loss(model, mode, rank + 10 * step)
        except ValueError as error:  # a refused setting: the test checks the message
            Path(out_dir, f"refused_{rank}.txt").write_text(str(error))
            break
        loss.backward()
        frozen_grads += [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        optimizer.step()
        optimizer.zero_grad()
        step_losses = [None] * world
        dist.all_gather_object(step_losses, loss.item())
        losses.append(step_losses)
    for module in model.modules():  # units a completions backward left gathered: back to their shards
        if isinstance(module, FSDPModule):
            module.reshard()
    full = {n: p.full_tensor().detach().contiguous() for n, p in model.named_parameters()}
    if rank == 0:
        save_file(full, os.path.join(out_dir, "params.safetensors"))
        Path(out_dir, "result.json").write_text(json.dumps({"losses": losses, "frozen_grads": frozen_grads}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["lm", "lm_lora", "completions"])
def test_fsdp2_training_steps_match_single_process(tmp_path, tiny_qwen3_dir, mode):
    from safetensors.torch import load_file

    run_two_ranks(__file__, [mode], [str(tiny_qwen3_dir), str(tmp_path)])
    result = json.loads((tmp_path / "result.json").read_text())
    sharded = load_file(str(tmp_path / "params.safetensors"))

    # reference: FSDP averages gradients over ranks, i.e. the gradient of the mean of the two ranks' losses,
    # computed on one thread like the workers (OMP_NUM_THREADS=1), whatever earlier tests set
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build(tiny_qwen3_dir, mode)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
        losses = []
        for step in range(STEPS):
            step_losses = [rank_loss(model, mode, rank + 10 * step) for rank in range(2)]
            ((step_losses[0] + step_losses[1]) / 2).backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append([loss.item() for loss in step_losses])
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(result["losses"]), atol=1e-5, rtol=1e-5)

    assert result["frozen_grads"] == []
    assert sharded.keys() == {n for n, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(sharded[name], param.detach(), atol=1e-5, rtol=1e-4, msg=name)
        if param.requires_grad:
            assert not torch.equal(sharded[name], before[name]), f"trainable {name} did not move"
        else:
            assert torch.equal(sharded[name], before[name]), f"frozen {name} changed"
    assert any(".lora_" in name for name in sharded) == mode.endswith("_lora")


def test_fsdp2_refuses_completions_that_would_train_a_sharded_layer_with_stale_weights(tmp_path, tiny_qwen3_dir):
    """dpo / grpo rows, attend_previous_chunk, a LoRA on FSDP2-sharded layers: refused before any forward, naming
    DDP and attend_previous_chunk=False (FSDP2 would free the prompt's layers too early, and keeping them gathered
    would keep a trainable layer's weights from before the optimizer step)."""
    run_two_ranks(__file__, ["completions_lora"], [str(tiny_qwen3_dir), str(tmp_path)])
    for rank in range(2):
        message = (tmp_path / f"refused_{rank}.txt").read_text()
        assert "FSDP2 with attend_previous_chunk=True cannot train sharded base layers" in message
        assert "ddp.yaml" in message and "attend_previous_chunk=False" in message
    assert json.loads((tmp_path / "result.json").read_text())["losses"] == []


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    exit_without_finalising()
