"""The CPU demo (`titans-hf demo`, `scripts/demo.sh`): the user's recipe (a pretrained Qwen, frozen, learns to use a
Titans memory) run offline on a CPU.

It needs no download, so it has two stages:

a. **A toy Qwen3 base.** A small Qwen3 is trained as an ordinary causal LM with full attention (no memory, no
   chunks) on the task's kind of text: prose, prose about the story's people and places, and bAbI stories with
   questions and answers. It is saved with ``save_pretrained`` (weights, config, tokenizer) in ``base/``, a
   folder like any downloaded Qwen. Its own full-attention accuracy on stories that fit one chunk is reported.
b. **The user's recipe, unchanged.** BABILong files are written to ``data/``; the code behind ``titans-hf train``
   (:func:`titans_hf.training.recipe.train_memory`) loads them with
   ``load_dataset("titans_babilong")``, loads ``base/`` frozen and trains only the memory, then saves it to
   ``memory/``; the function behind ``titans-hf eval`` reloads that folder and scores it with the memory on and
   off. The base's weights are checked bitwise against ``base/`` after training.

``--model`` (a Qwen folder or Hub id) skips stage a. Outputs (``outputs/demo/`` by default): ``base/``,
``data/``, ``memory/``, ``results.json``, ``heatmap.png``, ``predictions.jsonl``, ``loss.png``, ``run.json``.
Why the recipe looks the way it does is measured in ``docs/frozen_base.md``.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from titans_hf.files import atomic_write, atomic_write_json, file_sha256
from titans_hf.outputs import writing_folder
from titans_hf.tasks.babilong import (
    ACTORS,
    LOCATIONS,
    MOVE_VERBS,
    OBJECTS,
    PROMPT_TEMPLATE,
    World,
    distractor_sentence,
    generate_babilong,
    random_fact,
    random_question,
    write_babilong_json,
)
from titans_hf.tasks.babilong.evaluation import (
    DISTANCE_PLOT_NAME,
    OUTPUT_NAMES as EVALUATION_OUTPUT_NAMES,
    evaluate_babilong,
    load_model_for_eval,
)
from titans_hf.tasks.recall.toy_base import TOY_BASE_SHAPE
from titans_hf.testing_utils import build_qwen, build_tokenizer, mean_embedding_cosine, pretrain_causal_lm
from titans_hf.training.recipe import (
    DataArguments,
    MemoryArguments,
    ModelArguments,
    RecipeTrainingArguments,
    train_memory,
)

logger = logging.getLogger(__name__)

BASE_DIR_NAME = "base"
DATA_DIR_NAME = "data"
MEMORY_DIR_NAME = "memory"
LOSS_PLOT_NAME = "loss.png"
RUN_INFO_NAME = "run.json"

# Stage a's BABILong rows: bare stories and stories in a haystack of this many chunks (its rows are cut to 160 tokens:
# a longer haystack would only cut more stories short; qa2 and qa3 stories need 4)
PRETRAIN_HAYSTACK_CHUNKS = {"qa1": 3, "qa2": 4, "qa3": 4}
# Memory settings of the recipe; variant, layer and depth are TitansQwenConfig's defaults (mag on the middle layer,
# depth 1), chosen with scripts/bench_frozen.py. See docs/frozen_base.md.
MEMORY_SETTINGS = dict(
    memory_num_heads=4,
    memory_head_dim=16,
    conv_kernel=6,  # spans "Mary went back to the kitchen" and "Mary? \nAnswer:"
    memory_chunk_size=8,
    checkpoint_chunks=False,  # a few hundred tokens: recomputation would only cost time
    # chunk-local attention: with memory off, no chunk sees another, so the ablation shows what the memory carries
    attend_previous_chunk=False,
)

# What people and places are like, in the toy base's pretraining text. In real text every name has contexts of
# its own; in the bAbI stories alone the four actors (and the six places) are interchangeable, and a model trained on
# them learns one embedding for all four: its memory could then not tell whose fact it stores.
ENTITY_TRAITS: dict[str, list[str]] = {
    "John": ["John fixed the old fence with nails", "John the carpenter sawed a plank of oak",
             "John whistled while he mended the roof", "John sharpened his chisel"],
    "Mary": ["Mary baked a loaf of bread", "Mary the baker kneaded the dough", "Mary sang while the oven warmed",
             "Mary dusted flour from her apron"],
    "Sandra": ["Sandra read a book of poems", "Sandra the teacher marked the essays", "Sandra wrote a letter in ink",
               "Sandra opened the old atlas"],
    "Daniel": ["Daniel fed the horses", "Daniel the farmer ploughed the field", "Daniel milked the brown cow",
               "Daniel carried hay to the barn"],
    "bathroom": ["The bathroom smelled of soap", "Water dripped from the tap in the bathroom",
                 "The bathroom mirror was fogged"],
    "bedroom": ["The bedroom had a soft quilt", "A pillow lay on the bed in the bedroom",
                "The bedroom curtains were drawn"],
    "garden": ["The garden was full of roses", "Bees hummed over the garden", "The garden path was lined with tulips"],
    "hallway": ["The hallway was long and narrow", "Coats hung along the hallway", "The hallway floor creaked"],
    "kitchen": ["The kitchen smelled of soup", "Pots hung above the stove in the kitchen",
                "The kitchen table was set for dinner"],
    "office": ["The office was full of papers", "A typewriter clattered in the office", "The office desk held a lamp"],
    "football": ["The football was scuffed from the match", "The football bounced off the wall"],
    "apple": ["The apple was red and ripe", "The apple had a small bruise"],
    "milk": ["The milk was fresh from the farm", "The milk stood cold in a jug"],
}


def entity_sentence(rng: random.Random) -> str:
    """A sentence about one of the story's people, places or objects."""
    return rng.choice(ENTITY_TRAITS[rng.choice(sorted(ENTITY_TRAITS))]) + "."


