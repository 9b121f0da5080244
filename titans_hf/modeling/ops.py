"""The memory's update rules as ops: functions of one signature (:class:`UpdateOp`), a per-token reference beside them
(:func:`naive`), and the seam where a device kernel of the same signature takes a rule's place (:data:`UPDATE_OPS`).

An op reads and writes one segment of a memory's stream, all heads of all rows at once (``rows = batch * heads``):

* ``q``, ``k``, ``v`` [rows, N, d] and ``lr2`` [rows, N] (``2 theta``, zero on padding): the tokens not written yet,
  from the start of update chunk ``first_chunk`` of the stream (the unfinished chunk's buffered tokens come first;
  their queries are placeholders, since they were read in an earlier call, and the caller drops their reads);
* ``etas``, ``keeps``, ``valids``: one per whole update chunk ``j`` of the segment, each [rows, 1, 1]: the momentum
  gate ``eta_j``, ``1 - alpha_j`` (the forget gate's complement) and whether the row's chunk holds a real token (a
  row whose chunk does not keeps its state); a ``valids`` entry of None: every row's does;
* ``weights``, ``momentum``, ``grad_point``: one [rows, d_in, d_out] tensor per fast weight: ``W_{j-1}``,
  ``S_{j-1}`` and the weights where the current memory batch takes its inner gradients (the very list ``weights``
  when the two coincide);
* ``settings``: what the op reads of its memory (:class:`UpdateSettings`).

It returns ``(reads, weights, momentum, grad_point)``: the reads [rows, N, d] (a token of whole chunk ``j`` reads
``M_{W_{j-1}}(q_t)``, one of the unfinished chunk the latest weights) and the three lists after the last whole chunk
(``grad_point`` the very list ``weights`` when they coincide). The exact arithmetic of each rule is in
:mod:`titans_hf.modeling.memory`'s docstring; :func:`naive` restates it token by token.

The ops, named as `update_rule` spells them:

* :func:`gradient`: Titans' chunked rule for any memory model: every token's gradient at its memory batch's
  starting weights, clipped, with momentum and forgetting.
* :func:`gradient_linear`: the same rule for the linear memory ``M_W(z) = z + z W``, whose surprise is two products
  at the gradient point and whose reads are linear in the weights: a scan that only writes, then one product reads
  every chunk.
* :func:`delta`: the delta rule (linear memory): every token's step at the weights the tokens before it left, solved
  chunk-parallel in the WY form of DeltaNet's chunkwise algorithm, then forgetting and the norm cap.
* :func:`naive`: any rule as plain loops over rows, chunks and tokens, each token's inner gradient by autograd; a
  rule's `reference` (:func:`gradient_reference`, :func:`delta_reference`) writes one row's chunk.

Kernel seam: :data:`UPDATE_OPS` holds each rule's settings (:class:`~.update_rules.UpdateRule`, what the config
checks and resolves) and implementations (:class:`UpdateRuleOps`), and a `NeuralMemory` binds one of them when it is
built: the rule's `kernel` when one is set, else its torch op (the linear memory's own where the rule has one); a
rule that runs on the linear memory alone (the delta rule) refuses any other memory there.
A kernel of the same signature (a Triton WY step, say) plugs in with ``UPDATE_OPS["delta"].kernel =
chunk_delta_kernel``, before the model is built; it must serve every memory its rule runs on and may return the
momentum as it came if its rule does not use it (the delta rule).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .update_rules import UPDATE_RULES, UpdateRule


class MemoryFunction(Protocol):
    """What the ops use of a memory model (a `memory.MemoryModel`; ops.py imports nothing of memory.py, which binds
    the ops): the shapes of its fast weights, ``M_W(z)`` and the surprise of chunks sharing a point; the fused step of
    :func:`gradient` also calls an `ExplicitMemoryModel`'s written-out inner gradient."""

    shapes: list[tuple[int, int]]

    def __call__(self, weights: Sequence[Tensor], z: Tensor) -> Tensor: ...

    def surprise(self, point: Sequence[Tensor], keys: Tensor, values: Tensor, lr2: Tensor) -> list[Tensor]: ...


