"""Train the memory of a TitansQwen: the logic behind `titans-hf train` and `scripts/train.py`.

Two kinds of data, one recipe (`--dataset`):
- a task's builder (`titans_hf.tasks.TASKS`), `titans_babilong` the default: BABILong files, snapshot folders or the
  offline generator. Defaults follow the seed recipe (32768-token rows, chunks of 4096, 64 tokens kept for the
  answer, batch 1 per device, gradient accumulation 8, a log line every 80 batches, a 0.9 train split, a final
  memory checkpoint); `evaluate()` reports the exact match of the answers.
- `titans_tokens`: your own long documents, `titans-hf prepare`d into `seq` or `sft` token stores, read as windows
  of `--window_size` tokens (many chunks each), or `dpo` / `grpo` stores, read as whole records (a prompt and its
  answers; see `titans_hf.training.preference.completions_loss`); held out by `--eval_data_files` or a seeded
  `train_ratio` split.

Single process, or::

    accelerate launch --config_file titans_hf/accelerate/fsdp.yaml scripts/train.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B --data_files babilong/qa1/32k.json --bf16

(`accelerate launch -m titans_hf.commands.train` when the package is installed without the repo.)

Length curriculum, the way RMT/ARMT learned BABILong: give rows of several lengths and the chunk
counts of the stages, e.g. `--data_files qa1/4k.json qa1/8k.json qa1/16k.json qa1/32k.json
--curriculum_chunks 1 2 4 8` (or `--generate_lengths 3500 7500 15500 31500`). Epoch e trains on
the rows of at most `curriculum_chunks[e // curriculum_epochs_per_stage]` chunks; rows are then
left unpadded and each batch is padded to a multiple of `chunk_size` (see ChunkCurriculumSampler).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import datasets
import torch
from transformers import AutoConfig, AutoTokenizer, TrainerCallback, set_seed

from titans_hf.data.tokenizers import check_tokenizer_argument
from titans_hf.data.tokens_builder import check_stores_tokenizer, store_data_files
from titans_hf.modeling import MEMORY_VARIANTS, TitansQwenForCausalLM
from titans_hf.modeling.configuration_titans_qwen import CONV_INITS, TitansMemoryConfig
from titans_hf.modeling.memory import MEMORY_MODELS
from titans_hf.tasks import task_builder_names, task_for_builder

from .trainer import TitansTrainer, answer_exact_match
from .training_args import TitansTrainingArguments

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    """The base model to put a memory on."""

    _argument_group_name = "the base model"  # the group of these flags in `titans-hf train --help`

    model_name_or_path: str = field(metadata={"help": "Base Qwen2/Qwen3: Hub id or local folder."})
    model_revision: str | None = field(default=None, metadata={"help": "Revision of a base on the Hub."})
    dtype: str | None = field(
        default=None, metadata={"help": "dtype the base is loaded in (e.g. bfloat16); default: the checkpoint's."}
    )
    attn_implementation: str | None = field(default=None, metadata={"help": "e.g. sdpa, flash_attention_2."})
    lora_r: int | None = field(default=None, metadata={
        "help": "Train LoRA adapters of this rank on the frozen base together with the memory (titans_hf.lora; "
                "needs titans_hf[peft]); saved as PEFT's adapter files beside the memory. Default: no LoRA."})
    lora_alpha: float = field(default=8.0, metadata={"help": "LoRA's alpha (scale alpha / r; PEFT's default)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch."})
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"], metadata={
        "help": "Linear modules of the base to adapt: names or suffixes (PEFT's target_modules), or all-linear."})
    use_rslora: bool = field(default=False, metadata={"help": "rsLoRA's scale, alpha / sqrt(r)."})


def _memory_arguments() -> type:
    """The memory's flags: every TitansMemoryConfig setting, with its default and help (one source)."""
    settings = set(TitansMemoryConfig.setting_names())
    # the settings named from a registry: a wrong name is a usage error before anything loads
    choices = {"variant": MEMORY_VARIANTS, "memory_model": MEMORY_MODELS, "conv_init": CONV_INITS}
    return dataclasses.make_dataclass(
        "MemoryArguments",
        [(f.name, f.type, dataclasses.field(default=f.default, metadata={
            **f.metadata, **({"choices": sorted(choices[f.name])} if f.name in choices else {})}))
         for f in dataclasses.fields(TitansMemoryConfig) if f.name in settings],
        namespace={"__doc__": "The memory's settings (TitansMemoryConfig fields).", "__module__": __name__,
                   "_argument_group_name": "the memory (saved in memory_config.json)"},
    )


