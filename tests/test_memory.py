"""NeuralMemory against a literal per-token restatement of its definition (module docstring), plus the stream
properties the model relies on: pieces == one pass, causality, test-time learning, long-stream stability; and the
memory-model seam: models defined here with only a forward, registered by name, against the same reference."""

import ast
import dataclasses
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from titans_hf.modeling import configuration_titans_qwen, memory, ops, update_rules, variants
from titans_hf.modeling.memory import MemoryModel, MemoryState, MLPMemory, NeuralMemory


def randomise(mem: NeuralMemory, seed: int) -> NeuralMemory:
    """Move every parameter off its structured init (identity conv, unit norm) so no term hides behind a zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mem.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return mem


def mlp_memory(weights, z):
    """The default memory model: a_0 = z, a_l = silu(a_{l-1} W_l), M_W(z) = z + a_{L-1} W_L."""
    a = z
    for w in weights[:-1]:
        a = F.silu(a @ w)
    return z + a @ weights[-1]


def reference_theta(mem: NeuralMemory, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Every token's inner learning rate theta [B, T, H]: max_lr * sigmoid(RMSNorm(h) W_g + b_g)[:H], 0 on padding."""
    real = torch.ones(hidden.shape[:2], dtype=hidden.dtype) if mask is None else mask.to(hidden.dtype)
    x = hidden / torch.sqrt(hidden.pow(2).mean(-1, keepdim=True) + mem.norm.eps) * mem.norm.weight
    logits = x @ mem.to_gates.weight.T + mem.to_gates.bias
    return mem.max_lr * torch.sigmoid(logits[..., :mem.memory_num_heads]) * real[..., None]