@dataclass(frozen=True)
class UpdateSettings:
    """What an update op reads of its memory besides the tokens and the state.

    Args:
        memory_function: the memory model, ``M_W(z)`` as ``memory_function(weights, z)`` (a `memory.MemoryModel`).
        update_rule: the rule, as `update_rule` spells it ("gradient" or "delta").
        memory_chunk_size: tokens per update chunk.
        chunks_per_batch: update chunks per memory batch (`memory_batch_size` // `memory_chunk_size`).
        max_surprise_norm: the gradient rule's clip ``c`` of each chunk's surprise; None: no clip.
        max_memory_norm: the delta rule's cap on each head's Frobenius norm; None for the gradient rule.
        explicit_gradient: it writes its inner gradient out (an `ExplicitMemoryModel`): an update chunk whose
            reads and surprise share the current weights then runs as one autograd node (:class:`_ChunkStep`).
    """

    memory_function: MemoryFunction
    update_rule: str
    memory_chunk_size: int
    chunks_per_batch: int
    max_surprise_norm: float | None
    max_memory_norm: float | None
    explicit_gradient: bool


class UpdateOp(Protocol):
    """The signature every update op shares (see the module docstring for the arguments)."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, lr2: Tensor, etas: Sequence[Tensor], keeps: Sequence[Tensor],
                 valids: Sequence[Tensor | None], weights: list[Tensor], momentum: list[Tensor],
                 grad_point: list[Tensor], first_chunk: int, settings: UpdateSettings
                 ) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]: ...


# ---- the gradient rule ----


def _clip_scale(grads: Sequence[Tensor], clip: float | None) -> Tensor | None:
    """The clip factor c / max(||G||, c) per row and chunk ([rows, n, 1, 1]; None without a clip)."""
    if clip is None:
        return None
    # vector_norm's backward is safe at 0 (a fully padded chunk), sqrt(sum of squares) would give NaN
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dim=(-2, -1)) for g in grads]), dim=0)
    return (clip / norm.clamp(min=clip))[..., None, None]


def _step(weights, momentum, grads, scale, eta, keep, valid):
    """S_j = eta S_{j-1} - scale G_j, W_j = (1 - alpha) W_{j-1} + S_j; rows without real tokens keep their state."""
    if scale is None:
        new_momentum = [eta * s - g for s, g in zip(momentum, grads)]
    else:
        new_momentum = [torch.addcmul(eta * s, scale, g, value=-1) for s, g in zip(momentum, grads)]
    new_weights = [torch.addcmul(s, keep, w) for w, s in zip(weights, new_momentum)]
    return _keep_rows_without_tokens(new_weights, new_momentum, weights, momentum, valid)


def gradient(q: Tensor, k: Tensor, v: Tensor, lr2: Tensor, etas: Sequence[Tensor], keeps: Sequence[Tensor],
             valids: Sequence[Tensor | None], weights: list[Tensor], momentum: list[Tensor], grad_point: list[Tensor],
             first_chunk: int, settings: UpdateSettings) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """Titans' chunked rule for any memory model, chunk after chunk: the chunks of a memory batch take their
    surprise at one shared point in one call of ``memory_function.surprise``; a chunk whose point is the current
    weights (every chunk when ``chunks_per_batch`` is 1) runs as one fused node when the memory model writes its inner
    gradient out."""
    memory_function, clip = settings.memory_function, settings.max_surprise_norm
    C, m, (BH, N, d) = settings.memory_chunk_size, settings.chunks_per_batch, q.shape
    n_full, L = N // C, len(weights)
    # groups of consecutive full chunks that share one gradient point (the rest of a memory batch)
    groups, i = [], 0
    while i < n_full:
        groups.append(min(n_full - i, m - (first_chunk + i) % m))
        i += groups[-1]
    sizes = [n * C for n in groups] + ([N - n_full * C] if N > n_full * C else [])
    # cut with `split`: one backward node, where slicing zero-fills one full-size gradient per slice
    q_parts, k_parts, v_parts, lr2_parts = (t.split(sizes, dim=1) for t in (q, k, v, lr2))
    fused = settings.explicit_gradient
    qk_parts = None
    if fused and m == 1 and n_full:  # every whole chunk one fused step: its [q; k] block, all cut at once
        whole = lambda t: t[:, :n_full * C].view(BH, n_full, C, d)  # noqa: E731
        qk_parts = torch.cat([whole(q), whole(k)], dim=2).unbind(1)
    reads, chunk = [], 0
    for g, n in enumerate(groups):
        if fused and n == 1 and grad_point is weights:  # the paper's rule: reads and surprise share W_{j-1}
            inputs = (*weights, *momentum, qk_parts[g] if qk_parts else torch.cat([q_parts[g], k_parts[g]], 1),
                      v_parts[g], lr2_parts[g], etas[chunk], keeps[chunk])
            if torch.is_grad_enabled():
                out = _ChunkStep.apply(memory_function, clip, *inputs)
                read, new_weights, new_momentum = out[0], out[1:L + 1], out[L + 1:]
            else:
                read, new_weights, new_momentum = _ChunkStep.step(memory_function, clip,
                                                                  *inputs)[:3]
            reads.append(read)
            weights, momentum = _keep_rows_without_tokens(new_weights, new_momentum, weights, momentum,
                                                          valids[chunk])
        else:
            split = lambda t: t.unflatten(1, (n, C))  # noqa: E731
            grads = memory_function.surprise(grad_point, split(k_parts[g]), split(v_parts[g]),
                                             split(lr2_parts[g]))
            scale = _clip_scale(grads, clip)
            grads = list(zip(*[g_.unbind(1) for g_ in grads]))
            scales = [None] * n if scale is None else scale.unbind(1)
            read_weights = []
            for j in range(n):
                read_weights.append(weights)
                weights, momentum = _step(weights, momentum, grads[j], scales[j], etas[chunk + j], keeps[chunk + j],
                                          valids[chunk + j])
            stacked = [torch.stack(ws, dim=1) for ws in zip(*read_weights)]
            reads.append(memory_function(stacked, split(q_parts[g])).flatten(1, 2))
        chunk += n
        if (first_chunk + chunk) % m == 0:
            grad_point = weights
    if N > n_full * C:  # the unfinished chunk reads the latest weights and waits in the buffer
        reads.append(memory_function(weights, q_parts[-1]))
    return torch.cat(reads, dim=1) if len(reads) > 1 else reads[0], weights, momentum, grad_point


def gradient_linear(q: Tensor, k: Tensor, v: Tensor, lr2: Tensor, etas: Sequence[Tensor], keeps: Sequence[Tensor],
                    valids: Sequence[Tensor | None], weights: list[Tensor], momentum: list[Tensor],
                    grad_point: list[Tensor], first_chunk: int, settings: UpdateSettings
                    ) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """:func:`gradient` for the linear memory ``M_W(z) = z + z W``: its surprise
    ``G_j = (diag(2 theta) K_j)^T (K_j - V_j + K_j W)`` is two products at the gradient point, and its reads are
    linear in the weights, so the scan writes (two products and a few [d, d] operations per update chunk) and the
    reads of all chunks are one product after it."""
    C, m, clip, N = settings.memory_chunk_size, settings.chunks_per_batch, settings.max_surprise_norm, q.shape[1]
    n_full = N // C
    (W,), (S,), (point,) = weights, momentum, grad_point
    whole = lambda t: t[:, :n_full * C].unflatten(1, (n_full, C))  # noqa: E731
    keys = whole(k)
    scaled_keys = (keys * whole(lr2).unsqueeze(-1)).transpose(-1, -2).unbind(1)
    residuals = (keys - whole(v)).unbind(1)
    keys = keys.unbind(1)
    read_weights = []
    for j in range(n_full):
        read_weights.append(W)
        G = torch.bmm(scaled_keys[j], torch.baddbmm(residuals[j], keys[j], point))
        if clip is None:
            new_S = etas[j] * S - G
        else:  # S' = eta S - clip G / max(||G||, clip)
            norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True)
            new_S = torch.addcdiv(etas[j] * S, G, norm.clamp(min=clip), value=-clip)
        (W,), (S,) = _keep_rows_without_tokens([torch.addcmul(new_S, keeps[j], W)], [new_S], [W], [S], valids[j])
        if (first_chunk + j + 1) % m == 0:
            point = W
    reads = _linear_reads(q, read_weights, W, C)
    weights = [W]
    return reads, weights, [S], weights if point is W else [point]


# ---- the delta rule ----


def delta(q: Tensor, k: Tensor, v: Tensor, lr2: Tensor, etas: Sequence[Tensor], keeps: Sequence[Tensor],
          valids: Sequence[Tensor | None], weights: list[Tensor], momentum: list[Tensor], grad_point: list[Tensor],
          first_chunk: int, settings: UpdateSettings) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """The delta rule on the linear memory: every token of update chunk ``j`` takes its step
    ``W += beta_t k_t^T (v_t - k_t - k_t W)`` (``beta = 2 theta``) at the weights the tokens before it left, computed
    chunk-parallel in the WY form: ``U_j = P_j - Q_j W_{j-1}`` with
    ``[P_j, Q_j] = (I + tril(diag(beta) K_j K_j^T, -1))^-1 diag(beta) [V_j - K_j, K_j]`` solved for all chunks at once
    before the loop, then ``W_j = (1 - alpha_j) W_{j-1} + K_j^T U_j`` rescaled to norm ``max_memory_norm`` where it
    exceeds it. The loop holds two products a chunk; the reads of all chunks are one product after it. Momentum and
    the memory batch are not used (momentum stays as it came, the gradient point is the weights)."""
    C, cap, (N, d) = settings.memory_chunk_size, settings.max_memory_norm, q.shape[1:]
    n_full = N // C
    (W,), (S,) = weights, momentum
    whole = lambda t: t[:, :n_full * C].unflatten(1, (n_full, C))  # noqa: E731
    keys, beta = whole(k), whole(lr2).unsqueeze(-1)
    lower = torch.tril(beta * (keys @ keys.transpose(-1, -2)), diagonal=-1)
    lower = lower + torch.eye(C, dtype=lower.dtype, device=lower.device)
    targets = beta * torch.cat([whole(v) - keys, keys], dim=-1)
    P, Q = torch.linalg.solve_triangular(lower, targets, upper=False, unitriangular=True).split(d, dim=-1)
    keys_t, P, Q = keys.transpose(-1, -2).unbind(1), P.unbind(1), Q.unbind(1)
    read_weights = []
    for j in range(n_full):
        read_weights.append(W)
        new_W = torch.addcmul(torch.bmm(keys_t[j], torch.baddbmm(P[j], Q[j], W, alpha=-1)), keeps[j], W)
        norm = torch.linalg.vector_norm(new_W, dim=(-2, -1), keepdim=True)
        new_W = new_W * (cap / norm.clamp(min=cap))
        (W,), _ = _keep_rows_without_tokens([new_W], [S], [W], [S], valids[j])
    reads = _linear_reads(q, read_weights, W, C)
    weights = [W]
    return reads, weights, [S], weights


# ---- the reference ----


def naive(q: Tensor, k: Tensor, v: Tensor, lr2: Tensor, etas: Sequence[Tensor], keeps: Sequence[Tensor],
          valids: Sequence[Tensor | None], weights: list[Tensor], momentum: list[Tensor], grad_point: list[Tensor],
          first_chunk: int, settings: UpdateSettings) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """Any rule (``settings.update_rule``) restated token by token: plain loops over rows and update chunks, each
    whole chunk written by its rule's `reference` (:class:`UpdateRuleOps`), each token's inner gradient
    ``grad_W (lr2 / 2) ||M_W(k_t) - v_t||^2`` by autograd on ``settings.memory_function`` (differentiable when grad
    mode is on).
    The reference the tests hold the other ops to; slow."""
    memory_function, C, m = settings.memory_function, settings.memory_chunk_size, settings.chunks_per_batch
    reference = UPDATE_OPS[settings.update_rule].reference
    rows, N, _ = q.shape
    n_full = N // C

    def token_gradient(point: list[Tensor], t: int, row: int) -> list[Tensor]:
        outer = torch.is_grad_enabled()
        with torch.enable_grad():
            point = [w if w.requires_grad else w.detach().requires_grad_() for w in point]
            error = memory_function(point, k[row, t:t + 1]) - v[row, t:t + 1]
            loss = lr2[row, t] / 2 * error.square().sum()
            return list(torch.autograd.grad(loss, point, create_graph=outer))

    reads, out_weights, out_momentum, out_points = [], [], [], []
    for row in range(rows):
        row_gradient = functools.partial(token_gradient, row=row)
        W, S, P = [w[row] for w in weights], [s[row] for s in momentum], [p[row] for p in grad_point]
        row_reads = []
        for j in range(n_full + (N > n_full * C)):
            tokens = range(j * C, min(j * C + C, N))
            row_reads += [memory_function(W, q[row, t:t + 1]) for t in tokens]
            if len(tokens) < C:
                break
            new_W, new_S = reference(W, S, P, tokens, row_gradient, etas[j][row], keeps[j][row], settings)
            if valids[j] is None or bool(valids[j][row]):
                W, S = new_W, new_S
            if (first_chunk + j + 1) % m == 0:
                P = W
        reads.append(torch.cat(row_reads))
        out_weights.append(W)
        out_momentum.append(S)
        out_points.append(P)
    stack = lambda per_row: [torch.stack(layer) for layer in zip(*per_row)]  # noqa: E731
    new_weights = stack(out_weights)
    # the gradient point is the weights when the last whole chunk refreshed it (or, with none, when it was so before)
    shared = (first_chunk + n_full) % m == 0 if n_full else grad_point is weights
    return torch.stack(reads), new_weights, stack(out_momentum), new_weights if shared else stack(out_points)


class TokenGradient(Protocol):
    """One row's inner gradient of token `t` at the weights `point`, as :func:`naive` gives it to a reference."""

    def __call__(self, point: list[Tensor], t: int) -> list[Tensor]: ...