MemoryArguments = _memory_arguments()


TOKENS_DATASET = "titans_tokens"
DATASETS = (*task_builder_names(), TOKENS_DATASET)


@dataclass
class DataArguments:
    """Where the rows come from: BABILong (published parquet / JSON files or snapshot folders, or the offline
    generator at one or more lengths), or token stores of your own documents."""

    _argument_group_name = "the data"

    dataset: str = field(
        default="titans_babilong",
        metadata={"help": f"a task's rows, of {list(task_builder_names())} (titans_babilong: BABILong files or "
                  "generated rows), or titans_tokens (token stores written by titans-hf prepare)."},
    )
    data_files: list[str] | None = field(
        default=None,
        metadata={
            "help": "titans_babilong: BABILong files or folders (input/question/target): the Hub sets' "
            "LENGTH/TASK-0000i-of-0000n.parquet (a downloaded snapshot folder stands for all of them), or "
            "TASK/LENGTH.json / .jsonl, e.g. qa1/32k.json. titans_tokens: .h5 stores and files of .bin stores "
            "(e.g. stores/corpus_bin/*), or store folders."
        },
    )
    eval_data_files: list[str] | None = field(
        default=None,
        metadata={"help": "titans_tokens: held-out stores to evaluate on (default: a seeded share of the windows)."},
    )
    train_type: str = field(default="seq", metadata={
        "help": "titans_tokens: seq or sft (windows), dpo or grpo (whole records: each prompt read once, its answers "
                "scored from the memory state it leaves; DPO against the memory-off model, GRPO on the stored "
                "rewards)."})
    window_size: int | None = field(
        default=None, metadata={"help": "titans_tokens: tokens per training row (a multiple of chunk_size is best)."}
    )
    stride: int | None = field(default=None, metadata={"help": "titans_tokens: tokens between windows (default: "
                                                               "window_size)."})
    respect_document_boundaries: bool = field(
        default=False, metadata={"help": "titans_tokens: keep every window inside one document."}
    )
    pad_tail: bool = field(
        default=False,
        metadata={"help": "titans_tokens: also keep the last, shorter window (of each document, with "
                  "respect_document_boundaries), right-padded to window_size."},
    )
    data_tasks: list[str] | None = field(
        default=None,
        metadata={"help": "With data_files: only these tasks (e.g. qa1 qa2); a single one also labels the files whose "
                  "path does not name a task."},
    )
    data_lengths: list[str] | None = field(
        default=None,
        metadata={"help": "With data_files: only these lengths (labels such as 4k 32k); a single one also labels the "
                  "files whose path does not name a length."},
    )
    generate_lengths: list[int] | None = field(
        default=None,
        metadata={"help": "Without data_files: generate rows whose haystack has these token lengths (one set each)."},
    )
    task: str = field(default="qa1", metadata={"help": "Generated task: qa1, qa2 or qa3 (titans_babilong), passkey or mk "
                                                   "(titans_needle)."})
    num_samples: int = field(default=5000, metadata={"help": "Generated rows per length."})
    haystack_files: list[str] | None = field(
        default=None,
        metadata={"help": "Text files or folders (every *.txt under a folder, in sorted order) for the generated "
                  "haystack (default: built-in prose)."},
    )
    haystack_dataset: str | None = field(
        default=None,
        metadata={"help": "A datasets split for the generated haystack instead: what load_dataset takes as its path "
                  "(json, text, parquet or csv with haystack_data_files, a folder, a Hub id), read streaming."},
    )
    haystack_data_files: list[str] | None = field(
        default=None, metadata={"help": "The files of haystack_dataset (load_dataset's data_files)."}
    )
    haystack_split: str | None = field(default=None,
                                       metadata={"help": "The split of haystack_dataset (default: train)."})
    haystack_column: str = field(default="text", metadata={"help": "The column of haystack_dataset holding the text."})
    generation_seed: int = field(default=0, metadata={"help": "Seed of the generator and of the train/eval split."})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "Default: model_name_or_path."})
    max_length: int = field(default=32768, metadata={"help": "Tokens per row (prompt + answer)."})
    answer_reserve_tokens: int = field(default=64, metadata={"help": "Tokens kept for the answer."})
    truncate_answers: bool = field(
        default=False,
        metadata={"help": "Cut answers longer than the room left after the prompt (counted in the log); by default "
                  "such an answer is an error naming its row."},
    )
    train_ratio: float = field(default=0.9, metadata={"help": "Seeded train share of the rows (without "
                                                                    "eval_data_files); the rest evaluates."})
    pad_to_max_length: bool | None = field(
        default=None,
        metadata={
            "help": "Pad rows to max_length (the seed recipe). Default: yes, unless a curriculum is set, which needs "
            "unpadded rows (the collator pads each batch to a multiple of chunk_size)."
        },
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N training rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N evaluation rows."})


    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset {self.dataset!r} must be one of {list(DATASETS)}")
        if self.dataset == TOKENS_DATASET:
            if not self.data_files:
                raise ValueError("--dataset titans_tokens needs --data_files (token stores written by titans-hf "
                                 "prepare)")
            if self.train_type not in ("seq", "sft", "dpo", "grpo"):
                raise ValueError(f"--train_type {self.train_type!r} must be seq, sft, dpo or grpo")
            records = self.train_type in ("dpo", "grpo")
            if self.window_size is None and not records:
                raise ValueError("--dataset titans_tokens needs --window_size (tokens per training row)")
            if records and (self.window_size is not None or self.stride is not None or self.pad_tail
                            or self.respect_document_boundaries):
                raise ValueError(f"--train_type {self.train_type} reads whole records: --window_size, --stride, "
                                 "--pad_tail and --respect_document_boundaries are for seq and sft windows")


@dataclass
class RecipeTrainingArguments(TitansTrainingArguments):
    _argument_group_name = "training (transformers.TrainingArguments, plus log_every_batches, curriculum_chunks, hub_*)"

    output_dir: str | None = field(
        default="outputs/titans_memory",
        metadata={"help": "Checkpoints go to checkpoint-N below it, the final memory into it."},
    )


def load_token_splits(data_args: DataArguments, vocab_size: int, tokenizer: Any = None
                      ) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Train and evaluation windows of the `titans_tokens` builder: `eval_data_files` as the held-out split, else a
    seeded `train_ratio` share of the windows. Ids at or above the model's `vocab_size` are refused, and so is a
    store prepared with another tokenizer than `tokenizer` (by its vocabulary size and fingerprint)."""
    common = dict(train_type=data_args.train_type, window_size=data_args.window_size, stride=data_args.stride,
                  respect_document_boundaries=data_args.respect_document_boundaries, pad_tail=data_args.pad_tail,
                  vocab_size=vocab_size)
    files = {"train": store_data_files(data_args.data_files, "--data_files")}
    if data_args.eval_data_files:
        files["validation"] = store_data_files(data_args.eval_data_files, "--eval_data_files")
    if tokenizer is not None:
        check_stores_tokenizer([file for split in files.values() for file in split], tokenizer,
                               "the tokenizer of this run (--tokenizer_name_or_path, else the base's)")
    windows = datasets.load_dataset("titans_tokens", data_files=files, **common)
    train = windows["train"]
    if "validation" in windows:
        evaluation = windows["validation"]
    else:
        training = int(data_args.train_ratio * len(train))  # what train_test_split keeps for training
        if not 0 < training < len(train):
            rows = ("record" if data_args.train_type in ("dpo", "grpo") else "window") + "s" * (len(train) != 1)
            raise ValueError(f"--data_files {', '.join(files['train'])}: {len(train)} {data_args.train_type} {rows}, "
                             f"too few to set a --train_ratio {data_args.train_ratio} share of them apart for "
                             f"evaluation ({training} would train, {len(train) - training} evaluate); give more, or "
                             "the evaluation rows with --eval_data_files")
        split = train.train_test_split(train_size=data_args.train_ratio, seed=data_args.generation_seed)
        train, evaluation = split["train"], split["test"]
    if data_args.max_train_samples is not None:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    if data_args.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(data_args.max_eval_samples, len(evaluation))))
    return train, evaluation


def add_lora_from_arguments(model: TitansQwenForCausalLM, model_args: ModelArguments) -> None:
    """The LoRA of `--lora_r` and its flags on the model's base (`titans_hf.lora.add_lora`)."""
    if model_args.lora_r < 1:
        raise ValueError(f"--lora_r must be a rank >= 1, got {model_args.lora_r}")
    try:
        from peft import LoraConfig

        from titans_hf.lora import add_lora
    except ImportError as error:
        raise ImportError(f"--lora_r needs PEFT: pip install 'titans_hf[peft]' ({error})") from error
    targets = model_args.lora_target_modules
    add_lora(model, LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                               lora_dropout=model_args.lora_dropout, use_rslora=model_args.use_rslora,
                               target_modules="all-linear" if targets == ["all-linear"] else targets))