def reference(mem: NeuralMemory, hidden: torch.Tensor, mask: torch.Tensor | None = None,
              memory_fn=mlp_memory) -> torch.Tensor:
    """The module restated: each token's inputs (RMSNorm, the convolution as a sum over its taps, silu and l2norm,
    theta) and each update chunk's gates (the mean logit over its real tokens) by plain loops and products, then the
    update rule by `ops.naive` on the memory model `memory_fn(weights, z)`: loops over rows, chunks and tokens with
    autograd (create_graph) for each token's inner gradient."""
    B, T, _ = hidden.shape
    H, d, C, K = mem.memory_num_heads, mem.memory_head_dim, mem.memory_chunk_size, mem.conv_kernel
    real = torch.ones(B, T, dtype=hidden.dtype) if mask is None else mask.to(hidden.dtype)
    x = hidden / torch.sqrt(hidden.pow(2).mean(-1, keepdim=True) + mem.norm.eps) * mem.norm.weight
    u = (x @ mem.to_qkv.weight.T) * real[..., None]
    conv = torch.stack(
        [sum(mem.conv_weight[:, i] * u[:, t - K + 1 + i] for i in range(K) if t - K + 1 + i >= 0) for t in range(T)], 1
    )
    q, k, v = (part.reshape(B, T, H, d) for part in conv.split(H * d, dim=-1))
    l2 = lambda z: z / z.norm(dim=-1, keepdim=True).clamp(min=1e-12)  # noqa: E731
    q, k = l2(F.silu(q)), l2(F.silu(k))
    logits = x @ mem.to_gates.weight.T + mem.to_gates.bias
    theta = reference_theta(mem, hidden, mask)

    etas, keeps, valids = [], [], []
    for j in range(T // C):
        tokens = range(j * C, j * C + C)
        count = [real[b, tokens].sum() for b in range(B)]
        mean = lambda gate: torch.stack([(logits[b, tokens, gate * H + h] * real[b, tokens]).sum()  # noqa: E731
                                         / count[b].clamp(min=1) for b in range(B) for h in range(H)]).view(-1, 1, 1)
        etas.append(torch.sigmoid(mean(1)))
        keeps.append(1 - torch.sigmoid(mean(2)))
        valids.append(torch.tensor([bool(count[b] > 0) for b in range(B) for _ in range(H)]).view(-1, 1, 1))
    rows = lambda t: t.transpose(1, 2).flatten(0, 1)  # noqa: E731  [B, T, H, ...] -> [B * H, T, ...]
    weights = [w.expand(B, -1, -1, -1).flatten(0, 1) for w in mem.initial_weights]
    reads, *_ = ops.naive(rows(q), rows(k), rows(v), rows(2 * theta), etas, keeps, valids, weights,
                          [torch.zeros_like(w) for w in weights], weights, 0,
                          dataclasses.replace(mem.update_settings, memory_function=memory_fn))
    return reads.view(B, H, T, d).transpose(1, 2).reshape(B, T, H * d)


def delta_memory(max_memory_norm: float = 3.0, **settings) -> NeuralMemory:
    """A randomised fp64 memory with the delta rule (every setting but the rule's own may be overridden)."""
    settings = dict(dict(hidden_size=12, memory_num_heads=2, memory_head_dim=4, memory_depth=1, conv_kernel=3,
                         memory_chunk_size=4, max_lr=0.5, theta_bias_init=1.0), **settings)
    return randomise(NeuralMemory(**settings, update_rule="delta", max_memory_norm=max_memory_norm).double(), 7)


def padded_pieces_match_reference(mem: NeuralMemory, tokens: int = 30, padded_from: int = 22, padded_before: int = 9,
                                  pieces: tuple[int, ...] = (3, 6, 1, 13, 7), memory_fn=mlp_memory) -> MemoryState:
    """Stream two rows of `tokens` (row 0 padded from `padded_from`, row 1 before `padded_before`: by default two
    chunks of 4 without a real token) through `mem` in `pieces` that end mid-chunk; assert reads and outer gradients
    equal the per-token reference of `memory_fn`, that the memory wrote, and that the same stream without grad gives
    the same bits and builds no graph. Returns the state."""
    hidden = torch.randn(2, tokens, 12, dtype=torch.double)
    mask = torch.ones(2, tokens)
    mask[0, padded_from:] = 0
    mask[1, :padded_before] = 0
    probe = torch.randn(2, tokens, 8, dtype=torch.double)

    def streamed():
        return streamed_in_pieces(mem, hidden, mask, pieces)

    reads, state = streamed()
    expected = reference(mem, hidden, mask, memory_fn=memory_fn)
    torch.testing.assert_close(reads, expected, rtol=0, atol=1e-10)
    for got, want in zip(param_grads(mem, reads, probe), param_grads(mem, expected, probe)):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
    assert not torch.allclose(expected[:, -1], memory_read_without_updates(mem, hidden)[:, -1])
    with torch.no_grad():
        reads_no_grad, state_no_grad = streamed()
    assert reads_no_grad.grad_fn is None and state_no_grad.weights[0].grad_fn is None
    torch.testing.assert_close(reads_no_grad, reads, rtol=0, atol=0)
    for key, value in state.state_dict().items():
        torch.testing.assert_close(state_no_grad.state_dict()[key], value, rtol=0, atol=0, msg=key)
    return state


def streamed_in_pieces(mem: NeuralMemory, hidden: torch.Tensor, mask: torch.Tensor | None, sizes: tuple[int, ...]):
    """Feed `hidden` (and `mask`) to `mem` in pieces of `sizes`, carrying the state; the joined reads and last state."""
    state, pieces, start = None, [], 0
    for size in sizes:
        out, state = mem(hidden[:, start:start + size], state, None if mask is None else mask[:, start:start + size])
        pieces.append(out)
        start += size
    return torch.cat(pieces, 1), state


def param_grads(mem, reads, probe):
    return torch.autograd.grad((reads * probe).sum(), list(mem.parameters()))


@pytest.mark.parametrize(
    "depth,chunk,batch,kernel,clip",
    [(1, 4, 4, 3, None), (2, 4, 4, 3, 0.05), (2, 4, 8, 2, 0.05), (2, 3, 9, 4, None), (1, 5, 10, 1, 0.02)],
)
def test_matches_per_token_reference_reads_and_outer_gradients(depth, chunk, batch, kernel, clip):
    torch.manual_seed(0)
    mem = NeuralMemory(12, 2, 4, memory_depth=depth, memory_expansion=2, conv_kernel=kernel, memory_chunk_size=chunk,
                       memory_batch_size=batch, max_lr=0.5 if clip else 0.05, max_surprise_norm=clip,
                       theta_bias_init=0.0).double()
    randomise(mem, 1)
    hidden = torch.randn(2, 22, 12, dtype=torch.double)
    probe = torch.randn(2, 22, 8, dtype=torch.double)
    reads, _ = mem(hidden)
    expected = reference(mem, hidden)
    assert expected.abs().max() < 100  # a stable regime, so absolute tolerances mean something
    torch.testing.assert_close(reads, expected, rtol=0, atol=1e-10)
    for got, want in zip(param_grads(mem, reads, probe), param_grads(mem, expected, probe)):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
    assert not torch.allclose(expected[:, -1], memory_read_without_updates(mem, hidden)[:, -1])


@pytest.mark.parametrize("depth", [1, 2])
def test_streamed_pieces_match_reference_including_gradients(depth):
    """Pieces that end mid-chunk and mid-batch: single chunks whose gradient point is not the current weights."""
    torch.manual_seed(0)
    mem = randomise(NeuralMemory(12, 2, 4, memory_depth=depth, memory_expansion=2, conv_kernel=3, memory_chunk_size=4,
                                 memory_batch_size=12, max_lr=0.5, max_surprise_norm=0.05,
                                 theta_bias_init=0.0).double(), 8)
    hidden = torch.randn(2, 30, 12, dtype=torch.double)
    probe = torch.randn(2, 30, 8, dtype=torch.double)
    reads, _ = streamed_in_pieces(mem, hidden, None, (3, 5, 1, 4, 4, 13))
    expected = reference(mem, hidden)
    torch.testing.assert_close(reads, expected, rtol=0, atol=1e-10)
    for got, want in zip(param_grads(mem, reads, probe), param_grads(mem, expected, probe)):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


def memory_read_without_updates(mem, hidden):
    """Reads from the initial weights only: the reference must differ from this, or the test checks nothing."""
    frozen = NeuralMemory(12, 2, 4, memory_depth=mem.memory_depth, memory_expansion=2, conv_kernel=mem.conv_kernel,
                          memory_chunk_size=10**6, max_surprise_norm=mem.max_surprise_norm,
                          memory_model=mem.memory_model).double()
    frozen.load_state_dict(mem.state_dict())
    return frozen(hidden)[0]


def test_padding_mask_matches_reference_and_never_writes():
    torch.manual_seed(0)
    mem = randomise(NeuralMemory(12, 2, 4, conv_kernel=3, memory_chunk_size=4, max_lr=0.5, max_surprise_norm=0.05,
                                 theta_bias_init=0.0).double(), 2)
    hidden = torch.randn(2, 20, 12, dtype=torch.double)
    mask = torch.ones(2, 20)
    mask[0, 14:] = 0  # right padding: chunk 3 half real, chunk 4 none
    mask[1, :6] = 0  # left padding: chunk 0 no real token, chunk 1 half
    probe = torch.randn(2, 20, 8, dtype=torch.double)
    reads, state = mem(hidden, mask=mask)
    expected = reference(mem, hidden, mask)
    torch.testing.assert_close(reads, expected, rtol=0, atol=1e-10)
    for got, want in zip(param_grads(mem, reads, probe), param_grads(mem, expected, probe)):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
    # a fully padded chunk is a no-op: row 0 after 16 tokens equals row 0 after 20 (chunk 4 is all padding)
    _, state16 = mem(hidden[:, :16], mask=mask[:, :16])
    for w20, w16 in zip(state.weights, state16.weights):
        torch.testing.assert_close(w20[0], w16[0], rtol=0, atol=0)
    # padding content is irrelevant: change the padded tokens, nothing changes for real tokens
    noisy = hidden.clone()
    noisy[0, 14:] += 5 * torch.randn(6, 12, dtype=torch.double)
    noisy[1, :6] += 5 * torch.randn(6, 12, dtype=torch.double)
    reads2, state2 = mem(noisy, mask=mask)
    torch.testing.assert_close(reads2[0, :14], reads[0, :14], rtol=0, atol=1e-12)
    torch.testing.assert_close(reads2[1, 6:], reads[1, 6:], rtol=0, atol=1e-12)
    for a, b in zip(state.weights, state2.weights):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("batch", [4, 12])
def test_linear_memory_affine_scan_streamed_with_padding_matches_reference(batch):
    """The default memory (depth 1) runs as an affine scan (surprise P_j W + R_j from products taken before the
    loop): against the per-token reference with padding (two chunks without a real token), pieces that end mid-chunk
    and mid-batch, and a gradient point that is not the current weights; the same reads and state without grad."""
    torch.manual_seed(0)
    mem = randomise(NeuralMemory(12, 2, 4, memory_depth=1, conv_kernel=3, memory_chunk_size=4, memory_batch_size=batch,
                                 max_lr=0.5, max_surprise_norm=0.05, theta_bias_init=0.0).double(), 5)
    assert mem.affine
    padded_pieces_match_reference(mem)


@pytest.mark.parametrize("batch", [16, 32, 48])
def test_streaming_pieces_equal_one_pass(batch):
    torch.manual_seed(0)
    mem = randomise(NeuralMemory(24, 3, 8, memory_chunk_size=16, memory_batch_size=batch, conv_kernel=6, max_lr=0.5,
                                 theta_bias_init=0.0), 3)
    hidden = torch.randn(2, 172, 24)
    mask = (torch.rand(2, 172) > 0.2).float()
    for use_mask in (None, mask):
        full, full_state = mem(hidden, mask=use_mask)
        reads, state = streamed_in_pieces(mem, hidden, use_mask, (1, 7, 64, 100))
        torch.testing.assert_close(reads, full, rtol=1e-5, atol=1e-5)
        assert state.position == full_state.position == 172
        for key, value in full_state.state_dict().items():
            torch.testing.assert_close(state.state_dict()[key], value, rtol=1e-5, atol=1e-5, msg=key)


def test_single_token_decoding_equals_one_pass():
    torch.manual_seed(0)
    mem = randomise(NeuralMemory(16, 2, 8, memory_chunk_size=4, conv_kernel=4, max_lr=0.5, theta_bias_init=0.0), 4)
    hidden = torch.randn(3, 13, 16)
    full, _ = mem(hidden)
    state, outs = None, []
    for t in range(13):
        out, state = mem(hidden[:, t:t + 1], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-6)


def test_causality_reads_and_gradients():
    torch.manual_seed(0)
    C, K = 8, 3
    mem = randomise(NeuralMemory(16, 2, 8, memory_chunk_size=C, conv_kernel=K, max_lr=0.5,
                                 theta_bias_init=0.0).double(), 5)
    hidden = torch.randn(1, 40, 16, dtype=torch.double)
    base, _ = mem(hidden)
    t = 19  # inside chunk 2 = tokens 16..23
    changed = hidden.clone()
    changed[0, t] += 1.0
    out, _ = mem(changed)
    torch.testing.assert_close(out[0, :t], base[0, :t], rtol=0, atol=1e-13)  # nothing before t moves
    # the rest of chunk 2 beyond the conv window reads W_1, which token t cannot have written
    torch.testing.assert_close(out[0, t + K:24], base[0, t + K:24], rtol=0, atol=1e-13)
    assert (out[0, t] - base[0, t]).abs().max() > 1e-3  # its own read sees it through q
    assert (out[0, 24:32] - base[0, 24:32]).abs().max() > 1e-6  # chunk 3 reads W_2, written by token t
    # gradients: read at position s depends on no later token
    hidden.requires_grad_(True)
    reads, _ = mem(hidden)
    for s in (0, 7, 8, 23, 38):
        (grad,) = torch.autograd.grad(reads[0, s].sum(), hidden, retain_graph=True)
        assert grad[0, s + 1:].abs().max() == 0
        assert grad[0, s].abs().max() > 0


@pytest.mark.parametrize("depth,max_lr", [(1, 0.5), (2, 0.05)])
def test_memory_learns_key_value_pairs_at_test_time(depth, max_lr):
    """Hidden = [key | value]; q and k project the key half, v the value half. Streaming the pairs must make
    M(q_i) return v_i far better than the initial weights do."""
    torch.manual_seed(0)
    d, n_pairs = 16, 8
    mem = NeuralMemory(2 * d, 1, d, memory_depth=depth, memory_expansion=2, conv_kernel=1, memory_chunk_size=4,
                       max_lr=max_lr, max_surprise_norm=None, theta_bias_init=8.0, momentum_bias_init=-8.0,
                       forget_bias_init=-12.0)
    with torch.no_grad():
        eye = torch.eye(d)
        mem.to_qkv.weight.zero_()
        mem.to_qkv.weight[:d, :d] = eye  # q <- key half
        mem.to_qkv.weight[d:2 * d, :d] = eye  # k <- key half
        mem.to_qkv.weight[2 * d:, d:] = eye  # v <- value half
        mem.to_gates.weight.zero_()
    keys = F.normalize(torch.randn(n_pairs, d), dim=-1)
    values = F.normalize(torch.randn(n_pairs, d), dim=-1)
    pairs = torch.cat([keys, values], -1)[None]  # both halves unit norm: the RMS norm scales every token alike
    queries = torch.cat([keys, F.normalize(torch.randn(n_pairs, d), dim=-1)], -1)[None]
    target = values * math.sqrt(d)  # RMSNorm of a [unit | unit] vector multiplies by sqrt(2d / 2)

    def recall_error(state):
        # one token per call: it sits in an unfinished chunk, so it only reads the state's weights
        reads = torch.cat([mem(queries[:, i:i + 1], state)[0] for i in range(n_pairs)], 1)
        return (reads[0] - target).norm(dim=-1).mean()

    with torch.no_grad():
        state = mem.init_state(1)
        before = recall_error(state)
        for _ in range(30):
            _, state = mem(pairs, state)
        after = recall_error(state)
    assert after < 0.1 * before, (before, after)


def test_million_token_stream_stays_bounded():
    """With gate weights zeroed, eta and alpha are constants; clipping bounds |G| <= c, so per head
    |S| <= c / (1 - eta) and |W_j| <= |W_0| + c / ((1 - eta) * alpha): the stream must respect that bound."""
    torch.manual_seed(0)
    clip, eta, alpha = 1.0, torch.sigmoid(torch.tensor(0.0)), torch.sigmoid(torch.tensor(-4.0))
    mem = NeuralMemory(8, 2, 4, memory_depth=2, memory_expansion=2, conv_kernel=4, memory_chunk_size=256, max_lr=1.0,
                       max_surprise_norm=clip, theta_bias_init=4.0, momentum_bias_init=0.0, forget_bias_init=-4.0)
    with torch.no_grad():
        mem.to_gates.weight.zero_()

    def head_norms(weights):
        return torch.sqrt(sum(w.pow(2).sum((-2, -1)) for w in weights))

    bound = head_norms([w[None] for w in mem.initial_weights]) + clip / ((1 - eta) * alpha)
    state, largest = None, torch.zeros(1, 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only adds sync cost, badly so on a busy machine
    try:
        with torch.no_grad():
            for _ in range(16):
                reads, state = mem(3 * torch.randn(1, 65536, 8), state)
                assert torch.isfinite(reads).all()
                largest = torch.maximum(largest, head_norms(state.weights))
    finally:
        torch.set_num_threads(threads)
    assert state.position == 2**20
    assert (largest <= bound).all(), (largest, bound)
    moved = head_norms([w - w0 for w, w0 in zip(state.weights, mem.initial_weights)])
    assert (moved > 1.0).all()  # the memory did write all along: the bound is not vacuous


def test_bf16_activations_keep_fp32_state():
    torch.manual_seed(0)
    mem = randomise(NeuralMemory(16, 2, 8, memory_chunk_size=8, max_lr=0.5, theta_bias_init=0.0), 6)
    hidden = torch.randn(2, 30, 16)
    reads32, _ = mem(hidden)
    reads16, state = mem(hidden.bfloat16())
    assert reads16.dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for t in state.state_dict().values() if t.is_floating_point())
    torch.testing.assert_close(reads16.float(), reads32, rtol=0.05, atol=0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reads_autocast, state = mem(hidden)
    assert state.weights[0].dtype == torch.float32
    torch.testing.assert_close(reads_autocast.float(), reads32, rtol=0.05, atol=0.05)
    mem_bf16 = randomise(NeuralMemory(16, 2, 8, memory_chunk_size=8), 6).bfloat16()
    reads, state = mem_bf16(hidden.bfloat16())
    assert reads.dtype == torch.bfloat16 and state.weights[0].dtype == torch.float32 and torch.isfinite(reads).all()


def test_state_save_restore_select_and_detach(tmp_path):
    torch.manual_seed(0)
    mem = randomise(NeuralMemory(16, 2, 8, memory_chunk_size=8, memory_batch_size=16, max_lr=0.5,
                                 theta_bias_init=0.0), 7)
    hidden = torch.randn(3, 45, 16)
    full, _ = mem(hidden)
    _, state = mem(hidden[:, :21])
    save_file(state.state_dict(), tmp_path / "state.safetensors")
    restored = MemoryState.from_state_dict(load_file(tmp_path / "state.safetensors"))
    assert restored.position == 21
    rest, _ = mem(hidden[:, 21:], restored)
    torch.testing.assert_close(rest, full[:, 21:], rtol=1e-5, atol=1e-6)

    rows = [2, 0, 0]
    picked, _ = mem(hidden[rows, 21:], state.select(rows))
    torch.testing.assert_close(picked, full[rows, 21:], rtol=1e-5, atol=1e-6)

    detached = state.detach()
    assert state.weights[0].grad_fn is not None
    assert all(t.grad_fn is None for t in detached.weights + detached.momentum + [detached.buffer_keys])
    torch.testing.assert_close(detached.weights[0], state.weights[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="missing"):
        MemoryState.from_state_dict({"position": torch.tensor(3)})


def test_written_sums_each_tokens_theta_once_in_the_call_that_computed_it():
    """`MemoryState.written`: theta / max_lr summed over the call's real tokens and heads, so the pieces of a stream
    add up to one pass (a buffered token writes in the next call but is counted in its own); not part of the
    state (no saved key, None after detach / select)."""
    mem = delta_memory()
    hidden = torch.randn(2, 30, 12, dtype=torch.double)
    mask = torch.ones(2, 30)
    mask[0, 22:] = 0
    mask[1, :9] = 0
    per_token = reference_theta(mem, hidden, mask) / mem.max_lr
    state, start, total = None, 0, 0.0
    for size in (3, 6, 1, 13, 7):
        _, state = mem(hidden[:, start:start + size], state, mask[:, start:start + size])
        torch.testing.assert_close(state.written, per_token[:, start:start + size].sum(), rtol=1e-12, atol=0)
        total, start = total + state.written, start + size
    _, whole = mem(hidden, None, mask)
    torch.testing.assert_close(whole.written, total, rtol=1e-12, atol=0)
    assert 0 < float(whole.written.detach()) < mask.sum() * mem.memory_num_heads
    torch.autograd.grad(whole.written, mem.to_gates.bias)  # differentiable: what the write cost trains through
    assert "written" not in whole.state_dict() and whole.detach().written is None and whole.select([0]).written is None
    assert mem.init_state(2).written is None


def test_retrieve_reads_without_writing():
    """retrieve == the reads of tokens fed with no convolution history into an unfinished chunk (which only read)."""
    torch.manual_seed(0)
    mem = randomise(NeuralMemory(16, 2, 8, memory_chunk_size=8, conv_kernel=3, max_lr=0.5, theta_bias_init=0.0), 9)
    _, state = mem(torch.randn(2, 16, 16))  # at a chunk boundary: the next 5 tokens only read
    queries = torch.randn(1, 5, 16)
    got = mem.retrieve(queries, state)
    no_history = dataclasses.replace(state, conv_tail=torch.zeros_like(state.conv_tail))
    for t in range(5):  # one call per query, each time from the same state: no query sees another
        expected, _ = mem(queries[:, t:t + 1].expand(2, -1, -1), no_history)
        torch.testing.assert_close(got[:, t:t + 1], expected, rtol=1e-5, atol=1e-6)
    assert got.shape == (2, 5, 16) and not torch.allclose(got[0], got[1])  # rows read their own weights
    with pytest.raises(ValueError, match="retrieve"):
        mem.retrieve(torch.randn(3, 5, 16), state)


def test_bad_arguments_name_the_problem():
    """The inputs of a call (the settings are the config's to check: test_the_settings_a_neural_memory_takes_...)."""
    mem = NeuralMemory(16, 2, 8)
    with pytest.raises(ValueError, match="hidden"):
        mem(torch.randn(2, 5, 15))
    with pytest.raises(ValueError, match="mask"):
        mem(torch.randn(2, 5, 16), mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="rows"):
        mem(torch.randn(2, 5, 16), mem.init_state(3))


def test_window_conv_init_averages_query_and_key_taps_and_keeps_values_identity():
    heads, dim, kernel = 2, 4, 6
    inner = heads * dim
    window = NeuralMemory(8, heads, dim, memory_depth=1, conv_kernel=kernel, conv_init="window").conv_weight.detach()
    assert torch.equal(window[: 2 * inner], torch.full((2 * inner, kernel), 1 / kernel))
    identity_taps = torch.tensor([[0.0] * (kernel - 1) + [1.0]]).expand(inner, kernel)
    assert torch.equal(window[2 * inner :], identity_taps)
    identity = NeuralMemory(8, heads, dim, memory_depth=1, conv_kernel=kernel).conv_weight.detach()
    assert torch.equal(identity, identity_taps.repeat(3, 1))


def test_shifted_conv_init_keys_the_tokens_before_and_reads_back_the_token_that_followed():
    heads, dim, kernel = 2, 4, 6
    inner = heads * dim
    shifted = NeuralMemory(8, heads, dim, memory_depth=1, conv_kernel=kernel, conv_init="shifted").conv_weight.detach()
    # taps run oldest to newest (the last is the token itself): queries the 5 newest, keys the 5 before the token
    assert torch.equal(shifted[:inner], torch.tensor([[0.0] + [0.2] * 5]).expand(inner, kernel))
    assert torch.equal(shifted[inner : 2 * inner], torch.tensor([[0.2] * 5 + [0.0]]).expand(inner, kernel))
    assert torch.equal(shifted[2 * inner :], torch.tensor([[0.0] * 5 + [1.0]]).expand(inner, kernel))
    # so the key of token t is the query of token t - 1: a read after a context returns the token that followed it
    memory = NeuralMemory(8, heads, dim, memory_depth=1, conv_kernel=kernel, conv_init="shifted")
    tokens = 12
    with torch.no_grad():
        memory.to_qkv.weight[inner : 2 * inner] = memory.to_qkv.weight[:inner]  # one projection for queries and keys
        query, key, value, *_ = memory.token_inputs(torch.randn(1, tokens, 8), memory.init_state(1).conv_tail, None,
                                                    torch.ones(1, tokens))
    torch.testing.assert_close(key[:, :, 1:], query[:, :, :-1])
    assert not torch.allclose(key, query)


# ---- the memory-model seam: models with only a forward, registered by name ----


def linear_memory(weights, z):
    return z @ weights[0]


class LinearMemory(MemoryModel):
    """M_W(z) = z W: one weight, no residual, only a forward (inner gradients by autograd)."""

    def __init__(self, head_dim, depth, expansion):
        self.shapes = [(head_dim, head_dim)]

    def __call__(self, weights, z):
        return linear_memory(weights, z)


class AutogradMLP(MemoryModel):
    """The default MLP with only its forward: the generic path on a deep, nonlinear model."""

    def __init__(self, head_dim, depth, expansion):
        self.shapes = MLPMemory(head_dim, depth, expansion).shapes

    def __call__(self, weights, z):
        return mlp_memory(weights, z)


@pytest.fixture
def forward_only_models(monkeypatch):
    monkeypatch.setitem(memory.MEMORY_MODELS, "linear", LinearMemory)
    monkeypatch.setitem(memory.MEMORY_MODELS, "mlp-autograd", AutogradMLP)


@pytest.mark.parametrize(
    "name,memory_fn,depth,chunk,batch,clip",
    [("linear", linear_memory, 1, 4, 4, None), ("linear", linear_memory, 1, 3, 9, 0.05),
     ("mlp-autograd", mlp_memory, 2, 4, 4, 0.05), ("mlp-autograd", mlp_memory, 2, 4, 8, None)],
)
def test_forward_only_memory_model_matches_reference(forward_only_models, name, memory_fn, depth, chunk, batch,
                                                     clip):
    torch.manual_seed(0)
    mem = randomise(NeuralMemory(12, 2, 4, memory_depth=depth, memory_expansion=2, conv_kernel=3,
                                 memory_chunk_size=chunk, memory_batch_size=batch, max_lr=0.5 if clip else 0.05,
                                 max_surprise_norm=clip, theta_bias_init=0.0, memory_model=name).double(), 1)
    assert type(mem.memory_function) is memory.MEMORY_MODELS[name]
    hidden = torch.randn(2, 22, 12, dtype=torch.double)
    probe = torch.randn(2, 22, 8, dtype=torch.double)
    reads, _ = mem(hidden)
    expected = reference(mem, hidden, memory_fn=memory_fn)
    assert expected.abs().max() < 100
    torch.testing.assert_close(reads, expected, rtol=0, atol=1e-10)
    for got, want in zip(param_grads(mem, reads, probe), param_grads(mem, expected, probe)):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
    assert not torch.allclose(expected[:, -1], memory_read_without_updates(mem, hidden)[:, -1])


def test_linear_memory_streamed_with_padding_matches_reference_and_runs_without_grad(forward_only_models):
    torch.manual_seed(0)
    mem = randomise(NeuralMemory(12, 2, 4, conv_kernel=3, memory_chunk_size=4, memory_batch_size=8, max_lr=0.5,
                                 max_surprise_norm=0.05, theta_bias_init=0.0, memory_model="linear").double(), 2)
    padded_pieces_match_reference(mem, tokens=26, padded_from=17, padded_before=5, pieces=(3, 6, 1, 9, 7),
                                  memory_fn=linear_memory)


@pytest.mark.parametrize("batch", [16, 48])
def test_explicit_mlp_equals_its_autograd_twin(forward_only_models, batch):
    """The written-out inner gradients (fused chunk step, memory-batch node) against autograd on the same MLP, at a
    size the per-token reference is too slow for: reads, state and outer gradients, with padding and pieces."""
    torch.manual_seed(0)
    config = dict(memory_depth=3, memory_expansion=2, memory_chunk_size=16, memory_batch_size=batch, conv_kernel=4,
                  max_lr=0.5, max_surprise_norm=0.5, theta_bias_init=0.0)
    explicit = randomise(NeuralMemory(24, 3, 8, **config).double(), 3)
    generic = NeuralMemory(24, 3, 8, memory_model="mlp-autograd", **config).double()
    generic.load_state_dict(explicit.state_dict())
    hidden = torch.randn(2, 150, 24, dtype=torch.double)
    mask = (torch.rand(2, 150) > 0.2).double()
    mask[1, 32:64] = 0  # two chunks without a real token
    probe = torch.randn(2, 150, 24, dtype=torch.double)

    def streamed(mem):
        return streamed_in_pieces(mem, hidden, mask, (40, 1, 61, 48))

    results = []
    for mem in (explicit, generic):
        reads, state = streamed(mem)
        loss = (reads * probe).sum() + sum((w * w).sum() for w in state.weights + state.momentum)
        results.append((reads, state.state_dict(), torch.autograd.grad(loss, list(mem.parameters()))))
        with torch.no_grad():  # no graph: the explicit arithmetic is the same; autograd's rounds differently
            torch.testing.assert_close(streamed(mem)[0], reads, rtol=0, atol=0 if mem is explicit else 1e-12)
    (reads, state, grads), (want_reads, want_state, want_grads) = results
    assert reads.abs().max() < 100
    torch.testing.assert_close(reads, want_reads, rtol=0, atol=1e-10)
    for key, value in want_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-9, atol=1e-10, msg=key)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


def test_memory_model_is_chosen_by_name_and_leaves_state_dict_keys_alone(forward_only_models):
    with pytest.raises(ValueError, match=r"memory_model must be one of \[.*'mlp'.*\], got 'gated'"):
        NeuralMemory(16, 2, 8, memory_model="gated")
    mem = NeuralMemory(16, 2, 8, memory_depth=2)
    assert type(mem.memory_function) is MLPMemory and mem.memory_model == "mlp"
    assert set(mem.state_dict()) == {"norm.weight", "to_qkv.weight", "conv_weight", "to_gates.weight",
                                     "to_gates.bias", "initial_weights.0", "initial_weights.1"}
    linear = NeuralMemory(16, 2, 8, memory_depth=2, memory_model="linear")
    assert [tuple(w.shape) for w in linear.initial_weights] == [(2, 8, 8)]
    assert set(linear.state_dict()) == set(mem.state_dict()) - {"initial_weights.1"}


@pytest.mark.parametrize("chunk,cap", [(4, 3.0), (5, 1.5), (1, 3.0)])
def test_delta_rule_matches_per_token_reference_with_padding_and_pieces(chunk, cap):
    """The delta rule's chunk-parallel WY form against its per-token restatement (each token's step at the weights
    the tokens before it left), with padding (a chunk without a real token), pieces that end mid-chunk, the forget
    gate and the norm cap (a small cap binds, a large one does not); outer gradients too; no grad, the same bits."""
    torch.manual_seed(0)
    mem = delta_memory(cap, memory_chunk_size=chunk)
    state = padded_pieces_match_reference(mem)
    norms = torch.linalg.vector_norm(state.weights[0], dim=(-2, -1))
    assert (norms <= cap + 1e-9).all()
    if cap == 1.5:
        assert torch.allclose(norms, torch.full_like(norms, cap)), norms  # the cap bound, and the test saw it bind


def test_delta_rule_replaces_a_value_in_one_write():
    """beta = 1 on a unit key: one token's step stores v at k exactly (M_W(k) = v), and rewriting the same key with
    another value replaces it (what a new place for the same person needs); other, orthogonal keys keep theirs."""
    mem = NeuralMemory(4, 1, 4, memory_depth=1, memory_chunk_size=2, max_lr=0.5, update_rule="delta",
                       max_memory_norm=100.0).double()
    W = torch.zeros(1, 4, 4, dtype=torch.double)
    k = torch.eye(4, dtype=torch.double)[None, :2]  # two orthogonal unit keys in one update chunk
    v = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [0.0, -1.0, 0.0, 1.0]]], dtype=torch.double)
    ones = [torch.ones(1, 1, 1, dtype=torch.double)]
    step = lambda W, k, v: ops.delta(k, k, v, torch.ones(1, 2, dtype=torch.double), ones, ones,  # noqa: E731
                                     [None], [W], [torch.zeros_like(W)], [W], 0, mem.update_settings)[1][0]
    W = step(W, k, v)
    torch.testing.assert_close(k[0] + k[0] @ W[0], v[0], rtol=0, atol=1e-12)
    replaced = torch.tensor([[[9.0, 9.0, 9.0, 9.0], [0.0, -1.0, 0.0, 1.0]]], dtype=torch.double)
    W = step(W, k, replaced)
    torch.testing.assert_close(k[0] + k[0] @ W[0], replaced[0], rtol=0, atol=1e-12)