class ChunkReference(Protocol):
    """A rule token by token on one row's whole update chunk (`tokens`), from its weights, momentum and gradient
    point, with the chunk's momentum gate `eta` and ``keep = 1 - alpha``: the new weights and momentum."""

    def __call__(self, weights: list[Tensor], momentum: list[Tensor], grad_point: list[Tensor], tokens: range,
                 token_gradient: TokenGradient, eta: Tensor, keep: Tensor, settings: UpdateSettings
                 ) -> tuple[list[Tensor], list[Tensor]]: ...


def gradient_reference(weights: list[Tensor], momentum: list[Tensor], grad_point: list[Tensor], tokens: range,
                       token_gradient: TokenGradient, eta: Tensor, keep: Tensor, settings: UpdateSettings
                       ) -> tuple[list[Tensor], list[Tensor]]:
    """The gradient rule on one row's whole update chunk, token by token: the tokens' gradients at the gradient
    point summed, the sum clipped, then momentum and forgetting. Returns the new weights and momentum."""
    clip = settings.max_surprise_norm
    surprise = [torch.zeros_like(w) for w in weights]
    for t in tokens:
        surprise = [s + g for s, g in zip(surprise, token_gradient(grad_point, t))]
    if clip is not None:
        norm = torch.sqrt(sum(s.square().sum() for s in surprise))
        surprise = [s * clip / norm.clamp(min=clip) for s in surprise]
    new_momentum = [eta * s - g for s, g in zip(momentum, surprise)]
    return [keep * w + s for w, s in zip(weights, new_momentum)], new_momentum