def domain_documents(task: str, num_documents: int, characters: int = 400, entity_share: float = 0.5,
                     seed: int = 0) -> list[str]:
    """Documents of the toy base's pretraining text: sentences about the story's people, places and objects
    (`entity_share` of the sentences), distractor prose (a fifth) and the facts of one bAbI story (the rest), its
    questions asked and answered in BABILong's prompt format as the story unfolds (after three sentences in ten,
    once someone has moved)."""
    if not 0 <= entity_share <= 0.8:
        raise ValueError(f"domain_documents: entity_share={entity_share} must lie in [0, 0.8] (a fifth is prose)")
    rng = random.Random(f"titans_hf.demo.documents:{task}:{seed}")
    documents = []
    for _ in range(num_documents):
        world, parts = World(), []
        while len(" ".join(parts)) < characters:
            roll = rng.random()
            if roll < entity_share:
                parts.append(entity_sentence(rng))
            elif roll < entity_share + 0.2:
                parts.append(distractor_sentence(rng))
            else:
                parts.append(random_fact(task, world, rng))
            asked = random_question(task, world, rng) if world.actor_location and rng.random() < 0.3 else None
            if asked is not None:
                question, answer = asked
                parts.append(PROMPT_TEMPLATE.format(input="", question=question) + f" {answer}\n\n")
        documents.append(" ".join(parts).replace("\n\n ", "\n\n"))
    return documents