def test_delta_rule_transition_is_non_expansive_where_the_gradient_rule_is_not():
    """An update chunk maps the weights as W -> (I - K^T Q) W + K^T P. For the delta rule (unit keys, 2 theta <= 1)
    I - K^T Q is the product of the per-token contractions I - beta_t k_t^T k_t (spectral norm <= 1) for any keys,
    however aligned; the chunked gradient rule's I - 2 sum theta_t k_t^T k_t reaches 1 - 2 * 8 * 1 = -15 for 8 equal
    keys at max_lr 1."""
    torch.manual_seed(0)
    C, d = 8, 16
    mem = NeuralMemory(d, 1, d, memory_depth=1, memory_chunk_size=C, max_lr=0.5, update_rule="delta",
                       max_memory_norm=1e9).double()
    base = F.normalize(torch.randn(1, d, dtype=torch.double), dim=-1)
    keys = F.normalize(torch.cat([base + 1e-3 * torch.randn(C // 2, d, dtype=torch.double),
                                  torch.randn(C // 2, d, dtype=torch.double)]), dim=-1)[None]
    beta = torch.rand(1, C, dtype=torch.double).clamp(min=0.05)
    beta[0, :3] = 1.0
    ones = [torch.ones(1, 1, 1, dtype=torch.double)]
    identity = torch.eye(d, dtype=torch.double)[None]
    # values equal to the keys make P = 0: the chunk applied to W = I is the transition itself
    transition = ops.delta(keys, keys, keys, beta, ones, ones, [None], [identity], [identity * 0],
                           [identity], 0, mem.update_settings)[1][0][0]
    sequential = identity[0]
    for t in range(C):
        sequential = (identity[0] - beta[0, t] * keys[0, t, :, None] * keys[0, t]) @ sequential
    torch.testing.assert_close(transition, sequential, rtol=0, atol=1e-12)
    assert torch.linalg.matrix_norm(transition, ord=2) <= 1 + 1e-12
    same = base.expand(C, d)
    gradient_map = identity[0] - 2 * 1.0 * same.T @ same
    assert float(torch.linalg.eigvalsh(gradient_map).min()) == pytest.approx(-15.0)


def test_delta_rule_state_stays_bounded_under_adversarial_writes():
    """100,000 writes chosen against the memory: values of norm 1e6, steps of the largest beta, and pairs of keys
    1e-3 apart with opposite values (the least-squares solution the delta rule chases has norm ~ 1 / 1e-3 * 1e6).
    The docstring's bound holds at every update chunk: ||W_j||_F <= max(max_memory_norm, ||W_-1||_F) per head, and
    the writes do push the state to it (the bound is not vacuous)."""
    torch.manual_seed(0)
    C, d, heads, cap = 8, 8, 2, 10.0
    mem = NeuralMemory(d, heads, d, memory_depth=1, memory_chunk_size=C, max_lr=0.5, update_rule="delta",
                       max_memory_norm=cap)
    W = mem.init_state(1).weights[0].reshape(heads, d, d).detach()
    bound = max(cap, float(torch.linalg.vector_norm(W, dim=(-2, -1)).max()))
    ones = [torch.ones(heads, 1, 1)] * 25
    largest = 0.0
    with torch.no_grad():
        for block in range(500):  # 500 calls of 25 chunks of 8 tokens: 100,000 writes per head
            direction = F.normalize(torch.randn(heads, 1, d), dim=-1)
            keys = F.normalize(direction + 1e-3 * torch.randn(heads, 25 * C, d), dim=-1)
            values = 1e6 * torch.randn(heads, 1, d) * torch.where(torch.arange(25 * C) % 2 == 0, 1.0, -1.0)[:, None]
            lr2 = torch.ones(heads, 25 * C)
            _, (W,), _, _ = ops.delta(keys, keys, values, lr2, ones, ones, [None] * 25, [W],
                                      [torch.zeros_like(W)], [W], 0, mem.update_settings)
            assert torch.isfinite(W).all()
            largest = max(largest, float(torch.linalg.vector_norm(W, dim=(-2, -1)).max()))
    assert largest <= bound * (1 + 1e-6), (largest, bound)
    assert largest >= 0.99 * cap


# ---- the names and settings the config checks, and the ops a memory binds ----


def test_the_configs_names_are_the_registries_keys_and_the_config_imports_no_model_code():
    """The config checks variant, memory_model and update_rule against tuples of its own, so that it imports no torch
    model code (as a transformers config imports no model); each tuple must be its registry's keys."""
    assert tuple(variants.MEMORY_VARIANTS) == configuration_titans_qwen.VARIANTS == ("mag", "mal", "mac")
    assert tuple(memory.MEMORY_MODELS) == configuration_titans_qwen.MEMORY_MODEL_NAMES == ("mlp",)
    assert tuple(ops.UPDATE_OPS) == tuple(configuration_titans_qwen.UPDATE_RULES) == ("gradient", "delta")
    # each rule's entry of the op table carries the very settings the config checks and resolves
    assert all(entry.rule is update_rules.UPDATE_RULES[name] for name, entry in ops.UPDATE_OPS.items())
    assert configuration_titans_qwen.UPDATE_RULES is update_rules.UPDATE_RULES
    # a rule that writes every token runs on the linear memory alone: it has no op for any other memory
    assert all(entry.rule.writes_every_token == (entry.torch_op is None) for entry in ops.UPDATE_OPS.values())
    for module in (configuration_titans_qwen, update_rules):
        tree = ast.parse(inspect.getsource(module))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not imported & {"memory", "variants", "ops", "modeling_titans_qwen", "torch"}, imported


def test_the_config_takes_each_rules_defaults_and_limits_from_its_entry_alone(monkeypatch):
    """A rule's defaults, limits and the memories it runs on are its `UpdateRule`'s, read from there by the config (no
    rule's name in it): a rule added there is resolved and checked by its own values, and an unknown one is refused
    naming it."""
    chunked = update_rules.UpdateRule(name="slow", theta_bias_init=-3.5, write_cost=0.25, max_lr=2.0,
                                      max_lr_reason="a reason of its own", memory_norm_per_sqrt_head_dim=None,
                                      bounded_by="its forget gate", writes_every_token=False)
    monkeypatch.setitem(update_rules.UPDATE_RULES, "slow", chunked)
    config = configuration_titans_qwen.TitansMemoryConfig(update_rule="slow", memory_depth=2, max_lr=2.0)
    assert (config.theta_bias_init, config.write_cost, config.max_memory_norm) == (-3.5, 0.25, None)
    with pytest.raises(ValueError, match=r"max_lr=2.5: update_rule='slow' needs max_lr <= 2 \(a reason of its own\)"):
        configuration_titans_qwen.TitansMemoryConfig(update_rule="slow", max_lr=2.5)
    with pytest.raises(ValueError, match=r"max_memory_norm bounds the delta rule's state; update_rule='slow' is "
                                         r"bounded by its forget gate"):
        configuration_titans_qwen.TitansMemoryConfig(update_rule="slow", max_memory_norm=3.0)
    stepwise = dataclasses.replace(chunked, name="stepwise", memory_norm_per_sqrt_head_dim=2.0, bounded_by=None,
                                   writes_every_token=True)
    monkeypatch.setitem(update_rules.UPDATE_RULES, "stepwise", stepwise)
    config = configuration_titans_qwen.TitansMemoryConfig(update_rule="stepwise", memory_head_dim=16)
    assert (config.theta_bias_init, config.max_memory_norm) == (-3.5, 8.0)  # 2 sqrt(16)
    with pytest.raises(ValueError, match=r"update_rule='stepwise' writes the linear memory token by token: .*\(got "
                                         r"'mlp', 2, None\); set update_rule='gradient' or update_rule='slow' for"):
        configuration_titans_qwen.TitansMemoryConfig(update_rule="stepwise", memory_depth=2)
    with pytest.raises(ValueError, match=r"update_rule='hebb' must be one of \['delta', 'gradient', 'slow', "
                                         r"'stepwise'\]"):
        configuration_titans_qwen.TitansMemoryConfig(update_rule="hebb")


def test_the_reference_runs_each_rules_own_chunk_step(monkeypatch):
    """`naive` holds no rule of its own: each whole update chunk is written by its rule's `reference`, one row at a
    time, with the tokens of that chunk."""
    calls = []

    def keep_the_weights(weights, momentum, grad_point, tokens, token_gradient, eta, keep, settings):
        calls.append(list(tokens))
        return weights, momentum

    monkeypatch.setattr(ops.UPDATE_OPS["gradient"], "reference", keep_the_weights)
    mem = NeuralMemory(8, 1, 4, memory_depth=1, memory_chunk_size=2, max_lr=0.5, update_rule="gradient")
    monkeypatch.setattr(mem, "update_op", ops.naive)
    reads, state = mem(torch.randn(2, 5, 8))
    assert calls == [[0, 1], [2, 3]] * 2  # two rows, two whole chunks each (the fifth token waits in the buffer)
    for weight, initial in zip(state.weights, mem.initial_weights):
        torch.testing.assert_close(weight, initial.unsqueeze(0).expand_as(weight))


@pytest.mark.parametrize(("settings", "message"), [
    (dict(update_rule="gradient", memory_chunk_size=8, memory_batch_size=12),
     r"memory_batch_size=12 must be a multiple of memory_chunk_size \(8\) and at least it"),
    (dict(update_rule="gradient", memory_chunk_size=8, memory_batch_size=4),
     r"memory_batch_size=4 must be a multiple of memory_chunk_size \(8\) and at least it"),
    (dict(memory_depth=0), r"memory_depth=0 must be an integer >= 1"),
    (dict(memory_head_dim=0), r"memory_head_dim=0 must be an integer >= 1"),
    (dict(memory_num_heads=0), r"memory_num_heads=0 must be an integer >= 1 or None"),
    (dict(memory_expansion=0), r"memory_expansion=0 must be an integer >= 1"),
    (dict(conv_kernel=0), r"conv_kernel=0 must be an integer >= 1"),
    (dict(memory_chunk_size=0), r"memory_chunk_size=0 must be an integer >= 1"),
    (dict(conv_init="mean"), r"conv_init='mean' must be one of \['identity', 'shifted', 'window'\]"),
    (dict(max_lr=0.0), r"max_lr=0.0 must be > 0"),
    (dict(max_lr=-0.1, update_rule="gradient"), r"max_lr=-0.1 must be > 0"),
])
def test_the_settings_a_neural_memory_takes_as_they_are_are_refused_by_the_config_naming_them(settings, message):
    """NeuralMemory takes the values TitansMemoryConfig resolved and checked; the config refuses each of these, which
    would build a memory that computes something else (a batch of 12 tokens over chunks of 8 refreshes its gradient
    point every chunk, depth 0 builds the linear memory, an unknown conv_init starts as the identity)."""
    with pytest.raises(ValueError, match=message):
        configuration_titans_qwen.TitansMemoryConfig(**settings)


def test_a_rule_or_memory_model_without_an_implementation_is_refused_when_the_memory_is_built(forward_only_models,
                                                                                                monkeypatch):
    """What the module cannot be built without: a memory model or rule no registry holds, and an op for the rule on
    this memory. The delta rule's op writes the linear memory M_W(z) = z + z W alone; on any other (the module's own
    default depth 2, or a memory model without the residual) the memory used to build and then fail in its first
    forward ("too many values to unpack"), or read its weights as the wrong function. The op table refuses it when
    it binds, a kernel set or not."""
    with pytest.raises(ValueError, match=r"NeuralMemory: update_rule must be one of \['delta', 'gradient'\], "
                                         "got 'hebb'"):
        NeuralMemory(16, 2, 8, update_rule="hebb")
    needs = (r"update_rule='delta' needs the linear memory, M_W\(z\) = z \+ z W \(memory_model='mlp' with "
             r"memory_depth 1\); this memory is another")
    with pytest.raises(ValueError, match=needs):
        NeuralMemory(16, 2, 8, max_lr=0.5, update_rule="delta", max_memory_norm=3.0)  # depth 2
    with pytest.raises(ValueError, match=needs):
        NeuralMemory(16, 2, 8, memory_depth=1, max_lr=0.5, memory_model="linear", update_rule="delta",
                     max_memory_norm=3.0)  # M_W(z) = z W
    with pytest.raises(ValueError, match=needs):
        ops.UPDATE_OPS["delta"].bind(linear_memory=False)
    monkeypatch.setattr(ops.UPDATE_OPS["delta"], "kernel", ops.naive)
    with pytest.raises(ValueError, match=needs):
        ops.UPDATE_OPS["delta"].bind(linear_memory=False)
    assert ops.UPDATE_OPS["delta"].bind(linear_memory=True) is ops.naive
    assert ops.UPDATE_OPS["gradient"].bind(linear_memory=False) is ops.gradient  # the gradient rule: any memory
    assert [rule.name for rule in ops.UPDATE_OPS.values()] == list(ops.UPDATE_OPS)


def test_a_kernel_set_in_the_ops_table_is_bound_by_the_memories_built_after_it(monkeypatch):
    """`UPDATE_OPS[rule].kernel` takes the place of torch's op in every NeuralMemory built after it is set, chosen
    once at build (a memory built before keeps its op); each rule's torch op otherwise (the linear memory's own where
    the rule has one). The naive reference as the delta rule's kernel reads and writes what the WY op does, streamed in
    pieces that end mid-chunk, with padding."""
    torch.manual_seed(0)
    assert NeuralMemory(12, 2, 4, memory_depth=1).update_op is ops.gradient_linear
    assert NeuralMemory(12, 2, 4, memory_depth=2).update_op is ops.gradient
    torch_op = delta_memory()
    assert torch_op.update_op is ops.delta
    calls = []

    def kernel(*args):
        calls.append(args[-1])
        return ops.naive(*args)

    monkeypatch.setattr(ops.UPDATE_OPS["delta"], "kernel", kernel)
    kernel_op = delta_memory()
    kernel_op.load_state_dict(torch_op.state_dict())
    assert kernel_op.update_op is kernel and torch_op.update_op is ops.delta
    assert NeuralMemory(12, 2, 4, memory_depth=1).update_op is ops.gradient_linear  # the other rule keeps torch's
    hidden = torch.randn(2, 30, 12, dtype=torch.double)
    mask = torch.ones(2, 30)
    mask[0, 22:] = 0
    pieces = (3, 6, 1, 13, 7)
    want_reads, want_state = streamed_in_pieces(torch_op, hidden, mask, pieces)
    reads, state = streamed_in_pieces(kernel_op, hidden, mask, pieces)
    assert len(calls) == len(pieces) and all(settings is kernel_op.update_settings for settings in calls)
    torch.testing.assert_close(reads, want_reads, rtol=0, atol=1e-10)
    for key, value in want_state.state_dict().items():
        torch.testing.assert_close(state.state_dict()[key], value, rtol=0, atol=1e-10, msg=key)


def test_with_rows_from_takes_the_marked_rows_weights_and_momentum_and_keeps_the_rest():
    """State Passing's mix: the marked rows take the other state's fast weights, momentum and gradient point (the
    rows line up from the first; the other may hold fewer), every other row and field stays this state's (the
    convolution tail, the buffers, the position: a new row starts a new text)."""
    torch.manual_seed(0)
    mem = randomise(NeuralMemory(12, 2, 4, memory_depth=2, memory_expansion=2, conv_kernel=3, memory_chunk_size=4,
                                 memory_batch_size=8, max_lr=0.5, theta_bias_init=0.0), 3)
    _, ended = mem(torch.randn(2, 14, 12))  # 3 chunks and 2 buffered tokens: a gradient point of its own
    _, mine = mem(torch.randn(3, 5, 12))
    ended = ended.detach()
    assert ended.batch_start_weights is not ended.weights and mine.batch_start_weights is not mine.weights
    mixed = mine.with_rows_from(ended, torch.tensor([True, False, False]))
    for name in ("weights", "momentum", "batch_start_weights"):
        for got, own, theirs in zip(getattr(mixed, name), getattr(mine, name), getattr(ended, name)):
            assert torch.equal(got[0], theirs[0]) and torch.equal(got[1:], own[1:]), name
    assert all(getattr(mixed, name) is getattr(mine, name) for name in ("conv_tail", "buffer_keys", "buffer_values",
                                                                      "buffer_lr", "buffer_gate_logits",
                                                                      "buffer_mask"))
    assert mixed.position == mine.position == 5 and ended.position == 14
    fresh = mem.init_state(3)
    shared = fresh.with_rows_from(ended, torch.tensor([False, True, False]))
    assert shared.batch_start_weights is shared.weights  # a fresh state's point is its weights, and stays so
    assert torch.equal(shared.weights[1][1], ended.weights[1][1]) and shared.weights[0].requires_grad
    with pytest.raises(ValueError, match=r"marking none past the other state's 2; got \[False, False, True\]"):
        mine.with_rows_from(ended, torch.tensor([False, False, True]))