def delta_reference(weights: list[Tensor], momentum: list[Tensor], grad_point: list[Tensor], tokens: range,
                    token_gradient: TokenGradient, eta: Tensor, keep: Tensor, settings: UpdateSettings
                    ) -> tuple[list[Tensor], list[Tensor]]:
    """The delta rule on one row's whole update chunk, token by token: each token steps from the weights the tokens
    before it left, then forgetting and the norm cap. Returns the new weights and the momentum as it came."""
    cap = settings.max_memory_norm
    stepped = weights
    for t in tokens:
        stepped = [w - g for w, g in zip(stepped, token_gradient(stepped, t))]
    new_weights = [keep * w + (s - w) for w, s in zip(weights, stepped)]
    norm = torch.sqrt(sum(w.square().sum() for w in new_weights))
    return [w * cap / norm.clamp(min=cap) for w in new_weights], momentum


# ---- the table a memory binds its op from ----


@dataclass
class UpdateRuleOps:
    """One update rule: its settings and its implementations, each an :class:`UpdateOp`.

    Args:
        rule: what the config knows of the rule (:class:`~.update_rules.UpdateRule`: its name, defaults, limits).
        reference: the rule token by token on one row's whole update chunk (:class:`ChunkReference`), which
            :func:`naive` runs.
        torch_op: torch's, for any memory model; None where the rule runs on the linear memory alone.
        linear_op: torch's for the linear memory (``M_W(z) = z + z W``), where the rule has its own.
        kernel: a device kernel that replaces both once set (e.g. ``UPDATE_OPS["delta"].kernel = ...``); None: torch.
    """

    rule: UpdateRule
    reference: ChunkReference
    torch_op: UpdateOp | None = None
    linear_op: UpdateOp | None = None
    kernel: UpdateOp | None = None

    @property
    def name(self) -> str:
        """The rule, as `update_rule` spells it (its key in :data:`UPDATE_OPS`)."""
        return self.rule.name

    def bind(self, linear_memory: bool) -> UpdateOp:
        """The op a memory runs, chosen once when it is built: the kernel, or else torch's (as Qwen3-Next binds
        fla's `chunk_gated_delta_rule or torch_chunk_gated_delta_rule`). A memory other than the linear one
        (`linear_memory` false) is refused with a ValueError where the rule runs on the linear memory alone (no
        `torch_op`): its op would read the weights as that memory's single ``W``."""
        if not linear_memory and self.torch_op is None:
            any_memory = " or ".join(f"update_rule={name!r}" for name, ops in UPDATE_OPS.items()
                                     if ops.torch_op is not None)
            raise ValueError(f"update_rule={self.name!r} needs the linear memory, M_W(z) = z + z W (memory_model="
                             f"'mlp' with memory_depth 1); this memory is another: set memory_depth=1, or "
                             f"{any_memory} for a deeper memory")
        if self.kernel is not None:
            return self.kernel
        return self.linear_op if linear_memory and self.linear_op is not None else self.torch_op