def mixed_haystack_rows(task: str, num_samples: int, length: int, tokenizer, seed: int,
                        haystacks: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """BABILong rows whose haystacks are shared out between the built-in prose and each of `haystacks` (files or
    folders), in equal parts, in seeded order; without `haystacks`, `generate_babilong`'s rows as they are."""
    sources: list[str | None] = [None, *haystacks]
    rows = []
    for index, source in enumerate(sources):
        share = num_samples // len(sources) + (index < num_samples % len(sources))
        rows += generate_babilong(task, share, length, tokenizer, seed=seed + 7919 * index,
                                  haystack_files=None if source is None else [source])
    if haystacks:
        random.Random(seed).shuffle(rows)
    return rows


def build_demo_tokenizer(out_dir: str | Path, vocab_size: int = 1024, seed: int = 0):
    """A byte-level BPE tokenizer trained on the demo's own kind of text.

    Every actor, location, object and question word is one token: the memory then binds one token to one token,
    and a place is one answer token.
    """
    texts = domain_documents("qa2", 2000, seed=seed)
    # every fact of every task and every entity sentence, so none of their words is split
    texts += [f"{actor} {verb} the {location}." for actor in ACTORS for verb in MOVE_VERBS for location in LOCATIONS]
    texts += [f"{actor} took the {obj}." for actor in ACTORS for obj in OBJECTS]
    texts += [sentence for sentences in ENTITY_TRAITS.values() for sentence in sentences]
    return build_tokenizer(texts, out_dir, vocab_size=vocab_size)


def pretrain_base(
    base_dir: str | Path,
    tokenizer,
    task: str = "qa1",
    steps: int = 800,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    max_tokens: int = 160,
    haystack_lengths: tuple[int, ...] = (0, 96),
    entity_share: float = 0.5,
    seed: int = 0,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Stage a: train a small Qwen3 on `domain_documents` as an ordinary causal LM with full attention, with the
    plain `transformers.Trainer`, and save it with its tokenizer in `base_dir`. Returns what was done.

    Rows are at most `max_tokens` long, so the base learns positions a few chunks long."""
    model = build_qwen(base_dir, vocab_size=len(tokenizer), family="qwen3", seed=seed,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **TOY_BASE_SHAPE)
    # about one row in two a document, the rest BABILong rows with their answers (`haystack_lengths`: bare stories
    # and stories in a short haystack)
    rows_needed = steps * batch_size
    documents = domain_documents(task, rows_needed // 2, entity_share=entity_share, seed=seed)
    for index, length in enumerate(haystack_lengths):
        rows = generate_babilong(task, rows_needed // (2 * len(haystack_lengths)), length, tokenizer,
                                 seed=10_000 + 10 * seed + index)
        documents += [PROMPT_TEMPLATE.format(**row) + f" {row['target']}" for row in rows]
    random.Random(seed).shuffle(documents)
    losses = pretrain_causal_lm(model, tokenizer, documents, base_dir, steps, batch_size=batch_size,
                                learning_rate=learning_rate, max_tokens=max_tokens, seed=seed,
                                show_progress=show_progress)
    return {"steps": steps, "documents": len(documents), "final_loss": losses[-1],
            "shape": TOY_BASE_SHAPE, "entity_share": entity_share,
            "embedding_similarity": embedding_similarity(model, tokenizer)}


def embedding_similarity(model, tokenizer) -> dict[str, float]:
    """Mean cosine similarity between the input embeddings of the actors, and between those of the locations.

    Near 1, the model holds one vector for all of them: a memory reading these embeddings cannot tell whose fact
    it stores. A base that learned text in which each name has contexts of its own keeps them apart.
    """
    return {"actors": round(mean_embedding_cosine(model, tokenizer, ACTORS), 4),
            "locations": round(mean_embedding_cosine(model, tokenizer, LOCATIONS), 4)}


def base_accuracy(base: str | Path, tokenizer, task: str, chunk_size: int, num_rows: int = 200,
                  seed: int = 900) -> dict[str, Any]:
    """The plain base (full attention) on bare stories: what it can do in context. Only stories whose prompt fits
    one chunk count, unless the task has none (qa3's stories are longer): then every bare story counts, and
    `fits_one_chunk` says so."""
    model = AutoModelForCausalLM.from_pretrained(base, trust_remote_code=False, use_safetensors=True)
    stories = generate_babilong(task, 4 * num_rows, 0, tokenizer, seed=seed)
    rows = [row for row in stories if len(tokenizer(PROMPT_TEMPLATE.format(**row))["input_ids"]) <= chunk_size]
    fits_one_chunk = bool(rows)
    rows = (rows or stories)[:num_rows]
    results = evaluate_babilong(model, tokenizer, {(task, 0): rows}, max_new_tokens=3, batch_size=64,
                                ablation=False, show_progress=False)
    cell = results["details"][task]["0"]
    return {"rows": len(rows), "fits_one_chunk": fits_one_chunk, "max_prompt_tokens": cell["prompt_tokens"]["max"],
            "exact_match": cell["memory"]["exact_match"], "last_location_baseline": cell["last_location_baseline"],
            "chance": cell["chance"]}


def write_training_files(data_dir: str | Path, rows_by_length: dict[int, list[dict[str, str]]], task: str
                         ) -> list[Path]:
    """BABILong JSON files (input / question / target), one per input length in tokens (0: bare stories)."""
    return [write_babilong_json(rows, Path(data_dir) / task / f"train_{length}.json")
            for length, rows in rows_by_length.items()]


def row_chunks(rows: Sequence[Mapping[str, str]], tokenizer, chunk_size: int) -> list[int]:
    """Chunks each BABILong row fills as a training example (prompt and answer)."""
    texts = [PROMPT_TEMPLATE.format(**row) + f" {row['target']}" for row in rows]
    return [math.ceil(len(ids) / chunk_size) for ids in tokenizer(texts)["input_ids"]]


def base_weights_unchanged(model, base_dir: str | Path) -> bool:
    """Every tensor of the base's safetensors file equals, bit for bit, the trained model's tensor of that name."""
    saved = {}
    for file in sorted(Path(base_dir).glob("*.safetensors")):
        saved.update(load_file(str(file)))
    state = model.state_dict()
    return bool(saved) and all(name in state and torch.equal(state[name].cpu(), tensor)
                               for name, tensor in saved.items())


def plot_loss_curve(log_history: list[dict[str, Any]], path: str | Path, steps_per_epoch: int,
                    stage_chunks: list[int]) -> Path:
    """Training loss per logged step, with the curriculum's stage changes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    points = [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry and "step" in entry]
    if not points:
        raise ValueError("plot_loss_curve: the log history holds no loss (train at least logging_steps steps)")
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot([s for s, _ in points], [loss for _, loss in points], marker=".", linewidth=1)
    axis.set_yscale("log")
    axis.yaxis.set_major_locator(FixedLocator([0.05, 0.1, 0.2, 0.5, 1, 2, 5]))
    axis.yaxis.set_major_formatter(FormatStrFormatter("%g"))  # 0.1, 1 rather than 10^-1, 10^0
    axis.yaxis.set_minor_formatter(NullFormatter())
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("answer loss (cross-entropy)")
    axis.axhline(math.log(len(LOCATIONS)), color="grey", linestyle=":", label="chance among the 6 places")
    for stage, chunks in enumerate(stage_chunks[1:], start=1):
        axis.axvline(stage * steps_per_epoch, color="tab:orange", linestyle="--", linewidth=1)
        axis.text(stage * steps_per_epoch, axis.get_ylim()[1], f" rows of up to {chunks} chunks", va="top", ha="right",
                  rotation=90, fontsize=7, color="tab:orange")
    axis.legend(loc="lower left", fontsize=8)
    axis.set_title("BABILong with Titans memory on a frozen base: training loss")
    atomic_write(path, lambda temporary: figure.savefig(temporary, format="png", dpi=120, bbox_inches="tight"))
    plt.close(figure)
    return Path(path)


@dataclass
class DemoSettings:
    """What a demo trains and measures: the flags of ``titans-hf demo``.

    Lengths are given in chunks of the input (the question comes after it); `train_chunks` 0 means bare stories.
    The first epoch trains on rows of one chunk (bare stories); with `staged_curriculum` each later epoch admits the
    rows of the next trained length until all are in, else the second epoch admits them all at once. A
    `state_passing` share of the training rows start from the memory state another row ended in (State Passing,
    see `TitansTrainingArguments`). With `haystacks` (text files or folders), the training rows' haystacks are shared
    out between the built-in prose and each of them (`mixed_haystack_rows`), so that the memory learns to write little
    on prose in general, not on one text; the base and the evaluation rows are unchanged. Evaluation rows come from
    other generator seeds than training rows. `memory_settings` override `MEMORY_SETTINGS` (and the TitansQwenConfig
    defaults: variant, memory_layers, ...).

    Args:
        base: a pretrained Qwen2/Qwen3 (local folder or Hub id) used as the frozen base; None: stage a pretrains the
            toy base.
        pretrain_steps, entity_share: stage a's steps and share of sentences about the story's people and places.
        num_train_samples, num_eval_samples: rows per trained and per evaluated length.
    """

    base: str | None = None
    task: str = "qa1"
    chunk_size: int = 32
    train_chunks: tuple[int, ...] = (0, 4, 8, 16, 32)
    eval_chunks: tuple[int, ...] = (4, 256, 1024)
    pretrain_steps: int = 800
    entity_share: float = 0.5
    num_train_samples: int = 1000
    num_eval_samples: int = 200
    epochs: int = 11
    batch_size: int = 32
    learning_rate: float = 3e-3
    max_steps: int = -1
    staged_curriculum: bool = True
    state_passing: float = 0.5
    haystacks: tuple[str, ...] = ()
    memory_settings: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.train_chunks or not self.eval_chunks:
            raise ValueError("demo: train_chunks and eval_chunks must each name at least one length")
        if min(self.train_chunks) < 0 or min(self.eval_chunks) < 1:
            raise ValueError(f"demo: train_chunks {self.train_chunks} must be >= 0 and eval_chunks "
                             f"{self.eval_chunks} >= 1")

    @property
    def train_lengths(self) -> list[int]:
        """The trained input lengths in tokens."""
        return [chunks * self.chunk_size for chunks in self.train_chunks]

    @property
    def eval_lengths(self) -> list[int]:
        """The evaluated input lengths in tokens."""
        return [chunks * self.chunk_size for chunks in self.eval_chunks]


@dataclass
class TrainingData:
    """The training rows a demo wrote: one BABILong JSON file per trained length (`files`), the curriculum's stages
    in chunks (`curriculum_chunks`: one chunk, then the longest row of each trained length with a staged curriculum,
    and the longest of all) and the number of rows (`num_rows`)."""

    files: list[Path]
    curriculum_chunks: list[int]
    num_rows: int


def run_demo(output_dir: str | Path = "outputs/demo", settings: DemoSettings | None = None, overwrite: bool = False,
             threads: int | None = 1, show_progress: bool = True) -> dict[str, Any]:
    """Stage a (unless `settings.base` names a base), then stage b: the rows, the memory's training, its evaluation
    and the report; returns results, run info, paths and the trained model.

    Everything goes into `output_dir`, which must be absent, empty, or (with `overwrite`) a folder an earlier demo
    wrote, whose outputs it replaces; a run that fails leaves what was there. Files of the user's beside the outputs
    are left alone and not recorded as the demo's. `threads`: torch's threads (None: as they are).
    """
    settings = DemoSettings() if settings is None else settings
    started = time.time()
    if threads is not None:
        torch.set_num_threads(threads)
    # written in place (the memory records its base's absolute path), checked before any work: an earlier demo's
    # outputs are replaced only with `overwrite`, a user's folder or file never; a failed run leaves the old outputs
    outputs = ((BASE_DIR_NAME,) if settings.base is None else ()) + (DATA_DIR_NAME, MEMORY_DIR_NAME, LOSS_PLOT_NAME,
                                                                      RUN_INFO_NAME, *EVALUATION_OUTPUT_NAMES)
    with writing_folder(output_dir, overwrite, "titans-hf demo", outputs=outputs) as output:
        set_seed(settings.seed)
        timings: dict[str, float] = {}
        run_info: dict[str, Any] = {"task": settings.task, "seed": settings.seed, "chunk_size": settings.chunk_size}
        if settings.base is None:
            run_info["pretraining"] = pretrain_toy_base(settings, output / BASE_DIR_NAME, show_progress)
            base = str(output / BASE_DIR_NAME)
            timings["stage_a_s"] = time.time() - started
            logger.info("stage a: toy base pretrained in %.0fs (%d steps), saved to %s", timings["stage_a_s"],
                        run_info["pretraining"]["steps"], base)
        else:
            base = settings.base
        tokenizer = AutoTokenizer.from_pretrained(base, trust_remote_code=False)
        run_info["base"] = base
        run_info["base_accuracy"] = base_accuracy(base, tokenizer, settings.task, settings.chunk_size,
                                                  seed=900 + settings.seed)
        logger.info("base, full attention, on %d bare stories: %.1f%% exact match (chance %.1f%%)",
                    run_info["base_accuracy"]["rows"], 100 * run_info["base_accuracy"]["exact_match"],
                    100 * run_info["base_accuracy"]["chance"])

        stage_b_started = time.time()
        base_files = sorted(Path(base).glob("*.safetensors")) if Path(base).is_dir() else []
        hashes_before = {file.name: file_sha256(file) for file in base_files}
        data = write_training_data(settings, tokenizer, output / DATA_DIR_NAME)
        trainer = train_demo_memory(settings, base, data, output / MEMORY_DIR_NAME, show_progress)
        timings["stage_b_train_s"] = time.time() - stage_b_started
        run_info.update(trained_parameters(trainer.model))
        if base_files:
            run_info["base_unchanged"] = (base_weights_unchanged(trainer.model, base)
                                          and {f.name: file_sha256(f) for f in base_files} == hashes_before)
        plot_loss_curve(trainer.state.log_history, output / LOSS_PLOT_NAME,
                        math.ceil(len(trainer.train_dataset) / settings.batch_size), data.curriculum_chunks)

        eval_started = time.time()
        results = evaluate_demo_memory(settings, output, base, tokenizer, show_progress)
        timings["eval_s"] = time.time() - eval_started
        timings["total_s"] = time.time() - started
        run_info.update(training_report(settings, data, trainer, timings))
        atomic_write_json(output / RUN_INFO_NAME, run_info)
        return {"results": results, "run_info": run_info, "model": trainer.model, "tokenizer": tokenizer,
                "paths": demo_paths(output, settings, data)}


def pretrain_toy_base(settings: DemoSettings, base_dir: Path, show_progress: bool) -> dict[str, Any]:
    """Stage a: the demo's tokenizer and the toy base pretrained on the rows stage b trains on (bare stories and
    stories in a short haystack), both saved in `base_dir`; returns what `pretrain_base` did."""
    tokenizer = build_demo_tokenizer(base_dir, seed=settings.seed)
    haystack_lengths = (0, PRETRAIN_HAYSTACK_CHUNKS[settings.task] * settings.chunk_size)
    return pretrain_base(base_dir, tokenizer, task=settings.task, steps=settings.pretrain_steps,
                         haystack_lengths=haystack_lengths, entity_share=settings.entity_share, seed=settings.seed,
                         show_progress=show_progress)


def write_training_data(settings: DemoSettings, tokenizer, data_dir: Path) -> TrainingData:
    """Stage b's training rows, one BABILong JSON file per trained length in `data_dir`, and the curriculum over
    them: the shortest rows first (bare stories of one chunk), then every row, or with `staged_curriculum` one length
    more each epoch (1 chunk, then up to the rows of each trained length in turn)."""
    rows_by_length = {length: mixed_haystack_rows(settings.task, settings.num_train_samples, length, tokenizer,
                                                  seed=1000 * settings.seed + 100 + index,
                                                  haystacks=settings.haystacks)
                      for index, length in enumerate(settings.train_lengths)}
    files = write_training_files(data_dir, rows_by_length, settings.task)
    chunks_by_length = {length: row_chunks(rows, tokenizer, settings.chunk_size)
                        for length, rows in rows_by_length.items()}
    chunks = [count for counts in chunks_by_length.values() for count in counts]
    stages = sorted({min(chunks), max(chunks)} | ({max(counts) for counts in chunks_by_length.values()}
                                                  if settings.staged_curriculum else set()))
    return TrainingData(files=files, curriculum_chunks=stages, num_rows=len(chunks))


def train_demo_memory(settings: DemoSettings, base: str, data: TrainingData, memory_dir: Path, show_progress: bool):
    """Stage b's training: the arguments of ``titans-hf train`` for the demo's rows and settings, and
    `train_memory` on them (the frozen base, the memory saved to `memory_dir`); returns the trainer."""
    model_args = ModelArguments(model_name_or_path=base)
    memory_args = MemoryArguments(chunk_size=settings.chunk_size, **{**MEMORY_SETTINGS, **settings.memory_settings})
    data_args = DataArguments(data_files=[str(path) for path in data.files],
                              max_length=(max(data.curriculum_chunks) + 1) * settings.chunk_size,
                              answer_reserve_tokens=16, generation_seed=settings.seed)
    # the builder keeps `train_ratio` of the rows for training; the exact count is known once it has split them
    planned_steps = (settings.max_steps if settings.max_steps > 0
                     else settings.epochs * math.ceil(data_args.train_ratio * data.num_rows / settings.batch_size))
    training_args = RecipeTrainingArguments(
        output_dir=str(memory_dir),
        per_device_train_batch_size=settings.batch_size,
        gradient_accumulation_steps=1,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=30,
        weight_decay=0.0,
        max_grad_norm=1.0,
        num_train_epochs=settings.epochs,
        max_steps=settings.max_steps,
        curriculum_chunks=data.curriculum_chunks,
        curriculum_epochs_per_stage=1,
        state_passing=settings.state_passing,
        log_every_batches=max(1, min(20, planned_steps // 25)),  # a loss curve even for a few steps
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=settings.seed,
        dataloader_num_workers=0,
        disable_tqdm=not show_progress,
    )
    return train_memory(model_args, memory_args, data_args, training_args)


def trained_parameters(model) -> dict[str, Any]:
    """The trained model's trainable (memory) parameters, beside all of them."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable_parameters": {"memory": trainable, "total": total, "share": trainable / total}}


def evaluate_demo_memory(settings: DemoSettings, output: Path, base: str, tokenizer, show_progress: bool
                         ) -> dict[str, Any]:
    """Stage b's evaluation of what was saved (the folder a user pushes is the one measured), on rows of other
    generator seeds than training's; writes the evaluation's outputs into `output` and returns its results."""
    reloaded, _ = load_model_for_eval(output / MEMORY_DIR_NAME, tokenizer=base)
    rows_by_length = {length: generate_babilong(settings.task, settings.num_eval_samples, length, tokenizer,
                                                 seed=1000 * settings.seed + 500 + index)
                      for index, length in enumerate(settings.eval_lengths)}
    return evaluate_babilong(reloaded, tokenizer, {(settings.task, length): rows
                                                   for length, rows in rows_by_length.items()},
                             max_new_tokens=3, batch_size=64, output_dir=output, show_progress=show_progress,
                             trained_length=max(settings.train_lengths))


def training_report(settings: DemoSettings, data: TrainingData, trainer, timings: dict[str, float]
                    ) -> dict[str, Any]:
    """What `run.json` records of stage b: the memory's settings, the lengths, the training and the timings."""
    return {
        "memory_settings": trainer.model.config.memory_config.memory_settings(),
        "train_lengths": settings.train_lengths,
        "eval_lengths": settings.eval_lengths,
        "num_train_rows": len(trainer.train_dataset),
        "curriculum_chunks": data.curriculum_chunks,
        "training_loss": [[entry["step"], entry["loss"]] for entry in trainer.state.log_history
                          if "loss" in entry and "step" in entry],
        "steps": trainer.state.global_step,
        "epochs": settings.epochs,
        "batch_size": settings.batch_size,
        "learning_rate": settings.learning_rate,
        "state_passing": settings.state_passing,
        "haystacks": list(settings.haystacks),
        "write_cost_growth": [trainer.args.write_cost_growth, trainer.args.write_cost_growth_span],
        "threads": torch.get_num_threads(),
        "timings": {key: round(value, 1) for key, value in timings.items()},
    }


def demo_paths(output: Path, settings: DemoSettings, data: TrainingData) -> dict[str, Any]:
    """Where the demo's outputs are (`base` None where it took a given base)."""
    return {
        "results": output / "results.json",
        "heatmap": output / "heatmap.png",
        "distance_plot": output / DISTANCE_PLOT_NAME,
        "predictions": output / "predictions.jsonl",
        "loss_curve": output / LOSS_PLOT_NAME,
        "run_info": output / RUN_INFO_NAME,
        "base": output / BASE_DIR_NAME if settings.base is None else None,
        "data": data.files,
        "memory": output / MEMORY_DIR_NAME,
    }