def train_memory(
    model_args: ModelArguments,
    memory_args: MemoryArguments,
    data_args: DataArguments,
    training_args: TitansTrainingArguments,
    callbacks: list[TrainerCallback] | None = None,
) -> TitansTrainer:
    """Build rows and model, train (resuming if asked), write the final memory into `output_dir`."""
    check_tokenizer_argument(model_args.model_name_or_path, "--model_name_or_path")
    tokenizer_name = data_args.tokenizer_name_or_path or model_args.model_name_or_path
    if data_args.tokenizer_name_or_path:
        check_tokenizer_argument(data_args.tokenizer_name_or_path, "--tokenizer_name_or_path")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name, trust_remote_code=False)
    # Rank 0 builds the Arrow cache; the other ranks then read it instead of racing to write it.
    with training_args.main_process_first(desc=f"building {data_args.dataset} rows"):
        if data_args.dataset == TOKENS_DATASET:
            base_config = AutoConfig.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                                     trust_remote_code=False)
            train_rows, eval_rows = load_token_splits(data_args, base_config.vocab_size, tokenizer)
        else:
            pad_to_max_length = data_args.pad_to_max_length
            if pad_to_max_length is None:
                pad_to_max_length = training_args.curriculum_chunks is None
            train_rows, eval_rows = task_for_builder(data_args.dataset).training_splits(
                data_args, tokenizer_name, pad_to_max_length)

    set_seed(training_args.seed)  # the memory's initial weights: the same on every run of the same arguments
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    model = TitansQwenForCausalLM.from_base(
        model_args.model_name_or_path,
        TitansMemoryConfig(**dataclasses.asdict(memory_args)),
        revision=model_args.model_revision,
        dtype=dtype,
        attn_implementation=model_args.attn_implementation,
    )
    if model_args.lora_r is not None:
        add_lora_from_arguments(model, model_args)
    trainer = TitansTrainer(
        model=model,
        args=training_args,
        train_dataset=train_rows,
        eval_dataset=eval_rows,
        processing_class=tokenizer,
        callbacks=callbacks,
        compute_metrics=None if data_args.dataset == TOKENS_DATASET else answer_exact_match,
    )
    resume = training_args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume == "last" else resume)
    trainer.save_model()
    return trainer