# Every update rule's settings and implementations, by the name `update_rule` gives it (the keys of UPDATE_RULES, the
# config's, in the same order). A rule is its entry in UPDATE_RULES and its line here.
UPDATE_OPS: dict[str, UpdateRuleOps] = {rule.name: rule for rule in (
    UpdateRuleOps(UPDATE_RULES["gradient"], gradient_reference, torch_op=gradient, linear_op=gradient_linear),
    UpdateRuleOps(UPDATE_RULES["delta"], delta_reference, linear_op=delta),
)}


# ---- pieces the ops share ----


def _linear_reads(q: Tensor, read_weights: list[Tensor], W: Tensor, chunk: int) -> Tensor:
    """The linear memory's reads ``q + q W_j`` of queries `q` [rows, N, d]: the whole chunks' with the weights each
    started with (`read_weights`, one [rows, d, d] a chunk) as one batched product, an unfinished chunk's with `W`."""
    rows, N, d = q.shape
    n_full = len(read_weights)
    reads = []
    if n_full:
        queries = q[:, :n_full * chunk].unflatten(1, (n_full, chunk)).flatten(0, 1)
        stacked = torch.stack(read_weights, dim=1).flatten(0, 1)
        reads.append(torch.baddbmm(queries, queries, stacked).view(rows, n_full * chunk, d))
    if N > n_full * chunk:
        rest = q[:, n_full * chunk:]
        reads.append(torch.baddbmm(rest, rest, W))
    return torch.cat(reads, dim=1) if len(reads) > 1 else reads[0]


