"""Two CPU processes: `accelerate launch --config_file titans_hf/accelerate/cpu_ddp.yaml` running the BABILong
training entry (DDP over gloo), and raw FSDP2 `fully_shard` for the trainer's gather/load of trainable state.

This file is also the worker script (FSDP through accelerate/Trainer on a CPU silently becomes DDP in accelerate 1.15, so the
sharded checkpoint helpers are exercised under `fully_shard` directly):
    accelerate launch ... test_train_ddp.py ddp MODEL_DIR OUT_DIR
    python test_train_ddp.py fsdp RANK WORLD PORT MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gloo_workers import exit_without_finalising, run_two_ranks
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "titans_hf" / "accelerate"
STOP_STEP = 4  # inside epoch 1: 10 training rows over 2 ranks, 5 batches per rank, 3 optimizer steps per epoch
STEPS = 6


def tiny_recipe(model_dir: str, data_files: list[str], output_dir: str, *extra: str) -> list[str]:
    """The titans-hf train flags of a run small enough for CPU: QA1 at 2 lengths, curriculum 2 -> 4 chunks of 64."""
    return [
        "--model_name_or_path", model_dir, "--chunk_size", "64", "--memory_chunk_size", "8",
        "--memory_head_dim", "16",
        "--data_files", *data_files, "--max_length", "256",
        "--answer_reserve_tokens", "8", "--output_dir", output_dir, "--num_train_epochs", "2",
        "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3", "--log_every_batches", "4",
        "--curriculum_chunks", "2", "4", "--report_to", "none", "--disable_tqdm", "true", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def babilong_files(tmp_path_factory, tiny_qwen3_dir) -> list[str]:
    """QA1 rows with 80- and 200-token haystacks (2 and 4 chunks), 6 each, frozen in BABILong JSON files."""
    from transformers import AutoTokenizer

    from titans_hf.tasks.babilong import generate_babilong, write_babilong_json

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    folder = tmp_path_factory.mktemp("babilong")
    return [
        str(write_babilong_json(generate_babilong("qa1", 6, length, tokenizer, seed=length), folder / f"{length}.json"))
        for length in (80, 200)
    ]


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def ddp_worker(model_dir: str, out_dir: str, data_files: list[str]) -> None:
    from transformers import TrainerCallback

    from titans_hf.commands.train import parse_arguments
    from titans_hf.training.recipe import train_memory

    class StopAtStep(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == STOP_STEP

    class WriteRates(TrainerCallback):
        """This rank's write rate of every training batch (read from the model's outputs) and, at each training log,
        how many batches it had seen and the write_rate logged."""

        def __init__(self):
            self.batches: list[float] = []
            self.logged: list[tuple[int, float]] = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            def record(module, inputs, outputs):
                if module.training and outputs.write_rate is not None:
                    self.batches.append(outputs.write_rate.item())

            model.register_forward_hook(record)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                self.logged.append((len(self.batches), logs["write_rate"]))

    out = Path(out_dir)
    write_rates = WriteRates()
    runs = {
        "full": (tiny_recipe(model_dir, data_files, str(out / "full"), "--save_strategy", "no"), [write_rates]),
        "stopped": (tiny_recipe(model_dir, data_files, str(out / "resumed"), "--save_steps", "1"), [StopAtStep()]),
        "resumed": (tiny_recipe(model_dir, data_files, str(out / "resumed"), "--resume_from_checkpoint", "last"), None),
    }
    steps = {}
    for name, (argv, callbacks) in runs.items():
        trainer = train_memory(*parse_arguments(argv), callbacks=callbacks)
        rank = trainer.args.process_index
        save_file(trainable(trainer.model), str(out / f"{name}_rank{rank}.safetensors"))
        steps[name] = (trainer.state.global_step, trainer.args.world_size)
    (out / f"steps_rank{rank}.json").write_text(json.dumps(steps))
    (out / f"write_rates_rank{rank}.json").write_text(json.dumps({"batches": write_rates.batches,
                                                                  "logged": write_rates.logged}))


def test_two_process_ddp_training_and_exact_resume(tmp_path, tiny_qwen3_dir, babilong_files):
    from titans_hf.modeling import TitansQwenForCausalLM
    from titans_hf.modeling.memory_folder import file_key

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf_home")}
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(CONFIGS / "cpu_ddp.yaml"),
        __file__, "ddp", str(tiny_qwen3_dir), str(tmp_path), *babilong_files,
    ]  # fmt: skip
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]

    for rank in (0, 1):
        steps = json.loads((tmp_path / f"steps_rank{rank}.json").read_text())
        assert steps == {"full": [STEPS, 2], "stopped": [STOP_STEP, 2], "resumed": [STEPS, 2]}
    # the logged write_rate is the mean over ranks of each rank's mean over its batches since the last log (as the
    # loss is averaged), the same on both ranks; not rank 0's alone, which differs from it by more than the rounding
    rates = [json.loads((tmp_path / f"write_rates_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert rates[0]["logged"] == rates[1]["logged"]
    assert [end for end, _ in rates[0]["logged"]] == [4, 7, 10]  # a log every 2 steps; an epoch is 2 + 2 + 1 batches
    start, apart = 0, []
    for end, logged in rates[0]["logged"]:
        means = [sum(rank["batches"][start:end]) / (end - start) for rank in rates]
        assert logged == pytest.approx(sum(means) / 2, abs=1e-6)
        apart.append(abs(means[0] - means[1]) / 2)
        start = end
    assert max(apart) > 1e-5
    weights = {
        (run, rank): load_file(tmp_path / f"{run}_rank{rank}.safetensors")
        for run in ("full", "stopped", "resumed")
        for rank in (0, 1)
    }
    reference = weights["full", 0]
    for key in [("full", 1), ("resumed", 0), ("resumed", 1)]:
        assert weights[key].keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(weights[key][name], tensor), (key, name)
    assert not all(torch.equal(weights["stopped", 0][n], t) for n, t in reference.items())

    checkpoint = tmp_path / "resumed" / f"checkpoint-{STOP_STEP}"
    assert {"rng_state_0.pth", "rng_state_1.pth", "memory_model.safetensors"} <= set(os.listdir(checkpoint))
    assert not [f for f in os.listdir(checkpoint) if f.startswith(("model", "pytorch_model"))]
    saved = load_file(checkpoint / "memory_model.safetensors")
    assert saved.keys() == {file_key(n) for n in reference}  # the memory's parameters, under the file's keys
    assert not [n for n in saved if n.startswith(("model.", "lm_head."))]
    # the final memory in output_dir loads onto the base as the rank weights
    final = TitansQwenForCausalLM.from_base_and_memory(tiny_qwen3_dir, tmp_path / "full")
    assert all(torch.equal(final.memory_state_dict()[file_key(n)], t) for n, t in reference.items())


def test_cli_and_script_are_one_deterministic_entry(tmp_path, tiny_qwen3_dir, babilong_files):
    from titans_hf.commands import main as cli_main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the script's process: another thread count may sum in another order
    try:
        argv = tiny_recipe(str(tiny_qwen3_dir), babilong_files, str(tmp_path / "cli"), "--max_steps", "2")
        assert cli_main(["train", *argv]) == 0
    finally:
        torch.set_num_threads(threads)
    script = [sys.executable, str(REPO / "scripts" / "train.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = tiny_recipe(str(tiny_qwen3_dir), babilong_files, str(tmp_path / "script"), "--max_steps", "2", "--use_cpu", "true")
    result = subprocess.run(script + argv, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    # one rank-0 log line per logging step: log every 4 batches = every 2 steps, so 1 in 2 steps
    assert [line for line in result.stdout.splitlines() if "'loss'" in line][0].startswith("{'loss': ")
    assert sum("'loss'" in line for line in result.stdout.splitlines()) == 1

    tokenizer_files = sorted(f for f in os.listdir(tiny_qwen3_dir) if f.startswith("tokenizer"))
    for run in ("cli", "script"):
        assert sorted(os.listdir(tmp_path / run)) == sorted([
            ".titans_hf_outputs.json", "checkpoint-2", "config.json", "memory_config.json", "memory_model.safetensors",
            "training_args.json", *tokenizer_files,
        ])  # fmt: skip
    cli, script_weights = (load_file(tmp_path / run / "memory_model.safetensors") for run in ("cli", "script"))
    assert cli.keys() == script_weights.keys()
    assert all(torch.equal(cli[n], script_weights[n]) for n in cli)
    config = json.loads((tmp_path / "cli" / "memory_config.json").read_text())
    assert config["chunk_size"] == 64 and config["base_model_name_or_path"] == str(tiny_qwen3_dir)

    help_text = subprocess.run(script + ["--help"], env=env, capture_output=True, text=True).stdout
    for default in ("--max_length MAX_LENGTH", "default: 32768", "--log_every_batches", "outputs/titans_memory",
                    "--dataset DATASET", "--window_size WINDOW_SIZE"):
        assert default in help_text


def test_generated_lengths_are_built_and_split_per_length(tiny_qwen3_dir):
    from titans_hf.tasks.babilong.training import load_babilong_splits
    from titans_hf.training.recipe import DataArguments

    data_args = DataArguments(generate_lengths=[80, 200], num_samples=10, max_length=256, answer_reserve_tokens=8)
    train, evaluation = load_babilong_splits(data_args, str(tiny_qwen3_dir), pad_to_max_length=False)
    assert (len(train), len(evaluation)) == (18, 2)  # 9 + 1 per length
    assert sorted(set(train["length"])) == [80, 200] and train["length"].count(80) == 9
    assert all(len(ids) <= 256 for ids in train["input_ids"])  # unpadded, the collator pads to chunks
    assert len({len(ids) for ids in train["input_ids"]}) > 2
    with pytest.raises(ValueError, match="--data_files.*--generate_lengths"):
        load_babilong_splits(DataArguments(), str(tiny_qwen3_dir), pad_to_max_length=True)


# ---- accelerate configs ----


def test_accelerate_configs_load_and_select_the_intended_setup():
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    configs = {name: ClusterConfig.from_yaml_file(str(CONFIGS / f"{name}.yaml")) for name in ("ddp", "fsdp", "cpu_ddp")}
    assert (configs["ddp"].distributed_type, configs["ddp"].use_cpu) == (DistributedType.MULTI_GPU, False)
    # two CPU processes: accelerate 1.15 starts one process for MULTI_CPU, so it is MULTI_GPU + use_cpu
    assert (configs["cpu_ddp"].distributed_type, configs["cpu_ddp"].num_processes) == (DistributedType.MULTI_GPU, 2)
    assert configs["cpu_ddp"].use_cpu
    assert configs["fsdp"].distributed_type == DistributedType.FSDP
    assert configs["fsdp"].fsdp_config["fsdp_version"] == 2
    assert configs["fsdp"].fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert "fsdp_transformer_layer_cls_to_wrap" not in configs["fsdp"].fsdp_config  # the model's _no_split_modules


@pytest.mark.parametrize("base", ["tiny_qwen3_dir", "tiny_qwen2_dir"])
def test_fsdp_config_wraps_each_decoder_layer_of_a_titans_qwen(base, request):
    import yaml
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from titans_hf.modeling import TitansQwenForCausalLM

    settings = yaml.safe_load((CONFIGS / "fsdp.yaml").read_text())["fsdp_config"]
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=settings["fsdp_version"],
        auto_wrap_policy=settings["fsdp_auto_wrap_policy"],
        reshard_after_forward=settings["fsdp_reshard_after_forward"],
        state_dict_type=settings["fsdp_state_dict_type"],
    )
    model = TitansQwenForCausalLM.from_base(request.getfixturevalue(base), chunk_size=16)
    plugin.set_auto_wrap_policy(model)
    wraps = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [module for module in model.modules() if wraps(module)]
    assert wrapped == list(model.model.layers)  # the memory stays with the root unit, all fp32


# ---- FSDP2 ----


def fsdp_model(model_dir: str):
    from titans_hf.modeling import TitansQwenForCausalLM

    torch.manual_seed(0)
    model = TitansQwenForCausalLM.from_base(model_dir, chunk_size=8, memory_chunk_size=4, memory_head_dim=16)
    with torch.no_grad():
        for block in model.memory.values():
            block.output_weight.normal_(std=0.5)  # every memory parameter gets a gradient on the first step
    return model


def fsdp_step(model, optimizer, rank: int) -> None:
    ids = torch.randint(1, 200, (1, 16), generator=torch.Generator().manual_seed(rank))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def fsdp_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from titans_hf.training.checkpointing import (
        gather_optimizer_state_dict,
        gather_trainable_state_dict,
        load_optimizer_state_dict,
        load_trainable_state_dict,
    )

    def sharded():
        model = fsdp_model(model_dir)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, optimizer = sharded()
    fsdp_step(model, optimizer, rank)
    weights = gather_trainable_state_dict(model)  # collectives: every rank calls
    optimizer_state = gather_optimizer_state_dict(model, optimizer)
    if rank == 0:
        save_file(weights, os.path.join(out_dir, "gathered.safetensors"))
        torch.save(optimizer_state, os.path.join(out_dir, "optimizer.pt"))
    dist.barrier()

    # a fresh sharded model resumes from the files and takes the same next step as the original
    resumed, resumed_optimizer = sharded()
    load_trainable_state_dict(resumed, load_file(os.path.join(out_dir, "gathered.safetensors")), "gathered")
    state = torch.load(os.path.join(out_dir, "optimizer.pt"), weights_only=True)
    load_optimizer_state_dict(resumed, resumed_optimizer, state)
    for m, o in ((model, optimizer), (resumed, resumed_optimizer)):
        fsdp_step(m, o, rank + 10)
    after, after_resumed = gather_trainable_state_dict(model), gather_trainable_state_dict(resumed)
    if rank == 0:
        save_file(after, os.path.join(out_dir, "after.safetensors"))
        save_file(after_resumed, os.path.join(out_dir, "after_resumed.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp2_gathers_and_restores_only_trainable_state(tmp_path, tiny_qwen3_dir):
    run_two_ranks(__file__, ["fsdp"], [str(tiny_qwen3_dir), str(tmp_path)])

    model = fsdp_model(str(tiny_qwen3_dir))
    initial = trainable(model)
    gathered = load_file(tmp_path / "gathered.safetensors")
    assert gathered.keys() == initial.keys() == set(model.memory_parameter_names().values())
    assert all(gathered[n].shape == t.shape for n, t in initial.items())
    assert all(not torch.equal(gathered[n], t) for n, t in initial.items())  # the step moved every memory weight
    optimizer_state = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    assert set(optimizer_state["state"]) == set(initial)  # keyed by name, trainable parameters only
    after, after_resumed = load_file(tmp_path / "after.safetensors"), load_file(tmp_path / "after_resumed.safetensors")
    assert all(torch.equal(after_resumed[n], t) for n, t in after.items())


if __name__ == "__main__":
    if sys.argv[1] == "ddp":
        ddp_worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        fsdp_worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    exit_without_finalising()


def test_two_process_ddp_training_on_a_token_store(tmp_path, tiny_qwen3_dir):
    """`accelerate launch` of scripts/train.py on a seq store: two gloo ranks share the windows of one run."""
    from titans_hf.commands import main as cli_main

    documents = tmp_path / "doc.txt"
    documents.write_text("Ships waited in the harbour for the tide, their sails folded against the grey sky. " * 60)
    assert cli_main(["prepare", str(documents), "-o", str(tmp_path / "corpus.h5"), "--tokenizer",
                     str(tiny_qwen3_dir)]) == 0
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu_ddp.yaml"),
        str(REPO / "scripts" / "train.py"), "--dataset", "titans_tokens", "--data_files", str(tmp_path / "corpus.h5"),
        "--window_size", "128", "--model_name_or_path", str(tiny_qwen3_dir), "--chunk_size", "32",
        "--memory_chunk_size", "8", "--memory_head_dim", "16", "--output_dir", str(tmp_path / "out"),
        "--gradient_accumulation_steps", "1", "--max_steps", "2", "--save_steps", "1", "--report_to", "none",
        "--disable_tqdm", "true",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf_home")}
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert json.loads((tmp_path / "out" / "training_args.json").read_text())["world_size"] == 2
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(tmp_path / "out" / "checkpoint-2"))
    weights = load_file(tmp_path / "out" / "memory_model.safetensors")
    assert weights and not [name for name in weights if name.startswith(("model.", "lm_head."))]
