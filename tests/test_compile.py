"""`compile_chunks()`: the chunk step under torch.compile(fullgraph=True) equals the eager model.

The suite compiles with the `aot_eager` backend: dynamo's trace and AOTAutograd's forward / backward split, the path
inductor takes, without inductor's code generation (31-46 s for the CPU demo's model, forward only, on a 2-core CPU;
`scripts/bench_model.py --compile` measures it). `fullgraph=True` turns any graph break into an error, so a break
fails these tests. Each test starts from an empty compile cache (`torch.compiler.reset()`), so what it counts is its
own."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend  # counts the graphs compiled (torch's own test helper)
from transformers import Qwen3Config, Qwen3ForCausalLM

from titans_hf.modeling import TitansQwenConfig, TitansQwenForCausalLM, TitansQwenModel

CHUNK = 8


@pytest.fixture(autouse=True)
def empty_compile_cache():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def tiny_model(**memory_settings) -> TitansQwenForCausalLM:
    """Two Qwen3 layers, a memory on the second (its default), chunks of 8 attending to the previous chunk, memory
    updates of 4 tokens; W_O off its zero init so that the memory's read reaches the logits."""
    torch.manual_seed(0)
    text = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    text._attn_implementation = "sdpa"
    config = TitansQwenConfig(text_config=text, memory_config=dict(
        chunk_size=CHUNK, memory_chunk_size=4, memory_num_heads=2, memory_head_dim=16, freeze_base=False,
        **memory_settings))
    config._attn_implementation = "sdpa"
    model = TitansQwenForCausalLM(config, backbone=Qwen3ForCausalLM(text))
    with torch.no_grad():
        for block in model.memory.values():
            block.output_weight.normal_(std=0.5)
    return model