def _keep_rows_without_tokens(new_weights, new_momentum, weights, momentum, valid: Tensor | None):
    """A chunk without a single real token (padding only) leaves that row's weights and momentum untouched."""
    if valid is None:
        return list(new_weights), list(new_momentum)
    return ([torch.where(valid, n, o) for n, o in zip(new_weights, weights)],
            [torch.where(valid, n, o) for n, o in zip(new_momentum, momentum)])


def _dots(xs: Sequence[Tensor], ys: Sequence[Tensor]) -> Tensor:
    """sum_i <x_i, y_i> per row of [rows, m, n] tensors, as [rows, 1, 1] (vecdot: a batched GEMV is much slower)."""
    total = None
    for x, y in zip(xs, ys):
        dot = torch.linalg.vecdot(x.flatten(1), y.flatten(1))
        total = dot if total is None else total.add_(dot)
    return total.view(-1, 1, 1)


class _ChunkStep(torch.autograd.Function):
    """One update chunk of the gradient rule whose reads and surprise both use the current weights W (every chunk
    under the default ``memory_batch_size = memory_chunk_size``), as a single autograd node: an `ExplicitMemoryModel`'s
    inner gradient, the clip and the update rule, and their reverse.

    Inputs ``(memory_function, clip, *W, *S, [q; k], v, 2 theta, eta, 1 - alpha)``, rows = batch * heads; outputs
    ``(read, *W_new, *S_new)``. Queries and keys go through the memory model as one [2C, d] block. Saves the inputs,
    the error and (with a clip) G; the memory model recomputes its activations in the backward.
    """

    @staticmethod
    def step(memory_function: MemoryFunction, clip: float | None, *tensors: Tensor
             ) -> tuple[Tensor, list[Tensor], list[Tensor], Tensor, list[Tensor], Tensor | None, Tensor | None]:
        """The forward arithmetic: ``(read, W_new, S_new, err, G, ||G||, scale)`` (the last two None without a
        clip). Called directly where no gradient is wanted (no autograd node to build or inputs to save)."""
        L = len(memory_function.shapes)
        W, S = tensors[:L], tensors[L:2 * L]
        qk, values, lr2, eta, keep = tensors[2 * L:]
        reads, err, grads = memory_function.inner_gradient(W, qk, values, lr2, values.shape[1])
        norm = scale = None
        if clip is not None:
            norm = _dots(grads, grads).sqrt_()
            scale = norm.clamp(min=clip).reciprocal_().mul_(clip)  # clip / max(||G||, clip)
            new_S = [torch.addcmul(eta * s, scale, g, value=-1) for s, g in zip(S, grads)]
        else:
            new_S = [torch.sub(eta * s, g) for s, g in zip(S, grads)]
        new_W = [torch.addcmul(s, keep, w) for w, s in zip(W, new_S)]
        return reads, new_W, new_S, err, grads, norm, scale

    @staticmethod
    def forward(ctx, memory_function: MemoryFunction, clip: float | None, *tensors: Tensor
                ) -> tuple[Tensor, ...]:
        L = len(memory_function.shapes)
        reads, new_W, new_S, err, grads, norm, scale = _ChunkStep.step(memory_function, clip, *tensors)
        W, S = tensors[:L], tensors[L:2 * L]
        qk, _, lr2, eta, keep = tensors[2 * L:]
        ctx.memory_function, ctx.clip = memory_function, clip
        ctx.save_for_backward(*W, *S, qk, lr2, eta, keep, err,
                              *((*grads, norm, scale) if clip is not None else ()))
        return (reads, *new_W, *new_S)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_read: Tensor | None, *g_out: Tensor | None) -> tuple[Tensor | None, ...]:
        memory_function, clip = ctx.memory_function, ctx.clip
        L, saved = len(memory_function.shapes), ctx.saved_tensors
        W, S = saved[:L], saved[L:2 * L]
        qk, lr2, eta, keep, err = saved[2 * L:2 * L + 5]
        gW_new = [torch.zeros_like(w) if g is None else g for g, w in zip(g_out[:L], W)]
        gS_new = [torch.zeros_like(s) if g is None else g for g, s in zip(g_out[L:], S)]

        # W' = keep W + S', S' = eta S - scale G
        gS_total = [gs + gw for gs, gw in zip(gS_new, gW_new)]
        gW = [keep * g for g in gW_new]
        g_keep = _dots(gW_new, W)
        gS = [eta * g for g in gS_total]
        g_eta = _dots(gS_total, S)
        if clip is None:
            gG = [-g for g in gS_total]
        else:
            grads, (norm, scale) = saved[2 * L + 5:3 * L + 5], saved[3 * L + 5:]
            gG = [g * -scale for g in gS_total]
            g_scale = _dots(gS_total, grads).neg_()
            # scale = clip / norm where norm > clip: d scale / d G = -clip G / norm^3
            coef = torch.where(norm > clip, g_scale * -clip / norm.clamp(min=clip) ** 3, 0.0)
            gG = [g.addcmul_(coef, G) for g, G in zip(gG, grads)]

        g_qk, g_values, g_lr2 = memory_function.inner_gradient_backward(W, qk, err, lr2, err.shape[1], g_read, gG,
                                                                        gW)
        return (None, None, *gW, *gS, g_qk, g_values, g_lr2, g_eta, g_keep)