def padded_batch(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows: the second left-padded by a whole chunk (a chunk that must write nothing to its memory) and both
    right-padded by two tokens."""
    ids = torch.randint(1, 64, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :CHUNK] = 0
    mask[:, -2:] = 0
    return ids, mask


def training_step(model: TitansQwenForCausalLM, ids: torch.Tensor, mask: torch.Tensor):
    """(logits, loss, every gradient) of one forward + backward with labels."""
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), logits_to_keep=ids.shape[1])
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()
                                                    if p.grad is not None}


def assert_same_step(compiled, eager) -> None:
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-6, atol=1e-6)
    assert compiled[2].keys() == eager[2].keys()
    assert any(name.startswith("model.memory.") for name in eager[2])
    for name in eager[2]:
        torch.testing.assert_close(compiled[2][name], eager[2][name], rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_chunk_step_equals_eager_without_a_graph_break_or_a_recompile_per_chunk(one_thread):
    """Training as the recipe runs it: each chunk checkpointed (recomputed, compiled, in backward)."""
    model = tiny_model(checkpoint_chunks=True).train()
    short, longer = padded_batch(5 * CHUNK + 3, seed=1), padded_batch(12 * CHUNK + 3, seed=2)
    eager = [training_step(model, *batch) for batch in (short, longer)]

    graphs = CompileCounterWithBackend("aot_eager")
    model.compile_chunks(backend=graphs)
    assert_same_step(training_step(model, *short), eager[0])
    # three graphs: the first chunk (no previous chunk to attend to), the chunks after it, the last partial chunk
    assert graphs.frame_count == 3
    with torch.compiler.set_stance("fail_on_recompile"):  # more chunks, the same partial tail: nothing new
        assert_same_step(training_step(model, *longer), eager[1])
    assert graphs.frame_count == 3

    model.compile_chunks(enable=False)
    assert_same_step(training_step(model, *short), eager[0])
    assert graphs.frame_count == 3
    model.compile_chunks(backend=graphs)  # on again with the same options: the graphs compiled so far
    with torch.compiler.set_stance("fail_on_recompile"):
        assert_same_step(training_step(model, *short), eager[0])
    assert graphs.frame_count == 3


def test_compiled_chunks_generate_as_eager(one_thread):
    """The prefill's chunks run compiled (no gradient: graphs of their own), decoding's tokens that continue a
    chunk eagerly: the same greedy tokens."""
    model = tiny_model().eval()
    ids = torch.randint(1, 64, (1, 3 * CHUNK + 5), generator=torch.Generator().manual_seed(3))
    settings = dict(max_new_tokens=2 * CHUNK, do_sample=False, pad_token_id=0)
    eager = model.generate(ids, **settings)
    graphs = CompileCounterWithBackend("eager")  # no backward to split: dynamo's graphs, run as they are
    compiled = model.compile_chunks(backend=graphs).generate(ids, **settings)
    assert torch.equal(compiled, eager)
    # the first chunk; the second, whose previous chunk's values the cache holds whole; the chunks after it,
    # where they are a view into the two chunks' values (other strides); the prompt's partial last chunk; and the
    # one-token pieces that start the chunks decoding enters
    assert graphs.frame_count == 5



def test_compiled_chunks_equal_the_layer_major_stream(one_thread):
    """Chunks that attend only to themselves (the demo's setting) run layer by layer when eager; compiled, chunk by
    chunk: the same logits and hidden states, padding included."""
    model = tiny_model(attend_previous_chunk=False).eval()
    ids, mask = padded_batch(5 * CHUNK + 3, seed=4)
    assert model.model._runs_layer_by_layer(ids.shape[1], None)
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, output_hidden_states=True)
        graphs = CompileCounterWithBackend("eager")  # no backward to split: dynamo's graphs, run as they are
        compiled = model.compile_chunks(backend=graphs)(ids, attention_mask=mask, output_hidden_states=True)
    real = mask.bool()  # what padding positions hold means nothing (see forward)
    torch.testing.assert_close(compiled.logits[real], eager.logits[real], rtol=1e-6, atol=1e-6)
    assert len(compiled.hidden_states) == len(eager.hidden_states) == 3
    for ours, theirs in zip(compiled.hidden_states, eager.hidden_states):
        torch.testing.assert_close(ours[real], theirs[real], rtol=1e-6, atol=1e-6)
    assert graphs.frame_count == 3


def test_the_model_sets_how_many_graphs_its_step_may_compile(one_thread):
    """torch's recompile limit (8 per function) counts the step's graphs of every model, mode and backend in the
    process together, and fullgraph=True turns reaching it into an error; the model's own limit applies instead."""
    assert TitansQwenModel.COMPILED_CHUNK_GRAPHS > 8
    model = tiny_model(attend_previous_chunk=False).eval()
    model.model.COMPILED_CHUNK_GRAPHS = 2  # the stream below needs 3 graphs
    ids, mask = padded_batch(5 * CHUNK + 3, seed=4)
    with torch.no_grad(), pytest.raises(Exception) as refused:
        model.compile_chunks(backend="eager")(ids, attention_mask=mask)
    assert refused.typename == "FailOnRecompileLimitHit"


def test_titans_trainer_torch_compile_compiles_the_chunk_step_not_the_model(one_thread, tmp_path):
    """TrainingArguments(torch_compile=True) in TitansTrainer: the model's chunk step is compiled (compile_chunks,
    with torch_compile_backend), accelerate compiles nothing (the Trainer's private `_build_accelerator_args` hook:
    if the Trainer stops calling it, the dynamo backend below is not NO), and the steps equal eager ones."""
    import datasets
    from accelerate.utils import DynamoBackend

    from titans_hf.data.collator import TitansDataCollator
    from titans_hf.training import TitansTrainer, TitansTrainingArguments

    ids = torch.randint(1, 64, (4, 2 * CHUNK + 5), generator=torch.Generator().manual_seed(7)).tolist()
    rows = datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(ids[0])] * 4, "labels": ids})
    trained = {}
    for compiled in (False, True):
        model = tiny_model(checkpoint_chunks=True)
        args = TitansTrainingArguments(
            output_dir=str(tmp_path / str(compiled)), torch_compile=compiled,
            torch_compile_backend="aot_eager" if compiled else None, max_steps=2, per_device_train_batch_size=2,
            gradient_accumulation_steps=1, learning_rate=1e-2, save_strategy="no", report_to="none", use_cpu=True,
            disable_tqdm=True, seed=0)
        trainer = TitansTrainer(model=model, args=args, train_dataset=rows,
                                data_collator=TitansDataCollator(pad_token_id=0, chunk_size=CHUNK))
        trainer.train()
        trained[compiled] = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    assert model.model._compiled_chunk_step is not None
    assert trainer.accelerator.state.dynamo_plugin.backend == DynamoBackend.NO
    assert not isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert trained[True].keys() == trained[False].keys()
    for name, weight in trained[False].items():
        torch.testing.assert_close(trained[True][name], weight, rtol=1e-5, atol=1e-6, msg=name)
